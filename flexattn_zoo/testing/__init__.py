"""Testing toolkit for users and for our own tests (``fz.testing``).

* :func:`reference_attention` -- the float64 oracle (re-exported from :mod:`flexattn_zoo.reference`).
* :func:`eager_attention` -- the same math done eagerly in the *input* precision, with score mods
  evaluated as the routes evaluate them: the baseline that says how much error a computation of
  this problem in that precision is expected to have.
* :func:`assert_matches_reference` -- the tolerance rule of the project (docs/testing.md):

      max|route - ref64|  <=  ratio * max|eager - ref64|  +  floor          (ratio = 2)

      floor = M * (eps(dtype) + floor_ulps * eps(compute) * (1 + max|lse64|))   (floor_ulps = 4)

  where ``M`` is the largest reference magnitude (1 for the lse itself), ``compute`` is the
  precision kernels accumulate in (float32, or float64 for float64 inputs) and ``lse64`` the
  reference log-sum-exp. Why a floor: the eager baseline is sometimes luckily exact (a row that
  sees one key, float64 inputs) or just more accurate than a correct kernel for reasons that say
  nothing about bugs. The first term allows the one extra rounding of the result to ``dtype``.
  The second is the rounding noise of ``exp(s - lse)`` in the compute precision: its relative
  error is about ``eps * |s|``, and ``|s|`` near a row's maximum is about ``|lse|``. Measured on
  CPU float32 SDPA against eager float32, gradients differed by up to ~5x the eager error (100+
  ulps with scores near 40) purely from that noise; in bf16/fp16 the eager error dominates and
  the floor barely matters. A real bug (wrong mask, scale, lse base) is orders of magnitude above.

  Gradients add ``floor_ulps * eps(compute) * T`` with ``T`` the size of their largest summand
  (``|scale| * max(|dO| . |v|) * max|k|`` for dq, the same with ``q`` for dk, ``max|dO|`` for dv;
  ``|dO| . |v|``, the dot product of absolute values, is what rounding of ``dO . v`` scales with):
  ``dq = scale * sum_j p_ij (dp_ij - delta_i) k_j`` can cancel to exactly 0 (a row that sees one
  key) while a correct kernel leaves rounding of the size of its terms (fuzzing found -1e-7
  where the reference and eager are both exactly 0).
* :func:`assert_mask_consistent` / :func:`assert_score_consistent` -- a spec's ``mask_mod`` /
  ``score_mod`` against its dense oracle, and its cheap exact forms (block map, SDPA, varlen).
* :func:`spec_examples` -- every registered spec's ``examples()`` for one problem shape.
* ``strategies`` -- hypothesis strategies (imported on first use; hypothesis is a dev extra).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, overload

import torch

from flexattn_zoo.coercion import as_score_spec, tensor_args
from flexattn_zoo.reference import dense_attention, reference_attention
from flexattn_zoo.testing.checks import assert_mask_consistent, assert_score_consistent, spec_examples
from flexattn_zoo.validation import check_tolerance

__all__ = [
    "DEFAULT_RATIO",
    "FLOOR_ULPS",
    "assert_mask_consistent",
    "assert_matches_reference",
    "assert_score_consistent",
    "eager_attention",
    "reference_attention",
    "spec_examples",
    "strategies",  # noqa: F822 - provided lazily by __getattr__ below
]

#: A correct route may be this many times worse than eager attention in the same precision.
DEFAULT_RATIO = 2.0
#: Compute-precision ulps per unit of score magnitude in the floor (see the module docstring).
FLOOR_ULPS = 4.0


def __getattr__(name: str) -> Any:
    # Lazy so that ``import flexattn_zoo`` never needs hypothesis (a dev extra).
    if name == "strategies":
        import flexattn_zoo.testing.strategies as strategies

        return strategies
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@overload
def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Any = ...,
    score_mod: Any = ...,
    scale: float | None = ...,
    enable_gqa: bool = ...,
    return_lse: Literal[False] = ...,
    sinks: torch.Tensor | None = ...,
) -> torch.Tensor: ...
@overload
def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Any = ...,
    score_mod: Any = ...,
    scale: float | None = ...,
    enable_gqa: bool = ...,
    return_lse: Literal[True],
    sinks: torch.Tensor | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Any = ...,
    score_mod: Any = ...,
    scale: float | None = ...,
    enable_gqa: bool = ...,
    return_lse: bool = ...,
    sinks: torch.Tensor | None = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Any = None,
    score_mod: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dense attention computed in ``q.dtype`` throughout (scores, softmax, output), autograd-able
    (with respect to ``sinks`` too, a float tensor ``[H]`` of per-head sink logits, cast to
    ``q.dtype`` like everything else).

    The conventions of :func:`reference_attention` (fully masked rows give 0 and lse -inf), with
    the score spec evaluated as the routes evaluate it, through its ``score_mod`` (e.g. a table
    lookup where the reference uses the spec's own oracle), so its error against the float64
    reference is the yardstick for what a route can reach in this precision. Activation attention
    (a score spec with ``is_activation()``) is computed as the routes compute it too, the softmax
    of the log-weights times ``exp(lse)`` (the reference sums the weights directly).
    """
    mask, score = tensor_args(mask, score_mod)  # a float mask tensor is a Bias score
    spec = as_score_spec(score)
    kernel_mod = None if spec is None else spec.to(q.device).score_mod()
    if spec is not None and spec.is_activation():
        out, lse = dense_attention(
            q, k, v, mask=mask, score_mod=kernel_mod, scale=scale, enable_gqa=enable_gqa,
            return_lse=True, sinks=sinks, dtype=q.dtype,
        )  # fmt: skip
        out = out * torch.exp(lse).unsqueeze(-1)
        return (out, lse) if return_lse else out
    return dense_attention(
        q,
        k,
        v,
        mask=mask,
        score_mod=kernel_mod,
        scale=scale,
        enable_gqa=enable_gqa,
        return_lse=return_lse,
        sinks=sinks,
        dtype=q.dtype,
    )


