"""The video masks (``sliding_tile``: Sliding Tile Attention; ``video_sparse``: Sparse-VideoGen's
spatial and temporal heads): each against an oracle written here from the published rule (per-pair
predicates over tile / frame coordinates, independent of the spec's ``mask_mod`` and ``dense``),
block maps against ``create_block_mask``, the layouts the conventions promise, forms, parameter
errors, and the attention on the CPU routes against the float64 reference.

The registry-wide tests (``tests/property``) run every example through the consistency checks and
every CPU route; this file checks that the definitions are the published ones.
"""

from __future__ import annotations

import math

import pytest
import torch
from zoo_oracles import mask_mod_dense, qkv, table

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo._compat import create_block_mask
from flexattn_zoo.masks import Chunked, KeyPadding, Natten, SlidingTile, VideoSparse
from flexattn_zoo.spec import MaskSpec, SdpaForm, VarlenForm
from flexattn_zoo.testing import assert_mask_consistent, assert_matches_reference
from flexattn_zoo.testing.checks import block_mask_map

#: Block sizes for the consistency checks: tile-aligned, uneven, and larger than short problems.
SMALL_BLOCKS = ((4, 4), (3, 5), (16, 32))


def _pictures(spec_class: type) -> list[list[str]]:
    """The ``#``/``.`` pictures of a class docstring, one list of rows per picture."""
    found: list[list[str]] = [[]]
    for line in (spec_class.__doc__ or "").splitlines():
        text = line.strip()
        if text and set(text) <= set("#."):
            found[-1].append(text)
        elif found[-1]:
            found.append([])
    return [rows for rows in found if rows]


def _rows(mask: torch.Tensor) -> list[str]:
    return ["".join("#" if x else "." for x in row) for row in mask[0, 0].tolist()]


