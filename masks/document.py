"""``document``: packed sequences; a query sees only keys of its own document."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from flexattn_zoo.registry import MASKS
from flexattn_zoo.spec import (
    BlockMap,
    MaskMod,
    MaskSpec,
    Spec,
    VarlenForm,
    block_ranges,
    spec_dataclass,
    tracing,
)

from ._blocks import sorted_label_block_map, spec_cached

_IntRows = Sequence[int] | Sequence[Sequence[int]] | torch.Tensor


@MASKS.register
@spec_dataclass
class Document(MaskSpec):
    """Block-diagonal mask of packed documents: visible iff ``doc_ids[i] == doc_ids[j]``.

    ``doc_ids`` labels every position with its document: ``[L]`` shared by every batch row, or
    ``[B, L]`` per row (then the spec depends on the batch index). Queries and keys index the same
    labels, so ``L >= max(Lq, Lkv)``. Labels need not be sorted or contiguous, but the cheap forms
    need them to be. Combine with ``Causal()`` (``Document(...) & Causal()``) for packed causal
    training.

    Picture (``doc_ids = [0, 0, 0, 1, 1, 2]``; rows are queries, ``#`` visible)::

        ###...
        ###...
        ###...
        ...##.
        ...##.
        .....#

    Forms offered: varlen with ``segments`` = run lengths of the labels (``[S]``, or ``[B, S]``
    zero-padded) when ``Lq == Lkv`` and every label forms one contiguous run per row; the same
    runs as per-position run starts (``past_key_starts``: ANDed with ``Causal()``, key ``j`` is
    visible to query ``i`` iff ``start[i] <= j <= i``); a closed-form block map when labels never
    decrease along each row (otherwise None: the generic builder takes over). No SDPA form.

    Args:
        doc_ids: integer tensor ``[L]`` or ``[B, L]`` (lists are converted; stored as int64).
    """

    pair_loads = False  # document ids are read per query and per key

    doc_ids: torch.Tensor

    depends_on_batch = True  # class default; uses_batch() says whether this instance does

    def __post_init__(self) -> None:
        ids: Any = self.doc_ids
        if not isinstance(ids, torch.Tensor):
            try:
                ids = torch.as_tensor(ids)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise TypeError(
                    f"Document(doc_ids=...) must be an integer tensor [L] or [B, L]: {exc}"
                ) from exc
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise TypeError(
                f"Document(doc_ids=...) must be an integer tensor [L] or [B, L], got dtype {ids.dtype}"
            )
        if ids.dim() not in (1, 2) or ids.numel() == 0:
            raise ValueError(
                f"Document(doc_ids=...) must have shape [L] or [B, L] with L, B >= 1, got {tuple(ids.shape)}"
            )
        object.__setattr__(self, "doc_ids", ids.to(torch.int64))
        # The labels the mask_mod compares, made here (one device sync) rather than when the
        # mask_mod is built, which may happen while torch.compile traces (no data reads there).
        labels = self.doc_ids if tracing() else _int32_labels(self.doc_ids)  # int64 is exact too
        object.__setattr__(self, "_labels", labels)
        # Per-instance caches of data-dependent checks (each costs a device sync); not fields, so
        # they take no part in equality or hashing.
        object.__setattr__(self, "_cache", {})

    # ---- constructors -------------------------------------------------------------------------

    @classmethod
    def from_lengths(cls, lengths: _IntRows, *, device: torch.device | str | None = None) -> Document:
        """From document lengths: ``[3, 2, 1]`` gives ids ``[0, 0, 0, 1, 1, 2]``.

        ``lengths`` is a list or 1-D tensor (one packed sequence shared by all batch rows), or a
        list of per-row lists / a 2-D tensor (zero entries are ignored, so a zero-padded ``[B, S]``
        tensor such as ``VarlenForm.segments`` works). Rows shorter than the longest row are padded
        with one extra document (id = number of length entries in that row), so every row has length
        ``max(total)`` and padding tokens see only each other, never a real document. The ids go to
        ``device`` when given, else to the device of a ``lengths`` tensor (else the CPU).
        """
        dev = (
            device if device is not None else (lengths.device if isinstance(lengths, torch.Tensor) else None)
        )
        rows, per_batch = _length_rows(lengths)
        totals = [int(r.sum()) for r in rows]
        width = max(totals)
        if width == 0:
            raise ValueError(
                "Document.from_lengths(lengths=...) needs a positive total length, got all zeros"
            )
        built = []
        for row, total in zip(rows, totals, strict=True):
            ids = torch.repeat_interleave(torch.arange(row.numel(), device="cpu"), row)
            pad = torch.full((width - total,), row.numel(), dtype=torch.int64, device="cpu")
            built.append(torch.cat([ids, pad]))
        ids = torch.stack(built) if per_batch else built[0]
        return cls(doc_ids=ids.to(dev))

    @classmethod
    def from_cu_seqlens(
        cls, cu_seqlens: Sequence[int] | torch.Tensor, *, device: torch.device | str | None = None
    ) -> Document:
        """From cumulative lengths ``[0, l0, l0 + l1, ...]`` (FlashAttention varlen style); ``device``
        as in :meth:`from_lengths`."""
        dev = (
            device
            if device is not None
            else (cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else None)
        )
        cu = _int_vector(cu_seqlens, "Document.from_cu_seqlens(cu_seqlens=...)")
        if cu.numel() < 2 or int(cu[0]) != 0:
            raise ValueError(
                "Document.from_cu_seqlens(cu_seqlens=...) must start at 0 and hold at least 2 "
                f"entries, got {cu.tolist()[:8]}"
            )
        lengths = cu[1:] - cu[:-1]
        if bool((lengths < 0).any()):
            raise ValueError("Document.from_cu_seqlens(cu_seqlens=...) must be non-decreasing")
        if int(cu[-1]) == 0:  # else from_lengths would refuse it under its own name
            raise ValueError(
                f"Document.from_cu_seqlens(cu_seqlens=...) needs a positive total length (its last "
                f"entry), got {cu.tolist()[:8]}"
            )
        return cls.from_lengths(lengths, device=dev)

    # ---- spec protocol ------------------------------------------------------------------------

    def uses_batch(self) -> bool:
        return self.doc_ids.dim() == 2

    def _make_mask_mod(self) -> MaskMod:
        ids: torch.Tensor = self.__dict__["_labels"]
        if ids.dim() == 1:

            def document_mask(
                b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
            ) -> torch.Tensor:
                return ids[q_idx] == ids[kv_idx]

            return document_mask

        def batched_document_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return ids[b, q_idx] == ids[b, kv_idx]

        return batched_document_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        self._check_length(max(q_len, kv_len))
        rows = self.doc_ids.view(-1, self.doc_ids.shape[-1])
        # Oracle by document membership: one-hot each position over the distinct labels and
        # count shared documents with a matmul, instead of comparing labels like mask_mod does.
        _, inverse = torch.unique(rows, return_inverse=True)
        onehot = torch.nn.functional.one_hot(inverse).to(torch.float32)
        shared = onehot[:, :q_len] @ onehot[:, :kv_len].transpose(1, 2)
        return (shared > 0.5)[:, None]

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        self._check_length(max(q_len, kv_len))
        if self.doc_ids.dim() == 2 and self.doc_ids.shape[0] != batch:
            raise ValueError(
                f"Document(doc_ids=...) has {self.doc_ids.shape[0]} rows but the batch size is {batch}; "
                "pass [L] ids to share them across the batch, or one row per batch element"
            )

    def varlen_form(self, q_len: int, kv_len: int, batch: int) -> VarlenForm | None:
        if q_len != kv_len or tracing():
            return None  # the runs are read from the ids (see spec.tracing)
        self._check_length(q_len)
        runs = self._cached(("runs", q_len), lambda: _contiguous_runs(self.doc_ids, q_len))
        return None if runs is None else VarlenForm(segments=runs, window=(-1, -1))

    def past_key_starts(self, q_len: int, kv_len: int) -> torch.Tensor | None:
        # Exact when each label is one contiguous run: a key before the query is in the query's
        # document iff it is at or after the document's first position.
        if tracing():
            return None  # read from the ids (see spec.tracing)
        n = max(q_len, kv_len)
        self._check_length(n)
        return self._cached(("starts", n), lambda: _run_starts(self.doc_ids, n))

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        n = max(q_len, kv_len)
        self._check_length(n)
        if tracing():
            return None  # sortedness is read from the ids (see spec.tracing)
        rows = self.doc_ids.view(-1, self.doc_ids.shape[-1])[:, :n]
        if not self._cached(("sorted", n), lambda: bool((rows[:, 1:] >= rows[:, :-1]).all())):
            return None
        # Sorted labels: a block's min/max are the labels of its first/last valid position, so
        # only O(blocks) gathers are needed.
        q_first, q_last, q_complete = block_ranges(q_len, q_block, rows.device)
        k_first, k_last, k_complete = block_ranges(kv_len, kv_block, rows.device)
        q_lo, q_hi, k_lo, k_hi = (rows[:, idx].to(device) for idx in (q_first, q_last, k_first, k_last))
        complete = (q_complete[:, None] & k_complete[None, :]).to(device)
        return sorted_label_block_map(q_lo, q_hi, k_lo, k_hi, complete)

    @classmethod
    def typical_example(cls, q_len: int, kv_len: int, batch: int, heads: int) -> Spec:
        # Three packed documents of uneven lengths, document boundaries off the 128-block grid.
        n = max(q_len, kv_len, 1)
        first, second = max(1, n // 2 - 3), max(1, n // 4 + 5)
        return cls.from_lengths([first, second, n - first - second] if n > first + second else [n])

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        n = max(q_len, kv_len, 1)
        gen = torch.Generator().manual_seed(7919 * n + batch)

        def random_sorted(rows: int) -> torch.Tensor:
            # A new document starts with probability ~5/n: a handful of documents of mixed sizes.
            starts = torch.rand(rows, n, generator=gen) < 5.0 / n
            return torch.cumsum(starts.long(), dim=-1)

        out: list[Spec] = [
            cls(doc_ids=torch.zeros(n, dtype=torch.int64)),
            cls.from_lengths([n // 2, n - n // 2]),
            cls(doc_ids=random_sorted(1)[0]),
            cls(doc_ids=(7 - random_sorted(1)[0])),  # contiguous runs, descending: not sorted
            cls(doc_ids=(torch.arange(n) // max(1, n // 7)) % 3),  # documents split into pieces
        ]
        if batch > 1:
            out.append(cls(doc_ids=random_sorted(batch)))
        return out

    # ---- helpers ------------------------------------------------------------------------------

    def _check_length(self, needed: int) -> None:
        if self.doc_ids.shape[-1] < needed:
            raise ValueError(
                f"Document(doc_ids=...) has length {self.doc_ids.shape[-1]} but the problem needs at "
                f"least max(Lq, Lkv) = {needed}"
            )

    def _cached(self, key: tuple[Any, ...], make: Any) -> Any:
        return spec_cached(self, key, make)


def _int32_labels(ids: torch.Tensor) -> torch.Tensor:
    """``ids`` as int32 labels with the same equalities, for the kernels' per-pair lookups.

    Measured side by side on the H200 (document & causal, bf16, ``benchmarks/mod_spelling_probe.py``,
    results/mod_spelling_probe_h200.txt): int32 labels made the FA4 CuTe forward 6% faster at
    D=128, and Triton flex 42% / 13% faster (fwd / fwd+bwd) at D=64 (the same at D=128). Labels
    outside the int32 range are renumbered (rank among the distinct labels) instead of wrapped,
    which could make two documents equal. Costs one device sync per spec, like the other
    data-dependent checks here.
    """
    if ids.device.type == "meta":
        return ids  # no data to range-check; int64 is exact
    lo, hi = torch.aminmax(ids)
    info = torch.iinfo(torch.int32)
    if info.min <= int(lo) and int(hi) <= info.max:
        return ids.to(torch.int32)
    return torch.unique(ids, return_inverse=True)[1].to(torch.int32)


def _contiguous_runs(ids: torch.Tensor, length: int) -> torch.Tensor | None:
    """Run lengths of ``ids[..., :length]`` (``[S]`` or zero-padded ``[B, S]``), or None when some
    label appears in two separate runs of a row (varlen segments cannot express that)."""
    if not _labels_contiguous(ids, length):
        return None
    rows = ids.view(-1, ids.shape[-1])[:, :length]
    counts = [torch.unique_consecutive(row, return_counts=True)[1] for row in rows]
    if ids.dim() == 1:
        return counts[0]
    width = max(c.numel() for c in counts)
    return torch.stack([torch.nn.functional.pad(c, (0, width - c.numel())) for c in counts])


def _run_layout(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run number and run start (first position of the run) of every position, int32, shaped
    like ``ids``; a run starts where the label changes along the last dim. Tensor ops only (no
    data read: fine while torch.compile traces)."""
    rows = ids.view(-1, ids.shape[-1])
    first = torch.ones_like(rows[:, :1], dtype=torch.bool)
    starts_here = torch.cat([first, rows[:, 1:] != rows[:, :-1]], dim=1)
    run = torch.cumsum(starts_here, dim=1) - 1
    positions = torch.arange(rows.shape[1], device=rows.device).expand_as(rows)
    start = torch.where(starts_here, positions, 0).cummax(dim=1).values
    return run.to(torch.int32).view(ids.shape), start.to(torch.int32).view(ids.shape)


def _labels_contiguous(ids: torch.Tensor, length: int) -> bool:
    """Whether every label of ``ids[..., :length]`` forms one contiguous run in each row. One
    device sync: runs per row are compared with distinct labels per row (from a sort)."""
    rows = ids.view(-1, ids.shape[-1])[:, :length]
    if rows.shape[1] == 0:
        return True
    runs = (rows[:, 1:] != rows[:, :-1]).sum(dim=1)
    ordered = rows.sort(dim=1).values
    labels = (ordered[:, 1:] != ordered[:, :-1]).sum(dim=1)
    return bool((runs == labels).all())


def _run_starts(ids: torch.Tensor, length: int) -> torch.Tensor | None:
    """The run start of every position of ``ids`` (:func:`_run_layout`), or None when some label
    of ``ids[..., :length]`` forms two separate runs in a row. The starts cover every position (a
    position's start depends only on the ids up to it), so one ids tensor gives starts of one
    shape whatever the problem's length: one compiled kernel."""
    return _run_layout(ids)[1] if _labels_contiguous(ids, length) else None


def _int_vector(values: Any, what: str) -> torch.Tensor:
    """A 1-D int64 CPU tensor from a list or tensor; TypeError/ValueError naming ``what``."""
    if isinstance(values, torch.Tensor):
        t = values
    else:
        if not isinstance(values, (list, tuple)):
            raise TypeError(
                f"{what} must be a list of ints or an integer tensor, got {type(values).__name__}"
            )
        if any(isinstance(v, bool) for v in values):
            raise TypeError(f"{what} must hold ints, got a bool")
        try:
            # An empty list would become float32; keep it integral so the caller reports "empty".
            t = (
                torch.as_tensor(values, device="cpu")
                if len(values)
                else torch.zeros(0, dtype=torch.int64, device="cpu")
            )
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"{what} must be a list of ints or an integer tensor: {exc}") from exc
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(f"{what} must hold integers, got dtype {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{what} must be 1-D, got shape {tuple(t.shape)}")
    return t.to("cpu", torch.int64)


