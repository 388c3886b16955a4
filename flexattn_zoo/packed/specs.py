"""Specs that run many packed sequences as one ``[1, H, T, D]`` attention call.

FlashAttention's varlen convention: sequence ``i`` holds query rows ``cu_seqlens_q[i] :
cu_seqlens_q[i + 1]`` and key rows ``cu_seqlens_k[i] : cu_seqlens_k[i + 1]`` of the packed
tensors, and its queries see only its own keys. The two offset vectors may differ (a chunk of new
queries against a longer cached prefix), so the block-diagonal mask is over (query sequence, key
sequence) pairs: :class:`PackedSequences`. A user mask and score mod are applied in each
sequence's *local* coordinates (query row ``r`` in ``[0, Lq_i)``, key column ``c`` in
``[0, Lk_i)``), by translating the packed indices before calling them (:class:`PackedScore` for
score mods).

Every tensor here is ``[T]`` or ``[S + 1]``: nothing ``T x T`` is built except by ``dense()``,
the oracle (and the dense route, which materializes scores anyway).
"""

from __future__ import annotations

import torch

from flexattn_zoo.masks._blocks import sorted_label_block_map
from flexattn_zoo.spec import (
    BlockMap,
    MaskMod,
    MaskSpec,
    ScoreMod,
    ScoreSpec,
    VarlenForm,
    block_ranges,
    spec_dataclass,
    static_int,
    tracing,
)


