"""The decode BlockMask: one per (pattern, batch, Lq, cache capacity), updated in place each step.

Positions are absolute: a step's query ``q_idx`` of row ``b`` sits at ``cache_len[b] - Lq +
q_idx``, and the pattern (a mask spec) is evaluated there. :class:`DecodeMask` keeps the lengths
(and, for paged caches, a physical-page-to-position table) in tensors its ``mask_mod`` and score
mods capture, and :meth:`DecodeMask.update` rewrites them and the kv block list with device ops
only, so the BlockMask object, its shapes and the compiled kernel stay the same from step to step.
:data:`CAPTURED` keeps the masks a CUDA graph captured alive.
"""

from __future__ import annotations

from typing import Any

import torch

from flexattn_zoo import _compat
from flexattn_zoo.functions import FunctionScore
from flexattn_zoo.lru import ClockCache, LRUCache
from flexattn_zoo.models.decode.runs import _Run
from flexattn_zoo.spec import MaskSpec
from flexattn_zoo.validation import check_count, check_device_arg

DEFAULT_BLOCK_SIZE = 128
#: Planned call signatures kept per DecodeMask (dtypes, score mods... seen with it).
RUNS_PER_MASK = 16
#: Score mods seen through one decode mask, kept per score callable.
SCORES_PER_MASK = 16


def lowest_key(spec: MaskSpec | None, q_abs: torch.Tensor) -> torch.Tensor:
    """A lower bound on the keys the pattern lets absolute queries ``q_abs`` (int64) see: the
    spec's ``lowest_visible_key``, or 0 where it offers none.

    Used only to skip kv blocks, so any lower bound is correct; a tight one saves bandwidth. It
    never decreases with the query position, so the bound of a q block's first query holds for
    the whole block.
    """
    bound = spec.lowest_visible_key(q_abs) if spec is not None else None
    return torch.zeros_like(q_abs) if bound is None else bound


#: Positions per entry of :data:`LOWEST_KEYS`: a generation loop moves one position per step, so
#: a block's bounds serve that many steps.
LOWEST_KEY_BLOCK = 128
#: Entries of :data:`LOWEST_KEYS`: room for a model's few distinct patterns over a batch's spread
#: of lengths.
LOWEST_KEYS_SIZE = 256
#: ``(spec, position // LOWEST_KEY_BLOCK)`` -> ``max(lowest_visible_key, 0)`` of that block's
#: positions as Python ints, so a step with an int length reads its bound without a tensor op.
#: Specs are immutable and compared by value: an entry holds for any equal spec (a new
#: ``SlidingWindow`` per call finds it too). Only for specs that hold no tensor (their bound is
#: arithmetic on the positions, computed on the CPU here).
LOWEST_KEYS: ClockCache[list[int]] = ClockCache(LOWEST_KEYS_SIZE)


