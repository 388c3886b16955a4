"""The float64 math reference: dense, slow, obviously correct. The oracle for every test.

Conventions (the same on every route):

* Layout ``[B, H, L, D]``; with ``enable_gqa`` the query heads are grouped onto ``H_kv`` key/value
  heads, query head ``h`` reading kv head ``h // (H_q // H_kv)`` (as SDPA and flex do).
* Default ``scale`` is ``1/sqrt(D)``; score mods see the *scaled* score.
* A query row that sees no key outputs 0 and has lse ``-inf`` (never NaN).
* lse is the natural-log log-sum-exp of the modified, masked scores, shape ``[B, H, Lq]``.
* Attention sinks (``sinks=``, one learned logit ``s_h`` per query head, as in gpt-oss): the
  softmax of every row gets one extra logit ``s_h`` whose value vector is zero. It takes part in
  the normaliser only, so the lse includes it and a row that sees no key still outputs 0.
* Activation attention (a score spec with ``is_activation()``, e.g. ``score_mods.Sigmoid``): the
  modified scores are log-weights and the output is ``sum_j w_ij v_j`` with ``w = exp(score)``,
  unnormalised, computed here directly; the lse is ``log sum_j w_ij``. Sinks are refused with it.
* Dropout (SDPA's ``dropout_p``) acts on the softmax probabilities: each is zeroed or kept and the
  kept ones scaled by ``1 / (1 - dropout_p)``; the lse is that of the undropped scores. The
  reference takes the keep-mask as an argument (``dropout_mask``), it never draws one.
"""

from __future__ import annotations

import math
from typing import Any, Literal, overload

import torch

from flexattn_zoo.coercion import as_mask_spec, as_score_spec, tensor_args
from flexattn_zoo.validation import check_dropout_p, check_qkv


