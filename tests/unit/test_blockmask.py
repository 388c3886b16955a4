"""fz.block_mask: closed form and generic builders equal torch's create_block_mask, and the cache."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flexattn_zoo as fz
from flexattn_zoo import _compat, masks
from flexattn_zoo.blockmask import CACHE, _ordered
from flexattn_zoo.compose import Not


def _same_block_mask(ours, theirs) -> None:  # type: ignore[no-untyped-def]
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    # Indices: the live prefix of every row must list the same blocks in the same order.
    for num, idx in (
        ("kv_num_blocks", "kv_indices"),
        ("full_kv_num_blocks", "full_kv_indices"),
        ("q_num_blocks", "q_indices"),
        ("full_q_num_blocks", "full_q_indices"),
    ):
        n, a, b = getattr(ours, num), getattr(ours, idx), getattr(theirs, idx)
        live = torch.arange(a.shape[-1]) < n.unsqueeze(-1)
        assert torch.equal(a[live], b[live]), idx
    assert ours.seq_lengths == theirs.seq_lengths
    assert torch.equal(ours.to_dense(), theirs.to_dense())


SPECS = [
    masks.Full(),
    masks.Causal(),
    masks.Causal(align="bottom_right"),
    masks.SlidingWindow(left=70, right=5),
    masks.Chunked(size=96) & masks.Causal(),
    masks.PrefixLM(prefix_len=150),
    masks.Document.from_lengths([100, 300, 33, 167]),
    masks.Document.from_lengths([100, 300, 33, 167]) & masks.Causal(),
    ~masks.SlidingWindow(left=40),  # closed form through Not
    masks.Document(doc_ids=(torch.arange(600) // 50) % 3),  # unsorted ids: generic builder
]


@settings(max_examples=12, deadline=None)
@given(
    spec_i=st.integers(0, len(SPECS) - 1),
    lq=st.integers(1, 600),
    lkv=st.integers(1, 600),
    blocks=st.sampled_from([(128, 128), (64, 128), (128, 64), (32, 32)]),
)
def test_block_mask_equals_create_block_mask(spec_i: int, lq: int, lkv: int, blocks: tuple[int, int]) -> None:
    spec = SPECS[spec_i]
    ours = fz.block_mask(spec, lq, lkv, block_size=blocks)
    theirs = _compat.create_block_mask(
        spec.bind(lq, lkv).mask_mod(), None, None, lq, lkv, device="cpu", BLOCK_SIZE=blocks
    )
    if isinstance(spec, Not):
        # ~ keeps incomplete edge blocks partial (a safe superset); compare visibility only.
        assert torch.equal(ours.to_dense() | theirs.to_dense(), ours.to_dense())
        return
    if any(isinstance(p, masks.Causal) for p in getattr(spec, "parts", ())) and blocks[0] != blocks[1]:
        # & of two partial blocks may be empty: our map keeps it partial (safe superset).
        assert torch.equal(ours.to_dense() | theirs.to_dense(), ours.to_dense())
        return
    _same_block_mask(ours, theirs)


def test_per_batch_spec_keeps_batch_dim_and_others_collapse() -> None:
    ids = torch.tensor([[0] * 200 + [1] * 56, [0] * 10 + [1] * 246])
    bm = fz.block_mask(masks.Document(doc_ids=ids), 256, 256, batch=2, heads=8)
    assert bm.kv_num_blocks.shape[:2] == (2, 1)
    assert fz.block_mask(masks.Causal(), 256, 256, batch=2, heads=8).kv_num_blocks.shape[:2] == (1, 1)
    with pytest.raises(ValueError, match="pass batch="):
        fz.block_mask(masks.Document(doc_ids=ids), 256, 256)


def test_cache_hits_for_equal_specs() -> None:
    a = fz.block_mask(masks.SlidingWindow(left=77), 300, 300)
    b = fz.block_mask(masks.SlidingWindow(left=77), 300, 300)
    assert a is b
    ids = torch.arange(300) // 100
    assert fz.block_mask(masks.Document(doc_ids=ids), 300, 300) is fz.block_mask(
        masks.Document(doc_ids=ids.clone()), 300, 300
    )
    assert len(CACHE) <= CACHE.size


def test_ordered_matches_stable_argsort() -> None:
    m = torch.rand(3, 2, 17, 29) > 0.6
    num, idx = _ordered(m)
    ref = torch.argsort(m.to(torch.int32), dim=-1, descending=True, stable=True)
    assert torch.equal(idx, ref.to(torch.int32))
    assert torch.equal(num, m.sum(-1).to(torch.int32))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="q_len must be a positive int"):
        fz.block_mask("causal", 0, 10)
    with pytest.raises(ValueError, match="block_size must be a positive multiple of 16"):
        fz.block_mask("causal", 10, 10, block_size=100)
    with pytest.raises(ValueError, match="unknown mask 'casual'.*Did you mean 'causal'"):
        fz.block_mask("casual", 10, 10)
