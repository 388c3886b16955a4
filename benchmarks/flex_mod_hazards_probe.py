"""Which mods written for flex's 0-d index semantics torch's *compiled* flex kernel runs, per device.

torch's eager ``flex_attention`` evaluates a mod under ``torch.vmap`` and runs every mod below; the
compiled kernel lowers the mod into a pointwise subgraph, where some ops cannot be generated. This
probe runs each mod through ``torch.compile(flex_attention)`` with a BlockMask from
``create_block_mask``, without flexattn_zoo, and compares the output with eager flex (vmap), so
the library's refusals (``functions.REDUCES``, ``functions.READS_GATHERED_ROW``) can name the
devices they hold on. Each mod runs in its own process: a gathered row read out of bounds can abort
the process (a corrupted heap), which is itself the verdict.

    python benchmarks/flex_mod_hazards_probe.py --device cpu
    python benchmarks/flex_mod_hazards_probe.py --device cuda
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

L, D = 128, 16


def mods(device: str) -> dict[str, tuple[str, Callable[..., Any]]]:
    starts = torch.tensor([0, 40, 90], device=device)
    table = torch.rand(L, L, device=device) > 0.3
    bounds = torch.tensor([[0, 60], [30, 128]], device=device)
    image = (torch.arange(L, device=device) >= 64).long()
    return {
        "reduce_captured_row": (
            "mask",
            lambda b, h, q, k: ((starts <= q).sum() == (starts <= k).sum()) & (q >= k),
        ),
        "reduce_0d_index": ("mask", lambda b, h, q, k: (q - k).abs().amax() <= 8),
        "sum_0d_index": ("mask", lambda b, h, q, k: q.sum() >= k),
        "stack_then_amax": ("mask", lambda b, h, q, k: torch.stack([q, k]).amax() <= q),
        "gathered_row": ("mask", lambda b, h, q, k: table[q][k]),
        "gathered_interval": (
            "mask",
            lambda b, h, q, k: (q >= bounds[image[k]][0]) & (q < bounds[image[k]][1]),
        ),
        "one_index": ("mask", lambda b, h, q, k: table[q, k]),
        "maximum": ("mask", lambda b, h, q, k: torch.maximum(q, k) <= q),
        "score_reduce_0d": ("score", lambda s, b, h, q, k: s + (q - k).abs().sum() * 0.01),
        "searchsorted": (
            "mask",
            lambda b, h, q, k: (
                torch.searchsorted(starts, q, right=True) == torch.searchsorted(starts, k, right=True)
            ),
        ),
        # Element-by-element ops the library lets every flex route run (functions._ELEMENTWISE).
        "floor_divide": ("mask", lambda b, h, q, k: torch.floor_divide(q, 16) == torch.floor_divide(k, 16)),
        "remainder": ("mask", lambda b, h, q, k: (q % 7 == k % 7) | (q == k)),
        "where_scalars": ("mask", lambda b, h, q, k: torch.where(q >= k, 1, 0) > 0),
        "to_float": ("mask", lambda b, h, q, k: (q.float() - k.float()).abs() <= 8.5),
        "full_like": ("mask", lambda b, h, q, k: torch.full_like(q, 5) + k <= q + 5),
        "score_table_one_index": (
            "score",
            lambda s, b, h, q, k: s + table[q, k].to(s.dtype) * 0.5,
        ),
        "bucketize": (
            "mask",
            lambda b, h, q, k: (
                torch.bucketize(q, starts, right=True) == torch.bucketize(k, starts, right=True)
            ),
        ),
    }


def probe(device: str, name: str) -> None:
    kind, fn = mods(device)[name]
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, L, D, device=device) for _ in range(3))
    kw: dict[str, Any] = (
        {"block_mask": create_block_mask(fn, 1, 2, L, L, device=device)}
        if kind == "mask"
        else {"score_mod": fn}
    )
    expected = flex_attention(q, k, v, **kw)
    try:
        got = torch.compile(flex_attention)(q, k, v, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        verdict = f"runs, max |compiled - eager| = {(got - expected).abs().max().item():.2e}"
    except Exception as exc:  # noqa: BLE001 - the verdict is the point
        verdict = f"fails: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    print(f"{name:22s} {verdict}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", help="one mod, in this process (the parent runs each this way)")
    args = ap.parse_args()
    if args.only:
        probe(args.device, args.only)
        return
    print(f"torch {torch.__version__}, device {args.device}", flush=True)
    for name in mods("cpu"):
        run = subprocess.run(
            [sys.executable, __file__, "--device", args.device, "--only", name],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        lines = [line for line in run.stdout.splitlines() if line.startswith(name)]
        print(
            lines[-1] if lines else f"{name:22s} the process ended with code {run.returncode} (no verdict)",
            flush=True,
        )


if __name__ == "__main__":
    main()