def _length_rows(lengths: Any) -> tuple[list[torch.Tensor], bool]:
    """Split ``lengths`` into per-row 1-D length vectors; also say whether it was per-batch."""
    what = "Document.from_lengths(lengths=...)"
    if isinstance(lengths, torch.Tensor) and lengths.dim() > 2:
        raise ValueError(f"{what} must be 1-D [S] or 2-D [B, S], got shape {tuple(lengths.shape)}")
    if isinstance(lengths, torch.Tensor) and lengths.dim() == 2:
        rows, per_batch = [_int_vector(r, what) for r in lengths], True
    elif isinstance(lengths, torch.Tensor):
        rows, per_batch = [_int_vector(lengths, what)], False
    elif (
        isinstance(lengths, (list, tuple))
        and lengths
        and all(isinstance(r, (list, tuple, torch.Tensor)) for r in lengths)
    ):
        rows, per_batch = [_int_vector(r, what) for r in lengths], True
    elif isinstance(lengths, (list, tuple)):
        rows, per_batch = [_int_vector(lengths, what)], False
    else:
        raise TypeError(
            f"{what} must be a list of ints, a list of per-row lists, or an integer tensor, "
            f"got {type(lengths).__name__}"
        )
    if not rows or any(r.numel() == 0 for r in rows):
        raise ValueError(f"{what} needs at least one length per row")
    if any(bool((r < 0).any()) for r in rows):
        raise ValueError(f"{what} must be >= 0")
    return rows, per_batch
