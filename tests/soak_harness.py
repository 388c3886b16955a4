"""The soak's machinery, shared by its CPU form (tests/property/test_soak.py) and its GPU form
(tests/gpu/test_soak_gpu.py): many threads, many random calls, small caches, buffers rewritten in
place between calls, every result compared with the float64 reference, memory sampled per round.

Every result is compared with the float64 reference (or, for BlockMasks, with the spec's dense
oracle at block level), so a cache that ever serves an entry for another value -- a stale
BlockMask after an in-place write, a spec mistaken for one with a colliding hash, an entry torn by
a concurrent eviction -- fails here. The caches are shrunk (``SMALL_CACHES``, monkeypatched) so
eviction happens all the time under load.

What a call does (random per call, per thread):

* ``doc``: refill the thread's ids buffer (on the soak's device) in place, build a *new*
  ``Document`` over it (half the time ``& Causal()``), write the buffer again before the call (the
  spec must not see it), and run attention on one of ``doc_routes`` against a ``Document`` of the
  snapshot;
* ``closure``: refill the buffer in place and run attention with a raw ``mask_mod`` closure over
  it (its BlockMask must follow the buffer's version), on one of ``closure_routes``;
* ``registry``: a registered mask spec (sometimes ``& Causal()``), half the time with a registered
  score spec, run on one of ``registry_routes``. CPU form (``pool_size=0``): a random example of
  every registered spec (``examples()``) at a random length and batch, per call. GPU form: one
  entry of a fixed pool of such draws, each with its own length, batch and dtype (drawn once from
  the seed), so the compiled kernels stay bounded (each Triton compile costs seconds);
* ``block_mask``: ``fz.block_mask`` (on the soak's device) of a random registry example or
  composite, checked for soundness at block level: no visible element outside a listed block,
  every full block fully visible.

Routes: a kind with one named route calls it directly (the CPU form). Otherwise each call draws
a route from the kind's list; a named route is checked with ``fz.plan`` first and, when it refuses
the call, ``auto`` runs instead (counted as a refusal); the route that actually ran (``auto``'s
choice included) is counted per kind.

Memory: after each round the resident set size (``/proc/self/statm``) and, on CUDA,
``torch.cuda.memory_allocated`` / ``memory_reserved`` / ``max_memory_allocated`` (the round's
peak; the peak is reset at each round's start) are sampled; after the warm-up rounds they must
stay within a bound of the last warm-up round's value.
"""

from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import blockmask, masks, segments, spec
from flexattn_zoo.backends import flex as flex_backend
from flexattn_zoo.backends import varlen
from flexattn_zoo.compile import CACHE as COMPILE_CACHE
from flexattn_zoo.models import decode
from flexattn_zoo.plan_cache import PLANS
from flexattn_zoo.testing import assert_matches_reference, spec_examples

#: Growth of the resident set allowed after warm-up, in MiB. Everything the library keeps lives in
#: bounded LRUs (shrunk below) that are full by the end of warm-up, and their entries are small
#: (BlockMasks of at most 2 x 2 x 2 x 2 blocks, ids of <= 256 entries), so a correct run has no
#: trend: what moves is the allocator (glibc keeps an arena per thread and returns memory lazily;
#: torch caches freed CPU blocks). Measured on 2 shared cores: the round-to-round RSS wanders by
#: up to ~22 MiB around a flat level (short form: peak 2-13 MiB above warm-up; long form, 14,400
#: calls: 432-463 MiB, last round below the warm-up value). A leak of one spec, BlockMask or plan
#: per call (a few KiB each, plus their tensors) would exceed 48 MiB within the long form's
#: calls; the short form also checks that the library's tables stay within their bounds.
RSS_GROWTH_BOUND_MB = 48