def _block_mask_vs_map(spec: MaskSpec, q_len: int, kv_len: int, q_block: int, kv_block: int) -> None:
    """The spec's closed-form block map equals what ``create_block_mask`` builds from its mask_mod."""
    built = create_block_mask(
        spec.mask_mod(), None, None, q_len, kv_len, device="cpu", BLOCK_SIZE=(q_block, kv_block)
    )
    want_any, want_full = block_mask_map(built, -(-kv_len // kv_block))
    bmap = spec.block_map(q_len, kv_len, q_block, kv_block, "cpu")
    assert bmap is not None
    assert torch.equal(bmap.any[0, 0], want_any[0, 0]), (spec, q_block, kv_block)
    assert torch.equal(bmap.full[0, 0], want_full[0, 0]), (spec, q_block, kv_block)


def _same_varlen(got: VarlenForm | None, want: VarlenForm | None) -> None:
    assert got is not None and want is not None and want.segments is not None
    assert got.segments is not None and torch.equal(got.segments, want.segments)
    assert (got.window, got.uniform) == (want.window, want.uniform)


# ---- sliding_tile ------------------------------------------------------------------------------


def _sta_rule(
    canvas: tuple[int, ...],
    tile: tuple[int, ...],
    window: tuple[int, ...],
    text_len: int,
    q_len: int,
    kv_len: int,
) -> torch.Tensor:
    """STA as its reference code states it: a token's tile coordinates from its tile number (tiles
    row-major, each holding prod(tile) consecutive positions), the window's centre clamped to
    ``[w // 2, n - 1 - w // 2]``, keys whose tile lies within ``w // 2`` of it; text rows and
    columns dense."""
    grid = [c // t for c, t in zip(canvas, tile, strict=True)]
    per_tile, video = math.prod(tile), math.prod(canvas)

    def tile_coords(p: int) -> list[int]:
        number, out = p // per_tile, []
        for n in reversed(grid):
            out.append(number % n)
            number //= n
        return out[::-1]

    def sees(i: int, j: int) -> bool:
        if i >= video or j >= video:
            return True
        for x, y, n, w in zip(tile_coords(i), tile_coords(j), grid, window, strict=True):
            centre = min(max(x, w // 2), n - 1 - w // 2)
            if abs(centre - y) > w // 2:
                return False
        return True

    return table(q_len, kv_len, sees)


STA_CASES = [
    # canvas, tile, window, text_len
    ((4, 6), (2, 2), (1, 3), 0),  # 2-D, window spans one axis
    ((6, 8), (2, 2), (3, 3), 0),  # 2-D, borders on both axes
    ((8, 6), (2, 3), (3, 1), 3),  # 2-D with text
    ((3, 4, 4), (1, 2, 2), (3, 1, 1), 0),  # 3-D, a temporal window
    ((4, 4, 6), (2, 2, 2), (1, 1, 3), 2),  # 3-D with text
    ((5, 2, 4), (1, 1, 2), (3, 1, 1), 0),  # 5 frames: the window slides in the middle
    ((15,), (3,), (3,), 4),  # 1-D
]


@pytest.mark.parametrize(("canvas", "tile", "window", "text_len"), STA_CASES)
def test_sliding_tile_matches_the_sta_rule(
    canvas: tuple[int, ...], tile: tuple[int, ...], window: tuple[int, ...], text_len: int
) -> None:
    spec = SlidingTile(canvas=canvas, tile=tile, window=window, text_len=text_len)
    n = math.prod(canvas) + text_len
    # The whole layout, then problems cut short (the text not reached; Lq != Lkv; odd lengths).
    for q_len, kv_len in ((n, n), (n - 5, n), (n, n - 7), (n // 2 + 1, n // 3 + 2)):
        want = _sta_rule(canvas, tile, window, text_len, q_len, kv_len)
        assert torch.equal(spec.dense(q_len, kv_len), want)
        assert torch.equal(mask_mod_dense(spec, q_len, kv_len), want)
        assert_mask_consistent(spec, q_len, kv_len, block_sizes=SMALL_BLOCKS)
    # Every video token sees prod(window) whole tiles, at the borders too (the window slides in).
    video = math.prod(canvas)
    seen = spec.dense(n, n)[0, 0, :video, :video].sum(-1)
    assert bool((seen == math.prod(window) * math.prod(tile)).all())


@pytest.mark.parametrize(("canvas", "tile", "window", "text_len"), STA_CASES[1:5])
@pytest.mark.parametrize(("q_block", "kv_block"), [(4, 4), (8, 8), (5, 7), (16, 16)])
def test_sliding_tile_block_map_equals_create_block_mask(
    canvas: tuple[int, ...],
    tile: tuple[int, ...],
    window: tuple[int, ...],
    text_len: int,
    q_block: int,
    kv_block: int,
) -> None:
    spec = SlidingTile(canvas=canvas, tile=tile, window=window, text_len=text_len)
    n = spec.tokens
    _block_mask_vs_map(spec, n, n, q_block, kv_block)
    _block_mask_vs_map(spec, n - 3, max(1, n - 10), q_block, kv_block)


def test_sliding_tile_blocks_inside_tiles_are_never_partial() -> None:
    # Blocks that divide prod(tile) lie inside one tile: every block pair is full or empty.
    spec = SlidingTile(canvas=(6, 12, 8), tile=(2, 4, 4), window=(3, 3, 1), text_len=32)
    for block in (32, 16, 8):
        bmap = spec.block_map(spec.tokens, spec.tokens, block, block, "cpu")
        assert bmap is not None and torch.equal(bmap.any, bmap.full), block
        built = create_block_mask(
            spec.mask_mod(), None, None, spec.tokens, spec.tokens, device="cpu", BLOCK_SIZE=(block, block)
        )
        any_, full = block_mask_map(built, spec.tokens // block)
        assert torch.equal(any_, full)  # what flex sees: no partial block
    # Blocks of two tiles are partial at the window's edges.
    bmap = spec.block_map(spec.tokens, spec.tokens, 64, 64, "cpu")
    assert bmap is not None and bool((bmap.any & ~bmap.full).any())


def test_sliding_tile_block_map_at_video_scale() -> None:
    # FastVideo's HunyuanVideo setting: a 30 x 48 x 80 latent video in 6 x 8 x 8 tiles (384 tokens,
    # three 128-token blocks each), a 3 x 3 x 3 tile window, 256 text tokens; 115,456 positions.
    spec = SlidingTile(canvas=(30, 48, 80), tile=(6, 8, 8), window=(3, 3, 3), text_len=256)
    bmap = spec.block_map(spec.tokens, spec.tokens, 128, 128, "cpu")
    assert bmap is not None and bmap.any.shape[-2:] == (902, 902)
    assert torch.equal(bmap.any, bmap.full)  # no partial block anywhere
    # A video block sees 27 tiles of 3 blocks and the 2 text blocks; a text block sees all.
    per_row = bmap.any[0, 0].sum(-1)
    assert per_row[:900].eq(27 * 3 + 2).all() and per_row[900:].eq(902).all()


def test_sliding_tile_special_cases_and_forms() -> None:
    # Tiles of one token: NATTEN on the token grid.
    for canvas, window in (((5, 7), (3, 5)), ((3, 4, 5), (3, 3, 1))):
        spec = SlidingTile(canvas=canvas, tile=1, window=window)
        n = math.prod(canvas)
        assert torch.equal(spec.dense(n, n), Natten(canvas=canvas, kernel=window).dense(n, n))
    # A window of one tile and no text: chunks of prod(tile) positions, with Chunked's forms.
    local = SlidingTile(canvas=(4, 8), tile=(2, 4), window=1)
    assert torch.equal(local.dense(32, 32), Chunked(size=8).dense(32, 32))
    _same_varlen(local.varlen_form(32, 32, 1), Chunked(size=8).varlen_form(32, 32, 1))
    assert torch.equal(local.lowest_visible_key(torch.arange(32)), torch.arange(32) // 8 * 8)
    assert SlidingTile(canvas=(4, 8), tile=(2, 4), window=1, text_len=2).varlen_form(34, 34, 1) is None
    # The window covering the grid: everything visible, SDPA's unmasked call.
    covering = SlidingTile(canvas=(2, 6), tile=2, window=(1, 3), text_len=3)
    assert covering.sdpa_form(15, 15) == SdpaForm(is_causal=False)
    assert SlidingTile(canvas=(6, 6), tile=2, window=(1, 3)).sdpa_form(36, 36) is None
    # Lowest visible key: 1-D without text only (else not monotone).
    one_d = SlidingTile(canvas=12, tile=2, window=3)
    assert one_d.lowest_visible_key(torch.arange(12)).tolist() == [0, 0, 0, 0, 2, 2, 4, 4, 6, 6, 6, 6]
    assert SlidingTile(canvas=12, tile=2, window=3, text_len=1).lowest_visible_key(torch.arange(13)) is None
    assert SlidingTile(canvas=(4, 4), tile=2, window=1).lowest_visible_key(torch.arange(16)) is not None
    assert SlidingTile(canvas=(6, 6), tile=2, window=3).lowest_visible_key(torch.arange(36)) is None
    assert masks.get("sliding_tile", canvas=(4, 4), tile=2, window=1) == SlidingTile(
        canvas=(4, 4), tile=(2, 2), window=(1, 1)
    )


def test_sliding_tile_docstring_picture() -> None:
    (picture,) = _pictures(SlidingTile)
    spec = SlidingTile(canvas=(2, 8), tile=(1, 2), window=(1, 3), text_len=2)
    assert _rows(spec.dense(18, 18)) == picture


def test_sliding_tile_tiled_order_lays_a_row_major_video_out_tile_by_tile() -> None:
    canvas, tile = (4, 6, 4), (2, 3, 2)
    spec = SlidingTile(canvas=canvas, tile=tile, window=1)
    order = spec.tiled_order()
    assert sorted(order.tolist()) == list(range(96))
    grid = spec.grid
    for p, source in enumerate(order.tolist()):
        t, y, x = source // 24, source // 4 % 6, source % 4  # row-major canvas coordinates
        tile_number = ((t // 2) * grid[1] + y // 3) * grid[2] + x // 2
        assert p // 12 == tile_number  # tile by tile, tiles row-major
    # Within a tile, row-major: the first tile holds (0, 0, 0), (0, 0, 1), (0, 1, 0), ...
    assert order[:12].tolist() == [0, 1, 4, 5, 8, 9, 24, 25, 28, 29, 32, 33]
    # A row-major video laid out tile by tile, run through the mask, and taken back: the same as
    # a neighbourhood of whole tiles around each pixel's tile, in row-major coordinates.
    row_major = spec.dense(96, 96)[0, 0][order.argsort()][:, order.argsort()]
    tile_of = [((s // 24) // 2, (s // 4 % 6) // 3, (s % 4) // 2) for s in range(96)]
    assert torch.equal(row_major, table(96, 96, lambda i, j: tile_of[i] == tile_of[j])[0, 0])


def test_sliding_tile_convention_next_to_attention_gym_and_fastvideo() -> None:
    # attention-gym's generate_sta_mask_mod_2d(canvas_hw, kernel_hw, tile_hw, text_seq_len) takes
    # the window in tokens (kernel = window * tile): restated, its centre clamp and borders
    # ``left = k // 2``, ``right = k // 2 + k % 2 - 1`` on the tile grid agree with the spec on odd
    # windows.
    canvas, tile, window, text = (8, 12), (2, 3), (3, 3), 4
    grid = (4, 4)

    def gym(i: int, j: int) -> bool:
        video = 96
        if i >= video or j >= video:
            return j < video + text
        qt, kt = i // 6, j // 6
        ok = True
        for q, k, n, w in (
            (qt // grid[1], kt // grid[1], grid[0], window[0]),
            (qt % grid[1], kt % grid[1], grid[1], window[1]),
        ):
            left, right = w // 2, w // 2 + w % 2 - 1
            centre = min(max(q, left), n - 1 - right)
            ok = ok and centre - left <= k <= centre + right
        return ok

    spec = SlidingTile(canvas=canvas, tile=tile, window=window, text_len=text)
    assert torch.equal(spec.dense(100, 100), table(100, 100, gym))
    # FastVideo pads the text to 256 slots of which text_length are real; its padded queries see
    # the real keys, nobody sees a padded key: text_len = 256 with the padding as KeyPadding.
    real = 5
    padded = SlidingTile(canvas=canvas, tile=tile, window=window, text_len=8)
    valid = torch.arange(104) < 96 + real
    combined = padded & KeyPadding(valid=valid[None])

    def fastvideo(i: int, j: int) -> bool:
        if i < 96 and j < 96:
            return gym(i, j)
        if i < 96:
            return 96 <= j < 96 + real
        return j < 96 + real

    assert torch.equal(combined.dense(104, 104), table(104, 104, fastvideo))


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"canvas": (8, 8), "tile": 3, "window": 1}, ValueError, r"tile=\.\.\.\) must divide the canvas"),
        ({"canvas": (8, 8), "tile": 2, "window": 2}, ValueError, r"window=\.\.\.\) sizes .* must be odd"),
        ({"canvas": (8, 8), "tile": 4, "window": 3}, ValueError, "at most the number of tiles"),
        ({"canvas": (8, 8), "tile": (2, 2, 2), "window": 1}, ValueError, r"tile=\.\.\.\) needs one size per"),
        ({"canvas": (8, 8), "tile": 2, "window": (1, 1, 1)}, ValueError, r"window=\.\.\.\) needs one size"),
        ({"canvas": (2, 2, 2, 2), "tile": 1, "window": 1}, ValueError, "1 to 3 axes"),
        ({"canvas": "8x8", "tile": 2, "window": 1}, TypeError, r"canvas=\.\.\.\) must be an int or a tuple"),
        ({"canvas": (8, 0), "tile": 1, "window": 1}, ValueError, r"canvas=\.\.\.\) must be an int >= 1"),
        ({"canvas": (8, 8), "tile": 0, "window": 1}, ValueError, r"tile=\.\.\.\) must be an int >= 1"),
        ({"canvas": (8, 8), "tile": 2.0, "window": 1}, TypeError, r"tile=\.\.\.\)"),
        (
            {"canvas": (8, 8), "tile": 2, "window": 1, "text_len": -1},
            ValueError,
            r"text_len=\.\.\.\) must be",
        ),
        ({"canvas": (8, 8), "tile": 2, "window": 1, "text_len": True}, TypeError, "text_len"),
    ],
)
def test_sliding_tile_parameter_errors(kwargs: dict[str, object], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        SlidingTile(**kwargs)  # type: ignore[arg-type]


def test_sliding_tile_problem_must_fit_the_layout() -> None:
    spec = SlidingTile(canvas=(4, 4), tile=2, window=1, text_len=2)
    spec.validate(18, 18, 1, 1)
    with pytest.raises(ValueError, match="has 18 positions"):
        spec.validate(19, 4, 1, 1)
    with pytest.raises(ValueError, match="has 18 positions"):
        fz.attention(*qkv(1, 8, 19), mask=spec)


# ---- video_sparse ------------------------------------------------------------------------------


def _svg_rule(
    frames: int, per_frame: int, kind: str, window: int, sinks: int, text: int, q_len: int, kv_len: int
) -> torch.Tensor:
    """Sparse-VideoGen's heads from (frame, spatial index) coordinates: spatial heads compare frames,
    temporal heads spatial indices; first-frame sink keys and text rows / columns are dense."""
    video = frames * per_frame

    def sees(i: int, j: int) -> bool:
        if i >= video or j >= video or j < sinks * per_frame:
            return True
        (fi, si), (fj, sj) = divmod(i, per_frame), divmod(j, per_frame)
        return abs(fi - fj) <= window if kind == "spatial" else abs(si - sj) <= window

    return table(q_len, kv_len, sees)


SVG_CASES = [
    # frames, frame_tokens, kind, window, sink_frames, text_len
    (4, 5, "spatial", 0, 0, 0),
    (5, 6, "spatial", 1, 0, 0),
    (4, 7, "spatial", 2, 1, 3),
    (6, 4, "temporal", 0, 0, 0),
    (3, 9, "temporal", 2, 0, 2),
    (5, 6, "temporal", 1, 1, 4),
    (2, 11, "temporal", 0, 2, 0),  # every frame a sink: everything visible
]


@pytest.mark.parametrize(("frames", "per_frame", "kind", "window", "sinks", "text"), SVG_CASES)
def test_video_sparse_matches_the_svg_rule(
    frames: int, per_frame: int, kind: str, window: int, sinks: int, text: int
) -> None:
    spec = VideoSparse(
        frames=frames, frame_tokens=per_frame, kind=kind, window=window, sink_frames=sinks, text_len=text
    )
    n = frames * per_frame + text
    for q_len, kv_len in ((n, n), (n - 4, n), (n, n - 6), (n // 2 + 1, n // 3 + 2)):
        want = _svg_rule(frames, per_frame, kind, window, sinks, text, q_len, kv_len)
        assert torch.equal(spec.dense(q_len, kv_len), want)
        assert torch.equal(mask_mod_dense(spec, q_len, kv_len), want)
        assert_mask_consistent(spec, q_len, kv_len, block_sizes=SMALL_BLOCKS)


@pytest.mark.parametrize(("frames", "per_frame", "kind", "window", "sinks", "text"), SVG_CASES[1:6])
@pytest.mark.parametrize(("q_block", "kv_block"), [(4, 4), (8, 8), (5, 7), (16, 16)])
def test_video_sparse_block_map_equals_create_block_mask(
    frames: int, per_frame: int, kind: str, window: int, sinks: int, text: int, q_block: int, kv_block: int
) -> None:
    spec = VideoSparse(
        frames=frames, frame_tokens=per_frame, kind=kind, window=window, sink_frames=sinks, text_len=text
    )
    n = spec.tokens
    _block_mask_vs_map(spec, n, n, q_block, kv_block)
    _block_mask_vs_map(spec, n - 3, max(1, n - 10), q_block, kv_block)


def test_video_sparse_docstring_pictures() -> None:
    spatial, temporal = _pictures(VideoSparse)
    made = VideoSparse(frames=3, frame_tokens=3, kind="spatial", sink_frames=1, text_len=2)
    assert _rows(made.dense(11, 11)) == spatial
    assert _rows(VideoSparse(frames=3, frame_tokens=3, kind="temporal").dense(9, 9)) == temporal


def test_video_sparse_temporal_head_is_the_spatial_head_in_token_major_order() -> None:
    # Frame-major temporal head == token-major spatial head with frames and tokens swapped (and the
    # converse), text included; what Sparse-VideoGen's layout transformation relies on.
    for window, text in ((0, 0), (1, 3), (2, 0)):
        temporal = VideoSparse(frames=5, frame_tokens=6, kind="temporal", window=window, text_len=text)
        spatial = VideoSparse(frames=6, frame_tokens=5, kind="spatial", window=window, text_len=text)
        order = temporal.token_major_order()
        n = temporal.tokens
        assert sorted(order.tolist()) == list(range(n))
        permuted = temporal.dense(n, n)[0, 0][order][:, order]
        assert torch.equal(permuted, spatial.dense(n, n)[0, 0])
        back = spatial.token_major_order()
        assert torch.equal(spatial.dense(n, n)[0, 0][back][:, back], temporal.dense(n, n)[0, 0])
    # The attention agrees: permute q, k, v, attend with the spatial head, permute back.
    temporal = VideoSparse(frames=4, frame_tokens=6, kind="temporal", window=1, text_len=2)
    spatial = VideoSparse(frames=6, frame_tokens=4, kind="spatial", window=1, text_len=2)
    order = temporal.token_major_order()
    q, k, v = (t.detach() for t in qkv(1, 26, 26))
    direct = fz.attention(q, k, v, mask=temporal, backend="dense")
    moved = fz.attention(q[:, :, order], k[:, :, order], v[:, :, order], mask=spatial, backend="dense")
    torch.testing.assert_close(moved[:, :, order.argsort()], direct, rtol=1e-5, atol=1e-6)


def test_video_sparse_block_sparsity_of_each_layout() -> None:
    # CogVideoX-sized: 13 frames of 1350 tokens and 226 text tokens, 128-token blocks; the counts
    # the docstring quotes. ``video`` blocks hold video queries (keys) only.
    n, video = 13 * 1350 + 226, 13 * 1350 // 128

    def counts(**kwargs: object) -> tuple[int, int]:
        bmap = VideoSparse(text_len=226, **kwargs).block_map(n, n, 128, 128, "cpu")  # type: ignore[arg-type]
        assert bmap is not None
        return int(bmap.any[0, 0, :video, :video].sum()), int(bmap.full[0, 0, :video, :video].sum())

    spatial = counts(frames=13, frame_tokens=1350, kind="spatial")
    assert spatial[1] > 0.6 * spatial[0]  # whole frames: mostly full blocks
    # Frame-major temporal head: a stripe in every frame, no full block (window 0); at SVG's width
    # (about 2 frames of positions in token-major order: 206 spatial indices) still few full ones.
    stripes = counts(frames=13, frame_tokens=1350, kind="temporal")
    assert stripes[1] == 0 and stripes[0] > 0.15 * video * video
    wide = counts(frames=13, frame_tokens=1350, kind="temporal", window=206)
    assert wide[1] < 0.25 * wide[0]
    # Token-major (the same heads permuted, frames and frame_tokens swapped): far fewer blocks, and
    # at SVG's width nearly all of them full.
    swapped = counts(frames=1350, frame_tokens=13, kind="spatial")
    assert swapped[0] < stripes[0] / 4
    swapped_wide = counts(frames=1350, frame_tokens=13, kind="spatial", window=206)
    assert swapped_wide[0] < wide[0] and swapped_wide[1] > 0.9 * swapped_wide[0]


def test_video_sparse_special_cases_and_forms() -> None:
    # A spatial head on one frame without extras is chunked attention, with its forms.
    spec = VideoSparse(frames=4, frame_tokens=6, kind="spatial")
    assert torch.equal(spec.dense(24, 24), Chunked(size=6).dense(24, 24))
    _same_varlen(spec.varlen_form(24, 24, 2), Chunked(size=6).varlen_form(24, 24, 2))
    assert torch.equal(
        spec.lowest_visible_key(torch.arange(24)), Chunked(size=6).lowest_visible_key(torch.arange(24))
    )
    assert VideoSparse(frames=4, frame_tokens=6, kind="spatial", sink_frames=1).varlen_form(24, 24, 1) is None
    assert VideoSparse(frames=4, frame_tokens=6, kind="temporal").varlen_form(24, 24, 1) is None
    wide = VideoSparse(frames=5, frame_tokens=3, kind="spatial", window=2)
    assert wide.lowest_visible_key(torch.arange(15)).tolist() == [0] * 9 + [3] * 3 + [6] * 3
    assert VideoSparse(frames=5, frame_tokens=3, kind="temporal").lowest_visible_key(torch.arange(15)) is None
    assert (
        VideoSparse(frames=5, frame_tokens=3, kind="spatial", text_len=1).lowest_visible_key(torch.arange(16))
        is None
    )
    # Everything visible: the window spans the frames (spatial) or the frame (temporal), the
    # problem fits in window + 1 frames, or every key is a sink.
    full = SdpaForm(is_causal=False)
    assert VideoSparse(frames=4, frame_tokens=5, kind="spatial", window=3).sdpa_form(20, 20) == full
    assert (
        VideoSparse(frames=4, frame_tokens=5, kind="temporal", window=4, text_len=2).sdpa_form(22, 22) == full
    )
    assert VideoSparse(frames=4, frame_tokens=5, kind="spatial", window=1).sdpa_form(10, 10) == full
    assert VideoSparse(frames=4, frame_tokens=5, kind="spatial", window=1).sdpa_form(11, 10) is None
    assert VideoSparse(frames=4, frame_tokens=5, kind="temporal", sink_frames=2).sdpa_form(20, 10) == full
    assert VideoSparse(frames=4, frame_tokens=5, kind="temporal", window=3).sdpa_form(20, 20) is None
    assert masks.get("video_sparse", frames=2, frame_tokens=3, kind="temporal") == VideoSparse(
        frames=2, frame_tokens=3, kind="temporal"
    )


def test_video_sparse_convention_next_to_attention_gym() -> None:
    # attention-gym's generate_temporal_head_mask_mod(prompt_length, num_frames, token_per_frame,
    # width), restated: prompt first, dense rows and columns; ``|token(i) - token(j)| < (width *
    # token_per_frame) // num_frames``. With the prompt rolled to the end it is window =
    # (width * token_per_frame) // num_frames - 1.
    prompt, frames, per_frame, width = 3, 4, 10, 2

    def gym(i: int, j: int) -> bool:
        if i < prompt or j < prompt:
            return True
        return abs((i - prompt) % per_frame - (j - prompt) % per_frame) < (width * per_frame) // frames

    n = prompt + frames * per_frame
    spec = VideoSparse(
        frames=frames,
        frame_tokens=per_frame,
        kind="temporal",
        window=(width * per_frame) // frames - 1,
        text_len=prompt,
    )
    roll = (torch.arange(n) + n - prompt) % n  # position in this layout of each prompt-first position
    assert torch.equal(spec.dense(n, n)[0, 0][roll][:, roll], table(n, n, gym)[0, 0])


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (
            {"frames": 0, "frame_tokens": 4, "kind": "spatial"},
            ValueError,
            r"frames=\.\.\.\) must be an int >= 1",
        ),
        ({"frames": 2, "frame_tokens": 0, "kind": "spatial"}, ValueError, r"frame_tokens=\.\.\.\) must be"),
        ({"frames": 2.5, "frame_tokens": 4, "kind": "spatial"}, TypeError, r"frames=\.\.\.\)"),
        ({"frames": 2, "frame_tokens": 4, "kind": "spacial"}, ValueError, r"kind=\.\.\.\) must be one of"),
        ({"frames": 2, "frame_tokens": 4, "kind": 1}, TypeError, r"kind=\.\.\.\) must be a str"),
        ({"frames": 2, "frame_tokens": 4, "kind": "spatial", "window": -1}, ValueError, r"window=\.\.\.\)"),
        (
            {"frames": 2, "frame_tokens": 4, "kind": "temporal", "sink_frames": 3},
            ValueError,
            "at most frames",
        ),
        ({"frames": 2, "frame_tokens": 4, "kind": "temporal", "sink_frames": -1}, ValueError, "sink_frames"),
        ({"frames": 2, "frame_tokens": 4, "kind": "temporal", "text_len": -2}, ValueError, "text_len"),
        ({"frames": 2**20, "frame_tokens": 2**12, "kind": "temporal"}, ValueError, "index range"),
    ],
)
def test_video_sparse_parameter_errors(kwargs: dict[str, object], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        VideoSparse(**kwargs)  # type: ignore[arg-type]


def test_video_sparse_problem_must_fit_the_layout() -> None:
    spec = VideoSparse(frames=3, frame_tokens=4, kind="spatial", text_len=1)
    spec.validate(13, 13, 1, 1)
    with pytest.raises(ValueError, match="has 13 positions"):
        spec.validate(13, 14, 1, 1)
    with pytest.raises(ValueError, match="has 13 positions"):
        fz.attention(*qkv(1, 14, 8), mask=spec)


# ---- attention on the CPU routes ---------------------------------------------------------------

ROUTE_SPECS = {
    "sta_3d_text": SlidingTile(canvas=(3, 4, 6), tile=(1, 2, 3), window=(3, 1, 1), text_len=5),
    "svg_temporal_sink_text": VideoSparse(
        frames=5, frame_tokens=9, kind="temporal", window=1, sink_frames=1, text_len=4
    ),
}


@pytest.mark.parametrize("name", ROUTE_SPECS)
def test_attention_on_cpu_routes_matches_the_reference(name: str) -> None:
    spec = ROUTE_SPECS[name]
    n = spec.tokens  # type: ignore[attr-defined]
    q, k, v = qkv(2, n, n, seed=5)
    # Training: auto picks a CPU route with a backward; output and gradients against float64.
    out = fz.attention(q, k, v, mask=spec)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(out, q, k, v, mask=spec, grads=grads, grad_out=grad_out)
    # Inference: auto takes the compiled CPU flex kernel (the mask_mod traced by Inductor), and
    # naming the route gives the same. Lq != Lkv, the last text queries left out; one compile.
    q, k, v = (t.detach()[:, :, : n - 3] if t is q else t.detach() for t in (q, k, v))
    with torch.no_grad():
        assert fz.plan(q, k, v, mask=spec).backend == "flex_cpu"
        assert_matches_reference(fz.attention(q, k, v, mask=spec), q, k, v, mask=spec)
        flex = fz.attention(q, k, v, mask=spec, backend="flex_cpu")
        assert_matches_reference(flex, q, k, v, mask=spec)


@pytest.mark.parametrize(
    "spec",
    [
        masks.SlidingTile(canvas=(4, 8), tile=(2, 2), window=(1, 3), text_len=5),
        masks.SlidingTile(canvas=(2, 4, 4), tile=(1, 2, 2), window=(1, 1, 1)),
        masks.VideoSparse(frames=4, frame_tokens=6, kind="spatial", window=1, sink_frames=1, text_len=3),
        masks.VideoSparse(frames=4, frame_tokens=6, kind="temporal", window=1, sink_frames=1, text_len=3),
        masks.Natten(canvas=(6, 6), kernel=(3, 3)),
    ],
)
def test_visible_fraction_bounds_shorter_and_uneven_problems(spec) -> None:  # type: ignore[no-untyped-def]
    # The dispatcher's size rules read the bound: it must hold for every length the spec accepts,
    # problems shorter than the layout and Lq != Lkv included.
    tokens = spec.tokens
    for lq, lkv in [(tokens, tokens), (tokens // 2, tokens), (tokens, tokens // 3), (1, tokens), (7, 5)]:
        share = spec.dense(lq, lkv).double().mean().item()
        assert share <= spec.visible_fraction(lq, lkv) + 1e-12, (lq, lkv)
