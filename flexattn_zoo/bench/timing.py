"""Timing, memory and visible-work counting for :mod:`flexattn_zoo.bench`.

Timing follows the usual GPU recipe: one first call timed on the wall clock (it includes
compilation), untimed warm-up calls, then timed calls each bracketed by CUDA events; the median is
reported. On CPU the events are ``time.perf_counter`` around ``torch.cpu.synchronize``.

The counts are minimums, as in Triton's ``do_bench``: at least ``warmup`` warm-up calls and
:data:`MIN_WARMUP_S` of them, then at least ``iters`` timed calls and as many as fill
:data:`MIN_TIMED_S` (at most :data:`MAX_ITERS`), so a short call is timed over many repetitions
(a median of 8 calls of 0.1 ms moves by tens of percent with the host's jitter) while a long one
keeps its configured count. ``Timing.times_ms`` holds every timed call.

The timed calls run back to back, as in a model: when a call's host work (Python, launches)
takes longer than its kernels, the GPU waits and the events measure the host. ``host_ms`` (median
wall time for the host to return from one call, no synchronization) shows when that happens.
Host time drifts over a sweep process (two rows of one route, a few rows apart, differed by up to
1.5x), so the rows of such a case are timed again by :func:`interleaved`: in rounds, each round
timing every route in turn, so that drift moves them alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import re
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from flexattn_zoo import _compat
from flexattn_zoo.spec import MaskSpec
from flexattn_zoo.tuning.timing import fill_count, interleaved_times, sync, timed, warm_up

#: Least seconds of warm-up calls, and of timed calls, per row (the configured counts are minimums).
MIN_WARMUP_S = 0.025
MIN_TIMED_S = 0.1
#: Most timed calls per row, however short the call.
MAX_ITERS = 1000

#: Mask elements evaluated at once when counting visible pairs or materializing a dense mask.
SLAB_ELEMENTS = 1 << 26
MIB = 2**20
GIB = 2**30


def free_memory(device: torch.device) -> None:
    """Collect garbage (tracebacks keep tensors alive through cycles) and return cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclasses.dataclass
class Timing:
    first_s: float
    median_ms: float
    times_ms: list[float]
    peak_mib: float | None
    base_mib: float | None
    host_ms: float | None = None  # median host time to issue one call (CUDA only)

    @property
    def compile_s(self) -> float:
        """First call minus a steady-state call: compilation and one-time setup."""
        return max(0.0, self.first_s - self.median_ms / 1e3)


def measure(
    step: Callable[[], Any],
    device: torch.device,
    warmup: int,
    iters: int,
    on_first: Callable[[Any], None] | None = None,
) -> Timing:
    """Time ``step`` (see the module docstring). ``on_first`` sees the first call's result."""
    result, first = timed(step, device)
    if on_first is not None:
        on_first(result)
    del result
    with _no_gc():
        return _steady(step, device, warmup, iters, first)


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Python's cyclic GC off while timing, as ``timeit`` does: a sweep process holds many objects,
    and a collection landing in a timed loop would stall the host, which host-bound calls (short
    kernels) would show as GPU time."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def timed_iters(iters: int, per_call_s: float) -> int:
    """Timed calls for a call of ``per_call_s`` seconds: ``iters`` or as many as fill
    :data:`MIN_TIMED_S`, whichever is more, at most :data:`MAX_ITERS` (never below ``iters``)."""
    return fill_count(iters, per_call_s, MIN_TIMED_S, MAX_ITERS)


def _steady(step: Callable[[], Any], device: torch.device, warmup: int, iters: int, first: float) -> Timing:
    iters = timed_iters(iters, warm_up(step, device, warmup, MIN_WARMUP_S, MAX_ITERS))
    peak = base = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) / MIB
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        host = []
        for i in range(iters):
            starts[i].record()
            t0 = time.perf_counter()
            step()
            host.append((time.perf_counter() - t0) * 1e3)
            ends[i].record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
        peak = torch.cuda.max_memory_allocated(device) / MIB
        return Timing(first, statistics.median(times), times, peak, base, statistics.median(host))
    else:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
    return Timing(first, statistics.median(times), times, peak, base)


#: Rounds of :func:`interleaved`.
INTERLEAVED_ROUNDS = 5


def interleaved(
    steps: dict[str, tuple[Callable[[], Any], int]], device: torch.device, rounds: int = INTERLEAVED_ROUNDS
) -> dict[str, Timing]:
    """Time several warm calls together: ``steps`` maps a name to ``(step, calls)``; in each of
    ``rounds`` rounds every step runs its share of ``calls`` timed calls in turn
    (:func:`flexattn_zoo.tuning.timing.interleaved_times`). One :class:`Timing` per name over all
    its calls (``first_s`` 0: no first call here)."""
    cuda = device.type == "cuda"
    host: dict[str, list[float]] = {}
    with _no_gc():
        times = interleaved_times(steps, device, rounds, host_ms=host if cuda else None)
    return {
        name: Timing(
            0.0, statistics.median(t), t, None, None, statistics.median(host[name]) if cuda else None
        )
        for name, t in times.items()
    }


# ---------------------------------------------------------------------------------------------
# Visible work, without ever holding Lq x Lkv


