"""``chunked``: attention restricted to fixed-size chunks of positions (Llama-4 local layers)."""

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
    block_ranges,
    spec_dataclass,
    static_int,
)

from ._blocks import check_int, sorted_label_block_map


@MASKS.register
@spec_dataclass
class Chunked(MaskSpec):
    """Chunked local attention: visible iff ``i // size == j // size``.

    Positions are cut into consecutive chunks of ``size`` (the last may be shorter) and attention
    stays inside a chunk. Llama 4's chunked attention is ``Chunked(size=8192) & Causal()``.

    Picture (``size=3``, ``Lq = Lkv = 6``; rows are queries, ``#`` visible)::

        ###...
        ###...
        ###...
        ...###
        ...###
        ...###

    Forms offered: varlen when ``Lq == Lkv`` with segments ``[size, ..., size, rest]`` and window
    ``(-1, -1)``; SDPA ``is_causal=False`` when one chunk covers everything
    (``size >= max(Lq, Lkv)``); a closed-form block map for any lengths; lowest visible key
    ``(i // size) * size``, the start of the query's chunk.

    Args:
        size: chunk length in positions (``>= 1``).
    """

    size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", check_int("size", self.size, minimum=1, owner="Chunked"))

    def _make_mask_mod(self) -> MaskMod:
        size = static_int(self.size)  # see spec.MaskSpec.mask_mod

        def chunked_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return q_idx // size == kv_idx // size

        return chunked_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        # Oracle: paint each chunk's square, instead of dividing indices like mask_mod does.
        out = torch.zeros(q_len, kv_len, dtype=torch.bool)
        for start in range(0, max(q_len, kv_len), self.size):
            out[start : start + self.size, start : start + self.size] = True
        return out[None, None]

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        return SdpaForm(is_causal=False) if self.size >= max(q_len, kv_len) else None

    def varlen_form(self, q_len: int, kv_len: int, batch: int) -> VarlenForm | None:
        if q_len != kv_len:
            return None
        # [size, ..., size, rest] by tensor ops, not a Python list: under torch.compile with
        # dynamic shapes the length is symbolic, and routes that lay the call out as equal chunks
        # read ``uniform`` alone (a guard on length % size), never these values.
        starts = torch.arange(-(-q_len // self.size), dtype=torch.int64, device="cpu") * self.size
        segments = (q_len - starts).clamp(max=self.size)
        return VarlenForm(segments=segments, window=(-1, -1), uniform=self.size)

    def lowest_visible_key(self, q_idx: torch.Tensor) -> torch.Tensor | None:
        # The first key of the query's own chunk (visible whenever it exists): exact.
        return torch.div(q_idx, self.size, rounding_mode="floor") * self.size

    def sees_one_run(self) -> bool:
        return True  # the query's own chunk

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        # Chunk numbers never decrease with position: the sorted-label rule is exact.
        q_first, q_last, q_complete = block_ranges(q_len, q_block, device)
        k_first, k_last, k_complete = block_ranges(kv_len, kv_block, device)
        s = self.size
        complete = q_complete[:, None] & k_complete[None, :]
        return sorted_label_block_map(
            (q_first // s)[None], (q_last // s)[None], (k_first // s)[None], (k_last // s)[None], complete
        )

    @classmethod
    def typical_example(cls, q_len: int, kv_len: int, batch: int, heads: int) -> Spec:
        # Four chunks per sequence.
        return cls(size=max(1, max(q_len, kv_len) // 4))

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        n = max(q_len, kv_len, 1)
        return [cls(size=1), cls(size=64), cls(size=max(1, n // 3)), cls(size=128), cls(size=n + 1)]
