"""``prefix_lm``: bidirectional attention over a prefix, causal after it."""

from __future__ import annotations

from typing import Any

import torch

from flexattn_zoo.registry import MASKS
from flexattn_zoo.spec import (
    BlockMap,
    MaskMod,
    MaskSpec,
    SdpaForm,
    Spec,
    SplitForm,
    SplitPart,
    block_ranges,
    spec_dataclass,
    static_int,
    tracing,
)

from ._blocks import check_int, complete_pairs


@MASKS.register(name="prefix_lm")
@spec_dataclass
class PrefixLM(MaskSpec):
    """Prefix-LM mask: visible iff ``j < prefix_len`` or ``j <= i``.

    Every query sees the whole prefix (keys ``0 .. prefix_len - 1``), and keys after it causally
    (top-left aligned). ``prefix_len`` is one int for every batch row, or an integer tensor ``[B]``
    with one prefix length per row (then the spec depends on the batch index).

    Picture (``prefix_len=3``, ``Lq = Lkv = 6``; rows are queries, ``#`` visible)::

        ###...
        ###...
        ###...
        ####..
        #####.
        ######

    Forms offered: a closed-form block map for any lengths; SDPA only in the degenerate int cases
    (``prefix_len >= Lkv`` is ``is_causal=False``; ``prefix_len <= 1`` with ``Lq == Lkv`` is
    ``is_causal=True``); otherwise, for an int with ``Lq == Lkv``, a split form: every query
    against the prefix keys unmasked, and queries ``prefix_len..`` against keys ``prefix_len..``
    causal (the ``sdpa_split`` route). No varlen form.

    Args:
        prefix_len: int ``>= 0``, or integer tensor ``[B]`` of values ``>= 0`` (stored as int64).
            Values ``>= Lkv`` are allowed and mean that every key is visible.
    """

    pair_loads = False  # prefix lengths are read per batch row

    prefix_len: int | torch.Tensor

    depends_on_batch = True  # class default; uses_batch() says whether this instance does

    def __post_init__(self) -> None:
        value: Any = self.prefix_len
        if not isinstance(value, torch.Tensor):
            object.__setattr__(
                self, "prefix_len", check_int("prefix_len", value, minimum=0, owner="PrefixLM")
            )
            return
        if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
            raise TypeError(
                f"PrefixLM(prefix_len=...) must be an int or an integer tensor [B], got dtype {value.dtype}"
            )
        if value.dim() != 1 or value.numel() == 0:
            raise ValueError(
                f"PrefixLM(prefix_len=...) tensor must have shape [B] with B >= 1 (use an int to share "
                f"one length), got shape {tuple(value.shape)}"
            )
        # Traced (a spec made or moved inside torch.compile), values are unknown until run.
        if not tracing() and bool((value < 0).any()):
            raise ValueError(f"PrefixLM(prefix_len=...) must be >= 0, got {value.tolist()[:8]}")
        object.__setattr__(self, "prefix_len", value.to(torch.int64))

    def uses_batch(self) -> bool:
        return isinstance(self.prefix_len, torch.Tensor)

    def _make_mask_mod(self) -> MaskMod:
        prefix = self.prefix_len
        if isinstance(prefix, torch.Tensor):

            def batched_prefix_lm_mask(
                b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
            ) -> torch.Tensor:
                return (kv_idx < prefix[b]) | (kv_idx <= q_idx)

            return batched_prefix_lm_mask

        shared = static_int(prefix)  # see spec.MaskSpec.mask_mod

        def prefix_lm_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return (kv_idx < shared) | (kv_idx <= q_idx)

        return prefix_lm_mask

    def _prefixes(self) -> list[int]:
        p = self.prefix_len
        return [int(v) for v in p.tolist()] if isinstance(p, torch.Tensor) else [p]

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        # Oracle: a causal triangle with the prefix columns painted in, row by row.
        causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril()
        rows = []
        for p in self._prefixes():
            m = causal.clone()
            m[:, :p] = True
            rows.append(m)
        out = torch.stack(rows)[:, None]
        return out.to(self.prefix_len.device) if isinstance(self.prefix_len, torch.Tensor) else out

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        p = self.prefix_len
        if isinstance(p, torch.Tensor) and p.numel() != batch:
            raise ValueError(
                f"PrefixLM(prefix_len=...) tensor has {p.numel()} entries but the batch size is {batch}; "
                "pass one prefix length per batch row, or an int"
            )

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        p = self.prefix_len
        if isinstance(p, torch.Tensor):
            return None
        if p >= kv_len:
            return SdpaForm(is_causal=False)
        # Key 0 is always visible causally, so a prefix of 1 adds nothing.
        return SdpaForm(is_causal=True) if p <= 1 and q_len == kv_len else None

    def split_form(self, q_len: int, kv_len: int) -> SplitForm | None:
        p = self.prefix_len
        if isinstance(p, torch.Tensor) or q_len != kv_len or self.sdpa_form(q_len, kv_len) is not None:
            return None
        # Rows i < p see exactly keys [0, p) (j <= i adds nothing there); rows i >= p see [0, p)
        # and, causally, [p, i]: two parts with disjoint keys, the first covering every row.
        return SplitForm(
            parts=(
                SplitPart(q=(0, q_len), kv=(0, p), is_causal=False),
                SplitPart(q=(p, q_len), kv=(p, kv_len), is_causal=True),
            )
        )

    def sees_one_run(self) -> bool:
        return True  # keys 0 .. max(i, prefix_len - 1), in every batch row

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        q_first, q_last, _ = block_ranges(q_len, q_block, device)
        k_first, k_last, _ = block_ranges(kv_len, kv_block, device)
        complete = complete_pairs(q_len, kv_len, q_block, kv_block, device)
        # Some (i, j) visible: the pair's smallest key is in the prefix, or lies at or before its
        # last query. All visible: every key past the prefix lies at or before the first query,
        # and the largest key decides both (if it is in the prefix, all are).
        any_ = k_first[None, :] <= q_last[:, None]
        full = k_last[None, :] <= q_first[:, None]
        p = self.prefix_len
        if isinstance(p, torch.Tensor):
            col = p.to(device)[:, None, None]  # one prefix per batch row: [B, 1, 1]
            any_ = (k_first[None, None, :] < col) | any_
            full = (k_last[None, None, :] < col) | full
        else:
            any_ |= (k_first < p)[None, :]
            full |= (k_last < p)[None, :]
        full &= complete
        rows = any_.shape[0] if any_.dim() == 3 else 1  # explicit: -1 cannot be inferred at 0 blocks
        return BlockMap(any=any_.view(rows, 1, *any_.shape[-2:]), full=full.view(rows, 1, *full.shape[-2:]))

    @classmethod
    def typical_example(cls, q_len: int, kv_len: int, batch: int, heads: int) -> Spec:
        # A prompt of a quarter of the keys.
        return cls(prefix_len=max(1, kv_len // 4))

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        per_row = torch.tensor([(37 * r + kv_len // 2) % (kv_len + 2) for r in range(batch)])
        return [
            cls(prefix_len=0),
            cls(prefix_len=max(1, kv_len // 3)),
            cls(prefix_len=kv_len + 5),
            cls(prefix_len=per_row),
        ]
