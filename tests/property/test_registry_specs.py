"""Every registered mask and score spec, checked automatically against its dense oracle.

Nothing here names a spec: new registry entries are covered by adding them to the registry
(with ``examples()``), and their forms (block map, SDPA, varlen) are checked when they offer one.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexattn_zoo import masks, score_mods
from flexattn_zoo.testing import (
    assert_mask_consistent,
    assert_score_consistent,
    reference_attention,
    spec_examples,
    strategies,
)

MASK_NAMES = masks.names()
SCORE_NAMES = score_mods.names()


@pytest.mark.parametrize("name", MASK_NAMES)
@given(shape=strategies.shapes(max_len=300))
def test_mask_spec_matches_oracle(name: str, shape: strategies.ProblemShape) -> None:
    examples = spec_examples("mask", shape.q_len, shape.kv_len, shape.batch, shape.heads, names=[name])
    assert examples, f"mask {name!r} has no examples()"
    for _, spec in examples:
        assert_mask_consistent(spec, shape.q_len, shape.kv_len, batch=shape.batch, heads=shape.heads)


@pytest.mark.skipif(not MASK_NAMES, reason="no mask registered yet")
@given(shape=strategies.shapes(max_len=300), data=st.data())
def test_composed_mask_spec_matches_oracle(shape: strategies.ProblemShape, data: st.DataObject) -> None:
    spec = data.draw(strategies.mask_specs(shape.q_len, shape.kv_len, shape.batch, shape.heads))
    assert_mask_consistent(spec, shape.q_len, shape.kv_len, batch=shape.batch, heads=shape.heads)


@pytest.mark.parametrize("name", SCORE_NAMES)
@given(shape=strategies.shapes(max_len=300))
def test_score_spec_matches_oracle(name: str, shape: strategies.ProblemShape) -> None:
    examples = spec_examples("score", shape.q_len, shape.kv_len, shape.batch, shape.heads, names=[name])
    assert examples, f"score_mod {name!r} has no examples()"
    for _, spec in examples:
        assert_score_consistent(
            spec, batch=shape.batch, heads=shape.heads, q_len=shape.q_len, kv_len=shape.kv_len
        )


@pytest.mark.skipif(not SCORE_NAMES, reason="no score_mod registered yet")
@given(shape=strategies.shapes(max_len=200), data=st.data())
def test_chained_score_spec_matches_oracle(shape: strategies.ProblemShape, data: st.DataObject) -> None:
    spec = data.draw(strategies.score_specs(shape.q_len, shape.kv_len, shape.batch, shape.heads))
    assert_score_consistent(
        spec, batch=shape.batch, heads=shape.heads, q_len=shape.q_len, kv_len=shape.kv_len
    )


def straightforward_attention(q, k, v, visible, score_fn, scale, activation=False):  # type: ignore[no-untyped-def]
    """Per query head, with an explicit kv-head map and a max-subtracted softmax: a different
    code path from the reference (which repeats kv heads and uses logsumexp). ``activation``:
    the scores are log-weights and the output is unnormalised, ``sum_j exp(s_ij) v_j``."""
    b, hq, lq, _ = q.shape
    hkv = k.shape[1]
    out = torch.zeros(b, hq, lq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((b, hq, lq), -math.inf, dtype=torch.float64)
    for h in range(hq):
        kv_head = h * hkv // hq
        s = torch.einsum("bid,bjd->bij", q[:, h], k[:, kv_head]) * scale
        s = score_fn(s, h)
        # A score of -inf (score_mods.Bias) hides its key as the mask does.
        vis = visible[:, min(h, visible.shape[1] - 1)].expand_as(s) & ~torch.isneginf(s)
        row_any = vis.any(dim=-1)
        m = torch.where(vis, s, -math.inf).amax(dim=-1, keepdim=True)
        m = torch.where(row_any.unsqueeze(-1), m, 0.0)
        e = torch.where(vis, torch.exp(s - m), 0.0)
        total = e.sum(dim=-1, keepdim=True)
        p = torch.where(row_any.unsqueeze(-1), e / total.clamp_min(1e-300), 0.0)
        if activation:  # the weights themselves, unnormalised
            p = torch.where(vis, torch.exp(s), 0.0)
        out[:, h] = p @ v[:, kv_head]
        lse[:, h] = torch.where(row_any, m.squeeze(-1) + torch.log(total.squeeze(-1)), -math.inf)
    return out, lse


@given(shape=strategies.shapes(max_len=130), data=st.data())
def test_reference_agrees_with_straightforward_computation(
    shape: strategies.ProblemShape, data: st.DataObject
) -> None:
    b, hq, hkv, lq, lkv, _ = shape
    mask = data.draw(st.none() | strategies.mask_specs(lq, lkv, b, hq)) if MASK_NAMES else None
    score = data.draw(st.none() | strategies.score_specs(lq, lkv, b, hq)) if SCORE_NAMES else None
    q, k, v = (t.requires_grad_() for t in data.draw(strategies.qkv(shape, torch.float64)))
    out, lse = reference_attention(q, k, v, mask=mask, score_mod=score, enable_gqa=True, return_lse=True)  # type: ignore[misc]

    visible = (
        torch.ones(1, 1, lq, lkv, dtype=torch.bool)
        if mask is None
        else mask.dense(lq, lkv, batch=b, heads=hq)
    )

    def score_fn(s: torch.Tensor, h: int) -> torch.Tensor:
        if score is None:
            return s
        full = torch.zeros(b, hq, lq, lkv, dtype=torch.float64)
        full[:, h] = s
        return score.dense(full)[:, h]

    want, want_lse = straightforward_attention(
        q.detach(),
        k.detach(),
        v.detach(),
        visible,
        score_fn,
        shape.head_dim**-0.5,
        activation=score is not None and score.is_activation(),
    )
    torch.testing.assert_close(out.detach(), want, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(lse.detach(), want_lse, rtol=1e-9, atol=1e-10)
    empty = ~visible.expand(b, hq, lq, lkv).any(dim=-1)
    assert bool((out.detach()[empty] == 0).all()) and bool(torch.isneginf(lse.detach()[empty]).all())
    assert not torch.isnan(lse).any()
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert all(torch.isfinite(g).all() for g in grads), "NaN/inf gradient (fully masked rows?)"
