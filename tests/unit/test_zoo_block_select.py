"""The top-k block selection mask (``block_select``): against an oracle written here from the rule
(a per-pair Python predicate over the listed block numbers, independent of the spec's table and
of its ``dense``), its closed-form block map against torch's ``create_block_mask``, the attention
it stands for (float64 reference, forward and backward), parameter errors, and device moves.

The registry-wide tests (``tests/property``) run its examples through the consistency checks,
every CPU route and ``torch.compile``.
"""

from __future__ import annotations

import pytest
import torch
from zoo_oracles import table

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo._compat import create_block_mask
from flexattn_zoo.masks import BlockSelect
from flexattn_zoo.testing import assert_mask_consistent, assert_matches_reference
from flexattn_zoo.testing.checks import block_mask_map, index_grids


def _rule(
    indices: list, q_block: int, kv_block: int, q_len: int, kv_len: int, b: int = 0, h: int = 0
) -> torch.Tensor:
    """``[1, 1, Lq, Lkv]``: key ``j`` visible to query ``i`` iff ``j``'s block is listed for
    ``i``'s block. ``indices`` is a nested list, 2-D or 4-D (then row ``b``, head ``h``)."""
    rows = indices if not isinstance(indices[0][0], list) else indices[b][h]
    return table(q_len, kv_len, lambda i, j: (j // kv_block) in rows[i // q_block])


def _mod_grid(spec: BlockSelect, q_len: int, kv_len: int, batch: int, heads: int) -> torch.Tensor:
    """The spec's ``mask_mod`` on int32 index grids, as flex's kernels index, ``[B, H, Lq, Lkv]``."""
    out = spec.mask_mod()(*index_grids(batch, heads, q_len, kv_len))
    return torch.broadcast_to(out, (batch, heads, q_len, kv_len))


def _rows(mask: torch.Tensor) -> list[str]:
    return ["".join("#" if x else "." for x in row) for row in mask[0, 0].tolist()]


def _picture() -> list[str]:
    doc = BlockSelect.__doc__ or ""
    return [line.strip() for line in doc.splitlines() if line.strip() and set(line.strip()) <= set("#.")]


SHARED = {
    # name: (indices [n_q_blocks][k], block_size, q_len, kv_len)
    "picture": ([[0, -1], [0, 1], [2, 0], [1, 3]], 2, 8, 8),
    "ragged_ends": ([[1, 0], [2, -1], [-1, -1], [0, 2]], 3, 11, 7),  # cut blocks on both sides
    "duplicates": ([[1, 1, 1], [0, 2, 0], [2, 2, -1]], (4, 5), 10, 13),
    "per_token": ([[0], [1], [0], [2], [1], [-1]], (1, 4), 6, 12),  # NSA-style: one query per row
    "past_the_end": ([[3, 0], [1, 3]], 4, 8, 9),  # block 3 starts at key 12 > Lkv: selects nothing
}


@pytest.mark.parametrize("name", SHARED)
def test_shared_selection_matches_its_rule(name: str) -> None:
    indices, size, q_len, kv_len = SHARED[name]
    spec = BlockSelect(indices=indices, block_size=size, num_kv_blocks=4)
    q_block, kv_block = (size, size) if isinstance(size, int) else size
    want = _rule(indices, q_block, kv_block, q_len, kv_len)
    assert torch.equal(spec.dense(q_len, kv_len), want)
    assert torch.equal(_mod_grid(spec, q_len, kv_len, 1, 1)[:1, :1], want)
    blocks = ((q_block, kv_block), (4, 4), (3, 5), (16, 32), (2 * q_block, kv_block))
    assert_mask_consistent(spec, q_len, kv_len, block_sizes=blocks)


def test_per_batch_and_head_selection_matches_its_rule() -> None:
    gen = torch.Generator().manual_seed(5)
    indices = torch.randint(-1, 6, (2, 3, 5, 2), generator=gen)
    spec = BlockSelect(indices=indices, block_size=(7, 5), num_kv_blocks=6)
    assert spec.uses_batch() and spec.uses_head()
    nested = indices.tolist()
    got_dense = spec.dense(33, 29, batch=2, heads=3)
    got_mod = _mod_grid(spec, 33, 29, 2, 3)
    for b in range(2):
        for h in range(3):
            want = _rule(nested, 7, 5, 33, 29, b, h)[0, 0]
            assert torch.equal(got_dense[b, h], want) and torch.equal(got_mod[b, h], want)
    assert_mask_consistent(spec, 33, 29, batch=2, heads=3, block_sizes=((7, 5), (16, 32), (4, 4)))
    shared_heads = BlockSelect(indices=indices[:, :1], block_size=4, num_kv_blocks=6)
    assert shared_heads.uses_batch() and not shared_heads.uses_head()


def test_docstring_picture_and_conventions() -> None:
    spec = BlockSelect(indices=[[0, -1], [0, 1], [2, 0], [1, 3]], block_size=2)
    assert _rows(spec.dense(8, 8)) == _picture()
    # num_kv_blocks defaults to the largest index + 1; block_size is stored as a (q, kv) pair.
    assert spec.num_kv_blocks == 4 and spec.block_size == (2, 2)
    assert spec == BlockSelect(indices=torch.tensor([[[[0, -1], [0, 1], [2, 0], [1, 3]]]]), block_size=(2, 2))
    # Duplicates and the order within a row change nothing; -1 anywhere means "no block".
    same = BlockSelect(indices=[[-1, 0, 0], [1, 0, 1], [0, 2, -1], [3, -1, 1]], block_size=2)
    assert torch.equal(same.dense(8, 8), spec.dense(8, 8))
    assert torch.equal(_mod_grid(same, 8, 8, 1, 1), _mod_grid(spec, 8, 8, 1, 1))
    assert masks.get("block_select", indices=[[0]], block_size=4) == BlockSelect(indices=[[0]], block_size=4)


@pytest.mark.parametrize(("q_len", "kv_len"), [(64, 64), (61, 50), (64, 40)])
def test_block_map_at_its_own_size_is_create_block_masks_with_no_partial_block(
    q_len: int, kv_len: int
) -> None:
    gen = torch.Generator().manual_seed(q_len + kv_len)
    indices = torch.randint(-1, 4, (2, 2, 4, 3), generator=gen)
    spec = BlockSelect(indices=indices, block_size=16, num_kv_blocks=4)
    bmap = spec.block_map(q_len, kv_len, 16, 16, "cpu")
    assert bmap is not None
    made = create_block_mask(spec.mask_mod(), 2, 2, q_len, kv_len, device="cpu", BLOCK_SIZE=(16, 16))
    want_any, want_full = block_mask_map(made, bmap.any.shape[-1])
    assert torch.equal(bmap.any, want_any) and torch.equal(bmap.full, want_full)
    # Every selected block is full, but where the sequence end cuts it.
    n_q, n_kv = -(-q_len // 16), -(-kv_len // 16)
    complete = (torch.arange(n_q) < q_len // 16)[:, None] & (torch.arange(n_kv) < kv_len // 16)[None, :]
    assert torch.equal(bmap.full, bmap.any & complete)
    # fz.block_mask at the selection's size: a BlockMask straight from the indices.
    built = fz.block_mask(spec, q_len, kv_len, batch=2, heads=2, block_size=16)
    got_any, got_full = block_mask_map(built, n_kv)
    assert torch.equal(got_any, want_any) and torch.equal(got_full, want_full)
    if q_len % 16 == 0 and kv_len % 16 == 0:
        assert int(built.kv_num_blocks.sum()) == 0  # no partial block: mask_mod never runs


def test_block_map_at_other_sizes_is_create_block_masks() -> None:
    gen = torch.Generator().manual_seed(11)
    indices = torch.randint(-1, 9, (1, 2, 7, 4), generator=gen)
    spec = BlockSelect(indices=indices, block_size=(24, 40), num_kv_blocks=9)
    for q_block, kv_block in ((16, 16), (48, 80), (32, 128), (128, 16)):
        bmap = spec.block_map(150, 333, q_block, kv_block, "cpu")
        assert bmap is not None
        made = create_block_mask(
            spec.mask_mod(), None, 2, 150, 333, device="cpu", BLOCK_SIZE=(q_block, kv_block)
        )
        want_any, want_full = block_mask_map(made, bmap.any.shape[-1])
        assert torch.equal(bmap.any.expand_as(want_any), want_any), (q_block, kv_block)
        assert torch.equal(bmap.full.expand_as(want_full), want_full), (q_block, kv_block)


def test_block_map_at_scale_reads_only_the_table() -> None:
    # 128k tokens, 1024 blocks of 128 a side, 64 selected per query block and head: no L x L work.
    gen = torch.Generator().manual_seed(0)
    indices = torch.rand(1, 4, 1024, 1024, generator=gen).topk(64, dim=-1).indices
    spec = BlockSelect(indices=indices, block_size=128)
    bmap = spec.block_map(1 << 17, 1 << 17, 128, 128, "cpu")
    assert bmap is not None and int(bmap.full.sum()) == 4 * 1024 * 64 == int(bmap.any.sum())
    # At 256-wide kernel blocks a block holds 2 x 2 selection blocks: full only if all four are.
    coarse = spec.block_map(1 << 17, 1 << 17, 256, 256, "cpu")
    assert coarse is not None and coarse.any.shape[-2:] == (512, 512)
    cells = spec.block_map(1 << 17, 1 << 17, 128, 128, "cpu").any.view(1, 4, 512, 2, 512, 2)  # type: ignore[union-attr]
    assert torch.equal(coarse.any, cells.any(5).any(3)) and torch.equal(coarse.full, cells.all(5).all(3))


def test_with_causal() -> None:
    indices = [[0, -1], [0, 1], [2, 0], [1, 3]]
    spec = BlockSelect(indices=indices, block_size=4) & masks.Causal()
    want = _rule(indices, 4, 4, 16, 16) & torch.ones(16, 16, dtype=torch.bool).tril()
    assert torch.equal(spec.dense(16, 16), want)
    assert_mask_consistent(spec, 16, 16, block_sizes=((4, 4), (16, 32)), exact_blocks=True)
    bmap = spec.block_map(16, 16, 4, 4, "cpu")
    assert bmap is not None
    # Selected blocks below the diagonal are full, the selected diagonal ones partial.
    assert bmap.full[0, 0].nonzero().tolist() == [[1, 0], [2, 0], [3, 1]]
    assert (bmap.any & ~bmap.full)[0, 0].nonzero().tolist() == [[0, 0], [1, 1], [2, 2], [3, 3]]


def test_from_block_scores() -> None:
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.2], [0.3, 0.2, 0.8, 0.7]])
    spec = BlockSelect.from_block_scores(scores, 2, block_size=8)
    assert spec.indices.tolist() == [[[[1, 2], [2, 3]]]] and spec.num_kv_blocks == 4
    # Causal selection: future blocks scored -inf are never taken; short rows are padded with -1.
    causal = (
        torch.tensor([[1.0, 2.0, 3.0]])
        .expand(3, 3)
        .tril()
        .masked_fill(~torch.ones(3, 3).tril().bool(), -torch.inf)
    )
    picked = BlockSelect.from_block_scores(causal, 2, block_size=4)
    assert picked.indices[0, 0].tolist() == [[0, -1], [1, 0], [2, 1]]
    assert BlockSelect.from_block_scores(scores, 9, block_size=8).indices.shape[-1] == 4  # all blocks
    with pytest.raises(TypeError, match="floating"):
        BlockSelect.from_block_scores(torch.ones(2, 2, dtype=torch.int64), 1, block_size=8)
    with pytest.raises(ValueError, match="shape"):
        BlockSelect.from_block_scores(torch.ones(2, 2, 2), 1, block_size=8)
    with pytest.raises(ValueError, match="topk"):
        BlockSelect.from_block_scores(scores, 0, block_size=8)


# ---- attention --------------------------------------------------------------------------------


def _inputs(batch: int, heads: int, q_len: int, kv_len: int, grad: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(q_len * kv_len)
    q = torch.randn(batch, heads, q_len, 16, generator=g).requires_grad_(grad)
    k = torch.randn(batch, heads, kv_len, 16, generator=g).requires_grad_(grad)
    v = torch.randn(batch, heads, kv_len, 16, generator=g).requires_grad_(grad)
    return q, k, v


def _per_head_spec() -> BlockSelect:
    # Per head; row 3 of head 1 selects nothing (its queries see no key: output 0).
    indices = torch.tensor(
        [[[[0, 2], [1, -1], [3, 0], [2, 2]], [[1, 3], [0, -1], [2, 3], [-1, -1]]]], dtype=torch.int64
    )
    return BlockSelect(indices=indices, block_size=(16, 20), num_kv_blocks=4)


def test_attention_auto_forward_and_backward_matches_the_reference() -> None:
    spec = _per_head_spec()
    q, k, v = _inputs(2, 2, 61, 70, grad=True)
    assert fz.plan(q, k, v, mask=spec).backend == "dense"  # the CPU training route
    out = fz.attention(q, k, v, mask=spec)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(out, q, k, v, mask=spec, grads=grads, grad_out=grad_out)
    assert bool((out[:, 1, 48:] == 0).all())  # the empty row block
    # The head matters: head 0's selection applied to head 1 gives another result.
    swapped = BlockSelect(indices=spec.indices.flip(1), block_size=(16, 20), num_kv_blocks=4)
    assert not torch.allclose(fz.attention(q, k, v, mask=swapped), out)


def test_attention_flex_cpu_matches_the_reference() -> None:
    spec = _per_head_spec()
    q, k, v = _inputs(2, 2, 61, 70, grad=False)
    out = fz.attention(q, k, v, mask=spec, backend="flex_cpu")
    assert_matches_reference(out, q, k, v, mask=spec)
    # The BlockMask built at the selection's own grid, passed as the mask: no block is partial.
    shared = BlockSelect(indices=spec.indices[:, :1], block_size=16, num_kv_blocks=5)
    bm = fz.block_mask(shared, 64, 80, block_size=16)
    assert int(bm.kv_num_blocks.sum()) == 0
    q, k, v = _inputs(2, 2, 64, 80, grad=False)
    out = fz.attention(q, k, v, mask=bm, backend="flex_cpu")
    assert_matches_reference(out, q, k, v, mask=shared)


# ---- errors, devices, state -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (
            {"indices": [[0.0, 1.0]], "block_size": 4},
            TypeError,
            r"indices=\.\.\.\) must be an integer tensor",
        ),
        ({"indices": torch.ones(2, 2, dtype=torch.bool), "block_size": 4}, TypeError, "dtype torch.bool"),
        ({"indices": "ab", "block_size": 4}, TypeError, "indices"),
        ({"indices": torch.zeros(2, 3, 4, dtype=torch.int64), "block_size": 4}, ValueError, "ambiguous"),
        ({"indices": [0, 1], "block_size": 4}, ValueError, r"\[n_q_blocks, k\]"),
        ({"indices": torch.zeros(3, 0, dtype=torch.int64), "block_size": 4}, ValueError, "every size"),
        ({"indices": [], "block_size": 4}, ValueError, "every size"),  # not a dtype complaint
        ({"indices": [[0, -2]], "block_size": 4}, ValueError, r"\[0, num_kv_blocks = 1\) or -1.*got -2"),
        ({"indices": [[0, 5]], "block_size": 4, "num_kv_blocks": 5}, ValueError, "got 5"),
        ({"indices": [[0]], "block_size": 0}, ValueError, r"block_size=\.\.\.\) must be an int >= 1"),
        ({"indices": [[0]], "block_size": True}, TypeError, "block_size"),
        ({"indices": [[0]], "block_size": 2.5}, TypeError, "block_size"),
        ({"indices": [[0]], "block_size": (4, 4, 4)}, ValueError, r"\(q_block, kv_block\) pair"),
        ({"indices": [[0]], "block_size": (4, -1)}, ValueError, "block_size"),
        ({"indices": [[0]], "block_size": 4, "num_kv_blocks": 0}, ValueError, "num_kv_blocks"),
        ({"indices": [[0]], "block_size": 4, "num_kv_blocks": "3"}, TypeError, "num_kv_blocks"),
    ],
)
def test_parameter_errors(kwargs: dict[str, object], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        BlockSelect(**kwargs)  # type: ignore[arg-type]


def test_problem_must_fit_the_selection() -> None:
    spec = BlockSelect(indices=torch.zeros(1, 2, 3, 1, dtype=torch.int64), block_size=4, num_kv_blocks=2)
    spec.validate(12, 8, 5, 2)
    with pytest.raises(ValueError, match=r"3 query-block rows, but Lq = 13 needs ceil\(Lq / 4\) = 4"):
        spec.validate(13, 8, 1, 2)
    with pytest.raises(ValueError, match="pass num_kv_blocks=3"):
        spec.validate(12, 9, 1, 2)
    with pytest.raises(ValueError, match="head count"):
        spec.validate(12, 8, 1, 4)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        fz.attention(*_inputs(1, 2, 12, 9, grad=False), mask=spec)


def test_device_moves_and_state() -> None:
    buf = torch.tensor([[0, 1], [1, -1]])
    spec = BlockSelect(indices=buf, block_size=4)
    before = spec.dense(8, 8)
    buf.fill_(0)  # the spec owns a copy, and its table was made from the values it was given
    assert torch.equal(spec.dense(8, 8), before)
    assert torch.equal(_mod_grid(spec, 8, 8, 1, 1), before)
    # A moved spec has its own table on the new device (meta here: CPU-only CI), another
    # mask_mod, and compares unequal; nothing of it is read (num_kv_blocks is carried over).
    moved = spec.to("meta")
    assert moved.indices.device.type == "meta" and moved.__dict__["_table"].device.type == "meta"
    assert moved != spec and moved.num_kv_blocks == spec.num_kv_blocks
    assert moved.mask_mod() is not spec.mask_mod() and spec.to("cpu") is spec
    with pytest.raises(ValueError, match="num_kv_blocks"):
        BlockSelect(indices=torch.zeros(1, 1, dtype=torch.int64, device="meta"), block_size=4)
    # A new selection in the same buffer is a new spec: BlockMasks are never stale.
    buf.copy_(torch.tensor([[0, 1], [1, -1]]))
    first = fz.block_mask(BlockSelect(indices=buf, block_size=16), 32, 32, block_size=16)
    buf.copy_(torch.tensor([[1, 0], [0, -1]]))
    second = fz.block_mask(BlockSelect(indices=buf, block_size=16), 32, 32, block_size=16)
    assert block_mask_map(first, 2)[0][0, 0].tolist() == [[True, True], [False, True]]
    assert block_mask_map(second, 2)[0][0, 0].tolist() == [[True, True], [True, False]]


def test_visible_fraction_is_an_upper_bound() -> None:
    spec = _per_head_spec()
    share = float(spec.dense(61, 70, heads=2).float().mean(dim=(2, 3)).max())
    assert share <= spec.visible_fraction(61, 70) <= 1.0
    assert spec.visible_fraction(61, 70) == pytest.approx(2 * 20 / 70)


def test_nan_block_scores_are_never_selected() -> None:
    # torch's topk ranks NaN first; a NaN is no score, so it is passed over like -inf.
    spec = masks.BlockSelect.from_block_scores(torch.tensor([[float("nan"), 1.0, 0.5]]), 1, block_size=2)
    assert spec.indices.flatten().tolist() == [1]
