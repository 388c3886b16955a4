"""Tolerance check for attention with sinks (fz.testing's rule, with a sink-aware eager baseline).

``fz.testing.assert_matches_reference`` knows no sinks, so this applies the same rule (DESIGN.md
section 6) itself: the route's error against the float64 reference with sinks may be at most
``2 x`` the error of the same math done eagerly in the input precision, plus the floor of
``fz.testing`` (``M * (eps(dtype) + 4 * eps(float32) * (1 + max|lse|))``). The eager baseline
writes the sink as an extra logit column, like the reference, but in the input dtype.
"""

from __future__ import annotations

import math

import torch

from flexattn_zoo.testing import DEFAULT_RATIO, FLOOR_ULPS, reference_attention


def eager_with_sinks(q, k, v, sinks, *, mask_dense=None, scale=None):  # type: ignore[no-untyped-def]
    """Dense attention with sinks in ``q.dtype`` (scores, softmax and output)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads:
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask_dense is not None:
        scores = scores.masked_fill(~mask_dense, float("-inf"))
    column = sinks.to(q.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    lse = torch.logsumexp(torch.cat([scores, column], -1), -1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v), lse


def _check(what: str, got: torch.Tensor, ref: torch.Tensor, eager: torch.Tensor, dtype: torch.dtype, lse_scale: float) -> None:
    got, ref, eager = got.detach(), ref.detach(), eager.detach()
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err = float((got.double() - ref.double()).abs().max())
    eager_err = float((eager.double() - ref.double()).abs().max())
    magnitude = 1.0 if what == "lse" else float(ref.abs().max())
    floor = magnitude * (torch.finfo(dtype).eps + FLOOR_ULPS * torch.finfo(torch.float32).eps * lse_scale)
    budget = DEFAULT_RATIO * eager_err + floor
    assert err <= budget, f"{what}: error {err:.3e} > budget {budget:.3e} (eager {eager_err:.3e}, floor {floor:.3e})"


def assert_sinks_match(
    out, q, k, v, sinks, *, mask=None, scale=None, grads=None, grad_out=None, lse=None
) -> None:  # type: ignore[no-untyped-def]
    """``out`` (and optional ``lse``, ``grads = (dq, dk, dv, dsinks)``) within the sink budget."""
    want = grads is not None
    ins64 = [t.detach().double().requires_grad_(want) for t in (q, k, v, sinks)]
    low = [t.detach().clone().requires_grad_(want) for t in (q, k, v)] + [sinks.detach().to(q.dtype).requires_grad_(want)]
    dense = None
    if mask is not None:
        dense = mask.dense(q.shape[2], k.shape[2], batch=q.shape[0], heads=q.shape[1])
    with torch.enable_grad():
        ref, ref_lse = reference_attention(*ins64[:3], mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1], sinks=ins64[3], return_lse=True)
        eager, eager_lse = eager_with_sinks(*low, mask_dense=dense, scale=scale)
    lse_scale = 1.0 + float(ref_lse.detach().abs().max())
    _check("output", out, ref, eager, q.dtype, lse_scale)
    if lse is not None:
        _check("lse", lse, ref_lse, eager_lse, q.dtype, lse_scale)
    if grads is not None:
        ref_g = torch.autograd.grad(ref, ins64, grad_out.double())
        eager_g = torch.autograd.grad(eager, low, grad_out.to(q.dtype))
        for name, got, r, e in zip(("dq", "dk", "dv", "dsinks"), grads, ref_g, eager_g, strict=True):
            _check(name, got, r, e, q.dtype, lse_scale)
