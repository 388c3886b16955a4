"""SDPA / flex drop-in keywords: ``is_causal=`` and ``kernel_options=``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo.backends import BY_NAME
from flexattn_zoo.testing import assert_matches_reference


def _qkv(lq: int = 24, lkv: int = 24) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(lq + 3 * lkv)
    return (
        torch.randn(2, 2, lq, 16, generator=gen),
        torch.randn(2, 2, lkv, 16, generator=gen),
        torch.randn(2, 2, lkv, 16, generator=gen),
    )


@pytest.mark.parametrize("lq,lkv", [(24, 24), (8, 24), (24, 8)])
def test_is_causal_is_sdpas_top_left_causal(lq: int, lkv: int) -> None:
    q, k, v = _qkv(lq, lkv)
    out = fz.attention(q, k, v, is_causal=True)
    assert_matches_reference(out, q, k, v, mask=masks.Causal())
    if lq <= lkv:  # SDPA's own rows (with lq > lkv it gives NaN where a row sees nothing on some kernels)
        torch.testing.assert_close(
            out, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=2e-5, atol=2e-5
        )
    assert fz.plan(q, k, v, is_causal=True).problem.mask == masks.Causal().bind(lq, lkv)


def test_is_causal_is_anded_with_the_mask() -> None:
    q, k, v = _qkv()
    m = torch.rand(24, 24) < 0.6
    for mask in (m, "full", masks.Dense(mask=m), lambda b, h, qi, kv: kv % 2 == 0):
        out = fz.attention(q, k, v, mask=mask, is_causal=True)
        spec = fz.plan(q, k, v, mask=mask, is_causal=True).problem.mask
        assert spec is not None
        assert_matches_reference(out, q, k, v, mask=spec)
        assert not bool(spec.dense(24, 24, batch=2, heads=2)[..., 0, 1:].any())  # causal holds
    bias = torch.randn(24, 24)  # a float mask is a Bias: is_causal is the mask beside it
    out = fz.attention(q, k, v, mask=bias, is_causal=True)
    assert_matches_reference(out, q, k, v, mask="causal", score_mod=bias)
    assert fz.attention(q, k, v, is_causal=False).shape == q.shape


def test_is_causal_refusals() -> None:
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        fz.attention(q, k, v, is_causal=1)  # type: ignore[arg-type]
    bm = fz.block_mask(masks.Causal(), 24, 24)
    with pytest.raises(ValueError, match="is_causal=True cannot be combined with a BlockMask"):
        fz.attention(q, k, v, mask=bm, is_causal=True)


def test_layer_is_causal() -> None:
    q, k, v = _qkv()
    layer = fz.Attention(is_causal=True)
    assert layer.mask == masks.Causal()
    assert_matches_reference(layer(q, k, v), q, k, v, mask="causal")
    window = fz.Attention(mask=masks.SlidingWindow(left=3, right=3), is_causal=True)
    assert_matches_reference(
        window(q, k, v), q, k, v, mask=masks.SlidingWindow(left=3, right=3) & masks.Causal()
    )


def test_kernel_options_restrict_auto_to_flex_and_reach_the_kernel() -> None:
    q, k, v = _qkv()
    opts = {"BLOCK_M": 16, "BLOCK_N": 16}
    assert fz.plan(q, k, v, mask="causal").backend == "sdpa_flash"
    p = fz.plan(q, k, v, mask="causal", kernel_options=opts)
    assert p.backend == "flex_cpu" and p.problem.kernel_options == (("BLOCK_M", 16), ("BLOCK_N", 16))
    assert BY_NAME["flex_cpu"].options(p.problem) == {
        **(BY_NAME["flex_cpu"].options(fz.plan(q, k, v, mask="causal", backend="flex_cpu").problem) or {}),
        **opts,
    }  # type: ignore[attr-defined]
    out = fz.attention(q, k, v, mask="causal", kernel_options=opts)
    assert_matches_reference(out, q, k, v, mask="causal")
    # The plan cache keys the options: the call without them takes SDPA again.
    out2 = fz.attention(q, k, v, mask="causal")
    assert_matches_reference(out2, q, k, v, mask="causal")
    assert fz.plan(q, k, v, mask="causal", kernel_options={}).backend == "sdpa_flash"  # {}: none


def test_kernel_options_refusals() -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="sdpa_math.*takes no kernel_options"):
        fz.attention(q, k, v, kernel_options={"BLOCK_M": 16}, backend="sdpa_math")
    with pytest.raises(ValueError, match="dense.*takes no kernel_options"):
        fz.plan(q, k, v, kernel_options={"BLOCK_M": 16}, backend="dense")
    qg = q.clone().requires_grad_()
    with pytest.raises(ValueError, match="flex_cpu"):  # training on the CPU: no flex route has a backward
        fz.attention(qg, k, v, kernel_options={"BLOCK_M": 16})
    with pytest.raises(TypeError, match="kernel_options must be a dict"):
        fz.plan(q, k, v, kernel_options=[("BLOCK_M", 16)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="kernel_options\\['BLOCK_M'\\]"):
        fz.plan(q, k, v, kernel_options={"BLOCK_M": [16]})


def test_kernel_options_conflicting_with_a_routes_own_are_refused() -> None:
    q, k, v = _qkv()
    problem = fz.plan(q, k, v, kernel_options={"BACKEND": "TRITON"}).problem
    reasons = BY_NAME["flex_flash"].kernel_options_reasons(problem)
    assert reasons and "BACKEND='TRITON'" in reasons[0]
    assert BY_NAME["flex"].kernel_options_reasons(problem) == []


@pytest.mark.parametrize("route", ["auto", "sdpa_math", "dense", "flex_cpu"])
def test_bshd_layout_is_views_in_and_out(route: str) -> None:
    q, k, v = _qkv(24, 24)
    qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # [B, L, H, D] storage
    out = fz.attention(qs, ks, vs, mask="causal", layout="bshd", backend=route)
    assert out.shape == (2, 24, 2, 16)
    assert_matches_reference(out.transpose(1, 2), q, k, v, mask="causal")
    if route == "dense":
        out, lse = fz.attention(qs, ks, vs, layout="bshd", backend=route, return_lse=True)
        assert lse.shape == (2, 2, 24)
    same = fz.attention(q, k, v, mask="causal", layout="bhsd", backend=route)
    torch.testing.assert_close(
        fz.attention(qs, ks, vs, mask="causal", layout="bshd", backend=route), same.transpose(1, 2)
    )


def test_bshd_layout_refusals() -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="layout must be one of 'bhsd', 'bshd'"):
        fz.attention(q, k, v, layout="sbhd")
    with pytest.raises(ValueError, match="q must be a 4-D tensor"):
        fz.attention(q[0], k, v, layout="bshd")
