"""``Band``: a diagonal band at any offset from the main diagonal (decoding, model adapters)."""

from __future__ import annotations

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
    spec_dataclass,
    true_without_guard,
)

from ._blocks import CapturedOffsets, band_block_map, check_int


@MASKS.register
@spec_dataclass
class Band(CapturedOffsets, MaskSpec):
    """Key ``j`` is visible to query ``i`` iff ``lo <= j - i <= hi`` (``None``: unbounded that side).

    The general form behind the causal and sliding-window masks, with the diagonal allowed to sit
    anywhere: ``Band(hi=0)`` is ``Causal()``, ``Band(lo=-(W - 1), hi=0)`` is
    ``SlidingWindow.from_hf(W)``, ``Band(hi=d)`` is ``OffsetCausal(offset=d)``. What it adds is a
    window whose *both* ends are shifted, e.g. a sliding window of ``W`` keys for ``Lq`` new queries
    at the end of ``Lkv`` cached keys (``d = Lkv - Lq``): ``Band(lo=d - (W - 1), hi=d)``, which
    ``SlidingWindow`` (``left, right >= 0``) cannot say once ``d > W - 1``.

    Picture (``lo=1, hi=2``, ``Lq = 4``, ``Lkv = 6``; rows are queries, ``#`` visible)::

        .##...
        ..##..
        ...##.
        ....##

    Registered as ``band`` (``flexattn_zoo.hf`` and ``flexattn_zoo.models.decode`` build it too; most
    users write ``Causal``/``SlidingWindow``). Forms offered: varlen window ``(-lo, hi)`` when
    ``Lq == Lkv`` and ``lo <= 0 <= hi``; SDPA causal when ``Lq == Lkv``, ``hi == 0`` and the lower
    end is out of reach; SDPA without a mask, at any lengths, when the band covers every pair
    (``lo <= -(Lq - 1)`` and ``hi >= Lkv - 1``: a decode step inside the window); a closed-form
    block map for any lengths; lowest visible key ``i + lo`` when ``lo`` is given. The
    ``mask_mod`` reads ``lo``/``hi`` from captured 0-d tensors (not Python constants), so bands
    moving with a decode step share one compiled kernel.

    Args:
        lo: smallest visible ``j - i`` (``None``: no lower end).
        hi: largest visible ``j - i`` (``None``: no upper end).
    """

    lo: int | None = None
    hi: int | None = None

    def __post_init__(self) -> None:
        for name in ("lo", "hi"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, check_int(name, value, minimum=None, owner="Band"))
        self._set_device()

    def _make_mask_mod(self) -> MaskMod:
        # lo and hi move with a decode step's offset: captured tensors, so every band of one
        # shape (which ends are None) shares one compiled kernel (see CapturedOffsets).
        lo = None if self.lo is None else self._offset_tensor(self.lo)
        hi = None if self.hi is None else self._offset_tensor(self.hi)

        def band_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            diff = kv_idx - q_idx
            out = diff == diff  # all True, with the broadcast shape of the indices
            if lo is not None:
                out = out & (diff >= lo)
            if hi is not None:
                out = out & (diff <= hi)
            return out

        return band_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        # Oracle: keep diagonals lo..hi with tril/triu instead of comparing indices.
        out = torch.ones(q_len, kv_len, dtype=torch.bool)
        if self.hi is not None:
            out = out.tril(diagonal=self.hi)
        if self.lo is not None:
            out = out.triu(diagonal=self.lo)
        return out[None, None]

    # Offsets may be data-dependent while a compiled decode step traces (a cache position read
    # from a tensor): forms are offered only where the offsets are known to allow them.
    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        if q_len != kv_len:
            # SDPA without a mask where the band hides nothing (a decode step inside the window);
            # a traced step gets no guard on its offsets.
            if (self.lo is None or true_without_guard(self.lo <= -(q_len - 1))) and (
                self.hi is None or true_without_guard(self.hi >= kv_len - 1)
            ):
                return SdpaForm(is_causal=False)
            return None
        if self.lo is not None and not known_true(self.lo <= -(q_len - 1)):
            return None
        if self.hi is None or known_true(self.hi >= kv_len - 1):
            return SdpaForm(is_causal=False)
        return SdpaForm(is_causal=True) if known_true(self.hi == 0) else None

    def varlen_form(self, q_len: int, kv_len: int, batch: int) -> VarlenForm | None:
        if q_len != kv_len:
            return None
        if (self.lo is not None and not known_true(self.lo <= 0)) or (
            self.hi is not None and not known_true(self.hi >= 0)
        ):
            return None
        left = -1 if self.lo is None else -self.lo
        right = -1 if self.hi is None else self.hi
        return VarlenForm(segments=None, window=(left, right))

    def hides_future_keys(self, q_len: int, kv_len: int) -> bool:
        return self.hi is not None and known_true(self.hi <= 0)

    def lowest_visible_key(self, q_idx: torch.Tensor) -> torch.Tensor | None:
        # Key i + lo is in the band whenever the band is not empty (lo <= hi): exact.
        return None if self.lo is None else q_idx + self.lo

    def sees_one_run(self) -> bool:
        # Keys i + lo .. i + hi: one run, holding i when lo <= 0 <= hi.
        return (self.lo is None or known_true(self.lo <= 0)) and (self.hi is None or known_true(self.hi >= 0))

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        bmap = band_block_map(q_len, kv_len, q_block, kv_block, device, lo=self.lo, hi=self.hi)
        if self.lo is not None and self.hi is not None and known_true(self.lo > self.hi):
            # Empty band: the interval test above would still mark blocks that straddle it.
            return BlockMap(any=torch.zeros_like(bmap.any), full=torch.zeros_like(bmap.full))
        return bmap

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        d = kv_len - q_len
        return [cls(hi=d), cls(lo=d - 3, hi=d), cls(lo=1, hi=2), cls(lo=-2), cls(lo=5, hi=3), cls()]