SMALL_CACHES = {
    (blockmask.CACHE, "size"): 4,
    (PLANS, "size"): 8,
    (flex_backend.CALLS, "size"): 4,
    (spec._MODS, "size"): 16,
    (varlen.CU_SEQLENS_CACHE, "size"): 4,
    (segments.LAYOUT_CACHE, "size"): 4,
    (decode.CACHE, "size"): 2,
}
#: The shrunk LRUs by name, for the report (``inserts`` minus the final length = evictions).
CACHE_NAMES = {
    "blockmask.CACHE": blockmask.CACHE,
    "PLANS": PLANS,
    "flex.CALLS": flex_backend.CALLS,
    "spec._MODS": spec._MODS,
    "varlen.CU_SEQLENS_CACHE": varlen.CU_SEQLENS_CACHE,
    "segments.LAYOUT_CACHE": segments.LAYOUT_CACHE,
}
KINDS = ("doc", "closure", "registry", "block_mask")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def trim_heap() -> None:
    """glibc's ``malloc_trim(0)``: give free heap memory (every arena's) back to the system; a
    no-op where the C library has none."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def device_memory_mb(device: str) -> tuple[float, float, float] | None:
    """``(allocated, reserved, peak allocated since the last reset)`` in MiB on a CUDA device, after
    a synchronize; None elsewhere (no ``torch.cuda`` call is made then)."""
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize(device)
    mib = 2.0**20
    return (
        torch.cuda.memory_allocated(device) / mib,
        torch.cuda.memory_reserved(device) / mib,
        torch.cuda.max_memory_allocated(device) / mib,
    )


def reset_device_peak(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


@dataclass
class SoakConfig:
    """One soak. The fields after ``seed`` default to the CPU form's behaviour."""

    threads: int
    rounds: int
    warmup_rounds: int
    calls_per_round: int  # per thread, random rounds
    lengths: tuple[int, ...]  # for block masks and registry specs
    flex_length: int  # doc / closure calls (one shape: one compile per kernel)
    batches: tuple[int, ...]
    registry_routes: tuple[str, ...]  # routes of the registry specs' calls
    seed: int = 0
    device: str = "cpu"
    #: doc / closure calls draw their dtype per call; each pool entry has one (drawn once).
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    heads: int = 2
    head_dim: int = 16
    doc_routes: tuple[str, ...] = ("flex_cpu",)
    closure_routes: tuple[str, ...] = ("flex_cpu",)
    #: 0: registry specs drawn per call from every example (unbounded spec values: only for
    #: routes that compile nothing per spec); n > 0: a fixed pool of n draws.
    pool_size: int = 0
    #: Round 0 runs every (kind, causal, dtype, route, pool entry) combination once instead of
    #: random calls, split over the threads: every kernel compiles in warm-up.
    coverage: bool = False
    #: The same worker threads for every round (parked on a barrier between rounds) instead of
    #: new threads per round: per-thread library handles (cuBLAS / cuDNN handles and their
    #: workspaces) are made once, so the memory samples see the library, not thread churn.
    persistent_threads: bool = False
    #: CUDA only: "default" (every thread on the device's default stream) or "thread" (each
    #: worker its own ``torch.cuda.Stream``, synchronized at the round's end).
    streams: str = "default"
    #: Return the C heap's free memory to the system (glibc ``malloc_trim``) before each RSS
    #: sample, so the samples follow live memory rather than what the allocator keeps cached.
    trim_heap: bool = False


@dataclass
class PoolEntry:
    """One registry call shape of the GPU form: spec values, shape, dtype and the routes to draw."""

    name: str
    mask: Any
    score: Any
    batch: int
    length: int
    dtype: torch.dtype
    routes: tuple[str, ...] = ("auto",)


@dataclass
class SoakStats:
    calls: dict[str, int] = field(default_factory=dict)
    routes: dict[str, int] = field(default_factory=dict)  # "kind:route that ran"
    refused: dict[str, int] = field(default_factory=dict)  # "kind:named route" that refused
    rss: list[float] = field(default_factory=list)
    #: Objects the garbage collector tracks after each round (``len(gc.get_objects())``).
    objects: list[int] = field(default_factory=list)
    device_alloc: list[float] = field(default_factory=list)
    device_reserved: list[float] = field(default_factory=list)
    device_peak: list[float] = field(default_factory=list)
    compiles: list[int] = field(default_factory=list)  # compile cache total after each round
    round_seconds: list[float] = field(default_factory=list)
    round_calls: list[int] = field(default_factory=list)
    caches: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (inserts, length)
    pool: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def count(self, kind: str) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1


def _random_ids(rng: random.Random, n: int) -> torch.Tensor:
    """Sorted labels with a handful of documents, sometimes unsorted (generic BlockMask builder)."""
    starts = torch.tensor([rng.random() < 4.0 / n for _ in range(n)])
    ids = torch.cumsum(starts.long(), 0)
    if rng.random() < 0.2:
        ids = (ids * 7 + 3) % 5
    return ids


def _dense_blocks(num: torch.Tensor, idx: torch.Tensor, n_kv: int) -> torch.Tensor:
    """``[B, H, n_q, n_kv]`` bool from BlockMask (num_blocks, indices)."""
    cols = torch.arange(idx.shape[-1])
    listed = cols[None, None, None, :] < num[..., None]
    out = torch.zeros(*num.shape, n_kv + idx.shape[-1], dtype=torch.bool)
    out.scatter_(-1, torch.where(listed, idx.long(), n_kv + cols.expand_as(idx)), listed)
    return out[..., :n_kv]


