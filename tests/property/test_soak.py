"""Soak: many threads, many random calls, small caches, buffers rewritten in place between calls.

Every result is compared with the float64 reference (or, for BlockMasks, with the spec's dense
oracle at block level), so a cache that ever serves an entry for another value -- a stale
BlockMask after an in-place write, a spec mistaken for one with a colliding hash, an entry torn by
a concurrent eviction -- fails here. The caches are shrunk (monkeypatched) so eviction happens
all the time under load.

What a call does (random per call, per thread):

* ``doc``: refill the thread's ids buffer in place, build a *new* ``Document`` over it (half the
  time ``& Causal()``), write the buffer again before the call (the spec must not see it), and
  run attention on ``flex_cpu`` against a ``Document`` of the snapshot;
* ``closure``: refill the buffer in place and run attention with a raw ``mask_mod`` closure over
  it (its BlockMask must follow the buffer's version);
* ``registry``: a random example of every registered mask and score spec (``examples()``), run on
  the ``dense`` route;
* ``block_mask``: ``fz.block_mask`` of a random registry example or composite, checked for
  soundness at block level: no visible element outside a listed block, every full block fully
  visible.

Shapes come from fixed buckets so the compiled kernels stay bounded: both forms compile three flex
kernels (document, document & causal, the closure) at one shape; registry specs run on the
``dense`` route (``auto`` on the CPU would compile one kernel per spec value and length: every
window size is baked into its kernel) and reach the BlockMask cache through ``block_mask`` calls.

Memory: resident set size (``/proc/self/statm``) is sampled after every round; after the warm-up
rounds (which compile kernels and fill the caches to their bounds) it must stay within a bound
(see ``RSS_GROWTH_BOUND_MB``). ``test_soak_short`` runs in CI (< 60 s on 2 cores);
``test_soak_long`` is marked ``slow``. Both print their numbers (``-s`` shows them).
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import blockmask, masks, segments, spec
from flexattn_zoo.backends import flex as flex_backend
from flexattn_zoo.backends import varlen
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


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20


@dataclass
class SoakConfig:
    threads: int
    rounds: int
    warmup_rounds: int
    calls_per_round: int  # per thread
    lengths: tuple[int, ...]  # for block masks and dense / auto attention
    flex_length: int  # doc / closure calls (one shape: one compile per kernel)
    batches: tuple[int, ...]
    attention_route: str  # registry specs' route
    seed: int = 0


@dataclass
class SoakStats:
    calls: dict[str, int] = field(default_factory=dict)
    rss: list[float] = field(default_factory=list)
    round_seconds: list[float] = field(default_factory=list)
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
    """Soundness of ``bm`` for the dense mask ``truth`` ``[B|1, H|1, Lq, Lkv]``."""
    qb, kvb = bm.BLOCK_SIZE
    n_q, n_kv = -(-q_len // qb), -(-kv_len // kvb)
    padded = torch.zeros(*truth.shape[:2], n_q * qb, n_kv * kvb, dtype=torch.bool)
    padded[..., :q_len, :kv_len] = truth
    tiles = padded.view(*truth.shape[:2], n_q, qb, n_kv, kvb)
    any_true = tiles.any(5).any(3)
    valid = torch.zeros_like(padded)
    valid[..., :q_len, :kv_len] = True
    full_true = (tiles | ~valid.view_as(tiles)).all(5).all(3) & valid.view_as(tiles).all(5).all(3)
    listed = _dense_blocks(bm.kv_num_blocks, bm.kv_indices, n_kv)
    full = (
        _dense_blocks(bm.full_kv_num_blocks, bm.full_kv_indices, n_kv)
        if bm.full_kv_num_blocks is not None
        else torch.zeros_like(listed)
    )
    seen = listed | full
    assert not bool((any_true & ~seen).any()), "a visible element lies in a block the BlockMask skips"
    assert not bool((full & ~full_true).any()), "a block marked full hides some element"


def _worker(tid: int, cfg: SoakConfig, round_no: int, stats: SoakStats, lock: threading.Lock) -> None:
    rng = random.Random(cfg.seed * 1_000_003 + round_no * 1009 + tid)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    n = cfg.flex_length
    buf = torch.zeros(n, dtype=torch.int64)  # this thread's ids buffer, rewritten in place

    def same_doc(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return buf[q_idx] == buf[kv_idx]

    kinds = ("doc", "closure", "registry", "block_mask")
    for _ in range(cfg.calls_per_round):
        kind = rng.choice(kinds)
        with lock:
            stats.count(kind)
        heads = 2
        if kind in ("doc", "closure"):
            q, k, v = (torch.randn(1, heads, n, 16, generator=gen) for _ in range(3))
            buf.copy_(_random_ids(rng, n))
            if kind == "doc":
                snapshot = buf.clone()
                causal = rng.random() < 0.5
                mask = masks.Document(doc_ids=buf) & masks.Causal() if causal else masks.Document(doc_ids=buf)
                truth = (
                    masks.Document(doc_ids=snapshot) & masks.Causal()
                    if causal
                    else masks.Document(doc_ids=snapshot)
                )
                buf.copy_(_random_ids(rng, n))  # after construction: must not reach the spec
            else:
                mask, truth = same_doc, masks.Document(doc_ids=buf.clone())
            out = fz.attention(q, k, v, mask=mask, backend="flex_cpu")
            assert_matches_reference(out, q, k, v, mask=truth)
            continue
        length = rng.choice(cfg.lengths)
        batch = rng.choice(cfg.batches)
        examples = spec_examples("mask", length, length, batch, heads)
        _, mask = rng.choice(examples)
        if kind == "block_mask" and rng.random() < 0.3:
            _, other = rng.choice(examples)
            mask = mask & other if rng.random() < 0.5 else mask | ~other
        elif rng.random() < 0.3:
            mask = mask & masks.Causal()
        if kind == "block_mask":
            bm = fz.block_mask(mask, length, length, batch=batch, heads=heads)
            truth_dense = mask.dense(length, length, batch=batch, heads=heads)
            _check_block_mask(bm, truth_dense.cpu(), length, length)
            continue
        score = None
        if rng.random() < 0.5:
            _, score = rng.choice(spec_examples("score", length, length, batch, heads))
        q, k, v = (torch.randn(batch, heads, length, 16, generator=gen) for _ in range(3))
        out = fz.attention(q, k, v, mask=mask, score_mod=score, backend=cfg.attention_route)
        assert_matches_reference(out, q, k, v, mask=mask, score_mod=score)


def run_soak(cfg: SoakConfig, monkeypatch: pytest.MonkeyPatch) -> SoakStats:
    for (obj, attr), value in SMALL_CACHES.items():
        monkeypatch.setattr(obj, attr, value)
    stats = SoakStats()
    lock = threading.Lock()
    start = time.perf_counter()
    for round_no in range(cfg.rounds):
        errors: list[BaseException] = []

        def work(tid: int, round_no: int = round_no, errors: list[BaseException] = errors) -> None:
            try:
                _worker(tid, cfg, round_no, stats, lock)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(cfg.threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        stats.rss.append(rss_mb())
        stats.round_seconds.append(time.perf_counter() - start - sum(stats.round_seconds))
        # The library's own tables are bounded whatever the call mix.
        assert len(blockmask.CACHE) <= 4 and len(PLANS) <= 8 and len(flex_backend.CALLS) <= 4
        assert len(spec._MODS) <= 16
    stats.seconds = time.perf_counter() - start
    return stats


def _report(name: str, cfg: SoakConfig, stats: SoakStats) -> float:
    warm = stats.rss[cfg.warmup_rounds - 1]
    growth = max(stats.rss[cfg.warmup_rounds - 1 :]) - warm
    total = sum(stats.calls.values())
    print(
        f"\n{name}: {cfg.threads} threads x {cfg.rounds} rounds x {cfg.calls_per_round} calls = {total} calls "
        f"in {stats.seconds:.1f} s (rounds {[round(t, 1) for t in stats.round_seconds]}); by kind {dict(sorted(stats.calls.items()))}; RSS MiB after each round "
        f"{[round(r, 1) for r in stats.rss]}; growth after warm-up {growth:.1f} MiB "
        f"(bound {RSS_GROWTH_BOUND_MB}); spec._EQ_MEMO {len(spec._EQ_MEMO)}, spec._OWNED {len(spec._OWNED)}"
    )
    return growth


def test_soak_short(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = SoakConfig(
        threads=4,
        rounds=7,
        warmup_rounds=2,
        calls_per_round=12,
        lengths=(16, 48, 128, 200),
        flex_length=256,
        batches=(1, 2),
        attention_route="dense",
        seed=1,
    )
    stats = run_soak(cfg, monkeypatch)
    growth = _report("soak (short)", cfg, stats)
    assert sum(stats.calls.values()) == cfg.threads * cfg.rounds * cfg.calls_per_round
    assert growth < RSS_GROWTH_BOUND_MB


@pytest.mark.slow
def test_soak_long(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = SoakConfig(
        threads=8,
        rounds=30,
        warmup_rounds=3,
        calls_per_round=60,
        lengths=(16, 48, 64, 128, 200, 256),
        flex_length=256,
        batches=(1, 2),
        attention_route="dense",
        seed=2,
    )
    stats = run_soak(cfg, monkeypatch)
    growth = _report("soak (long)", cfg, stats)
    assert growth < RSS_GROWTH_BOUND_MB
