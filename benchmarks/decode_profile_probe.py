"""Where a decode step's time goes: host time per call and the kernels each spelling launches.

One query against a fixed-length cache (GQA), at a repeated shape, four spellings side by side in
one process:

* ``sdpa``: ``F.scaled_dot_product_attention(q, k[:, :, :L], v[:, :, :L], enable_gqa=True)``;
* ``attention``: ``fz.attention`` on the same slices (a plan-cache hit after the first call);
* ``decode_int``: ``fz.decode.decode_step(q, k, v, L, mask=Causal())``;
* ``decode_lens``: the same with a ``[B]`` lengths tensor.

For each: the plan ``fz.plan`` explains (``attention``), the median wall time per call over back to
back calls (GPU-bound when above the host time), the median host time per call (the call returns
before its kernels finish), and torch.profiler's kernels per call (name, count, CUDA us).

    PYTHONPATH=. python benchmarks/decode_profile_probe.py --shape 1,32,8,4096,128 --shape 8,32,8,4096,128
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo.models import decode


def per_call_us(fn: Callable[[], Any], calls: int, rounds: int) -> tuple[float, float]:
    """``(wall, host)`` medians over ``rounds``, in us per call: wall syncs after ``calls`` back to
    back calls; host stops the clock before the sync."""
    walls, hosts = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        hosts.append((t1 - t0) / calls * 1e6)
        walls.append((t2 - t0) / calls * 1e6)
    return statistics.median(walls), statistics.median(hosts)


def kernels(fn: Callable[[], Any], calls: int, top: int) -> str:
    """torch.profiler's CUDA kernels of ``calls`` calls, per call."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        cuda_us = getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0)
        if e.device_type == torch.autograd.DeviceType.CUDA and cuda_us > 0:
            rows.append((cuda_us / calls, e.count / calls, e.key))
    rows.sort(reverse=True)
    return (
        "\n".join(f"    {us:8.1f} us  x{n:4.1f}  {name[:110]}" for us, n, name in rows[:top]) or "    (none)"
    )


def profile_shape(shape: str, calls: int, rounds: int, top: int) -> None:
    """Print the plan, host/wall time and kernels of each spelling at ``shape`` (B,H,HKV,L,D)."""
    b, h, hkv, length, d = (int(x) for x in shape.split(","))
    dev, dtype = "cuda", torch.bfloat16
    q = torch.randn(b, h, 1, d, device=dev, dtype=dtype)
    k = torch.randn(b, hkv, length, d, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    lens = torch.full((b,), length, device=dev, dtype=torch.int32)
    causal = masks.Causal()
    steps: dict[str, Callable[[], Any]] = {
        "sdpa": lambda: F.scaled_dot_product_attention(
            q, k[:, :, :length], v[:, :, :length], enable_gqa=True
        ),
        "attention": lambda: fz.attention(q, k[:, :, :length], v[:, :, :length], enable_gqa=True),
        "decode_int": lambda: decode.decode_step(q, k, v, length, mask=causal),
        "decode_lens": lambda: decode.decode_step(q, k, v, lens, mask=causal),
    }
    print(f"## B={b} H={h} HKV={hkv} L={length} D={d} bf16, torch {torch.__version__}", flush=True)
    print(fz.plan(q, k[:, :, :length], v[:, :, :length], enable_gqa=True).explain(), flush=True)
    with torch.no_grad():
        for fn in steps.values():
            for _ in range(20):
                fn()
        torch.cuda.synchronize()
        for name, fn in steps.items():
            wall, host = per_call_us(fn, calls, rounds)
            print(f"- {name}: wall {wall:.1f} us/call, host {host:.1f} us/call", flush=True)
            print(kernels(fn, calls, top), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", action="append", help="B,H,HKV,L,D (repeatable)")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--top", type=int, default=8)
    a = p.parse_args()
    for shape in a.shape or ["1,32,8,4096,128", "8,32,8,4096,128"]:
        profile_shape(shape, a.calls, a.rounds, a.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
