"""Activation (non-softmax) attention: score_mods.Sigmoid and score_mods.Relu, run through the lse.

The expected outputs here are written out by hand (``sum_j w(s_ij) v_j`` over the visible keys),
independent of both the routes' ``out * exp(lse)`` and the reference's code path.
"""

from __future__ import annotations

import math

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.models import decode
from flexattn_zoo.score_mods import Relu, Sigmoid
from flexattn_zoo.testing import assert_matches_reference, reference_attention

B, H, HKV, L, D = 2, 4, 2, 40, 16


def _qkv(lq: int = L, lkv: int = L, dtype: torch.dtype = torch.float32, grad: bool = False):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, lq, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)
    k = torch.randn(B, HKV, lkv, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)
    v = torch.randn(B, HKV, lkv, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)
    return q, k, v


def _by_hand(q, k, v, weight, visible):  # type: ignore[no-untyped-def]
    """``sum_j weight(s_ij) v_j`` over visible keys, in float64, kv heads mapped per query head."""
    q, k, v = (t.detach().double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    w = torch.where(visible, weight(s), torch.zeros_like(s))
    return w @ v, w.sum(-1)


CAUSAL = torch.ones(L, L, dtype=torch.bool).tril()


@pytest.mark.parametrize(
    ("spec", "weight"),
    [
        (Sigmoid(), torch.sigmoid),
        (Sigmoid.for_length(L), lambda s: torch.sigmoid(s - math.log(L))),
        (Relu(divisor=float(L)), lambda s: torch.relu(s) / L),
        (Relu(power=2.0, offset=0.5), lambda s: torch.relu(s + 0.5) ** 2),
    ],
    ids=["sigmoid", "sigmoid_for_length", "relu_over_length", "relu2_offset"],
)
def test_output_and_lse_are_the_unnormalised_sums(spec, weight) -> None:  # type: ignore[no-untyped-def]
    q, k, v = _qkv()
    out, lse = fz.attention(q, k, v, mask=masks.Causal(), score_mod=spec, enable_gqa=True, return_lse=True)
    want, total = _by_hand(q, k, v, weight, CAUSAL)
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)
    assert lse.dtype == torch.float32
    torch.testing.assert_close(lse.double().exp(), total, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("spec", [Sigmoid(bias=-1.0), Relu(power=2.0, offset=0.25, divisor=7.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_every_cpu_route_matches_the_reference_forward_and_backward(spec, dtype) -> None:  # type: ignore[no-untyped-def]
    q, k, v = _qkv(dtype=dtype, grad=True)
    window = masks.SlidingWindow(left=7)
    out = fz.attention(q, k, v, mask=window, score_mod=spec, enable_gqa=True)
    assert out.dtype == dtype
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(
        out, q, k, v, mask=window, score_mod=spec, enable_gqa=True, grads=grads, grad_out=grad_out
    )


def test_rows_without_weight_are_zero_with_finite_gradients() -> None:
    # An offset of -100 gives every key ReLU weight 0 (unit-scale inputs score far below 100).
    q, k, v = _qkv(grad=True)
    spec = Relu(offset=-100.0)
    out, lse = fz.attention(q, k, v, mask=masks.Causal(), score_mod=spec, enable_gqa=True, return_lse=True)
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    # A row the mask leaves empty (Lkv < Lq, bottom-right causal hides everything from row 0).
    q2, k2, v2 = _qkv(lq=L, lkv=L - 5)
    out2 = fz.attention(
        q2, k2, v2, mask=masks.Causal(align="bottom_right"), score_mod=Sigmoid(), enable_gqa=True
    )
    assert bool((out2[:, :, :5] == 0).all())
    want, _ = _by_hand(q2, k2, v2, torch.sigmoid, torch.ones(L, L - 5, dtype=torch.bool).tril(-5))
    torch.testing.assert_close(out2.double(), want, rtol=2e-5, atol=2e-5)


def test_chain_weighs_the_chained_score() -> None:
    q, k, v = _qkv()
    alibi = score_mods.Alibi(num_heads=H)
    spec = alibi >> Sigmoid(bias=-0.5)
    assert spec.is_activation() and not alibi.is_activation()
    out = fz.attention(q, k, v, mask=masks.Causal(), score_mod=spec, enable_gqa=True)
    slopes = torch.tensor(alibi.head_slopes(), dtype=torch.float64).view(1, H, 1, 1)
    distance = (torch.arange(L).view(-1, 1) - torch.arange(L).view(1, -1)).abs().double()
    want, _ = _by_hand(q, k, v, lambda s: torch.sigmoid(s - slopes * distance - 0.5), CAUSAL)
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)


def test_plan_cache_hit_layout_and_name_agree() -> None:
    q, k, v = _qkv()
    first = fz.attention(q, k, v, mask="causal", score_mod="sigmoid", enable_gqa=True)
    again = fz.attention(q, k, v, mask="causal", score_mod="sigmoid", enable_gqa=True)  # cached plan
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    bshd = fz.attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask="causal", score_mod=Sigmoid(),
        enable_gqa=True, layout="bshd",
    )  # fmt: skip
    torch.testing.assert_close(bshd.transpose(1, 2), first, rtol=1e-6, atol=1e-6)


def test_routes_without_lse_refuse_with_the_reason() -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="cannot return the lse activation attention runs through"):
        fz.attention(q, k, v, score_mod=Sigmoid(), enable_gqa=True, backend="flex_cpu")
    text = fz.plan(q, k, v, score_mod=Relu(), enable_gqa=True).explain()
    assert "route: dense" in text and "lse activation attention runs through" in text


def test_compiled_fullgraph_matches_eager() -> None:
    q, k, v = _qkv()
    spec = Sigmoid.for_length(L)

    def f(q, k, v):  # type: ignore[no-untyped-def]
        return fz.attention(q, k, v, mask=masks.Causal(), score_mod=spec, enable_gqa=True)

    torch.compiler.reset()
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v), f(q, k, v), rtol=1e-6, atol=1e-6)


