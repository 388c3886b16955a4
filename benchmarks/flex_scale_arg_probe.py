"""Host cost of passing ``scale`` as a Python float to a compiled flex_attention, against None
(flex's own default, the same 1/sqrt(D)), on the CPU with a tiny problem whose kernel is
negligible. Interleaved rounds, median per round, best round per variant.

    python benchmarks/flex_scale_arg_probe.py      # -> results/flex_scale_arg_probe_cpu.txt
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

torch.set_num_threads(1)
q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
bm = create_block_mask(lambda b, h, i, j: i >= j, None, None, 64, 64, device="cpu")
flex = torch.compile(flex_attention)
variants = {
    "scale=None": lambda: flex(q, k, v, block_mask=bm, scale=None),
    "scale=0.25 (float)": lambda: flex(q, k, v, block_mask=bm, scale=0.25),
}


def median_us(fn, n: int = 400) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


for fn in variants.values():
    for _ in range(50):
        fn()
best = {name: float("inf") for name in variants}
for _ in range(8):
    for name, fn in variants.items():
        best[name] = min(best[name], median_us(fn))
print(f"# torch {torch.__version__}, CPU, 1 thread, B=1 H=2 L=64 D=16 causal; best of 8 rounds")
for name, us in best.items():
    print(f"{name:20s} {us:7.1f} us per call")
