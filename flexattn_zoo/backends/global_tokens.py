"""Attention under a window plus global tokens (``GlobalTokensForm``: Longformer, BigBird's global
part) from kernels that know only windows.

Row ``i`` sees the keys of its window ``W(i)`` and the global keys ``G``; split as ``W(i)`` and
``G \\ W(i)``, the two key sets are disjoint, so

* ``(out_w, lse_w)``: the windowed kernel over every row;
* ``(out_c, lse_c)``: each row scored against the global keys outside its window, densely
  (``[B, H, L, G]`` in float32 at least: ``G`` is small, ``spec.GLOBAL_FORM_MAX_TOKENS``);
* merged by log-sum-exp (``fz.merge_attention``'s :func:`~flexattn_zoo.backends.merge.merge_core`);
* the global rows see every key: ``(out_g, lse_g)`` from an unmasked kernel call on those rows
  alone, written over their merged rows.

Backward (as ``sdpa_split``'s): a part's attention backward given the *final* ``out`` and ``lse``
of its rows is the gradient of the whole attention restricted to that part's keys, so each part
runs one kernel backward: the window over every row with the global rows' ``dout`` zeroed (they
were overwritten), the dense global keys likewise, and the global rows' unmasked call on those
rows. An lse gradient (a caller that reads the lse) adds ``P * g`` to each part's score gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.autograd.function import once_differentiable

from flexattn_zoo.backends.merge import merge_two
from flexattn_zoo.spec import GlobalTokensForm

Window = tuple[int, int]


class WindowKernels(NamedTuple):
    """A windowed attention kernel on ``[B, H, L, D]`` tensors (k/v may have fewer heads:
    grouped-query attention), ``window = (left, right)`` with -1 unbounded, bottom-right aligned
    (so an unbounded window is no mask whatever the lengths)."""

    #: ``(q, k, v, window) -> (out [B, H, Lq, Dv], lse [B, H, Lq] float32)``, no autograd.
    forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Window], tuple[torch.Tensor, torch.Tensor]]
    #: ``(dout, q, k, v, out, lse, window, g_lse) -> (dq, dk, dv)``: the FA backward from ``out``
    #: and ``lse`` as given (``dS = P * (dout . v - rowsum(dout * out) + g_lse)``, ``g_lse`` None: 0).
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def global_tokens_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    form: GlobalTokensForm,
    scale: float,
    kernels: WindowKernels,
    *,
    softcap: float = 0.0,
    merge: Callable[..., tuple[torch.Tensor, torch.Tensor]] = merge_two,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, H, L, Dv], lse [B, H, L])`` of ``q, k, v`` (``[B, H, L, D]``, ``Lq == Lkv``) under
    ``form``, differentiable through both (see the module docstring).

    ``softcap``: the kernels' soft-cap (0: none), applied to the global keys' scores as
    ``softcap * tanh(s / softcap)``. ``merge``: ``merge_two``'s signature (e.g. its compiled form).
    """
    length = q.shape[2]
    window = tuple(-1 if w < 0 or w >= length - 1 else w for w in form.window)
    return _GlobalTokens.apply(q, k, v, form.positions, window, scale, softcap, kernels, merge)


