"""Host time of a plan-cache hit of ``fz.attention`` on a tiny CPU problem, next to the SDPA call it
wraps: interleaved rounds (each round times every call in turn, so a noisy host moves them alike),
median microseconds per call.

* ``raw sdpa``: ``F.scaled_dot_product_attention(is_causal=True)``, SDPA's own kernel choice;
* ``pin sdpa``: the same under the kernel pin the CPU route sets (``_compat.pin_sdpa_kernel``);
* ``fz causal``: ``fz.attention(q, k, v, mask="causal")`` (a hit);
* ``noop``: ``fz.attention`` whose cached bound call is replaced by a no-op (the dispatcher alone);
* ``key+lookup``: ``plan_cache.call_key`` and ``plan_cache.lookup`` of a ``Causal()`` spec;
* on 1x2x64x16, each beside its plain SDPA call: ``fz Causal()``, a ``masks.Causal()`` built anew
  for every call (its own baseline ``raw sdpa 64``), and ``fz prefix``, one query over a cache
  prefix whose length cycles over 64 values, all of them cached (baseline ``sdpa prefix``).

Reported per call: the median over rounds and the best round (the host's floor).

Compare trees by running it in each, alternately, a few times:

    PYTHONPATH=. python benchmarks/hit_path_probe.py [--rounds 30] [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import flexattn_zoo as fz
from flexattn_zoo import _compat, masks, plan_cache


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--calls", type=int, default=200)
    a = p.parse_args()
    torch.set_num_threads(1)
    q, k, v = (torch.randn(1, 2, 16, 16) for _ in range(3))
    causal = masks.Causal()
    fz.attention(q, k, v, mask=causal)
    fz.attention(q, k, v, mask="causal")
    det = _compat.strict_deterministic_mode()

    def key() -> Any:
        return plan_cache.call_key(q, k, v, causal, None, False, False, det, "auto")

    hit = plan_cache.lookup(key(), q, k, v)
    assert hit is not None, "no plan-cache hit: the probe's key differs from the dispatcher's"
    # A route that returns at once: what remains is the dispatcher. (This entry serves ``Causal()``
    # only; the ``"causal"`` string keys its own entry.)
    hit.run = lambda q_, k_, v_, scale: (q_, None)
    kernel = plan_cache.lookup(
        plan_cache.call_key(q, k, v, "causal", None, False, False, det, "auto"), q, k, v
    )
    pin = kernel.plan.backend.removeprefix("sdpa_").upper() + "_ATTENTION"

    def pinned() -> torch.Tensor:
        token = _compat.pin_sdpa_kernel((pin,))
        try:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        finally:
            _compat.restore_sdpa_kernels(token)

    # Other shapes than the no-op entry's, so a new Causal() per call keys an entry of its own.
    q6, k6, v6 = (torch.randn(1, 2, 64, 16) for _ in range(3))
    k_cache, v_cache = (torch.randn(1, 2, 256, 16) for _ in range(2))
    q1 = torch.randn(1, 2, 1, 16)
    step = [0]

    def live() -> int:
        step[0] += 1
        return 128 + step[0] % 64

    calls: dict[str, Callable[[], Any]] = {
        "raw sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "pin sdpa": pinned,
        "fz causal": lambda: fz.attention(q, k, v, mask="causal"),
        "noop": lambda: fz.attention(q, k, v, mask=causal),
        "key+lookup": lambda: plan_cache.lookup(key(), q, k, v),
        "raw sdpa 64": lambda: F.scaled_dot_product_attention(q6, k6, v6, is_causal=True),
        "fz Causal()": lambda: fz.attention(q6, k6, v6, mask=masks.Causal()),
        "sdpa prefix": lambda: F.scaled_dot_product_attention(
            q1, k_cache[:, :, : (n := live())], v_cache[:, :, :n]
        ),
        "fz prefix": lambda: fz.attention(q1, k_cache[:, :, : (n := live())], v_cache[:, :, :n]),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        for _ in range(300):
            call()
    for _ in range(a.rounds):
        for name, call in calls.items():
            t0 = time.perf_counter()
            for _ in range(a.calls):
                call()
            times[name].append((time.perf_counter() - t0) / a.calls * 1e6)
    print(
        f"# torch {torch.__version__}, CPU, 1x2x16x16 float32, route {kernel.plan.backend}, us per call: "
        "median, best round"
    )
    for name, ts in times.items():
        print(f"{name:<12} {statistics.median(ts):7.2f} {min(ts):7.2f}")
    best = {name: min(ts) for name, ts in times.items()}
    print(
        f"# best round over its baseline: fz causal {best['fz causal'] - best['raw sdpa']:+.2f}, "
        f"fz Causal() {best['fz Causal()'] - best['raw sdpa 64']:+.2f}, "
        f"fz prefix {best['fz prefix'] - best['sdpa prefix']:+.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
