"""Attention under a window plus global tokens (``GlobalTokensForm``: Longformer, BigBird's global
part) from kernels that know only windows.

Row ``i`` sees the keys of its window ``W(i)`` and the global keys ``G``; split as ``W(i)`` and
``G \\ W(i)``, the two key sets are disjoint, so

* ``(out_w, lse_w)``: the windowed kernel over every row;
* ``(out_c, lse_c)``: each row scored against the global keys outside its window, densely
  (``[B, H, L, G]`` in float32 at least: ``G`` is small, ``spec.GLOBAL_FORM_MAX_TOKENS``);
* merged by log-sum-exp (``fz.merge_attention``'s :func:`~flexattn_zoo.backends.merge.merge_core`);
* the global rows see every key: ``(out_g, lse_g)`` from an unmasked call on those rows alone,
  written over their merged rows.

Every step is a differentiable torch op or a kernel differentiable through its output and lse, so
autograd gives the exact backward (a global row's merged values get no gradient: they are
overwritten). Rows that see nothing do not occur (every row sees its own window or every key).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from flexattn_zoo.backends.merge import merge_core
from flexattn_zoo.spec import GlobalTokensForm

#: ``kernel(q, k, v, window)`` -> ``(out [B, H, Lq, Dv], lse [B, H, Lq])``, ``[B, H, L, D]`` inputs
#: (k/v may have fewer heads: grouped-query attention), ``window = (left, right)`` with -1 for
#: unbounded; differentiable through both results.
WindowKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int]], tuple[torch.Tensor, torch.Tensor]
]


def global_tokens_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    form: GlobalTokensForm,
    scale: float,
    kernel: WindowKernel,
    *,
    softcap: float = 0.0,
    merge: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, H, L, Dv], lse [B, H, L])`` of ``q, k, v`` (``[B, H, L, D]``, ``Lq == Lkv``) under
    ``form``, with ``kernel`` running the window and the global rows (see the module docstring).

    ``softcap``: the kernel's soft-cap (0: none), applied to the global keys' scores as
    ``softcap * tanh(s / softcap)``. ``merge``: ``merge_core``'s signature for two parts (None:
    ``merge_core`` itself).
    """
    length = q.shape[2]
    left, right = (-1 if w < 0 or w >= length - 1 else w for w in form.window)
    out_w, lse_w = kernel(q, k, v, (left, right))
    out_c, lse_c = _global_keys_outside_window(q, k, v, form.positions, (left, right), scale, softcap)
    if merge is None:
        out, lse = merge_core((out_w, out_c.to(out_w.dtype)), (lse_w, lse_c))
    else:
        out, lse = merge(out_w, lse_w, out_c.to(out_w.dtype), lse_c)
    rows = form.positions
    out_g, lse_g = kernel(q.index_select(2, rows), k, v, (-1, -1))
    out = out.index_copy(2, rows, out_g.to(out.dtype))
    lse = lse.index_copy(2, rows, lse_g.to(lse.dtype))
    return out, lse


def _global_keys_outside_window(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    window: tuple[int, int],
    scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's attention over the global keys outside its window: ``(out [B, H, L, Dv], lse
    [B, H, L])``, ``lse`` ``-inf`` (and ``out`` 0) where the window holds every global key."""
    b, h, length, d = q.shape
    kv_heads = k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    keys = k.index_select(2, positions).to(acc)  # [B, Hkv, G, D]
    values = v.index_select(2, positions).to(acc)
    # Query head h reads kv head h // group: [B, Hkv, group, L, D] against [B, Hkv, 1, G, D].
    grouped = q.to(acc).reshape(b, kv_heads, h // kv_heads, length, d)
    s = torch.matmul(grouped, keys.unsqueeze(2).transpose(-1, -2)) * scale  # [B, Hkv, group, L, G]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    left, right = window
    i = torch.arange(length, device=q.device).view(length, 1)
    j = positions.view(1, -1)
    inside = torch.ones(length, positions.numel(), dtype=torch.bool, device=q.device)
    if left >= 0:
        inside &= j >= i - left
    if right >= 0:
        inside &= j <= i + right
    s = s.masked_fill(inside, -math.inf)  # counted by the window already
    # The row's largest score as the reference (detached: the result does not depend on it), 0 in
    # rows with no global key outside the window, so that no -inf - -inf is formed.
    top = s.detach().amax(dim=-1)
    ref = torch.where(top == -math.inf, torch.zeros_like(top), top)
    weights = torch.exp(s - ref.unsqueeze(-1))
    total = weights.sum(dim=-1)
    empty = total == 0
    safe = torch.where(empty, torch.ones_like(total), total)
    lse = torch.where(empty, torch.full_like(total, -math.inf), ref + torch.log(safe))
    out = torch.matmul(weights / safe.unsqueeze(-1), values.unsqueeze(2))  # [B, Hkv, group, L, Dv]
    return out.reshape(b, h, length, -1), lse.reshape(b, h, length)


__all__ = ["WindowKernel", "global_tokens_attention"]
