"""Tensors as ``mask=`` / ``score_mod=`` (SDPA's ``attn_mask``): ``masks.Dense`` and ``score_mods.Bias``,
their coercion, the routes that run them exactly, and gradients of a learned bias."""

from __future__ import annotations

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.masks.dense import bool_block_map
from flexattn_zoo.testing import assert_matches_reference, reference_attention
from flexattn_zoo.testing.checks import dense_block_map

CPU_ROUTES = ("sdpa_math", "sdpa_flash", "dense", "flex_cpu")


def _qkv(b: int = 2, h: int = 3, lq: int = 37, lkv: int = 37, d: int = 16) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(lq * 7 + lkv)
    q = torch.randn(b, h, lq, d, generator=gen)
    k = torch.randn(b, h, lkv, d, generator=gen)
    v = torch.randn(b, h, lkv, d, generator=gen)
    return q, k, v


def _bool_masks(b: int, h: int, lq: int, lkv: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    full = torch.rand(b, h, lq, lkv, generator=gen) < 0.5
    full[0, 0, 2] = False  # a row that sees nothing
    keys = torch.rand(b, 1, 1, lkv, generator=gen) < 0.7
    two_d = torch.rand(lq, lkv, generator=gen) < 0.4
    return [full, keys, two_d, (torch.rand(1, 1, lq, lkv, generator=gen) < 0.5).expand(b, h, lq, lkv)]


@pytest.mark.parametrize("route", CPU_ROUTES)
@pytest.mark.parametrize("lq,lkv", [(37, 37), (5, 70)])
def test_bool_tensor_mask_matches_reference_on_every_cpu_route(route: str, lq: int, lkv: int) -> None:
    q, k, v = _qkv(lq=lq, lkv=lkv)
    for m in _bool_masks(2, 3, lq, lkv):
        out = fz.attention(q, k, v, mask=m, backend=route)
        assert_matches_reference(out, q, k, v, mask=masks.Dense(mask=m))
        # SDPA's own answer, where a row sees a key (SDPA agrees on empty rows here: 0).
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)
        torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_float_tensor_bias_matches_reference_on_every_cpu_route(route: str) -> None:
    q, k, v = _qkv()
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(1, 3, 37, 37, generator=gen)
    bias[..., 4, :] = float("-inf")  # a row that sees nothing: 0 on every route
    bias[..., 7, ::2] = float("-inf")
    for as_mask in (False, True):
        kwargs = {"mask": bias} if as_mask else {"score_mod": bias}
        out = fz.attention(q, k, v, backend=route, **kwargs)
        assert_matches_reference(out, q, k, v, score_mod=score_mods.Bias(bias=bias))
        assert bool((out[:, :, 4] == 0).all())


def test_auto_takes_sdpa_for_tensors_on_cpu_and_plan_names_the_spec() -> None:
    q, k, v = _qkv()
    m = torch.rand(2, 1, 37, 37) < 0.5
    p = fz.plan(q, k, v, mask=m)
    assert p.backend.startswith("sdpa") and isinstance(p.problem.mask, masks.Dense)
    p = fz.plan(q, k, v, mask=torch.zeros(37, 37))
    assert p.backend.startswith("sdpa") and p.problem.mask is None
    assert isinstance(p.problem.score, score_mods.Bias)


def test_tensor_specs_beside_other_specs() -> None:
    q, k, v = _qkv()
    m = torch.rand(2, 3, 37, 37) < 0.6
    bias = torch.randn(37, 37)
    dense = masks.Dense(mask=m)
    for mask, score in [
        (dense & masks.Causal(), None),  # no single SDPA call: flex / dense
        (masks.Causal(), score_mods.Bias(bias=bias)),
        (dense, score_mods.Bias(bias=bias)),
        (dense & masks.Full(), score_mods.Bias(bias=bias) >> score_mods.SoftCap(cap=5.0)),
    ]:
        for route in ("auto", "dense", "flex_cpu"):
            out = fz.attention(q, k, v, mask=mask, score_mod=score, backend=route)
            assert_matches_reference(out, q, k, v, mask=mask, score_mod=score)
    with pytest.raises(ValueError, match="sdpa_math"):
        fz.plan(q, k, v, mask=dense, score_mod=score_mods.Bias(bias=bias), backend="sdpa_math")
    assert fz.plan(q, k, v, mask=dense & masks.Full(), backend="sdpa_math").backend == "sdpa_math"


def test_gqa_and_low_precision() -> None:
    q, _, _ = _qkv(h=4)
    _, k, v = _qkv(h=2)
    m = torch.rand(2, 4, 37, 37) < 0.5
    bias = torch.randn(2, 1, 37, 37)
    for route in CPU_ROUTES:
        out = fz.attention(q, k, v, mask=m, enable_gqa=True, backend=route)
        assert_matches_reference(out, q, k, v, mask=m, enable_gqa=True)
        qb, kb, vb = (t.bfloat16() for t in (q, k, v))
        out = fz.attention(qb, kb, vb, score_mod=bias, enable_gqa=True, backend=route)
        assert_matches_reference(out, qb, kb, vb, score_mod=bias, enable_gqa=True)


