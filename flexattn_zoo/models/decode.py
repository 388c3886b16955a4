"""KV-cache decoding: a few new queries against a long cache, without rebuilding masks per step.

``decode_step(q, k_cache, v_cache, cache_len)`` attends the newest ``Lq`` tokens (already written
into the cache at positions ``cache_len - Lq .. cache_len - 1``) to the first ``cache_len`` cached
keys, under a pattern given over *absolute* positions (``mask=``, default ``Causal()``; e.g.
``SlidingWindow.from_hf(4096)`` or ``Chunked(8192) & Causal()``), with score mods and sinks.

Design: one BlockMask per (pattern, batch, Lq, cache capacity) and calling thread, built once
and **updated in place** each step. Its ``mask_mod`` and the score mods read the current lengths
from a captured int32 tensor ``cache_len[b]`` (a query's absolute position is
``cache_len[b] - Lq + q_idx``); the per-step update writes that tensor and the kv block list
(``kv_num_blocks``/``kv_indices``: the blocks from the pattern's lowest visible key to
``cache_len - 1``) with a few device ops, no host sync and no new objects. So the compiled kernel
(keyed by the ``mask_mod`` object), the BlockMask and all tensor shapes stay the same from step to
step: no rebuild, no recompile, and the kernel reads only the live blocks of the cache, not its
capacity. Why not the alternatives: ``fz.attention`` with a ``Causal(align="bottom_right")`` per
step shares one kernel too (its offset is a captured tensor) but builds a new BlockMask every
step and needs the cache sliced to each length (a dynamic-shape kernel); bucketing lengths
bounds the shapes but still rebuilds masks. Per thread because the mask is state: shared, one
thread's update could land between another's update and its kernel (see :func:`_caller`).
The q-side block indices are not maintained (they only serve the backward): decoding with
inputs that require grad takes the exact ``dense`` route instead.

Paged KV (``block_table=``): the cache is a pool of pages and ``block_table[b, p]`` is the
physical page of row ``b``'s logical page ``p``. Pools come in the serving stacks' layouts
(``kv_layout="NHD"``: ``[n_pages, page_size, Hkv, D]``, vLLM / FlashAttention / FlashInfer;
``"HND"``: ``[n_pages, Hkv, page_size, D]``), any page size, read in place through a strided view
(:func:`pool_view`), or in flexattn_zoo's own ``[1, Hkv, n_pages * block_size, D]``. The BlockMask
then lists physical pages (one flex kv block per page) and the ``mask_mod`` maps a physical key
index back to its logical position through a captured page-to-position table (updated in place
like the lengths). :func:`append_kv` writes new tokens into the pools through the block table;
``fz.pages.PageAllocator`` owns a block table and the lengths, hands out pages from a free list
and writes through ``append_kv``.
On CUDA with torch >= 2.13, :func:`decode_step_varlen` runs the same paged decode on
FlashAttention's varlen kernel (``block_table`` + ``seqused_k``) for causal or sliding-window
patterns.

Serving: a step is planned (validated and routed) once per call signature (:func:`run_signature`;
on the CPU it includes whether q and the cache hold NaN/inf, which the inputs are scanned for
every step, as ``fz.attention`` does). On CUDA a step is capturable in a CUDA graph: capture one ``decode_step`` call, then write ``cache_len`` (a device
tensor) and the new tokens in place and replay; nothing syncs with the host or reallocates.
Eager steps cost ~0.3 ms of host time on an H200 host, graphed ones run at the kernel's speed
(benchmarks/results/decode_h200.md). A graph-captured mask is kept alive whatever the cache
drops (:data:`CAPTURED`). Values held in CUDA tensors (``cache_len``, ``block_table``) are not
checked (that would be a sync); block counts and page numbers are clamped instead, so bad values
can never make the kernel read outside the cache. Ints and CPU tensors are checked. A contiguous
cache of >= 2**31 elements is decoded a slice of rows at a time (see
``backends.flex.MAX_FLEX_ELEMENTS``).

Routes: one query per row under the default causal pattern with an int ``cache_len`` (no score
mod, sinks, lse, pages or gradients: a plain generation step) is SDPA over the cache's live
prefix ``cache[:, :, :cache_len]``, which that query sees exactly, read in place, no DecodeMask
(eager host time of a plain SDPA call instead of a flex launch and a mask update), except on
CUDA over long caches with many rows (8192 keys and 256 (batch x kv head) rows or more), where
FlashAttention-2 leaves half of HBM bandwidth unused and the flex kernel, splitting the keys,
does not. Otherwise CUDA uses ``flex`` (any pattern, score mod, lse and sinks); CPU uses ``flex_cpu`` when
no lse is needed (no sinks, no ``return_lse``), else the ``dense`` route over the live prefix of
the cache (the pages gathered for paged caches): exact, but it materialises ``Lq x cache_len``.
Pages smaller than a device's flex minimum (:data:`MIN_FLEX_PAGE`: 16 keys on CUDA) take that
``dense`` route too.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Hashable
from typing import Any, Literal, overload

import torch
import torch.nn.functional as F

from flexattn_zoo import _compat, sharding
from flexattn_zoo.arch import SPLIT_DECODE_MIN_KV_LEN, SPLIT_DECODE_MIN_KV_ROWS
from flexattn_zoo.backends import BACKENDS, BY_NAME
from flexattn_zoo.backends.base import fused_layout, prefixes_are_dense_blocks
from flexattn_zoo.backends.flex import MAX_FLEX_ELEMENTS, FlexBackend, FlexCall
from flexattn_zoo.backends.sdpa import SDPA_LOCK
from flexattn_zoo.coercion import as_mask_spec, as_score_spec
from flexattn_zoo.dispatch import _under_autocast, attention, execute_plan, needs_grad, plan
from flexattn_zoo.functions import FunctionMask, FunctionScore
from flexattn_zoo.lru import LRUCache
from flexattn_zoo.masks import Causal
from flexattn_zoo.models.sinks import apply_sinks, check_sinks
from flexattn_zoo.plan_cache import process_state
from flexattn_zoo.spec import MaskSpec
from flexattn_zoo.validation import (
    aligned_qkv_acceptable,
    check_qkv,
    check_scale,
    inputs_nonfinite,
    qkv_acceptable,
)

__all__ = ["DecodeMask", "append_kv", "decode_step", "decode_step_varlen", "lowest_key", "pool_view"]

DEFAULT_BLOCK_SIZE = 128
#: Page layouts ``decode_step(kv_layout=...)`` and :func:`append_kv` take: the serving stacks'
#: KV pools (vLLM, FlashInfer, FlashAttention), one per k and v.
KV_LAYOUTS = ("NHD", "HND")
KV_LAYOUT_SHAPES = {"NHD": "[n_pages, page_size, Hkv, D]", "HND": "[n_pages, Hkv, page_size, D]"}
#: The smallest kv block (page) a flex kernel takes, per device type (others: any). CUDA: the
#: Triton kernels tile keys in blocks of >= 16 (tl.dot), which must divide the kv block.
MIN_FLEX_PAGE = {"cuda": 16}
#: The default pattern, one object (a spec is immutable): the DecodeMask cache key then hashes
#: and compares it by identity instead of a new spec's fields every step.
_CAUSAL = Causal()
#: What ``decode_step(backend=...)`` takes: "auto" and the routes that declare ``decode``.
DECODE_ROUTES = ("auto", *(b.name for b in BACKENDS if b.decode))
#: DecodeMask objects kept by ``decode_step`` (least recently used dropped first); one per
#: (pattern, shape, calling thread), so a few threads with a few shapes each fit.
DECODE_CACHE_SIZE = 64
#: Planned call signatures kept per DecodeMask (dtypes, score mods... seen with it).
RUNS_PER_MASK = 16


def _cpu_hazards(spec: Any, score: Any) -> tuple[str, ...]:
    """:meth:`Spec.flex_cpu_hazards` of the step's mask and score specs, each phrase once."""
    found = (*(spec.flex_cpu_hazards() if spec is not None else ()),
             *(score.flex_cpu_hazards() if score is not None else ()))  # fmt: skip
    return tuple(dict.fromkeys(found))


