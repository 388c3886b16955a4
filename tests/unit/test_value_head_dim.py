"""A value head dim other than the q/k head dim (``Dv != Dqk``, DeepSeek-style 192/128) through
``fz.attention``, on the CPU routes that take it, against the float64 reference."""

from __future__ import annotations

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo.testing import assert_matches_reference


def _qkv(dqk: int = 24, dv: int = 16, grad: bool = True) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 37, dqk, generator=g)
    k = torch.randn(2, 2, 41, dqk, generator=g)
    v = torch.randn(2, 2, 41, dv, generator=g)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


MASKS = [None, masks.Causal(align="bottom_right"), masks.SlidingWindow(left=5)]


@pytest.mark.parametrize(
    ("route", "mask"),
    [*(("auto", m) for m in MASKS), *(("dense", m) for m in MASKS), ("sdpa_math", None)],
)
def test_forward_and_backward_match_the_reference(route: str, mask: masks.MaskSpec | None) -> None:
    q, k, v = _qkv()
    out = fz.attention(q, k, v, mask=mask, enable_gqa=True, backend=route)
    assert out.shape == (2, 4, 37, 16)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(out, q, k, v, mask=mask, enable_gqa=True, grads=grads, grad_out=grad_out)


def test_flex_cpu_forward_and_lse_free_inference() -> None:
    q, k, v = _qkv(grad=False)
    mask = masks.Causal(align="bottom_right")
    with torch.no_grad():
        out = fz.attention(q, k, v, mask=mask, enable_gqa=True, backend="flex_cpu")
    assert_matches_reference(out, q, k, v, mask=mask, enable_gqa=True)


def test_flex_cpu_under_no_grad_with_inputs_that_require_grad() -> None:
    """torch's CPU flex refuses inputs that require grad even under ``torch.no_grad()``; the route
    runs only without grad mode, so it passes detached views (failed with NotImplementedError)."""
    q, k, v = _qkv(dqk=16, dv=16, grad=True)
    with torch.no_grad():
        out = fz.attention(q, k, v, mask="causal", enable_gqa=True, backend="flex_cpu")
    assert not out.requires_grad
    assert_matches_reference(out, q, k, v, mask="causal", enable_gqa=True)


def test_routes_that_need_equal_dims_refuse_with_the_reason() -> None:
    q, k, v = _qkv(grad=False)
    with pytest.raises(ValueError, match="value head dim 16 differs from q/k head dim 24"):
        fz.attention(q, k, v, enable_gqa=True, backend="sdpa_flash")
    q, k, v = _qkv(dqk=24, dv=600, grad=False)
    with pytest.raises(ValueError, match="value head dim 600 outside"):
        fz.attention(q, k, v, enable_gqa=True, backend="flex_cpu")
