"""Fuzzing the whole path: random compositions of zoo masks (``&``, ``|``, ``~``, up to 3 deep)
and score-mod chains (up to 3 long) over bucketed shapes, against the float64 reference.

Bounded for a 2-core CI (whole file well under 90 s with ``HYPOTHESIS_PROFILE=ci``):

* forward *and* backward through ``auto`` with inputs that require grad: on the CPU that is
  ``sdpa_flash`` / ``sdpa_math`` for specs with an SDPA form and ``dense`` for the rest, so no
  compile at all however many specs hypothesis draws;
* the BlockMask of every drawn composite (closed form or generic builder) against its dense
  oracle, also compile-free;
* ``flex_cpu`` (each distinct spec is a 5-10 s compile) on one fixed composite over drawn
  lengths: at most two graphs (static, then one dynamic-shape graph).
"""

from __future__ import annotations

import functools
import operator

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.arch import priority
from flexattn_zoo.compile import CACHE as COMPILE_CACHE
from flexattn_zoo.compose import And, Not, Or
from flexattn_zoo.spec import MaskSpec, ScoreSpec
from flexattn_zoo.testing import assert_matches_reference, strategies
from flexattn_zoo.testing.checks import block_mask_map, dense_block_map
from flexattn_zoo.testing.strategies import ProblemShape

CPU_TRAINING_ROUTES = frozenset(priority("cpu", "fwdbwd"))


def score_chains(shape: ProblemShape) -> st.SearchStrategy[ScoreSpec]:
    """One to three registered score specs chained left to right with ``>>``."""
    base = strategies.score_specs(shape.q_len, shape.kv_len, shape.batch, shape.heads, chain=False)
    return st.lists(base, min_size=1, max_size=3).map(lambda mods: functools.reduce(operator.rshift, mods))


def _depth(spec: MaskSpec | None) -> int:
    if spec is None:
        return -1
    if isinstance(spec, (And, Or)):
        return 1 + max(_depth(p) for p in spec.parts)
    if isinstance(spec, Not):
        return 1 + _depth(spec.part)
    return 0


@st.composite
def problems(draw: st.DrawFn, max_len: int = 300) -> tuple[ProblemShape, MaskSpec | None, ScoreSpec | None]:
    shape = draw(strategies.shapes(max_len=max_len))
    mask = draw(
        st.none() | strategies.mask_specs(shape.q_len, shape.kv_len, shape.batch, shape.heads, depth=3)
    )
    score = draw(st.none() | score_chains(shape))
    return shape, mask, score


@given(case=problems(), dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), data=st.data())
def test_auto_forward_backward_matches_reference(case, dtype: torch.dtype, data: st.DataObject) -> None:  # type: ignore[no-untyped-def]
    shape, mask, score = case
    q, k, v = data.draw(strategies.qkv(shape, dtype, requires_grad=True))
    plan = fz.plan(q, k, v, mask=mask, score_mod=score, enable_gqa=True)
    assert plan.backend in CPU_TRAINING_ROUTES, plan.explain()
    event(f"route {plan.backend}")  # shown by --hypothesis-show-statistics
    event(f"mask depth {_depth(mask)}")
    lse_wanted = plan.backend == "dense"  # SDPA returns no lse
    res = fz.attention(q, k, v, mask=mask, score_mod=score, enable_gqa=True, return_lse=lse_wanted)
    out, lse = res if lse_wanted else (res, None)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(shape.q_len)).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(
        out, q, k, v, mask=mask, score_mod=score, enable_gqa=True, lse=lse, grads=grads, grad_out=grad_out
    )


@given(case=problems(max_len=1024), block=st.sampled_from([(16, 32), (32, 16), (128, 128)]))
def test_block_mask_of_composites_covers_every_visible_element(case, block: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    shape, mask, _ = case
    if mask is None:
        return
    bm = fz.block_mask(
        mask, shape.q_len, shape.kv_len, batch=shape.batch, heads=shape.heads, block_size=block
    )
    dense = mask.dense(shape.q_len, shape.kv_len, batch=shape.batch, heads=shape.heads)
    dense = dense.expand(shape.batch, shape.heads, shape.q_len, shape.kv_len)
    want_any, want_full = dense_block_map(dense, *block)
    got_any, got_full = block_mask_map(bm, want_any.shape[-1])
    got_any, got_full = got_any.expand_as(want_any), got_full.expand_as(want_full)
    # Partial blocks still run mask_mod, so "any" may over-approximate; it must never miss a
    # visible block, and a block marked full (mask_mod skipped) must really be full.
    assert not bool((want_any & ~got_any).any()), "BlockMask skips a block with visible elements"
    assert not bool((got_full & ~want_full).any()), "BlockMask marks a block full that has masked elements"


# One fixed composite (3 deep) and a 2-long score chain, so flex_cpu compiles one kernel.
FLEX_MASK = (masks.SlidingWindow(left=20) | masks.PrefixLM(prefix_len=7)) & ~(
    masks.Chunked(size=50) & ~masks.Causal()
)
FLEX_SCORE = score_mods.Alibi(num_heads=4) >> score_mods.SoftCap(cap=5.0)


@settings(max_examples=6)
@given(
    q_len=strategies.lengths(max_len=300),
    kv_len=strategies.lengths(max_len=300),
    batch=st.sampled_from([1, 2]),
    data=st.data(),
)
def test_flex_cpu_forward_matches_reference(q_len: int, kv_len: int, batch: int, data: st.DataObject) -> None:
    shape = ProblemShape(batch, 4, 2, q_len, kv_len, 32)
    q, k, v = data.draw(strategies.qkv(shape, torch.float32))
    out = fz.attention(q, k, v, mask=FLEX_MASK, score_mod=FLEX_SCORE, enable_gqa=True, backend="flex_cpu")
    assert_matches_reference(out, q, k, v, mask=FLEX_MASK, score_mod=FLEX_SCORE, enable_gqa=True)


@pytest.mark.parametrize("lengths", [((129, 77), (1, 300))])
def test_flex_cpu_length_sweep_compiles_at_most_twice(lengths: tuple[tuple[int, int], ...]) -> None:
    """Explicit examples (a ragged pair, a single query) on the same kernel as above."""
    before = COMPILE_CACHE.total_compiles()
    for i, (lq, lkv) in enumerate(lengths):
        g = torch.Generator().manual_seed(i)
        q, k, v = (
            torch.randn(2, 4, lq, 32, generator=g),
            torch.randn(2, 2, lkv, 32, generator=g),
            torch.randn(2, 2, lkv, 32, generator=g),
        )
        out = fz.attention(q, k, v, mask=FLEX_MASK, score_mod=FLEX_SCORE, enable_gqa=True, backend="flex_cpu")
        assert_matches_reference(out, q, k, v, mask=FLEX_MASK, score_mod=FLEX_SCORE, enable_gqa=True)
    assert COMPILE_CACHE.total_compiles() - before <= 2