def _floor(dtype: torch.dtype, magnitude: float, lse_scale: float, floor_ulps: float) -> float:
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return magnitude * (torch.finfo(dtype).eps + floor_ulps * torch.finfo(compute).eps * lse_scale)


def _compare(
    what: str,
    got: torch.Tensor,
    ref: torch.Tensor,
    eager: torch.Tensor,
    *,
    dtype: torch.dtype,
    ratio: float,
    floor_ulps: float,
    lse_scale: float,
    terms: float = 0.0,
) -> None:
    if tuple(got.shape) != tuple(ref.shape):
        raise AssertionError(f"{what}: shape {tuple(got.shape)} != expected {tuple(ref.shape)}")
    got64, ref, eager = got.detach().double().to(ref.device), ref.detach(), eager.detach()
    # A NaN reference (a score spec's dense() giving NaN) would make every error NaN, and NaN
    # fails the budget comparison, so any output would pass: refuse to judge against it.
    ref_bad = torch.isnan(ref) | torch.isposinf(ref)
    if ref_bad.any():
        where = _first(ref_bad)
        raise AssertionError(
            f"{what}: the float64 reference itself is {ref[where].item()} at index {where}, so nothing "
            "can be checked against it; check the specs' dense() oracles with assert_score_consistent "
            "/ assert_mask_consistent"
        )
    # -inf is legitimate (lse of a row that sees nothing) but must sit exactly where it should.
    got_inf, ref_inf = torch.isneginf(got64), torch.isneginf(ref)
    if not torch.equal(got_inf, ref_inf):
        where = _first(got_inf != ref_inf)
        raise AssertionError(
            f"{what}: -inf pattern differs from the reference at index {where} "
            f"(got {got64[where].item()}, reference {ref[where].item()})"
        )
    bad = ~torch.isfinite(got64) & ~got_inf
    if bad.any():
        where = _first(bad)
        raise AssertionError(f"{what}: non-finite value {got64[where].item()} at index {where}")
    if ref.numel() == 0:
        return
    finite = ~ref_inf
    err = torch.where(finite, (got64 - ref).abs(), 0.0)
    # An eager value that overflowed (fp16) says nothing about the expected error: skip it
    # rather than let an infinite baseline make every output pass.
    eager_err = torch.where(finite, (eager.double() - ref).abs(), 0.0).nan_to_num(nan=0.0, posinf=0.0)
    magnitude = 1.0 if what == "lse" else float(torch.where(finite, ref.abs(), 0.0).max())
    compute_eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    floor = _floor(dtype, magnitude, lse_scale, floor_ulps) + floor_ulps * compute_eps * terms
    eager_max, worst = float(eager_err.max()), float(err.max())
    budget = ratio * eager_max + floor
    if worst > budget:
        where = _first(err == worst)
        raise AssertionError(
            f"{what}: max abs error {worst:.3e} at index {where} (got {got64[where].item():.6g}, "
            f"reference {ref[where].item():.6g}) exceeds the budget {budget:.3e} = {ratio} x eager "
            f"{dtype} error {eager_max:.3e} + floor {floor:.3e} (max |reference| {magnitude:.3g}, "
            f"1 + max |lse| {lse_scale:.3g})"
        )


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(x) for x in torch.nonzero(mask)[0])


