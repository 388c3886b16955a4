"""``sliding_window``: a query sees a fixed band of keys around its own position."""

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
    spec_dataclass,
    static_int,
)

from ._blocks import band_block_map, check_int


@MASKS.register
@spec_dataclass
class SlidingWindow(MaskSpec):
    """Local attention: key ``j`` is visible to query ``i`` iff ``i - left <= j <= i + right``.

    This is FlashAttention's ``window_size=(left, right)``, both ends inclusive, top-left aligned
    (absolute positions, whatever ``Lq`` and ``Lkv`` are). ``SlidingWindow(left=W - 1)`` is causal
    attention to the last ``W`` keys including the query's own position; a Hugging Face / Mistral
    config value ``sliding_window=W`` means exactly that, so build it with :meth:`from_hf`.

    Picture (``left=2, right=1``, ``Lq = Lkv = 6``; rows are queries, ``#`` visible)::

        ##....
        ###...
        ####..
        .####.
        ..####
        ...###

    Forms offered: varlen with window ``(left, right)`` when ``Lq == Lkv``; SDPA when ``Lq == Lkv``
    and the window covers the whole sequence on each side it opens (``is_causal=True`` if
    ``right == 0`` and ``left >= L - 1``, ``False`` if both are ``>= L - 1``); a closed-form block
    map for any lengths; lowest visible key ``i - left``.

    Args:
        left: keys visible before the query (``>= 0``).
        right: keys visible after the query (``>= 0``; default 0 = causal window).
    """

    left: int
    right: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "left", check_int("left", self.left, minimum=0, owner="SlidingWindow"))
        object.__setattr__(self, "right", check_int("right", self.right, minimum=0, owner="SlidingWindow"))

    @classmethod
    def from_hf(cls, sliding_window: int) -> SlidingWindow:
        """From a Hugging Face / Mistral config value ``sliding_window=W`` (W >= 1 keys, the query's
        own included, causal): ``SlidingWindow(left=W - 1, right=0)``."""
        width = check_int("sliding_window", sliding_window, minimum=1, owner="SlidingWindow.from_hf")
        return cls(left=width - 1, right=0)

    def _make_mask_mod(self) -> MaskMod:
        left, right = static_int(self.left), static_int(self.right)  # see spec.MaskSpec.mask_mod

        def sliding_window_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            # kv_idx - right, not q_idx + right: the sum could pass int32's maximum.
            return (kv_idx >= q_idx - left) & (kv_idx - right <= q_idx)

        return sliding_window_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        # Band = keep diagonals -left..right: tril then triu, not the index comparison of mask_mod.
        ones = torch.ones(q_len, kv_len, dtype=torch.bool)
        return ones.tril(diagonal=self.right).triu(diagonal=-self.left)[None, None]

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        if q_len != kv_len or self.left < q_len - 1:
            return None
        if self.right == 0:
            return SdpaForm(is_causal=True)
        return SdpaForm(is_causal=False) if self.right >= q_len - 1 else None

    def varlen_form(self, q_len: int, kv_len: int, batch: int) -> VarlenForm | None:
        return VarlenForm(segments=None, window=(self.left, self.right)) if q_len == kv_len else None

    def hides_future_keys(self, q_len: int, kv_len: int) -> bool:
        return self.right == 0

    def visible_fraction(self, q_len: int, kv_len: int) -> float:
        return min(1.0, (self.left + self.right + 1) / max(1, kv_len))

    def lowest_visible_key(self, q_idx: torch.Tensor) -> torch.Tensor | None:
        # Key i - left is inside the window whenever it exists (right >= 0): exact.
        return q_idx - self.left

    def sees_one_run(self) -> bool:
        return True  # keys i - left .. i + right

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        return band_block_map(q_len, kv_len, q_block, kv_block, device, lo=-self.left, hi=self.right)

    @classmethod
    def typical_example(cls, q_len: int, kv_len: int, batch: int, heads: int) -> Spec:
        # A local layer's window: an eighth of the sequence, causal.
        return cls(left=max(1, max(q_len, kv_len) // 8))

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        n = max(q_len, kv_len)
        return [
            cls(left=0),
            cls(left=3, right=2),
            cls.from_hf(max(1, n // 3)),
            cls(left=n // 5, right=n // 7 + 1),
            cls(left=n, right=n),
        ]
