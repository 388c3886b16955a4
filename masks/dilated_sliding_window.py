"""``dilated_sliding_window``: a sliding window that keeps every ``dilation``-th key (Longformer)."""

from __future__ import annotations

import torch

from flexattn_zoo.registry import MASKS
from flexattn_zoo.spec import (
    BlockMap,
    MaskMod,
    MaskSpec,
    SdpaForm,
    Spec,
    StridedForm,
    VarlenForm,
    block_ranges,
    spec_dataclass,
    static_int,
)

from ._blocks import check_int
from .sliding_window import SlidingWindow


@MASKS.register
@spec_dataclass
class DilatedSlidingWindow(MaskSpec):
    """Dilated window: visible iff ``-left <= j - i <= right`` and ``(j - i) % dilation == 0``.

    The window of :class:`SlidingWindow` (both ends inclusive, in positions, absolute and top-left
    aligned), of which only the keys a multiple of ``dilation`` away from the query are kept, the
    query's own position always among them. Longformer's dilated windows; ``dilation=1`` is
    exactly ``SlidingWindow(left=left, right=right)``.

    Picture (``left=4, right=2, dilation=2``, ``Lq = Lkv = 8``; rows are queries, ``#`` visible)::

        #.#.....
        .#.#....
        #.#.#...
        .#.#.#..
        #.#.#.#.
        .#.#.#.#
        ..#.#.#.
        ...#.#.#

    Convention next to attention-gym's: ``generate_dilated_sliding_window(window_size=w,
    dilation=d)`` keeps ``|i - j| <= w`` and ``|i - j| % d == 0``, which is
    ``DilatedSlidingWindow(left=w, right=w, dilation=d)``. Here the two sides are separate (a
    causal dilated window is ``right=0``), and like theirs ``left`` / ``right`` count positions,
    not kept keys: ``left=4, dilation=2`` reaches back two kept keys.

    Forms offered: everything :class:`SlidingWindow` offers when ``dilation == 1`` (varlen, SDPA
    in the full-window cases) and when no other key than the query's own survives
    (``left, right < dilation``: the diagonal, as ``SlidingWindow(left=0)``); otherwise, for
    ``Lq == Lkv``, a strided form: each residue class of positions mod ``dilation`` is a plain
    window of ``left // dilation`` / ``right // dilation`` kept keys, which FlashAttention-4's
    windowed kernels run as ``dilation`` times as many heads of ``L / dilation`` positions (route
    ``fa4``, when ``L`` is a multiple of the dilation), and SDPA's kernels too when that window
    spans each class (``left >= L - dilation``; ``right`` too, or ``right < dilation``); a
    closed-form block map for any lengths; lowest visible key ``i - left`` for ``dilation == 1``
    and ``i`` when ``left < dilation`` (otherwise none: early rows' lowest key ``i % dilation``
    falls at every multiple of the dilation, and a bound must never decrease).

    Args:
        left: reach before the query, in positions (``>= 0``).
        right: reach after the query, in positions (``>= 0``; default 0: causal).
        dilation: stride between kept keys (``>= 1``).
    """

    left: int
    right: int = 0
    dilation: int = 1

    def __post_init__(self) -> None:
        owner = "DilatedSlidingWindow"
        object.__setattr__(self, "left", check_int("left", self.left, minimum=0, owner=owner))
        object.__setattr__(self, "right", check_int("right", self.right, minimum=0, owner=owner))
        object.__setattr__(self, "dilation", check_int("dilation", self.dilation, minimum=1, owner=owner))

    def _plain(self) -> SlidingWindow | None:
        """The undilated window this spec equals, if any (dilation 1, or only the diagonal kept)."""
        d = self.dilation
        if d == 1:
            return SlidingWindow(left=self.left, right=self.right)
        if self.left < d and self.right < d:
            return SlidingWindow(left=0)
        return None

    def _make_mask_mod(self) -> MaskMod:
        left, right, d = static_int(self.left), static_int(self.right), static_int(self.dilation)

        def dilated_sliding_window_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            # As SlidingWindow: kv_idx - right, not q_idx + right (int32 overflow).
            in_window = (kv_idx >= q_idx - left) & (kv_idx - right <= q_idx)
            return in_window & ((kv_idx - q_idx) % d == 0)

        return dilated_sliding_window_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        # Oracle: paint each row's kept keys by a strided slice, walking outwards from the query.
        out = torch.zeros(q_len, kv_len, dtype=torch.bool)
        reach_back = self.left - self.left % self.dilation  # farthest kept key before the query
        for i in range(q_len):
            first = max(i - reach_back, i % self.dilation)
            out[i, first : min(kv_len, i + self.right + 1) : self.dilation] = True
        return out[None, None]

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        plain = self._plain()
        return None if plain is None else plain.sdpa_form(q_len, kv_len)

    def varlen_form(self, q_len: int, kv_len: int, batch: int) -> VarlenForm | None:
        plain = self._plain()
        return None if plain is None else plain.varlen_form(q_len, kv_len, batch)

    def strided_form(self, q_len: int, kv_len: int) -> StridedForm | None:
        # Kept pairs share their position mod the dilation; in that class's own positions
        # (position // dilation) the window reaches left // dilation back, right // dilation ahead.
        if q_len != kv_len or self._plain() is not None:
            return None  # the plain window's varlen form serves those
        d = self.dilation
        return StridedForm(stride=d, window=(self.left // d, self.right // d))

    def hides_future_keys(self, q_len: int, kv_len: int) -> bool:
        return self.right < self.dilation  # the first kept key after the query is `dilation` away

    def lowest_visible_key(self, q_idx: torch.Tensor) -> torch.Tensor | None:
        if self.dilation == 1:
            return q_idx - self.left  # SlidingWindow's exact bound
        if self.left < self.dilation:
            return q_idx.clone()  # no kept key before the query: it is its own lowest key
        # The lowest key is max(i - left rounded to the stride, i % dilation): the second term
        # drops at every multiple of the dilation, and a bound must never decrease.
        return None

    # No visible_fraction bound (the base's 1.0): at the bound, (left + right) // dilation + 1 keys
    # per query, an 8K problem falls under the dispatcher's short-problem rule, which puts Triton
    # flex first, and its forward+backward measured 1.8x slower than flex_flash's on the H200
    # (benchmarks/results/zoo_h200.json). The rule needs a mask-aware threshold first.

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        # In a block pair j - i takes every integer of [k_first - q_last, k_last - q_first]; clip
        # it to the window [-left, right]. Some pair is visible iff the clipped interval holds a
        # multiple of the dilation; all are iff the window holds the whole interval and that
        # interval is one value (a single query and key), a multiple of it -- or the dilation is 1.
        q_first, q_last, q_complete = block_ranges(q_len, q_block, device)
        k_first, k_last, k_complete = block_ranges(kv_len, kv_block, device)
        d = self.dilation
        lo = torch.clamp(k_first[None, :] - q_last[:, None], min=-self.left)
        hi = torch.clamp(k_last[None, :] - q_first[:, None], max=self.right)
        any_ = torch.div(hi, d, rounding_mode="floor") * d >= lo
        inside = (k_first[None, :] - q_last[:, None] >= -self.left) & (
            k_last[None, :] - q_first[:, None] <= self.right
        )
        full = inside & q_complete[:, None] & k_complete[None, :]
        if d > 1:
            full &= (lo == hi) & (lo % d == 0)
        return BlockMap(any=any_[None, None], full=full[None, None])

    @classmethod
    def typical_example(cls, q_len: int, kv_len: int, batch: int, heads: int) -> Spec:
        # A causal window of a quarter of the sequence, every second key.
        return cls(left=max(2, max(q_len, kv_len) // 4), dilation=2)

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        n = max(q_len, kv_len)
        return [
            cls(left=4, right=2, dilation=2),
            cls(left=n // 5, dilation=3),
            cls(left=n // 3, right=n // 4 + 1, dilation=5),
            cls(left=n, right=n, dilation=2),
        ]
