"""``causal``: a query sees keys at or before its own position, top-left or bottom-right aligned."""

from __future__ import annotations

from typing import Literal

import torch

from flexattn_zoo.registry import MASKS
from flexattn_zoo.spec import (
    BlockMap,
    MaskMod,
    MaskSpec,
    SdpaForm,
    Spec,
    VarlenForm,
    known_true,
    lower_triangle_fraction,
    spec_dataclass,
    true_without_guard,
)

from ._blocks import CapturedOffsets, band_block_map, check_int

_ALIGNS = ("top_left", "bottom_right")


@MASKS.register
@spec_dataclass
class Causal(MaskSpec):
    """Causal mask: ``j <= i`` (``align="top_left"``) or ``j <= i + (Lkv - Lq)`` (``"bottom_right"``).

    ``top_left`` is SDPA's ``is_causal`` and flex's usual ``q_idx >= kv_idx``; ``bottom_right`` is
    FlashAttention's convention, where the last query lines up with the last key (decoding with a
    KV cache). The two agree when ``Lq == Lkv``.

    Picture (``Lq = 4``, ``Lkv = 6``; rows are queries, columns keys, ``#`` visible)::

        top_left     bottom_right
        #.....       ###...
        ##....       ####..
        ###...       #####.
        ####..       ######

    ``mask_mod`` sees no lengths, so ``bottom_right`` must be bound first:
    ``Causal(align="bottom_right").bind(Lq, Lkv)`` returns ``Causal()`` when ``Lq == Lkv`` and an
    :class:`OffsetCausal` carrying ``Lkv - Lq`` otherwise; calling ``mask_mod()`` on the unbound
    spec raises ``ValueError``. ``dense``/``block_map`` take the lengths and need no binding.

    Forms offered (both aligns): SDPA ``is_causal=True`` and varlen window ``(-1, 0)`` when
    ``Lq == Lkv``; a closed-form block map for any lengths.

    Args:
        align: ``"top_left"`` (default) or ``"bottom_right"``.
    """

    align: Literal["top_left", "bottom_right"] = "top_left"

    def __post_init__(self) -> None:
        if self.align not in _ALIGNS:
            raise ValueError(
                f"Causal(align=...) must be one of {', '.join(map(repr, _ALIGNS))}, got {self.align!r}"
            )

    def _offset(self, q_len: int, kv_len: int) -> int:
        return 0 if self.align == "top_left" else kv_len - q_len

    def bind(self, q_len: int, kv_len: int) -> MaskSpec:
        if self.align == "top_left":
            return self
        # Equal lengths bind to plain Causal() so both aligns share one mask_mod and kernel.
        return Causal() if q_len == kv_len else OffsetCausal(offset=kv_len - q_len)

    def _make_mask_mod(self) -> MaskMod:
        if self.align == "bottom_right":
            raise ValueError(
                "Causal(align='bottom_right') depends on Lkv - Lq, which mask_mod cannot see; "
                "call spec.bind(q_len, kv_len).mask_mod() instead"
            )

        def causal_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return kv_idx <= q_idx

        return causal_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        return _tril(q_len, kv_len, self._offset(q_len, kv_len))

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        return SdpaForm(is_causal=True) if q_len == kv_len else None

    def hides_future_keys(self, q_len: int, kv_len: int) -> bool:
        return self._offset(q_len, kv_len) <= 0

    def sees_one_run(self) -> bool:
        return True  # keys 0 .. i (both aligns agree at equal lengths)

    def visible_fraction(self, q_len: int, kv_len: int) -> float:
        return lower_triangle_fraction(q_len, kv_len, self._offset(q_len, kv_len))

    def varlen_form(self, q_len: int, kv_len: int, batch: int) -> VarlenForm | None:
        return VarlenForm(segments=None, window=(-1, 0)) if q_len == kv_len else None

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        offset = self._offset(q_len, kv_len)
        return band_block_map(q_len, kv_len, q_block, kv_block, device, lo=None, hi=offset)

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        return [cls(), cls(align="bottom_right")]


@spec_dataclass
class OffsetCausal(CapturedOffsets, MaskSpec):
    """``j <= i + offset``: a causal diagonal shifted by ``offset`` keys (may be negative).

    What ``Causal(align="bottom_right").bind(Lq, Lkv)`` returns when ``Lq != Lkv``
    (``offset = Lkv - Lq``). Not registered: users write ``Causal(align="bottom_right")``.

    Picture (``offset = 2``, ``Lq = Lkv = 6``; rows are queries, ``#`` visible)::

        ###...
        ####..
        #####.
        ######
        ######
        ######

    Forms offered: SDPA ``is_causal=True`` / varlen ``(-1, 0)`` only when ``offset == 0`` and
    ``Lq == Lkv``; SDPA without a mask, at any lengths, when ``offset >= Lkv - 1`` (it hides
    nothing: one decoding query at the end of the cache); a closed-form block map for any lengths.

    The ``mask_mod`` reads ``offset`` from a captured 0-d tensor, not a Python constant: a decode
    loop (``Lq = 1``, ``Lkv = 8, 9, 10, ...``: a new offset every step) reuses one compiled kernel
    instead of compiling one per step (see ``CapturedOffsets``; ``spec.to(device)`` puts that
    tensor where the kernel runs).
    """

    offset: int

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "offset", check_int("offset", self.offset, minimum=None, owner="OffsetCausal")
        )
        self._set_device()

    def _make_mask_mod(self) -> MaskMod:
        offset = self._offset_tensor(self.offset)

        def offset_causal_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return kv_idx - q_idx <= offset

        return offset_causal_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        return _tril(q_len, kv_len, self.offset)

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        if true_without_guard(self.offset >= kv_len - 1):
            # Every query sees every key (a decode step's one query at the end of the cache):
            # SDPA without a mask, at any lengths. A traced step gets no guard on its offset.
            return SdpaForm(is_causal=False)
        return SdpaForm(is_causal=True) if q_len == kv_len and known_true(self.offset == 0) else None

    def hides_future_keys(self, q_len: int, kv_len: int) -> bool:
        return known_true(self.offset <= 0)

    def visible_fraction(self, q_len: int, kv_len: int) -> float:
        if not isinstance(self.offset, int):
            return 1.0
        return lower_triangle_fraction(q_len, kv_len, self.offset)

    def varlen_form(self, q_len: int, kv_len: int, batch: int) -> VarlenForm | None:
        if q_len == kv_len and known_true(self.offset == 0):
            return VarlenForm(segments=None, window=(-1, 0))
        return None

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        return band_block_map(q_len, kv_len, q_block, kv_block, device, lo=None, hi=self.offset)

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        return [cls(offset=kv_len - q_len), cls(offset=0), cls(offset=-3)]


def _tril(q_len: int, kv_len: int, offset: int) -> torch.Tensor:
    # The oracle uses tril's diagonal argument instead of comparing indices like mask_mod does.
    return torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=offset)[None, None]