def _rows(cu: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(seq, local)`` per packed row ``[0, total)``: the sequence it belongs to and its offset
    inside it. ``searchsorted`` rather than ``repeat_interleave``: no data-dependent output size,
    and a sequence of length 0 (a repeated offset) is skipped without special cases (``right=True``
    lands on the last sequence starting at or before the row, the non-empty one)."""
    rows = torch.arange(total, device=cu.device, dtype=cu.dtype)
    seq = torch.searchsorted(cu, rows, right=True) - 1
    # Rows past cu[-1] cannot occur for a validated call; clamp so an index never leaves the table.
    seq = seq.clamp(0, cu.numel() - 2)
    return seq.to(torch.int32), (rows - cu[seq]).to(torch.int32)


@spec_dataclass
class PackedSequences(MaskSpec):
    """Queries see keys of their own sequence, and there ``inner`` and a bottom-right window.

    Query row ``q`` of sequence ``i`` (``cu_seqlens_q[i] <= q < cu_seqlens_q[i + 1]``) sees key
    row ``k`` iff ``k`` is in sequence ``i`` too, ``inner`` holds at the local indices
    ``(q - cu_seqlens_q[i], k - cu_seqlens_k[i])``, and the local key index ``c`` is within
    ``[p - left, p + right]`` where ``p = r + (Lk_i - Lq_i)`` is the query's position counted
    bottom-right aligned (FlashAttention's ``window_size``; ``-1`` leaves that side unbounded;
    ``causal`` is ``right = 0``). Not registered: built by ``fz.varlen_attention``.

    Args:
        cu_seqlens_q: int64 ``[S + 1]`` offsets of the query sequences (validated by the caller:
            starts at 0, non-decreasing, ends at ``q_total``).
        cu_seqlens_k: int64 ``[S + 1]`` offsets of the key sequences (ends at ``kv_total``).
        q_total: packed query rows ``Tq``.
        kv_total: packed key rows ``Tk``.
        max_seqlen_q: the extent of local query indices (at least the longest query sequence):
            ``inner``'s oracle is evaluated for ``max_seqlen_q x max_seqlen_k`` and sliced.
        max_seqlen_k: the same for keys.
        inner: a mask in local coordinates, already bound to the sequences' lengths (one spec for
            every sequence), or None.
        left: keys visible before the bottom-right-aligned query position, ``-1`` unbounded.
        right: keys visible after it, ``-1`` unbounded (``0``: causal).
    """

    pair_loads = False  # its tables are read per query row and per key row; inner answers for itself

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    q_total: int
    kv_total: int
    max_seqlen_q: int
    max_seqlen_k: int
    inner: MaskSpec | None = None
    left: int = -1
    right: int = -1

    def __post_init__(self) -> None:
        q_seq, q_local = _rows(self.cu_seqlens_q, self.q_total)
        k_seq, k_local = _rows(self.cu_seqlens_k, self.kv_total)
        lengths_q = self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]
        lengths_k = self.cu_seqlens_k[1:] - self.cu_seqlens_k[:-1]
        # The bottom-right position of each query row: its local index shifted by Lk_i - Lq_i,
        # so the last query of a sequence lines up with its last key (may be negative).
        shift = (lengths_k - lengths_q).to(torch.int32)
        # Per-row tables, not fields: derived from the fields, so they take no part in equality.
        for name, value in (
            ("_q_seq", q_seq),
            ("_q_local", q_local),
            ("_q_pos", q_local + shift[q_seq.long()]),
            ("_k_seq", k_seq),
            ("_k_local", k_local),
        ):
            object.__setattr__(self, name, value)

    def uses_head(self) -> bool:
        return self.inner is not None and self.inner.uses_head()

    def reads_scalar_tensors(self) -> bool:
        return self.inner is not None and self.inner.reads_scalar_tensors()

    def _make_mask_mod(self) -> MaskMod:
        q_seq, q_local, q_pos = self.__dict__["_q_seq"], self.__dict__["_q_local"], self.__dict__["_q_pos"]
        k_seq, k_local = self.__dict__["_k_seq"], self.__dict__["_k_local"]
        inner = None if self.inner is None else self.inner.mask_mod()
        left, right = static_int(self.left), static_int(self.right)

        def packed_sequences_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            kv = k_local[kv_idx]
            out = q_seq[q_idx] == k_seq[kv_idx]
            if inner is not None:
                out = out & inner(b, h, q_local[q_idx], kv)
            if left >= 0:
                out = out & (kv >= q_pos[q_idx] - left)
            if right >= 0:
                out = out & (kv <= q_pos[q_idx] + right)
            return out

        return packed_sequences_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        # Oracle: one block per sequence, the window written with tril/triu on the block and the
        # inner mask's own oracle sliced to the block; no index tables, unlike mask_mod.
        cu_q, cu_k = self.cu_seqlens_q.tolist(), self.cu_seqlens_k.tolist()
        head_dim = 1 if self.inner is None else heads
        out = torch.zeros(1, head_dim, q_len, kv_len, dtype=torch.bool)
        inner = None
        if self.inner is not None:
            inner = self.inner.to("cpu").dense(self.max_seqlen_q, self.max_seqlen_k, batch=1, heads=heads)
        for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:], strict=False):
            lq, lk = q1 - q0, k1 - k0
            block = torch.ones(lq, lk, dtype=torch.bool)
            if self.right >= 0:
                block = block.tril(diagonal=lk - lq + self.right)
            if self.left >= 0:
                block = block.triu(diagonal=lk - lq - self.left)
            block = block[None, None].expand(1, head_dim, lq, lk)
            if inner is not None:
                block = block & inner[:1, :, :lq, :lk]
            out[:, :, q0:q1, k0:k1] = block
        return out

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        _check_packed_call("PackedSequences", (self.q_total, self.kv_total), q_len, kv_len, batch)

    def varlen_form(self, q_len: int, kv_len: int, batch: int) -> VarlenForm | None:
        # The sequences with their bottom-right window are FlashAttention's varlen call itself,
        # when no inner mask is left and every query sees a key. Reads the offsets' data, so not
        # while tracing; sequences with no queries and no keys take no part.
        if self.inner is not None or tracing() or (q_len, kv_len, batch) != (self.q_total, self.kv_total, 1):
            return None
        lengths_q = (self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]).cpu()
        lengths_k = (self.cu_seqlens_k[1:] - self.cu_seqlens_k[:-1]).cpu()
        used = (lengths_q > 0) | (lengths_k > 0)
        lengths_q, lengths_k = lengths_q[used].to(torch.int64), lengths_k[used].to(torch.int64)
        if bool(((lengths_q == 0) | (lengths_k == 0)).any()):
            return None  # queries without keys (or keys without queries): rows a kernel leaves empty
        if self.right >= 0 and bool((lengths_q > lengths_k + self.right).any()):
            return None  # the first queries of such a sequence see no key
        if bool((lengths_q == lengths_k).all()):
            return VarlenForm(segments=lengths_q, window=(self.left, self.right))
        return VarlenForm(segments=lengths_q, window=(self.left, self.right), kv_segments=lengths_k)

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        # Sequence labels never decrease along the rows, so a query block can see a key block
        # only if their label ranges overlap (Document's rule; here q and k rows carry labels of
        # their own, so a superset of the visible pairs: exactness inside partial blocks comes
        # from mask_mod). A block pair is full only without any inner mask or window, when both
        # blocks are complete and lie in one and the same sequence.
        q_first, q_last, q_complete = block_ranges(q_len, q_block, "cpu")
        k_first, k_last, k_complete = block_ranges(kv_len, kv_block, "cpu")
        q_seq, k_seq = self.__dict__["_q_seq"].cpu(), self.__dict__["_k_seq"].cpu()
        labels = sorted_label_block_map(
            q_seq[q_first][None], q_seq[q_last][None], k_seq[k_first][None], k_seq[k_last][None],
            q_complete[:, None] & k_complete[None, :],
        )  # fmt: skip
        full = labels.full
        if self.inner is not None or self.left >= 0 or self.right >= 0:
            full = torch.zeros_like(full)
        return BlockMap(any=labels.any.to(device), full=full.to(device))


@spec_dataclass
class PackedScore(ScoreSpec):
    """``inner`` applied in each packed sequence's local coordinates (see :class:`PackedSequences`).

    The score of query row ``q`` and key row ``k`` becomes ``inner``'s score at
    ``(q - cu_seqlens_q[i], k - cu_seqlens_k[j])``, ``i`` and ``j`` the rows' own sequences; pairs
    of different sequences are masked by :class:`PackedSequences`, so their value is never used.

    Args:
        inner: the user's score spec.
        cu_seqlens_q, cu_seqlens_k, q_total, kv_total, max_seqlen_q, max_seqlen_k: as for
            :class:`PackedSequences`.
    """

    pair_loads = False  # its tables are read per query row and per key row; inner answers for itself

    inner: ScoreSpec
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    q_total: int
    kv_total: int
    max_seqlen_q: int
    max_seqlen_k: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "_q_local", _rows(self.cu_seqlens_q, self.q_total)[1])
        object.__setattr__(self, "_k_local", _rows(self.cu_seqlens_k, self.kv_total)[1])

    def uses_head(self) -> bool:
        return self.inner.uses_head()

    def reads_scalar_tensors(self) -> bool:
        return self.inner.reads_scalar_tensors()

    def _make_score_mod(self, *, fast: bool) -> ScoreMod:
        q_local, k_local = self.__dict__["_q_local"], self.__dict__["_k_local"]
        inner = self.inner.score_mod(fast=fast)

        def packed_score(
            score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return inner(score, b, h, q_local[q_idx], k_local[kv_idx])

        return packed_score

    def dense(self, scores: torch.Tensor) -> torch.Tensor:
        # Oracle: the inner spec's own oracle on each sequence's diagonal block, placed at the
        # top-left of a [max_seqlen_q, max_seqlen_k] tile (the local index range it serves).
        cu_q, cu_k = self.cu_seqlens_q.tolist(), self.cu_seqlens_k.tolist()
        longest_q, longest_k = self.max_seqlen_q, self.max_seqlen_k
        inner = self.inner.to(scores.device)
        out = scores.clone()
        batch, heads = scores.shape[:2]
        for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:], strict=False):
            if q1 == q0 or k1 == k0:
                continue
            tile = scores.new_zeros(batch, heads, longest_q, longest_k)
            tile[:, :, : q1 - q0, : k1 - k0] = scores[:, :, q0:q1, k0:k1]
            out[:, :, q0:q1, k0:k1] = inner.dense(tile)[:, :, : q1 - q0, : k1 - k0]
        return out

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        _check_packed_call("PackedScore", (self.q_total, self.kv_total), q_len, kv_len, batch)


def _check_packed_call(owner: str, totals: tuple[int, int], q_len: int, kv_len: int, batch: int) -> None:
    """ValueError unless the call is the one packed call (B=1, the packed lengths) ``owner`` was
    built for."""
    q_total, kv_total = totals
    if (q_len, kv_len, batch) != (q_total, kv_total, 1):
        raise ValueError(
            f"{owner} was built for B=1, Lq={q_total}, Lkv={kv_total}; got B={batch}, Lq={q_len}, Lkv={kv_len}"
        )


__all__ = ["PackedScore", "PackedSequences"]