def _grid_sizes(spec: MaskSpec, batch: int, heads: int) -> tuple[int, int]:
    return (batch if spec.uses_batch() else 1), (heads if spec.uses_head() else 1)


def mask_slabs(
    spec: MaskSpec, length: int, batch: int, heads: int, device: torch.device, q_len: int | None = None
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(row_start, row_stop, visible[B|1, H|1, rows, L])`` over slabs of query rows.

    ``length`` is the key length; ``q_len`` the query length (default: ``length``). Evaluates the
    spec's ``mask_mod`` on broadcast index grids, at most ``SLAB_ELEMENTS`` at a time (like
    :func:`flexattn_zoo.blockmask.generic_block_map`), so temporaries stay bounded.
    """
    q_len = length if q_len is None else q_len
    mod = spec.bind(q_len, length).mask_mod()
    nb, nh = _grid_sizes(spec, batch, heads)
    b = torch.arange(nb, device=device).view(nb, 1, 1, 1)
    h = torch.arange(nh, device=device).view(1, nh, 1, 1)
    kv = torch.arange(length, device=device).view(1, 1, 1, length)
    rows = max(1, SLAB_ELEMENTS // (nb * nh * length))
    for r0 in range(0, q_len, rows):
        r1 = min(q_len, r0 + rows)
        q = torch.arange(r0, r1, device=device).view(1, 1, -1, 1)
        vis = torch.as_tensor(mod(b, h, q, kv), device=device)
        yield r0, r1, torch.broadcast_to(vis, (nb, nh, r1 - r0, length))


def visible_pairs(
    spec: MaskSpec | None, length: int, batch: int, heads: int, device: torch.device, q_len: int | None = None
) -> int:
    """Visible (query, key) pairs summed over every batch row and query head (``length`` keys,
    ``q_len`` queries, default ``length``)."""
    q_len = length if q_len is None else q_len
    if spec is None:
        return batch * heads * q_len * length
    nb, nh = _grid_sizes(spec, batch, heads)
    total = sum(int(vis.sum()) for _, _, vis in mask_slabs(spec, length, batch, heads, device, q_len))
    return total * (batch // nb) * (heads // nh)


def dense_mask(spec: MaskSpec, length: int, batch: int, heads: int, device: torch.device) -> torch.Tensor:
    """The boolean ``[B|1, H|1, L, L]`` mask, filled slab by slab from ``mask_mod``."""
    nb, nh = _grid_sizes(spec, batch, heads)
    out = torch.empty(nb, nh, length, length, dtype=torch.bool, device=device)
    for r0, r1, vis in mask_slabs(spec, length, batch, heads, device):
        out[:, :, r0:r1] = vis
    return out


def dense_bias(
    score_mod: Callable[..., torch.Tensor],
    mask: MaskSpec | None,
    length: int,
    batch: int,
    heads: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Additive float bias ``[B|1, H, L, L]``: ``score_mod`` of a zero score, ``-inf`` where masked."""
    nb = batch if (mask is not None and mask.uses_batch()) else 1
    b = torch.arange(nb, device=device).view(nb, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, heads, 1, 1)
    kv = torch.arange(length, device=device).view(1, 1, 1, length)
    out = torch.empty(nb, heads, length, length, dtype=dtype, device=device)
    rows = max(1, SLAB_ELEMENTS // (nb * heads * length))
    zero = torch.zeros((), dtype=torch.float32, device=device)
    slabs = mask_slabs(mask, length, batch, heads, device) if mask is not None else None
    for r0 in range(0, length, rows):
        r1 = min(length, r0 + rows)
        q = torch.arange(r0, r1, device=device).view(1, 1, -1, 1)
        out[:, :, r0:r1] = score_mod(zero, b, h, q, kv).to(dtype)
    if slabs is not None:
        for r0, r1, vis in slabs:
            out[:, :, r0:r1].masked_fill_(~vis, float("-inf"))
    return out


# ---------------------------------------------------------------------------------------------
# Catching what torch only logs: Dynamo's recompile limit and flex's unfused fallback


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "recompile_limit" in msg or "cache_size_limit" in msg:
            func = re.search(r"function: '([^']+)'", msg)
            limit = re.search(r"config\.(\w+) \((\d+)\)", msg)
            self.messages.append(
                f"Dynamo hit {limit.group(1) + ' ' + limit.group(2) if limit else 'its recompile limit'}"
                f" for {func.group(1) if func else 'a compiled function'}: it runs eagerly from here on"
            )


@contextlib.contextmanager
def torch_warnings() -> Iterator[list[str]]:
    """Collect Dynamo recompile-limit logs and torch's "unfused" warnings raised inside the block."""
    notes: list[str] = []
    handler = _Collect()
    logger = logging.getLogger(_compat.DYNAMO_LOGGER)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logger.addHandler(handler)
        try:
            yield notes
        finally:
            logger.removeHandler(handler)
            notes.extend(dict.fromkeys(handler.messages))
            for w in caught:
                text = str(w.message)
                if "unfused" in text or "without torch.compile" in text:
                    notes.append("torch warned: " + text.splitlines()[0][:200])
