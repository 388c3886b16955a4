"""``full``: every query sees every key."""

from __future__ import annotations

import torch

from flexattn_zoo.registry import MASKS
from flexattn_zoo.spec import BlockMap, MaskMod, MaskSpec, SdpaForm, Spec, VarlenForm, spec_dataclass

from ._blocks import band_block_map


@MASKS.register
@spec_dataclass
class Full(MaskSpec):
    """No masking: key ``j`` is visible to query ``i`` for every ``i`` and ``j``.

    Picture (``Lq = Lkv = 6``; rows are queries, columns keys, ``#`` visible)::

        ######
        ######
        ######
        ######
        ######
        ######

    Forms offered: SDPA with ``is_causal=False`` for any lengths; varlen with one segment per row
    and window ``(-1, -1)`` when ``Lq == Lkv``; a closed-form block map (every block full, except
    trailing incomplete blocks, which are partial).
    """

    def _make_mask_mod(self) -> MaskMod:
        def full_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            # Indices are never negative; comparing both keeps the broadcast shape of (q, kv).
            return (q_idx >= 0) & (kv_idx >= 0)

        return full_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        return torch.ones(1, 1, q_len, kv_len, dtype=torch.bool)

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        return SdpaForm(is_causal=False)

    def varlen_form(self, q_len: int, kv_len: int, batch: int) -> VarlenForm | None:
        return VarlenForm(segments=None, window=(-1, -1)) if q_len == kv_len else None

    def sees_one_run(self) -> bool:
        return True  # every key

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        return band_block_map(q_len, kv_len, q_block, kv_block, device, lo=None, hi=None)

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        return [cls()]
