"""``Dense``: a materialised boolean mask tensor (SDPA's ``attn_mask``) as a mask spec.

The helpers here (shape checks, broadcast indexing, block reductions) are shared with
``score_mods.Bias``, the float (additive) counterpart.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flexattn_zoo.registry import MASKS
from flexattn_zoo.spec import BlockMap, MaskMod, MaskSpec, SdpaForm, Spec, spec_dataclass, tracing


def as_4d_tensor(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` (``[Lq, Lkv]`` or ``[B|1, H|1, Lq|1, Lkv|1]``) as a 4-D view.

    3-D tensors are refused: SDPA broadcasts ``[X, Lq, Lkv]`` as ``[H, Lq, Lkv]`` (right-aligned),
    other libraries mean ``[B, Lq, Lkv]``; add the missing dim yourself (``t[:, None]`` for batch).
    """
    if t.dim() == 2:
        return t[None, None]
    if t.dim() == 4:
        return t
    if t.dim() == 3:
        raise ValueError(
            f"{what} is 3-D {tuple(t.shape)}, which is ambiguous (SDPA broadcasts it as [H, Lq, Lkv], "
            "others mean [B, Lq, Lkv]); pass [Lq, Lkv] or 4-D [B|1, H|1, Lq|1, Lkv|1] "
            "(e.g. t[:, None] for a per-batch mask)"
        )
    raise ValueError(
        f"{what} must be 2-D [Lq, Lkv] or 4-D [B|1, H|1, Lq|1, Lkv|1], got shape {tuple(t.shape)}"
    )


def collapse_broadcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every expanded (stride-0) dim of size > 1 narrowed to size 1: a mask given as
    ``m.expand(B, H, L, L)`` is held (and copied by the spec) at ``m``'s own size."""
    for d in range(t.dim()):
        if t.shape[d] > 1 and t.stride(d) == 0:
            t = t.narrow(d, 0, 1)
    return t


def check_broadcast(t: torch.Tensor, what: str, q_len: int, kv_len: int, batch: int, heads: int) -> None:
    """``ValueError`` unless the 4-D ``t`` broadcasts to ``[batch, heads, q_len, kv_len]``."""
    b, h, lq, lkv = t.shape
    if b not in (1, batch) or h not in (1, heads) or lq not in (1, q_len) or lkv not in (1, kv_len):
        raise ValueError(
            f"{what} has shape {tuple(t.shape)}; need one broadcastable to "
            f"[{batch}|1, {heads}|1, {q_len}|1, {kv_len}|1] (B, H, Lq, Lkv)"
        )


