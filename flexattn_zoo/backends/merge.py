"""``fz.merge_attention``: attention over the union of disjoint key sets, from each set's result.

Attention of one query row over keys ``K = K_1 u ... u K_n`` (disjoint) is a convex combination
of the attentions over each ``K_p``: with ``lse_p`` the log-sum-exp of the row's scores over
``K_p`` (``-inf`` when the row sees none of them),

    lse = log(sum_p exp(lse_p))        out = sum_p exp(lse_p - lse) * out_p

which is exact (no approximation beyond rounding): the softmax denominator over ``K`` is the sum
of the parts' denominators. Split-KV decoding, ring / context-parallel attention and the
``sdpa_split`` route all combine partial results this way.

The computation subtracts the largest ``lse_p`` of the row before exponentiating, so it neither
overflows nor underflows the largest weight. A row whose ``lse_p`` are all ``-inf`` sees no key in
any part: its ``lse`` is ``-inf`` and its output 0, and a part whose ``lse_p`` is ``-inf``
contributes nothing whatever its ``out_p`` holds there (some kernels write NaN to rows that see
no key, e.g. SDPA's math kernel). Gradients (plain autograd through torch ops) are finite in those
rows too: every ``-inf`` is kept out of the expressions whose derivative would read it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from flexattn_zoo import _compat


def finite_lse(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``-inf`` (a row that sees none of a part's keys) as 0, the reference a part's
    probabilities ``exp(s - lse)`` are taken against: its ``-inf`` scores then give 0, never
    ``exp(-inf + inf)``."""
    return torch.where(lse == -math.inf, torch.zeros_like(lse), lse)


