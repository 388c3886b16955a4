"""``global_window``: a sliding window plus global tokens (Longformer, BigBird's global part)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from flexattn_zoo._compat import outside_inference_mode
from flexattn_zoo.registry import MASKS
from flexattn_zoo.spec import (
    GLOBAL_FORM_MAX_TOKENS,
    BlockMap,
    GlobalTokensForm,
    MaskMod,
    MaskSpec,
    Spec,
    VarlenForm,
    spec_dataclass,
    static_int,
    tracing,
)

from ._blocks import band_block_map, check_int, complete_pairs
from .document import _int_vector

#: Lengths whose global positions a ``GlobalWindow`` keeps (a model calls few lengths; reading
#: them from the flags syncs with the device once per length).
_POSITIONS_KEPT = 8


@MASKS.register
@spec_dataclass
class GlobalWindow(MaskSpec):
    """Sliding window plus global tokens: visible iff ``i - left <= j <= i + right``, or ``i`` is a
    global position, or ``j`` is one.

    Global tokens see every key and are seen by every query (Longformer's global attention on
    ``[CLS]`` or question tokens, BigBird's global tokens); every other pair follows the window of
    :class:`SlidingWindow` (both ends inclusive, absolute positions). ``is_global`` flags the global
    positions: a bool tensor ``[L]`` shared by every batch row, or ``[B, L]`` per row (Hugging Face
    Longformer's ``global_attention_mask``), with ``L >= max(Lq, Lkv)``; queries and keys index the
    same flags. Longformer's ``attention_window=w`` is ``left=right=w // 2``; attention-gym's
    ``generate_global_sliding_window(window_size=w, is_global)`` (``|i - j| <= w``) is
    ``GlobalWindow(is_global, left=w, right=w)``.

    Picture (``left=1, right=1``, global position 2, ``Lq = Lkv = 7``; ``#`` visible)::

        ###....
        ###....
        #######
        ..###..
        ..####.
        ..#.###
        ..#..##

    Forms offered: a closed-form block map for any lengths (the window's interval rule, or'ed with
    the blocks holding a global query or key; a block pair is full when every non-global query and
    non-global key of it fall in the window, read off the extreme non-global positions of each
    block). With ``[L]`` flags and ``Lq == Lkv``: a global-tokens form (the window, plus the global
    positions) for 1 to ``spec.GLOBAL_FORM_MAX_TOKENS`` global positions, which FlashAttention-4's
    windowed kernel runs; a plain window's varlen form when no position is global. Neither while
    ``torch.compile`` traces (the positions are data). No SDPA form; no lowest visible key (a
    global key may sit anywhere below).

    Args:
        is_global: bool tensor ``[L]`` or ``[B, L]`` (0/1 integers are converted); see
            :meth:`from_positions` for a list of positions.
        left: keys visible before the query (``>= 0``).
        right: keys visible after the query (``>= 0``; default 0).
    """

    pair_loads = False  # global flags are read per query and per key

    is_global: torch.Tensor
    left: int
    right: int = 0

    depends_on_batch = True  # class default; uses_batch() says whether this instance does

    def __post_init__(self) -> None:
        flags: Any = self.is_global
        if not isinstance(flags, torch.Tensor):
            try:
                flags = torch.as_tensor(flags)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise TypeError(
                    f"GlobalWindow(is_global=...) must be a bool tensor [L] or [B, L]: {exc}"
                ) from exc
        if flags.is_floating_point() or flags.is_complex():
            raise TypeError(
                f"GlobalWindow(is_global=...) must be bool or 0/1 integers, got dtype {flags.dtype}"
            )
        if flags.dim() not in (1, 2) or flags.numel() == 0:
            raise ValueError(
                f"GlobalWindow(is_global=...) must have shape [L] or [B, L] with L, B >= 1, got {tuple(flags.shape)}"
            )
        if flags.dtype != torch.bool:
            # Only 0/1: Hugging Face Longformer's attention_mask (0 padding, 1 local, 2 global)
            # passed here by mistake would otherwise make every non-padding token global.
            if not tracing() and bool(((flags != 0) & (flags != 1)).any()):
                raise ValueError(
                    "GlobalWindow(is_global=...) takes bool or 0/1 integer flags, got values "
                    f"{sorted(set(flags.unique().tolist()))[:8]}; for a Longformer attention_mask "
                    "(1 local, 2 global) pass is_global=attention_mask == 2"
                )
            flags = flags != 0
        object.__setattr__(self, "is_global", flags)
        object.__setattr__(self, "left", check_int("left", self.left, minimum=0, owner="GlobalWindow"))
        object.__setattr__(self, "right", check_int("right", self.right, minimum=0, owner="GlobalWindow"))

    @classmethod
    def from_positions(
        cls,
        positions: Sequence[int] | torch.Tensor,
        length: int,
        left: int,
        right: int = 0,
        *,
        device: torch.device | str | None = None,
    ) -> GlobalWindow:
        """Global tokens at ``positions`` (e.g. ``[0]`` for a ``[CLS]`` token) of sequences of
        ``length`` tokens, shared by every batch row."""
        n = check_int("length", length, minimum=1, owner="GlobalWindow.from_positions")
        # Checked as integers, not cast: a cast would truncate 2.5 to position 2.
        where = _int_vector(positions, "GlobalWindow.from_positions(positions=...)")
        if bool(((where < 0) | (where >= n)).any()):
            raise ValueError(
                f"GlobalWindow.from_positions(positions=...) must lie in [0, {n}), got {where.tolist()[:8]}"
            )
        flags = torch.zeros(n, dtype=torch.bool, device="cpu")
        flags[where] = True
        return cls(is_global=flags.to(device), left=left, right=right)

    def uses_batch(self) -> bool:
        return self.is_global.dim() == 2

    def _make_mask_mod(self) -> MaskMod:
        flags = self.is_global
        left, right = static_int(self.left), static_int(self.right)
        if flags.dim() == 1:

            def global_window_mask(
                b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
            ) -> torch.Tensor:
                in_window = (kv_idx >= q_idx - left) & (kv_idx - right <= q_idx)
                return in_window | flags[q_idx] | flags[kv_idx]

            return global_window_mask

        def batched_global_window_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            in_window = (kv_idx >= q_idx - left) & (kv_idx - right <= q_idx)
            return in_window | flags[b, q_idx] | flags[b, kv_idx]

        return batched_global_window_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        self._check_length(max(q_len, kv_len))
        # Oracle: the window's band from tril/triu, then the global rows and columns painted in
        # through the list of global positions of each row.
        band = torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=self.right).triu(diagonal=-self.left)
        rows = self.is_global.cpu().view(-1, self.is_global.shape[-1])
        out = band.repeat(rows.shape[0], 1, 1)
        for r, flags in enumerate(rows):
            for p in torch.nonzero(flags).flatten().tolist():
                if p < q_len:
                    out[r, p, :] = True
                if p < kv_len:
                    out[r, :, p] = True
        return out[:, None]

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        self._check_length(max(q_len, kv_len))
        if self.is_global.dim() == 2 and self.is_global.shape[0] != batch:
            raise ValueError(
                f"GlobalWindow(is_global=...) has {self.is_global.shape[0]} rows but the batch size is "
                f"{batch}; pass [L] flags to share them across the batch, or one row per batch element"
            )

    def global_tokens_form(self, q_len: int, kv_len: int) -> GlobalTokensForm | None:
        positions = self._shared_positions(q_len, kv_len)
        if positions is None or not 1 <= positions.numel() <= GLOBAL_FORM_MAX_TOKENS:
            return None
        return GlobalTokensForm(positions=positions, window=(self.left, self.right))

    def varlen_form(self, q_len: int, kv_len: int, batch: int) -> VarlenForm | None:
        positions = self._shared_positions(q_len, kv_len)
        if positions is None or positions.numel():
            return None
        return VarlenForm(segments=None, window=(self.left, self.right))  # no global token: a window

    def _shared_positions(self, q_len: int, kv_len: int) -> torch.Tensor | None:
        """The global positions below ``L`` (int64, ascending, on the flags' device) when the flags
        are shared by every row and ``Lq == Lkv == L``, else None; found once per length."""
        if tracing() or q_len != kv_len or self.is_global.dim() != 1:
            return None
        self._check_length(q_len)
        found = self.__dict__.setdefault("_positions", {})
        positions = found.get(q_len)
        if positions is None:
            # Kept beyond the call: a normal tensor even when first asked under inference_mode.
            flags = self.is_global[:q_len]
            positions = outside_inference_mode(lambda: torch.nonzero(flags).flatten())
            if len(found) >= _POSITIONS_KEPT:
                del found[next(iter(found))]  # the oldest length
            found[q_len] = positions
        return positions

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        if tracing():
            return None  # the flags are data (see spec.tracing)
        self._check_length(max(q_len, kv_len))
        band = band_block_map(q_len, kv_len, q_block, kv_block, device, lo=-self.left, hi=self.right)
        rows = self.is_global.view(-1, self.is_global.shape[-1]).to(device)
        q_any, q_all, q_min, q_max = _block_flags(rows[:, :q_len], q_block)
        k_any, k_all, k_min, k_max = _block_flags(rows[:, :kv_len], kv_block)
        # Some pair visible: some pair in the window (interval rule), or a global query or key.
        any_ = band.any[0] | q_any[:, :, None] | k_any[:, None, :]
        # Every pair visible: all queries or all keys global, or else every pair of a non-global
        # query and a non-global key in the window; for a band that is decided by the extremes.
        in_window = (k_max[:, None, :] - q_min[:, :, None] <= self.right) & (
            k_min[:, None, :] - q_max[:, :, None] >= -self.left
        )
        full = (q_all[:, :, None] | k_all[:, None, :] | in_window) & complete_pairs(
            q_len, kv_len, q_block, kv_block, device
        )
        return BlockMap(any=any_[:, None], full=full[:, None])

    @classmethod
    def typical_example(cls, q_len: int, kv_len: int, batch: int, heads: int) -> Spec:
        # A [CLS] token and a window of an eighth of the sequence (a sixteenth on each side).
        n = max(q_len, kv_len, 1)
        w = max(1, n // 16)
        return cls.from_positions([0], n, left=w, right=w)

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        n = max(q_len, kv_len, 1)
        gen = torch.Generator().manual_seed(4099 * n + batch)
        out: list[Spec] = [
            cls.from_positions([0], n, left=4, right=4),  # a [CLS] token
            cls.from_positions(sorted({n // 3, min(n - 1, n // 3 + 1), n - 1}), n, left=n // 6, right=0),
            cls(is_global=torch.rand(n, generator=gen) < 0.05, left=2, right=n // 9),
        ]
        if batch > 1:
            out.append(cls(is_global=torch.rand(batch, n, generator=gen) < 0.03, left=n // 5, right=n // 5))
        return out

    def _check_length(self, needed: int) -> None:
        if self.is_global.shape[-1] < needed:
            raise ValueError(
                f"GlobalWindow(is_global=...) has length {self.is_global.shape[-1]} but the problem needs "
                f"at least max(Lq, Lkv) = {needed}"
            )


def _block_flags(
    flags: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block of ``flags`` (``[R, n]``): whether it holds a global position, whether all its
    positions are global, and its smallest and largest non-global position (``+-2**40`` sentinels
    when it has none, which make the window test pass: no non-global pair to check)."""
    rows, n = flags.shape
    n_blocks = -(-n // block)
    pad = n_blocks * block - n
    # Padding counts as global here: it is no position, so no pair with it needs to be visible.
    tiles = torch.nn.functional.pad(flags, (0, pad), value=True).view(rows, n_blocks, block)
    real = torch.arange(n_blocks * block, device=flags.device).view(n_blocks, block) < n
    pos = torch.arange(n_blocks * block, device=flags.device, dtype=torch.int64).view(1, n_blocks, block)
    big = 2**40
    lowest = torch.where(tiles, big, pos).amin(dim=-1)
    highest = torch.where(tiles, -big, pos).amax(dim=-1)
    return (tiles & real).any(dim=-1), tiles.all(dim=-1), lowest, highest
