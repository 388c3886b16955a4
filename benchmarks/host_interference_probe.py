"""Why ``fz.attention`` on a flex route costs more than its dispatcher plus its bound call.

On a plan-cache hit ``fz.attention`` runs the dispatcher (validation, the call key, the plan
cache) and then the cached bound call. Timed apart, the two add up to less than the whole call:
the compiled flex call after the dispatcher is slower than the same call alone. This probe times,
interleaved round by round on one tiny problem (the kernel short next to the host):

* the compiled flex call alone (``torch.compile(flex_attention)``) and the bound call;
* ``fz.attention`` as it is, and with one part of its dispatcher replaced by its precomputed
  result for a whole chunk of calls (the call key, the process state inside it, the plan cache's
  locked lookup): what each part costs *including* what it does to the call after it;
* the dispatcher alone (the cached bound call swapped for a no-op), and the dispatcher followed by
  the bound call written out by hand;
* both with Python's garbage collector off (its young-generation passes come more often the more
  objects a call allocates);
* the bound call after a Python busy loop of about the dispatcher's length that touches a few
  objects, and after one that walks a large list (which evicts the CPU caches): whether any
  Python work slows the call after it, or only work with a large memory footprint.

Last, the bound call's own time measured from inside: timed around its ``run`` when
``fz.attention`` calls it, and when a loop calls it. Prints the median and 10th percentile of
the per-chunk mean time per call (us); the last two rows: of the per-chunk median.

    PYTHONPATH=. python benchmarks/host_interference_probe.py --device cuda
    PYTHONPATH=. python benchmarks/host_interference_probe.py --device cpu --threads 1 --shape 1x2x64x16
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from host_layers_probe import (  # a sibling script
    header,
    median_p10,
    plan_cache_entry,
    probe_args,
    sliding_problem,
)

import flexattn_zoo as fz
from flexattn_zoo import _compat, dispatch, plan_cache
from flexattn_zoo.backends import BY_NAME


@contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextmanager
def _gc_off() -> Iterator[None]:
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def rows(
    device: torch.device, dtype: torch.dtype, shape: tuple[int, ...]
) -> dict[str, tuple[Callable[[], Any], Any]]:
    """``name -> (call, context factory)``: the context is entered around each timed chunk."""
    q, k, v, sliding = sliding_problem(device, dtype, shape)
    key, hit = plan_cache_entry(q, k, v, sliding)
    scale = hit.scale
    prepared = BY_NAME[hit.plan.backend].prepared(hit.plan.problem, device)
    bm, opts = prepared.block_mask, prepared.options
    raw = torch.compile(_compat.flex_attention)
    entry = plan_cache.PLANS.get(key)
    state = plan_cache.process_state()

    class _NoOp:
        plan = hit.plan

        def __init__(self) -> None:
            self.scale = hit.scale

        def run(self, q_: Any, k_: Any, v_: Any, s_: Any) -> Any:
            return q_, None

    noop = _NoOp()

    def set_entry(value: Any) -> Any:
        @contextmanager
        def ctx() -> Iterator[None]:
            slot = entry.plans if isinstance(entry, plan_cache.ByFiniteness) else None
            if slot is None:
                plan_cache.PLANS.put(key, value) if value is hit else plan_cache.PLANS.replace(key, value)
            else:
                slot[False] = value
            try:
                yield
            finally:
                if slot is None:
                    plan_cache.PLANS.replace(key, hit)
                else:
                    slot[False] = hit

        return ctx

    plain: dict[Any, Any] = {key: entry}
    few = list(range(8))
    many = list(range(200_000))

    def busy_small() -> Any:
        total = 0
        for _ in range(40):
            for x in few:
                total += x
        return hit.run(q, k, v, scale)

    def busy_large() -> Any:
        total = 0
        for x in many[step[0] : step[0] + 320]:  # a moving window: new memory every call
            total += x
        step[0] = (step[0] + 4099) % (len(many) - 320)
        return hit.run(q, k, v, scale)

    step = [0]

    def dispatch_then_run() -> Any:
        fz.attention(q, k, v, mask=sliding)  # the no-op entry is in place for this row
        return hit.run(q, k, v, scale)

    call = lambda: fz.attention(q, k, v, mask=sliding)  # noqa: E731
    return {
        "compiled flex alone": (
            lambda: raw(q, k, v, block_mask=bm, scale=scale, kernel_options=opts),
            nullcontext,
        ),
        "bound call": (lambda: hit.run(q, k, v, scale), nullcontext),
        "fz.attention": (call, nullcontext),
        "fz.attention, call key precomputed": (call, lambda: _patched(dispatch, "call_key", lambda *a: key)),
        "fz.attention, process state precomputed": (
            call,
            lambda: _patched(plan_cache, "process_state", lambda: state),
        ),
        "fz.attention, plan cache a plain dict": (call, lambda: _patched(plan_cache, "PLANS", plain)),
        "fz.attention, garbage collector off": (call, _gc_off),
        "bound call, garbage collector off": (lambda: hit.run(q, k, v, scale), _gc_off),
        "dispatcher alone (no-op route)": (call, set_entry(noop)),
        "dispatcher (no-op route), then bound call": (dispatch_then_run, set_entry(noop)),
        "busy loop, few objects (alone)": (lambda: sum(x for _ in range(40) for x in few), nullcontext),
        "busy loop, few objects, then bound call": (busy_small, nullcontext),
        "list walk, large (alone)": (lambda: sum(many[0:320]), nullcontext),
        "list walk, large, then bound call": (busy_large, nullcontext),
    }


def inner_times(
    device: torch.device, dtype: torch.dtype, shape: tuple[int, ...], rounds: int, chunk: int
) -> tuple[list[float], list[float]]:
    """The bound call's own time (us, median per chunk) when ``fz.attention`` calls it, and when
    called in a loop of its own: the cached entry is swapped for one that times its ``run``."""
    q, k, v, sliding = sliding_problem(device, dtype, shape)
    key, hit = plan_cache_entry(q, k, v, sliding)
    clock = time.perf_counter
    took: list[float] = []

    class _Timed:
        plan = hit.plan
        scale = hit.scale

        def run(self, *args: Any) -> Any:
            t0 = clock()
            out = hit.run(*args)
            took.append(clock() - t0)
            return out

    timed = _Timed()
    entry = plan_cache.PLANS.get(key)
    if isinstance(entry, plan_cache.ByFiniteness):
        entry.plans[False] = timed
    else:
        plan_cache.PLANS.replace(key, timed)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    inside: list[float] = []
    alone: list[float] = []
    for _ in range(rounds):
        for out, call in (
            (inside, lambda: fz.attention(q, k, v, mask=sliding)),
            (alone, lambda: timed.run(q, k, v, hit.scale)),
        ):
            for _ in range(5):
                call()
            took.clear()
            for _ in range(chunk):
                call()
            out.append(statistics.median(took) * 1e6)
            sync()
    if isinstance(entry, plan_cache.ByFiniteness):
        entry.plans[False] = hit
    else:
        plan_cache.PLANS.replace(key, hit)
    return inside, alone


def measure(
    table: dict[str, tuple[Callable[[], Any], Any]], device: torch.device, rounds: int, chunk: int
) -> dict[str, list[float]]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for fn, ctx in table.values():
        with ctx():
            for _ in range(50):
                fn()
    sync()
    samples: dict[str, list[float]] = {name: [] for name in table}
    clock = time.perf_counter
    for _ in range(rounds):
        for name, (fn, ctx) in table.items():
            with ctx():
                for _ in range(5):
                    fn()
                t0 = clock()
                for _ in range(chunk):
                    fn()
                samples[name].append((clock() - t0) * 1e6 / chunk)
            sync()
    return samples


def main() -> None:
    args, device, dtype, shape = probe_args(__doc__.split("\n\n")[0], rounds=40)
    table = rows(device, dtype, shape)
    samples = measure(table, device, args.rounds, args.chunk)
    print(header("interference probe", args, device, dtype))
    print(f"{'row':<48} {'median':>8} {'p10':>8}")
    inside, alone = inner_times(device, dtype, shape, args.rounds, args.chunk)
    samples["bound call's own time, called by fz.attention"] = inside
    samples["bound call's own time, called in a loop"] = alone
    for row, values in samples.items():
        med, p10 = median_p10(values)
        print(f"{row:<48} {med:8.1f} {p10:8.1f}")


if __name__ == "__main__":
    main()
