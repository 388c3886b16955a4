"""The mask families from attention-gym's catalogue and beyond (NATTEN, dilated windows, block
diffusion, global + window, Flamingo cross-attention): each against an oracle written here from
the family's own definition (independent of both the spec's ``mask_mod`` and its ``dense``), the
conventions stated next to attention-gym's, forms, and parameter errors.

The registry-wide tests (``tests/property``) already run every example of these specs through
the consistency checks and every CPU route; this file checks that those definitions are the
right ones. Nothing here compiles: the routes are ``dense`` and the reference.
"""

from __future__ import annotations

import math

import pytest
import torch
from zoo_oracles import mask_mod_dense, qkv, table

import flexattn_zoo as fz
from flexattn_zoo.masks import (
    BlockDiffusion,
    DilatedSlidingWindow,
    FlamingoCross,
    GlobalWindow,
    Natten,
    SlidingTile,
    SlidingWindow,
)
from flexattn_zoo.testing import assert_mask_consistent, assert_matches_reference

# ---- natten ------------------------------------------------------------------------------------


def _natten_loops(canvas: tuple[int, ...], kernel: tuple[int, ...]) -> torch.Tensor:
    """NATTEN from coordinates: a query's window on each axis starts at ``x - K // 2``, moved
    inside the grid when that would leave it."""
    cells = math.prod(canvas)

    def coords(p: int) -> list[int]:
        out = []
        for size in reversed(canvas):
            out.append(p % size)
            p //= size
        return out[::-1]

    def sees(i: int, j: int) -> bool:
        for x, y, size, k in zip(coords(i), coords(j), canvas, kernel, strict=True):
            first = x - k // 2
            first = max(0, min(first, size - k))
            if not first <= y < first + k:
                return False
        return True

    return table(cells, cells, sees)


@pytest.mark.parametrize(
    ("canvas", "kernel"),
    [((9,), (3,)), ((5, 7), (3, 5)), ((4, 6), (3, 1)), ((3, 4, 5), (3, 3, 5)), ((2, 3, 4), (1, 3, 3))],
)
def test_natten_matches_coordinate_loops(canvas: tuple[int, ...], kernel: tuple[int, ...]) -> None:
    spec, want = Natten(canvas=canvas, kernel=kernel), _natten_loops(canvas, kernel)
    n = math.prod(canvas)
    assert torch.equal(spec.dense(n, n), want) and torch.equal(mask_mod_dense(spec, n, n), want)
    assert int(want.sum(-1).min()) == int(want.sum(-1).max()) == math.prod(kernel)  # never shrinks
    assert_mask_consistent(spec, n, n - 3, block_sizes=((4, 4), (5, 7)))


