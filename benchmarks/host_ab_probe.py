"""``fz.attention``'s host time over plain SDPA on a tiny CPU problem, for comparing two trees:
run it in each checkout, alternately, a few times.

Three calls, each against its SDPA baseline in the same process (B=1 H=2 L=64 D=16 float32, one
thread): ``mask="causal"``, a ``masks.Causal()`` built anew per call, and one query over a cache
prefix whose length cycles over 64 values (the plan cache holds them all). Every call is a
plan-cache hit after the warm-up. Rounds visit each call in turn, 100 calls per round; reported is
the best round's time per call (the host's floor: its caches warm, no preemption), as the
difference to the baseline in us.

    for t in OLD NEW; do (cd $t && PYTHONPATH=. python benchmarks/host_ab_probe.py); done
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import flexattn_zoo as fz
from flexattn_zoo import masks


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=gen) for _ in range(3))
    k_cache, v_cache = (torch.randn(1, 2, 256, 16, generator=gen) for _ in range(2))
    q1 = torch.randn(1, 2, 1, 16, generator=gen)
    step = [0]

    def live() -> int:
        step[0] += 1
        return 128 + step[0] % 64

    cases = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "causal": lambda: fz.attention(q, k, v, mask="causal"),
        "new spec": lambda: fz.attention(q, k, v, mask=masks.Causal()),
        "sdpa prefix": lambda: F.scaled_dot_product_attention(
            q1, k_cache[:, :, : (n := live())], v_cache[:, :, :n]
        ),
        "prefix": lambda: fz.attention(q1, k_cache[:, :, : (n := live())], v_cache[:, :, :n]),
    }
    for call in cases.values():
        for _ in range(300):
            call()
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(60):
        for name, call in cases.items():
            t0 = time.perf_counter()
            for _ in range(100):
                call()
            best[name] = min(best[name], (time.perf_counter() - t0) / 100 * 1e6)
    print(
        f"causal {best['causal'] - best['sdpa']:+.2f} us, new spec {best['new spec'] - best['sdpa']:+.2f}, "
        f"prefix {best['prefix'] - best['sdpa prefix']:+.2f} (sdpa {best['sdpa']:.2f}, "
        f"sdpa prefix {best['sdpa prefix']:.2f})"
    )


if __name__ == "__main__":
    main()
