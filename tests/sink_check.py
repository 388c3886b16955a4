"""Tolerance check for attention with sinks (fz.testing's rule, with a sink-aware eager baseline).

``fz.testing.assert_matches_reference`` knows no sinks, so this applies the same rule and floor
itself: the route's error against the float64 reference with sinks may be at most ``2 x`` the error of the same math done eagerly in the input precision, plus the floor of
``fz.testing`` (``M * (eps(dtype) + 4 * eps(float32) * (1 + max|lse|))``). The eager baseline
writes the sink as an extra logit column, like the reference, but in the input dtype.
"""

from __future__ import annotations

import torch

from flexattn_zoo.reference import dense_attention
from flexattn_zoo.testing import DEFAULT_RATIO, FLOOR_ULPS, _floor, reference_attention


def _check(
    what: str, got: torch.Tensor, ref: torch.Tensor, eager: torch.Tensor, dtype: torch.dtype, lse_scale: float
) -> None:
    got, ref, eager = got.detach(), ref.detach(), eager.detach()
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err = float((got.double() - ref.double()).abs().max())
    eager_err = float((eager.double() - ref.double()).abs().max())
    magnitude = 1.0 if what == "lse" else float(ref.abs().max())
    floor = _floor(dtype, magnitude, lse_scale, FLOOR_ULPS)
    budget = DEFAULT_RATIO * eager_err + floor
    assert err <= budget, (
        f"{what}: error {err:.3e} > budget {budget:.3e} (eager {eager_err:.3e}, floor {floor:.3e})"
    )


def assert_sinks_match(
    out, q, k, v, sinks, *, mask=None, scale=None, grads=None, grad_out=None, lse=None
) -> None:  # type: ignore[no-untyped-def]
    """``out`` (and optional ``lse``, ``grads = (dq, dk, dv, dsinks)``) within the sink budget."""
    want = grads is not None
    ins64 = [t.detach().double().requires_grad_(want) for t in (q, k, v, sinks)]
    low = [t.detach().clone().requires_grad_(want) for t in (q, k, v)] + [
        sinks.detach().to(q.dtype).requires_grad_(want)
    ]
    kwargs = dict(mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1], return_lse=True)
    with torch.enable_grad():
        ref, ref_lse = reference_attention(*ins64[:3], sinks=ins64[3], **kwargs)
        eager, eager_lse = dense_attention(*low[:3], sinks=low[3], dtype=q.dtype, **kwargs)
    lse_scale = 1.0 + float(ref_lse.detach().abs().max())
    _check("output", out, ref, eager, q.dtype, lse_scale)
    if lse is not None:
        _check("lse", lse, ref_lse, eager_lse, q.dtype, lse_scale)
    if grads is not None:
        ref_g = torch.autograd.grad(ref, ins64, grad_out.double())
        eager_g = torch.autograd.grad(eager, low, grad_out.to(q.dtype))
        for name, got, r, e in zip(("dq", "dk", "dv", "dsinks"), grads, ref_g, eager_g, strict=True):
            _check(name, got, r, e, q.dtype, lse_scale)
