"""``shared_prefix``: several continuations of one prompt packed in one row, each seeing the prompt."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from flexattn_zoo.registry import MASKS
from flexattn_zoo.spec import (
    BlockMap,
    MaskMod,
    MaskSpec,
    SdpaForm,
    Spec,
    block_ranges,
    lower_triangle_fraction,
    spec_dataclass,
    tracing,
)

from ._blocks import INDEX_LIMIT, check_int, spec_cached
from .document import _int_vector, _run_starts


@MASKS.register
@spec_dataclass
class SharedPrefix(MaskSpec):
    """One prompt followed by several continuations of it, packed in one row; causal throughout.

    Positions ``[0, prefix_len)`` hold the shared prompt; position ``prefix_len + t`` belongs to
    the continuation labelled ``doc_ids[t]``. Key ``j`` is visible to query ``i`` iff ``j <= i``
    and either ``j < prefix_len`` (the prompt, seen by every later token) or ``i`` and ``j`` both
    lie in the same continuation. Prompt queries see the causal prompt only; a continuation never
    sees another one. This is how several samples of one prompt (GRPO-style rollouts, beams) are
    trained in one row with the prompt stored once. Positions are absolute (top-left aligned), so
    ``Lq`` and ``Lkv`` are free as long as ``prefix_len + len(doc_ids) >= max(Lq, Lkv)``.

    ``doc_ids`` follows :class:`Document`'s convention (a label per position, here per position
    after the prompt): labels are any integers, need not be sorted or contiguous (pieces with one
    label form one continuation), and :meth:`from_lengths` builds them from continuation lengths.
    With ``prefix_len=0`` the mask is ``Document(doc_ids) & Causal()``.

    Convention next to attention-gym's: ``generate_shared_prefix_mask_mod(offsets,
    prefix_document_id)`` with one prompt document of length ``p`` followed by continuations of
    lengths ``n1, n2, ...`` (``prefix_document_id`` all 0) is ``SharedPrefix.from_lengths(p, [n1,
    n2, ...])``; several prompts with their own continuations in one row are not one spec here.

    Picture (``prefix_len=3``, ``doc_ids = [0, 0, 1, 1, 1]``: prompt | a a | b b b)::

        #.......
        ##......
        ###.....
        ####....
        #####...
        ###..#..
        ###..##.
        ###..###

    Forms offered: SDPA ``is_causal=True`` when ``Lq == Lkv`` and the problem holds at most one
    continuation; a closed-form block map when every label forms one contiguous run (each block
    pair decided from the run containing its key block's last key and the run of its last query),
    otherwise the generic builder. No varlen form (the prompt is shared), no lowest visible key
    (with a prompt every query sees key 0). Forms that read the labels are not offered while
    ``torch.compile`` traces.

    Args:
        prefix_len: length of the shared prompt (``>= 0``).
        doc_ids: integer tensor ``[S]``, the continuation of each position after the prompt
            (lists are converted; stored as int64; may be empty); see :meth:`from_lengths`.
    """

    pair_loads = False  # its tables are read per query and per key

    prefix_len: int
    doc_ids: torch.Tensor

    def __post_init__(self) -> None:
        owner = "SharedPrefix"
        prefix = check_int("prefix_len", self.prefix_len, minimum=0, owner=owner)
        ids: Any = self.doc_ids
        if not isinstance(ids, torch.Tensor):
            if isinstance(ids, (list, tuple)) and not ids:
                ids = torch.zeros(0, dtype=torch.int64)  # an empty list would become float32
            else:
                try:
                    ids = torch.as_tensor(ids)
                except (TypeError, ValueError, RuntimeError) as exc:
                    raise TypeError(f"{owner}(doc_ids=...) must be a 1-D integer tensor [S]: {exc}") from exc
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"{owner}(doc_ids=...) must be a 1-D integer tensor [S], got dtype {ids.dtype}")
        if ids.dim() != 1:
            raise ValueError(
                f"{owner}(doc_ids=...) must be 1-D: one label per position after the prompt, got shape "
                f"{tuple(ids.shape)}"
            )
        if prefix + ids.numel() > INDEX_LIMIT:
            raise ValueError(
                f"{owner}: prefix_len + len(doc_ids) = {prefix + ids.numel()} positions exceed the "
                f"kernels' index range ({INDEX_LIMIT})"
            )
        object.__setattr__(self, "prefix_len", prefix)
        object.__setattr__(self, "doc_ids", ids.to(torch.int64))
        # The table the mask_mod reads, one entry per position: -1 on the prompt, then each
        # continuation's number (labels renumbered from 0, int32 like Document's labels). Made here
        # rather than in _make_mask_mod, which may run while torch.compile traces.
        if tracing():
            labels = self.doc_ids - self.doc_ids.amin() if ids.numel() else self.doc_ids
        else:
            labels = torch.unique(self.doc_ids, return_inverse=True)[1].to(torch.int32)
        prompt = torch.full((prefix,), -1, dtype=labels.dtype, device=labels.device)
        object.__setattr__(self, "_table", torch.cat([prompt, labels]))
        # Per-instance caches of data-dependent checks (each a device sync); not fields.
        object.__setattr__(self, "_cache", {})

    @classmethod
    def from_lengths(
        cls,
        prefix_len: int,
        lengths: Sequence[int] | torch.Tensor,
        *,
        device: torch.device | str | None = None,
    ) -> SharedPrefix:
        """A prompt of ``prefix_len`` tokens followed by continuations of ``lengths`` tokens, in
        order (``[4, 0, 3]``: ids ``[0, 0, 0, 0, 2, 2, 2]``; a zero is an empty continuation). The ids
        go to ``device`` when given, else to the device of a ``lengths`` tensor (else the CPU)."""
        dev = (
            device if device is not None else (lengths.device if isinstance(lengths, torch.Tensor) else None)
        )
        sizes = _int_vector(lengths, "SharedPrefix.from_lengths(lengths=...)")
        if bool((sizes < 0).any()):
            raise ValueError(f"SharedPrefix.from_lengths(lengths=...) must be >= 0, got {sizes.tolist()[:8]}")
        ids = torch.repeat_interleave(torch.arange(sizes.numel(), device="cpu"), sizes)
        return cls(prefix_len=prefix_len, doc_ids=ids.to(dev))

    def _make_mask_mod(self) -> MaskMod:
        table: torch.Tensor = self.__dict__["_table"]

        def shared_prefix_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            key = table[kv_idx]
            return (kv_idx <= q_idx) & ((key < 0) | (key == table[q_idx]))

        return shared_prefix_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        n = max(q_len, kv_len)
        self._check_length(n)
        p = min(self.prefix_len, n)
        ids = self.doc_ids.cpu()[: n - p]
        # Oracle by painting: the prompt's columns for every row, then each continuation's square
        # (found by its positions), then the causal triangle; the mask_mod compares table entries.
        out = torch.zeros(n, n, dtype=torch.bool)
        out[:, :p] = True
        for label in torch.unique(ids).tolist():
            where = p + torch.nonzero(ids == label).flatten()
            out[where[:, None], where[None, :]] = True
        out &= torch.ones(n, n, dtype=torch.bool).tril()
        return out[:q_len, :kv_len][None, None].to(self.doc_ids.device)

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        self._check_length(max(q_len, kv_len))

    def hides_future_keys(self, q_len: int, kv_len: int) -> bool:
        return True

    def starts_mask_mod(self, q_len: int, kv_len: int) -> MaskMod | None:
        # With every continuation one contiguous run, query i sees the prompt and the keys from its
        # continuation's first position to i: one lookup per query instead of one per key too.
        if tracing():
            return None  # read from the ids (see spec.tracing)
        n = max(q_len, kv_len)
        self._check_length(n)
        found = spec_cached(self, ("starts", n), lambda: self._starts(n))
        if found is None:
            return None
        starts, prompt = found

        def shared_prefix_starts_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return (kv_idx <= q_idx) & ((kv_idx < prompt) | (starts[q_idx] <= kv_idx))

        return shared_prefix_starts_mask

    def _starts(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each position's first visible key after the prompt (0 on the prompt; int32, one per
        position of the spec, whatever ``n``) and the prompt's length as a 0-d tensor (a kernel
        input, not a constant: one compiled kernel serves every prompt length), or None when a
        continuation within the first ``n`` positions is split into pieces."""
        p = self.prefix_len
        local = _run_starts(self.doc_ids, max(n - p, 0)) if self.doc_ids.numel() else None
        if local is None and self.doc_ids.numel():
            return None
        device = self.doc_ids.device
        after = local + p if local is not None else torch.zeros(0, dtype=torch.int32, device=device)
        prompt = torch.zeros(p, dtype=torch.int32, device=device)
        return torch.cat([prompt, after]), torch.tensor(p, dtype=torch.int32, device=device)

    def visible_fraction(self, q_len: int, kv_len: int) -> float:
        return lower_triangle_fraction(q_len, kv_len, 0)

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        if q_len != kv_len or tracing():
            return None  # the labels are data (see spec.tracing)
        self._check_length(q_len)
        tail = self.doc_ids[: max(0, q_len - self.prefix_len)]
        single = self._cached(("single", q_len), lambda: tail.numel() == 0 or bool((tail == tail[0]).all()))
        return SdpaForm(is_causal=True) if single else None

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        n = max(q_len, kv_len)
        self._check_length(n)
        if tracing():
            return None  # contiguity is read from the labels (see spec.tracing)
        p = min(self.prefix_len, n)
        ids = self.doc_ids[: n - p].to(device)
        if not self._cached(("runs", n), lambda: _one_run_each(ids)):
            return None
        # Every label one run: the run start never decreases along the row, so a query sees keys of
        # a later key block iff it lies in the key's run or one before it. Per position, the start
        # and last position of its run (prompt positions: unused values).
        m = ids.numel()
        idx = torch.arange(m, device=device)
        change = ids[1:] != ids[:-1]
        yes = torch.ones(min(m, 1), dtype=torch.bool, device=device)
        first, last = torch.cat([yes, change]), torch.cat([change, yes])
        start = torch.cummax(torch.where(first, idx, 0), dim=0).values
        end = torch.cummin(torch.where(last, idx, m).flip(0), dim=0).values.flip(0)
        prompt = torch.arange(p, device=device)
        run_start = torch.cat([torch.zeros_like(prompt), start + p])
        run_end = torch.cat([prompt, end + p])

        q_first, q_last, q_complete = block_ranges(q_len, q_block, device)
        k_first, k_last, k_complete = block_ranges(kv_len, kv_block, device)
        qf, ql = q_first[:, None], q_last[:, None]
        kf, kl = k_first[None, :], k_last[None, :]
        # Prompt keys: causal (the block's first key against its last query).
        any_ = (kf < p) & (kf <= ql)
        # Continuation keys: some query at or after the key block's first key, in a continuation
        # no later than the one holding the block's last key (so its run starts at or before it).
        lo = torch.maximum(qf, kf).clamp(min=p)
        hi = torch.minimum(ql, run_end[k_last][None, :])
        any_ |= (kl >= p) & (lo <= hi)
        # All visible: every key at or before the first query, and the continuation keys (if any)
        # inside the run of the last query, whose run starts last.
        full = (kl <= qf) & ((kl < p) | (kf.clamp(min=p) >= run_start[q_last][:, None]))
        full &= q_complete[:, None] & k_complete[None, :]
        return BlockMap(any=any_[None, None], full=full[None, None])

    @classmethod
    def typical_example(cls, q_len: int, kv_len: int, batch: int, heads: int) -> Spec:
        # A prompt of a quarter of the row, then four rollouts of uneven lengths.
        n = max(q_len, kv_len, 1)
        prompt = n // 4
        rest = n - prompt
        first, second, third = rest * 3 // 10, rest // 5, rest * 7 // 20
        return cls.from_lengths(prompt, [first, second, third, rest - first - second - third])

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        n = max(q_len, kv_len, 1)
        gen = torch.Generator().manual_seed(6151 * n + batch)
        prompt, rest = n // 3, n - n // 3
        pieces = n - n // 5
        return [
            cls.from_lengths(prompt, [rest // 2, 0, rest // 3, rest - rest // 2 - rest // 3]),
            # Continuations cut into interleaved pieces: the generic block builder's case.
            cls(prefix_len=n // 5, doc_ids=(torch.arange(pieces) // max(1, n // 9)) % 3),
            # A short prompt and a handful of continuations of random lengths.
            cls(
                prefix_len=min(n, 7),
                doc_ids=torch.cumsum(torch.rand(n - min(n, 7), generator=gen) < 5.0 / n, dim=0),
            ),
        ]

    def _check_length(self, needed: int) -> None:
        have = self.prefix_len + self.doc_ids.numel()
        if have < needed:
            raise ValueError(
                f"SharedPrefix covers prefix_len + len(doc_ids) = {have} positions but the problem needs "
                f"at least max(Lq, Lkv) = {needed}"
            )

    def _cached(self, key: tuple[Any, ...], make: Any) -> Any:
        return spec_cached(self, key, make)


def _one_run_each(ids: torch.Tensor) -> bool:
    """Whether every label of ``ids`` forms one contiguous run."""
    runs = torch.unique_consecutive(ids)
    return bool(torch.unique(runs).numel() == runs.numel())
