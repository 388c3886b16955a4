"""Spec algebra: ``a & b``, ``a | b``, ``~a`` for masks and ``a >> b`` for score mods.

Composites keep every cheap form that stays exact: SDPA and varlen forms intersect under ``&``,
and block maps combine block-wise (``&``: exact "full", safe superset "any"; ``|``: exact "any",
safe subset "full"; ``~``: swaps them, keeping incomplete edge blocks partial). Lowest visible
keys combine as bounds (``&``: the largest, ``|``: the smallest). A chain keeps its one part's
soft-cap form, and the summed slopes when every part is a linear bias.

Shards (:func:`on_shard`, :class:`MaskOnShard`, :class:`ScoreOnShard`): a spec as one shard of a
larger call sees it. A call split by batch rows or heads (a DTensor's local shard, see
:mod:`flexattn_zoo.sharding`) runs on local tensors whose batch index ``b`` and head index ``h``
start at 0, while specs are written for the whole call: ALiBi's slope of head ``h``, ``Document``
ids of row ``b``. The wrappers hold the part of the whole call a shard covers -- batch rows
``[b0, b1)`` and query heads ``[h0, h1)`` of a call with ``total = (B, H)`` -- and give the inner
spec global indices: ``mask_mod(b, h, ...)`` is the inner ``mask_mod(b + b0, h + h0, ...)``. Nothing
is sliced to build them, so specs holding ``[B, ...]`` tensors and raw callables work alike. Forms
stay exact: those that cannot depend on ``b`` or ``h`` (SDPA's ``is_causal``, split, strided,
soft-cap, future keys hidden, lowest visible key: each holds for every row and head of the whole call, so for
every row and head of a shard) pass through; those that can are sliced to the shard (SDPA
``attn_mask`` tensors and block maps ``[B|1, H|1, ...]``, varlen segments ``[B, S]``, per-head
linear-bias slopes). ``validate`` checks the inner spec against the whole call and the local sizes
against the shard; the dense oracles evaluate the inner oracle on the whole call and slice it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Callable
from typing import Any, ClassVar, overload

import torch

from flexattn_zoo.spec import (
    COMBINATORS,
    BlockMap,
    GlobalTokensForm,
    LinearBiasForm,
    MaskMod,
    MaskSpec,
    ScoreMod,
    ScoreSpec,
    SdpaForm,
    SoftCapForm,
    SplitForm,
    StridedForm,
    VarlenForm,
    as_4d,
    block_ranges,
    spec_dataclass,
)


def check_mask(other: object, op: str) -> MaskSpec:
    """``other``, if it is a mask spec; else ``TypeError`` naming the operator ``op``."""
    if not isinstance(other, MaskSpec):
        raise TypeError(
            f"mask {op} expects another mask spec (e.g. masks.Causal()), got {type(other).__name__}"
        )
    return other


class _Combined(MaskSpec):
    """Shared behaviour of ``And``/``Or``: fold ``parts`` with one elementwise boolean op."""

    parts: tuple[MaskSpec, ...]
    #: ``operator.and_`` or ``operator.or_``; also used for the dense oracles and block maps.
    op: ClassVar[Callable[[Any, Any], Any]]

    def __post_init__(self) -> None:
        # Built directly (And(parts=[...])) as well as by ``&`` / ``|``: a list would hide its
        # specs' tensors from ``tensors()`` / ``to()``, which walk tuples.
        what = f"{type(self).__name__}(parts=...)"
        if not isinstance(self.parts, (tuple, list)):
            raise TypeError(f"{what} must be a tuple of mask specs, got {type(self.parts).__name__}")
        parts = tuple(self.parts)
        if not parts:
            raise ValueError(f"{what} needs at least one mask spec")
        for p in parts:
            if not isinstance(p, MaskSpec):
                raise TypeError(f"{what} takes mask specs (e.g. masks.Causal()), got {type(p).__name__}")
        object.__setattr__(self, "parts", parts)

    def uses_batch(self) -> bool:
        return any(p.uses_batch() for p in self.parts)

    def reads_scalar_tensors(self) -> bool:
        return any(p.reads_scalar_tensors() for p in self.parts)

    def uses_head(self) -> bool:
        return any(p.uses_head() for p in self.parts)

    def bind(self, q_len: int, kv_len: int) -> MaskSpec:
        parts = tuple(p.bind(q_len, kv_len) for p in self.parts)
        # Keep ``self`` when nothing changed so mask_mod identity (and compiled kernels) survive.
        if all(a is b for a, b in zip(parts, self.parts, strict=True)):
            return self
        return dataclasses.replace(self, parts=parts)  # type: ignore[type-var]  # mixin: And/Or are dataclasses

    def _make_mask_mod(self) -> MaskMod:
        mods = [p.mask_mod() for p in self.parts]
        op = type(self).op

        def combined_mask(b, h, q_idx, kv_idx):
            out = mods[0](b, h, q_idx, kv_idx)
            for mod in mods[1:]:
                out = op(out, mod(b, h, q_idx, kv_idx))
            return out

        return combined_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        return functools.reduce(
            type(self).op, (p.dense(q_len, kv_len, batch=batch, heads=heads) for p in self.parts)
        )

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        for p in self.parts:
            p.validate(q_len, kv_len, batch, heads)

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        # &: "full" exact, "any" a superset (two partial blocks may not overlap); |: "any" exact,
        # "full" a subset (two partial blocks may cover each other). Both are safe: the kernel
        # still applies mask_mod inside partial blocks.
        maybe = [p.block_map(q_len, kv_len, q_block, kv_block, device) for p in self.parts]
        maps = [m for m in maybe if m is not None]
        if len(maps) < len(maybe):
            return None
        op = type(self).op
        return BlockMap(
            any=functools.reduce(op, (m.any for m in maps)),
            full=functools.reduce(op, (m.full for m in maps)),
        )


@spec_dataclass
class And(_Combined):
    """Visible iff visible in every part."""

    parts: tuple[MaskSpec, ...]
    op = operator.and_

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        maybe = [p.sdpa_form(q_len, kv_len) for p in self.parts]
        forms = [f for f in maybe if f is not None]
        if len(forms) < len(maybe):
            return None
        tensors = [f for f in forms if f.attn_mask is not None]
        if tensors:
            # SDPA takes one attn_mask and no is_causal beside it: exact only when every other
            # part is "no mask" (ANDing tensors would materialize a new one per call).
            others = [f for f in forms if f.attn_mask is None]
            if len(tensors) > 1 or any(f.is_causal for f in others):
                return None
            return tensors[0]
        return SdpaForm(is_causal=any(f.is_causal for f in forms))

    def hides_future_keys(self, q_len: int, kv_len: int) -> bool:
        return any(p.hides_future_keys(q_len, kv_len) for p in self.parts)

    def starts_mask_mod(self, q_len: int, kv_len: int) -> MaskMod | None:
        # Where one part hides every future key, another part offering starts is exact as
        # "starts[q] <= kv" on the keys that remain (MaskSpec.past_key_starts).
        hiding = [i for i, p in enumerate(self.parts) if p.hides_future_keys(q_len, kv_len)]
        for i, part in enumerate(self.parts):
            if not hiding or hiding == [i]:
                continue
            starts = part.past_key_starts(q_len, kv_len)
            if starts is not None:
                others = [p.mask_mod() for j, p in enumerate(self.parts) if j != i]
                return _starts_spelled(others, starts)
        return None

    def visible_fraction(self, q_len: int, kv_len: int) -> float:
        return min(p.visible_fraction(q_len, kv_len) for p in self.parts)

    def lowest_visible_key(self, q_idx: torch.Tensor) -> torch.Tensor | None:
        # A key visible in the intersection is visible in every part, so it is above every part's
        # bound; parts without one contribute 0. Not exact: the parts' lowest keys may differ.
        bounds = [p.lowest_visible_key(q_idx) for p in self.parts]
        known = [b for b in bounds if b is not None]
        if not known:
            return None
        if len(known) < len(bounds):
            known.append(torch.zeros_like(q_idx))
        return torch.stack(known).amax(0)

    def sees_one_run(self) -> bool:
        # Runs that all hold the query meet in one run, from the highest start: the bound above
        # is then exact.
        return all(p.sees_one_run() for p in self.parts)

    def varlen_form(self, q_len: int, kv_len: int, batch: int) -> VarlenForm | None:
        maybe = [p.varlen_form(q_len, kv_len, batch) for p in self.parts]
        forms = [f for f in maybe if f is not None]
        if len(forms) < len(maybe):
            return None
        segmented = [f for f in forms if f.segments is not None]
        if len(segmented) > 1:
            return None  # intersecting two segmentations has no cheap exact form here
        if len(forms) > 1 and any(f.kv_segments is not None for f in forms):
            return None  # its window is bottom-right aligned per segment; the others' are not
        left, right = -1, -1
        for f in forms:
            fl, fr = f.window
            left = fl if left < 0 else (left if fl < 0 else min(left, fl))
            right = fr if right < 0 else (right if fr < 0 else min(right, fr))
        if not segmented:
            return VarlenForm(segments=None, window=(left, right))
        return dataclasses.replace(segmented[0], window=(left, right))

    def strided_form(self, q_len: int, kv_len: int) -> StridedForm | None:
        # Parts with strided forms of one stride, the others plain windows (a varlen form of one
        # segment per row): a same-class pair is (u - t) * stride apart, so an absolute window
        # (left, right) is (left // stride, right // stride) in class positions; windows intersect.
        strided = [p.strided_form(q_len, kv_len) for p in self.parts]
        strides = {f.stride for f in strided if f is not None}
        if len(strides) != 1:
            return None
        stride = strides.pop()
        windows = []
        for part, form in zip(self.parts, strided, strict=True):
            if form is not None:
                windows.append(form.window)
                continue
            if part.uses_batch():
                return None  # per-row segments at best: no plain window
            plain = part.varlen_form(q_len, kv_len, 1)
            if plain is None or plain.segments is not None or plain.kv_segments is not None:
                return None
            left, right = plain.window
            windows.append((left // stride if left >= 0 else -1, right // stride if right >= 0 else -1))
        return StridedForm(
            stride=stride, window=(_tightest([w[0] for w in windows]), _tightest([w[1] for w in windows]))
        )

    def __and__(self, other: MaskSpec) -> MaskSpec:
        check_mask(other, "&")
        return And(parts=(*self.parts, other))


def _tightest(reaches: list[int]) -> int:
    """The smallest of window reaches where ``-1`` means unbounded (``-1`` if all are)."""
    bounded = [r for r in reaches if r >= 0]
    return min(bounded) if bounded else -1


def _starts_spelled(others: list[MaskMod], starts: torch.Tensor) -> MaskMod:
    """``others`` ANDed with ``starts[q] <= kv`` (``starts[b, q]`` for ``[B, L]`` starts)."""
    batched = starts.dim() == 2  # a Python constant of the function: flex traces one branch

    def starts_mask(b, h, q_idx, kv_idx):
        out = (starts[b, q_idx] if batched else starts[q_idx]) <= kv_idx
        for mod in others:
            out = out & mod(b, h, q_idx, kv_idx)
        return out

    return starts_mask


@spec_dataclass
class Or(_Combined):
    """Visible iff visible in any part."""

    parts: tuple[MaskSpec, ...]
    op = operator.or_

    def hides_future_keys(self, q_len: int, kv_len: int) -> bool:
        return all(p.hides_future_keys(q_len, kv_len) for p in self.parts)

    def visible_fraction(self, q_len: int, kv_len: int) -> float:
        return min(1.0, sum(p.visible_fraction(q_len, kv_len) for p in self.parts))

    def lowest_visible_key(self, q_idx: torch.Tensor) -> torch.Tensor | None:
        # A key visible in the union is visible in some part: above the smallest bound. One part
        # without a bound leaves the union without one.
        bounds = [p.lowest_visible_key(q_idx) for p in self.parts]
        known = [b for b in bounds if b is not None]
        if len(known) < len(bounds):
            return None
        return torch.stack(known).amin(0)

    def sees_one_run(self) -> bool:
        # Runs that all hold the query join into one run, from the lowest start: the bound above
        # is then exact.
        return all(p.sees_one_run() for p in self.parts)

    def __or__(self, other: MaskSpec) -> MaskSpec:
        check_mask(other, "|")
        return Or(parts=(*self.parts, other))


@spec_dataclass
class Not(MaskSpec):
    """Visible iff not visible in ``part``."""

    part: MaskSpec

    def __post_init__(self) -> None:
        if not isinstance(self.part, MaskSpec):
            raise TypeError(
                f"Not(part=...) takes a mask spec (e.g. masks.Causal()), got {type(self.part).__name__}"
            )

    def uses_batch(self) -> bool:
        return self.part.uses_batch()

    def reads_scalar_tensors(self) -> bool:
        return self.part.reads_scalar_tensors()

    def uses_head(self) -> bool:
        return self.part.uses_head()

    def bind(self, q_len: int, kv_len: int) -> MaskSpec:
        part = self.part.bind(q_len, kv_len)
        return self if part is self.part else dataclasses.replace(self, part=part)

    def _make_mask_mod(self) -> MaskMod:
        mod = self.part.mask_mod()

        def not_mask(b, h, q_idx, kv_idx):
            return ~mod(b, h, q_idx, kv_idx)

        return not_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        return ~self.part.dense(q_len, kv_len, batch=batch, heads=heads)

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        self.part.validate(q_len, kv_len, batch, heads)

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        inner = self.part.block_map(q_len, kv_len, q_block, kv_block, device)
        if inner is None:
            return None
        _, _, q_complete = block_ranges(q_len, q_block, device)
        _, _, kv_complete = block_ranges(kv_len, kv_block, device)
        complete = q_complete.view(-1, 1) & kv_complete.view(1, -1)
        # A block is fully visible in ~a iff a sees none of it (and it is complete); it has some
        # visible element iff a does not see all of it. Incomplete blocks are never "full" in a,
        # so they stay "any" here: a safe superset.
        return BlockMap(any=~inner.full, full=~inner.any & complete)

    def __invert__(self) -> MaskSpec:
        return self.part


@spec_dataclass
class Chain(ScoreSpec):
    """Apply ``mods`` in order: ``Chain(mods=(a, b))`` computes ``b(a(score))``; same as ``a >> b``."""

    mods: tuple[ScoreSpec, ...]

    def __post_init__(self) -> None:
        if not self.mods:
            raise ValueError("Chain(mods=...) needs at least one score spec")
        for m in self.mods:
            if not isinstance(m, ScoreSpec):
                raise TypeError(f"Chain(mods=...) takes score specs, got {type(m).__name__}")

    def _make_score_mod(self, *, fast: bool) -> ScoreMod:
        return _chained([m.score_mod(fast=fast) for m in self.mods])

    def _make_past_score_mod(self, *, fast: bool) -> ScoreMod:
        fns = [m.score_mod(fast=fast, future_keys_hidden=True) for m in self.mods]
        if all(f is m.score_mod(fast=fast) for f, m in zip(fns, self.mods, strict=True)):
            return self.score_mod(fast=fast)  # no part has a cheaper variant: share the kernel
        return _chained(fns)

    def has_fast_variant(self) -> bool:
        return any(m.has_fast_variant() for m in self.mods)

    def reads_scalar_tensors(self) -> bool:
        return any(m.reads_scalar_tensors() for m in self.mods)

    def softcap_form(self) -> SoftCapForm | None:
        # Only a chain of one: capping twice, or capping a biased score, is not one soft-cap.
        return self.mods[0].softcap_form() if len(self.mods) == 1 else None

    def linear_bias_form(self) -> LinearBiasForm | None:
        # Linear biases add up: s - a[h]|i - j| - b[h]|i - j| = s - (a[h] + b[h])|i - j|.
        forms = [f for f in (m.linear_bias_form() for m in self.mods) if f is not None]
        if len(forms) < len(self.mods) or len({len(f.slopes) for f in forms}) != 1:
            return None
        per_head = zip(*(f.slopes for f in forms), strict=True)
        return LinearBiasForm(slopes=tuple(math.fsum(s) for s in per_head))

    def uses_head(self) -> bool:
        return any(m.uses_head() for m in self.mods)

    def dense(self, scores: torch.Tensor) -> torch.Tensor:
        for m in self.mods:
            scores = m.dense(scores)
        return scores

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        for m in self.mods:
            m.validate(q_len, kv_len, batch, heads)


def _chained(fns: list[ScoreMod]) -> ScoreMod:
    def chained(score, b, h, q_idx, kv_idx):
        for fn in fns:
            score = fn(score, b, h, q_idx, kv_idx)
        return score

    return chained


def _and(left: MaskSpec, right: object) -> MaskSpec:
    return And(parts=(left, check_mask(right, "&")))


def _or(left: MaskSpec, right: object) -> MaskSpec:
    return Or(parts=(left, check_mask(right, "|")))


def _chain(left: ScoreSpec, right: ScoreSpec) -> ScoreSpec:
    mods_left = left.mods if isinstance(left, Chain) else (left,)
    mods_right = right.mods if isinstance(right, Chain) else (right,)
    return Chain(mods=(*mods_left, *mods_right))


COMBINATORS.update({"&": _and, "|": _or, "~": lambda part: Not(part=part), ">>": _chain})


# ---------------------------------------------------------------------------------------------
# Shards (see the module docstring)

Range = tuple[int, int]


def _check_ranges(owner: str, batch: Range, heads: Range, total: tuple[int, int]) -> None:
    for name, value in (("batch", batch), ("heads", heads), ("total", total)):
        if (
            not isinstance(value, tuple)
            or len(value) != 2
            or any(isinstance(x, bool) or not isinstance(x, int) for x in value)
        ):
            raise TypeError(f"{owner}({name}=...) must be a tuple of two ints, got {value!r}")
    for name, (start, stop), size in (("batch", batch, total[0]), ("heads", heads, total[1])):
        if not 0 <= start < stop <= size:
            raise ValueError(
                f"{owner}({name}={(start, stop)}) must be a non-empty [start, stop) range inside "
                f"[0, {size}) (total={total})"
            )


def _shifted(b: Any, h: Any, b0: int, h0: int) -> tuple[Any, Any]:
    # Skip the add where the offset is 0: the kernel's index arithmetic stays what it was.
    return (b + b0 if b0 else b), (h + h0 if h0 else h)


def _slice_rows_heads(t: torch.Tensor, batch: Range, heads: Range) -> torch.Tensor:
    """``t`` (``[B|1, H|1, ...]``) restricted to the shard; size-1 (broadcast) dims stay."""
    if t.shape[0] != 1:
        t = t[batch[0] : batch[1]]
    if t.shape[1] != 1:
        t = t[:, heads[0] : heads[1]]
    return t


def _sdpa_form_on_shard(form: SdpaForm | None, batch: Range, heads: Range) -> SdpaForm | None:
    """``form`` of the whole call with its ``attn_mask`` (``[B|1, H|1, Lq|1, Lkv|1]``) cut to the
    shard's rows and heads: a view, no copy. ``empty_rows`` stays the whole call's (a safe "maybe")."""
    if form is None or form.attn_mask is None:
        return form
    return dataclasses.replace(form, attn_mask=_slice_rows_heads(as_4d(form.attn_mask), batch, heads))


@spec_dataclass
class MaskOnShard(MaskSpec):
    """``part`` on the shard of batch rows ``batch = (b0, b1)`` and query heads ``heads = (h0, h1)``
    of a call with ``total = (B, H)`` rows and query heads: local ``(b, h)`` is ``(b + b0, h + h0)``
    of the whole call. Built by :func:`on_shard`; see the module docstring for the forms."""

    part: MaskSpec
    batch: Range
    heads: Range
    total: tuple[int, int]

    def __post_init__(self) -> None:
        if not isinstance(self.part, MaskSpec):
            raise TypeError(f"MaskOnShard(part=...) takes a mask spec, got {type(self.part).__name__}")
        _check_ranges("MaskOnShard", self.batch, self.heads, self.total)

    def uses_batch(self) -> bool:
        return self.part.uses_batch()

    def uses_head(self) -> bool:
        return self.part.uses_head()

    def reads_scalar_tensors(self) -> bool:
        return self.part.reads_scalar_tensors()

    def bind(self, q_len: int, kv_len: int) -> MaskSpec:
        part = self.part.bind(q_len, kv_len)
        return self if part is self.part else dataclasses.replace(self, part=part)

    def _make_mask_mod(self) -> MaskMod:
        mod = self.part.mask_mod()
        b0, h0 = self.batch[0], self.heads[0]

        def mask_on_shard(b, h, q_idx, kv_idx):
            gb, gh = _shifted(b, h, b0, h0)
            return mod(gb, gh, q_idx, kv_idx)

        return mask_on_shard

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        whole = self.part.dense(q_len, kv_len, batch=self.total[0], heads=self.total[1])
        return _slice_rows_heads(as_4d(whole), self.batch, self.heads)

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        self.part.validate(q_len, kv_len, *self.total)
        # Callers pass 1 for a dim the spec does not use (``fz.block_mask`` without batch=).
        for name, size, (start, stop), used in (
            ("batch", batch, self.batch, self.part.uses_batch()),
            ("heads", heads, self.heads, self.part.uses_head()),
        ):
            if used and size != stop - start:
                raise ValueError(
                    f"MaskOnShard covers {name} [{start}, {stop}) ({stop - start}) but the call has {size}"
                )

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        return _sdpa_form_on_shard(self.part.sdpa_form(q_len, kv_len), self.batch, self.heads)

    def split_form(self, q_len: int, kv_len: int) -> SplitForm | None:
        return self.part.split_form(q_len, kv_len)

    def strided_form(self, q_len: int, kv_len: int) -> StridedForm | None:
        return self.part.strided_form(q_len, kv_len)  # the same classes in every row and head

    def global_tokens_form(self, q_len: int, kv_len: int) -> GlobalTokensForm | None:
        return self.part.global_tokens_form(q_len, kv_len)  # the same positions in every row and head

    def varlen_form(self, q_len: int, kv_len: int, batch: int) -> VarlenForm | None:
        form = self.part.varlen_form(q_len, kv_len, self.total[0])
        if form is None or form.segments is None or form.segments.dim() == 1:
            return form  # the same segments for every row
        return dataclasses.replace(form, segments=form.segments[self.batch[0] : self.batch[1]])

    def hides_future_keys(self, q_len: int, kv_len: int) -> bool:
        return self.part.hides_future_keys(q_len, kv_len)

    def lowest_visible_key(self, q_idx: torch.Tensor) -> torch.Tensor | None:
        return self.part.lowest_visible_key(q_idx)

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        whole = self.part.block_map(q_len, kv_len, q_block, kv_block, device)
        if whole is None:
            return None
        return BlockMap(
            any=_slice_rows_heads(as_4d(whole.any), self.batch, self.heads),
            full=_slice_rows_heads(as_4d(whole.full), self.batch, self.heads),
        )


@spec_dataclass
class ScoreOnShard(ScoreSpec):
    """``part`` on a shard of a larger call; fields and index convention as :class:`MaskOnShard`."""

    part: ScoreSpec
    batch: Range
    heads: Range
    total: tuple[int, int]

    def __post_init__(self) -> None:
        if not isinstance(self.part, ScoreSpec):
            raise TypeError(f"ScoreOnShard(part=...) takes a score spec, got {type(self.part).__name__}")
        _check_ranges("ScoreOnShard", self.batch, self.heads, self.total)

    def _wrap(self, mod: ScoreMod) -> ScoreMod:
        b0, h0 = self.batch[0], self.heads[0]

        def score_on_shard(score, b, h, q_idx, kv_idx):
            gb, gh = _shifted(b, h, b0, h0)
            return mod(score, gb, gh, q_idx, kv_idx)

        return score_on_shard

    def _make_score_mod(self, *, fast: bool) -> ScoreMod:
        return self._wrap(self.part.score_mod(fast=fast))

    def _make_past_score_mod(self, *, fast: bool) -> ScoreMod:
        past = self.part.score_mod(fast=fast, future_keys_hidden=True)
        if past is self.part.score_mod(fast=fast):
            return self.score_mod(fast=fast)  # no cheaper variant: share the kernel
        return self._wrap(past)

    def has_fast_variant(self) -> bool:
        return self.part.has_fast_variant()

    def reads_scalar_tensors(self) -> bool:
        return self.part.reads_scalar_tensors()

    def uses_head(self) -> bool:
        return self.part.uses_head()

    def dense(self, scores: torch.Tensor) -> torch.Tensor:
        # The inner oracle sees the whole call (e.g. Alibi checks its head count): place the shard's
        # scores at their global rows and heads, apply, and cut the shard out again.
        (b0, b1), (h0, h1) = self.batch, self.heads
        whole = scores.new_zeros(self.total[0], self.total[1], *scores.shape[2:])
        whole[b0:b1, h0:h1] = scores
        return self.part.dense(whole)[b0:b1, h0:h1]

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        self.part.validate(q_len, kv_len, *self.total)
        for name, size, (start, stop) in (("batch", batch, self.batch), ("heads", heads, self.heads)):
            if size != stop - start:
                raise ValueError(
                    f"ScoreOnShard covers {name} [{start}, {stop}) ({stop - start}) but the call has {size}"
                )

    def softcap_form(self) -> SoftCapForm | None:
        return self.part.softcap_form()

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        return _sdpa_form_on_shard(self.part.sdpa_form(q_len, kv_len), self.batch, self.heads)

    def linear_bias_form(self) -> LinearBiasForm | None:
        form = self.part.linear_bias_form()
        if form is None:
            return None
        return LinearBiasForm(slopes=form.slopes[self.heads[0] : self.heads[1]])


@overload
def on_shard(spec: None, *, batch: Range, heads: Range, total: tuple[int, int]) -> None: ...
@overload
def on_shard(spec: MaskSpec, *, batch: Range, heads: Range, total: tuple[int, int]) -> MaskSpec: ...
@overload
def on_shard(spec: ScoreSpec, *, batch: Range, heads: Range, total: tuple[int, int]) -> ScoreSpec: ...


def on_shard(
    spec: MaskSpec | ScoreSpec | None, *, batch: Range, heads: Range, total: tuple[int, int]
) -> MaskSpec | ScoreSpec | None:
    """``spec`` as the shard of batch rows ``batch`` and query heads ``heads`` of a ``total =
    (B, H)`` call sees it (see the module docstring); ``spec`` itself where the shard changes
    nothing for it.

    A mask is kept as is when the shard covers every row and head it depends on
    (``uses_batch()`` / ``uses_head()``). A score spec is wrapped whenever the shard is not the
    whole call: score specs do not declare batch dependence, and a subclass may read ``h``
    without setting ``depends_on_head``, so nothing proves the wrapper unnecessary.
    """
    if spec is None:
        return None
    whole_batch, whole_heads = batch == (0, total[0]), heads == (0, total[1])
    if isinstance(spec, MaskSpec):
        if (whole_batch or not spec.uses_batch()) and (whole_heads or not spec.uses_head()):
            return spec
        return MaskOnShard(part=spec, batch=batch, heads=heads, total=total)
    if whole_batch and whole_heads:
        return spec
    return ScoreOnShard(part=spec, batch=batch, heads=heads, total=total)
