"""``natten``: neighborhood attention over a 1-D, 2-D or 3-D grid of tokens (NATTEN)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from flexattn_zoo.registry import MASKS
from flexattn_zoo.spec import (
    BlockMap,
    MaskMod,
    MaskSpec,
    SdpaForm,
    Spec,
    block_ranges,
    spec_dataclass,
    static_int,
    tracing,
)

from ._blocks import check_int

#: One axis-aligned box of grid coordinates for a batch of blocks: per axis ``(first, last)``
#: tensors, and whether the box exists for each block.
_Box = tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]


def axis_ints(name: str, value: Any, minimum: int, owner: str = "Natten") -> tuple[int, ...]:
    """``value`` (an int or a sequence of ints, one per grid axis) as a tuple of plain ints; TypeError
    / ValueError naming ``owner(name=...)``."""
    if getattr(value, "ndim", 0) > 0:
        # A tensor or NumPy array of extents is a sequence: it has __index__ too, like a scalar,
        # but that only works for one element.
        value = value.tolist()
    items = (value,) if isinstance(value, int) or hasattr(value, "__index__") else value
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence) or not items:
        raise TypeError(f"{owner}({name}=...) must be an int or a tuple of 1 to 3 ints, got {value!r}")
    return tuple(check_int(name, v, minimum=minimum, owner=owner) for v in items)


@MASKS.register
@spec_dataclass
class Natten(MaskSpec):
    """Neighborhood attention: each token of a grid sees the ``kernel``-sized box of tokens around
    it, the box shifted inwards at the grid's edges so that it always holds ``prod(kernel)`` tokens.

    Tokens are the cells of a ``canvas`` grid (1-D ``(L,)``, 2-D ``(H, W)`` or 3-D ``(T, H, W)``)
    flattened row-major (the last axis fastest): position ``p`` of a 2-D canvas is row ``p // W``,
    column ``p % W``. Along each axis of extent ``S`` with kernel ``K`` (odd, ``K <= S``), query
    coordinate ``x`` sees the key coordinates ``[s, s + K)`` with ``s = clamp(x - K // 2, 0, S - K)``;
    a key is visible iff it is in that range on every axis. This is NATTEN's neighborhood
    attention (no dilation, not causal): near an edge the window does not shrink but slides inside
    the grid. Queries and keys are the first ``Lq`` / ``Lkv`` cells (``Lq, Lkv <= prod(canvas)``).

    Picture (1-D: ``canvas=8, kernel=3``; rows are queries, ``#`` visible)::

        ###.....
        ###.....
        .###....
        ..###...
        ...###..
        ....###.
        .....###
        .....###

    2-D (``canvas=(3, 3), kernel=(3, 1)``: each pixel sees its whole column)::

        #..#..#..
        .#..#..#.
        ..#..#..#
        #..#..#..
        .#..#..#.
        ..#..#..#
        #..#..#..
        .#..#..#.
        ..#..#..#

    Convention next to attention-gym's: ``generate_natten(canvas_w, canvas_h, kernel_w, kernel_h)``
    is ``Natten(canvas=(canvas_h, canvas_w), kernel=(kernel_h, kernel_w))`` on a square canvas with
    a square kernel. On other shapes they differ: it clamps the row ``p // canvas_w`` with the
    width's bounds and ``kernel_w`` (and the column with the height's), where NATTEN and this spec
    clamp each axis within its own extent and kernel: on a square canvas with a non-square kernel it
    is ``Natten(canvas=(S, S), kernel=(kernel_w, kernel_h))``. Its ``generate_tiled_natten(W, H,
    K_W, K_H, T_W, T_H)`` (``K_W`` spanning columns there) is ``Natten(canvas=(H, W), kernel=(K_H,
    K_W))`` on tokens permuted by ``SlidingTile(canvas=(H, W), tile=(T_H, T_W),
    window=1).tiled_order()``, and ``generate_morton_natten`` the same on a Morton-ordered one.

    Forms offered: SDPA ``is_causal=False`` when the kernel covers the canvas on every axis (every
    key visible); a closed-form block map for any lengths (each block's run of positions is cut
    into boxes of grid cells, at most 1, 4 or 13 candidates for 1, 2 or 3 axes, and each pair of
    boxes decides per axis with interval arithmetic on the window starts, which never decrease
    along an axis); lowest visible key ``clamp(i - K // 2, 0, L - K)`` on a 1-D canvas (on 2-D and
    3-D canvases the lowest key drops from the end of one row to the start of the next near the top
    and bottom edges, where rows share a window, so none is offered).

    Args:
        canvas: grid extents, an int (1-D) or a tuple of 1 to 3 ints ``>= 1``.
        kernel: neighborhood extents, odd, one per axis (an int is used on every axis), each at
            most its axis' extent.
    """

    canvas: tuple[int, ...]
    kernel: tuple[int, ...]

    def __post_init__(self) -> None:
        canvas = axis_ints("canvas", self.canvas, 1)
        kernel = axis_ints("kernel", self.kernel, 1)
        if len(canvas) > 3:
            raise ValueError(f"Natten(canvas=...) has 1 to 3 axes, got {len(canvas)}: {canvas}")
        if len(kernel) == 1 and len(canvas) > 1:
            kernel = kernel * len(canvas)
        if len(kernel) != len(canvas):
            raise ValueError(
                f"Natten(kernel=...) needs one size per canvas axis ({len(canvas)}), got {kernel}"
            )
        for k, s in zip(kernel, canvas, strict=True):
            if k % 2 == 0 or k > s:
                raise ValueError(
                    f"Natten(kernel=...) sizes must be odd and at most the canvas extent, got kernel "
                    f"{kernel} for canvas {canvas}"
                )
        object.__setattr__(self, "canvas", canvas)
        object.__setattr__(self, "kernel", kernel)

    @property
    def tokens(self) -> int:
        """Number of grid cells, ``prod(canvas)``."""
        return math.prod(self.canvas)

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        if max(q_len, kv_len) > self.tokens:
            raise ValueError(
                f"Natten(canvas={self.canvas}) has {self.tokens} tokens but the problem has "
                f"Lq={q_len}, Lkv={kv_len}; the canvas must hold max(Lq, Lkv) tokens"
            )

    def _make_mask_mod(self) -> MaskMod:
        canvas = tuple(static_int(s) for s in self.canvas)
        kernel = tuple(static_int(k) for k in self.kernel)
        strides = [math.prod(canvas[a + 1 :]) for a in range(len(canvas))]

        def natten_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            out = None
            for size, k, stride in zip(canvas, kernel, strides, strict=True):
                qx = q_idx // stride % size if stride > 1 else q_idx % size
                kx = kv_idx // stride % size if stride > 1 else kv_idx % size
                # The window slides inside the edge: clamp(qx - k // 2, 0, size - k), written
                # with where (FlashAttention-4's code generator in torch 2.11 has no min/max).
                start = qx - k // 2
                start = torch.where(start < 0, 0, torch.where(start > size - k, size - k, start))
                axis = (kx >= start) & (kx < start + k)
                out = axis if out is None else out & axis
            assert out is not None
            return out

        return natten_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        # Oracle: the 1-D neighborhood matrix of each axis painted row by row, and the grid's mask
        # their Kronecker product (row-major flattening), cut to Lq x Lkv.
        out = torch.ones(1, 1, dtype=torch.bool)
        for size, k in zip(self.canvas, self.kernel, strict=True):
            axis = torch.zeros(size, size, dtype=torch.bool)
            for x in range(size):
                first = min(max(x - k // 2, 0), size - k)
                axis[x, first : first + k] = True
            out = torch.kron(out.to(torch.uint8), axis.to(torch.uint8)).bool()
        return out[:q_len, :kv_len][None, None]

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        return SdpaForm(is_causal=False) if self.kernel == self.canvas else None

    def lowest_visible_key(self, q_idx: torch.Tensor) -> torch.Tensor | None:
        if len(self.canvas) != 1:
            return None
        (size,), (k,) = self.canvas, self.kernel
        return (q_idx - k // 2).clamp(0, size - k)

    def visible_fraction(self, q_len: int, kv_len: int) -> float:
        # A query sees at most its kernel's box of keys.
        return min(1.0, math.prod(self.kernel) / max(1, kv_len))

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        q_first, q_last, q_complete = block_ranges(q_len, q_block, device)
        k_first, k_last, k_complete = block_ranges(kv_len, kv_block, device)
        some, every = window_block_pairs(q_first, q_last, k_first, k_last, self.canvas, self.kernel)
        full = every & q_complete[:, None] & k_complete[None, :]
        return BlockMap(any=some[None, None], full=full[None, None])

    @classmethod
    def typical_example(cls, q_len: int, kv_len: int, batch: int, heads: int) -> Spec:
        # A square image with a 7 x 7 neighborhood (smaller images: the largest odd kernel).
        side = math.isqrt(max(q_len, kv_len, 1) - 1) + 1
        return cls(canvas=(side, side), kernel=(min(7, _odd(side)),) * 2)

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        n = max(q_len, kv_len, 1)
        side = math.isqrt(n - 1) + 1  # the smallest square holding n tokens
        out: list[Spec] = [
            # First: the same spec for every length up to 320 (compiled tests reuse one graph).
            cls(canvas=(max(20, -(-n // 16)), 16), kernel=(3, 5)),
            cls(canvas=(n,), kernel=(min(7, _odd(n)),)),
            cls(canvas=(side, side), kernel=((side // 2) | 1,) * 2),
        ]
        if n >= 8:
            depth = -(-n // 16)
            out.append(cls(canvas=(depth, 4, 4), kernel=(min(3, _odd(depth)), 3, 1)))
        return out


def window_block_pairs(
    q_first: torch.Tensor,
    q_last: torch.Tensor,
    k_first: torch.Tensor,
    k_last: torch.Tensor,
    canvas: tuple[int, ...],
    kernel: tuple[int, ...],
    *,
    q_valid: torch.Tensor | None = None,
    k_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NATTEN's window rule between runs of cells of a row-major grid, ``[n_q, n_kv]`` each.

    Query run ``r`` is the cells ``q_first[r] .. q_last[r]`` (flat indices into ``canvas``), key
    run ``c`` likewise; ``q_valid`` / ``k_valid`` (default: all) say which runs exist. ``some[r, c]``:
    some cell of run ``r`` has some cell of run ``c`` in its ``kernel`` window; ``every[r, c]``: every
    cell of ``r`` has every cell of ``c`` in it (True when either run does not exist). Exact for
    any runs: every cell of a run is a query (or key) of its block, so the block pair is decided by
    these cell sets alone (``Natten`` passes positions, ``SlidingTile`` the tiles its blocks touch).
    """
    device = q_first.device
    # Candidate boxes no run uses (most of them when runs align with rows or slices) are dropped
    # before the pairwise work; not while torch.compile traces (that reads data).
    keep = (lambda box: True) if tracing() else (lambda box: bool(box[1].any()))
    q_boxes = [
        (axes, valid if q_valid is None else valid & q_valid)
        for axes, valid in _boxes(q_first, q_last, canvas)
    ]
    k_boxes = [
        (axes, valid if k_valid is None else valid & k_valid)
        for axes, valid in _boxes(k_first, k_last, canvas)
    ]
    q_boxes = [box for box in q_boxes if keep(box)]
    k_boxes = [box for box in k_boxes if keep(box)]
    n_q, n_kv = q_first.numel(), k_first.numel()
    some_all = torch.zeros(n_q, n_kv, dtype=torch.bool, device=device)
    every_all = torch.ones(n_q, n_kv, dtype=torch.bool, device=device)
    for q_axes, q_ok in q_boxes:
        for k_axes, k_ok in k_boxes:
            both = q_ok[:, None] & k_ok[None, :]
            some, every = both, torch.ones_like(both)
            for (qa, qb), (ka, kb), size, k in zip(q_axes, k_axes, canvas, kernel, strict=True):
                # Window starts never decrease along an axis and step by at most 1, so the
                # queries [qa, qb] of a box together see keys [start(qa), start(qb) + K - 1],
                # and each of them sees at least [start(qb), start(qa) + K - 1].
                lo = (qa - k // 2).clamp(0, size - k)[:, None]
                hi = (qb - k // 2).clamp(0, size - k)[:, None]
                some = some & (lo <= kb[None, :]) & (ka[None, :] <= hi + k - 1)
                every = every & (hi <= ka[None, :]) & (kb[None, :] <= lo + k - 1)
            some_all |= some
            every_all &= every | ~both
    return some_all, every_all


def _odd(size: int) -> int:
    """The largest odd number ``<= size`` (``size >= 1``)."""
    return size if size % 2 else size - 1


def _boxes(first: torch.Tensor, last: torch.Tensor, canvas: tuple[int, ...]) -> list[_Box]:
    """Cut each flat range ``[first, last]`` of a row-major grid into axis-aligned boxes.

    A range that stays in one slice of the leading axis recurses into that slice; otherwise it is
    its first slice's tail, the whole slices in between, and its last slice's head. Every block
    gets the same list of candidate boxes (``3 * B(n - 1) + 1`` for ``n`` axes: 1, 4, 13), each with
    a per-block flag saying whether it is part of that block's cut; the boxes of one block are
    disjoint and cover its range exactly.
    """
    ones = torch.ones_like(first, dtype=torch.bool)
    if len(canvas) == 1:
        return [([(first, last)], ones)]
    inner = math.prod(canvas[1:])
    lead_lo, rest_lo = first // inner, first % inner
    lead_hi, rest_hi = last // inner, last % inner
    same = lead_lo == lead_hi
    out: list[_Box] = []
    for axes, valid in _boxes(rest_lo, rest_hi, canvas[1:]):  # within one slice
        out.append(([(lead_lo, lead_lo), *axes], valid & same))
    for axes, valid in _boxes(rest_lo, torch.full_like(first, inner - 1), canvas[1:]):  # first slice's tail
        out.append(([(lead_lo, lead_lo), *axes], valid & ~same))
    whole = [(torch.zeros_like(first), torch.full_like(first, s - 1)) for s in canvas[1:]]
    out.append(([(lead_lo + 1, lead_hi - 1), *whole], ~same & (lead_hi - lead_lo >= 2)))  # whole slices
    for axes, valid in _boxes(torch.zeros_like(first), rest_hi, canvas[1:]):  # last slice's head
        out.append(([(lead_hi, lead_hi), *axes], valid & ~same))
    return out