def broadcast_indexer(
    t: torch.Tensor,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``f(b, h, q_idx, kv_idx) -> t[b, h, q_idx, kv_idx]`` for the 4-D ``t``, with its broadcast
    (size-1) dims taken as 0. Works on flex's scalar indices and on the dense route's broadcast
    index grids alike.

    The size-1 dims are dropped from a view of ``t`` and only the other indices are used, so the
    load has no constant index unless every dim is 1: FlashAttention-4's CuTe code generator
    (torch 2.11) cannot load a tensor at a constant index, nor lower ``minimum`` (a clamp). A spec
    whose table may have one element says so (``reads_scalar_tensors``)."""
    keep = tuple(d for d, n in enumerate(t.shape) if n != 1)
    view = t.reshape(tuple(t.shape[d] for d in keep))  # a view: only size-1 dims go

    def index(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        every = (b, h, q_idx, kv_idx)
        return view[tuple(every[d] for d in keep)] if keep else view  # [1, 1, 1, 1]: one value

    return index


def _reduce_blocks(t: torch.Tensor, dim: int, length: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(any, all)`` of the bool ``t`` over blocks of ``block`` positions along ``dim`` (size
    ``length``, or 1 when broadcast). A trailing incomplete block is never "all" (positions past
    ``length`` count as masked, as in ``create_block_mask``). Views and reductions only: nothing
    of ``t``'s size is copied."""
    n = -(-length // block)
    whole = length // block
    complete = torch.arange(n, device=t.device) < whole
    shape = [1] * t.dim()
    shape[dim] = n
    complete = complete.view(shape)
    if t.shape[dim] == 1:  # broadcast: every block holds the same (valid) positions
        sizes = list(t.shape)
        sizes[dim] = n
        return t.expand(sizes), t.expand(sizes) & complete
    parts_any, parts_all = [], []
    if whole:
        tiles = t.narrow(dim, 0, whole * block).unflatten(dim, (whole, block))
        parts_any.append(tiles.any(dim + 1))
        parts_all.append(tiles.all(dim + 1))
    if whole < n:
        tail = t.narrow(dim, whole * block, length - whole * block)
        parts_any.append(tail.any(dim, keepdim=True))
        parts_all.append(torch.zeros_like(parts_any[-1]))
    return torch.cat(parts_any, dim), torch.cat(parts_all, dim) & complete


def bool_block_map(t: torch.Tensor, q_len: int, kv_len: int, q_block: int, kv_block: int) -> BlockMap:
    """The exact :class:`BlockMap` of the 4-D bool ``t`` (broadcast dims allowed), computed by block
    reductions on ``t``'s device: first over key blocks, then over query blocks."""
    any_k, all_k = _reduce_blocks(t, 3, kv_len, kv_block)
    any_, _ = _reduce_blocks(any_k, 2, q_len, q_block)
    _, full = _reduce_blocks(all_k, 2, q_len, q_block)
    return BlockMap(any=any_.contiguous(), full=(full & any_).contiguous())


@MASKS.register
@spec_dataclass
class Dense(MaskSpec):
    """Key ``j`` is visible to query ``i`` of batch row ``b``, head ``h`` iff ``mask[b, h, i, j]``
    (True = attend: SDPA's boolean ``attn_mask`` convention).

    ``mask`` is a bool tensor ``[Lq, Lkv]`` or ``[B|1, H|1, Lq|1, Lkv|1]``; size-1 dims broadcast
    (``[B, 1, 1, Lkv]`` is a key-padding mask). 3-D masks are refused as ambiguous. Expanded
    (stride-0) dims are kept at size 1, so ``m.expand(B, H, L, L)`` costs no copy of that size.
    ``fz.attention(mask=t)`` with a bool tensor ``t`` builds this spec (a copy of ``t`` per call:
    build ``Dense(mask=t)`` once to reuse it and everything cached for it).

    Picture (``mask = [[1, 0, 1], [0, 1, 0]]``; ``#`` visible)::

        #.#
        .#.

    Forms offered: SDPA's ``attn_mask`` (``SdpaForm.attn_mask``), an exact block map computed by
    block reductions on the mask's device, and a ``mask_mod`` that indexes the tensor (flex, dense).
    Registered as ``dense`` (it takes a tensor from the data, like ``KeyPadding``).
    """

    mask: torch.Tensor

    depends_on_batch = True
    depends_on_head = True

    def __post_init__(self) -> None:
        mask = self.mask
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"Dense(mask=...) must be a bool tensor, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            hint = (
                " (a float tensor is an additive mask: score_mods.Bias)" if mask.is_floating_point() else ""
            )
            raise TypeError(
                f"Dense(mask=...) must be a bool tensor (True = attend), got dtype {mask.dtype}{hint}"
            )
        mask = collapse_broadcast(as_4d_tensor(mask, "Dense(mask=...)"))
        # An empty mask (a batch or length of 0) is valid where it broadcasts (``validate``), as
        # SDPA's ``attn_mask`` is: the call it fits is an empty problem, with nothing to mask.
        object.__setattr__(self, "mask", mask)

    def uses_batch(self) -> bool:
        return self.mask.shape[0] > 1

    def uses_head(self) -> bool:
        return self.mask.shape[1] > 1

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        check_broadcast(self.mask, "Dense(mask=...)", q_len, kv_len, batch, heads)

    def reads_scalar_tensors(self) -> bool:
        return self.mask.numel() == 1  # every dim broadcast: one value, loaded at a fixed index

    def _make_mask_mod(self) -> MaskMod:
        index = broadcast_indexer(self.mask)

        def dense_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return index(b, h, q_idx, kv_idx)

        return dense_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        t = self.mask.cpu()
        if t.shape[2] not in (1, q_len) or t.shape[3] not in (1, kv_len):
            raise ValueError(f"Dense(mask=...) has shape {tuple(t.shape)}; Lq, Lkv = {q_len}, {kv_len}")
        return t.expand(t.shape[0], t.shape[1], q_len, kv_len).clone()

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        # A mask broadcast over no key (its last dim 1, Lkv = 0) leaves every query row empty.
        no_keys = kv_len == 0 and q_len > 0
        return SdpaForm(is_causal=False, attn_mask=self.mask, empty_rows=no_keys or self.hides_whole_rows())

    def hides_whole_rows(self) -> bool:
        """Whether some query row sees no key (True while traced: the data is not read then).
        Computed once per spec."""
        if tracing():
            return True
        cached = self.__dict__.get("_empty_rows")
        if cached is None:
            cached = not bool(self.mask.any(dim=-1).all())
            object.__setattr__(self, "_empty_rows", cached)
        return cached

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        bm = bool_block_map(self.mask, q_len, kv_len, q_block, kv_block)
        return BlockMap(any=bm.any.to(device), full=bm.full.to(device))

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        gen = torch.Generator().manual_seed(17 * q_len + kv_len + batch)
        rand = torch.rand(batch, heads, q_len, kv_len, generator=gen) < 0.6
        keys = torch.rand(batch, 1, 1, kv_len, generator=gen) < 0.7
        tril = torch.ones(q_len, kv_len, dtype=torch.bool).tril()
        return [
            cls(mask=rand),
            cls(mask=keys),
            cls(mask=tril),
            cls(mask=torch.ones(1, 1, 1, 1, dtype=torch.bool)),
        ]
