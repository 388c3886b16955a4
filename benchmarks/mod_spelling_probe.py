"""Score-mod and mask-mod spellings on the FA4 CuTe route (flex_flash) and Triton flex, side by side.

Issue 4's softcap and ALiBi goals are far above what flex_flash reached (softcap 334 / 378 with the
exact ``torch.tanh``, ALiBi 528 / 537, causal alone 668 / 555 TFLOP/s). Inductor lowers a score_mod
op by op into CuTe DSL: ``torch.tanh`` becomes ``cute.math.tanh`` (the exact libdevice tanh), while
``exp2`` and ``rsqrt`` become the hardware approximations. This probe times spellings of the same
function, one process, median of timed runs (CUDA events), bf16, B=4 H=16 L=8192 D=128, causal:

- softcap 30: ``tanh`` (exact), ``exp2_rsqrt`` (``1 - 2 r^2`` with ``r = rsqrt(2^(2x log2 e) + 1)``:
  two hardware approximations, no division), ``exp2_div`` (``1 - 2 / (2^(2x log2 e) + 1)``);
- ALiBi: the library's ``Alibi`` (slope ``exp2`` of an affine function of ``h``; ``|i - j|`` until
  7d9ad13, since then ``i - j`` under this causal mask), ``noabs`` (``i - j``: under a causal mask
  every visible pair has ``i >= j``), and ``const``
  (one slope for every head; not ALiBi, the cost of the slope computation's absence);
- documents (lengths 256-2048, as the h200 sweep) & causal: the library's ``Document & Causal``
  (``ids[q] == ids[kv]`` and ``kv <= q``; int64 labels when this group first ran, int32 since
  eefbe3f), the same on int32 ids and on int64 ids, and
  ``starts[q] <= kv <= q`` (one lookup per query row instead of two per pair; exact for
  contiguous documents);
- per-row prefix-LM lengths (a ``[B]`` tensor): the library's ``PrefixLM`` (int64 lengths) against
  the same rule on int32 lengths (no difference measured, so PrefixLM keeps int64).

Each variant's output and gradients are compared with the first variant of its group. The first
run (before ``documents`` existed) was ``python benchmarks/flash_scoremod_probe.py --iters 20``.

    python benchmarks/mod_spelling_probe.py            # CUDA GPU with flash-attn-4 importable
    python benchmarks/mod_spelling_probe.py --small --routes dense --iters 3   # checks it runs
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import torch

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.bench.config import document_lengths
from flexattn_zoo.bench.timing import measure, visible_pairs

CAP = 30.0
K2 = 2.0 * math.log2(math.e) / CAP  # tanh(s / cap) from 2^(s * K2)


def softcap_tanh(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
    return CAP * torch.tanh(score * (1.0 / CAP))


def softcap_exp2_rsqrt(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
    r = torch.rsqrt(torch.exp2(score * K2) + 1.0)
    return CAP - (2.0 * CAP) * (r * r)


def softcap_exp2_div(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
    return CAP - (2.0 * CAP) / (torch.exp2(score * K2) + 1.0)


def alibi_variants(heads: int) -> dict[str, Any]:
    log2_step = -8.0 / heads  # power-of-two head counts only (the probe's 16)

    def noabs(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        slope = torch.exp2(h.to(torch.float32) * log2_step + log2_step)
        return score - slope * (q_idx - kv_idx).to(torch.float32)

    def const(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return score - 0.0625 * (q_idx - kv_idx).to(torch.float32)

    return {
        "alibi (library)": ("causal", score_mods.Alibi(num_heads=heads)),
        "alibi noabs": ("causal", noabs),
        "alibi const": ("causal", const),
    }


def document_variants(length: int, device: torch.device) -> dict[str, Any]:
    lo, hi = (16, 64) if length < 1024 else (256, 2048)
    lengths = document_lengths(length, lo, hi, seed=0)
    library = masks.Document.from_lengths(lengths).to(device) & masks.Causal()
    ids = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device)
    )
    ids32 = ids.to(torch.int32)
    starts = torch.tensor([0, *lengths[:-1]], device=device).cumsum(0).to(torch.int32)
    starts = torch.repeat_interleave(starts, torch.tensor(lengths, device=device))

    def ids_int32(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (ids32[q_idx] == ids32[kv_idx]) & (kv_idx <= q_idx)

    def ids_int64(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (ids[q_idx] == ids[kv_idx]) & (kv_idx <= q_idx)

    def row_start(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (kv_idx >= starts[q_idx]) & (kv_idx <= q_idx)

    return {
        "Document & Causal": (library, None),
        "int32 ids": (ids_int32, None),
        "int64 ids": (ids_int64, None),
        "row start": (row_start, None),
    }


def prefix_variants(batch: int, length: int, device: torch.device) -> dict[str, Any]:
    # A different prefix per batch row (a tensor, looked up with b); the h200 sweep's prefix_lm
    # case has one int prefix, which the kernels see as a constant.
    lengths = torch.tensor([length // 4, length // 8, length // 2, length // 16][:batch], device=device)
    library = masks.PrefixLM(prefix_len=lengths)
    prefix32 = lengths.to(torch.int32)

    def int32_lengths(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (kv_idx < prefix32[b]) | (kv_idx <= q_idx)

    return {"PrefixLM([B])": (library, None), "int32 lengths": (int32_lengths, None)}


def compare(name: str, run: Callable[[], Any], ref: tuple[torch.Tensor, ...]) -> None:
    got = run()
    errs = [(g.float() - r.float()).abs().max().item() for g, r in zip(got, ref, strict=True)]
    print(
        f"    {name:<22} max |diff| vs first: out {errs[0]:.2e}  dq {errs[1]:.2e}  dk {errs[2]:.2e}  dv {errs[3]:.2e}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny sizes")
    p.add_argument("--routes", default="flex_flash,flex")
    p.add_argument("--modes", default="fwd,fwdbwd")
    p.add_argument("--only", default="softcap,alibi,document,prefix")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--head-dim", type=int, default=128, help="D (default 128, as the probe's first runs)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b, h, length, d = (1, 2, 256, 64) if args.small else (4, 16, 8192, args.head_dim)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(b, h, length, d, device=device, dtype=dtype, generator=g).requires_grad_() for _ in "qkv"
    )
    grad_out = torch.randn(q.shape, device=device, dtype=dtype, generator=g)
    groups: dict[str, dict[str, Any]] = {
        "softcap": {
            "tanh (exact)": ("causal", softcap_tanh),
            "exp2_rsqrt": ("causal", softcap_exp2_rsqrt),
            "exp2_div": ("causal", softcap_exp2_div),
        },
        "alibi": alibi_variants(h),
        "document": document_variants(length, device),
        "prefix": prefix_variants(b, length, device),
    }
    print(
        f"{torch.__version__}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; "
        f"{b}x{h}x{length}x{d} {dtype}, causal",
        flush=True,
    )
    for group in args.only.split(","):
        first_mask = next(iter(groups[group].values()))[0]
        spec = masks.Causal() if first_mask == "causal" else first_mask
        flops = 4.0 * visible_pairs(spec, length, b, h, device) * d
        for route in args.routes.split(","):
            print(f"{group} on {route}", flush=True)

            def call(mod: Any, route: str = route) -> torch.Tensor:
                return fz.attention(q, k, v, mask=mod[0], score_mod=mod[1], backend=route)

            ref: tuple[torch.Tensor, ...] | None = None
            for name, mod in groups[group].items():

                def fwdbwd(mod: Any = mod) -> tuple[torch.Tensor, ...]:
                    out = call(mod)
                    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))

                try:
                    if ref is None:
                        ref = tuple(t.detach() for t in fwdbwd())
                    else:
                        compare(name, fwdbwd, ref)
                except Exception as exc:  # a route that refuses a variant: report, go on
                    print(f"    {name:<22} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                    continue
                for mode in args.modes.split(","):

                    def step(mod: Any = mod, mode: str = mode) -> Any:
                        if mode == "fwd":
                            with torch.no_grad():
                                return call(mod)
                        return fwdbwd(mod)

                    t = measure(step, device, warmup=3, iters=args.iters)
                    f = flops * (3.5 if mode == "fwdbwd" else 1.0)
                    print(
                        f"  {name:<22} {mode:<6} {t.median_ms:8.3f} ms {f / t.median_ms / 1e9:7.1f} TFLOP/s"
                        f"  (first call {t.first_s:.1f} s)",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
