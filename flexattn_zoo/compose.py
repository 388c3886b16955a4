"""Spec algebra: ``a & b``, ``a | b``, ``~a`` for masks and ``a >> b`` for score mods.

Composites keep every cheap form that stays exact: SDPA and varlen forms intersect under ``&``,
and block maps combine block-wise (``&``: exact "full", safe superset "any"; ``|``: exact "any",
safe subset "full"; ``~``: swaps them, keeping incomplete edge blocks partial). Lowest visible
keys combine as bounds (``&``: the largest, ``|``: the smallest). A chain keeps its one part's
soft-cap form, and the summed slopes when every part is a linear bias.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from flexattn_zoo.spec import (
    COMBINATORS,
    BlockMap,
    LinearBiasForm,
    MaskMod,
    MaskSpec,
    ScoreMod,
    ScoreSpec,
    SdpaForm,
    SoftCapForm,
    VarlenForm,
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
        return SdpaForm(is_causal=any(f.is_causal for f in forms))

    def hides_future_keys(self, q_len: int, kv_len: int) -> bool:
        return any(p.hides_future_keys(q_len, kv_len) for p in self.parts)

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

    def varlen_form(self, q_len: int, kv_len: int, batch: int) -> VarlenForm | None:
        maybe = [p.varlen_form(q_len, kv_len, batch) for p in self.parts]
        forms = [f for f in maybe if f is not None]
        if len(forms) < len(maybe):
            return None
        segmented = [f for f in forms if f.segments is not None]
        if len(segmented) > 1:
            return None  # intersecting two segmentations has no cheap exact form here
        left, right = -1, -1
        for f in forms:
            fl, fr = f.window
            left = fl if left < 0 else (left if fl < 0 else min(left, fl))
            right = fr if right < 0 else (right if fr < 0 else min(right, fr))
        return VarlenForm(segments=segmented[0].segments if segmented else None, window=(left, right))

    def __and__(self, other: MaskSpec) -> MaskSpec:
        check_mask(other, "&")
        return And(parts=(*self.parts, other))


@spec_dataclass
class Or(_Combined):
    """Visible iff visible in any part."""

    parts: tuple[MaskSpec, ...]
    op = operator.or_

    def hides_future_keys(self, q_len: int, kv_len: int) -> bool:
        return all(p.hides_future_keys(q_len, kv_len) for p in self.parts)

    def lowest_visible_key(self, q_idx: torch.Tensor) -> torch.Tensor | None:
        # A key visible in the union is visible in some part: above the smallest bound. One part
        # without a bound leaves the union without one.
        bounds = [p.lowest_visible_key(q_idx) for p in self.parts]
        known = [b for b in bounds if b is not None]
        if len(known) < len(bounds):
            return None
        return torch.stack(known).amin(0)

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
