"""``block_select``: top-k block sparsity; each query block attends the key blocks it selected."""

from __future__ import annotations

from typing import Any

import torch

from flexattn_zoo.registry import MASKS
from flexattn_zoo.spec import (
    BlockMap,
    MaskMod,
    MaskSpec,
    Spec,
    block_ranges,
    spec_dataclass,
    static_int,
    tracing,
)

from ._blocks import INDEX_LIMIT, check_int
from .dense import broadcast_indexer


@MASKS.register
@spec_dataclass
class BlockSelect(MaskSpec):
    """Top-k block sparsity: each query block sees only the key blocks its row of ``indices`` lists.

    The selection of VSA's top-k blocks, NSA's selected blocks or MoBA's gating, given as block
    numbers. Positions are cut into blocks of ``block_size`` (one int, or ``(q_block,
    kv_block)``): query ``i`` is in query block ``i // q_block``, key ``j`` in key block
    ``j // kv_block``. Key ``j`` is visible to query ``i`` of batch row ``b`` under head ``h`` iff
    ``j // kv_block`` appears in ``indices[b, h, i // q_block, :]``. The selection comes from the
    model (scores of pooled queries against pooled keys, a router, a fixed pattern); this spec
    runs it exactly.

    Picture (``block_size=2``, ``indices = [[0, -1], [0, 1], [2, 0], [1, 3]]``; ``#`` visible)::

        ##......
        ##......
        ####....
        ####....
        ##..##..
        ##..##..
        ..##..##
        ..##..##

    Conventions:

    * ``-1`` means "no block" and may appear anywhere in a row: rows that select fewer than ``k``
      blocks are padded with it (a row of ``-1`` sees nothing; its output is 0).
    * Duplicates are allowed and harmless: a block listed twice is selected once (some top-k
      implementations pad with a repeated index instead of ``-1``).
    * The order within a row does not matter.
    * A selected block that the sequence end cuts (the last, shorter block) covers only its valid
      positions; a selected block wholly past ``Lkv`` selects nothing.
    * Not causal: a query sees all of a selected block, also keys after it. For causal block
      selection (NSA, MoBA in a decoder) combine with ``& masks.Causal()``: the selected blocks below
      the diagonal stay full, the diagonal ones become partial.

    ``num_kv_blocks`` is the number of key blocks the indices count (the width of the block
    scores they came from); ``None`` takes the largest index + 1. Every index must be below it, and
    the problem's keys must fit: ``ceil(Lkv / kv_block) <= num_kv_blocks``. Likewise ``indices``
    needs a row for every query block: ``ceil(Lq / q_block) <= n_q_blocks`` (more rows are
    ignored). ``block_size=(1, kv_block)`` selects per query token, as NSA does.

    The ``mask_mod`` looks the pair up in a boolean block table ``[B|1, H|1, n_q_blocks,
    num_kv_blocks]`` made once from ``indices`` when the spec is built (one table load per pair,
    vmap- and compile-friendly; the table is ``(L / block)**2`` per head, far below ``L**2``). The
    :meth:`dense` oracle compares key blocks with each listed index instead.

    Forms offered: a closed-form block map at any BlockMask block size, from the table alone (no
    mask evaluation): at the selection's own block size every selected block is full (a block the
    sequence end cuts is partial) and every other block empty; at other sizes a block is full iff
    it is complete and every selection block it overlaps is selected. ``fz.block_mask(spec, Lq,
    Lkv, block_size=...)`` at the selection's block size (a multiple of 16) is thus a BlockMask
    straight from the indices, with no partial block. No SDPA or varlen form.

    Args:
        indices: integer tensor ``[n_q_blocks, k]`` (shared by every batch row and head) or
            ``[B|1, H|1, n_q_blocks, k]``, ``k >= 1``, entries ``-1 <= idx < num_kv_blocks``
            (lists are converted; stored 4-D, int64). 3-D tensors are refused as ambiguous (add the
            missing dim). Read once when the spec is built (a device sync).
        block_size: positions per block, ``>= 1``: an int for both sides, or ``(q_block,
            kv_block)``.
        num_kv_blocks: key blocks the indices count (``>= 1``); default ``max(indices) + 1``.
    """

    indices: torch.Tensor
    block_size: int | tuple[int, int]
    num_kv_blocks: int | None = None

    depends_on_batch = True  # class defaults; uses_batch() / uses_head() say what this one does
    depends_on_head = True

    def __post_init__(self) -> None:
        owner = "BlockSelect"
        sizes = _block_sizes(self.block_size, owner)
        idx = _index_tensor(self.indices, owner)
        # No data to read while torch.compile traces (the values would be baked into the graph)
        # or on the meta device; the range checks happened where the spec was first built.
        readable = not tracing() and idx.device.type != "meta"
        count = self.num_kv_blocks
        if count is None:
            if not readable:
                raise ValueError(
                    f"{owner}(num_kv_blocks=...) must be given for indices on the meta device or "
                    "inside torch.compile (the default reads the indices)"
                )
            count = max(1, int(idx.max()) + 1)
        count = check_int("num_kv_blocks", count, minimum=1, owner=owner)
        if readable:
            lo, hi = (int(v) for v in torch.aminmax(idx))
            if lo < -1 or hi >= count:
                bad = lo if lo < -1 else hi
                raise ValueError(
                    f"{owner}(indices=...) must hold key block numbers in [0, num_kv_blocks = {count}) "
                    f"or -1 (no block), got {bad}"
                )
        object.__setattr__(self, "indices", idx)
        object.__setattr__(self, "block_size", sizes)
        object.__setattr__(self, "num_kv_blocks", count)
        # The block table the mask_mod and the block map read, made here rather than when the
        # mask_mod is built (which may happen while torch.compile traces). It lives on the
        # indices' device; Spec.to builds a new spec, so a moved spec gets its own table.
        object.__setattr__(self, "_table", _block_table(idx, count))

    @classmethod
    def from_block_scores(
        cls, scores: torch.Tensor, topk: int, block_size: int | tuple[int, int]
    ) -> BlockSelect:
        """The ``topk`` highest-scoring key blocks of each query block.

        ``scores`` is a float tensor ``[n_q_blocks, n_kv_blocks]`` or ``[B|1, H|1, n_q_blocks,
        n_kv_blocks]`` (e.g. pooled queries against pooled keys, VSA's coarse stage); a score of
        ``-inf`` (or NaN) is never selected (mask future blocks that way for causal selection), and rows
        with fewer than ``topk`` finite scores are padded with ``-1``. ``topk`` above
        ``n_kv_blocks`` selects every block. ``num_kv_blocks`` is ``n_kv_blocks``.
        """
        owner = "BlockSelect.from_block_scores"
        if not isinstance(scores, torch.Tensor) or not scores.is_floating_point():
            got = scores.dtype if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise TypeError(f"{owner}(scores=...) must be a floating tensor, got {got}")
        if scores.dim() not in (2, 4) or scores.numel() == 0:
            raise ValueError(
                f"{owner}(scores=...) must have shape [n_q_blocks, n_kv_blocks] or "
                f"[B|1, H|1, n_q_blocks, n_kv_blocks], non-empty; got {tuple(scores.shape)}"
            )
        k = min(check_int("topk", topk, minimum=1, owner=owner), scores.shape[-1])
        # NaN would rank first in topk: it is no score, so it is never selected, like -inf.
        clean = scores.detach().nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
        values, picked = clean.topk(k, dim=-1)
        picked = torch.where(torch.isneginf(values), -1, picked)
        return cls(indices=picked, block_size=block_size, num_kv_blocks=scores.shape[-1])

    # ---- spec protocol ------------------------------------------------------------------------

    def uses_batch(self) -> bool:
        return self.indices.shape[0] > 1

    def uses_head(self) -> bool:
        return self.indices.shape[1] > 1

    def _make_mask_mod(self) -> MaskMod:
        q_block, kv_block = (static_int(s) for s in self._sizes())
        index = broadcast_indexer(self.__dict__["_table"])

        def block_select_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return index(b, h, q_idx // q_block, kv_idx // kv_block)

        return block_select_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        self._check_lengths(q_len, kv_len)
        q_block, kv_block = self._sizes()
        # Oracle: compare each key's block number with every index listed for the query's block
        # (k comparisons per pair), instead of the table lookup the mask_mod does.
        idx = self.indices.cpu()
        listed = idx[:, :, torch.arange(q_len) // q_block, :]  # [B', H', Lq, k]
        key_block = torch.arange(kv_len) // kv_block
        out = torch.zeros(*idx.shape[:2], q_len, kv_len, dtype=torch.bool)
        for s in range(idx.shape[-1]):
            out |= listed[..., s, None] == key_block
        return out

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        self._check_lengths(q_len, kv_len)
        b, h = self.indices.shape[:2]
        if b not in (1, batch) or h not in (1, heads):
            raise ValueError(
                f"BlockSelect(indices=...) has shape {tuple(self.indices.shape)}; its leading dims "
                f"must be 1 or the problem's batch size and head count ({batch}, {heads})"
            )

    def reads_scalar_tensors(self) -> bool:
        # One query block and one key block: the table has one element, loaded at a fixed index.
        return self.__dict__["_table"].numel() == 1

    def visible_fraction(self, q_len: int, kv_len: int) -> float:
        # A query sees at most k blocks of kv_block keys (duplicates and -1 only lower it).
        return min(1.0, self.indices.shape[-1] * self._sizes()[1] / max(1, kv_len))

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        self._check_lengths(q_len, kv_len)
        sel_q, sel_kv = self._sizes()
        cells = self.__dict__["_table"].to(device)
        # The selection blocks holding valid positions; the table may have more rows and columns.
        cells = cells[:, :, : -(-q_len // sel_q), : -(-kv_len // sel_kv)]
        q_first, q_last, q_complete = block_ranges(q_len, q_block, device)
        k_first, k_last, k_complete = block_ranges(kv_len, kv_block, device)
        complete = q_complete[:, None] & k_complete[None, :]
        if (q_block, kv_block) == (sel_q, sel_kv):
            # The selection's own grid: each block is one cell, wholly selected or not.
            return BlockMap(any=cells.contiguous(), full=cells & complete)
        # Another grid: a block overlaps the cells from its first to its last valid position's
        # (a contiguous range on each side, every cell of it holding some of the block's valid
        # positions), so it is live iff one of those cells is selected and full iff it is complete
        # and all of them are. Counted with prefix sums, first along keys, then along queries.
        some_k, all_k = _range_counts(cells, 3, k_first // sel_kv, k_last // sel_kv)
        some, _ = _range_counts(some_k, 2, q_first // sel_q, q_last // sel_q)
        _, every = _range_counts(all_k, 2, q_first // sel_q, q_last // sel_q)
        return BlockMap(any=some, full=every & complete)

    @classmethod
    def typical_example(cls, q_len: int, kv_len: int, batch: int, heads: int) -> Spec:
        # Per-head top-k of a quarter of the key blocks, each query block keeping its own
        # diagonal block (VSA-like); the kernels' 128 blocks once the sequence has a few of them.
        n = max(q_len, kv_len, 1)
        size = 128 if n >= 1024 else max(1, -(-n // 8))
        n_q, n_kv = -(-q_len // size), -(-kv_len // size)
        gen = torch.Generator().manual_seed(104729 * n + heads)
        scores = torch.rand(1, heads, n_q, n_kv, generator=gen)
        rows = torch.arange(n_q)
        scores[:, :, rows, torch.clamp(rows, max=n_kv - 1)] = 2.0  # above any random score
        return cls.from_block_scores(scores, max(1, n_kv // 4), size)

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        gen = torch.Generator().manual_seed(7907 * q_len + 31 * kv_len + batch)

        def selection(
            b: int, h: int, size_q: int, size_kv: int, k: int, unused: float = 0.25, past_end: int = 0
        ) -> torch.Tensor:
            n_q, n_kv = -(-q_len // size_q), -(-kv_len // size_kv)
            # Duplicates happen; past_end draws indices that far past the keys' end too.
            picked = torch.randint(0, n_kv + past_end, (b, h, n_q, k), generator=gen)
            return torch.where(torch.rand(b, h, n_q, k, generator=gen) < unused, -1, picked)

        return [
            # One selection for every row and head, blocks of 16 (the tests' q block size). k = 6,
            # half of them -1: a k that equals no other size of the compile tests' calls (Dynamo
            # would give equal sizes one symbol, and recompile when they part).
            cls(indices=selection(1, 1, 16, 16, 6, 0.5), block_size=16, num_kv_blocks=-(-kv_len // 16)),
            # Per batch row and head, uneven blocks, indices past the keys' end (a wider table).
            cls(
                indices=selection(batch, heads, 8, 24, 2, past_end=2),
                block_size=(8, 24),
                num_kv_blocks=-(-kv_len // 24) + 2,
            ),
            # Per query token (NSA's selection), per head.
            cls(indices=selection(1, heads, 1, 32, 2), block_size=(1, 32), num_kv_blocks=-(-kv_len // 32)),
            # One block covering everything: all visible, or (row of -1) nothing.
            cls(indices=torch.tensor([[0, -1]]), block_size=max(q_len, kv_len)),
            cls(indices=torch.tensor([[-1]]), block_size=max(q_len, kv_len)),
        ]

    # ---- helpers ------------------------------------------------------------------------------

    def _sizes(self) -> tuple[int, int]:
        sizes = self.block_size
        assert isinstance(sizes, tuple)  # __post_init__ stores the pair
        return sizes

    def _check_lengths(self, q_len: int, kv_len: int) -> None:
        q_block, kv_block = self._sizes()
        rows, need_rows = self.indices.shape[2], -(-q_len // q_block)
        need_cols = -(-kv_len // kv_block)
        if need_rows > rows:
            raise ValueError(
                f"BlockSelect(indices=...) has {rows} query-block rows, but Lq = {q_len} needs "
                f"ceil(Lq / {q_block}) = {need_rows}"
            )
        if need_cols > self.num_kv_blocks:  # type: ignore[operator]  # an int after __post_init__
            raise ValueError(
                f"BlockSelect covers num_kv_blocks = {self.num_kv_blocks} key blocks, but Lkv = {kv_len} "
                f"needs ceil(Lkv / {kv_block}) = {need_cols}; pass num_kv_blocks={need_cols}"
            )


def _block_sizes(value: Any, owner: str) -> tuple[int, int]:
    """``block_size`` as a ``(q_block, kv_block)`` pair of positive ints."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(
                f"{owner}(block_size=...) must be an int or a (q_block, kv_block) pair, got {value!r}"
            )
        q, kv = value
    else:
        q = kv = value
    return (
        check_int("block_size", q, minimum=1, owner=owner),
        check_int("block_size", kv, minimum=1, owner=owner),
    )


def _index_tensor(value: Any, owner: str) -> torch.Tensor:
    """``indices`` as a 4-D int64 tensor; TypeError / ValueError naming the argument."""
    what = f"{owner}(indices=...)"
    idx = value
    if not isinstance(idx, torch.Tensor):
        try:
            idx = torch.as_tensor(idx)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"{what} must be an integer tensor [n_q_blocks, k]: {exc}") from exc
    if idx.numel() == 0:  # before the dtype: an empty list converts to float32
        raise ValueError(
            f"{what} must have shape [n_q_blocks, k] or [B|1, H|1, n_q_blocks, k] with every size "
            f">= 1, got {tuple(idx.shape)}"
        )
    if idx.dtype == torch.bool or idx.is_floating_point() or idx.is_complex():
        raise TypeError(f"{what} must be an integer tensor of key block numbers, got dtype {idx.dtype}")
    if idx.dim() == 3:
        raise ValueError(
            f"{what} is 3-D {tuple(idx.shape)}, which is ambiguous ([B, n_q_blocks, k] or "
            "[H, n_q_blocks, k]); pass [n_q_blocks, k] or 4-D [B|1, H|1, n_q_blocks, k]"
        )
    if idx.dim() not in (2, 4) or idx.numel() == 0:
        raise ValueError(
            f"{what} must have shape [n_q_blocks, k] or [B|1, H|1, n_q_blocks, k] with every size "
            f">= 1, got {tuple(idx.shape)}"
        )
    if idx.shape[-2] > INDEX_LIMIT:
        raise ValueError(f"{what} has more query blocks than the kernels can index ({INDEX_LIMIT})")
    return (idx[None, None] if idx.dim() == 2 else idx).to(torch.int64)


def _block_table(idx: torch.Tensor, count: int) -> torch.Tensor:
    """Bool ``[B', H', n_q_blocks, count]``: which key blocks each query block selected. ``-1``
    entries land in a spare last column, dropped."""
    spare = torch.where(idx >= 0, idx, count)
    table = torch.zeros(*idx.shape[:-1], count + 1, dtype=torch.bool, device=idx.device)
    table.scatter_(-1, spare, True)
    return table[..., :count].contiguous()


def _range_counts(
    cells: torch.Tensor, dim: int, first: torch.Tensor, last: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(any, all)`` of the bool ``cells`` over the inclusive ranges ``[first[t], last[t]]``
    along ``dim``, one result per range (prefix sums: one pass over ``cells``)."""
    counts = torch.cumsum(cells, dim=dim, dtype=torch.int32)
    shape = list(counts.shape)
    shape[dim] = 1
    counts = torch.cat([torch.zeros(shape, dtype=counts.dtype, device=counts.device), counts], dim=dim)
    inside = counts.index_select(dim, last + 1) - counts.index_select(dim, first)
    width = (last - first + 1).view([-1] + [1] * (cells.dim() - 1 - dim))
    return inside > 0, inside == width