def assert_matches_reference(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Any = None,
    score_mod: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    sinks: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    grads: Sequence[torch.Tensor | None] | None = None,
    grad_out: torch.Tensor | None = None,
    ratio: float = DEFAULT_RATIO,
    floor_ulps: float = FLOOR_ULPS,
) -> None:
    """Assert that a route's results are as accurate as attention in ``q.dtype`` can be.

    Args:
        out: The route's output for ``q, k, v`` (any dtype; compared in float64).
        q, k, v: The inputs the route was given (their dtype sets the expected precision).
        mask, score_mod, scale, enable_gqa: As given to the route (specs, names or callables).
        sinks: The per-head sink logits ``[H]`` the route was given
            (``fz.layers.attention_layer(sinks=...)``, ``fz.Attention(sinks=...)``), or None.
        lse: The route's log-sum-exp ``[B, H, Lq]``, checked too when given (natural log;
            ``-inf`` exactly on rows that see no key; with sinks it includes the sink logit).
        grads: ``(dq, dk, dv)`` the route produced for the upstream gradient ``grad_out``, and
            with ``sinks`` optionally a fourth, ``dsinks`` (``None`` entries are skipped).
        grad_out: Upstream gradient of ``out``; required with ``grads``.
        ratio, floor_ulps: The tolerance rule (see the module docstring).

    Raises:
        AssertionError: naming the quantity, the worst index, its error and the budget.
        ValueError: ``grads`` without ``grad_out``, ``grads`` not 3 tensors (or 4 with
            ``sinks``), ``sinks`` not ``[H]``, or a negative or non-finite ``ratio`` /
            ``floor_ulps`` (TypeError for a non-number or a non-tensor ``sinks``).
    """
    for name, given in (("out", out), ("sinks", sinks), ("lse", lse), ("grad_out", grad_out)):
        if given is not None and not isinstance(given, torch.Tensor):
            raise TypeError(
                f"assert_matches_reference({name}=...) must be a tensor, got {type(given).__name__}"
            )
    ratio = check_tolerance("assert_matches_reference(ratio=...)", ratio)
    floor_ulps = check_tolerance("assert_matches_reference(floor_ulps=...)", floor_ulps)
    if grads is not None and grad_out is None:
        raise ValueError("assert_matches_reference(grads=...) needs grad_out= (the upstream gradient)")
    want_grads = grads is not None
    allowed = (3,) if sinks is None else (3, 4)
    if grads is not None and len(grads) not in allowed:
        want = "(dq, dk, dv)" if sinks is None else "(dq, dk, dv) or (dq, dk, dv, dsinks)"
        raise ValueError(f"assert_matches_reference(grads=...) must be {want}, got {len(grads)} tensors")
    kwargs: dict[str, Any] = dict(
        mask=mask, score_mod=score_mod, scale=scale, enable_gqa=enable_gqa, return_lse=True
    )
    ins64 = [t.detach().double().requires_grad_(want_grads) for t in (q, k, v)]
    ins_low = [t.detach().clone().requires_grad_(want_grads) for t in (q, k, v)]
    sinks64 = sinks_low = None
    if sinks is not None:
        sinks64 = sinks.detach().double().requires_grad_(want_grads)
        sinks_low = sinks.detach().clone().requires_grad_(want_grads)
    with torch.enable_grad():
        ref, ref_lse = reference_attention(*ins64, sinks=sinks64, **kwargs)
        eager, eager_lse = eager_attention(*ins_low, sinks=sinks_low, **kwargs)
    dtype = q.dtype
    finite_lse = ref_lse.detach()[torch.isfinite(ref_lse.detach())]
    lse_scale = 1.0 + (float(finite_lse.abs().max()) if finite_lse.numel() else 0.0)
    rule: dict[str, Any] = dict(dtype=dtype, ratio=ratio, floor_ulps=floor_ulps, lse_scale=lse_scale)
    _compare("output", out, ref, eager, **rule)
    if lse is not None:
        # lse is float32 (float64 for float64 inputs): judge it at the coarser of the two.
        coarser = lse.dtype if torch.finfo(lse.dtype).eps > torch.finfo(dtype).eps else dtype
        _compare("lse", lse, ref_lse, eager_lse, **{**rule, "dtype": coarser})
    if grads is not None:
        assert grad_out is not None
        wrt64, wrt_low = list(ins64), list(ins_low)
        terms: list[float] = list(_grad_terms(ins64, grad_out.detach().double(), scale))
        if len(grads) == 4:
            assert sinks64 is not None and sinks_low is not None
            wrt64.append(sinks64)
            wrt_low.append(sinks_low)
            # dsinks_h = -sum over the head's rows of p_sink * (dO . out): at most that many
            # summands of size |dO . out|.
            rows = (grad_out.detach().double() * ref.detach()).sum(-1).abs()
            terms.append(float(rows.sum(dim=(0, 2)).max()) if rows.numel() else 0.0)
        ref_g = torch.autograd.grad(ref, wrt64, grad_out.detach().double())
        eager_g = torch.autograd.grad(eager, wrt_low, grad_out.detach().to(dtype))
        names = ("dq", "dk", "dv", "dsinks")
        for name, got, r, e, t in zip(names, grads, ref_g, eager_g, terms, strict=False):
            if got is not None:
                _compare(name, got, r, e, **rule, terms=t)


def _grad_terms(
    ins64: Sequence[torch.Tensor], grad_out: torch.Tensor, scale: float | None
) -> tuple[float, float, float]:
    """Largest summand of dq, dk, dv (see the module docstring); score mods are assumed to have
    derivatives of order 1 (ALiBi, soft-capping)."""
    q, k, v = (t.detach() for t in ins64)
    if min(q.numel(), k.numel(), grad_out.numel()) == 0:
        return 0.0, 0.0, 0.0
    if q.shape[1] != k.shape[1]:
        group = q.shape[1] // k.shape[1]
        v = v.repeat_interleave(group, dim=1)
    s = abs(1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale))
    # The rounding of dp = dO . v (and of delta = dO . out) scales with |dO| . |v|, not |dO . v|,
    # which can cancel to far less.
    dp = float(torch.matmul(grad_out.to(v.device).abs(), v.abs().transpose(-1, -2)).max())
    return s * dp * float(k.abs().max()), s * dp * float(q.abs().max()), float(grad_out.abs().max())