def _check_block_mask(bm: Any, truth: torch.Tensor, q_len: int, kv_len: int) -> None:
    """Soundness of ``bm`` (any device) for the dense CPU mask ``truth`` ``[B|1, H|1, Lq, Lkv]``."""
    qb, kvb = bm.BLOCK_SIZE
    n_q, n_kv = -(-q_len // qb), -(-kv_len // kvb)
    padded = torch.zeros(*truth.shape[:2], n_q * qb, n_kv * kvb, dtype=torch.bool)
    padded[..., :q_len, :kv_len] = truth
    tiles = padded.view(*truth.shape[:2], n_q, qb, n_kv, kvb)
    any_true = tiles.any(5).any(3)
    valid = torch.zeros_like(padded)
    valid[..., :q_len, :kv_len] = True
    full_true = (tiles | ~valid.view_as(tiles)).all(5).all(3) & valid.view_as(tiles).all(5).all(3)
    listed = _dense_blocks(bm.kv_num_blocks.cpu(), bm.kv_indices.cpu(), n_kv)
    full = (
        _dense_blocks(bm.full_kv_num_blocks.cpu(), bm.full_kv_indices.cpu(), n_kv)
        if bm.full_kv_num_blocks is not None
        else torch.zeros_like(listed)
    )
    seen = listed | full
    assert not bool((any_true & ~seen).any()), "a visible element lies in a block the BlockMask skips"
    assert not bool((full & ~full_true).any()), "a block marked full hides some element"


def build_pool(cfg: SoakConfig) -> list[PoolEntry]:
    """``cfg.pool_size`` registry draws, fixed by the seed: the registered mask names in a random
    order (each once before any repeats), for each a random example at a random length and batch,
    sometimes ``& Causal()``, half the time with a score example, and a dtype; each entry gets the
    named ``registry_routes`` that accept it (``fz.plan`` on empty tensors of its shape) after
    ``auto``."""
    rng = random.Random(cfg.seed * 7_919 + 17)
    names = sorted({name for name, _ in spec_examples("mask", 64, 64, 2, cfg.heads)})
    rng.shuffle(names)
    pool = []
    for i in range(cfg.pool_size):
        length = rng.choice(cfg.lengths)
        batch = rng.choice(cfg.batches)
        mask_name = names[i % len(names)]
        _, mask = rng.choice(spec_examples("mask", length, length, batch, cfg.heads, names=[mask_name]))
        if rng.random() < 0.3:
            mask, mask_name = mask & masks.Causal(), f"{mask_name}&causal"
        score, score_name = None, ""
        if rng.random() < 0.5:
            score_name, score = rng.choice(spec_examples("score", length, length, batch, cfg.heads))
        dtype = rng.choice(cfg.dtypes)
        q = torch.zeros(batch, cfg.heads, length, cfg.head_dim, device=cfg.device, dtype=dtype)
        routes = ["auto"]
        for route in cfg.registry_routes:
            if route == "auto":
                continue
            try:
                fz.plan(q, q, q, mask=mask, score_mod=score, backend=route)
            except ValueError:
                continue
            routes.append(route)
        label = f"{mask_name}{'+' + score_name if score_name else ''} B{batch} L{length} {str(dtype)[6:]}"
        pool.append(PoolEntry(label, mask, score, batch, length, dtype, tuple(routes)))
    return pool


class _Worker:
    """One thread's calls in one round: its RNGs, its ids buffer (rewritten in place)."""

    def __init__(
        self,
        tid: int,
        cfg: SoakConfig,
        round_no: int,
        stats: SoakStats,
        lock: threading.Lock,
        pool: list[PoolEntry],
    ) -> None:
        self.cfg, self.stats, self.lock, self.pool = cfg, stats, lock, pool
        self.rng = random.Random(cfg.seed * 1_000_003 + round_no * 1009 + tid)
        self.gen = torch.Generator(device=cfg.device).manual_seed(self.rng.randrange(2**31))
        # this thread's ids buffer, rewritten in place, and one raw mask_mod over it for all its
        # closure calls (tracked by identity and the buffer's version counter)
        self.buf = buf = torch.zeros(cfg.flex_length, dtype=torch.int64, device=cfg.device)

        def same_doc(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return buf[q_idx] == buf[kv_idx]

        self.same_doc = same_doc

    # ---- helpers --------------------------------------------------------------------------------

    def _pick(self, options: tuple[Any, ...]) -> Any:
        """A random option; no draw for a single one (so the CPU form's draws stay as they were)."""
        return options[0] if len(options) == 1 else self.rng.choice(options)

    def _randn(self, batch: int, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        shape = (batch, self.cfg.heads, length, self.cfg.head_dim)
        return tuple(
            torch.randn(*shape, generator=self.gen, device=self.cfg.device, dtype=dtype) for _ in range(3)
        )

    def _add(self, table: dict[str, int], key: str) -> None:
        with self.lock:
            table[key] = table.get(key, 0) + 1

    def _attend(
        self, kind: str, q: Any, k: Any, v: Any, mask: Any, score: Any, routes: tuple[str, ...], route: Any
    ) -> torch.Tensor:
        if route is None:
            route = self._pick(routes)
        if len(routes) == 1 and route != "auto":  # the CPU form: the one route, called directly
            self._add(self.stats.routes, f"{kind}:{route}")
            return fz.attention(q, k, v, mask=mask, score_mod=score, backend=route)
        try:
            plan = fz.plan(q, k, v, mask=mask, score_mod=score, backend=route)
        except ValueError:
            if route == "auto":
                raise
            self._add(self.stats.refused, f"{kind}:{route}")
            route = "auto"
            plan = fz.plan(q, k, v, mask=mask, score_mod=score, backend=route)
        self._add(self.stats.routes, f"{kind}:{plan.backend}")
        return fz.attention(q, k, v, mask=mask, score_mod=score, backend=route)

    # ---- the four kinds of call -----------------------------------------------------------------

    def doc(self, causal: bool | None = None, dtype: Any = None, route: str | None = None) -> None:
        cfg, rng, buf, n = self.cfg, self.rng, self.buf, self.cfg.flex_length
        q, k, v = self._randn(1, n, self._pick(cfg.dtypes) if dtype is None else dtype)
        buf.copy_(_random_ids(rng, n))
        snapshot = buf.clone()
        if causal is None:
            causal = rng.random() < 0.5
        mask = masks.Document(doc_ids=buf) & masks.Causal() if causal else masks.Document(doc_ids=buf)
        truth = (
            masks.Document(doc_ids=snapshot) & masks.Causal() if causal else masks.Document(doc_ids=snapshot)
        )
        buf.copy_(_random_ids(rng, n))  # after construction: must not reach the spec
        out = self._attend("doc", q, k, v, mask, None, cfg.doc_routes, route)
        assert_matches_reference(out, q, k, v, mask=truth)

    def closure(self, dtype: Any = None, route: str | None = None) -> None:
        cfg, rng, buf, n = self.cfg, self.rng, self.buf, self.cfg.flex_length
        q, k, v = self._randn(1, n, self._pick(cfg.dtypes) if dtype is None else dtype)
        buf.copy_(_random_ids(rng, n))
        truth = masks.Document(doc_ids=buf.clone())
        out = self._attend("closure", q, k, v, self.same_doc, None, cfg.closure_routes, route)
        assert_matches_reference(out, q, k, v, mask=truth)

    def registry(self, entry: PoolEntry | None = None, route: str | None = None) -> None:
        if self.pool:
            if entry is None:
                entry = self.pool[self.rng.randrange(len(self.pool))]
            q, k, v = self._randn(entry.batch, entry.length, entry.dtype)
            out = self._attend("registry", q, k, v, entry.mask, entry.score, entry.routes, route)
            assert_matches_reference(out, q, k, v, mask=entry.mask, score_mod=entry.score)
            return
        cfg, rng, heads = self.cfg, self.rng, self.cfg.heads
        length = rng.choice(cfg.lengths)
        batch = rng.choice(cfg.batches)
        examples = spec_examples("mask", length, length, batch, heads)
        _, mask = rng.choice(examples)
        if rng.random() < 0.3:
            mask = mask & masks.Causal()
        score = None
        if rng.random() < 0.5:
            _, score = rng.choice(spec_examples("score", length, length, batch, heads))
        q, k, v = self._randn(batch, length, self._pick(cfg.dtypes))
        out = self._attend("registry", q, k, v, mask, score, cfg.registry_routes, route)
        assert_matches_reference(out, q, k, v, mask=mask, score_mod=score)

    def block_mask(self) -> None:
        cfg, rng, heads = self.cfg, self.rng, self.cfg.heads
        length = rng.choice(cfg.lengths)
        batch = rng.choice(cfg.batches)
        examples = spec_examples("mask", length, length, batch, heads)
        _, mask = rng.choice(examples)
        if rng.random() < 0.3:
            _, other = rng.choice(examples)
            mask = mask & other if rng.random() < 0.5 else mask | ~other
        elif rng.random() < 0.3:
            mask = mask & masks.Causal()
        bm = fz.block_mask(mask, length, length, batch=batch, heads=heads, device=cfg.device)
        truth_dense = mask.dense(length, length, batch=batch, heads=heads)
        _check_block_mask(bm, truth_dense.cpu(), length, length)

    # ---- a round --------------------------------------------------------------------------------

    def random_calls(self) -> None:
        for _ in range(self.cfg.calls_per_round):
            kind = self.rng.choice(KINDS)
            with self.lock:
                self.stats.count(kind)
            getattr(self, kind)()

    def scripted_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> None:
        for kind, kwargs in calls:
            with self.lock:
                self.stats.count(kind)
            getattr(self, kind)(**kwargs)


def coverage_calls(cfg: SoakConfig, pool: list[PoolEntry]) -> list[tuple[str, dict[str, Any]]]:
    """Every compile-relevant combination once: doc (causal x dtype x route), closure (dtype x
    route), each pool entry on each of its routes, and a few block masks."""
    calls: list[tuple[str, dict[str, Any]]] = []
    for causal in (False, True):
        for dtype in cfg.dtypes:
            calls += [("doc", dict(causal=causal, dtype=dtype, route=r)) for r in cfg.doc_routes]
    for dtype in cfg.dtypes:
        calls += [("closure", dict(dtype=dtype, route=r)) for r in cfg.closure_routes]
    for entry in pool:
        calls += [("registry", dict(entry=entry, route=r)) for r in entry.routes]
    calls += [("block_mask", {})] * cfg.threads
    return calls


def _round_work(
    tid: int,
    cfg: SoakConfig,
    round_no: int,
    stats: SoakStats,
    lock: threading.Lock,
    pool: list[PoolEntry],
    scripted: list[tuple[str, dict[str, Any]]] | None,
) -> None:
    worker = _Worker(tid, cfg, round_no, stats, lock, pool)
    if scripted is not None:
        worker.scripted_calls(scripted[tid :: cfg.threads])
    else:
        worker.random_calls()


class _Rounds:
    """Runs one round's work on ``cfg.threads`` threads: new threads per round, or persistent ones
    parked on a barrier between rounds (each with its own CUDA stream if ``streams="thread"``)."""

    def __init__(self, cfg: SoakConfig, work: Callable[[int, int], None]) -> None:
        self.cfg, self.work = cfg, work
        self.errors: list[BaseException] = []
        self._round = 0
        if cfg.streams not in ("default", "thread"):
            raise ValueError(f"streams must be 'default' or 'thread', got {cfg.streams!r}")
        if cfg.streams == "thread" and torch.device(cfg.device).type != "cuda":
            raise ValueError(f"streams='thread' needs a CUDA device, got {cfg.device!r}")
        self._threads: list[threading.Thread] = []
        if cfg.persistent_threads:
            self._start = threading.Barrier(cfg.threads + 1)
            self._end = threading.Barrier(cfg.threads + 1)
            self._threads = [
                threading.Thread(target=self._loop, args=(t,), daemon=True) for t in range(cfg.threads)
            ]
            for t in self._threads:
                t.start()

    def _run_one(self, tid: int, round_no: int, stream: Any) -> None:
        try:
            if stream is None:
                self.work(tid, round_no)
            else:
                with torch.cuda.stream(stream):
                    self.work(tid, round_no)
                stream.synchronize()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            self.errors.append(exc)

    def _loop(self, tid: int) -> None:
        stream = torch.cuda.Stream(self.cfg.device) if self.cfg.streams == "thread" else None
        try:
            while True:
                self._start.wait()
                self._run_one(tid, self._round, stream)
                self._end.wait()
        except threading.BrokenBarrierError:
            return

    def run(self, round_no: int) -> None:
        self._round = round_no
        if self.cfg.persistent_threads:
            self._start.wait()
            self._end.wait()
        else:
            stream_for = (
                (lambda: torch.cuda.Stream(self.cfg.device)) if self.cfg.streams == "thread" else None
            )
            threads = [
                threading.Thread(
                    target=self._run_one, args=(t, round_no, stream_for() if stream_for else None)
                )
                for t in range(self.cfg.threads)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if self.errors:
            raise self.errors[0]

    def close(self) -> None:
        if self.cfg.persistent_threads:
            self._start.abort()
            self._end.abort()
            for t in self._threads:
                t.join(timeout=60)


def run_soak(cfg: SoakConfig, monkeypatch: pytest.MonkeyPatch) -> SoakStats:
    for (obj, attr), value in SMALL_CACHES.items():
        monkeypatch.setattr(obj, attr, value)
    stats = SoakStats()
    lock = threading.Lock()
    inserts0 = {name: c.inserts for name, c in CACHE_NAMES.items()}
    start = time.perf_counter()
    pool = build_pool(cfg) if cfg.pool_size else []
    stats.pool = [f"{e.name} routes {'/'.join(e.routes)}" for e in pool]
    scripted = coverage_calls(cfg, pool) if cfg.coverage else None

    def work(tid: int, round_no: int) -> None:
        _round_work(tid, cfg, round_no, stats, lock, pool, scripted if round_no == 0 else None)

    rounds = _Rounds(cfg, work)
    try:
        for round_no in range(cfg.rounds):
            calls_before = sum(stats.calls.values())
            reset_device_peak(cfg.device)
            rounds.run(round_no)
            # Cycles holding device tensors (tracebacks, compiler state) go now, and the object
            # count below sees live objects only.
            gc.collect()
            stats.objects.append(len(gc.get_objects()))
            device = device_memory_mb(cfg.device)
            if device is not None:
                stats.device_alloc.append(device[0])
                stats.device_reserved.append(device[1])
                stats.device_peak.append(device[2])
            if cfg.trim_heap:
                trim_heap()
            stats.rss.append(rss_mb())
            stats.compiles.append(COMPILE_CACHE.total_compiles())
            stats.round_calls.append(sum(stats.calls.values()) - calls_before)
            stats.round_seconds.append(time.perf_counter() - start - sum(stats.round_seconds))
            # The library's own tables are bounded whatever the call mix.
            assert len(blockmask.CACHE) <= 4 and len(PLANS) <= 8 and len(flex_backend.CALLS) <= 4
            assert len(spec._MODS) <= 16
    finally:
        rounds.close()
    stats.seconds = time.perf_counter() - start
    stats.caches = {name: (c.inserts - inserts0[name], len(c)) for name, c in CACHE_NAMES.items()}
    return stats


def growth(samples: list[float], warmup_rounds: int) -> float:
    """Largest value after warm-up minus the last warm-up round's value."""
    return max(samples[warmup_rounds - 1 :]) - samples[warmup_rounds - 1]


def _r(values: list[float]) -> list[float]:
    return [round(x, 1) for x in values]


def report(name: str, cfg: SoakConfig, stats: SoakStats) -> dict[str, Any]:
    """Print the soak's numbers (``-s`` shows them) and return them as a JSON-able summary."""
    total = sum(stats.calls.values())
    rss_growth = growth(stats.rss, cfg.warmup_rounds)
    summary: dict[str, Any] = {
        "name": name,
        "device": cfg.device,
        "threads": cfg.threads,
        "streams": cfg.streams if torch.device(cfg.device).type == "cuda" else None,
        "rounds": cfg.rounds,
        "warmup_rounds": cfg.warmup_rounds,
        "calls_per_round_per_thread": cfg.calls_per_round,
        "calls": total,
        "calls_by_kind": dict(sorted(stats.calls.items())),
        "calls_by_route": dict(sorted(stats.routes.items())),
        "named_route_refused": dict(sorted(stats.refused.items())),
        "seconds": round(stats.seconds, 2),
        "round_seconds": [round(t, 2) for t in stats.round_seconds],
        "round_calls": stats.round_calls,
        "compiles_after_round": stats.compiles,
        "cache_inserts_and_length": stats.caches,
        "rss_mb": _r(stats.rss),
        "rss_growth_mb": round(rss_growth, 1),
        "gc_objects": stats.objects,
        "gc_objects_growth": growth(stats.objects, cfg.warmup_rounds) if stats.objects else 0,
        "pool": stats.pool,
    }
    coverage = f" (round 0: every combination once, {stats.round_calls[0]} calls)" if cfg.coverage else ""
    line = (
        f"\n{name}: {cfg.threads} threads, {cfg.rounds} rounds of {cfg.calls_per_round} calls per thread"
        f"{coverage}, {total} calls in all "
        f"in {stats.seconds:.1f} s (rounds {[round(t, 1) for t in stats.round_seconds]}); by kind "
        f"{dict(sorted(stats.calls.items()))}; RSS MiB after each round {_r(stats.rss)}; growth after "
        f"warm-up {rss_growth:.1f} MiB; spec._EQ_MEMO {len(spec._EQ_MEMO)}, spec._OWNED {len(spec._OWNED)}"
    )
    print(line)
    if stats.device_alloc:
        alloc_growth = growth(stats.device_alloc, cfg.warmup_rounds)
        summary.update(
            device_alloc_mb=_r(stats.device_alloc),
            device_reserved_mb=_r(stats.device_reserved),
            device_peak_mb=_r(stats.device_peak),
            device_alloc_growth_mb=round(alloc_growth, 2),
            device_max_memory_allocated_mb=round(max(stats.device_peak), 1),
        )
        warm = cfg.warmup_rounds - 1
        print(
            f"  device memory MiB: allocated first {stats.device_alloc[0]:.1f}, warm-up "
            f"{stats.device_alloc[warm]:.1f}, last {stats.device_alloc[-1]:.1f}, max after warm-up "
            f"{max(stats.device_alloc[warm:]):.1f} (growth {alloc_growth:.2f}); per round {_r(stats.device_alloc)}"
        )
        print(
            f"  device max_memory_allocated MiB per round {_r(stats.device_peak)} (max "
            f"{max(stats.device_peak):.1f}); reserved per round {_r(stats.device_reserved)}"
        )
    if stats.routes:
        print(
            f"  routes that ran: {dict(sorted(stats.routes.items()))}; named routes refused: {stats.refused}"
        )
    print(f"  compiles after each round {stats.compiles}; calls per round {stats.round_calls}")
    print(f"  cache (inserts during the soak, length at the end): {stats.caches}")
    for entry in stats.pool:
        print(f"  pool: {entry}")
    return summary


def write_summary(summary: dict[str, Any], env: str) -> None:
    """Write ``summary`` as JSON to the path in the environment variable ``env``, if set."""
    path = os.environ.get(env)
    if path:
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)


def calls_per_round(total_calls: int, threads: int, random_rounds: int) -> int:
    """Per-thread calls per random round for about ``total_calls`` random calls in all."""
    return max(1, math.ceil(total_calls / (threads * random_rounds)))


# ---- the GPU form (tests/gpu/test_soak_gpu.py; rehearsed on the CPU) -----------------------------

CALLS_ENV = "FLEXATTN_ZOO_SOAK_CALLS"
STREAMS_ENV = "FLEXATTN_ZOO_SOAK_STREAMS"
SUMMARY_ENV = "FLEXATTN_ZOO_SOAK_SUMMARY"
#: Growth of ``torch.cuda.memory_allocated()`` allowed after warm-up, in MiB. What the library
#: keeps on the device lives in the shrunk LRUs, full after warm-up, and is small: spec copies
#: (ids of <= 1024 int64, 8 KiB), BlockMasks of <= 8 x 8 blocks, cu_seqlens; under 1 MiB in all.
#: Measured on an H200 (torch 2.11, 4,400 and 10,000 calls): 0.04-0.06 MiB. Per-thread cuBLAS workspaces (tens of MiB each) are
#: made in warm-up: the threads persist and every one of them runs matmuls in rounds 0 and 1.
#: Leaking the inputs or output of one call (q/k/v are 0.03-1 MiB each here) or one spec /
#: BlockMask per call (>= 4 KiB with the allocator's 512-byte rounding, ~400 calls a round)
#: exceeds it within a few rounds.
DEVICE_ALLOC_GROWTH_BOUND_MB = 8.0
#: Growth of the resident set (after ``malloc_trim``) allowed after warm-up, in MiB: a coarse
#: backstop for leaks outside Python's objects and the device (the CUDA driver's and compiled
#: kernels' host state); Python-level leaks are caught precisely by the object count below.
#: Measured on an H200 (torch 2.11, 8 threads): RSS rises over the first four or five rounds
#: (1760-1880 -> 1910-2090 MiB), then by 29-79 MiB more over the eight rounds after warm-up in
#: eight runs of 10,000 calls (stepwise, steps of up to 40 MiB), and by 89 MiB in a run of 3,000
#: calls: the rise follows rounds more than calls, while the collector's object count and
#: device memory stay flat, so it is not the library's Python state or tensors, nor glibc's
#: per-thread arenas (``MALLOC_ARENA_MAX=2``: +91 MiB at 3,000 calls); what raises it is not
#: established. A leak of 18 KiB per call (7,300 calls after warm-up) exceeds the bound.
RSS_GROWTH_BOUND_MB_GPU = 128.0
#: Growth allowed, after warm-up, in the number of objects Python's garbage collector tracks
#: (containers: what a spec, plan, closure or tensor is made of; sampled after ``gc.collect()``):
#: half an object per call after warm-up, at least ``OBJECT_GROWTH_FLOOR``. Bounded tables full by
#: the end of warm-up leave no trend; the count wanders by a few hundred (CPU, 1,440 calls after
#: warm-up: +515 at most, falling back after; H200, 2,240 calls: +117). Leaking one object per
#: call, or a spec, plan or closure (several objects) in every few calls, exceeds it.
OBJECT_GROWTH_PER_CALL = 0.5
OBJECT_GROWTH_FLOOR = 1000

#: Random calls of the GPU form by default (plus about 40 in the coverage round).
GPU_DEFAULT_CALLS = 10000
#: Routes per kind of the GPU form: ``auto`` (SDPA / cuDNN / varlen / Triton flex, or FA4 and
#: flex_flash where flash-attn-4 is installed) and named routes, each taken only where ``fz.plan``
#: says it accepts the call (else ``auto`` runs, counted as a refusal).
GPU_ROUTES = {
    "doc": ("auto", "flex", "varlen"),
    "closure": ("auto", "flex"),
    "registry": ("auto", "flex", "sdpa_cudnn", "varlen"),
}


def gpu_form_config(
    device: str = "cuda",
    total_calls: int = GPU_DEFAULT_CALLS,
    streams: str = "default",
    routes: dict[str, tuple[str, ...]] | None = None,
    **overrides: Any,
) -> SoakConfig:
    """The GPU form: 8 persistent threads, 12 rounds (round 0 the coverage round, rounds 1-3
    random warm-up), bf16 and fp16, heads 4, head dim 64, doc / closure calls at L=1000 (not a multiple of
    128: a partial last block), a pool of 8 registry draws at lengths up to 1024, batch 1 or 2.
    ``device="cpu"`` with CPU routes rehearses it without a GPU.

    Time on an H200 (an estimate, not yet measured): round 0 compiles about 15 Triton flex kernels
    without flash-attn-4 (Document, Document & Causal and the closure in two dtypes, one per pool
    entry), a few seconds each, so about a minute; the ``total_calls`` random calls after it
    (``GPU_DEFAULT_CALLS`` by default) are host-bound (each builds inputs, runs the route and the
    float64 reference, and compares). With flash-attn-4, auto also compiles FA4 / flex_flash kernels in round 0."""
    routes = routes or GPU_ROUTES
    threads, rounds = overrides.pop("threads", 8), overrides.pop("rounds", 12)
    cfg = dict(
        threads=threads,
        rounds=rounds,
        warmup_rounds=4,
        calls_per_round=calls_per_round(total_calls, threads, rounds - 1),
        lengths=(64, 200, 333, 512, 1024),
        flex_length=1000,
        batches=(1, 2),
        registry_routes=routes["registry"],
        seed=3,
        device=device,
        dtypes=(torch.bfloat16, torch.float16),
        heads=4,
        head_dim=64,
        doc_routes=routes["doc"],
        closure_routes=routes["closure"],
        pool_size=8,
        coverage=True,
        persistent_threads=True,
        streams=streams,
        trim_heap=True,
    )
    cfg.update(overrides)
    return SoakConfig(**cfg)


def gpu_form_soak(monkeypatch: pytest.MonkeyPatch, device: str = "cuda", **config: Any) -> dict[str, Any]:
    """Run the GPU form on ``device`` (knobs from the environment: ``CALLS_ENV``, ``STREAMS_ENV``,
    ``SUMMARY_ENV``), print and write its numbers, check them; return the summary.
    ``device="cpu"`` (with CPU ``routes=`` and smaller ``config``) rehearses the same code without
    a GPU: no ``torch.cuda`` call is made then, so there are no device-memory samples."""
    cfg = gpu_form_config(
        device=device,
        total_calls=int(os.environ.get(CALLS_ENV) or GPU_DEFAULT_CALLS),
        streams=os.environ.get(STREAMS_ENV) or "default",
        **config,
    )
    on_cuda = torch.device(device).type == "cuda"
    stats = run_soak(cfg, monkeypatch)
    summary = report(
        f"soak (GPU form, {torch.cuda.get_device_name(device) if on_cuda else device})", cfg, stats
    )
    summary.update(
        torch=torch.__version__,
        device_alloc_growth_bound_mb=DEVICE_ALLOC_GROWTH_BOUND_MB,
        rss_growth_bound_mb=RSS_GROWTH_BOUND_MB_GPU,
        gc_objects_growth_bound=object_growth_bound(stats, cfg),
    )
    write_summary(summary, SUMMARY_ENV)
    random_calls = cfg.threads * (cfg.rounds - 1) * cfg.calls_per_round
    assert sum(stats.calls.values()) > random_calls  # plus the coverage round
    if on_cuda:
        assert len(stats.device_alloc) == cfg.rounds
    if stats.device_alloc:
        alloc_growth = growth(stats.device_alloc, cfg.warmup_rounds)
        assert alloc_growth <= DEVICE_ALLOC_GROWTH_BOUND_MB, (
            f"torch.cuda.memory_allocated() grew {alloc_growth:.2f} MiB after warm-up (bound "
            f"{DEVICE_ALLOC_GROWTH_BOUND_MB}): {_r(stats.device_alloc)}"
        )
    rss_growth = growth(stats.rss, cfg.warmup_rounds)
    assert rss_growth < RSS_GROWTH_BOUND_MB_GPU, (
        f"RSS grew {rss_growth:.1f} MiB after warm-up (bound {RSS_GROWTH_BOUND_MB_GPU}): {_r(stats.rss)}"
    )
    object_growth = growth(stats.objects, cfg.warmup_rounds)
    assert object_growth <= object_growth_bound(stats, cfg), (
        f"Python objects grew by {object_growth} after warm-up (bound {object_growth_bound(stats, cfg)}): "
        f"{stats.objects}"
    )
    return summary


def object_growth_bound(stats: SoakStats, cfg: SoakConfig) -> int:
    """``OBJECT_GROWTH_PER_CALL`` objects per call made after the last warm-up round, at least
    ``OBJECT_GROWTH_FLOOR``."""
    calls_after_warmup = sum(stats.round_calls[cfg.warmup_rounds :])
    return max(OBJECT_GROWTH_FLOOR, int(OBJECT_GROWTH_PER_CALL * calls_after_warmup))