@overload
def reference_attention(
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
    dropout_p: float = ...,
    dropout_mask: torch.Tensor | None = ...,
) -> torch.Tensor: ...
@overload
def reference_attention(
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
    dropout_p: float = ...,
    dropout_mask: torch.Tensor | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def reference_attention(
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
    dropout_p: float = ...,
    dropout_mask: torch.Tensor | None = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def reference_attention(
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
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention in float64 with a dense mask, differentiable with respect to q, k, v (and sinks).

    ``mask`` and ``score_mod`` accept specs, registry names or raw callables (not BlockMasks: the
    oracle never trusts block sparsity). The output has ``q``'s dtype only if ``q`` is float64;
    otherwise it stays float64 so callers compare against full precision. ``sinks`` is a float
    tensor ``[H]`` (one logit per query head) or None.

    Dropout is given, never drawn (the oracle is deterministic): ``dropout_mask`` is a bool
    keep-mask broadcastable to ``[B, H, Lq, Lkv]`` (True = kept) and ``dropout_p`` the probability
    it was drawn with; the softmax probabilities are multiplied by the mask and by
    ``1 / (1 - dropout_p)`` (SDPA's convention), the lse is that of the undropped scores. Both or
    neither: ``dropout_p > 0`` needs the mask and the mask needs ``dropout_p > 0``.
    """
    return dense_attention(
        q,
        k,
        v,
        mask=mask,
        score_mod=score_mod,
        scale=scale,
        enable_gqa=enable_gqa,
        return_lse=return_lse,
        sinks=sinks,
        dtype=torch.float64,
        dropout_p=dropout_p,
        dropout_mask=dropout_mask,
    )


def dense_attention(
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
    dtype: torch.dtype,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The reference math with every step (scores, softmax, output) computed in ``dtype``.

    ``dtype=float64`` is :func:`reference_attention`; the input dtype is ``fz.testing``'s eager
    baseline, whose error says how accurate a low-precision route can be.
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(
            f"dense_attention(dtype=...) must be a floating torch.dtype (e.g. torch.float64), got {dtype!r}"
        )
    shape = check_qkv(q, k, v, enable_gqa=enable_gqa)
    mask, score_mod = tensor_args(mask, score_mod)
    mask_spec = as_mask_spec(mask)
    score_spec = as_score_spec(score_mod)
    if mask_spec is not None:
        mask_spec.validate(shape.q_len, shape.kv_len, shape.batch, shape.heads)
    if score_spec is not None:
        score_spec.validate(shape.q_len, shape.kv_len, shape.batch, shape.heads)
    qc, kc, vc = q.to(dtype), k.to(dtype), v.to(dtype)
    if shape.heads != shape.kv_heads:
        group = shape.heads // shape.kv_heads
        kc = kc.repeat_interleave(group, dim=1)
        vc = vc.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(shape.head_dim) if scale is None else float(scale)
    keep = _dropout_factor(dropout_p, dropout_mask, shape.batch, shape.heads, shape.q_len, shape.kv_len)
    scores = torch.matmul(qc, kc.transpose(-1, -2)) * scale
    if score_spec is not None:
        # (Spec.to keeps the spec's type; it is annotated as returning Spec.)
        scores = score_spec.to(scores.device).dense(scores).to(dtype)
        # A -inf score (score_mods.Bias) hides its key: as a masked key, with no gradient through
        # it (a row of only -inf would otherwise get NaN gradients from logsumexp).
        scores = scores.masked_fill(torch.isneginf(scores), float("-inf"))
    if mask_spec is not None:
        visible = (
            mask_spec.to("cpu")
            .dense(shape.q_len, shape.kv_len, batch=shape.batch, heads=shape.heads)
            .to(scores.device)
        )
        scores = scores.masked_fill(~visible, float("-inf"))
    if score_spec is not None and score_spec.is_activation():
        if sinks is not None:
            raise ValueError(
                f"sinks take part in a softmax; score_mod {type(score_spec).__name__} is activation "
                "attention (unnormalised weights), which has none"
            )
        # The weights themselves, not the out * exp(lse) identity the routes use: tests compare
        # the two. exp(-inf) = 0 hides masked keys.
        weights = torch.exp(scores)
        if keep is not None:
            weights = weights * keep.to(weights.device, dtype)
        out = torch.matmul(weights, vc)
        return (out, torch.logsumexp(scores, dim=-1)) if return_lse else out
    if sinks is not None:
        # The sink is literally one more column of logits (value vector 0): written as a concat,
        # not through the out * sigmoid(lse - s) identity the layers use, so tests compare the two.
        if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (shape.heads,):
            got = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            raise ValueError(f"sinks must be a float tensor [H] = [{shape.heads}], got {got}")
        column = sinks.to(scores.device, dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        lse = torch.logsumexp(torch.cat([scores, column], dim=-1), dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1))
        if keep is not None:
            probs = probs * keep.to(probs.device, dtype)
        out = torch.matmul(probs, vc)
        return (out, lse) if return_lse else out
    lse = torch.logsumexp(scores, dim=-1)
    # Rows that see nothing: lse is -inf; exp(scores - lse) would be NaN, so zero those rows.
    empty = torch.isneginf(lse)
    probs = torch.exp(scores - lse.masked_fill(empty, 0.0).unsqueeze(-1))
    probs = probs.masked_fill(empty.unsqueeze(-1), 0.0)
    if keep is not None:
        probs = probs * keep.to(probs.device, dtype)
    out = torch.matmul(probs, vc)
    return (out, lse) if return_lse else out


def _dropout_factor(
    dropout_p: float, dropout_mask: torch.Tensor | None, batch: int, heads: int, q_len: int, kv_len: int
) -> torch.Tensor | None:
    """The factor the probabilities are multiplied by, ``keep / (1 - dropout_p)`` in float64
    (``[B|1, H|1, Lq|1, Lkv|1]``), or None without dropout; ValueError for a bad pair."""
    p = check_dropout_p(dropout_p)
    if dropout_mask is None:
        if p > 0:
            raise ValueError(
                "reference_attention draws no dropout: with dropout_p > 0 pass dropout_mask (the bool "
                "keep-mask [B|1, H|1, Lq|1, Lkv|1] the route used)"
            )
        return None
    if not isinstance(dropout_mask, torch.Tensor) or dropout_mask.dtype != torch.bool:
        got = (
            f"dtype {dropout_mask.dtype}"
            if isinstance(dropout_mask, torch.Tensor)
            else type(dropout_mask).__name__
        )
        raise ValueError(f"dropout_mask must be a bool tensor (True = kept), got {got}")
    if p == 0:
        raise ValueError("dropout_mask needs dropout_p > 0 (the probability it was drawn with: the scale)")
    target = (batch, heads, q_len, kv_len)
    try:
        fits = torch.broadcast_shapes(dropout_mask.shape, target) == target
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"dropout_mask of shape {tuple(dropout_mask.shape)} does not broadcast to "
            f"[B, H, Lq, Lkv] = {list(target)}"
        )
    return dropout_mask.to(torch.float64) * (1.0 / (1.0 - p))
