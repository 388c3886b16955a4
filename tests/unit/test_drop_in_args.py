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
    # SDPA's own answer: top-left causal leaves no row empty (every query sees key 0).
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


def _bshd_leaves(lq: int = 24, lkv: int = 24, kv_heads: int = 2) -> tuple[torch.Tensor, ...]:
    """q, k, v stored ``[B, L, H, D]`` (leaves that require grad)."""
    gen = torch.Generator().manual_seed(7 * lq + lkv)
    shapes = ((2, lq, 4, 16), (2, lkv, kv_heads, 16), (2, lkv, kv_heads, 16))
    return tuple(torch.randn(*s, generator=gen).requires_grad_() for s in shapes)


def _bhsd_copies(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same values, stored ``[B, H, L, D]`` (new leaves)."""
    return tuple(t.detach().transpose(1, 2).contiguous().requires_grad_() for t in ts)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(mask="causal"),
        dict(mask=masks.SlidingWindow(left=3), enable_gqa=True),
        dict(is_causal=True, return_lse=True, backend="dense"),
        dict(mask="causal", kernel_options={"BLOCK_M": 16}),
        dict(backend="sdpa_math", scale=0.3),
    ],
)
def test_plan_bshd_plans_what_attention_runs(kwargs: dict) -> None:
    qs, ks, vs = _bshd_leaves(24, 16, kv_heads=2 if kwargs.get("enable_gqa") else 4)
    q, k, v = (t.detach().transpose(1, 2) for t in (qs, ks, vs))
    with torch.no_grad():
        bshd = fz.plan(qs, ks, vs, layout="bshd", **kwargs)
        assert bshd.problem == fz.plan(q, k, v, **kwargs).problem  # the [B, H, L, D] views' problem
        assert bshd.backend == fz.plan(q, k, v, **kwargs).backend
        assert bshd.problem.heads == 4 and bshd.problem.q_len == 24 and bshd.problem.kv_len == 16
    # With grad (a training call) too: the plan is of the transposed views of the leaves.
    if "kernel_options" not in kwargs:  # (flex on the CPU has no backward)
        p = fz.plan(qs, ks, vs, layout="bshd", **kwargs)
        views = fz.plan(qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2), **kwargs)
        assert p.problem.requires_grad and p.problem == views.problem and p.backend == views.backend
    assert fz.plan(q, k, v, layout="bhsd", **kwargs).problem == fz.plan(q, k, v, **kwargs).problem


@pytest.mark.parametrize("route", ["auto", "dense"])
@pytest.mark.parametrize("sinks", [False, True])
def test_layer_bshd_matches_bhsd_forward_and_backward(route: str, sinks: bool) -> None:
    qs, ks, vs = _bshd_leaves(24, 24, kv_heads=2)  # GQA detected from dim 2 in bshd
    q, k, v = _bhsd_copies(qs, ks, vs)
    opts: dict = dict(mask=masks.SlidingWindow(left=5), is_causal=True, backend=route, return_lse=True)
    if sinks:
        opts.update(sinks=True, num_heads=4)
    ref = fz.Attention(**opts)
    lay = fz.Attention(layout="bshd", **opts)
    assert lay.layout == "bshd" and "layout='bshd'" in repr(lay)
    if sinks:
        with torch.no_grad():
            ref.sinks.copy_(torch.linspace(-1, 1, 4))  # type: ignore[union-attr]
            lay.sinks.copy_(torch.linspace(-1, 1, 4))  # type: ignore[union-attr]
    out_s, lse_s = lay(qs, ks, vs)
    out, lse = ref(q, k, v)
    assert out_s.shape == (2, 24, 4, 16) and lse_s.shape == (2, 4, 24)
    torch.testing.assert_close(out_s, out.transpose(1, 2))
    torch.testing.assert_close(lse_s, lse)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out_s * grad.transpose(1, 2)).sum().backward()
    (out * grad).sum().backward()
    for a, b in zip((qs, ks, vs), (q, k, v), strict=True):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad.transpose(1, 2))
    if sinks:
        torch.testing.assert_close(lay.sinks.grad, ref.sinks.grad)  # type: ignore[union-attr]
    # The functional layer takes it too (a preset's head count read from dim 2).
    got = fz.layers.attention_layer(qs, ks, vs, config="gemma2", layer=1, layout="bshd", backend=route)
    want = fz.layers.attention_layer(q, k, v, config="gemma2", layer=1, backend=route)
    torch.testing.assert_close(got, want.transpose(1, 2))


def test_attention_bshd_backward_matches_bhsd() -> None:
    qs, ks, vs = _bshd_leaves(24, 24, kv_heads=4)
    q, k, v = _bhsd_copies(qs, ks, vs)
    out_s = fz.attention(qs, ks, vs, mask="causal", layout="bshd")
    out = fz.attention(q, k, v, mask="causal")
    torch.testing.assert_close(out_s, out.transpose(1, 2))
    out_s.sum().backward()
    out.sum().backward()
    for a, b in zip((qs, ks, vs), (q, k, v), strict=True):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad.transpose(1, 2))


def test_layout_refusals_of_plan_and_layer() -> None:
    q, k, v = _qkv()
    for bad in ("sbhd", "BSHD", None, 1):
        with pytest.raises(ValueError, match="layout must be one of 'bhsd', 'bshd'"):
            fz.plan(q, k, v, layout=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="layout must be one of 'bhsd', 'bshd'"):
            fz.Attention(layout=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="layout must be one of 'bhsd', 'bshd'"):
            fz.layers.attention_layer(q, k, v, layout=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k must be a 4-D tensor"):
        fz.plan(q, k[0], v, layout="bshd")
    with pytest.raises(ValueError, match="q must be a 4-D tensor"):
        fz.Attention(layout="bshd")(q[0], k, v)
