"""Where ``fz.attention(q1, cache[:, :, :n])`` spends its host time beyond plain SDPA's, piece by
piece, side by side in one process (host_cost.py's decode case: one query over cache prefixes
whose length cycles over 64 values).

Under cProfile the SDPA call itself took longer when the library made it (26.5 vs 21 us per
call on an H100), so each variant below adds one thing the route does to the plain call:

* ``plain``: ``F.scaled_dot_product_attention(q1, k[:, :, :n], v[:, :, :n])``;
* ``scale``: the same with ``scale=`` given (the route passes the problem's default scale);
* ``pinned``: the same with SDPA's enable flags set as the route sets them once cuDNN joins the
  choice (``_compat.pin_sdpa_kernel`` of the route's kernels, restored after);
* ``bound``: the route's bound call of the plan-cache entry (``hit.run``), no key, no lookup;
* ``fz``: ``fz.attention`` as a user calls it.

Host time per call: ``perf_counter`` around the call without a synchronize, rounds alternating
the variants, the queue drained between chunks (as host_cost.py).

    python benchmarks/sdpa_decode_host_probe.py --device cuda
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
from flexattn_zoo import _compat, plan_cache
from flexattn_zoo.backends import BY_NAME
from flexattn_zoo.backends.sdpa import SDPA_LOCK


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="1,8,512,64", help="B,H,L,D: a cache of 4L, prefixes of 2L + (0..63)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--chunk", type=int, default=64)
    args = ap.parse_args()
    device = torch.device(args.device)
    b, h, length, d = (int(x) for x in args.shape.split(","))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(b, h, 4 * length, d, generator=gen).to(device, dtype) for _ in range(2))
    q1 = torch.randn(b, h, 1, d, generator=gen).to(device, dtype)
    lengths = [2 * length + i for i in range(64)]
    scale = d**-0.5

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    # Each length's plan-cache entry, bound call and the kernels it pins once cuDNN joins.
    hits = {}
    for n in lengths:
        for _ in range(3):  # the bound call's second call lets cuDNN in; its third runs it
            fz.attention(q1, k_cache[:, :, :n], v_cache[:, :, :n])
        k, v = k_cache[:, :, :n], v_cache[:, :, :n]
        key = plan_cache.call_key(q1, k, v, None, None, False, False, False, "auto")
        hits[n] = plan_cache.lookup(key, q1, k, v)
    first = next(iter(hits.values()))
    route = BY_NAME[first.plan.backend]
    kernels = route.repeated_shape_kernels(first.plan.problem)
    print(f"route {first.plan.backend}; kernels once the shape repeats: {kernels}")

    def plain(n: int) -> Any:
        return F.scaled_dot_product_attention(q1, k_cache[:, :, :n], v_cache[:, :, :n])

    def with_scale(n: int) -> Any:
        return F.scaled_dot_product_attention(q1, k_cache[:, :, :n], v_cache[:, :, :n], scale=scale)

    def pinned(n: int) -> Any:
        if kernels is None:
            return with_scale(n)
        with SDPA_LOCK:
            token = _compat.pin_sdpa_kernel(kernels)
            try:
                return F.scaled_dot_product_attention(q1, k_cache[:, :, :n], v_cache[:, :, :n], scale=scale)
            finally:
                _compat.restore_sdpa_kernels(token)

    def bound(n: int) -> Any:
        hit = hits[n]
        return hit.run(q1, k_cache[:, :, :n], v_cache[:, :, :n], hit.scale)

    def ours(n: int) -> Any:
        return fz.attention(q1, k_cache[:, :, :n], v_cache[:, :, :n])

    variants: dict[str, Callable[[int], Any]] = {
        "plain": plain,
        "scale": with_scale,
        "pinned": pinned,
        "bound": bound,
        "fz": ours,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():  # warm-up: every length once more
        for n in lengths:
            fn(n)
    sync()
    names = list(variants)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            fn = variants[name]
            for i in range(args.chunk):
                n = lengths[(r * args.chunk + i) % len(lengths)]
                t0 = time.perf_counter()
                fn(n)
                times[name].append((time.perf_counter() - t0) * 1e6)
            sync()
    base = statistics.median(times["plain"])
    card = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{torch.__version__}, {card}, shape {args.shape}")
    print(f"{'variant':8s} {'median us':>10s} {'p10':>8s} {'p90':>8s} {'- plain':>8s}")
    for name in names:
        ts = sorted(times[name])
        med = statistics.median(ts)
        p10, p90 = ts[len(ts) // 10], ts[(9 * len(ts)) // 10]
        print(f"{name:8s} {med:10.1f} {p10:8.1f} {p90:8.1f} {med - base:+8.1f}")


if __name__ == "__main__":
    main()
