"""How a mask's varlen form lays a ``[batch, length]`` call out for kernels without mask mods.

Kernels that only know "no mask", causal or a window (SDPA's fused kernels, FlashAttention-4's
own kernels) can still run a block-diagonal mask exactly when the blocks are laid out so the
kernel sees them as separate sequences:

* ``rows``: one segment per batch row (no mask, causal, sliding window): the call as it is;
* ``chunks``: every segment ``chunk`` long, tiling each row (``Chunked``, equal documents): the
  rows viewed as a larger batch of chunks;
* ``packed``: anything else (documents of unequal length): only varlen kernels (``cu_seqlens``);
* ``strided``: no varlen form, but a ``StridedForm`` (a dilated window) with ``L`` a multiple of
  its stride (``chunk``): each residue class of positions mod the stride is a sequence of its
  own, which kernels taking ``[B, L, H, D]`` see as heads of their own (:func:`fold_strided`).

``window`` is the form's window inside each segment (or class): ``(left, right)``, ``-1`` unbounded;
a reach that spans every segment (``>= segment length - 1``) is given as ``-1`` too, so kernels
that know only "no mask" and causal read such a window as one of those.
"""

from __future__ import annotations

import torch

from flexattn_zoo.lru import LRUCache
from flexattn_zoo.spec import MaskSpec, VarlenForm, tracing

#: ``(kind, chunk, window)``; ``chunk`` is the segment length for rows/chunks, the stride when
#: strided, 0 when packed.
SegmentLayout = tuple[str, int, tuple[int, int]]
#: Per (mask, batch, length): reading a document mask's segments is a device sync, so it is cached.
LAYOUT_CACHE: LRUCache[SegmentLayout] = LRUCache(64)


def segment_layout(mask: MaskSpec | None, batch: int, length: int) -> SegmentLayout | None:
    """The layout of a ``[batch, length]`` call with ``Lq == Lkv``, or None when the mask has
    neither a varlen form (with query and key segments alike) nor a strided one whose stride
    divides ``length``; cached per (mask, batch, length). No mask is ``("rows", length, (-1, -1))``."""
    if mask is None:
        return "rows", length, (-1, -1)
    key = (mask, batch, length)
    found = LAYOUT_CACHE.get(key)
    if found is not None:
        return found
    form = mask.varlen_form(length, length, batch)
    if form is None:
        strided = mask.strided_form(length, length)
        if strided is None or length % strided.stride:
            return None
        layout: SegmentLayout = ("strided", strided.stride, strided.window)
    elif form.kv_segments is not None:
        return None  # keys segmented apart from queries: only a varlen kernel with two offset lists
    else:
        layout = _layout(form, length)
    return LAYOUT_CACHE.put(key, _spans_as_unbounded(layout, length))


def _spans_as_unbounded(layout: SegmentLayout, length: int) -> SegmentLayout:
    """``layout`` with each window reach that spans its segments (a class of ``length / stride``
    positions, a chunk, a row) as -1; packed segments differ in length and keep theirs."""
    kind, size, (left, right) = layout
    if kind == "packed":
        return layout
    span = length // size if kind == "strided" else size
    return kind, size, (-1 if left >= span - 1 else left, -1 if right >= span - 1 else right)


def _layout(form: VarlenForm, length: int) -> SegmentLayout:
    if form.segments is None:
        return "rows", length, form.window
    if form.uniform is not None and length % form.uniform == 0:
        chunk = form.uniform
        return ("rows" if chunk == length else "chunks"), chunk, form.window
    if tracing():
        return "packed", 0, form.window  # equal segments are only known from their data
    seg = form.segments.detach().to("cpu", torch.int64)
    lengths = seg[seg > 0]
    chunk = int(lengths[0]) if lengths.numel() else 0
    if chunk > 0 and length % chunk == 0 and bool((lengths == chunk).all()):
        return ("rows" if chunk == length else "chunks"), chunk, form.window
    return "packed", 0, form.window


def as_chunks(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[B, H, L, D]`` -> ``[B * L // chunk, H, chunk, D]``: each chunk its own batch row.

    A view when the layout allows it (``[B, L, H, D]`` projections viewed with ``transpose(1, 2)``,
    or B == 1), else one copy.
    """
    b, h, length, d = t.shape
    return (
        t.unflatten(2, (length // chunk, chunk)).transpose(1, 2).reshape(b * (length // chunk), h, chunk, d)
    )


def from_chunks(t: torch.Tensor, batch: int) -> torch.Tensor:
    """Inverse of :func:`as_chunks`: ``[B * n, H, chunk, D]`` -> ``[B, H, n * chunk, D]``."""
    bn, h, chunk, d = t.shape
    n = bn // batch
    return t.reshape(batch, n, h, chunk, d).transpose(1, 2).reshape(batch, h, n * chunk, d)


#: The most heads a folded call may have on CUDA: kernels put heads on a grid dimension of at most
#: 65535 blocks (FlashAttention-2's and the memory-efficient kernel's).
MAX_FOLDED_HEADS = 65535


def fold_too_wide(stride: int, heads: int, device_type: str) -> str | None:
    """Why a call folding ``stride`` residue classes of ``heads`` heads into heads of their own
    cannot run on ``device_type`` (too many heads for a CUDA kernel's grid), or None."""
    if device_type != "cuda" or stride * heads <= MAX_FOLDED_HEADS:
        return None
    return (
        f"{stride} residue classes x {heads} heads, each class as heads of its own, exceed the "
        f"{MAX_FOLDED_HEADS} heads a CUDA kernel grid takes"
    )


def fold_strided(t: torch.Tensor, stride: int) -> torch.Tensor:
    """``[B, L, H, D]`` -> ``[B, L // stride, stride * H, D]``: position ``u * stride + r`` of head
    ``h`` becomes position ``u`` of head ``r * H + h`` (each residue class its own heads; with
    fewer k/v heads, q head ``r * H + h`` still reads k/v head ``r * Hkv + h // group``). A view
    of a contiguous ``[B, L, H, D]`` tensor (a projection's output), else one copy."""
    b, length, h, d = t.shape
    return t.reshape(b, length // stride, stride * h, d)


def unfold_strided(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of :func:`fold_strided` for an output ``[B, L / stride, stride * H, Dv]`` of
    ``heads`` = H heads: ``[B, L, H, Dv]`` (a view of a contiguous output)."""
    b, classes_len, folded, d = t.shape
    return t.reshape(b, classes_len * (folded // heads), heads, d)


def unfold_strided_lse(lse: torch.Tensor, heads: int) -> torch.Tensor:
    """The lse ``[B, stride * H, L / stride]`` of a folded call as ``[B, H, L]`` (one copy)."""
    b, folded, classes_len = lse.shape
    stride = folded // heads
    return lse.view(b, stride, heads, classes_len).permute(0, 2, 3, 1).reshape(b, heads, classes_len * stride)


__all__ = [
    "LAYOUT_CACHE",
    "MAX_FOLDED_HEADS",
    "SegmentLayout",
    "as_chunks",
    "fold_strided",
    "fold_too_wide",
    "from_chunks",
    "segment_layout",
    "unfold_strided",
    "unfold_strided_lse",
]