def _attention_gym_natten(canvas_w: int, canvas_h: int, kernel_w: int, kernel_h: int) -> torch.Tensor:
    """attention-gym's generate_natten rule, restated: x = p // canvas_w and y = p % canvas_w,
    the kernel centre clamped to [k // 2, canvas - 1 - k // 2] with (canvas_w, kernel_w) for x and
    (canvas_h, kernel_h) for y, keys within k // 2 of it."""
    n = canvas_w * canvas_h

    def sees(i: int, j: int) -> bool:
        qx, qy, kx, ky = i // canvas_w, i % canvas_w, j // canvas_w, j % canvas_w
        cx = min(max(qx, kernel_w // 2), canvas_w - 1 - kernel_w // 2)
        cy = min(max(qy, kernel_h // 2), canvas_h - 1 - kernel_h // 2)
        return abs(cx - kx) <= kernel_w // 2 and abs(cy - ky) <= kernel_h // 2

    return table(n, n, sees)


def test_natten_convention_next_to_attention_gym() -> None:
    # Square canvas and kernel: the same mask.
    assert torch.equal(Natten(canvas=(6, 6), kernel=(3, 3)).dense(36, 36), _attention_gym_natten(6, 6, 3, 3))
    # A wide canvas: attention-gym clamps rows with the width's bounds; NATTEN (and this spec) not.
    assert not torch.equal(
        Natten(canvas=(3, 6), kernel=(3, 3)).dense(18, 18), _attention_gym_natten(6, 3, 3, 3)
    )


def test_natten_forms_and_scale() -> None:
    assert Natten(canvas=(3, 5), kernel=(3, 5)).sdpa_form(15, 15) is not None
    assert Natten(canvas=(3, 5), kernel=(3, 3)).sdpa_form(15, 15) is None
    one_d = Natten(canvas=10, kernel=5)
    assert one_d.lowest_visible_key(torch.arange(10)).tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 5, 5]
    assert Natten(canvas=(3, 3), kernel=3).lowest_visible_key(torch.arange(9)) is None
    # A 1024 x 1024 image (1M tokens): 1024-token blocks, never an element-wise evaluation.
    bmap = Natten(canvas=(1024, 1024), kernel=(7, 7)).block_map(1 << 20, 1 << 20, 1024, 1024, "cpu")
    assert bmap is not None and bmap.any.shape[-2:] == (1024, 1024)
    assert int(bmap.any.sum()) == 1024 * 7  # a block is an image row; its window spans 7 rows


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"canvas": (4, 4), "kernel": 2}, ValueError, "odd"),
        ({"canvas": (4, 4), "kernel": (5, 3)}, ValueError, "at most the canvas"),
        ({"canvas": (4, 4), "kernel": (3, 3, 3)}, ValueError, "one size per canvas axis"),
        ({"canvas": (2, 2, 2, 2), "kernel": 1}, ValueError, "1 to 3 axes"),
        ({"canvas": "8x8", "kernel": 3}, TypeError, "tuple of 1 to 3 ints"),
        ({"canvas": (4, 0), "kernel": 1}, ValueError, ">= 1"),
    ],
)
def test_natten_parameter_errors(kwargs: dict[str, object], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        Natten(**kwargs)  # type: ignore[arg-type]


def test_grid_extents_as_tensors_or_arrays_are_sequences() -> None:
    # A 1-D tensor or array has __index__ like a scalar (it raises for several elements), so it was
    # taken for one extent and refused as "must be an int".
    np = pytest.importorskip("numpy")
    want = Natten(canvas=(4, 6), kernel=(3, 5))
    assert Natten(canvas=torch.tensor([4, 6]), kernel=np.array([3, 5])) == want
    assert Natten(canvas=np.array([4, 6]), kernel=torch.tensor(3)) == Natten(canvas=(4, 6), kernel=3)
    tile = SlidingTile(canvas=np.array([4, 8]), tile=torch.tensor([2, 2]), window=np.array([1, 3]))
    assert tile == SlidingTile(canvas=(4, 8), tile=(2, 2), window=(1, 3))
    with pytest.raises(TypeError, match=r"Natten\(canvas=...\) must be an int >= 1, got float"):
        Natten(canvas=torch.tensor([4.0, 6.0]), kernel=3)


def test_natten_needs_a_canvas_holding_the_problem() -> None:
    with pytest.raises(ValueError, match="12 tokens"):
        fz.attention(*qkv(1, 13, 13), mask=Natten(canvas=(3, 4), kernel=3))


# ---- dilated_sliding_window --------------------------------------------------------------------


def test_dilated_window_definition_and_attention_gym_convention() -> None:
    for left, right, d in ((6, 0, 2), (5, 4, 3), (0, 7, 2), (3, 3, 4)):
        want = table(20, 23, lambda i, j: -left <= j - i <= right and (j - i) % d == 0)  # noqa: B023
        spec = DilatedSlidingWindow(left=left, right=right, dilation=d)
        assert torch.equal(spec.dense(20, 23), want) and torch.equal(mask_mod_dense(spec, 20, 23), want)
    # attention-gym's generate_dilated_sliding_window(window_size=w, dilation=d): |i - j| <= w and
    # |i - j| % d == 0, i.e. left = right = w.
    gym = table(24, 24, lambda i, j: abs(i - j) <= 4 and abs(i - j) % 2 == 0)
    assert torch.equal(DilatedSlidingWindow(left=4, right=4, dilation=2).dense(24, 24), gym)


def test_dilated_window_of_stride_one_is_the_sliding_window_with_its_forms() -> None:
    for left, right in ((3, 0), (2, 5), (40, 40)):
        spec, plain = DilatedSlidingWindow(left=left, right=right), SlidingWindow(left=left, right=right)
        assert torch.equal(spec.dense(41, 41), plain.dense(41, 41))
        assert spec.varlen_form(41, 41, 1) == plain.varlen_form(41, 41, 1)
        assert spec.sdpa_form(41, 41) == plain.sdpa_form(41, 41)
    assert DilatedSlidingWindow(left=4, dilation=2).varlen_form(9, 9, 1) is None
    diagonal = DilatedSlidingWindow(left=1, right=2, dilation=3)  # only the query's own key
    assert diagonal.varlen_form(9, 9, 1) == SlidingWindow(left=0).varlen_form(9, 9, 1)
    assert DilatedSlidingWindow(left=4, right=1, dilation=2).hides_future_keys(9, 9)
    assert not DilatedSlidingWindow(left=4, right=2, dilation=2).hides_future_keys(9, 9)
    assert DilatedSlidingWindow(left=4, dilation=2).lowest_visible_key(torch.arange(5)) is None
    assert torch.equal(
        DilatedSlidingWindow(left=1, right=6, dilation=2).lowest_visible_key(torch.arange(5)), torch.arange(5)
    )


# ---- block_diffusion ---------------------------------------------------------------------------


def _bd3lm(block_size: int, n: int, q_len: int, kv_len: int) -> torch.Tensor:
    """BD3-LM's rule, restated: x_t is [0, n), x_0 is [n, 2n); blocks counted in each copy."""

    def sees(i: int, j: int) -> bool:
        q_x0, k_x0 = i >= n, j >= n
        bq = (i - n if q_x0 else i) // block_size
        bk = (j - n if k_x0 else j) // block_size
        diagonal = bq == bk and q_x0 == k_x0
        offset_causal = bq > bk and k_x0 and not q_x0
        causal = bq >= bk and k_x0 and q_x0
        return diagonal or offset_causal or causal

    return table(q_len, kv_len, sees)


@pytest.mark.parametrize(
    ("block_size", "n", "q_len", "kv_len"),
    [(4, 16, 32, 32), (3, 10, 20, 20), (5, 12, 30, 17), (1, 6, 12, 12)],
)
def test_block_diffusion_is_bd3lm_training_mask(block_size: int, n: int, q_len: int, kv_len: int) -> None:
    spec, want = BlockDiffusion(block_size=block_size, noisy_len=n), _bd3lm(block_size, n, q_len, kv_len)
    assert torch.equal(spec.dense(q_len, kv_len), want)
    assert torch.equal(mask_mod_dense(spec, q_len, kv_len), want)


def test_block_diffusion_noisy_blocks_never_read_their_own_clean_tokens() -> None:
    # Changing the clean copy of block 2 (and later) leaves the outputs of noisy blocks 0..2 alone.
    spec = BlockDiffusion(block_size=4, noisy_len=16)
    q, k, v = (t.detach() for t in qkv(1, 32, 32))
    out = fz.attention(q, k, v, mask=spec, backend="dense")
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 16 + 8 :], v2[:, :, 16 + 8 :] = 5.0, -3.0
    again = fz.attention(q, k2, v2, mask=spec, backend="dense")
    assert torch.equal(out[:, :, :12], again[:, :, :12]) and not torch.equal(
        out[:, :, 12:16], again[:, :, 12:16]
    )


