"""How route choice times its candidates (and the benchmark its rows): warm-up, call counts filled
to a duration, and timing in interleaved rounds.

* Each candidate's first call is timed alone on the wall clock (it compiles); then at least
  ``warmup`` untimed calls and :data:`MIN_WARMUP_S` of them.
* Timed calls: at least ``reps`` per candidate, raised for short calls to fill
  :data:`MIN_TIMED_S` (at most :data:`MAX_REPS`), run in :data:`ROUNDS` rounds. Each round times
  every candidate in turn, starting one candidate later than the round before, so drift of the
  host or the clocks over the measurement (rows of the same calls timed a few seconds apart
  differed by up to a third on an H200 host) moves every candidate alike instead of favouring the
  one timed in a quiet moment.
* A timed call is bracketed by CUDA events on a GPU (calls run back to back, as in a model: a
  call whose host work outlasts its kernels is timed at its host time) and by ``perf_counter``
  around a synchronize elsewhere. The median over a candidate's timed calls is its time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

#: Least seconds of warm-up calls and of timed calls per candidate: the configured counts are
#: minimums, raised for short calls (whose time is mostly host time, which a median of ten calls
#: does not pin down) up to :data:`MAX_REPS` timed calls.
MIN_WARMUP_S = 0.01
MIN_TIMED_S = 0.05
MAX_REPS = 500
#: Rounds the timed calls of several candidates are spread over (see the module docstring): a
#: multiple of 2 and 3, so that with two or three candidates each starts as many rounds as the others.
ROUNDS = 6


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "cpu":
        torch.cpu.synchronize()


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """``(fn(), seconds)`` with the device synchronized on both sides (a first call: compilation
    included)."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def warm_up(step: Callable[[], Any], device: torch.device, count: int, min_s: float, max_calls: int) -> float:
    """Run ``step`` at least ``count`` times (at least twice) and for at least ``min_s`` seconds,
    adding calls only while fewer than ``max_calls`` ran, each batch of calls followed by a
    device synchronize (so little more than ``min_s`` of work is ever queued); returns the seconds
    per call of the last batch. Batches double after the first.

    Callers have made the step's first call already (timed alone: it compiles). The warm-up's own
    first call runs alone too and is left out of the estimate: one-time work a step does on its
    second call (SDPA's decoding route lets cuDNN in from there, which builds cuDNN's plan for the
    shape, tens of milliseconds of host time) would otherwise make a 0.06 ms call look like a
    slow one, and :func:`fill_count` would give it a handful of timed calls instead of hundreds."""
    t0 = time.perf_counter()
    step()
    sync(device)
    done, spent, per_call, batch = 1, time.perf_counter() - t0, 0.0, max(count - 1, 1)
    # done == 1: only the lone call ran; the estimate comes from a batch after it, whatever min_s says.
    while done == 1 or (spent < min_s and done < max_calls):
        t0 = time.perf_counter()
        for _ in range(batch):
            step()
        sync(device)
        took = time.perf_counter() - t0
        done, spent, per_call = done + batch, spent + took, took / batch
        batch = min(2 * batch, max_calls)
    return per_call


def fill_count(count: int, per_call_s: float, min_s: float, max_calls: int) -> int:
    """Calls to time for a call of ``per_call_s`` seconds: ``count``, raised to as many as fill
    ``min_s`` seconds, at most ``max_calls`` (never below ``count``)."""
    fill = int(min_s / per_call_s) + 1 if per_call_s > 0 else max_calls
    return max(count, min(fill, max_calls))


def interleaved_times(
    steps: Mapping[str, tuple[Callable[[], Any], int]],
    device: torch.device,
    rounds: int = ROUNDS,
    host_ms: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Milliseconds of every timed call of warm steps: ``steps`` maps a name to ``(step, calls)``;
    in each of ``rounds`` rounds every step runs its share of its ``calls`` timed calls (at least
    one call in all) in turn, the order rotated by one per round. On CUDA, ``host_ms`` (when
    given) gets each call's host time (the wall time for the call to return, no synchronize)."""
    names = list(steps)
    steps = {name: (step, max(calls, 1)) for name, (step, calls) in steps.items()}
    times: dict[str, list[float]] = {name: [] for name in names}
    cuda = device.type == "cuda"
    for r in range(rounds):
        shift = r % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            step, calls = steps[name]
            n = calls // rounds + (r < calls % rounds)
            if cuda:
                events = [
                    (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                    for _ in range(n)
                ]
                for begin, end in events:
                    begin.record()
                    t0 = time.perf_counter()
                    step()
                    if host_ms is not None:
                        host_ms.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
                    end.record()
                torch.cuda.synchronize(device)
                times[name] += [begin.elapsed_time(end) for begin, end in events]
            else:
                for _ in range(n):
                    t0 = time.perf_counter()
                    step()
                    sync(device)
                    times[name].append((time.perf_counter() - t0) * 1e3)
    return times


Timed = tuple[float, float]


def time_routes(
    steps: Mapping[str, Callable[[], Any]], device: torch.device, warmup: int, reps: int
) -> dict[str, Timed | Exception]:
    """Per name, ``(median ms of the timed calls, seconds of the first call)`` of its step, or the
    exception it raised (first call, warm-up or timed calls: a failing candidate is dropped and
    the others are timed without it). See the module docstring for the method."""
    out: dict[str, Timed | Exception] = {}
    first: dict[str, float] = {}
    counts: dict[str, int] = {}
    for name, step in steps.items():
        try:
            _, first[name] = timed(step, device)
            per_call = warm_up(step, device, warmup, MIN_WARMUP_S, MAX_REPS)
        except Exception as exc:
            out[name] = exc
            continue
        counts[name] = fill_count(reps, per_call, MIN_TIMED_S, MAX_REPS)
    live = dict(counts)
    while live:
        try:
            times = interleaved_times({n: (_raising(n, steps[n]), live[n]) for n in live}, device)
        except _StepFailed as failed:
            out[failed.name] = failed.error
            del live[failed.name]
            continue
        for name, ms in times.items():
            out[name] = (statistics.median(ms), first[name])
        break
    return {name: out[name] for name in steps}


class _StepFailed(Exception):
    def __init__(self, name: str, error: Exception) -> None:
        super().__init__(name)
        self.name, self.error = name, error


def _raising(name: str, step: Callable[[], Any]) -> Callable[[], Any]:
    def call() -> Any:
        try:
            return step()
        except Exception as exc:
            raise _StepFailed(name, exc) from exc

    return call


__all__ = [
    "MAX_REPS",
    "MIN_TIMED_S",
    "MIN_WARMUP_S",
    "ROUNDS",
    "fill_count",
    "interleaved_times",
    "sync",
    "time_routes",
    "timed",
    "warm_up",
]
