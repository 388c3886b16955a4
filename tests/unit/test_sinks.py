"""Attention sinks: the reference's extra-logit form, and the layers' out * sigmoid(lse - s) form."""

from __future__ import annotations

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo.masks.band import Band
from flexattn_zoo.models.sinks import apply_sinks
from flexattn_zoo.testing import assert_matches_reference, reference_attention


def _qkv(
    dtype: torch.dtype,
    b: int = 2,
    h: int = 4,
    hkv: int = 2,
    lq: int = 45,
    lkv: int = 45,
    d: int = 16,
    grad: bool = False,
):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(1)
    # Scaled up so the softmax is peaked and sinks of either sign matter.
    q = (2 * torch.randn(b, h, lq, d, generator=g)).to(dtype).requires_grad_(grad)
    k = (2 * torch.randn(b, hkv, lkv, d, generator=g)).to(dtype).requires_grad_(grad)
    v = torch.randn(b, hkv, lkv, d, generator=g).to(dtype).requires_grad_(grad)
    sinks = torch.tensor([-3.0, 0.0, 1.5, 6.0]).requires_grad_(grad)
    return q, k, v, sinks


def test_reference_sinks_minus_infinity_is_plain_attention() -> None:
    q, k, v, _ = _qkv(torch.float64)
    plain, plain_lse = reference_attention(q, k, v, mask=masks.Causal(), enable_gqa=True, return_lse=True)
    out, lse = reference_attention(
        q, k, v, mask=masks.Causal(), enable_gqa=True, return_lse=True, sinks=torch.full((4,), float("-inf"))
    )
    torch.testing.assert_close(out, plain, rtol=0, atol=1e-14)
    torch.testing.assert_close(lse, plain_lse, rtol=0, atol=1e-14)


def test_sigmoid_identity_matches_reference_in_float64() -> None:
    q, k, v, sinks = _qkv(torch.float64)
    sinks = sinks.double()
    out, lse = reference_attention(q, k, v, mask=masks.Causal(), enable_gqa=True, return_lse=True)
    got, got_lse = apply_sinks(out, lse, sinks)
    want, want_lse = reference_attention(
        q, k, v, mask=masks.Causal(), enable_gqa=True, return_lse=True, sinks=sinks
    )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=1e-13)


def test_float64_layers_keep_float64_precision_with_sinks_and_lse() -> None:
    # The lse of float64 inputs is float64: sinks applied to a float32 one were off by ~1e-8.
    q, k, v, sinks = _qkv(torch.float64)
    sinks = sinks.double()
    _, lse = fz.attention(q, k, v, mask=masks.Causal(), enable_gqa=True, return_lse=True)
    _, ref_lse = reference_attention(q, k, v, mask=masks.Causal(), enable_gqa=True, return_lse=True)
    assert lse.dtype == torch.float64
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
    layer = fz.Attention(mask=masks.Causal(), sinks=sinks)
    want = reference_attention(q, k, v, mask=masks.Causal(), enable_gqa=True, sinks=sinks)
    torch.testing.assert_close(layer(q, k, v), want, rtol=0, atol=1e-12)
    empty, empty_lse = fz.attention(q[:, :, :0], k, v, enable_gqa=True, return_lse=True)
    assert empty_lse.dtype == torch.float64 and empty.dtype == torch.float64


def test_reference_rejects_bad_sinks() -> None:
    q, k, v, _ = _qkv(torch.float64)
    with pytest.raises(ValueError, match=r"sinks must be a float tensor \[H\]"):
        reference_attention(q, k, v, enable_gqa=True, sinks=torch.zeros(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", [masks.Causal(), masks.SlidingWindow.from_hf(9), Band(lo=3, hi=6)], ids=repr)
def test_layer_sinks_forward_and_grads_on_dense_route(dtype: torch.dtype, mask: fz.MaskSpec) -> None:
    # Band(lo=3, hi=6) leaves the last queries with no key at all: output 0, finite grads.
    q, k, v, sinks = _qkv(dtype, grad=True)
    out, lse = fz.layers.attention_layer(q, k, v, mask=mask, sinks=sinks, return_lse=True, backend="dense")
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v, sinks), grad_out)
    assert_matches_reference(
        out, q, k, v, mask=mask, enable_gqa=True, sinks=sinks, lse=lse, grads=grads, grad_out=grad_out
    )


def test_the_reference_check_judges_sinks_and_their_gradient() -> None:
    """``assert_matches_reference(sinks=...)``: a route that ignores the sinks, or returns a wrong
    ``dsinks``, fails; the correct result passes, with three or four gradients."""
    q, k, v, sinks = _qkv(torch.float32, grad=True)
    out, lse = fz.layers.attention_layer(q, k, v, sinks=sinks, return_lse=True, backend="dense")
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    dq, dk, dv, dsinks = torch.autograd.grad(out, (q, k, v, sinks), grad_out)
    check = dict(enable_gqa=True, sinks=sinks, grad_out=grad_out)
    assert_matches_reference(out, q, k, v, lse=lse, grads=(dq, dk, dv, dsinks), **check)
    assert_matches_reference(out, q, k, v, grads=(dq, dk, dv), **check)
    plain = fz.attention(q, k, v, enable_gqa=True, backend="dense")
    with pytest.raises(AssertionError, match="output"):
        assert_matches_reference(plain, q, k, v, enable_gqa=True, sinks=sinks)
    with pytest.raises(AssertionError, match="dsinks"):
        assert_matches_reference(out, q, k, v, grads=(dq, dk, dv, dsinks * 1.01), **check)
    with pytest.raises(ValueError, match=r"\(dq, dk, dv\) or \(dq, dk, dv, dsinks\), got 2"):
        assert_matches_reference(out, q, k, v, grads=(dq, dk), **check)
    with pytest.raises(TypeError, match=r"sinks=...\) must be a tensor"):
        assert_matches_reference(out, q, k, v, enable_gqa=True, sinks=[0.0] * 4)  # type: ignore[arg-type]


def test_module_learns_sinks_and_rows_without_keys_stay_zero() -> None:
    q, k, v, _ = _qkv(torch.float32, lq=12, lkv=12)
    layer = fz.Attention(mask=Band(lo=1, hi=3), num_heads=4, sinks=True, backend="dense")
    assert isinstance(layer.sinks, torch.nn.Parameter) and layer.sinks.shape == (4,)
    out = layer(q, k, v)
    assert torch.equal(out[:, :, -1], torch.zeros_like(out[:, :, -1]))  # the last query sees no key
    out.square().sum().backward()
    assert layer.sinks.grad is not None and torch.isfinite(layer.sinks.grad).all()
    assert layer.sinks.grad.abs().sum() > 0
