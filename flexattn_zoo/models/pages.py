"""A page allocator for paged KV caches: the block table and lengths that ``fz.decode`` reads.

:class:`PageAllocator` (also ``fz.pages.PageAllocator``) hands out the pages of a pool of
``n_pages`` pages of ``page_size`` tokens to ``batch`` rows (sequences), and owns the two tensors
:func:`~flexattn_zoo.models.decode.decode_step` and :func:`~flexattn_zoo.models.decode.append_kv`
take with paged caches:

* :attr:`PageAllocator.block_table`: ``[batch, max_pages_per_row]`` int32 on ``device``;
  ``block_table[b, p]`` is the physical page of row ``b``'s logical page ``p`` (its tokens
  ``p * page_size .. (p + 1) * page_size - 1``), ``-1`` where the row has no page.
* :attr:`PageAllocator.cache_len`: ``[batch]`` int32 on ``device``, the tokens each row holds
  (``decode_step(cache_len=...)``: the new tokens included once :meth:`PageAllocator.extend`
  counted them).

Conventions:

* A row's pages are its logical pages ``0, 1, ...`` in order; it owns pages for
  ``ceil(reserved / page_size)`` tokens, where ``reserved`` is at least its length. Pages are
  taken from a free list, lowest page first while the pool is fresh, then the most recently
  freed first, so a row's physical pages are in no particular order. Pages never move: a
  token's page and slot stay fixed until its row is freed.
* Bookkeeping is on the host (the free list, each row's page list and length, in Python).
  The device tensors are the same two objects for the allocator's life, updated in place with
  a few device ops per call (an index write of the new table entries, a copy of the B lengths),
  never a Python loop per token, and nothing reads them back to the host.
* Every method checks its arguments (``ValueError`` / ``TypeError`` naming the argument) and
  either succeeds or changes nothing: a step that asks for more pages than are free, or grows a
  row past ``max_pages_per_row``, raises before any page is taken.
* Several layers share one allocator (one block table and one set of lengths for every layer's
  pools, as in vLLM): :meth:`PageAllocator.extend` once per step, then per layer
  :meth:`PageAllocator.write` its new keys and values and ``decode_step``.
  :meth:`PageAllocator.append` is ``extend`` + ``write`` for one layer.
* Prefix sharing (:meth:`PageAllocator.fork`, for parallel sampling and beam search): a forked
  row holds the same physical pages as its source, and each page counts the rows that hold it;
  :meth:`PageAllocator.free` returns a page to the free list when its last holder lets it go.
  Copy-on-write: tokens are only ever written at a row's positions past its length, so the one
  shared page a row can write into is its last, partially filled one. :meth:`PageAllocator.extend`
  gives the row a private page in its place (one more page from the free list, counted in its
  all-or-nothing check; of the page's holders extended in one call, the last keeps the page if
  no other row holds it then) and leaves the copy of the page's tokens pending; each
  :meth:`PageAllocator.write` (hence :meth:`PageAllocator.append`) makes that copy in the pools it
  is given, every layer its own (a caller that writes the tokens itself calls
  :meth:`PageAllocator.copy_pending` per layer). The old page is kept off the free list until the
  row's next ``extend`` or ``free``, so later layers still find the tokens to copy. Full shared
  pages are never copied.
* Not thread-safe: one allocator per serving loop (its calls change host lists and tensors).
* ``decode_step`` requires every row's ``cache_len`` to be at least ``Lq``: a batch with idle
  rows (length 0) decodes its live rows, e.g. ``decode_step(q[live], ..., alloc.cache_len[live],
  block_table=alloc.block_table[live])``.

CUDA graphs: a captured ``decode_step(q, k_pool, v_pool, alloc.cache_len,
block_table=alloc.block_table, kv_layout=...)`` reads the allocator's tensors on every replay,
and since they are updated in place, a replay sees the current pages and lengths. Allocation is
host work with host-to-device copies: call :meth:`~PageAllocator.extend`,
:meth:`~PageAllocator.reserve`, :meth:`~PageAllocator.free`, :meth:`~PageAllocator.fork` and
:meth:`~PageAllocator.append` *outside* captured regions, between replays, on the stream that replays (the device writes are
ordered after the kernels queued before them). ``write`` / ``append`` are not meant to be
captured either (they build index tensors on the host).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from numbers import Integral
from typing import Any, NamedTuple

import torch

from flexattn_zoo.models.decode import append_kv
from flexattn_zoo.validation import check_device_arg, check_strided

__all__ = ["PageAllocator"]

#: Pool layouts :meth:`PageAllocator.write` takes (those of ``append_kv``; None: flexattn_zoo's
#: own ``[1, Hkv, n_pages * page_size, D]``).
_LAYOUTS = ("NHD", "HND", None)


_INT32_MAX = 2**31 - 1


def _positive(value: Any, name: str, *, zero: bool = False) -> int:
    """``value`` as a plain int, numpy's integers included (counts read from numpy arrays)."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"PageAllocator {name} must be an int, got {type(value).__name__}")
    if value < 0 or (value == 0 and not zero):
        raise ValueError(f"PageAllocator {name} must be {'>= 0' if zero else '> 0'}, got {value}")
    return int(value)


