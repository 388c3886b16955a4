"""Triton flex through the library on pair-loaded score mods (a value read per query-key pair from
a captured tensor): the library's own pipeline choice (torch's default forward pipeline tried
first eagerly, or two stages first for positional gathers, ``Spec.pair_gathers``) against two
stages forced by the caller, side by side in one process.

For each score mod's ``typical_example`` (Graphormer's gathered table, a dense ``[B|1, H, L, L]``
bias, T5's bucketed table, Sandwich) under a causal mask, at each head dim and length: forward
median ms (``tuning.timing.time_routes``: rotated rounds, warmed up), the first call's seconds
(compiles, and for the library's call a failed compile where the defaults run out of shared
memory), and the kernel options the route's prepared call ended with after such a retry. (Before
positional gathers started on two stages, the first column was "default first" for every mod.)

    PYTHONPATH=. python benchmarks/pair_load_probe.py [--lengths 1024 4096] [--head-dims 64 128]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo.backends import flex as flex_backend
from flexattn_zoo.registry import SCORES
from flexattn_zoo.tuning.timing import time_routes


def _call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kw: dict[str, Any]) -> Any:
    return lambda: fz.attention(q, k, v, **kw)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--mods", nargs="+", default=["graphormer", "bias", "rel_pos_bias", "sandwich"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    a = p.parse_args()
    dev = torch.device("cuda")
    print(
        f"# torch {torch.__version__}, {torch.cuda.get_device_name()}, B={a.batch} H={a.heads} bf16, causal"
    )
    for name in a.mods:
        for d in a.head_dims:
            for n in a.lengths:
                spec = SCORES.find(name).factory.typical_example(n, n, a.batch, a.heads).to(dev)  # type: ignore[union-attr]
                g = torch.Generator(device=dev).manual_seed(0)
                q, k, v = (
                    torch.randn(a.batch, a.heads, n, d, device=dev, dtype=torch.bfloat16, generator=g)
                    for _ in range(3)
                )
                kw: dict[str, Any] = {"mask": masks.Causal(), "score_mod": spec, "backend": "flex"}
                flex_backend.CALLS.clear()
                steps = {
                    "library": _call(q, k, v, kw),
                    "2 stages": _call(q, k, v, {**kw, "kernel_options": {"fwd_num_stages": 2}}),
                }
                with torch.no_grad():
                    res = time_routes(steps, dev, warmup=5, reps=30)
                ended = [c.held[2] for c in flex_backend.CALLS.values() if c.fallbacks]
                cells = []
                for label, r in res.items():
                    cells.append(
                        f"{label} {r!r:.60}"
                        if isinstance(r, Exception)
                        else f"{label} {r[0]:.3f} ms (first {r[1]:.1f} s)"
                    )
                print(
                    f"{name:13s} D={d:<3d} L={n:<5d} "
                    + " | ".join(cells)
                    + f" | retried calls ended on {ended}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
