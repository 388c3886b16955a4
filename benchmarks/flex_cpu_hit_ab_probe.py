"""Host time of a plan-cache hit of ``fz.attention(backend="flex_cpu")`` on a tiny CPU problem
(1x2x64x16, ``SlidingWindow(left=16)``): minimum and median over 30 rounds of 300 calls, in us.
Run it in two trees alternately to compare them:

    PYTHONPATH=. python benchmarks/flex_cpu_hit_ab_probe.py
"""

from __future__ import annotations

import statistics
import time

import torch

import flexattn_zoo as fz
from flexattn_zoo import masks


def main() -> None:
    torch.set_num_threads(1)
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    mask = masks.SlidingWindow(left=16)
    for _ in range(100):
        fz.attention(q, k, v, mask=mask, backend="flex_cpu")
    rounds = []
    for _ in range(30):
        start = time.perf_counter()
        for _ in range(300):
            fz.attention(q, k, v, mask=mask, backend="flex_cpu")
        rounds.append((time.perf_counter() - start) / 300 * 1e6)
    print(f"{min(rounds):.1f} {statistics.median(rounds):.1f}")


if __name__ == "__main__":
    main()
