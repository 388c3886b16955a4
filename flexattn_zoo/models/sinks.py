"""Attention sinks: one learned logit per head in the softmax denominator (gpt-oss).

With sinks, row ``i`` of head ``h`` takes its softmax over the visible logits ``x_j`` *plus* one
extra logit ``s_h`` whose value vector is zero::

    out'_i = sum_j exp(x_j) v_j / (sum_j exp(x_j) + exp(s_h))

Write ``Z = sum_j exp(x_j) = exp(lse_i)`` and ``out_i = sum_j exp(x_j) v_j / Z`` (plain attention).
Then::

    out'_i = out_i * Z / (Z + exp(s_h)) = out_i / (1 + exp(s_h - lse_i)) = out_i * sigmoid(lse_i - s_h)

so sinks need no kernel of their own: any route that returns the lse can serve them, and the
gradients for ``q, k, v`` and ``s_h`` come from autograd through ``out`` and ``lse`` (the route's
lse must be differentiable: flex on GPU and the ``dense`` route are). The log-normaliser of the
augmented softmax is ``logaddexp(lse_i, s_h)``. A row that sees no key has ``out = 0`` and
``lse = -inf``; ``sigmoid(-inf) = 0`` keeps it at 0, never NaN. ``sigmoid`` of a difference is
computed in float32 without overflow for any magnitudes, unlike ``exp(s_h - lse)``.
"""

from __future__ import annotations

import torch


def check_sinks(sinks: torch.Tensor, heads: int, device: torch.device) -> torch.Tensor:
    """``sinks`` validated as a float tensor ``[heads]`` on ``device`` (``ValueError``/``TypeError``)."""
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(
            f"sinks must be a float tensor [H] (one logit per query head), got {type(sinks).__name__}"
        )
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating tensor, got dtype {sinks.dtype}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(
            f"sinks must have shape [H] = [{heads}] (one per query head), got {tuple(sinks.shape)}"
        )
    if sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {device}")
    return sinks


def apply_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out * sigmoid(lse - s), logaddexp(lse, s))`` for ``out [B, H, L, Dv]``, ``lse [B, H, L]``.

    See the module docstring for the derivation. Computed in float32 (float64 for float64 ``out``);
    the output keeps ``out``'s dtype, the lse is float32 (float64 for float64 ``out``).
    """
    compute = torch.float64 if out.dtype == torch.float64 else torch.float32
    s = sinks.to(compute).view(1, -1, 1)
    lse_c = lse.to(compute)
    weight = torch.sigmoid(lse_c - s)
    new_out = (out.to(compute) * weight.unsqueeze(-1)).to(out.dtype)
    return new_out, torch.logaddexp(lse_c, s)
