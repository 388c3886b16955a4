"""Base classes for mask and score specs, and their algebra.

Conventions shared by every spec:

* Positions are absolute: query ``i`` in ``[0, Lq)`` and key ``j`` in ``[0, Lkv)``.
* A spec is a frozen, hashable, keyword-only dataclass. Equal parameters give equal specs and the
  *same* ``mask_mod`` / ``score_mod`` function object, so compiled kernels and BlockMasks are reused.
  Tensor parameters (document ids, per-batch prefix lengths) compare by value and hash by
  shape/dtype; treat them as immutable once they are inside a spec.
* ``MaskSpec.dense(q_len, kv_len)`` is the independent oracle: a boolean ``[B|1, H|1, Lq, Lkv]``
  tensor written without calling ``mask_mod``. It materializes ``Lq x Lkv``: it is for tests and
  the reference only.
* ``ScoreSpec.dense(scores)`` rewrites a dense float64 ``[B, H, Lq, Lkv]`` tensor of *scaled*
  scores, again written independently of ``score_mod``.

Masks compose with ``a & b``, ``a | b`` and ``~a``. Score specs chain with ``a >> b``: ``a`` is
applied first, then ``b`` (function composition read left to right).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any, ClassVar

import torch

from flexattn_zoo.lru import LRUCache

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ScoreMod = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]

#: Upper bound on cached mod functions; old entries are dropped least-recently-used first.
MOD_CACHE_SIZE = 1024


def spec_dataclass(cls: type) -> type:
    """Decorator: a frozen keyword-only dataclass whose equality/hash come from :class:`Spec`."""
    return dataclasses.dataclass(frozen=True, kw_only=True, eq=False, repr=True)(cls)


def _freeze(value: Any) -> Hashable:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a is b:
            return True
        return (
            a.shape == b.shape
            and a.dtype == b.dtype
            and a.device == b.device
            and bool(torch.equal(a, b))
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


_MODS: LRUCache[Any] = LRUCache(MOD_CACHE_SIZE)


class Spec:
    """Common behaviour: value equality, hashing, device moves."""

    #: Registry name (snake_case); set by the registry decorator.
    name: ClassVar[str] = ""

    def _fields(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))  # type: ignore[arg-type]

    def __eq__(self, other: object) -> bool:
        if type(self) is not type(other):
            return NotImplemented
        return all(
            _values_equal(a, b) for a, b in zip(self._fields(), other._fields(), strict=True)  # type: ignore[attr-defined]
        )

    def __hash__(self) -> int:
        return hash((type(self).__qualname__, _freeze(self._fields())))

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        """A few valid instances for a problem of this shape; the registry-wide tests and the
        hypothesis strategies draw from them. The default is the no-argument instance."""
        return [cls()]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this spec captures (recursively), e.g. to check devices."""
        found: list[torch.Tensor] = []
        for value in self._fields():
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, Spec):
                found.extend(value.tensors())
            elif isinstance(value, tuple):
                for v in value:
                    if isinstance(v, Spec):
                        found.extend(v.tensors())
                    elif isinstance(v, torch.Tensor):
                        found.append(v)
        return found

    def to(self, device: torch.device | str) -> Spec:
        """A copy with every captured tensor on ``device`` (``self`` if nothing moves)."""
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and value.device != torch.device(device):
                changes[f.name] = value.to(device)
            elif isinstance(value, Spec):
                moved = value.to(device)
                if moved is not value:
                    changes[f.name] = moved
            elif isinstance(value, tuple) and any(isinstance(v, Spec) for v in value):
                moved_t = tuple(v.to(device) if isinstance(v, Spec) else v for v in value)
                if any(a is not b for a, b in zip(moved_t, value, strict=True)):
                    changes[f.name] = moved_t
        return dataclasses.replace(self, **changes) if changes else self  # type: ignore[type-var]


# ---------------------------------------------------------------------------------------------
# Cheap exact forms offered to the dispatcher.


@dataclasses.dataclass(frozen=True)
class SdpaForm:
    """The mask is exactly SDPA's ``is_causal`` flag (top-left; only offered when Lq == Lkv)."""

    is_causal: bool