def test_softmax_only_features_refuse_activation_specs() -> None:
    q, k, v = _qkv()
    sinks = torch.zeros(H)
    with pytest.raises(ValueError, match="sinks take part in a softmax"):
        reference_attention(q, k, v, score_mod=Sigmoid(), enable_gqa=True, sinks=sinks)
    layer = fz.Attention(mask="causal", score_mod=Sigmoid(), sinks=sinks)
    with pytest.raises(ValueError, match="sinks take part in a softmax"):
        layer(q, k, v)
    k_cache, v_cache = torch.randn(B, HKV, 64, D), torch.randn(B, HKV, 64, D)
    with pytest.raises(ValueError, match="decode_step runs softmax attention"):
        decode.decode_step(q[:, :, :1], k_cache, v_cache, cache_len=10, score_mod=Sigmoid())


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda: Sigmoid(bias="1"), TypeError),
        (lambda: Sigmoid(bias=math.inf), ValueError),
        (lambda: Sigmoid.for_length(0), ValueError),
        (lambda: Relu(power=0.0), ValueError),
        (lambda: Relu(power=True), TypeError),
        (lambda: Relu(divisor=-1.0), ValueError),
        (lambda: Relu(offset=math.nan), ValueError),
    ],
)
def test_bad_arguments_are_refused(make, error) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error):
        make()


def test_equal_values_are_one_spec() -> None:
    assert Sigmoid(bias=-2) == Sigmoid(bias=-2.0) and hash(Sigmoid(bias=-2)) == hash(Sigmoid(bias=-2.0))
    assert Relu(power=2) == Relu(power=2.0)
    assert {"sigmoid", "relu"} <= set(score_mods.names())


def test_sigmoid_gradient_at_a_zero_score_is_one_half() -> None:
    # Zero queries give scores of exactly 0 (a zero-initialised projection): d log sigmoid / dx
    # there is sigmoid(0) = 1/2, not the 0 a where/abs spelling gives at its kink.
    x = torch.zeros(3, requires_grad=True)
    Sigmoid().score_mod()(x, 0, 0, 0, 0).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 0.5))
    q = torch.zeros(1, 1, 4, 8, requires_grad=True)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 1, 4, 8, generator=g).requires_grad_() for _ in range(2))
    out = fz.attention(q, k, v, score_mod=Sigmoid())
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert float(grads[0].abs().max()) > 0
    assert_matches_reference(out, q, k, v, score_mod=Sigmoid(), grads=grads, grad_out=torch.ones_like(out))


def test_flex_flash_refuses_training_through_the_lse() -> None:
    """torch's FLASH backward raises for a gradient through the lse (sinks, activation
    attention), after the forward ran: the route refuses such calls up front."""
    import dataclasses

    from flexattn_zoo import _compat
    from flexattn_zoo.backends.flex import FLEX_FLASH
    from flexattn_zoo.problem import Problem

    p = Problem(2, 4, 4, 256, 256, 64, torch.bfloat16, "cuda", "sm90", requires_grad=True,
                mask=masks.Causal(), score=Sigmoid(), return_lse=True)  # fmt: skip
    reasons = FLEX_FLASH.mask_reasons(p)
    if _compat.FLASH_LSE_TRUSTWORTHY:
        assert any("no gradient through the lse" in r for r in reasons), reasons
    else:
        assert any("off by a factor ln 2" in r for r in reasons), reasons
    assert not any(
        "lse" in r for r in FLEX_FLASH.mask_reasons(dataclasses.replace(p, score=None, return_lse=False))
    )