def lowest_key(spec: MaskSpec | None, q_abs: torch.Tensor) -> torch.Tensor:
    """A lower bound on the keys the pattern lets absolute queries ``q_abs`` (int64) see: the
    spec's ``lowest_visible_key``, or 0 where it offers none.

    Used only to skip kv blocks, so any lower bound is correct; a tight one saves bandwidth. It
    never decreases with the query position, so the bound of a q block's first query holds for
    the whole block.
    """
    bound = spec.lowest_visible_key(q_abs) if spec is not None else None
    return torch.zeros_like(q_abs) if bound is None else bound


def _bounded_below(spec: MaskSpec | None, device: torch.device | str = "cpu") -> bool:
    """Whether :func:`lowest_key` can be above 0 for ``spec`` (else every row's blocks start at 0);
    ``device``: where the spec's tensors live."""
    probe = torch.zeros(1, dtype=torch.int64, device=device)
    return spec is not None and spec.lowest_visible_key(probe) is not None


class DecodeMask:
    """A decode BlockMask for ``q_len`` new queries per row, updated in place by :meth:`update`.

    Args:
        spec: the pattern over absolute positions (None: every cached key is visible).
        batch, q_len: rows and new queries per row.
        capacity: cache capacity in tokens (logical; for paged caches the block-table width
            times ``block_size``).
        n_physical: number of physical kv blocks (pages) when paged, else None.
        device: where the cache lives.
        block_size: kv block (page) size; also the q block size unless ``q_block_size`` is given.
        q_block_size: q block size (None: ``block_size``).
    """

    def __init__(
        self,
        spec: MaskSpec | None,
        batch: int,
        q_len: int,
        capacity: int,
        *,
        n_physical: int | None = None,
        device: torch.device | str = "cpu",
        block_size: int = DEFAULT_BLOCK_SIZE,
        q_block_size: int | None = None,
    ) -> None:
        # On the cache's device: the mask_mod captures the spec's tensors (document ids, offsets).
        self.spec = spec.bind(capacity, capacity).to(device) if spec is not None else None
        self.batch, self.q_len, self.block_size = batch, q_len, block_size
        self.q_block_size = block_size if q_block_size is None else q_block_size
        self.paged = n_physical is not None
        self.n_logical = -(-capacity // block_size)
        n_kv = n_physical if n_physical is not None else self.n_logical
        self.kv_len = n_kv * block_size if self.paged else capacity
        n_q = -(-q_len // self.q_block_size)
        device = torch.device(device)
        i32 = torch.int32
        self.cache_len = torch.zeros(batch, dtype=i32, device=device)
        # Physical page -> first logical position stored in it (see update); one spare column.
        self.page_start = torch.full((batch, n_kv + 1), -block_size, dtype=i32, device=device)
        # Logical page -> whether the row owns a physical page there (block_table entry in the
        # pool): the dense route reads the pages gathered in logical order, and a -1 entry below
        # a row's length (a page a sliding window freed) must stay invisible there too.
        self.page_owned = torch.ones(batch, self.n_logical, dtype=torch.bool, device=device)
        self._logical = _page_map(self.page_start, block_size)
        self.kv_num_blocks = torch.zeros(batch, 1, n_q, dtype=i32, device=device)
        self.kv_indices = (
            torch.arange(n_kv, dtype=i32, device=device).view(1, 1, 1, n_kv).repeat(batch, 1, n_q, 1)
        )
        self._q_starts = torch.arange(n_q, dtype=torch.int64, device=device) * self.q_block_size
        self._steps = torch.arange(n_kv, dtype=torch.int64, device=device)
        # Blocks 0 .. last for every row when the pattern has no lower bound on a contiguous cache:
        # kv_indices never changes, and update() writes only the lengths and counts (one or two
        # fills for an int length, four ops for a tensor, instead of about 20).
        self._indices_fixed = not self.paged and not _bounded_below(self.spec, device)
        self.logical_mask_mod = self._make_mod(paged=False)
        self.mask_mod = self._make_mod(paged=self.paged)
        # No block is marked "full" (mask_mod runs on every live block: cheap next to reading the
        # cache). On CUDA no full-block tensors either: with them torch's decoding kernel splits
        # the whole capacity among its CTAs instead of the live blocks. On the CPU empty ones are
        # passed: torch 2.13's CPU flex template fails to compile some masks without them.
        on_cpu = device.type == "cpu"
        self.block_mask = _compat.BlockMask.from_kv_blocks(
            self.kv_num_blocks,
            self.kv_indices,
            torch.zeros_like(self.kv_num_blocks) if on_cpu else None,
            self.kv_indices.clone() if on_cpu else None,
            BLOCK_SIZE=(self.q_block_size, block_size),
            mask_mod=self.mask_mod,
            seq_lengths=(q_len, self.kv_len),
        )
        #: The block count update() last wrote for every row from the host (None: unknown), and
        #: whether a CUDA graph captured an update of this mask (see _fill_count).
        self._count_written: int | None = None
        self.captured = False
        self._scores: dict[Hashable, Any] = {}
        #: decode_step's plans (fz.plan results, as :class:`_Run`) per call signature, so later
        #: steps skip validation and route choice (host time that dominated short steps on the H200).
        self.runs: LRUCache[_Run] = LRUCache(RUNS_PER_MASK)

    @property
    def offset(self) -> torch.Tensor:
        """``cache_len - Lq`` per row, the absolute position of each row's first new query (a new
        tensor). The mods work it out from ``cache_len`` in the kernel rather than read a tensor of
        its own: one device op fewer per step (a kernel launch on CUDA)."""
        return self.cache_len - self.q_len

    def _make_mod(self, *, paged: bool) -> Any:
        inner = self.spec.mask_mod() if self.spec is not None else None
        cache_len, logical, q_len = self.cache_len, self._logical, self.q_len
        if not paged and self.paged:
            return self._make_gathered_mod(inner)

        def decode_mask(b, h, q_idx, kv_idx):
            kv = logical(b, kv_idx) if paged else kv_idx
            out = (kv < cache_len[b]) & (kv >= 0)
            if inner is not None:
                out = out & inner(b, h, q_idx + (cache_len[b] - q_len), kv)
            return out

        return decode_mask

    def _make_gathered_mod(self, inner: Any) -> Any:
        """The mask over a paged cache's pages gathered in logical order (the dense route): keys
        of logical pages the row does not own are invisible, as they are on the flex route."""
        cache_len, owned, q_len, page = self.cache_len, self.page_owned, self.q_len, self.block_size

        def decode_gathered_mask(b, h, q_idx, kv_idx):
            out = (kv_idx < cache_len[b]) & owned[b, kv_idx // page]
            if inner is not None:
                out = out & inner(b, h, q_idx + (cache_len[b] - q_len), kv_idx)
            return out

        return decode_gathered_mask

    def _fill_count(self, count: int) -> None:
        """Set every row's block count to ``count`` (int lengths on a fixed block list).

        Skipped when the count this method last wrote is still there: it moves once every
        ``block_size`` tokens, so most steps launch one fill instead of two. Every other writer
        of the counts (the tensor paths of :meth:`update`) forgets that record, and a mask a CUDA
        graph captured never keeps one: a replay writes the counts without Python seeing it.
        """
        if count != self._count_written:
            self.kv_num_blocks.fill_(count)
        self._count_written = None if self.captured else count

    def _mark_captured(self) -> None:
        """A CUDA graph is capturing this mask's update: it will rewrite the mask on every replay,
        and a replay must find its tensors alive (:data:`CAPTURED`, whatever the LRU drops)."""
        self.captured = True
        self._count_written = None
        CAPTURED.add(self)

    def score_mod(self, inner: Any, *, paged: bool | None = None) -> Any:
        """``inner`` (a flex score_mod over absolute positions) seen through this mask's lengths;
        one function object per ``inner`` so compiled kernels are reused."""
        paged = self.paged if paged is None else paged
        key = (inner, paged)
        if key not in self._scores:
            cache_len, logical, q_len = self.cache_len, self._logical, self.q_len

            def decode_score(score, b, h, q_idx, kv_idx):
                kv = logical(b, kv_idx) if paged else kv_idx
                return inner(score, b, h, q_idx + (cache_len[b] - q_len), kv)

            self._scores[key] = decode_score
        return self._scores[key]

    def score_spec(self, inner: Any) -> FunctionScore:
        """:meth:`score_mod` of ``inner`` as a spec, one object per ``inner`` (a stable plan key)."""
        key = ("spec", inner)
        if key not in self._scores:
            # Untracked: its closure reads the lengths update() rewrites in place every step, and
            # only kernels read them (nothing cached derives from their values).
            self._scores[key] = FunctionScore(fn=self.score_mod(inner), label="decode", tracked=False)
        return self._scores[key]

    def update(
        self, cache_len: torch.Tensor | int, block_table: torch.Tensor | None = None
    ) -> _compat.BlockMask:
        """Point the mask at the current lengths (and pages); returns the same BlockMask object.

        ``cache_len``: ``[B]`` lengths, or one int for every row. Only device ops on preallocated
        tensors, no host sync: a CUDA graph can capture it (with a tensor ``cache_len``; an int is
        a constant of the captured graph).
        """
        bs = self.block_size
        if self.cache_len.is_cuda and torch.cuda.is_current_stream_capturing():
            self._mark_captured()
        if isinstance(cache_len, int):
            if self._indices_fixed:
                # Known on the host: a fill of the lengths and, when it changed, of the block count
                # (see _fill_count), instead of a lengths tensor and the ops below (each op a
                # kernel launch, microseconds of host time, on CUDA). Same values.
                self.cache_len.fill_(cache_len)
                self._fill_count(min(max((cache_len + bs - 1) // bs, 0), self.kv_indices.shape[-1]))
                return self.block_mask
            cache_len = torch.full((self.batch,), cache_len, dtype=torch.int64, device=self.cache_len.device)
        self._count_written = None  # the counts below come from device values
        if self._indices_fixed:
            self.cache_len.copy_(cache_len)
            # Blocks 0 .. ceil(len / bs) - 1, the same count for every q block.
            # Clamped so that a length past the capacity cannot make the kernel read past kv_indices.
            n_kv = self.kv_indices.shape[-1]
            if self.kv_num_blocks.shape[-1] == 1:  # one q block (Lq <= block_size): in place
                counts = self.kv_num_blocks.view(-1)
                torch.add(self.cache_len, bs - 1, out=counts)
                counts.div_(bs, rounding_mode="floor").clamp_(0, n_kv)
            else:
                count = torch.div(self.cache_len + (bs - 1), bs, rounding_mode="floor").clamp_(0, n_kv)
                self.kv_num_blocks.copy_(count[:, None, None].expand_as(self.kv_num_blocks))
            return self.block_mask
        lens = cache_len.to(self.cache_len.device, torch.int64)
        self.cache_len.copy_(lens)
        q_abs = (lens - self.q_len)[:, None] + self._q_starts[None, :]  # first query of each q block
        first = torch.div(lowest_key(self.spec, q_abs).clamp(min=0), bs, rounding_mode="floor")
        last = torch.div((lens - 1).clamp(min=0), bs, rounding_mode="floor")[:, None]
        num = (last - first + 1).clamp(0, self.kv_indices.shape[-1]) * (lens > 0)[:, None]
        logical_blocks = (first[..., None] + self._steps).clamp(max=self.n_logical - 1)
        if self.paged:
            assert block_table is not None
            table = block_table.to(self.cache_len.device, torch.int64)
            flat = logical_blocks.reshape(logical_blocks.shape[0], -1)
            n_phys = self.page_start.shape[1] - 1
            # Clamped into the pool: decode_step checks page numbers only in a CPU table (a CUDA
            # one would cost a sync), and a bad one must not make the kernel read outside the pool.
            indices = table.gather(1, flat).view_as(logical_blocks).clamp(0, n_phys - 1)
            # page_start[b, physical page] = first logical position stored there; -block_size
            # (so every key of the page maps below 0, i.e. invisible) for pages row b does not own.
            # Unowned table entries (-1, or past the pool) scatter into a spare last column that
            # is never read.
            starts = torch.full_like(self.page_start, -bs, dtype=torch.int64)
            pages = torch.arange(table.shape[1], device=table.device).expand_as(table) * bs
            owned = (table >= 0) & (table < n_phys)
            starts.scatter_(1, torch.where(owned, table, n_phys), pages)
            self.page_start.copy_(starts)
            self.page_owned.copy_(owned[:, : self.n_logical])
        else:
            indices = logical_blocks
        self.kv_num_blocks.copy_(num[:, None, :])
        self.kv_indices.copy_(indices[:, None, :, :])
        return self.block_mask


def _page_map(page_start: torch.Tensor, page: int) -> Any:
    """``(b, kv_idx) -> logical position`` of physical key ``kv_idx`` in row ``b`` (below 0 where
    row ``b`` owns no page there), through ``page_start`` ``[B, n_physical + 1]``.

    A closure over the page size, not a method reading ``self``: the compile key
    (``compile.mod_key``) sees a closure's captured constants but not a bound method's ``self``,
    and two page sizes sharing one compiled entry made Dynamo turn the page size into a symbol
    that torch's CPU flex template fails to compile (C++ errors).
    """

    def logical(b, kv_idx):
        return page_start[b, kv_idx // page] + kv_idx % page

    return logical


#: decode_step's DecodeMasks, keyed by pattern, shape, device *and calling thread* (see
#: :func:`_caller`).
CACHE: LRUCache[DecodeMask] = LRUCache(DECODE_CACHE_SIZE)
#: DecodeMasks that a CUDA graph captured: kept alive for the life of the process, whatever the
#: LRU drops, because a replay reads (and writes) their tensors without asking Python.
CAPTURED: set[DecodeMask] = set()

_THREAD = threading.local()


class _Caller:
    """One thread's share of :data:`CACHE` (stored in the cache keys, so never reused by a later
    thread the way a thread id can be)."""

    def __init__(self) -> None:
        self.thread = threading.current_thread().name

    def __repr__(self) -> str:
        return f"<decode caller {self.thread}>"


def _caller() -> _Caller:
    """The calling thread's key into :data:`CACHE`.

    Why per thread: a DecodeMask is *state*, written by each step's ``update`` and read by the
    kernel that step launches. Shared between threads, thread A's update could land between
    thread B's update and B's kernel, and B would attend with A's lengths (8 CPU threads with
    different cache lengths all got wrong outputs). Within one thread the steps are ordered:
    on the CPU every call finishes before the next starts; on CUDA the update and the kernel of a
    step are queued on the current stream, after the previous step's kernel. So each thread owns
    its masks, and no lock is held while a kernel runs. (One thread alternating streams for
    steps of one shape must order those streams itself, as for any tensor two streams share.)
    """
    caller = getattr(_THREAD, "caller", None)
    if caller is None:
        caller = _THREAD.caller = _Caller()
    return caller


def _lengths(
    cache_len: Any, batch: int, q_len: int, capacity: int, device: torch.device
) -> torch.Tensor | int:
    """``cache_len`` as an integer ``[B]`` on ``device``, its values checked where they are on the
    host; an int stays an int (checked), one length for every row (``DecodeMask.update`` takes
    both). A tensor keeps its integer dtype: ``DecodeMask.update`` converts it where it copies it
    into the mask, so an int32 device tensor (a CUDA graph's) costs no separate cast per step."""
    if isinstance(cache_len, int) and not isinstance(cache_len, bool):
        if cache_len < q_len or cache_len > capacity:
            raise ValueError(
                f"cache_len {cache_len} is out of range: each row's cache_len must be >= Lq = {q_len} (the "
                f"new tokens are already in the cache) and <= the cache capacity {capacity}"
            )
        return int(cache_len)  # an int subclass (e.g. numpy's) as a plain int
    if isinstance(cache_len, torch.Tensor):
        if cache_len.dtype == torch.bool or cache_len.is_floating_point() or cache_len.is_complex():
            raise TypeError(
                f"cache_len must be an int or an integer tensor [B], got a {cache_len.dtype} tensor "
                "(lengths are counts of tokens; a float would be truncated)"
            )
        lens = cache_len.to(device=device).reshape(-1)
        if lens.numel() == 1:
            lens = lens.expand(batch)
        # Values are checked only when they are on the host: reading a CUDA tensor would sync with
        # the device every step (and break graph capture). On CUDA the block counts are clamped to
        # the capacity instead, so a bad device-side length cannot make the kernel read past the cache.
        on_host = cache_len.device.type == "cpu" and cache_len.numel() > 0
        bounds = (int(cache_len.min()), int(cache_len.max())) if on_host else None
    else:
        raise TypeError(f"cache_len must be an int or an integer tensor [B], got {type(cache_len).__name__}")
    if lens.numel() != batch:
        raise ValueError(f"cache_len must hold one length per batch row ({batch}), got {lens.numel()}")
    if bounds is not None:
        lo, hi = bounds
        if lo < q_len or hi > capacity:
            bad = lo if lo < q_len else hi
            raise ValueError(
                f"cache_len {bad} is out of range: each row's cache_len must be >= Lq = {q_len} (the new "
                f"tokens are already in the cache) and <= the cache capacity {capacity}"
            )
    return lens


def _check_block_table(block_table: Any, batch: int) -> None:
    if (
        not isinstance(block_table, torch.Tensor)
        or block_table.dtype == torch.bool
        or (block_table.is_floating_point() or block_table.is_complex())
    ):
        what = (
            f"a {block_table.dtype} tensor"
            if isinstance(block_table, torch.Tensor)
            else type(block_table).__name__
        )
        raise TypeError(f"block_table must be an integer tensor [B, max_pages], got {what}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must be [B={batch}, max_pages], got {tuple(block_table.shape)}")


def _check_pages(block_table: torch.Tensor, n_pages: int, block_size: int) -> None:
    """Page numbers in ``-1 .. n_pages - 1``, only for a CPU table (reading a CUDA one would
    sync with the device every step; there the gathered page numbers are clamped instead).
    -1 entries may sit anywhere, also below a row's length: those keys are invisible (a
    sliding-window cache may free the pages its window left)."""
    if block_table.device.type != "cpu" or block_table.numel() == 0:
        return
    lo, hi = int(block_table.min()), int(block_table.max())
    if lo < -1 or hi >= n_pages:
        bad = lo if lo < -1 else hi
        raise ValueError(
            f"block_table holds page {bad}, outside the pool: valid pages are 0 .. {n_pages - 1} "
            f"(k_cache holds {n_pages} pages of {block_size} tokens), or -1 for none"
        )


def _check_inputs(q: Any, k_cache: Any, v_cache: Any, block_size: Any, paged: bool) -> None:
    if _well_formed(q, k_cache, v_cache, block_size, paged):
        return  # the common case, in a few comparisons (every step runs this)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"decode_step {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            layout = (
                "[B, H, Lq, D]"
                if name == "q"
                else (
                    "[1, Hkv, n_pages * block_size, D] (a paged pool)" if paged else "[B, Hkv, capacity, D]"
                )
            )
            raise ValueError(f"decode_step {name} must have 4 dims {layout}, got shape {tuple(t.shape)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"decode_step block_size must be a positive int, got {type(block_size).__name__}")
    if block_size <= 0:
        raise ValueError(f"decode_step block_size must be a positive int, got {block_size}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"k_cache and v_cache must agree in batch, heads and length (dims 0-2), got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if not paged and k_cache.shape[0] != q.shape[0]:
        raise ValueError(
            f"k_cache/v_cache hold {k_cache.shape[0]} rows but q has batch {q.shape[0]}: a contiguous cache "
            "is [B, Hkv, capacity, D] with q's B (a shared page pool [1, ...] needs block_table=)"
        )


def _well_formed(q: Any, k_cache: Any, v_cache: Any, block_size: Any, paged: bool) -> bool:
    """Whether :func:`_check_inputs` has nothing to say (it names what is wrong otherwise)."""
    tensor = torch.Tensor
    return (
        isinstance(q, tensor)
        and isinstance(k_cache, tensor)
        and isinstance(v_cache, tensor)
        and q.dim() == 4
        and k_cache.dim() == 4
        and v_cache.dim() == 4
        and type(block_size) is int
        and block_size > 0
        and k_cache.shape[:3] == v_cache.shape[:3]
        and (paged or k_cache.shape[0] == q.shape[0])
    )


def _gather_pages(pool: torch.Tensor, block_table: torch.Tensor, pages: int, bs: int) -> torch.Tensor:
    """The first ``pages`` logical pages of every row, as a contiguous ``[B, H, pages * bs, D]``;
    ``pool`` ``[1 (or B, broadcast), H, n_pages * bs, D]``, any strides (a kv_layout view)."""
    _, h, _, d = pool.shape
    paged = pool[0].unflatten(1, (-1, bs))  # [H, n_pages, bs, D], a view whatever the strides
    idx = block_table[:, :pages].clamp(min=0).to(pool.device, torch.int64)
    return paged[:, idx].permute(1, 0, 2, 3, 4).reshape(idx.shape[0], h, pages * bs, d)


def _layout_views(
    k_pool: Any, v_pool: Any, kv_layout: str, block_size: int | None
) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """``kv_layout`` pools as ``decode_step``'s own paged layout: ``(k_view, v_view, page_size,
    slot_stride, n_pages)``, the views ``[1, Hkv, n_slots * page_size, D]`` (see
    :func:`pool_view`)."""
    for name, t in (("k_cache", k_pool), ("v_cache", v_pool)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"decode_step {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4 or 0 in t.shape[:3]:
            raise ValueError(
                f"decode_step {name} with kv_layout={kv_layout!r} must be a pool {KV_LAYOUT_SHAPES[kv_layout]} "
                f"(no empty dims), got shape {tuple(t.shape)}"
            )
    if k_pool.shape[:3] != v_pool.shape[:3]:
        raise ValueError(
            f"k_cache and v_cache must agree in pages, page size and heads (dims 0-2), got "
            f"{tuple(k_pool.shape)} and {tuple(v_pool.shape)}"
        )
    page = k_pool.shape[1] if kv_layout == "NHD" else k_pool.shape[2]
    if block_size is not None and block_size != page:
        raise ValueError(
            f"decode_step block_size={block_size!r} differs from the pools' page size {page} "
            f"(kv_layout={kv_layout!r} pools {KV_LAYOUT_SHAPES[kv_layout]}): leave block_size out"
        )
    k_view, slots = pool_view(k_pool, kv_layout)
    v_view, v_slots = pool_view(v_pool, kv_layout)
    if v_slots != slots:  # one table for both: copied contiguous, their pages sit alike
        k_view, slots = pool_view(k_pool.contiguous(), kv_layout)
        v_view, _ = pool_view(v_pool.contiguous(), kv_layout)
    return k_view, v_view, page, slots, k_pool.shape[0]


def pool_view(pool: torch.Tensor, kv_layout: str) -> tuple[torch.Tensor, int]:
    """A ``kv_layout`` page pool seen as one key sequence per head, without a copy.

    ``pool``: ``[n_pages, page_size, Hkv, D]`` (``"NHD"``) or ``[n_pages, Hkv, page_size, D]``
    (``"HND"``). Returns ``(view, slot_stride)``: ``view`` ``[1, Hkv, L, D]`` (batch stride 0)
    in which token ``o`` of page ``p`` is key ``(p * slot_stride) * page_size + o`` of every
    head, ``L = ((n_pages - 1) * slot_stride + 1) * page_size``. The key stride is the pool's
    token stride, so pages are ``slot_stride`` page slots apart: 1 for a contiguous NHD pool
    (the view is the pool itself, heads interleaved), ``Hkv`` for a contiguous HND pool (the
    slots between hold the other heads' keys of the page: the view's rows overlap in memory, and
    decode_step never lists those slots). A pool whose strides fit neither (last dim not
    contiguous, page stride not a whole number of pages of its token stride) is copied
    contiguous first.
    """
    n_pages, a, b, d = pool.shape
    page, heads = (a, b) if kv_layout == "NHD" else (b, a)
    tok_dim, head_dim = (1, 2) if kv_layout == "NHD" else (2, 1)
    s_page, s_tok, s_head = pool.stride(0), pool.stride(tok_dim), pool.stride(head_dim)
    if page == 1:
        s_tok = s_page  # one token per page: its stride is free, pages are then adjacent keys
    if not (pool.stride(3) == 1 or d == 1) or s_tok <= 0 or s_page % s_tok or (s_page // s_tok) % page:
        return pool_view(pool.contiguous(), kv_layout)
    slot_stride = s_page // s_tok // page
    length = ((n_pages - 1) * slot_stride + 1) * page
    view = pool.as_strided((1, heads, length, d), (0, s_head, s_tok, 1), pool.storage_offset())
    return view, slot_stride


@overload
def append_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: int,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    *,
    kv_layout: str | None = ...,
    block_size: int | None = ...,
) -> int: ...
@overload
def append_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    *,
    kv_layout: str | None = ...,
    block_size: int | None = ...,
) -> torch.Tensor: ...


def append_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: int | torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    *,
    kv_layout: str | None = None,
    block_size: int | None = None,
) -> int | torch.Tensor:
    """Write ``n`` new tokens per row into paged KV pools through a block table, in place.

    Row ``b``'s new token ``i`` goes to logical position ``seq_lens[b] + i``: logical page
    ``(seq_lens[b] + i) // page_size``, physical page ``block_table[b, that page]``, slot
    ``(seq_lens[b] + i) % page_size`` in it. Then ``decode_step(q, k_pool, v_pool, <the returned
    lengths>, block_table=block_table, kv_layout=kv_layout)`` attends the new queries to them.

    Args:
        k_pool, v_pool: the pools, written in place: with ``kv_layout`` ``"NHD"``
            ``[n_pages, page_size, Hkv, D]``, ``"HND"`` ``[n_pages, Hkv, page_size, D]``; with
            None decode_step's own ``[1, Hkv, n_pages * block_size, D]``.
        block_table: ``[B, max_pages]`` integer tensor, the physical page of each logical page;
            every page written to must be in the pool (-1 elsewhere is fine).
        seq_lens: the tokens each row holds before this write, an int or an integer tensor
            ``[B]``; not modified.
        k_new, v_new: ``[B, Hkv, n, D]`` (the library's head-first layout), the pools' dtype and
            device.
        kv_layout: ``"NHD"``, ``"HND"`` or None, as for :func:`decode_step`.
        block_size: the page size of a ``kv_layout=None`` pool (default 128); with a
            ``kv_layout`` the pools' page size, which it must equal if given.

    Returns:
        ``seq_lens + n``: the new lengths (an int for an int, else a new tensor).

    Raises:
        TypeError / ValueError naming the argument: wrong types, shapes, dtypes or devices,
        an unknown ``kv_layout``; and, when ``block_table`` and ``seq_lens`` are CPU tensors or
        ints, a write past the table's width or into a page outside the pool (-1 included). On
        CUDA those values are not read (that would sync with the device): an invalid page is sent
        out of the pool's range, so the write fails with a device-side index error instead of
        landing in another row's page.
    """
    if kv_layout is not None and kv_layout not in KV_LAYOUTS:
        raise ValueError(
            f"append_kv kv_layout must be None, {' or '.join(map(repr, KV_LAYOUTS))}; got {kv_layout!r}"
        )
    shape = KV_LAYOUT_SHAPES.get(kv_layout or "", "[1, Hkv, n_pages * block_size, D]")
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool), ("k_new", k_new), ("v_new", v_new)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"append_kv {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            want = shape if name.endswith("pool") else "[B, Hkv, n, D]"
            raise ValueError(f"append_kv {name} must have 4 dims {want}, got shape {tuple(t.shape)}")
    if kv_layout is None:
        page = DEFAULT_BLOCK_SIZE if block_size is None else block_size
        if isinstance(page, bool) or not isinstance(page, int) or page <= 0:
            raise ValueError(f"append_kv block_size must be a positive int, got {page!r}")
        if k_pool.shape[0] != 1 or k_pool.shape[2] % page:
            raise ValueError(
                f"append_kv pools without kv_layout are {shape} with block_size={page}; got {tuple(k_pool.shape)}"
            )
        n_pages, heads = k_pool.shape[2] // page, k_pool.shape[1]
    else:
        n_pages, a, b_, _ = k_pool.shape
        page, heads = (a, b_) if kv_layout == "NHD" else (b_, a)
        if block_size is not None and block_size != page:
            raise ValueError(
                f"append_kv block_size={block_size!r} differs from the pools' page size {page} ({shape})"
            )
    batch, new_heads, n, _ = k_new.shape
    for name, pool, new in (("k", k_pool, k_new), ("v", v_pool, v_new)):
        if pool.shape[:3] != k_pool.shape[:3]:
            raise ValueError(
                f"append_kv k_pool and v_pool must agree in dims 0-2, got {tuple(k_pool.shape)} and {tuple(pool.shape)}"
            )
        if new.shape[:3] != (batch, heads, n) or new.shape[3] != pool.shape[3]:
            raise ValueError(
                f"append_kv {name}_new must be [B, Hkv={heads}, n, D={pool.shape[3]}] with k_new's B and n, "
                f"got {tuple(new.shape)}"
            )
        if new.dtype != pool.dtype or new.device != pool.device:
            raise TypeError(
                f"append_kv {name}_new must have {name}_pool's dtype and device ({pool.dtype}, {pool.device}), "
                f"got {new.dtype} on {new.device}"
            )
    _check_block_table(block_table, batch)
    max_pages = block_table.shape[1]
    if isinstance(seq_lens, int) and not isinstance(seq_lens, bool):
        start: torch.Tensor = torch.full((batch,), seq_lens, dtype=torch.int64)
    elif isinstance(seq_lens, torch.Tensor) and not (
        seq_lens.dtype == torch.bool or seq_lens.is_floating_point() or seq_lens.is_complex()
    ):
        start = seq_lens.reshape(-1).to(torch.int64)
        if start.numel() != batch:
            raise ValueError(
                f"append_kv seq_lens must hold one length per row of block_table ({batch}), got {start.numel()}"
            )
    else:
        what = f"a {seq_lens.dtype} tensor" if isinstance(seq_lens, torch.Tensor) else type(seq_lens).__name__
        raise TypeError(f"append_kv seq_lens must be an int or an integer tensor [B], got {what}")
    device = k_pool.device
    pos = start.to(device)[:, None] + torch.arange(n, device=device)  # [B, n] logical positions
    logical = pos // page
    table = block_table.to(device, torch.int64)
    on_host = start.device.type == "cpu" and block_table.device.type == "cpu"
    if on_host and pos.numel():
        lo, hi = int(start.min()), int(start.max()) + n
        if lo < 0 or hi > max_pages * page:
            raise ValueError(
                f"append_kv writes positions {lo} .. {hi - 1}, outside the table's capacity 0 .. "
                f"{max_pages * page - 1} ({max_pages} pages of {page}): seq_lens must be >= 0 and "
                f"seq_lens + n <= max_pages * page_size"
            )
    physical = table.gather(1, logical.clamp(0, max_pages - 1))
    if on_host and physical.numel():
        bad = (physical < 0) | (physical >= n_pages)
        if bool(bad.any()):
            b, i = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"append_kv row {b} writes position {int(pos[b, i])} to block_table[{b}, {int(logical[b, i])}] = "
                f"{int(physical[b, i])}, outside the pool: valid pages are 0 .. {n_pages - 1}"
            )
    # Invalid entries (a CUDA table, not read on the host) point past the pool: a loud index
    # error, where a -1 would wrap around to the last page.
    physical = torch.where((physical >= 0) & (physical < n_pages), physical, n_pages).flatten()
    slot = (pos % page).flatten()
    for pool, new in ((k_pool, k_new), (v_pool, v_new)):
        rows = new.transpose(1, 2).reshape(batch * n, heads, new.shape[3])  # [B * n, Hkv, D]
        if kv_layout == "NHD":
            pool[physical, slot] = rows
        elif kv_layout == "HND":
            pool[physical, :, slot] = rows
        else:
            pool[0, :, physical * page + slot] = rows.transpose(0, 1)
    return seq_lens + n


@overload
def decode_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len: int | torch.Tensor,
    *,
    mask: Any = ...,
    score_mod: Any = ...,
    scale: float | None = ...,
    enable_gqa: bool | None = ...,
    sinks: torch.Tensor | None = ...,
    block_table: torch.Tensor | None = ...,
    return_lse: Literal[False] = ...,
    backend: str = ...,
    block_size: int | None = ...,
    kv_layout: str | None = ...,
) -> torch.Tensor: ...
@overload
def decode_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len: int | torch.Tensor,
    *,
    mask: Any = ...,
    score_mod: Any = ...,
    scale: float | None = ...,
    enable_gqa: bool | None = ...,
    sinks: torch.Tensor | None = ...,
    block_table: torch.Tensor | None = ...,
    return_lse: Literal[True],
    backend: str = ...,
    block_size: int | None = ...,
    kv_layout: str | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def decode_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len: int | torch.Tensor,
    *,
    mask: Any = ...,
    score_mod: Any = ...,
    scale: float | None = ...,
    enable_gqa: bool | None = ...,
    sinks: torch.Tensor | None = ...,
    block_table: torch.Tensor | None = ...,
    return_lse: bool = ...,
    backend: str = ...,
    block_size: int | None = ...,
    kv_layout: str | None = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def decode_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len: int | torch.Tensor,
    *,
    mask: Any = None,
    score_mod: Any = None,
    scale: float | None = None,
    enable_gqa: bool | None = None,
    sinks: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    block_size: int | None = None,
    kv_layout: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of the newest ``Lq`` tokens to a KV cache (see the module docstring).

    Args:
        q: ``[B, H, Lq, D]``, the queries at absolute positions ``cache_len - Lq .. cache_len - 1``.
        k_cache, v_cache: ``[B, Hkv, capacity, D]`` caches whose first ``cache_len`` entries are
            valid (the new tokens included); with ``block_table``, page pools: by default
            ``[1, Hkv, n_pages * block_size, D]``, with ``kv_layout`` the serving stacks' pools
            (below).
        cache_len: valid length, an int or an integer tensor ``[B]`` (rows may differ), each in
            ``Lq .. capacity`` (checked when an int or a CPU tensor: a CUDA one is not read).
        mask: the pattern over absolute positions (spec, name or callable); default ``Causal()``.
        score_mod: a score spec / name / callable over absolute positions.
        scale, enable_gqa (None: from head counts), sinks ``[H]``, return_lse: as for the layers.
        block_table: ``[B, max_pages]`` int, physical page of each logical page (-1: none); page
            numbers are checked when it is a CPU tensor.
        backend: ``"auto"``, ``"flex"``, ``"flex_cpu"`` or ``"dense"`` (the routes with
            ``decode=True``). ``"auto"``: SDPA over the live prefix for a plain one-query step (see
            the module docstring) but on CUDA from 8192 keys with 256 or more (batch x kv head)
            rows, else on CUDA ``"flex"`` (torch's flex-decoding kernel for short ``Lq``).
        block_size: kv block size, and the page size of paged caches (None: 128; with
            ``kv_layout``, the pools' page size, which it must equal if given).
        kv_layout: None, or the page layout of the pools a ``block_table`` points into, as
            vLLM, FlashInfer and FlashAttention keep them: ``"NHD"``, ``k_cache`` / ``v_cache``
            ``[n_pages, page_size, Hkv, D]``; ``"HND"``, ``[n_pages, Hkv, page_size, D]``. Any
            page size. The pools are read in place through a strided view (no copy; a pool whose
            last dim is not contiguous, or whose page stride is not a multiple of a page of its
            token stride, is copied contiguous first), with ``block_table`` ``[B, max_pages]``
            (int32 or int64) and ``cache_len`` ``[B]`` as above. Pages below
            :data:`MIN_FLEX_PAGE` of the device (CUDA: 16 keys, the Triton kernels' smallest
            tile) cannot be a flex block: those steps take the exact ``dense`` route over the
            row's live pages gathered in logical order (a copy of the live keys per step).
    """
    if (
        score_mod is None
        and sinks is None
        and block_table is None
        and not return_lse
        and backend == "auto"
        and block_size is None
        and kv_layout is None
        and type(cache_len) is int
        and (mask is None or (type(mask) is Causal and mask.plain_key() == _CAUSAL.plain_key()))
        and type(q) is torch.Tensor
        and type(k_cache) is torch.Tensor
        and type(v_cache) is torch.Tensor
    ):
        # Perhaps a plain generation step: one query per row over an int length (None: it is not).
        out = one_query_over_prefix(q, k_cache, v_cache, cache_len, scale, enable_gqa)
        if out is not None:
            return out
    spec = _CAUSAL if mask is None else as_mask_spec(mask)
    if spec is not None:
        spec = spec.live()  # a raw callable's captured tensors now
    score = None if score_mod is None else as_score_spec(score_mod)
    if score is not None:
        score = score.live()
        if score.is_activation():
            raise ValueError(
                f"decode_step runs softmax attention; score_mod {type(score).__name__} is activation "
                "attention (unnormalised weights): call fz.attention over the cache instead"
            )
    paged = block_table is not None
    n_pages: int | None = None  # pages in a kv_layout pool (its view counts page slots instead)
    slot_stride = 1  # page p of a kv_layout pool is page slot p * slot_stride of its view
    q_block_size = None
    if kv_layout is not None:
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(
                f"decode_step kv_layout must be None, {' or '.join(map(repr, KV_LAYOUTS))}; got {kv_layout!r}"
            )
        if not paged:
            raise ValueError(
                f"decode_step kv_layout={kv_layout!r} names a page pool layout: it needs block_table="
            )
        k_cache, v_cache, block_size, slot_stride, n_pages = _layout_views(
            k_cache, v_cache, kv_layout, block_size
        )
        # q blocks of 128 rows whatever the page: the CUDA kernels tile queries in blocks of
        # 16 .. 128 rows, which must divide the q block (flex's _decode_kernel_has_no_config).
        q_block_size = max(block_size, DEFAULT_BLOCK_SIZE)
    elif block_size is None:
        block_size = DEFAULT_BLOCK_SIZE
    _check_inputs(q, k_cache, v_cache, block_size, paged)
    on_cuda = q.is_cuda
    batch, heads, q_len, _ = q.shape
    gqa = heads != k_cache.shape[1] if enable_gqa is None else enable_gqa
    if paged:
        assert block_table is not None
        if k_cache.shape[0] != 1 or k_cache.shape[2] % block_size:
            raise ValueError(
                f"paged caches are pools [1, Hkv, n_pages * {block_size}, D]; got {tuple(k_cache.shape)}"
            )
        _check_block_table(block_table, batch)
        capacity = block_table.shape[1] * block_size
        n_physical: int | None = k_cache.shape[2] // block_size
    else:
        capacity, n_physical = k_cache.shape[2], None
    lens = _lengths(cache_len, batch, q_len, capacity, q.device)
    if paged:
        assert block_table is not None and n_physical is not None
        _check_pages(block_table, n_physical if n_pages is None else n_pages, block_size)
        if slot_stride != 1:
            block_table = torch.where(block_table >= 0, block_table * slot_stride, -1)
    if spec is not None:
        try:  # positions are absolute: the pattern must describe all of 0 .. capacity - 1
            spec.validate(capacity, capacity, batch, heads)
        except ValueError as exc:
            raise ValueError(f"decode_step mask does not fit a cache of capacity {capacity}: {exc}") from exc
    if score is not None:
        score.validate(q_len, capacity, batch, heads)  # e.g. Alibi(num_heads) against H
    need_lse = sinks is not None or return_lse
    grad = needs_grad((q, k_cache, v_cache, sinks), score)  # a learned bias in score_mod counts
    small_page = block_size < MIN_FLEX_PAGE.get(q.device.type, 1)
    # What torch's compiled CPU flex kernel mishandles in the user's callables (the flex_cpu route
    # refuses the same for fz.attention): decode's own wrappers hide them from the route's check.
    hazards = () if on_cuda else _cpu_hazards(spec, score)
    use_flex = (
        backend != "dense" and not grad and (on_cuda or not need_lse) and not small_page and not hazards
    )
    if backend not in DECODE_ROUTES:
        raise ValueError(f"decode_step backend must be one of {', '.join(DECODE_ROUTES)}; got {backend!r}")
    if not use_flex and backend not in ("auto", "dense"):
        if small_page:
            why = (
                f"kv blocks of {block_size} keys are below the {MIN_FLEX_PAGE[q.device.type]} flex needs "
                f"on {q.device.type}"
            )
        elif hazards:
            why = f"the compiled CPU flex kernel cannot run a mod that {'; '.join(hazards)}"
        else:
            why = "needs lse on CPU, or inputs require grad"
        raise ValueError(f"backend {backend!r} cannot run this decode step ({why})")
    if use_flex and on_cuda:
        backend = "flex" if backend == "auto" else backend
    if use_flex and not paged and batch > 1:
        rows = _rows_per_launch(k_cache, v_cache)
        if rows < batch:  # a cache too large for one flex launch: decode it a slice of rows at a time
            parts = [
                decode_step(
                    q[i : i + rows],
                    k_cache[i : i + rows],
                    v_cache[i : i + rows],
                    lens if isinstance(lens, int) else lens[i : i + rows],
                    mask=spec,
                    score_mod=score,
                    scale=scale,
                    enable_gqa=gqa,
                    sinks=sinks,
                    return_lse=True,
                    backend=backend,
                    block_size=block_size,
                )
                for i in range(0, batch, rows)
            ]
            out = torch.cat([o for o, _ in parts])
            return (out, torch.cat([lse for _, lse in parts])) if return_lse else out
    # Per calling thread (see _caller): the mask's tensors are written by this step's update and
    # read by this step's kernel, so no two threads may share them.
    key = (spec, batch, q_len, capacity, n_physical, block_size, q_block_size, q.device, _caller())
    dm = CACHE.get_or_create(
        key,
        lambda: DecodeMask(
            spec,
            batch,
            q_len,
            capacity,
            n_physical=n_physical,
            device=q.device,
            block_size=block_size,
            q_block_size=q_block_size,
        ),
    )
    inner_score = score.score_mod(fast=on_cuda) if score is not None else None
    if use_flex:
        bm = dm.update(lens, block_table)
        k_run, v_run = k_cache, v_cache
        if k_cache.shape[0] != batch:  # a page pool shared by every row
            k_run, v_run = k_cache.expand(batch, -1, -1, -1), v_cache.expand(batch, -1, -1, -1)
        run_score = dm.score_spec(inner_score) if inner_score is not None else None
        if q_len > 0:
            out, lse = _run_planned(dm, q, k_run, v_run, bm, run_score, scale, gqa, need_lse, backend)
        else:  # no queries: fz.attention's empty result
            out, lse = _attend(
                q,
                k_run,
                v_run,
                need_lse,
                mask=bm,
                score_mod=run_score,
                scale=scale,
                enable_gqa=gqa,
                backend=backend,
            )
    else:
        dm.update(lens, block_table if paged else None)
        live = lens if isinstance(lens, int) else (int(lens.max()) if lens.numel() else 0)
        if live > capacity:
            raise ValueError(f"cache_len {live} exceeds the cache capacity {capacity}")
        pages = max(1, -(-live // block_size))
        if paged:
            assert block_table is not None
            k_run = _gather_pages(k_cache, block_table, pages, block_size)
            v_run = _gather_pages(v_cache, block_table, pages, block_size)
        else:
            stop = min(capacity, pages * block_size)
            k_run, v_run = k_cache[:, :, :stop], v_cache[:, :, :stop]
        # Untracked (as in DecodeMask.score_spec): the dense route evaluates them live each call.
        run_mask = FunctionMask(fn=dm.logical_mask_mod, label="decode", tracked=False)
        dense_score = (
            FunctionScore(fn=dm.score_mod(inner_score, paged=False), label="decode", tracked=False)
            if inner_score is not None
            else None
        )
        out, lse = _attend(
            q,
            k_run,
            v_run,
            need_lse,
            mask=run_mask,
            score_mod=dense_score,
            scale=scale,
            enable_gqa=gqa,
            backend="dense",
        )
    if sinks is not None:
        check_sinks(sinks, heads, q.device)
        assert lse is not None  # need_lse: sinks asked the route for it
        out, lse = apply_sinks(out, lse, sinks)
    if not return_lse:
        return out
    assert lse is not None  # need_lse: return_lse asked the route for it
    return out, lse


#: The SDPA kernels a one-query step over a cache prefix may take on CUDA (SDPA's own choice among
#: them): those without per-shape setup.
_PREFIX_KERNELS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def one_query_over_prefix(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    length: int,
    scale: float | None,
    enable_gqa: bool | None,
) -> torch.Tensor | None:
    """A causal step of one query per row, every row ``length`` long, that records no gradient,
    outside a traced graph and torch's context_parallel; None for any other step (the general
    path takes it and names what is wrong). The query sits at the last position, so it sees
    exactly the cache's first ``length`` keys, with no mask at all. SDPA runs that on the prefix
    views as they are (no copy: ``backends.base.fused_layout``) with its own kernel choice (on
    CUDA among FlashAttention-2, the memory-efficient and the math kernel: cuDNN's per-shape plan
    would be rebuilt every step) -- its math fallback holds only ``B x H x 1 x length`` scores --
    for a fraction of the host time of a flex launch and its per-step mask update. Checked in a
    few comparisons: a decode step's whole host time is a few tens of microseconds. On CUDA, from
    ``arch.SPLIT_DECODE_MIN_KV_LEN`` keys with ``arch.SPLIT_DECODE_MIN_KV_ROWS`` (batch x kv head)
    rows on, None: FlashAttention-2 reads such caches at about half of HBM bandwidth, the flex
    path's kernel (split over the keys) near all of it."""
    q_shape, k_shape, v_shape = q.shape, k_cache.shape, v_cache.shape
    if not (
        len(q_shape) == 4
        and len(k_shape) == 4
        and len(v_shape) == 4
        and q_shape[2] == 1
        and q_shape[0] == k_shape[0] == v_shape[0]
        and k_shape[1] == v_shape[1]
        and k_shape[2] == v_shape[2]
        and 1 <= length <= k_shape[2]
        and not needs_grad((q, k_cache, v_cache), None)
        and not _compat.is_compiling()
        and not sharding.context_parallel_active()
    ):
        return None
    batch, heads, _, dim = q_shape
    kv_heads = k_shape[1]
    on_cuda = q.is_cuda
    if length >= SPLIT_DECODE_MIN_KV_LEN and batch * kv_heads >= SPLIT_DECODE_MIN_KV_ROWS and on_cuda:
        return None  # a long cache over many rows: the flex path (see the docstring)
    gqa = heads != kv_heads if enable_gqa is None else enable_gqa
    if (
        not _compat.any_autocast_enabled()
        and aligned_qkv_acceptable(q, k_cache, v_cache, gqa, q_shape, k_shape)  # shapes compared above
        and (on_cuda or q.is_cpu)
        # Plain tensors only: a subclass (a DTensor, a Parameter) may define its views otherwise.
        and type(k_cache) is torch.Tensor
        and type(v_cache) is torch.Tensor
    ):
        # The caches pass exactly when their prefixes do (same dtype, device, batch, heads and
        # D; equal lengths), and a prefix of a contiguous, aligned cache needs no layout check:
        # what the cache says holds every step, so no per-step slice is inspected. The prefixes
        # are the caches' own sizes and strides with ``length`` keys, the view ``narrow`` gives,
        # set directly: ``as_strided`` skips narrow's argument handling, a good part of a view's
        # host cost. On plain CPU and CUDA tensors only; the rest take ``narrow`` below.
        k = k_cache.as_strided((batch, kv_heads, length, dim), k_cache.stride())
        v = v_cache.as_strided((batch, kv_heads, length, v_shape[3]), v_cache.stride())
        q = fused_layout(q)
        if not prefixes_are_dense_blocks(k_cache):
            k = fused_layout(k)
        if not prefixes_are_dense_blocks(v_cache):
            v = fused_layout(v)
    else:
        k, v = k_cache.narrow(2, 0, length), v_cache.narrow(2, 0, length)
        q, k, v = _under_autocast(q, k, v)  # as fz.attention: e.g. a float32 q over a bf16 cache
        if not qkv_acceptable(q, k, v, gqa):
            check_qkv(q, k, v, enable_gqa=gqa)  # names what is wrong
        q, k, v = fused_layout(q), fused_layout(k), fused_layout(v)
    scale = check_scale(scale)
    with SDPA_LOCK:  # never under another thread's pin of a kernel (backends.sdpa)
        if not on_cuda:
            return _sdpa(q, k, v, scale, gqa)
        # On CUDA without cuDNN: its SDPA builds an execution plan for every new shape, and a
        # generation loop meets a new length every step (45 ms per call on the H200 for a new
        # shape each call, benchmarks/results/host_cost_h200.md, decode-growing).
        token = _compat.pin_sdpa_kernel(_PREFIX_KERNELS)
        try:
            return _sdpa(q, k, v, scale, gqa)
        finally:
            _compat.restore_sdpa_kernels(token)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, gqa: bool) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with its defaults left out where they apply (SDPA parses
    fewer keyword arguments; read from ``F`` each call, as a patch of it must be seen)."""
    if scale is None and not gqa:
        return F.scaled_dot_product_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, need_lse: bool, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fz.attention`` as ``(out, lse or None)``."""
    if need_lse:
        return attention(q, k, v, return_lse=True, **kwargs)
    return attention(q, k, v, **kwargs), None


def _rows_per_launch(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """How many batch rows of a contiguous cache one flex launch can take (see MAX_FLEX_ELEMENTS)."""
    per_row = max(math.prod(t.shape[1:]) for t in (k_cache, v_cache))  # elements of one row
    fit = max(1, (MAX_FLEX_ELEMENTS - 1) // max(per_row, 1))
    batch = k_cache.shape[0]
    # Equal slices (32 rows with room for 31: 16 + 16, not 31 + 1): fewer distinct batch sizes,
    # so fewer kernels to compile.
    return -(-batch // -(-batch // fit))


def run_signature(q, k, v, score, scale, gqa: bool, need_lse: bool, backend: str) -> Hashable:
    """Everything a decode step's plan depends on besides its DecodeMask: shapes, strides, dtypes,
    devices, the score mod, scale, GQA, lse, the requested route, torch's determinism switch,
    whether the step records gradients (routes differ by mode), whether torch's context_parallel
    is active (it narrows the routes), the process state the dispatcher reads
    (``plan_cache.process_state``) and, on the CPU, whether q/k/v hold NaN/inf (``flex_cpu``
    refuses them: the scan the full path makes)."""
    device = q.device
    return (
        q.shape,
        q.stride(),
        q.dtype,
        k.shape,
        k.stride(),
        k.dtype,
        v.shape,
        v.stride(),
        v.dtype,
        device,
        k.device,
        v.device,
        score,
        scale,
        gqa,
        need_lse,
        backend,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        needs_grad((q, k, v), score),
        process_state(),
        sharding.context_parallel_active(),
        device.type == "cpu" and inputs_nonfinite(q, k, v),
    )


class _Run:
    """A decode step's plan for one signature (:func:`run_signature`) and how to launch it.

    On a flex route that lets its caller launch (``FlexBackend.caller_mask_call``) the route's
    prepared call for this DecodeMask's BlockMask is kept too: later steps go straight to the
    compiled kernel, without the plan's route lookup and the route's own cache lookup (a few
    microseconds of host time per step), and from the second step without Dynamo's frame
    evaluation and guards (see ``ran``). The prepared call depends only on the plan's problem,
    the device and the DecodeMask's mask_mod and block size, none of which change for the
    DecodeMask and signature this run is stored under.
    """

    __slots__ = ("call", "plan", "ran", "scale")

    def __init__(self, chosen: Any, bm: _compat.BlockMask, device: torch.device, scale: float | None) -> None:
        self.plan = chosen
        route = BY_NAME[chosen.backend]
        self.call: FlexCall | None = None
        #: ``FlexCall.launch``'s memo of this run's last launch: every step of one signature has
        #: the same q/k/v shapes, strides and grad flags, and the DecodeMask's BlockMask (the same
        #: object, updated in place), so from the second step the compiled graph runs directly.
        self.ran: list[Any] = [None]
        if isinstance(route, FlexBackend) and not chosen.problem.requires_grad:
            self.call = route.caller_mask_call(chosen.problem, device, bm)
        # execute_plan's default scale, worked out once.
        self.scale = 1.0 / math.sqrt(chosen.problem.head_dim) if scale is None else float(scale)

    @property
    def backend(self) -> str:
        return str(self.plan.backend)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bm: _compat.BlockMask
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.call is not None:
            return self.call.launch(q, k, v, self.scale, bm, self.ran)
        return execute_plan(self.plan, q, k, v, scale=self.scale, block_mask=bm)


def _run_planned(
    dm: DecodeMask, q, k, v, bm, score, scale, gqa: bool, need_lse: bool, backend: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One flex call through ``dm``'s BlockMask, planned (validated, routed) once per signature
    (:func:`run_signature`). q/k/v are first cast as ``fz.attention`` casts them under
    ``torch.autocast``, so the plan, its signature and the kernel all see the dtype computed in."""
    q, k, v = _under_autocast(q, k, v)
    sig = run_signature(q, k, v, score, scale, gqa, need_lse, backend)
    run = dm.runs.get(sig)
    if run is None:
        chosen = plan(
            q,
            k,
            v,
            mask=bm,
            score_mod=score,
            scale=scale,
            enable_gqa=gqa,
            backend=backend,
            return_lse=need_lse,
        )
        run = dm.runs.put(sig, _Run(chosen, bm, q.device, scale))
    return run(q, k, v, bm)


def decode_step_varlen(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    cache_len: torch.Tensor,
    block_table: torch.Tensor,
    *,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Paged causal (or sliding-window) decode on FlashAttention varlen (CUDA, torch >= 2.13).

    ``q [B, H, Lq, D]``; ``k_pages``/``v_pages`` ``[n_pages, page_size, Hkv, D]`` (varlen's paged
    layout); ``cache_len [B]`` valid keys per row (new tokens included); ``block_table [B,
    max_pages]`` int32; ``window``: Hugging Face ``sliding_window`` (W keys, own included) or None.
    FlashAttention aligns causal masks bottom-right to ``cache_len``, which is the decode
    convention. Returns ``[B, H, Lq, D]``. Not covered by CPU tests (varlen is CUDA-only).
    """
    fn = _compat.varlen_attn_fn()
    if fn is None or not _compat.varlen_supports("block_table") or not q.is_cuda:
        raise ValueError(
            "decode_step_varlen needs CUDA and torch.nn.attention.varlen with block_table (torch >= 2.13)"
        )
    batch, heads, q_len, d = q.shape
    flat_q = q.transpose(1, 2).reshape(batch * q_len, heads, d)
    cu_q = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * q_len
    seqused = cache_len.to(q.device, torch.int32)
    max_k = block_table.shape[1] * k_pages.shape[1]
    left = -1 if window is None else window - 1
    out = fn(
        flat_q,
        k_pages,
        v_pages,
        cu_q,
        None,
        q_len,
        max_k,
        scale=scale,
        window_size=(left, 0),
        enable_gqa=heads != k_pages.shape[2],
        seqused_k=seqused,
        block_table=block_table.to(torch.int32),
    )
    return out.view(batch, q_len, heads, -1).transpose(1, 2)