@dataclasses.dataclass(frozen=True)
class VarlenForm:
    """The mask is exactly block-diagonal segments, each with an FA-style window.

    ``segments`` holds, per batch row, the lengths of consecutive segments that tile ``[0, L)``
    (``None`` means one segment per row). ``window`` is ``(left, right)`` with -1 for unbounded,
    relative to the diagonal inside each segment. Only offered when Lq == Lkv.
    """

    segments: torch.Tensor | None  # int64 [B, S] padded with 0, or [S] shared by every row
    window: tuple[int, int] = (-1, -1)


@dataclasses.dataclass(frozen=True)
class BlockMap:
    """Block-level visibility, computed in closed form (O(n_q_blocks * n_kv_blocks), never O(L^2)).

    ``any[b, h, r, c]`` is True when query block ``r`` sees at least one key of key block ``c``;
    ``full[b, h, r, c]`` when it sees all of them. Leading dims are 1 when the spec does not depend
    on batch/head. Conventions follow ``create_block_mask``: positions past ``Lq``/``Lkv`` count as
    masked, so a trailing incomplete block is never full. ``full`` implies ``any``.
    """

    any: torch.Tensor
    full: torch.Tensor


def block_ranges(length: int, block: int, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(start, last, complete)`` per block of ``[0, length)``: first index, last valid index,
    and whether the block is complete (holds ``block`` valid positions)."""
    n = -(-length // block)
    start = torch.arange(n, device=device) * block
    last = torch.clamp(start + block - 1, max=length - 1)
    complete = (start + block) <= length
    return start, last, complete


# ---------------------------------------------------------------------------------------------
# Masks


class MaskSpec(Spec):
    """Base class of every mask spec. Subclasses implement ``_make_mask_mod`` and ``dense``."""

    #: True when visibility depends on the batch index (e.g. per-row documents).
    depends_on_batch: ClassVar[bool] = False
    #: True when visibility depends on the head index.
    depends_on_head: ClassVar[bool] = False

    def uses_batch(self) -> bool:
        """Whether this spec instance depends on the batch index (composites override)."""
        return self.depends_on_batch

    def uses_head(self) -> bool:
        """Whether this spec instance depends on the head index (composites override)."""
        return self.depends_on_head

    def bind(self, q_len: int, kv_len: int) -> MaskSpec:
        """This spec specialised to ``q_len`` x ``kv_len`` (``self`` for most specs).

        ``mask_mod`` receives no lengths, so a spec whose rule mentions them (e.g.
        ``Causal(align="bottom_right")``, which needs ``Lkv - Lq``) returns an equivalent spec with
        the length-derived value made explicit. Callers building kernels call
        ``spec.bind(Lq, Lkv)`` before asking for ``mask_mod()``.
        """
        return self

    def mask_mod(self) -> MaskMod:
        """The flex ``mask_mod(b, h, q_idx, kv_idx) -> bool``; one function object per value."""
        return _MODS.get_or_create(("mask", self), self._make_mask_mod)

    def _make_mask_mod(self) -> MaskMod:
        raise NotImplementedError

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        """Independent boolean oracle of shape ``[B|1, H|1, q_len, kv_len]``.

        ``batch``/``heads`` only matter to specs that depend on them; others return size-1 dims.
        """
        raise NotImplementedError

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        """Raise ``ValueError`` if the spec cannot describe a problem of this shape."""

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        """Exact SDPA form, or None."""
        return None

    def varlen_form(self, q_len: int, kv_len: int, batch: int) -> VarlenForm | None:
        """Exact varlen form, or None."""
        return None

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        """Closed-form block visibility (see :class:`BlockMap`), or None if there is none.

        None sends ``fz.block_mask`` to the generic builder, which evaluates ``mask_mod`` in
        bounded-memory chunks.
        """
        return None

    def __and__(self, other: MaskSpec) -> MaskSpec:
        _check_mask(other, "&")
        return And(parts=(self, other))

    def __or__(self, other: MaskSpec) -> MaskSpec:
        _check_mask(other, "|")
        return Or(parts=(self, other))

    def __invert__(self) -> MaskSpec:
        return Not(part=self)


def _check_mask(other: object, op: str) -> None:
    if not isinstance(other, MaskSpec):
        raise TypeError(
            f"mask {op} expects another mask spec (e.g. masks.Causal()), got {type(other).__name__}"
        )


@spec_dataclass
class And(MaskSpec):
    """Visible iff visible in every part."""

    parts: tuple[MaskSpec, ...]

    def uses_batch(self) -> bool:
        return any(p.uses_batch() for p in self.parts)

    def uses_head(self) -> bool:
        return any(p.uses_head() for p in self.parts)

    def bind(self, q_len: int, kv_len: int) -> MaskSpec:
        parts = tuple(p.bind(q_len, kv_len) for p in self.parts)
        # Keep ``self`` when nothing changed so mask_mod identity (and compiled kernels) survive.
        if all(a is b for a, b in zip(parts, self.parts, strict=True)):
            return self
        return dataclasses.replace(self, parts=parts)

    def _make_mask_mod(self) -> MaskMod:
        mods = [p.mask_mod() for p in self.parts]

        def and_mask(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            out = mods[0](b, h, q_idx, kv_idx)
            for mod in mods[1:]:
                out = out & mod(b, h, q_idx, kv_idx)
            return out

        return and_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        out = self.parts[0].dense(q_len, kv_len, batch=batch, heads=heads)
        for p in self.parts[1:]:
            out = out & p.dense(q_len, kv_len, batch=batch, heads=heads)
        return out

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        for p in self.parts:
            p.validate(q_len, kv_len, batch, heads)

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        forms = [p.sdpa_form(q_len, kv_len) for p in self.parts]
        if any(f is None for f in forms):
            return None
        return SdpaForm(is_causal=any(f.is_causal for f in forms))  # type: ignore[union-attr]

    def varlen_form(self, q_len: int, kv_len: int, batch: int) -> VarlenForm | None:
        forms = [p.varlen_form(q_len, kv_len, batch) for p in self.parts]
        if any(f is None for f in forms):
            return None
        segmented = [f for f in forms if f.segments is not None]  # type: ignore[union-attr]
        if len(segmented) > 1:
            return None  # intersecting two segmentations has no cheap exact form here
        left, right = -1, -1
        for f in forms:
            fl, fr = f.window  # type: ignore[union-attr]
            left = fl if left < 0 else (left if fl < 0 else min(left, fl))
            right = fr if right < 0 else (right if fr < 0 else min(right, fr))
        return VarlenForm(segments=segmented[0].segments if segmented else None, window=(left, right))

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        maps = [p.block_map(q_len, kv_len, q_block, kv_block, device) for p in self.parts]
        if any(m is None for m in maps):
            return None
        # full is exact; any is a superset (two partial blocks may not overlap), which is safe:
        # the kernel still applies mask_mod inside partial blocks.
        any_, full = maps[0].any, maps[0].full  # type: ignore[union-attr]
        for m in maps[1:]:
            any_, full = any_ & m.any, full & m.full  # type: ignore[union-attr]
        return BlockMap(any=any_, full=full)

    def __and__(self, other: MaskSpec) -> MaskSpec:
        _check_mask(other, "&")
        return And(parts=(*self.parts, other))


@spec_dataclass
class Or(MaskSpec):
    """Visible iff visible in any part."""

    parts: tuple[MaskSpec, ...]

    def uses_batch(self) -> bool:
        return any(p.uses_batch() for p in self.parts)

    def uses_head(self) -> bool:
        return any(p.uses_head() for p in self.parts)

    def bind(self, q_len: int, kv_len: int) -> MaskSpec:
        parts = tuple(p.bind(q_len, kv_len) for p in self.parts)
        # Keep ``self`` when nothing changed so mask_mod identity (and compiled kernels) survive.
        if all(a is b for a, b in zip(parts, self.parts, strict=True)):
            return self
        return dataclasses.replace(self, parts=parts)

    def _make_mask_mod(self) -> MaskMod:
        mods = [p.mask_mod() for p in self.parts]

        def or_mask(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            out = mods[0](b, h, q_idx, kv_idx)
            for mod in mods[1:]:
                out = out | mod(b, h, q_idx, kv_idx)
            return out

        return or_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        out = self.parts[0].dense(q_len, kv_len, batch=batch, heads=heads)
        for p in self.parts[1:]:
            out = out | p.dense(q_len, kv_len, batch=batch, heads=heads)
        return out

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        for p in self.parts:
            p.validate(q_len, kv_len, batch, heads)

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        maps = [p.block_map(q_len, kv_len, q_block, kv_block, device) for p in self.parts]
        if any(m is None for m in maps):
            return None
        # any is exact; full is a subset (two partial blocks may cover each other), which is safe.
        any_, full = maps[0].any, maps[0].full  # type: ignore[union-attr]
        for m in maps[1:]:
            any_, full = any_ | m.any, full | m.full  # type: ignore[union-attr]
        return BlockMap(any=any_, full=full)

    def __or__(self, other: MaskSpec) -> MaskSpec:
        _check_mask(other, "|")
        return Or(parts=(*self.parts, other))


@spec_dataclass
class Not(MaskSpec):
    """Visible iff not visible in ``part``."""

    part: MaskSpec

    def uses_batch(self) -> bool:
        return self.part.uses_batch()

    def uses_head(self) -> bool:
        return self.part.uses_head()

    def bind(self, q_len: int, kv_len: int) -> MaskSpec:
        part = self.part.bind(q_len, kv_len)
        return self if part is self.part else dataclasses.replace(self, part=part)

    def _make_mask_mod(self) -> MaskMod:
        mod = self.part.mask_mod()

        def not_mask(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
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


# ---------------------------------------------------------------------------------------------
# Score modifications


class ScoreSpec(Spec):
    """Base class of every score spec. Subclasses implement ``_make_score_mod`` and ``dense``."""

    depends_on_head: ClassVar[bool] = False

    def score_mod(self, *, fast: bool = False) -> ScoreMod:
        """The flex ``score_mod(score, b, h, q_idx, kv_idx)``; one function object per value.

        ``fast=True`` asks for the variant a GPU kernel should run (e.g. a hardware tanh); it is
        only different for specs that opted in (``SoftCap(approx=True)``).
        """
        return _MODS.get_or_create(("score", self, fast), lambda: self._make_score_mod(fast=fast))

    def _make_score_mod(self, *, fast: bool) -> ScoreMod:
        raise NotImplementedError

    def dense(self, scores: torch.Tensor) -> torch.Tensor:
        """Apply to a dense ``[B, H, Lq, Lkv]`` float64 tensor of scaled scores (oracle)."""
        raise NotImplementedError

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        """Raise ``ValueError`` if the spec cannot serve a problem of this shape."""

    def captures_grad_tensors(self) -> bool:
        """True when the score_mod closes over tensors that require grad (learned biases)."""
        return any(t.requires_grad for t in self.tensors())

    def __rshift__(self, other: ScoreSpec) -> ScoreSpec:
        if not isinstance(other, ScoreSpec):
            raise TypeError(
                "score >> expects another score spec (e.g. score_mods.SoftCap(cap=30.0)), "
                f"got {type(other).__name__}"
            )
        left = self.mods if isinstance(self, Chain) else (self,)
        right = other.mods if isinstance(other, Chain) else (other,)
        return Chain(mods=(*left, *right))


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
        fns = [m.score_mod(fast=fast) for m in self.mods]

        def chained(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            for fn in fns:
                score = fn(score, b, h, q_idx, kv_idx)
            return score

        return chained

    def dense(self, scores: torch.Tensor) -> torch.Tensor:
        for m in self.mods:
            scores = m.dense(scores)
        return scores

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        for m in self.mods:
            m.validate(q_len, kv_len, batch, heads)


def positions(q_len: int, kv_len: int, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(i, j)`` index grids of shape ``[Lq, 1]`` and ``[1, Lkv]`` for writing dense oracles."""
    i = torch.arange(q_len, device=device).view(q_len, 1)
    j = torch.arange(kv_len, device=device).view(1, kv_len)
    return i, j


def as_4d(mask: torch.Tensor) -> torch.Tensor:
    """View a ``[Lq, Lkv]`` or ``[B, Lq, Lkv]`` boolean mask as ``[B|1, H|1, Lq, Lkv]``."""
    if mask.dim() == 2:
        return mask[None, None]
    if mask.dim() == 3:
        return mask[:, None]
    return mask
