"""CUDA, FA4 installed: score-mod spellings on torch's FLASH-backend flex (FA4's CuTe kernel) against
Triton flex on the same inputs: which ops the CuTe lowering computes wrongly. Prints each
spelling's max abs difference (bf16, B=2 H=4 L=256 D=64, no mask). Arguments: spellings to run."""

from __future__ import annotations

import sys

import torch
from torch.nn.attention.flex_attention import flex_attention

SLOPES = (0.25, 0.0625, 0.015625, 0.00390625)
SLOPE_TABLE = torch.tensor(SLOPES)  # moved to the GPU in main()


def where_chain_from_zeros(h):
    out = torch.zeros_like(h, dtype=torch.float32)
    for i, s in enumerate(SLOPES):
        out = torch.where(h == i, torch.full_like(out, s), out)
    return out


def where_chain_from_full(h):
    out = torch.full_like(h, SLOPES[0], dtype=torch.float32)
    for i in range(1, len(SLOPES)):
        out = torch.where(h == i, SLOPES[i], out)
    return out


MODS = {
    "linear_const": lambda s, b, h, q, k: s - 0.01 * (q - k),
    "int_square_const": lambda s, b, h, q, k: s - 0.01 * ((q - k) * (q - k)),
    "float_square_const": lambda s, b, h, q, k: s - 0.01 * ((q - k).float() * (q - k).float()),
    "int_square_to_float": lambda s, b, h, q, k: s - 0.01 * ((q - k) * (q - k)).to(torch.float32),
    "zeros_where_slope": lambda s, b, h, q, k: s - where_chain_from_zeros(h),
    "full_where_slope": lambda s, b, h, q, k: s - where_chain_from_full(h),
    "zeros_where_linear": lambda s, b, h, q, k: s - where_chain_from_zeros(h) * (q - k),
    "zeros_where_int_square": lambda s, b, h, q, k: s - where_chain_from_zeros(h) * ((q - k) * (q - k)),
    "full_where_int_square": lambda s, b, h, q, k: s - where_chain_from_full(h) * ((q - k) * (q - k)),
    "full_where_float_square": lambda s, b, h, q, k: (
        s - where_chain_from_full(h) * ((q - k).float() * (q - k).float())
    ),
    "abs_diff": lambda s, b, h, q, k: s - 0.01 * (q - k).abs(),
    "int_square_small": lambda s, b, h, q, k: s - 0.0001 * ((q - k) * (q - k)),
    "full_where_times_float_linear": lambda s, b, h, q, k: s - where_chain_from_full(h) * (q - k).float(),
    "full_where_times_abs_float": lambda s, b, h, q, k: s - where_chain_from_full(h) * (k - q).abs().float(),
    "full_where_times_int_linear": lambda s, b, h, q, k: s - where_chain_from_full(h) * (q - k),
    "h_times_float_linear": lambda s, b, h, q, k: s - 0.01 * h.float() * (q - k).float(),
    "h_times_float_square": lambda s, b, h, q, k: s - 0.01 * h.float() * ((q - k) * (q - k)).float(),
    "large_const_square": lambda s, b, h, q, k: s - 0.25 * ((q - k) * (q - k)).float(),
    "full_where_plus_float_linear": lambda s, b, h, q, k: (
        s + where_chain_from_full(h) + 0.01 * (q - k).float()
    ),
    # respellings of a per-head constant times an index term (ALiBi with given slopes)
    "table_slope_times_linear": lambda s, b, h, q, k: s - SLOPE_TABLE[h] * (q - k).float(),
    "indicator_sum_times_linear": lambda s, b, h, q, k: s - indicator_sum(h) * (q - k).float(),
    "where_of_products": lambda s, b, h, q, k: s - where_of_products(h, (q - k).float()),
}


def indicator_sum(h):
    return sum((h == i).to(torch.float32) * s for i, s in enumerate(SLOPES))


def where_of_products(h, term):
    out = SLOPES[0] * term
    for i in range(1, len(SLOPES)):
        out = torch.where(h == i, SLOPES[i] * term, out)
    return out


def main() -> None:
    global SLOPE_TABLE
    SLOPE_TABLE = torch.tensor(SLOPES, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g) * 0.5 for _ in range(3)
    )
    torch._dynamo.config.recompile_limit = 10_000  # one compile per spelling, none run eagerly
    compiled = torch.compile(flex_attention)
    only = set(sys.argv[1:])  # spellings to run (default: all)
    for name, mod in MODS.items():
        if only and name not in only:
            continue
        torch._dynamo.reset()
        want = compiled(q, k, v, score_mod=mod)
        try:
            got = compiled(q, k, v, score_mod=mod, kernel_options={"BACKEND": "FLASH"})
            diff = (got.float() - want.float()).abs().max().item()
            print(f"{name}: FLASH vs Triton max abs diff {diff:.3e}", flush=True)
        except Exception as exc:  # noqa: BLE001 - a probe: report and go on
            print(f"{name}: FLASH failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)


if __name__ == "__main__":
    main()