class _Undo(NamedTuple):
    """What :meth:`PageAllocator._extend` changed, for :meth:`PageAllocator._unextend`."""

    grown: list[tuple[int, int]]  # (row, pages held before)
    copies: list[tuple[int, int, int]]  # copy-on-write: (row, shared page, private page)
    before: list[tuple[int, int, tuple[int, int, int] | None]]  # (row, fresh, pending) before
    released: list[int]  # pages the finished pending copies put on the free list, in order


class PageAllocator:
    """Pages of a KV pool for ``batch`` rows: a free list on the host, the block table and the
    lengths on the device (see the module docstring for the conventions).

    Args:
        n_pages: pages in the pool (each pool's dim 0 for ``kv_layout`` ``"NHD"`` / ``"HND"``).
        page_size: tokens per page.
        max_pages_per_row: the block table's width; a row holds at most
            ``max_pages_per_row * page_size`` tokens (``decode_step``'s cache capacity).
        batch: rows (sequences) in the batch, the table's height.
        device: where :attr:`block_table` and :attr:`cache_len` live (the pools' device).
        kv_layout: the pools' layout for :meth:`write` / :meth:`append`: ``"NHD"``
            ``[n_pages, page_size, Hkv, D]``, ``"HND"`` ``[n_pages, Hkv, page_size, D]`` or None
            ``[1, Hkv, n_pages * page_size, D]``; pass the same to ``decode_step``.

    Example: one layer, two rows (``k_new`` / ``v_new`` ``[B, Hkv, n, D]``)::

        alloc = PageAllocator(64, 16, 8, batch=2, kv_layout="NHD")
        alloc.append(k_pool, v_pool, k_prompt, v_prompt)  # a prefill of n tokens per row
        out = decode_step(q, k_pool, v_pool, alloc.cache_len, block_table=alloc.block_table,
                          kv_layout="NHD")
        alloc.free(1)  # row 1 is done: its pages go back to the free list

    Example: parallel sampling, three answers to row 0's prompt::

        alloc.fork(0, [1, 2])  # rows 1 and 2 share row 0's pages (no copy), same length
        alloc.append(k_pool, v_pool, k_new, v_new)  # [3, Hkv, 1, D]: a different token per row;
        # a shared, partly filled last page is copied first (each row gets its own), full pages
        # stay shared
        alloc.free([0, 1, 2])  # each page goes back once, when its last row lets it go
    """

    def __init__(
        self,
        n_pages: int,
        page_size: int,
        max_pages_per_row: int,
        *,
        batch: int,
        device: torch.device | str = "cpu",
        kv_layout: str | None = "NHD",
    ) -> None:
        self.n_pages = _positive(n_pages, "n_pages")
        self.page_size = _positive(page_size, "page_size")
        self.max_pages_per_row = _positive(max_pages_per_row, "max_pages_per_row")
        self.batch = _positive(batch, "batch")
        # block_table and cache_len are int32 (what decode_step and the kernels read): a page
        # number or a row length past 2**31 - 1 cannot be stored (n_pages = 2**40 failed as a
        # MemoryError building the free list).
        row_capacity = min(self.max_pages_per_row, self.n_pages) * self.page_size
        if self.n_pages > _INT32_MAX or row_capacity > _INT32_MAX:
            raise ValueError(
                f"PageAllocator n_pages ({self.n_pages}) and a row's capacity min(max_pages_per_row, n_pages) "
                f"* page_size ({row_capacity}) must be at most 2**31 - 1: block_table and cache_len are int32"
            )
        if kv_layout not in _LAYOUTS:
            raise ValueError(f"PageAllocator kv_layout must be 'NHD', 'HND' or None; got {kv_layout!r}")
        self.kv_layout = kv_layout
        self.device = check_device_arg(device, "PageAllocator(device=...)")
        # A stack: pop() takes the last entry, so 0, 1, 2, ... while fresh, then the last freed.
        self._free: list[int] = list(range(self.n_pages - 1, -1, -1))
        self._pages: list[list[int]] = [[] for _ in range(self.batch)]
        self._lengths: list[int] = [0] * self.batch
        #: Tokens the last extend() added per row: what write() places (0: nothing to write).
        self._fresh: list[int] = [0] * self.batch
        #: Rows holding each page (fork shares pages); a page is free when this and its pins are 0.
        self._refs: list[int] = [0] * self.n_pages
        #: Pending copy-on-write copies that read each page (see _pending).
        self._pins: list[int] = [0] * self.n_pages
        #: Per row, the copy its last extend left for write: (shared page, private page, tokens).
        self._pending: list[tuple[int, int, int] | None] = [None] * self.batch
        i32 = torch.int32
        self._table = torch.full((self.batch, self.max_pages_per_row), -1, dtype=i32, device=self.device)
        self._cache_len = torch.zeros(self.batch, dtype=i32, device=self.device)

    # ---- state ---------------------------------------------------------------------------------

    @property
    def block_table(self) -> torch.Tensor:
        """``[batch, max_pages_per_row]`` int32 on :attr:`device`, -1 for no page; always the same
        tensor, updated in place (a CUDA graph that captured it sees the updates)."""
        return self._table

    @property
    def cache_len(self) -> torch.Tensor:
        """``[batch]`` int32 on :attr:`device`, each row's length (tokens counted by
        :meth:`extend`); always the same tensor, updated in place."""
        return self._cache_len

    @property
    def lengths(self) -> list[int]:
        """Each row's length on the host (a copy; :attr:`cache_len` holds the same values)."""
        return list(self._lengths)

    @property
    def capacity(self) -> int:
        """Most tokens a row can hold: ``max_pages_per_row * page_size``."""
        return self.max_pages_per_row * self.page_size

    @property
    def n_free(self) -> int:
        """Pages on the free list (a page shared by several rows is not on it, and counts once)."""
        return len(self._free)

    def pages(self, row: int) -> list[int]:
        """Row ``row``'s physical pages in logical order (a copy)."""
        rows = self._rows(row)
        if len(rows) != 1 or not hasattr(row, "__index__"):
            raise TypeError(f"PageAllocator.pages takes one row index, got {row!r}")
        return list(self._pages[rows[0]])

    # ---- allocation ----------------------------------------------------------------------------

    def reserve(self, n_tokens: int, rows: int | Iterable[int] | None = None) -> None:
        """Give each of ``rows`` (None: every row) pages for ``n_tokens`` tokens past its length,
        without counting them (e.g. a prompt and its longest answer when a request is admitted,
        so later steps cannot run out of pages). Pages already held count towards it."""
        n = _positive(n_tokens, "n_tokens", zero=True)
        rows_ = self._rows(rows)
        self._grow(rows_, [self._lengths[r] + n for r in rows_], n)

    def extend(self, n_tokens: int, rows: int | Iterable[int] | None = None) -> torch.Tensor:
        """Count ``n_tokens`` new tokens in each of ``rows`` (None: every row), taking the pages
        they need; returns :attr:`cache_len`. The new tokens' positions are then the last
        ``n_tokens`` of each row, where :meth:`write` puts them.

        Copy-on-write: a row whose last page is partly filled and shared with another row
        (:meth:`fork`) gets a private page in its place (one more page from the free list; the
        other rows keep the old one, and the last of its holders in ``rows`` writes in it in place
        when no row outside ``rows`` holds it). The tokens already in that page are copied into the new one
        by each :meth:`write` of the row (every layer's pools), or by :meth:`copy_pending` for a
        caller that writes the new tokens itself: do one or the other for every layer before
        reading the row. The old page stays off the free list until the row's next ``extend`` or
        :meth:`free`."""
        n = _positive(n_tokens, "n_tokens", zero=True)
        self._extend(n, self._rows(rows))
        return self._cache_len

    def _extend(self, n: int, rows: list[int]) -> _Undo:
        """:meth:`extend`; returns what it changed, for :meth:`_unextend`."""
        page = self.page_size
        # The rows' pending copies are done (write only writes the tokens of the last extend):
        # a shared page that only they still read goes back first, and may serve this step.
        before = [(r, self._fresh[r], self._pending[r]) for r in rows]
        released = []
        for r in rows:
            done = self._pending[r]
            self._pending[r] = None
            if done is not None:
                self._pins[done[0]] -= 1
                if self._release(done[0]):
                    released.append(done[0])
        # The rows whose next token lands in a shared, partly filled page: copy-on-write, except
        # for the last of its holders in this step, which keeps the page and writes in place.
        cow = []
        holders: dict[int, int] = {}
        for r in rows:
            if n and self._lengths[r] % page:
                p = self._pages[r][self._lengths[r] // page]
                left = holders.setdefault(p, self._refs[p])
                if left > 1:
                    cow.append(r)
                    holders[p] = left - 1
        try:
            grown = self._grow(rows, [self._lengths[r] + n for r in rows], n, extra=len(cow))
        except ValueError:
            self._unrelease(before, released)
            raise
        # Nothing can fail from here on. The private pages are taken after the grown ones
        # (_unextend puts them back in the reverse order).
        flat, taken = [], []
        copies = []
        for r in cow:
            i = self._lengths[r] // page
            old, new = self._pages[r][i], self._free.pop()
            self._pages[r][i] = new
            self._refs[old] -= 1  # still held by the rows it was shared with
            self._refs[new] = 1
            self._pins[old] += 1  # kept until the copies are done
            self._pending[r] = (old, new, self._lengths[r] % page)
            flat.append(r * self.max_pages_per_row + i)
            taken.append(new)
            copies.append((r, old, new))
        if flat:
            self._set_entries(flat, taken)
        for r in rows:
            self._lengths[r] += n
            self._fresh[r] = n
        self._write_lengths()
        return _Undo(grown, copies, before, released)

    def _unrelease(
        self, before: list[tuple[int, int, tuple[int, int, int] | None]], released: list[int]
    ) -> None:
        """Undo the release of the pending copies at the start of :meth:`_extend`."""
        for p in reversed(released):  # the last pages pushed on the free list
            popped = self._free.pop()
            assert popped == p
        for r, _, pending in before:
            self._pending[r] = pending
            if pending is not None:
                self._pins[pending[0]] += 1

    def _unextend(self, n: int, undo: _Undo) -> None:
        """Undo :meth:`_extend` (right after it): pages, table, counts and lengths as before."""
        flat, olds = [], []
        for r, old, new in reversed(undo.copies):
            i = (self._lengths[r] - n) // self.page_size  # the page of the length before extend
            self._pages[r][i] = old
            self._refs[old] += 1
            self._pins[old] -= 1
            self._refs[new] = 0
            self._free.append(new)
            flat.append(r * self.max_pages_per_row + i)
            olds.append(old)
        if flat:
            self._set_entries(flat, olds)
        self._shrink(undo.grown)
        self._unrelease(undo.before, undo.released)
        for r, fresh, _ in undo.before:
            self._lengths[r] -= n
            self._fresh[r] = fresh
        self._write_lengths()

    def free(self, rows: int | Iterable[int]) -> None:
        """Let ``rows`` go of their pages and empty them (length 0, table row -1): the rows can
        start new sequences. A page goes back to the free list when no row holds it any more
        (pages shared by :meth:`fork` stay with the rows that still hold them)."""
        rows_ = self._rows(rows)
        for r in rows_:
            pending = self._pending[r]
            if pending is not None:
                self._pins[pending[0]] -= 1
                self._release(pending[0])
            self._pending[r] = None
            for p in self._pages[r]:  # the row's last page is the next one taken
                self._refs[p] -= 1
                self._release(p)
            self._pages[r] = []
            self._lengths[r] = self._fresh[r] = 0
        if rows_:
            idx = torch.tensor(rows_, dtype=torch.int64, device=self.device)
            self._table.index_fill_(0, idx, -1)
            self._cache_len.index_fill_(0, idx, 0)

    def fork(self, src_row: int, dst_rows: int | Iterable[int]) -> None:
        """Share row ``src_row``'s tokens with each of ``dst_rows`` (parallel sampling, beam
        search): each destination row gets the source's length and the source's pages that hold
        its tokens, the same physical pages in its block-table row (nothing is copied; pages the
        source reserved past its length stay the source's alone). The rows then grow apart:
        the first token a row writes into a shared, partly filled last page gives it a private
        copy of that page (see :meth:`extend`); full shared pages stay shared until their last
        holder is freed.

        Every destination row must hold no pages (a fresh or :meth:`free`-d row) and differ from
        ``src_row``; a destination row has no tokens to :meth:`write` until its next
        :meth:`extend`. Raises ``ValueError`` / ``TypeError`` naming the row, changing nothing."""
        src = self._rows(src_row)
        if len(src) != 1 or not hasattr(src_row, "__index__"):
            raise TypeError(f"PageAllocator.fork src_row must be one row index, got {src_row!r}")
        s = src[0]
        dsts = self._rows(dst_rows)
        for d in dsts:
            if d == s:
                raise ValueError(f"PageAllocator.fork: row {d} is both the source and a destination")
            if self._pages[d]:
                raise ValueError(
                    f"PageAllocator.fork: destination row {d} holds {len(self._pages[d])} pages (length "
                    f"{self._lengths[d]}): free it first, a row forked into must hold no pages"
                )
        length = self._lengths[s]
        shared = self._pages[s][: -(-length // self.page_size)]
        flat, values = [], []
        for d in dsts:
            self._pages[d] = list(shared)
            self._lengths[d] = length
            self._fresh[d] = 0
            flat += [d * self.max_pages_per_row + i for i in range(len(shared))]
            values += shared
        for p in shared:
            self._refs[p] += len(dsts)
        if flat:
            self._set_entries(flat, values)
        self._write_lengths()

    # ---- writing tokens ------------------------------------------------------------------------

    def write(
        self,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        rows: int | Iterable[int] | None = None,
    ) -> None:
        """Write the tokens the last :meth:`extend` of ``rows`` counted into one layer's pools, in
        place, with ``append_kv``: ``k_new`` / ``v_new`` ``[len(rows), Hkv, n, D]`` (None: every
        row, ``[batch, ...]``) go to each row's last ``n`` positions; ``n`` must be what that
        extend counted. Call once per layer, each with its own pools. A row that extend moved
        off a shared page (copy-on-write, see :meth:`fork`) also gets that page's earlier tokens
        copied into its private page here, in these pools."""

        rows_ = self._rows(rows)
        if not isinstance(k_new, torch.Tensor) or k_new.dim() != 4:
            what = tuple(k_new.shape) if isinstance(k_new, torch.Tensor) else type(k_new).__name__
            raise ValueError(f"PageAllocator k_new must be [len(rows), Hkv, n, D], got {what}")
        n = k_new.shape[2]
        if k_new.shape[0] != len(rows_):
            raise ValueError(
                f"PageAllocator k_new must hold one row per entry of rows ({len(rows_)}), got {k_new.shape[0]}"
            )
        stale = [r for r in rows_ if self._fresh[r] != n]
        if stale:
            r = stale[0]
            raise ValueError(
                f"PageAllocator k_new holds n={n} tokens per row but the last extend of row {r} counted "
                f"{self._fresh[r]}: call extend(n_tokens, rows) first (once per step, for every layer)"
            )
        for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
            pages = self._pool_pages(pool)
            if pages is not None and pages < self.n_pages:
                raise ValueError(
                    f"PageAllocator {name} holds {pages} pages, fewer than the allocator's n_pages="
                    f"{self.n_pages} (shape {tuple(pool.shape)}, kv_layout={self.kv_layout!r})"
                )
        if len(rows_) == self.batch and rows_ == list(range(self.batch)):
            table, starts = self._table, self._cache_len - n
        else:
            idx = torch.tensor(rows_, dtype=torch.int64, device=self.device)
            table, starts = self._table[idx], self._cache_len[idx] - n
        append_kv(
            k_pool, v_pool, table, starts, k_new, v_new, kv_layout=self.kv_layout, block_size=self.page_size
        )
        # Copy-on-write: the tokens before the new ones in a page that was shared (append_kv wrote
        # the new ones past them; the shared page's tokens there are never overwritten).
        self._copy(k_pool, v_pool, rows_)

    def copy_pending(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: int | Iterable[int] | None = None
    ) -> None:
        """Make, in one layer's pools, the copies the last :meth:`extend` of ``rows`` (None: every
        row) left pending: the tokens of a shared, partly filled last page, copied into the private
        page that took its place in the row (a few slices per such row; nothing for the others).
        :meth:`write` does this itself; call it per layer when writing the new tokens some other
        way (e.g. ``append_kv`` through :attr:`block_table`). Copying twice is harmless."""
        rows_ = self._rows(rows)
        for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
            pages = self._pool_pages(pool)
            if pages is None or pages < self.n_pages:
                what = tuple(pool.shape) if isinstance(pool, torch.Tensor) else type(pool).__name__
                raise ValueError(
                    f"PageAllocator {name} must be a pool of at least n_pages={self.n_pages} pages for "
                    f"kv_layout={self.kv_layout!r}, got {what}"
                )
        self._copy(k_pool, v_pool, rows_)

    def _copy(self, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: list[int]) -> None:
        page = self.page_size
        for r in rows:
            pending = self._pending[r]
            if pending is None:
                continue
            old, new, k = pending
            for pool in (k_pool, v_pool):
                if self.kv_layout == "NHD":
                    pool[new, :k] = pool[old, :k]
                elif self.kv_layout == "HND":
                    pool[new, :, :k] = pool[old, :, :k]
                else:
                    pool[:, :, new * page : new * page + k] = pool[:, :, old * page : old * page + k]

    def append(
        self,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        rows: int | Iterable[int] | None = None,
    ) -> torch.Tensor:
        """:meth:`extend` ``rows`` by ``k_new.shape[2]`` tokens, then :meth:`write` them into one
        layer's pools; returns :attr:`cache_len` (for ``decode_step``). If the write fails its
        checks, the extend is undone (pages and lengths as before)."""
        if isinstance(k_new, torch.Tensor):
            check_strided("PageAllocator k_new", k_new)  # before .shape, which a nested one lacks
        if not isinstance(k_new, torch.Tensor) or k_new.dim() != 4:
            what = tuple(k_new.shape) if isinstance(k_new, torch.Tensor) else type(k_new).__name__
            raise ValueError(f"PageAllocator k_new must be [len(rows), Hkv, n, D], got {what}")
        rows_ = self._rows(rows)
        n = k_new.shape[2]
        undo = self._extend(n, rows_)
        try:
            self.write(k_pool, v_pool, k_new, v_new, rows_)
        except (TypeError, ValueError):
            self._unextend(n, undo)
            raise
        return self._cache_len

    # ---- internals -----------------------------------------------------------------------------

    def _rows(self, rows: int | Iterable[int] | None) -> list[int]:
        """``rows`` as a list of distinct row indices in ``0 .. batch - 1`` (None: all of them)."""
        if rows is None:
            return list(range(self.batch))
        given: Any = rows  # an int, a sequence, a numpy or torch integer...
        try:
            if isinstance(given, torch.Tensor):
                if given.dtype == torch.bool or given.is_floating_point() or given.is_complex():
                    raise TypeError
                items: list[Any] = given.reshape(-1).tolist()
            elif isinstance(given, bool):
                raise TypeError
            elif hasattr(given, "__iter__") and getattr(given, "ndim", 1) != 0:
                # A sequence or an array of rows (a numpy array has ``__index__`` too, which
                # refuses all but one element: rows=np.flatnonzero(done) was refused).
                items = list(given)
            else:
                items = [operator.index(given)]
            if any(isinstance(r, bool) for r in items):
                raise TypeError
            out = [operator.index(r) for r in items]
        except TypeError:
            raise TypeError(
                f"PageAllocator rows must be a row index, a sequence of row indices or None, got {rows!r}"
            ) from None
        for r in out:
            if not 0 <= r < self.batch:
                raise ValueError(
                    f"PageAllocator rows: row {r} is outside 0 .. {self.batch - 1} (batch={self.batch})"
                )
        if len(set(out)) != len(out):
            raise ValueError(f"PageAllocator rows must be distinct, got {out}")
        return out

    def _grow(self, rows: list[int], targets: list[int], n: int, extra: int = 0) -> list[tuple[int, int]]:
        """Give each ``rows[i]`` pages for ``targets[i]`` tokens, all or none, with one device write
        of the new table entries; returns ``(row, pages it held before)`` for :meth:`_shrink`.
        Raises, taking nothing, unless ``extra`` more pages (copy-on-write) would be left free."""
        page = self.page_size
        need = []
        for r, target in zip(rows, targets, strict=True):
            if target > self.capacity:
                raise ValueError(
                    f"PageAllocator row {r} would hold {target} tokens ({self._lengths[r]} + n_tokens={n}), "
                    f"over max_pages_per_row={self.max_pages_per_row} pages of page_size={page} "
                    f"({self.capacity} tokens)"
                )
            need.append(max(0, -(-target // page) - len(self._pages[r])))
        total = sum(need)
        if total + extra > len(self._free):
            cow = f" ({extra} of them private copies of shared pages)" if extra else ""
            raise ValueError(
                f"PageAllocator is out of pages: n_tokens={n} for rows {rows} needs {total + extra} new "
                f"pages{cow}, {len(self._free)} of n_pages={self.n_pages} are free (free finished rows first)"
            )
        before = [(r, len(self._pages[r])) for r in rows]
        if total:
            flat, taken = [], []
            for r, k in zip(rows, need, strict=True):
                held = self._pages[r]
                for _ in range(k):
                    flat.append(r * self.max_pages_per_row + len(held))
                    held.append(self._free.pop())
                    self._refs[held[-1]] = 1
                    taken.append(held[-1])
            self._set_entries(flat, taken)
        return before

    def _shrink(self, before: list[tuple[int, int]]) -> None:
        """Undo :meth:`_grow`: its pages back on the free list in the order they were taken."""
        flat = []
        for r, count in reversed(before):
            held = self._pages[r]
            flat += [r * self.max_pages_per_row + c for c in range(count, len(held))]
            for p in held[count:]:
                self._refs[p] = 0
            self._free.extend(reversed(held[count:]))
            del held[count:]
        if flat:
            self._set_entries(flat, [-1] * len(flat))

    def _release(self, page: int) -> bool:
        """Put ``page`` on the free list if no row holds it and no pending copy reads it."""
        if self._refs[page] or self._pins[page]:
            return False
        self._free.append(page)
        return True

    def _write_lengths(self) -> None:
        """``cache_len`` from the host's lengths (one host-to-device copy)."""
        self._cache_len.copy_(torch.tensor(self._lengths, dtype=torch.int32, device="cpu"))

    def _set_entries(self, flat: list[int], values: list[int]) -> None:
        """``block_table.view(-1)[flat] = values``: one host-to-device copy and one index write."""
        both = torch.tensor([flat, values], dtype=torch.int64, device="cpu").to(self.device)
        self._table.view(-1).index_copy_(0, both[0], both[1].to(torch.int32))

    def _pool_pages(self, pool: Any) -> int | None:
        """Pages in ``pool`` by its shape (None: not a 4-dim tensor; append_kv names that)."""
        if not isinstance(pool, torch.Tensor) or pool.dim() != 4:
            return None
        if self.kv_layout is None:
            return pool.shape[2] // self.page_size
        return pool.shape[0]

    def __repr__(self) -> str:
        return (
            f"PageAllocator(n_pages={self.n_pages}, page_size={self.page_size}, max_pages_per_row="
            f"{self.max_pages_per_row}, batch={self.batch}, device={str(self.device)!r}, "
            f"kv_layout={self.kv_layout!r}; {self.n_free} pages free)"
        )