@pytest.mark.parametrize("route", ["sdpa_math", "dense"])
def test_learned_bias_gets_gradients(route: str) -> None:
    q, k, v = (t.requires_grad_() for t in _qkv())
    bias = torch.randn(1, 3, 37, 37, requires_grad=True)
    with torch.no_grad():
        bias[..., 4, :] = float("-inf")
    out = fz.attention(q, k, v, score_mod=bias, backend=route)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, bias), g)
    ref = reference_attention(q, k, v, score_mod=bias)
    want = torch.autograd.grad(ref, (q, k, v, bias), g.double())
    for a, b in zip(got, want, strict=True):
        finite = torch.isfinite(b)
        torch.testing.assert_close(a[finite].double(), b[finite].double(), rtol=1e-4, atol=1e-5)
    # The same spec twice is one spec (identity): plans and compiled calls are reused.
    assert score_mods.Bias(bias=bias) == score_mods.Bias(bias=bias)


def test_learned_bias_refused_with_reasons_where_no_gradient() -> None:
    q, k, v = _qkv()
    bias = torch.randn(37, 37, requires_grad=True)
    with pytest.raises(ValueError, match="takes no attn_mask that requires grad"):
        fz.plan(q, k, v, score_mod=bias, backend="sdpa_flash")
    with pytest.raises(ValueError, match="no backward"):
        fz.plan(q, k, v, score_mod=bias, backend="flex_cpu")
    assert fz.plan(q, k, v, score_mod=bias).backend == "sdpa_math"
    with torch.no_grad():  # no gradient recorded, yet torch's CPU flash kernel refuses the mask
        assert fz.plan(q, k, v, score_mod=bias).backend not in ("sdpa_flash", "sdpa_split")
        out = fz.attention(q, k, v, score_mod=bias)
    assert_matches_reference(out, q, k, v, score_mod=score_mods.Bias(bias=bias.detach()))


def test_ambiguous_and_wrong_tensors_are_refused_naming_the_argument() -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="mask got a floating tensor.*score_mod is given"):
        fz.attention(q, k, v, mask=torch.zeros(37, 37), score_mod="softcap")
    with pytest.raises(ValueError, match="score_mod got a bool tensor"):
        fz.attention(q, k, v, score_mod=torch.ones(37, 37, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask got a torch.int64 tensor"):
        fz.attention(q, k, v, mask=torch.ones(37, 37, dtype=torch.long))
    with pytest.raises(ValueError, match="3-D"):
        fz.attention(q, k, v, mask=torch.ones(2, 37, 37, dtype=torch.bool))
    with pytest.raises(ValueError, match="broadcastable"):
        fz.attention(q, k, v, mask=torch.ones(3, 1, 37, 37, dtype=torch.bool))
    with pytest.raises(TypeError, match="Bias"):
        masks.Dense(mask=torch.zeros(3, 3))
    with pytest.raises(TypeError, match="Dense"):
        score_mods.Bias(bias=torch.ones(3, 3, dtype=torch.bool))


def test_expanded_mask_is_held_at_its_own_size() -> None:
    m = torch.rand(1, 1, 9, 9) < 0.5
    spec = masks.Dense(mask=m.expand(4, 8, 9, 9))
    assert spec.mask.shape == (1, 1, 9, 9) and not spec.uses_batch() and not spec.uses_head()
    assert masks.Dense(mask=torch.ones(4, 1, 1, 9, dtype=torch.bool)).uses_batch()


@pytest.mark.parametrize(
    "lq,lkv,qb,kvb", [(37, 37, 8, 8), (5, 70, 4, 16), (64, 64, 16, 16), (1, 3, 128, 128)]
)
def test_block_map_is_exact(lq: int, lkv: int, qb: int, kvb: int) -> None:
    gen = torch.Generator().manual_seed(lq + lkv)
    for m in [
        torch.rand(2, 3, lq, lkv, generator=gen) < 0.05,
        torch.rand(2, 1, 1, lkv, generator=gen) < 0.5,
        torch.rand(1, 1, lq, 1, generator=gen) < 0.5,
        torch.ones(1, 1, lq, lkv, dtype=torch.bool).tril(),
    ]:
        spec = masks.Dense(mask=m)
        fz.testing.assert_mask_consistent(spec, batch=2, heads=3, q_len=lq, kv_len=lkv)
        bm = bool_block_map(spec.mask, lq, lkv, qb, kvb)
        dense = spec.dense(lq, lkv, batch=2, heads=3)
        want_any, want_full = dense_block_map(dense, qb, kvb)
        assert torch.equal(bm.any.expand_as(want_any), want_any)
        assert torch.equal(bm.full.expand_as(want_full), want_full)


def test_layer_and_reference_take_tensors() -> None:
    q, k, v = _qkv()
    m = torch.rand(2, 1, 37, 37) < 0.5
    layer = fz.Attention(mask=m)
    assert_matches_reference(layer(q, k, v), q, k, v, mask=m)
    bias = torch.randn(37, 37)
    layer = fz.Attention(mask=bias)  # additive, as SDPA
    assert_matches_reference(layer(q, k, v), q, k, v, score_mod=bias)
