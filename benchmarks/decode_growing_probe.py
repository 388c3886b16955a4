"""One-query decoding over a KV cache that grows by one token per step, as generation runs it:
every step meets a cache length it has never seen. Times each step (wall, device synchronized)
for plain SDPA on the live prefix with torch's own kernel choice, the same with cuDNN disabled,
``fz.decode.decode_step`` with an int ``cache_len`` and ``fz.attention`` on the same slices;
median over the steps after a warm-up.

With ``--profile N``: after the timings, cProfile of N more growing steps of ``fz.attention`` with
``backend="auto"``, with each of ``--routes``, and of ``fz.decode.decode_step`` (host functions by
own time, microseconds per step), to show where a plan-cache miss spends its host time.

    PYTHONPATH=. python benchmarks/decode_growing_probe.py [--steps 200] [--batch 8] [--start 4000] [--routes sdpa,fa4]
    PYTHONPATH=. python benchmarks/decode_growing_probe.py --device cpu --batch 1 --heads 8:8 --head-dim 64 --start 1000 --steps 1000

On the CPU (float32, one thread) every step includes its kernel, and the planning of a miss
also decides whether to scan q/k/v for NaN/inf.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flexattn_zoo as fz


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--start", type=int, default=4000)
    p.add_argument("--routes", default="", help="also fz.attention(backend=ROUTE) for each, e.g. sdpa,fa4")
    p.add_argument("--profile", type=int, default=0, help="cProfile this many growing steps per backend")
    p.add_argument("--top", type=int, default=20, help="with --profile: functions shown per backend")
    p.add_argument("--device", default="cuda", help="cuda (bfloat16) or cpu (float32, one thread)")
    p.add_argument("--heads", default="32:8", help="query heads:key/value heads")
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args()
    dev = args.device
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    if dev == "cpu":
        torch.set_num_threads(1)
    h, hkv = (int(x) for x in args.heads.split(":"))
    b, d = args.batch, args.head_dim
    routes = args.routes.split(",") if args.routes else []
    profiled = ["auto", *routes, "decode_step"] if args.profile else []
    # Every step of every call below meets a length no call met before, so the cache holds them
    # all (a slice past its end would repeat the full cache's shape: plan-cache hits).
    cap = args.start + (4 + len(routes)) * (args.steps + 1) + len(profiled) * args.profile + 16
    k, v = (torch.randn(b, hkv, cap, d, device=dev, dtype=dt) for _ in range(2))
    q = torch.randn(b, h, 1, d, device=dev, dtype=dt)
    no_cudnn = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    calls = {
        "F.scaled_dot_product_attention (torch's choice)": lambda n: F.scaled_dot_product_attention(
            q, k[:, :, :n], v[:, :, :n], enable_gqa=True
        ),
        "F.scaled_dot_product_attention without cuDNN": lambda n: _without(no_cudnn, q, k, v, n),
        "fz.decode.decode_step(cache_len=n)": lambda n: fz.decode.decode_step(q, k, v, n),
        "fz.attention(q, cache[:, :, :n]) (a plan-cache miss per step)": lambda n: fz.attention(
            q, k[:, :, :n], v[:, :, :n], enable_gqa=True
        ),
    }
    for route in routes:
        calls[f"fz.attention(backend={route!r})"] = lambda n, r=route: fz.attention(
            q, k[:, :, :n], v[:, :, :n], enable_gqa=True, backend=r
        )
    length = args.start
    plan = fz.plan(q, k[:, :, :length], v[:, :, :length], enable_gqa=True)
    print(f"auto's route at {length} keys: {plan.backend}")
    with torch.no_grad():
        for name, call in calls.items():
            times = []
            if dev == "cpu":
                # The same lengths for every call (each still new to it: fz.attention meets each
                # once): a CPU step's time is mostly its kernel's, which grows with the length.
                length = args.start
            try:
                length += 1
                call(length)  # a first call (plan, compile), untimed
            except Exception as exc:  # a route this machine lacks (fa4 without FA4)
                print(f"{name}: unavailable ({type(exc).__name__}: {str(exc)[:120]})")
                continue
            for step in range(args.steps):
                length += 1  # a length no call has seen
                assert length <= cap
                _sync(dev)
                t0 = time.perf_counter()
                call(length)
                _sync(dev)
                if step >= 10:
                    times.append((time.perf_counter() - t0) * 1e3)
            print(
                f"{name}: median {statistics.median(times):.3f} ms per step (p90 {sorted(times)[len(times) * 9 // 10]:.3f})"
            )
        for backend in profiled:
            length = _profile(backend, q, k, v, length, args.profile, args.top)


def _profile(backend: str, q, k, v, length: int, steps: int, top: int) -> int:  # type: ignore[no-untyped-def]
    """cProfile ``steps`` growing-cache calls of ``fz.attention(backend=backend)``; prints the top
    functions by own time in microseconds per step; returns the next unseen length."""
    profiler = cProfile.Profile()
    _sync(q.device.type)
    profiler.enable()
    for _ in range(steps):
        length += 1
        assert length <= k.shape[2]
        if backend == "decode_step":
            fz.decode.decode_step(q, k, v, length)
        else:
            fz.attention(q, k[:, :, :length], v[:, :, :length], enable_gqa=True, backend=backend)
    _sync(q.device.type)
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]  # type: ignore[attr-defined]
    total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
    print(f"profile backend={backend!r}: {total / steps * 1e6:.1f} us of host functions per step (own time)")
    for (file, line, func), (_, ncalls, own, cum, _) in rows:
        print(
            f"  {own / steps * 1e6:8.1f} own {cum / steps * 1e6:8.1f} cum  {ncalls / steps:5.1f}x  {func} ({Path(file).name}:{line})"
        )
    return length


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _without(kernels, q, k, v, n):  # type: ignore[no-untyped-def]
    with sdpa_kernel(kernels):
        return F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], enable_gqa=True)


if __name__ == "__main__":
    main()