def merge_core(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge without argument checks (the ``sdpa_split`` route compiles this function).

    ``outs[p]`` is ``[..., Lq, Dv]`` and ``lses[p]`` is ``[..., Lq]``, all of one shape. Math runs
    in float32 at least (float64 when any output or lse is float64); the output has the dtype of
    ``outs[0]``, the lse the compute dtype.
    """
    # Promoted over every lse (the outs share one dtype): a float64 lse after a float32 one must
    # not be rounded to float32, nor the result's dtype depend on the order of the parts.
    acc = torch.float32
    for t in (outs[0], *lses):
        acc = torch.promote_types(acc, t.dtype)
    lse_all = torch.stack([lse.to(acc) for lse in lses])  # [P, ..., Lq]
    # The row's largest lse, as the reference the exponentials are taken against. Detached: the
    # result does not depend on it (its derivative cancels exactly), and rows where it is -inf
    # (no part sees a key) get 0 so that no -inf - -inf is ever formed.
    top = lse_all.detach().amax(dim=0)
    empty = top == -math.inf
    ref = torch.where(empty, torch.zeros_like(top), top)
    weights = torch.exp(lse_all - ref)  # in [0, 1]; exactly 0 for parts that see no key
    total = weights.sum(dim=0)
    # Rows that see nothing: the sum is 0; divide by 1 there and set the lse apart, so that
    # neither log(0) nor 0 / 0 enters the graph (their derivatives would be inf * 0 = NaN).
    safe_total = torch.where(empty, torch.ones_like(total), total)
    lse = torch.where(empty, torch.full_like(top, -math.inf), ref + torch.log(safe_total))
    weights = weights / safe_total
    out = torch.zeros(outs[0].shape, dtype=acc, device=outs[0].device)
    for part, w, part_lse in zip(outs, weights, lse_all, strict=True):
        # Rows this part does not see are zeroed before the product (a where, not a multiplication
        # by the 0 weight): NaN there must reach neither the output nor the weight's gradient.
        seen = (part_lse != -math.inf).unsqueeze(-1)
        out = out + torch.where(seen, part.to(acc), 0.0) * w.unsqueeze(-1)
    return out.to(outs[0].dtype), lse


def merge_two(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_core` of two parts (the routes' merge of a kernel's result with another part's)."""
    return merge_core((out_a, out_b), (lse_a, lse_b))


def _merge_two_one_graph(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_two` for ``torch.compile``: a graph break in it is an error (one fused kernel).
    Only ever run compiled: torch's flag behind ``no_graph_breaks`` is process-wide eagerly."""
    with _compat.no_graph_breaks():
        return merge_two(out_a, lse_a, out_b, lse_b)


@functools.cache
def compiled_merge_two() -> Callable[..., Any]:
    """:func:`merge_two` compiled by ``torch.compile`` (eager calls on CUDA; differentiable).

    Eager, the merge is several passes over float32 copies of the outputs; compiled it is one
    fused kernel (H200, prefix-LM 2048 at 4x16x8192x128 on ``sdpa_split``: 2.71 ms forward with
    the eager merge, 2.02 compiled). Default (automatic) dynamic shapes: a second length or batch
    compiles one shape-generic kernel, not one per shape."""
    compiled = torch.compile(_merge_two_one_graph, fullgraph=_compat.FULLGRAPH_NEEDED)
    return functools.partial(_compat.call_compiled, compiled)


def merge_attention(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention results computed over disjoint key sets into the attention over their union.

    Args:
        outs: the partial outputs, each ``[..., Lq, Dv]`` (e.g. ``[B, H, Lq, Dv]``), all of one
            shape, device and floating dtype.
        lses: their log-sum-exps (``fz.attention(..., return_lse=True)``), each ``[..., Lq]``:
            natural log of the sum of ``exp(score)`` over the part's visible keys, ``-inf`` for a
            row that sees none of them.

    Returns:
        ``(out, lse)``: ``out`` ``[..., Lq, Dv]`` in the dtype of ``outs[0]``, ``lse`` ``[..., Lq]``
        in float32 (float64 when any input is float64). Rows that see no key in any part give
        ``out`` 0 and ``lse`` ``-inf``, never NaN. Differentiable with respect to every ``out`` and ``lse``.

    The key sets must be disjoint for the result to be the attention over their union (a key in
    two parts would be counted twice); the merge itself cannot check that.

    Example::

        out_a, lse_a = fz.attention(q, k[:, :, :n], v[:, :, :n], return_lse=True)
        out_b, lse_b = fz.attention(q, k[:, :, n:], v[:, :, n:], return_lse=True)
        out, lse = fz.merge_attention([out_a, out_b], [lse_a, lse_b])  # == attention over all of k
    """
    if isinstance(outs, torch.Tensor) or isinstance(lses, torch.Tensor):
        raise TypeError(
            "merge_attention(outs, lses) takes sequences of tensors (one per key set), e.g. "
            "[out_a, out_b], [lse_a, lse_b]; got a single tensor"
        )
    outs, lses = list(outs), list(lses)
    if not outs or len(outs) != len(lses):
        raise ValueError(
            f"merge_attention needs one lse per output and at least one of each, got {len(outs)} "
            f"outputs and {len(lses)} lses"
        )
    for what, items in (("outs", outs), ("lses", lses)):
        for p, t in enumerate(items):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"merge_attention({what}[{p}]) must be a tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise TypeError(f"merge_attention({what}[{p}]) must be a floating tensor, got {t.dtype}")
    shape = outs[0].shape
    if len(shape) < 2:
        raise ValueError(f"merge_attention(outs[0]) must be [..., Lq, Dv], got shape {tuple(shape)}")
    for p, (o, lse) in enumerate(zip(outs, lses, strict=True)):
        if o.shape != shape:
            raise ValueError(
                f"merge_attention(outs[{p}]) has shape {tuple(o.shape)} but outs[0] has {tuple(shape)}"
            )
        if lse.shape != shape[:-1]:
            raise ValueError(
                f"merge_attention(lses[{p}]) has shape {tuple(lse.shape)}; the lse of an output "
                f"{tuple(shape)} is {tuple(shape[:-1])}"
            )
        for t in (o, lse):
            if t.device != outs[0].device:
                raise ValueError(
                    f"merge_attention: every tensor must be on one device, got {outs[0].device} and {t.device}"
                )
        if o.dtype != outs[0].dtype:
            raise TypeError(f"merge_attention(outs[{p}]) has dtype {o.dtype} but outs[0] has {outs[0].dtype}")
    return merge_core(outs, lses)


__all__ = ["compiled_merge_two", "finite_lse", "merge_attention", "merge_core", "merge_two"]
