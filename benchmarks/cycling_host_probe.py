"""Where a flex decoding call spends its time when the cache length changes from call to call.

``fz.attention(q, cache[:, :, :n], ...)`` on a flex route costs about 0.25 ms per step at one
fixed length on the H200 (B=32, 32:8 heads, 8K keys) but 0.6-0.74 ms when the length cycles over
64 values (``decode_kernel_probe_h200_r24_prefix.txt``). Its run on the H200
(``cycling_host_probe_h200_b32.txt``) found that to be kernel time: once the entry has seen a
second length, its dynamic-shape graph's kernel takes 0.6 ms at every length. This probe times,
for a fixed and for a cycling length, each layer of that call side by side:

* ``fz.attention(backend=ROUTE)`` on the prefix;
* the plan cache's bound call (the route's launch for the problem);
* the library's compiled entry (``CompiledFlex._fn``) called with the same arguments;
* ``torch.compile(flex_attention)`` written by hand (``enable_gqa``, no BlockMask);

as the host's time to issue one call (the device kept busy) and as the wall time per step with
the device synchronized at the end. Then, for the cycling ``fz.attention`` call: Dynamo's counters
(recompiles, guard failures), a torch.profiler table of 20 steps and a cProfile of 200 steps.

    PYTHONPATH=. python benchmarks/cycling_host_probe.py [--batch 8 --len 8192 --route flex]
    PYTHONPATH=. python benchmarks/cycling_host_probe.py --device cpu --batch 1 --len 256 --route flex_cpu
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import flexattn_zoo as fz
from flexattn_zoo import _compat, plan_cache
from flexattn_zoo.backends import BY_NAME
from flexattn_zoo.compile import CACHE

CYCLE = 64


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", default="32,8", help="H,HKV")
    p.add_argument("--len", type=int, default=8192)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--route", default="flex")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    hq, hkv = (int(x) for x in args.heads.split(","))
    gen = torch.Generator(device="cpu").manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    q = make(args.batch, hq, 1, args.dim)
    k_cache, v_cache = (make(args.batch, hkv, args.len + CYCLE, args.dim) for _ in range(2))
    gqa = hq != hkv
    det = _compat.strict_deterministic_mode()
    raw = torch.compile(_compat.flex_attention)

    def hit(n: int) -> Any:
        k, v = k_cache[:, :, :n], v_cache[:, :, :n]
        fz.attention(q, k, v, enable_gqa=gqa, backend=args.route)
        key = plan_cache.call_key(q, k, v, None, None, gqa, False, det, args.route)
        found = plan_cache.lookup(key, q, k, v)
        assert found is not None, "no plan-cache hit"
        return found

    bound = {n: hit(n) for n in range(args.len, args.len + CYCLE)}
    some = bound[args.len]
    prepared = BY_NAME[some.plan.backend].prepared(some.plan.problem, device)
    entry = CACHE.get_keyed(prepared.key, prepared.options, prepared.lse, prepared.gqa)

    layers: dict[str, Callable[[int], Any]] = {
        f"fz.attention(backend={args.route!r})": lambda n: fz.attention(
            q, k_cache[:, :, :n], v_cache[:, :, :n], enable_gqa=gqa, backend=args.route
        ),
        "bound call (plan-cache hit's run)": lambda n: bound[n].run(
            q, k_cache[:, :, :n], v_cache[:, :, :n], bound[n].scale
        ),
        "compiled entry (CompiledFlex._fn)": lambda n: entry._fn(
            q, k_cache[:, :, :n], v_cache[:, :, :n], None, some.scale, None
        ),
        "torch.compile(flex_attention), enable_gqa": lambda n: raw(
            q, k_cache[:, :, :n], v_cache[:, :, :n], enable_gqa=gqa
        ),
    }
    print(
        f"# {torch.__version__}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
        f"B={args.batch} {hq}:{hkv} heads, D={args.dim}, {args.len}+ keys, route {some.plan.backend}; "
        f"us per call, median of {args.rounds} rounds x {args.steps} calls"
    )
    print(f"{'layer':52} {'length':8} {'host':>8} {'wall':>8}")
    for name, call in layers.items():
        for cycling in (False, True):
            lengths = [args.len + (i % CYCLE if cycling else 0) for i in range(args.steps)]
            for n in lengths[:CYCLE]:
                call(n)  # warm: every length once (compiles, plans)
            sync()
            host, wall = [], []
            for _ in range(args.rounds):
                sync()
                t0 = time.perf_counter()
                for n in lengths:
                    call(n)
                t1 = time.perf_counter()
                sync()
                t2 = time.perf_counter()
                host.append((t1 - t0) / args.steps * 1e6)
                wall.append((t2 - t0) / args.steps * 1e6)
            label = "cycling" if cycling else "fixed"
            print(
                f"{name:52} {label:8} {statistics.median(host):8.1f} {statistics.median(wall):8.1f}",
                flush=True,
            )

    cycling_call = layers[f"fz.attention(backend={args.route!r})"]
    from torch._dynamo.utils import counters

    counters.clear()
    for i in range(args.steps):
        cycling_call(args.len + i % CYCLE)
    sync()
    print(
        "\n## Dynamo counters over",
        args.steps,
        "cycling calls:",
        {k: dict(v) for k, v in counters.items() if v},
    )

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(20):
            cycling_call(args.len + i % CYCLE)
        sync()
    print("\n## torch.profiler, 20 cycling calls")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70))

    pr = cProfile.Profile()
    pr.enable()
    for i in range(args.steps):
        cycling_call(args.len + i % CYCLE)
    sync()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
    print(f"\n## cProfile, {args.steps} cycling calls (tottime)")
    print(buf.getvalue())


if __name__ == "__main__":
    main()
