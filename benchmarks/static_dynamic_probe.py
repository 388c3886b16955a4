"""A flex route's compiled kernel with static shapes against the dynamic-shape graph Dynamo
compiles once the same code has seen a second shape (its automatic dynamic shapes).

The flex routes keep one compiled entry per kernel (mask / score-mod code, options), shared by
every length. With Dynamo's automatic dynamic shapes alone, a process that runs a mask at two
lengths would run its dynamic-shape graph from then on, at every length; an entry now compiles
static graphs for its first ``STATIC_SHAPES`` shapes and only later shapes share a dynamic one. Measured on the H200 so far: one-query decoding over 8K keys takes 0.6 ms on
that graph against 0.25 at static shapes (``cycling_host_probe_h200_b32.txt``), and the host issues
a small call about 35 us slower (``host_layers_h200_r25.txt``). This probe measures it per
problem: three fresh entries with the route's BlockMask and kernel options, one called at the
problem's shape only (static), one first called at one other length (two lengths: the entry's
policy should keep it static), one first called at ``STATIC_SHAPES + 1`` other lengths (dynamic),
timed interleaved:
CUDA-event milliseconds per call (median) and the host's time to issue a call, forward and
forward + backward.

    PYTHONPATH=. python benchmarks/static_dynamic_probe.py [--rounds 5 --calls 20]
    PYTHONPATH=. python benchmarks/static_dynamic_probe.py --device cpu   # the logic, tiny shapes
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import time
from typing import Any

import torch

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo.backends import BY_NAME
from flexattn_zoo.compile import STATIC_SHAPES, CompiledFlex

#: name: (B, Hq, Hkv, Lq, Lkv, D, mask, other length): the length the "dynamic" entry sees first,
#: a block of 128 shorter for training shapes (two batches of a run, two prefill lengths), one key
#: shorter for decoding (the previous step's cache).
CASES: dict[str, tuple[int, int, int, int, int, int, Any, int]] = {
    "causal 8K, 32:8, D=128": (1, 32, 8, 8192, 8192, 128, masks.Causal(), 8064),
    "sliding 4096 + causal 8K, 16:8, D=128": (
        2,
        16,
        8,
        8192,
        8192,
        128,
        masks.SlidingWindow(left=4095, right=0) & masks.Causal(),
        8064,
    ),
    "causal 2K, B=16, 12 heads, D=64": (16, 12, 12, 2048, 2048, 64, masks.Causal(), 1920),
    "decode, 1 query, 8K keys, B=32, 32:8": (32, 32, 8, 1, 8192, 128, None, 8191),
}
#: Small versions for a run of the probe's logic on the CPU (``--device cpu``; flex_cpu, float32).
CPU_CASES: dict[str, tuple[int, int, int, int, int, int, Any, int]] = {
    "causal 256, 4:2, D=16": (1, 4, 2, 256, 256, 16, masks.Causal(), 224),
    "decode, 1 query, 256 keys, 4:2": (2, 4, 2, 1, 256, 16, None, 255),
}


def _inputs(
    b: int, hq: int, hkv: int, lq: int, lkv: int, d: int, grad: bool, device: torch.device
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cpu").manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = ((b, hq, lq, d), (b, hkv, lkv, d), (b, hkv, lkv, d))
    return tuple(torch.randn(s, generator=g).to(device, dtype).requires_grad_(grad) for s in shapes)


def _call(entry: Any, prep: Any, scale: float, qkv: tuple[torch.Tensor, ...], grad: bool) -> None:
    out, _ = entry(*qkv, prep.block_mask, scale, prep.score_mod)
    if grad:
        out.backward(torch.ones_like(out))


def _timed(call: Any, n: int, cuda: bool, host: list[float]) -> list[float]:
    """Milliseconds of ``n`` calls (CUDA events, or the wall clock on the CPU); appends the host's
    microseconds per call to ``host``."""
    if not cuda:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            call()
            out.append((time.perf_counter() - t0) * 1e3)
            host.append(out[-1] * 1e3)
        return out
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for begin, end in events:
        begin.record()
        t0 = time.perf_counter()
        call()
        host.append((time.perf_counter() - t0) * 1e6)
        end.record()
    torch.cuda.synchronize()
    return [begin.elapsed_time(end) for begin, end in events]


def _entries(
    problem: tuple[int, int, int, int, int, int, Any, int],
    route: str,
    grad: bool,
    device: torch.device,
    serial: Any,
) -> dict[str, Any]:
    """The calls to compare: a fresh entry that only ever sees the problem's shape, one that saw
    one other length first, and one that saw ``STATIC_SHAPES + 1`` other lengths first (so the
    problem's shape runs on the dynamic-shape graph)."""
    b, hq, hkv, lq, lkv, d, mask, other = problem
    q, k, v = _inputs(b, hq, hkv, lq, lkv, d, grad, device)
    gqa = hq != hkv
    scale = d**-0.5
    calls: dict[str, Any] = {}
    for label, earlier in (("static", 0), ("two lengths", 1), ("dynamic", STATIC_SHAPES + 1)):
        prep = BY_NAME[route].prepared(
            fz.plan(q, k, v, mask=mask, enable_gqa=gqa, backend=route).problem, device
        )
        entry = CompiledFlex(next(serial), prep.options, prep.lse, prep.gqa)
        for i in range(earlier):
            n = lkv - (lkv - other) * (i + 1)
            q2, k2, v2 = _inputs(b, hq, hkv, n if lq == lkv else lq, n, d, grad, device)
            plan2 = fz.plan(q2, k2, v2, mask=mask, enable_gqa=gqa, backend=route)
            _call(entry, BY_NAME[route].prepared(plan2.problem, device), scale, (q2, k2, v2), grad)
        call = functools.partial(_call, entry, prep, scale, (q, k, v), grad)
        call()
        call.entry = entry  # type: ignore[attr-defined]
        calls[label] = call
    return calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    route = "flex" if cuda else "flex_cpu"
    serial = itertools.count(90_000)
    print(
        f"# static vs dynamic-shape {route} entries, torch {torch.__version__}, "
        f"{torch.cuda.get_device_name() if cuda else 'cpu'}; median of {args.rounds} rounds x {args.calls} "
        "calls, interleaved"
    )
    print(
        f"{'problem':42} {'mode':7} {'static ms':>10} {'2 lengths':>10} {'dynamic ms':>11} {'ratio':>6} "
        f"{'host s/2/d us':>16} {'dyn. graphs s/2/d':>18}"
    )
    for name, problem in (CASES if cuda else CPU_CASES).items():
        for mode in ("fwd", "fwdbwd") if cuda else ("fwd",):
            if problem[3] == 1 and mode == "fwdbwd":
                continue
            grad = mode == "fwdbwd"
            with torch.no_grad() if not grad else torch.enable_grad():
                calls = _entries(problem, route, grad, device, serial)
                ms: dict[str, list[float]] = {label: [] for label in calls}
                host: dict[str, list[float]] = {label: [] for label in calls}
                for _ in range(args.rounds):
                    for label, call in calls.items():
                        ms[label] += _timed(call, args.calls, cuda, host[label])
            st, two, dy = (statistics.median(ms[label]) for label in calls)
            hs, h2, hd = (statistics.median(host[label]) for label in calls)
            graphs = "/".join(str(call.entry.dynamic_graphs) for call in calls.values())
            print(
                f"{name:42} {mode:7} {st:10.3f} {two:10.3f} {dy:11.3f} {dy / st:6.2f} "
                f"{hs:5.0f}/{h2:.0f}/{hd:<6.0f} {graphs:>18}",
                flush=True,
            )


if __name__ == "__main__":
    main()