def lowest_key_at(spec: MaskSpec, position: int) -> int:
    """:func:`lowest_key` of one absolute position ``>= 0``, clamped to 0, as an int (cached: see
    :data:`LOWEST_KEYS`). ``spec`` must hold no tensor."""
    block, offset = divmod(position, LOWEST_KEY_BLOCK)
    key = (spec, block)
    bounds = LOWEST_KEYS.get_eager(key)
    if bounds is None:
        first = block * LOWEST_KEY_BLOCK
        lo = spec.lowest_visible_key(torch.arange(first, first + LOWEST_KEY_BLOCK, device="cpu"))
        bounds = LOWEST_KEYS.put(key, [0] * LOWEST_KEY_BLOCK if lo is None else lo.clamp(min=0).tolist())
    return bounds[offset]


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
        # Checked once per DecodeMask (decode_step caches them): the arithmetic below would
        # otherwise divide by zero or build tensors of negative size.
        if spec is not None and not isinstance(spec, MaskSpec):
            raise TypeError(
                f"DecodeMask(spec=...) must be a mask spec (e.g. masks.Causal()) or None, got {type(spec).__name__}"
            )
        for name, value in (("batch", batch), ("capacity", capacity), ("block_size", block_size)):
            check_count(f"DecodeMask({name}=...)", value)
        for name, optional in (("n_physical", n_physical), ("q_block_size", q_block_size)):
            if optional is not None:
                check_count(f"DecodeMask({name}=...)", optional)
        if isinstance(q_len, bool) or not isinstance(q_len, int) or q_len < 0:
            raise ValueError(f"DecodeMask(q_len=...) must be an int >= 0, got {q_len!r}")
        device = check_device_arg(device, "DecodeMask(device=...)")
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
        self._logical_steps = torch.arange(self.n_logical, dtype=torch.int64, device=device)
        # Blocks 0 .. last for every row when the pattern has no lower bound on a contiguous cache:
        # kv_indices never changes, and update() writes only the lengths and counts (one or two
        # fills for an int length, four ops for a tensor, instead of about 20).
        self._indices_fixed = not self.paged and not _bounded_below(self.spec, device)
        # A pattern bounded below whose bound is arithmetic (no tensor): for an int length the
        # block list is known on the host, and update() rewrites it only when it changes.
        self._host_bounds = (
            not self.paged and not self._indices_fixed and self.spec is not None and not self.spec.tensors()
        )
        self._q_starts_host = [i * self.q_block_size for i in range(n_q)]
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
        #: The block list update() last wrote from an int length on a host-bounded pattern:
        #: (first block of each q block, last block, any key) (None: unknown).
        self._list_written: tuple[tuple[int, ...], int, bool] | None = None
        self.captured = False
        #: score_mod / score_spec results per ``inner`` (bounded: a caller may pass a new score
        #: callable on every step).
        self._scores: LRUCache[Any] = LRUCache(SCORES_PER_MASK)
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
        self._list_written = None
        CAPTURED.add(self)

    def score_mod(self, inner: Any, *, paged: bool | None = None) -> Any:
        """``inner`` (a flex score_mod over absolute positions) seen through this mask's lengths;
        one function object per ``inner`` so compiled kernels are reused."""
        paged = self.paged if paged is None else paged

        def make() -> Any:
            cache_len, logical, q_len = self.cache_len, self._logical, self.q_len

            def decode_score(score, b, h, q_idx, kv_idx):
                kv = logical(b, kv_idx) if paged else kv_idx
                return inner(score, b, h, q_idx + (cache_len[b] - q_len), kv)

            return decode_score

        return self._scores.get_or_create((inner, paged), make)

    def score_spec(self, inner: Any) -> FunctionScore:
        """:meth:`score_mod` of ``inner`` as a spec, one object per ``inner`` (a stable plan key)."""
        # Untracked: its closure reads the lengths update() rewrites in place every step, and
        # only kernels read them (nothing cached derives from their values).
        return self._scores.get_or_create(
            ("spec", inner),
            lambda: FunctionScore(fn=self.score_mod(inner), label="decode", tracked=False),
        )

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
            if self._host_bounds:
                # The block list from host ints: when it is the one written last (it moves once
                # every block_size tokens), only the lengths are written, one fill instead of the
                # 15-odd ops below. A captured mask never keeps a record (see _fill_count).
                spec, starts = self.spec, self._q_starts_host
                assert spec is not None  # _host_bounds: a pattern bounded below
                listed = (
                    tuple(lowest_key_at(spec, cache_len - self.q_len + s) // bs for s in starts),
                    max(cache_len - 1, 0) // bs,
                    cache_len > 0,
                )
                if listed == self._list_written:
                    self.cache_len.fill_(cache_len)
                    return self.block_mask
                self._write_lists(
                    torch.full((self.batch,), cache_len, dtype=torch.int64, device=self.cache_len.device),
                    None,
                )
                self._list_written = None if self.captured else listed
                return self.block_mask
            cache_len = torch.full((self.batch,), cache_len, dtype=torch.int64, device=self.cache_len.device)
        self._write_lists(cache_len, block_table)
        return self.block_mask

    def _write_lists(self, cache_len: torch.Tensor, block_table: torch.Tensor | None) -> None:
        """:meth:`update` from ``[B]`` lengths on the device: lengths, counts and block lists."""
        bs = self.block_size
        self._list_written = None  # written from device values
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
            return
        lens = cache_len.to(self.cache_len.device, torch.int64)
        self.cache_len.copy_(lens)
        q_abs = (lens - self.q_len)[:, None] + self._q_starts[None, :]  # first query of each q block
        first = torch.div(lowest_key(self.spec, q_abs).clamp(min=0), bs, rounding_mode="floor")
        last = torch.div((lens - 1).clamp(min=0), bs, rounding_mode="floor")[:, None]
        if self.paged:
            assert block_table is not None
            table = block_table.to(self.cache_len.device, torch.int64)
            n_phys = self.page_start.shape[1] - 1
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
            num, indices = self._owned_blocks(table, owned, first, last, lens)
        else:
            num = (last - first + 1).clamp(0, self.kv_indices.shape[-1]) * (lens > 0)[:, None]
            indices = (first[..., None] + self._steps).clamp(max=self.n_logical - 1)
        self.kv_num_blocks.copy_(num[:, None, :])
        self.kv_indices.copy_(indices[:, None, :, :])

    def _owned_blocks(
        self,
        table: torch.Tensor,
        owned: torch.Tensor,
        first: torch.Tensor,
        last: torch.Tensor,
        lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kv block list of a paged cache: ``(counts [B, n_q], physical pages [B, n_q, n_kv])``,
        the pages of logical pages ``first .. last`` that each row owns, in logical order.

        Entries without a page (-1, or past the pool) are left out of the list, not listed as a
        clamped page number: flex reads a listed block as many times as it is listed, so a hole
        listed as page 0 counted page 0's keys twice in a row that owns page 0, and a row with
        more logical pages in range than the pool has pages lost the pages past that many. The
        owned pages are moved to the front with a cumulative sum and a scatter (device ops only,
        as the rest of :meth:`update`); the others go to a spare last column that is never read.
        """
        n_kv, n_phys = self.kv_indices.shape[-1], self.page_start.shape[1] - 1
        span = first[..., None] + self._logical_steps  # [B, n_q, n_logical] logical pages
        rows = span.shape[0]
        clamped = span.clamp(max=self.n_logical - 1).reshape(rows, -1)
        listed = (
            owned.gather(1, clamped).view_as(span) & (span <= last[..., None]) & (lens > 0)[:, None, None]
        )
        slot = torch.where(listed, listed.cumsum(-1) - 1, span.shape[-1])
        compact = torch.zeros(*span.shape[:-1], span.shape[-1] + 1, dtype=torch.int64, device=span.device)
        compact.scatter_(-1, slot, table.gather(1, clamped).view_as(span))
        # Clamped into the pool (a row cannot own more distinct pages than the pool holds; the
        # clamps only keep a malformed CUDA table, not read on the host, inside the pool).
        num = listed.sum(-1).clamp(max=n_kv)
        if compact.shape[-1] < n_kv:
            compact = torch.nn.functional.pad(compact, (0, n_kv - compact.shape[-1]))
        return num, compact[..., :n_kv].clamp(0, n_phys - 1)


def _page_map(page_start: torch.Tensor, page: int) -> Any:
    """``(b, kv_idx) -> logical position`` of physical key ``kv_idx`` in row ``b`` (below 0 where
    row ``b`` owns no page there), through ``page_start`` ``[B, n_physical + 1]``.

    A closure over the page size: the compile key (``compile.mod_key``) holds the captured
    constants, so each page size gets its own compiled entry. Two page sizes sharing one entry
    made Dynamo turn the page size into a symbol that torch's CPU flex template fails to compile
    (C++ errors).
    """

    def logical(b, kv_idx):
        return page_start[b, kv_idx // page] + kv_idx % page

    return logical


#: DecodeMasks that a CUDA graph captured: kept alive for the life of the process, whatever the
#: LRU drops, because a replay reads (and writes) their tensors without asking Python.
CAPTURED: set[DecodeMask] = set()
