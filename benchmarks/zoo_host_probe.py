"""Eager host time per call of zoo entries on the flex route, next to hand-written compiled flex.

For each registered mask's typical example: ``fz.attention(backend=ROUTE)`` and
``torch.compile(flex_attention)`` on a BlockMask prebuilt from the same mask_mod, each warmed up,
then timed in interleaved rounds: host time per call (``perf_counter`` around the call, no
synchronization; the queue is drained between chunks, outside the timed region) and device time
per call (CUDA events around a chunk). Median over rounds, in microseconds.

    PYTHONPATH=. python benchmarks/zoo_host_probe.py [--names natten,sliding_window] [--shape 2,16,4096,128]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import flexattn_zoo as fz
from flexattn_zoo import registry
from flexattn_zoo.backends import BY_NAME
from flexattn_zoo.backends.flex import FlexBackend


def _chunk(fn: Callable[[], Any], calls: int) -> tuple[float, float]:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = 0.0
    start.record()
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        host += time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    return host / calls * 1e6, start.elapsed_time(end) / calls * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--names", default="natten,sliding_tile,sliding_window")
    p.add_argument("--shape", default="2,16,4096,128")
    p.add_argument("--route", default="flex")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()
    b, h, length, d = (int(n) for n in args.shape.split(","))
    q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    compiled = torch.compile(flex_attention)
    print(
        f"# B={b} H={h} L={length} D={d} bf16, torch {torch.__version__}; median of {args.rounds} rounds x {args.calls} calls"
    )
    print("| entry | call | host us | device us |\n|---|---|---:|---:|")
    for name in args.names.split(","):
        spec = registry.MASKS.entry(name).factory.typical_example(length, length, b, h).to("cuda")
        bm = create_block_mask(
            spec.mask_mod(), b if spec.uses_batch() else None, h if spec.uses_head() else None, length, length,
            device="cuda",
        )  # fmt: skip
        plan = fz.plan(q, k, v, mask=spec, backend=args.route)
        route = BY_NAME[plan.backend]
        opts = route.options(plan.problem, bm) if isinstance(route, FlexBackend) else None
        calls = {
            "compiled flex_attention, prebuilt BlockMask": lambda bm=bm: compiled(q, k, v, block_mask=bm),
            f"the same with the route's kernel_options {opts}": (
                lambda bm=bm, opts=opts: compiled(q, k, v, block_mask=bm, kernel_options=opts)
            ),
            f'fz.attention(backend="{args.route}")': lambda spec=spec: fz.attention(q, k, v, mask=spec, backend=args.route),
        }  # fmt: skip
        times: dict[str, list[tuple[float, float]]] = {c: [] for c in calls}
        for fn in calls.values():
            for _ in range(5):
                fn()
        for _ in range(args.rounds):
            for c, fn in calls.items():
                times[c].append(_chunk(fn, args.calls))
        for c, got in times.items():
            host = statistics.median(t[0] for t in got)
            dev = statistics.median(t[1] for t in got)
            print(f"| {name} | {c} | {host:.1f} | {dev:.1f} |", flush=True)


if __name__ == "__main__":
    main()