class _GlobalTokens(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rows: torch.Tensor,
        window: Window,
        scale: float,
        softcap: float,
        kernels: WindowKernels,
        merge: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out_w, lse_w = kernels.forward(q, k, v, window)
        dense = _GlobalKeys(q, k, v, rows, window, scale, softcap)
        probs, lse_c = dense.probs(None)
        out_c = torch.matmul(probs, dense.values).reshape(*out_w.shape[:3], -1)
        out, lse = merge(out_w, lse_w, out_c.to(out_w.dtype), lse_c.reshape(lse_w.shape))
        out_g, lse_g = kernels.forward(q.index_select(2, rows), k, v, (-1, -1))
        # The merge's results are its own (fresh) tensors: the global rows are written in place.
        out.index_copy_(2, rows, out_g.to(out.dtype))
        lse.index_copy_(2, rows, lse_g.to(lse.dtype))
        ctx.save_for_backward(q, k, v, out, lse, rows)
        ctx.args = (window, scale, softcap, kernels)
        # An unused lse gets no gradient (None), not zeros: its backward is a kernel call more.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @once_differentiable  # the kernels' backwards have no derivative: say so instead of a wrong one
    def backward(ctx: Any, g_out: torch.Tensor | None, g_lse: torch.Tensor | None) -> Any:
        q, k, v, out, lse, rows = ctx.saved_tensors
        window, scale, softcap, kernels = ctx.args
        if g_out is None:
            g_out = torch.zeros_like(out)
        g_out = g_out.contiguous()
        # The global rows were overwritten: no gradient reaches the window's or the dense part's
        # values there (a zero dout and lse gradient make their score gradients 0).
        g_kept = g_out.index_fill(2, rows, 0.0)
        lse_kept = None if g_lse is None else g_lse.index_fill(2, rows, 0.0)
        dq, dk, dv = kernels.backward(g_kept, q, k, v, out, lse, window, lse_kept)
        dense = _GlobalKeys(q, k, v, rows, window, scale, softcap)
        cq, ck, cv = dense.backward(g_kept, out, lse, lse_kept)
        dq = dq + cq.to(dq.dtype)
        dk = dk.index_add(2, rows, ck.to(dk.dtype))
        dv = dv.index_add(2, rows, cv.to(dv.dtype))
        q_rows = q.index_select(2, rows)
        lse_rows = None if g_lse is None else g_lse.index_select(2, rows)
        gq, gk, gv = kernels.backward(
            g_out.index_select(2, rows), q_rows, k, v, out.index_select(2, rows), lse.index_select(2, rows),
            (-1, -1), lse_rows,
        )  # fmt: skip
        dq = dq.index_add(2, rows, gq.to(dq.dtype))
        return dq, dk + gk, dv + gv, None, None, None, None, None, None


class _GlobalKeys:
    """Every row scored against the global keys outside its window (the dense part), with the
    query heads grouped over their kv head: scores ``[B, Hkv, group, L, G]``."""

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rows: torch.Tensor,
        window: Window,
        scale: float,
        softcap: float,
    ) -> None:
        b, h, length, d = q.shape
        self.kv_heads = k.shape[1]
        self.acc = torch.promote_types(q.dtype, torch.float32)
        self.shape = (b, self.kv_heads, h // self.kv_heads, length)
        self.q = q.to(self.acc).reshape(*self.shape, d)
        self.keys = k.index_select(2, rows).to(self.acc).unsqueeze(2)  # [B, Hkv, 1, G, D]
        self.values = v.index_select(2, rows).to(self.acc).unsqueeze(2)
        self.scale, self.softcap = scale, softcap
        left, right = window
        i = torch.arange(length, device=q.device).view(length, 1)
        j = rows.view(1, -1)
        inside = torch.ones(length, rows.numel(), dtype=torch.bool, device=q.device)
        if left >= 0:
            inside &= j >= i - left
        if right >= 0:
            inside &= j <= i + right
        self.inside = inside  # counted by the window already

    def _scores(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, s)``: the scaled scores and the capped, masked ones."""
        x = torch.matmul(self.q, self.keys.transpose(-1, -2)) * self.scale
        s = self.softcap * torch.tanh(x / self.softcap) if self.softcap else x
        return x, s.masked_fill(self.inside, -math.inf)

    def probs(self, lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``exp(s - lse)`` (hidden pairs 0) and the lse: the part's own when ``lse`` is None
        (``-inf`` in rows whose window holds every global key), else the given (final) one."""
        _, s = self._scores()
        if lse is None:
            lse = torch.logsumexp(s, dim=-1)
        ref = torch.where(lse == -math.inf, torch.zeros_like(lse), lse)
        return torch.exp(s - ref.unsqueeze(-1)), lse

    def backward(
        self, g_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, g_lse: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq [B, H, L, D], dk, dv [B, Hkv, G, D])`` of the part, from the final out and lse."""
        acc = self.acc
        x, _ = self._scores()
        p, _ = self.probs(lse.to(acc).reshape(self.shape))
        g = g_out.to(acc).reshape(*self.shape, -1)
        rowsum = (g * out.to(acc).reshape(*self.shape, -1)).sum(-1, keepdim=True)
        if g_lse is not None:
            rowsum = rowsum - g_lse.to(acc).reshape(*self.shape, 1)
        dv = torch.matmul(p.transpose(-1, -2), g).sum(2)  # summed over the group
        ds = p * (torch.matmul(g, self.values.transpose(-1, -2)) - rowsum)
        if self.softcap:
            ds = ds * (1 - torch.tanh(x / self.softcap) ** 2)
        dq = torch.matmul(ds, self.keys) * self.scale
        dk = torch.matmul(ds.transpose(-1, -2), self.q).sum(2) * self.scale
        b, _, _, length = self.shape
        return dq.reshape(b, -1, length, dq.shape[-1]), dk, dv


__all__ = ["WindowKernels", "global_tokens_attention"]
