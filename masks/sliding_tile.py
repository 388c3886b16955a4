"""``sliding_tile``: Sliding Tile Attention (STA) over a video or image laid out tile by tile."""

from __future__ import annotations

import math

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

from ._blocks import INDEX_LIMIT, check_int
from .chunked import Chunked
from .natten import _odd, axis_ints, window_block_pairs

_OWNER = "SlidingTile"


@MASKS.register
@spec_dataclass
class SlidingTile(MaskSpec):
    """Sliding Tile Attention: a token sees every token of the ``window`` of tiles around its tile.

    Layout: the video (or image) is a ``canvas`` grid of tokens (``(T, H, W)``, ``(H, W)``, or 1-D),
    cut into tiles of ``tile`` tokens per axis (each extent divisible by its tile size). Tokens are
    stored tile by tile: tile number ``t`` holds positions ``[t * prod(tile), (t + 1) * prod(tile))``,
    tiles numbered row-major over the grid of tiles (last axis fastest). The order of tokens
    inside a tile does not matter to the mask (:meth:`tiled_order` gives the row-major one). After
    the ``prod(canvas)`` video tokens come ``text_len`` text tokens.

    Rule: along each axis with ``n`` tiles and an odd window of ``w`` tiles (``w <= n``), a query in
    tile coordinate ``x`` sees the tiles ``[s, s + w)`` with ``s = clamp(x - w // 2, 0, n - w)``: the
    window is centred on the query's tile and shifted inwards at the grid's borders (NATTEN's rule
    at tile granularity), so every video token sees ``prod(window)`` whole tiles. A video key is
    visible iff its tile is in the window on every axis. Text tokens attend to every token and are
    attended by every token. Queries and keys are the first ``Lq`` / ``Lkv`` positions.

    Picture (``canvas=(2, 8), tile=(1, 2), window=(1, 3), text_len=2``: 8 tiles of 2 tokens in 2
    rows of 4, then 2 text tokens; rows are queries, ``#`` visible)::

        ######..........##
        ######..........##
        ######..........##
        ######..........##
        ..######........##
        ..######........##
        ..######........##
        ..######........##
        ........######..##
        ........######..##
        ........######..##
        ........######..##
        ..........########
        ..........########
        ..........########
        ..........########
        ##################
        ##################

    Convention next to STA's (Zhang et al., "Fast Video Generation with Sliding Tile Attention",
    2025): FastVideo's kernel takes the window in tiles per axis (``window_size=(3, 3, 3)`` with
    tiles of ``(6, 8, 8)`` tokens is ``SlidingTile(canvas=(T, H, W), tile=(6, 8, 8), window=(3, 3,
    3))``), stores the video tile by tile and appends the text, as here. attention-gym's
    ``generate_sta_mask_mod_3d(canvas_twh, kernel_twh, tile_twh, text_seq_len)`` takes the window
    in tokens: its ``kernel_twh`` is ``window * tile`` per axis. Both clamp the window's centre
    into the grid, which is this spec's shifted window for odd windows; they disagree with each
    other on even windows (``w + 1`` tiles wide in FastVideo's reference, ``w`` in attention-gym's),
    so only odd ones are accepted. STA pads the text to a fixed buffer (256) of which
    ``text_length`` tokens are real, every query seeing only the real ones; that is
    ``SlidingTile(..., text_len=256) & KeyPadding(valid)``.

    Forms offered: SDPA ``is_causal=False`` when the window covers the grid of tiles; varlen (the
    tiles as segments) and the lowest visible key when every window is one tile and there is no
    text; lowest visible key on 1-D canvases without text; a closed-form block map for any
    lengths and block sizes (each block's run of positions touches a run of tiles, and NATTEN's
    block rule decides runs of tiles). When ``prod(tile)`` is a multiple of both block sizes,
    every block lies inside one tile and every pair of complete blocks is full or empty: the kernel
    evaluates no ``mask_mod`` at all (FastVideo's ``(6, 8, 8)`` tiles of 384 tokens with 128-token
    blocks).

    Args:
        canvas: token grid extents, an int (1-D) or a tuple of 1 to 3 ints ``>= 1``.
        tile: tile extents in tokens, one per axis (an int is used on every axis), each dividing
            its canvas extent.
        window: window extents in tiles, odd, one per axis (an int is used on every axis), each at
            most the number of tiles on its axis.
        text_len: text tokens after the video (``>= 0``; default 0), attending and attended densely.
    """

    canvas: tuple[int, ...]
    tile: tuple[int, ...]
    window: tuple[int, ...]
    text_len: int = 0

    def __post_init__(self) -> None:
        canvas = axis_ints("canvas", self.canvas, 1, _OWNER)
        if len(canvas) > 3:
            raise ValueError(f"{_OWNER}(canvas=...) has 1 to 3 axes, got {len(canvas)}: {canvas}")
        tile = self._per_axis("tile", axis_ints("tile", self.tile, 1, _OWNER), canvas)
        window = self._per_axis("window", axis_ints("window", self.window, 1, _OWNER), canvas)
        for size, t in zip(canvas, tile, strict=True):
            if size % t:
                raise ValueError(
                    f"{_OWNER}(tile=...) must divide the canvas on every axis (pad the video to whole "
                    f"tiles, as STA does), got tile {tile} for canvas {canvas}"
                )
        grid = tuple(size // t for size, t in zip(canvas, tile, strict=True))
        for w, n in zip(window, grid, strict=True):
            if w % 2 == 0 or w > n:
                raise ValueError(
                    f"{_OWNER}(window=...) sizes (in tiles) must be odd and at most the number of tiles "
                    f"on their axis, got window {window} for {grid} tiles (canvas {canvas}, tile {tile})"
                )
        text = check_int("text_len", self.text_len, minimum=0, owner=_OWNER)
        if math.prod(canvas) + text > INDEX_LIMIT:
            raise ValueError(
                f"{_OWNER}: prod(canvas) + text_len = {math.prod(canvas) + text} positions exceed the "
                f"kernels' index range ({INDEX_LIMIT})"
            )
        object.__setattr__(self, "canvas", canvas)
        object.__setattr__(self, "tile", tile)
        object.__setattr__(self, "window", window)
        object.__setattr__(self, "text_len", text)

    @staticmethod
    def _per_axis(name: str, values: tuple[int, ...], canvas: tuple[int, ...]) -> tuple[int, ...]:
        if len(values) == 1 and len(canvas) > 1:
            return values * len(canvas)
        if len(values) != len(canvas):
            raise ValueError(
                f"{_OWNER}({name}=...) needs one size per canvas axis ({len(canvas)}), got {values}"
            )
        return values

    @property
    def grid(self) -> tuple[int, ...]:
        """Tiles per axis, ``canvas // tile``."""
        return tuple(size // t for size, t in zip(self.canvas, self.tile, strict=True))

    @property
    def tile_tokens(self) -> int:
        """Tokens per tile, ``prod(tile)``."""
        return math.prod(self.tile)

    @property
    def video_tokens(self) -> int:
        """Video tokens, ``prod(canvas)``; the text follows them."""
        return math.prod(self.canvas)

    @property
    def tokens(self) -> int:
        """Positions of the layout, ``prod(canvas) + text_len``."""
        return self.video_tokens + self.text_len

    def tiled_order(self) -> torch.Tensor:
        """int64 ``[prod(canvas)]``: the row-major canvas index of the token at each tiled position
        (tiles in row-major order, each tile's tokens row-major). ``x[..., spec.tiled_order(), :]``
        lays a row-major video ``[..., prod(canvas), D]`` out for this mask, and ``out[...,
        spec.tiled_order().argsort(), :]`` takes the attention output back."""
        # Axes of the canvas split into (tiles, within tile), then the tile axes moved first.
        index = torch.arange(self.video_tokens).view(
            *[d for n, t in zip(self.grid, self.tile, strict=True) for d in (n, t)]
        )
        rank = len(self.canvas)
        return index.permute(*range(0, 2 * rank, 2), *range(1, 2 * rank, 2)).reshape(-1)

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        self._check(q_len, kv_len)

    def _check(self, q_len: int, kv_len: int) -> None:
        if max(q_len, kv_len) > self.tokens:
            raise ValueError(
                f"{_OWNER}(canvas={self.canvas}, text_len={self.text_len}) has {self.tokens} positions "
                f"but the problem has Lq={q_len}, Lkv={kv_len}; the layout must hold max(Lq, Lkv)"
            )

    def _make_mask_mod(self) -> MaskMod:
        grid = tuple(static_int(n) for n in self.grid)
        window = tuple(static_int(w) for w in self.window)
        per_tile = static_int(self.tile_tokens)
        video = static_int(self.video_tokens)
        text = static_int(self.text_len) > 0
        strides = [math.prod(grid[a + 1 :]) for a in range(len(grid))]

        def sliding_tile_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            q_tile = q_idx // per_tile if per_tile > 1 else q_idx
            k_tile = kv_idx // per_tile if per_tile > 1 else kv_idx
            out = None
            for n, w, stride in zip(grid, window, strides, strict=True):
                qx = q_tile // stride % n if stride > 1 else q_tile % n
                kx = k_tile // stride % n if stride > 1 else k_tile % n
                # clamp(qx - w // 2, 0, n - w) with where: FA4's code generator has no min/max.
                start = qx - w // 2
                start = torch.where(start < 0, 0, torch.where(start > n - w, n - w, start))
                axis = (kx >= start) & (kx < start + w)
                out = axis if out is None else out & axis
            assert out is not None
            if text:  # positions past the video are text: seen by all, seeing all
                out = out | (q_idx >= video) | (kv_idx >= video)
            return out

        return sliding_tile_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        self._check(q_len, kv_len)
        # Oracle: the tiles' coordinates listed by a Cartesian product (row-major), each axis'
        # window start written out with min/max, the tile-level mask then repeated over each tile's
        # tokens and framed by dense text rows and columns. No divisions of positions.
        grid = self.grid
        coords = torch.cartesian_prod(*[torch.arange(n) for n in grid]).view(-1, len(grid))
        tiles = torch.ones(coords.shape[0], coords.shape[0], dtype=torch.bool)
        for axis, (n, w) in enumerate(zip(grid, self.window, strict=True)):
            first = torch.tensor([min(max(x - w // 2, 0), n - w) for x in range(n)])
            start = first[coords[:, axis]][:, None]
            tiles &= (coords[None, :, axis] >= start) & (coords[None, :, axis] < start + w)
        per_tile, video = self.tile_tokens, self.video_tokens
        out = torch.ones(self.tokens, self.tokens, dtype=torch.bool)
        out[:video, :video] = tiles.repeat_interleave(per_tile, 0).repeat_interleave(per_tile, 1)
        return out[:q_len, :kv_len][None, None]

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        return SdpaForm(is_causal=False) if self.window == self.grid else None

    def _tile_local(self) -> bool:
        """Every window one tile and no text: exactly ``Chunked(size=prod(tile))``."""
        return self.text_len == 0 and all(w == 1 for w in self.window)

    def varlen_form(self, q_len: int, kv_len: int, batch: int) -> VarlenForm | None:
        if not self._tile_local():
            return None
        return Chunked(size=self.tile_tokens).varlen_form(q_len, kv_len, batch)

    def lowest_visible_key(self, q_idx: torch.Tensor) -> torch.Tensor | None:
        if self.text_len:
            return None  # text queries (after the video) see key 0: a bound would decrease
        per_tile = self.tile_tokens
        if self._tile_local():
            return torch.div(q_idx, per_tile, rounding_mode="floor") * per_tile
        if len(self.canvas) != 1:
            return None  # rows of tiles share windows near the borders: the bound is not monotone
        (n,), (w,) = self.grid, self.window
        return (torch.div(q_idx, per_tile, rounding_mode="floor") - w // 2).clamp(0, n - w) * per_tile

    def visible_fraction(self, q_len: int, kv_len: int) -> float:
        # A video query sees its window of whole tiles and the text; a text query sees everything.
        seen = math.prod(self.window) * math.prod(self.tile) + self.text_len
        return min(1.0, seen / max(1, kv_len) + self.text_len / max(1, q_len))

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        self._check(q_len, kv_len)
        q_first, q_last, q_complete = block_ranges(q_len, q_block, device)
        k_first, k_last, k_complete = block_ranges(kv_len, kv_block, device)
        video, per_tile = self.video_tokens, self.tile_tokens
        # The video part of each block is a run of positions, which touches a run of tiles: every
        # tile of it holds a query (key) of the block, so NATTEN's rule between runs of grid cells,
        # applied to the tile grid, decides the video pairs exactly. Text pairs are all visible.
        last = video - 1
        some, every = window_block_pairs(
            q_first.clamp(max=last) // per_tile,
            q_last.clamp(max=last) // per_tile,
            k_first.clamp(max=last) // per_tile,
            k_last.clamp(max=last) // per_tile,
            self.grid,
            self.window,
            q_valid=q_first < video,
            k_valid=k_first < video,
        )
        any_ = some | (q_last >= video)[:, None] | (k_last >= video)[None, :]
        full = every & q_complete[:, None] & k_complete[None, :]
        return BlockMap(any=any_[None, None], full=full[None, None])

    @classmethod
    def typical_example(cls, q_len: int, kv_len: int, batch: int, heads: int) -> Spec:
        # A square image in tiles of 4 x 4 tokens, a window of 3 x 3 tiles (fewer on small images).
        n = max(q_len, kv_len, 1)
        side = 4 * -(-(math.isqrt(n - 1) + 1) // 4)  # the smallest multiple of 4 whose square holds n
        reach = min(3, _odd(side // 4))
        return cls(canvas=(side, side), tile=(4, 4), window=(reach, reach))

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        n = max(q_len, kv_len, 1)
        frames = max(1, (n - 1) // 24)  # 24-token frames, the rest of the row text (from n = 25 on)
        rows = max(1, -(-n // 24))
        return [
            # First: the same spec for every length up to 320 (compiled tests reuse one graph).
            cls(canvas=(max(20, 4 * -(-n // 64)), 16), tile=(4, 4), window=(3, 3)),
            # A video of 4 x 6 frames in 1 x 2 x 2 tiles, followed by text.
            cls(
                canvas=(frames, 4, 6),
                tile=(1, 2, 2),
                window=(min(3, _odd(frames)), 1, 3),
                text_len=max(0, n - 24 * frames),
            ),
            # Tiles of 8 tokens (blocks of 16 hold two), a window spanning one axis.
            cls(canvas=(2 * rows, 12), tile=(2, 4), window=(min(5, _odd(rows)), 3)),
            cls(canvas=(5 * max(3, -(-n // 5)),), tile=(5,), window=(3,)),  # 1-D
        ]