# ---- global_window -----------------------------------------------------------------------------


def test_global_window_definition_per_row() -> None:
    flags = torch.zeros(2, 30, dtype=torch.bool)
    flags[0, [0, 17]] = True
    flags[1, 29] = True
    spec = GlobalWindow(is_global=flags, left=3, right=2)
    for r in range(2):
        g = flags[r].tolist()
        want = table(30, 26, lambda i, j: -3 <= j - i <= 2 or g[i] or g[j])  # noqa: B023
        assert torch.equal(spec.dense(30, 26, batch=2)[r : r + 1], want)
        assert torch.equal(mask_mod_dense(spec, 30, 26, batch=2)[r : r + 1], want)
    assert GlobalWindow.from_positions([0, 17], 30, left=3, right=2) == GlobalWindow(
        is_global=flags[0], left=3, right=2
    )
    # Longformer: attention_window=w is left=right=w // 2, with its global_attention_mask as flags.
    assert GlobalWindow(is_global=[1, 0, 0, 0], left=2, right=2).is_global.dtype == torch.bool
    bmap = GlobalWindow.from_positions([0, 5000], 1 << 20, left=512, right=512).block_map(
        1 << 20, 1 << 20, 1024, 1024, "cpu"
    )
    assert bmap is not None and bmap.any.shape[-2:] == (1024, 1024)
    with pytest.raises(ValueError, match="must lie in"):
        GlobalWindow.from_positions([30], 30, left=1)
    # Longformer's attention_mask (0 padding, 1 local, 2 global) is not a flag tensor: taken as
    # "non-zero is global" it made every token global. Refused, with the spelling that works.
    longformer = torch.tensor([[2, 1, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match=r"0/1 integer flags, got values \[0, 1, 2\].*attention_mask == 2"):
        GlobalWindow(is_global=longformer, left=1, right=1)
    assert GlobalWindow(is_global=longformer == 2, left=1, right=1).is_global.tolist() == [[1, 0, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="2 rows but the batch size is 3"):
        spec.validate(30, 30, 3, 1)


@pytest.mark.parametrize(
    ("positions", "error", "match"),
    [
        ([1.9], TypeError, "must hold integers"),  # a cast would truncate it to position 1
        (torch.tensor([2.5]), TypeError, "must hold integers"),
        ([True], TypeError, "must hold ints, got a bool"),
        ([[0, 1], [2, 3]], ValueError, "must be 1-D"),  # a cast would flatten it
        ("ab", TypeError, "must be a list of ints"),
    ],
)
def test_position_helpers_refuse_non_integer_positions(positions, error, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=rf"GlobalWindow.from_positions\(positions=...\) {match}"):
        GlobalWindow.from_positions(positions, 5, left=1)
    what = r"FlamingoCross.from_image_positions\(image_positions=...\)"
    with pytest.raises(error, match=rf"{what} {match}"):
        FlamingoCross.from_image_positions(positions, tokens_per_image=2, text_len=5)


# ---- flamingo_cross ----------------------------------------------------------------------------


def test_flamingo_cross_from_image_positions_and_both_rules() -> None:
    # Images of 3 tokens before text tokens 2, 5 and 5: image 1 is followed by image 2 directly.
    spec = FlamingoCross.from_image_positions([2, 5, 5], tokens_per_image=3, text_len=9)
    assert spec.last_image.tolist() == [-1, -1, 0, 0, 0, 2, 2, 2, 2]
    assert spec.key_image.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    image = [0, 0, 0, 1, 1, 1, 2, 2, 2]
    last = spec.last_image.tolist()
    want_last = table(9, 9, lambda i, j: image[j] == last[i])
    want_all = table(9, 9, lambda i, j: 0 <= image[j] <= last[i])
    every = FlamingoCross(last_image=spec.last_image, key_image=spec.key_image, attend="all")
    for s, want in ((spec, want_last), (every, want_all)):
        assert torch.equal(s.dense(9, 9), want) and torch.equal(mask_mod_dense(s, 9, 9), want)
        assert_mask_consistent(s, 9, 9, block_sizes=((2, 2), (4, 3)))
    # Text before the first image attends to nothing: output 0, not NaN, on every route here.
    q, k, v = qkv(1, 9, 9)
    out = fz.attention(q, k, v, mask=spec, backend="dense")
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))
    assert_matches_reference(out, q, k, v, mask=spec)


def test_flamingo_cross_attention_gym_intervals() -> None:
    # attention-gym gives image k to the text tokens of intervals[k] = [start, end). Flamingo's
    # rule is the tiling case: image k from its own position to the next image's.
    tiling = [(0, 1), (1, 7), (7, 12)]
    gym = table(12, 9, lambda i, j: tiling[j // 3][0] <= i < tiling[j // 3][1])
    spec = FlamingoCross.from_image_positions([0, 1, 7], tokens_per_image=3, text_len=12)
    assert torch.equal(spec.dense(12, 9), gym)
    # Its own example, [[0, 7], [1, 7], [7, 12]] (tokens 1..6 see images 0 and 1, tokens 7.. only
    # image 2), follows neither rule: a per-image interval this spec does not state.
    example = [(0, 7), (1, 7), (7, 12)]
    gym = table(12, 9, lambda i, j: example[j // 3][0] <= i < example[j // 3][1])
    for attend in ("last", "all"):
        s = FlamingoCross(last_image=spec.last_image, key_image=spec.key_image, attend=attend)  # type: ignore[arg-type]
        assert not torch.equal(s.dense(12, 9), gym)


def test_flamingo_cross_errors() -> None:
    with pytest.raises(ValueError, match="-1 for none"):
        FlamingoCross(last_image=[-2, 0], key_image=[0, 0])
    with pytest.raises(ValueError, match="attend"):
        FlamingoCross(last_image=[0], key_image=[0], attend="first")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-decreasing"):
        FlamingoCross.from_image_positions([3, 1], tokens_per_image=2, text_len=5)
    with pytest.raises(ValueError, match="Lkv = 7"):
        FlamingoCross.from_image_positions([0, 2], tokens_per_image=3, text_len=5).validate(5, 7, 1, 1)
