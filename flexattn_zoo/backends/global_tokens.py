"""Attention under a window plus global tokens (``GlobalTokensForm``: Longformer, BigBird's global
part) from kernels that know only windows.

Row ``i`` sees the keys of its window ``W(i)`` and the global keys ``G``; split as ``W(i)`` and
``G \\ W(i)``, the two key sets are disjoint, so

* ``(out_w, lse_w)``: the windowed kernel over every row;
* ``(out_c, lse_c)``: each row scored against the global keys outside its window, densely
  (``[B, H, L, G]`` scores in float32 at least: ``G`` is small, ``spec.GLOBAL_FORM_MAX_TOKENS``);
* merged by log-sum-exp (``fz.merge_attention``'s :func:`~flexattn_zoo.backends.merge.merge_core`);
* the global rows see every key: ``(out_g, lse_g)`` from those rows against every key, written
  over their merged rows -- densely too while their scores stay small
  (:data:`GLOBAL_ROWS_DENSE_MAX_SCORES`), else one unmasked kernel call on those rows.

Everything but the windowed kernel is one function (``_dense_forward``, and
``_dense_backward`` for the gradients), which CUDA calls run compiled: one call, a few fused
kernels. Compiled, a product over the head dim or the (small) global axis is a broadcast product
summed, which reads the bfloat16 inputs in place; a sum over the sequence is a matmul in the
inputs' dtype with float32 accumulation, the probabilities and score gradients rounded to that
dtype first as flash kernels round theirs. Eagerly (CPU), both are float32 matmuls.

Backward (as ``sdpa_split``'s): a part's attention backward given the *final* ``out`` and ``lse``
of its rows is the gradient of the whole attention restricted to that part's keys. So the window
runs one kernel backward over every row, the global rows included (their final lse is over every
key, so their window's probabilities are the true ones); the dense backward adds each other row's
global keys outside its window and each global row's keys outside its window: every (row, key)
pair is counted once. Where the global rows take a kernel call over every key instead, their
``dout`` and lse gradient are zeroed for the window's backward. An lse gradient (a caller that
reads the lse) adds ``P * g`` to each part's score gradient.
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.autograd.function import once_differentiable

from flexattn_zoo import _compat
from flexattn_zoo.backends.merge import finite_lse, merge_core
from flexattn_zoo.spec import GlobalTokensForm

Window = tuple[int, int]

#: The most scores (``B * H * G * L``) the global rows take densely, in the compiled function
#: beside the global keys; past it they take one more unmasked kernel call (and its backward).
#: 2**24 float32 scores are 64 MiB (the backward holds a few such temporaries): a [CLS] token up to
#: 2**24 / (B * H) keys, 64 global tokens at 8K keys with B * H = 32.
GLOBAL_ROWS_DENSE_MAX_SCORES = 1 << 24


class WindowKernels(NamedTuple):
    """A windowed attention kernel on ``[B, H, L, D]`` tensors (k/v may have fewer heads:
    grouped-query attention), ``window = (left, right)`` with -1 unbounded, bottom-right aligned
    (so an unbounded window is no mask whatever the lengths)."""

    #: ``(q, k, v, window) -> (out [B, H, Lq, Dv], lse [B, H, Lq] float32)``, no autograd.
    forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Window], tuple[torch.Tensor, torch.Tensor]]
    #: ``(dout, q, k, v, out, lse, window, g_lse) -> (dq, dk, dv)``: the FA backward from ``out``
    #: and ``lse`` as given (``dS = P * (dout . v - rowsum(dout * out) + g_lse)``, ``g_lse`` None: 0).
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class DenseParts(NamedTuple):
    """The dense parts' forward and backward (``_dense_forward``, ``_dense_backward``), eager or
    compiled."""

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
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
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, H, L, Dv], lse [B, H, L])`` of ``q, k, v`` (``[B, H, L, D]``, ``Lq == Lkv``) under
    ``form``, differentiable through both (see the module docstring).

    ``softcap``: the kernels' soft-cap (0: none), applied to the global keys' scores as
    ``softcap * tanh(s / softcap)``. ``compiled``: run the dense parts through ``torch.compile``
    (:func:`compiled_dense_parts`), as CUDA calls should.
    """
    length = q.shape[2]
    window = tuple(-1 if w < 0 or w >= length - 1 else w for w in form.window)
    parts = compiled_dense_parts() if compiled else _EAGER_PARTS
    return _GlobalTokens.apply(q, k, v, form.positions, window, scale, softcap, kernels, parts)


def _rows_dense(q: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether the global rows of ``q`` take the dense part (:data:`GLOBAL_ROWS_DENSE_MAX_SCORES`)."""
    b, h, length, _ = q.shape
    return b * h * rows.numel() * length <= GLOBAL_ROWS_DENSE_MAX_SCORES


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
        parts: DenseParts,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out_w, lse_w = kernels.forward(q, k, v, window)
        dense_rows = _rows_dense(q, rows)
        out, lse = parts.forward(q, k, v, out_w, lse_w, rows, window, scale, softcap, dense_rows)
        if not dense_rows:
            out_g, lse_g = kernels.forward(q.index_select(2, rows), k, v, (-1, -1))
            # The dense part's results are its own (fresh) tensors: the global rows are written in place.
            out.index_copy_(2, rows, out_g.to(out.dtype))
            lse.index_copy_(2, rows, lse_g.to(lse.dtype))
        ctx.save_for_backward(q, k, v, out, lse, rows)
        ctx.args = (window, scale, softcap, kernels, parts, dense_rows)
        # An unused lse gets no gradient (None), not zeros: its backward is a kernel call more.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @once_differentiable  # the kernels' backwards have no derivative: say so instead of a wrong one
    def backward(ctx: Any, g_out: torch.Tensor | None, g_lse: torch.Tensor | None) -> Any:
        q, k, v, out, lse, rows = ctx.saved_tensors
        window, scale, softcap, kernels, parts, dense_rows = ctx.args
        if g_out is None:
            g_out = torch.zeros_like(out)
        g_out = g_out.contiguous()
        g_window, lse_window = g_out, g_lse
        if not dense_rows:
            # The global rows take a kernel backward over every key below: none of their
            # gradient goes through the window's (a zero dout and lse gradient make their score
            # gradients 0). Dense, the global rows' part takes only the keys outside their window.
            g_window = g_out.index_fill(2, rows, 0.0)
            lse_window = None if g_lse is None else g_lse.index_fill(2, rows, 0.0)
        dq, dk, dv = kernels.backward(g_window, q, k, v, out, lse, window, lse_window)
        dq, dk, dv = parts.backward(
            dq, dk, dv, g_out, g_lse, q, k, v, out, lse, rows, window, scale, softcap, dense_rows
        )
        if not dense_rows:
            lse_rows = None if g_lse is None else g_lse.index_select(2, rows)
            gq, gk, gv = kernels.backward(
                g_out.index_select(2, rows), q.index_select(2, rows), k, v, out.index_select(2, rows),
                lse.index_select(2, rows), (-1, -1), lse_rows,
            )  # fmt: skip
            dq = dq.index_add(2, rows, gq.to(dq.dtype))
            dk, dv = dk + gk, dv + gv
        return dq, dk, dv, None, None, None, None, None, None


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` over the last axis (``[..., M, K]``, ``[..., N, K]`` -> ``[..., M, N]``) in
    float32 at least. Compiled, a broadcast product summed over ``K`` (one reduction kernel that
    reads ``a`` and ``b`` in their own dtype); eagerly a matmul of float32 copies (the broadcast
    product would be materialized). Used where ``K`` or ``N`` is the head dim or the global axis."""
    acc = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    if _compat.is_compiling():
        return (a.unsqueeze(-2).to(acc) * b.unsqueeze(-3).to(acc)).sum(-1)
    return torch.matmul(a.to(acc), b.to(acc).transpose(-1, -2))


def _long_sum(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``p @ x`` summed over the sequence axis (``p`` ``[..., M, L]`` in float32, ``x``
    ``[..., L, N]``): a matmul in ``x``'s dtype (``p`` rounded to it, as flash kernels round their
    probabilities and score gradients) with float32 accumulation; the result is rounded to ``x``'s
    dtype (the matmul's output) and returned in float32 at least."""
    acc = torch.promote_types(x.dtype, torch.float32)
    return torch.matmul(p.to(x.dtype), x).to(acc)


def _score_grad(
    p: torch.Tensor, dp: torch.Tensor, rowsum: torch.Tensor, x: torch.Tensor, softcap: float
) -> torch.Tensor:
    """The FA backward's score gradient ``P * (dP - rowsum)`` (``rowsum``: ``sum(dout * out)`` minus
    the lse gradient, broadcast against ``p``), through the soft-cap's ``tanh`` of the raw scores
    ``x`` when there is one."""
    ds = p * (dp - rowsum)
    return ds * (1 - torch.tanh(x / softcap) ** 2) if softcap else ds


def _capped(x: torch.Tensor, softcap: float) -> torch.Tensor:
    return softcap * torch.tanh(x / softcap) if softcap else x


def _inside_window(length: int, rows: torch.Tensor, window: Window) -> torch.Tensor:
    """``[L, G]``: whether global key ``rows[g]`` lies inside row ``i``'s window (the windowed
    kernel counted it already)."""
    i = torch.arange(length, device=rows.device).view(length, 1)
    j = rows.view(1, -1)
    left, right = window
    inside = torch.ones(length, rows.numel(), dtype=torch.bool, device=rows.device)
    if left >= 0:
        inside = inside & (j >= i - left)
    if right >= 0:
        inside = inside & (j <= i + right)
    return inside


def _row_slots(length: int, rows: torch.Tensor) -> torch.Tensor:
    """``[L]`` int64: ``g`` at position ``rows[g]``, -1 at the other positions (``rows`` unique)."""
    slots = torch.full((length,), -1, dtype=torch.long, device=rows.device)
    return slots.index_copy(0, rows, torch.arange(rows.numel(), device=rows.device))


def _at_rows(
    base: torch.Tensor, per_row: torch.Tensor, slots: torch.Tensor, *, replace: bool = False
) -> torch.Tensor:
    """``base`` (``[B, H, L, ...]``) plus -- ``replace``: replaced by -- ``per_row`` (``[B, H, G,
    ...]``) at the global positions (:func:`_row_slots`), in ``base``'s dtype. A gather and a
    ``where`` rather than ``index_add`` / ``index_copy``, so that compiled, Inductor can fuse it
    into the kernel that produces ``base`` and its dtype conversion after (a scatter is a kernel
    of its own, after ``base`` is written out)."""
    picked = per_row.index_select(2, slots.clamp(min=0)).to(base.dtype)  # [B, H, L, ...]
    is_row = (slots >= 0).view(-1, *([1] * (base.dim() - 3)))
    return torch.where(is_row, picked if replace else base + picked, base)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, H, L, D]`` as ``[B, Hkv, H / Hkv, L, D]`` (query heads grouped over their kv head)."""
    b, h, length, d = q.shape
    return q.reshape(b, kv_heads, h // kv_heads, length, d)


def _dense_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out_w: torch.Tensor,
    lse_w: torch.Tensor,
    rows: torch.Tensor,
    window: Window,
    scale: float,
    softcap: float,
    dense_rows: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The window's ``(out_w, lse_w)`` merged with every row's global keys outside its window, and
    (``dense_rows``) the global rows' attention over every key written over their rows: fresh
    ``(out [B, H, L, Dv] in out_w's dtype, lse [B, H, L] float32 at least)``."""
    b, h, length, _ = q.shape
    kv_heads = k.shape[1]
    qg = _grouped(q, kv_heads)
    kg, vg = k.unsqueeze(2), v.unsqueeze(2)  # [B, Hkv, 1, L, D]
    keys, values = kg.index_select(3, rows), vg.index_select(3, rows)  # [B, Hkv, 1, G, D]
    s = _capped(_dot(qg, keys) * scale, softcap)  # [B, Hkv, group, L, G]
    s = s.masked_fill(_inside_window(length, rows, window), -math.inf)
    lse_c = torch.logsumexp(s, dim=-1)  # -inf where the window holds every global key
    p = torch.exp(s - finite_lse(lse_c).unsqueeze(-1))
    out_c = _dot(p, values.transpose(-1, -2)).reshape(b, h, length, -1)
    out, lse = merge_core((out_w.to(out_c.dtype), out_c), (lse_w, lse_c.reshape(lse_w.shape)))
    if dense_rows:
        q_rows = qg.index_select(3, rows)  # [B, Hkv, group, G, D]
        x = _capped(_dot(kg, q_rows) * scale, softcap)  # [B, Hkv, group, L, G]: keys on the long axis
        lse_g = torch.logsumexp(x, dim=-2)  # every key is visible: finite
        p_g = torch.exp(x - lse_g.unsqueeze(-2))
        out_g = _long_sum(p_g.transpose(-1, -2), vg)  # [B, Hkv, group, G, Dv]
        slots = _row_slots(length, rows)
        out = _at_rows(out, out_g.reshape(b, h, rows.numel(), -1), slots, replace=True)
        lse = _at_rows(lse, lse_g.reshape(b, h, rows.numel()), slots, replace=True)
    return out.to(out_w.dtype), lse


class _Saved(NamedTuple):
    """What both dense backward parts read: q and k/v grouped (``[B, Hkv, group or 1, L, D]``),
    the final out / lse and the gradients in float32 at least, the global positions."""

    qg: torch.Tensor
    kg: torch.Tensor
    vg: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    g_out: torch.Tensor
    g_lse: torch.Tensor | None
    rows: torch.Tensor
    scale: float
    softcap: float


def _global_keys_backward(
    t: _Saved, g_out: torch.Tensor, slots: torch.Tensor, window: Window
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq [B, Hkv, group, L, D], dk, dv [B, Hkv, G, D])`` of every row but the global ones
    (the global rows' part takes theirs) against the global keys outside its window."""
    keys, values = t.kg.index_select(3, t.rows), t.vg.index_select(3, t.rows)
    gk = _grouped(g_out, t.kg.shape[1])  # in dout's dtype: dv's _long_sum rounds P, not it
    rowsum = (gk.to(t.out.dtype) * t.out).sum(-1)
    if t.g_lse is not None:
        rowsum = rowsum - t.g_lse
    x = _dot(t.qg, keys) * t.scale  # [B, Hkv, group, L, G]
    counted = _inside_window(t.qg.shape[3], t.rows, window) | (slots >= 0).unsqueeze(-1)
    s = _capped(x, t.softcap).masked_fill(counted, -math.inf)
    p = torch.exp(s - t.lse.unsqueeze(-1))  # the final lse: finite (every row sees itself)
    ds = _score_grad(p, _dot(gk, values), rowsum.unsqueeze(-1), x, t.softcap)
    dq = _dot(ds, keys.transpose(-1, -2)) * t.scale
    dk = _long_sum(ds.transpose(-1, -2), t.qg).sum(2) * t.scale
    dv = _long_sum(p.transpose(-1, -2), gk).sum(2)
    return dq, dk, dv


def _global_rows_backward(t: _Saved, window: Window) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq [B, Hkv, group, G, D], dk, dv [B, Hkv, L, D])`` of the global rows against the keys
    outside their window (the window's kernel backward took those inside, from the rows' own
    dout)."""
    q_rows = t.qg.index_select(3, t.rows)  # [B, Hkv, group, G, D]
    g_rows = t.g_out.index_select(3, t.rows)
    rowsum = (g_rows * t.out.index_select(3, t.rows)).sum(-1)  # [B, Hkv, group, G]
    if t.g_lse is not None:
        rowsum = rowsum - t.g_lse.index_select(3, t.rows)
    x = _dot(t.kg, q_rows) * t.scale  # [B, Hkv, group, L, G]: keys on the long axis
    # Key j lies in row r's window (left, right) iff r lies in key j's mirrored one (right, left).
    in_window = _inside_window(t.kg.shape[3], t.rows, (window[1], window[0]))
    s = _capped(x, t.softcap).masked_fill(in_window, -math.inf)
    p = torch.exp(s - t.lse.index_select(3, t.rows).unsqueeze(-2))
    ds = _score_grad(p, _dot(t.vg, g_rows), rowsum.unsqueeze(-2), x, t.softcap)
    dq = _long_sum(ds.transpose(-1, -2), t.kg) * t.scale
    dk = _dot(ds, q_rows.transpose(-1, -2)).sum(2) * t.scale
    dv = _dot(p, g_rows.transpose(-1, -2)).sum(2)
    return dq, dk, dv


def _dense_backward(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    g_out: torch.Tensor,
    g_lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    rows: torch.Tensor,
    window: Window,
    scale: float,
    softcap: float,
    dense_rows: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` (the window's, in their dtypes) plus the dense parts' gradients, from the
    final ``out`` and ``lse``: every other row's global keys outside its window and, ``dense_rows``,
    the global rows' keys outside theirs."""
    b, h, length, d = q.shape
    kv_heads = k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)

    def grouped(t: torch.Tensor) -> torch.Tensor:
        return _grouped(t.unsqueeze(-1), kv_heads).squeeze(-1).to(acc)  # [B, H, L] -> [B, Hkv, group, L]

    saved = _Saved(
        _grouped(q, kv_heads), k.unsqueeze(2), v.unsqueeze(2), _grouped(out, kv_heads).to(acc), grouped(lse),
        _grouped(g_out, kv_heads).to(acc), None if g_lse is None else grouped(g_lse), rows, scale, softcap,
    )  # fmt: skip
    slots = _row_slots(length, rows)
    cq, ck, cv = _global_keys_backward(saved, g_out, slots, window)
    dq_acc = dq.to(acc) + cq.reshape(b, h, length, d)
    dk_acc = _at_rows(dk.to(acc), ck, slots)
    dv_acc = _at_rows(dv.to(acc), cv, slots)
    if dense_rows:
        rq, rk, rv = _global_rows_backward(saved, window)
        dq_acc = _at_rows(dq_acc, rq.reshape(b, h, rows.numel(), d), slots)
        dk_acc, dv_acc = dk_acc + rk, dv_acc + rv
    return dq_acc.to(dq.dtype), dk_acc.to(dk.dtype), dv_acc.to(dv.dtype)


_EAGER_PARTS = DenseParts(_dense_forward, _dense_backward)


# One module-level function per compiled part: Dynamo keeps its graphs (and its recompile limit)
# per code object, and the forward and backward must not share one. Only ever run compiled:
# torch's flag behind ``no_graph_breaks`` is process-wide eagerly.
def _dense_forward_one_graph(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    with _compat.no_graph_breaks():
        return _dense_forward(*args)


def _dense_backward_one_graph(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with _compat.no_graph_breaks():
        return _dense_backward(*args)


#: Inductor options of the compiled dense parts (``torch.compile(options=...)``), read by the first
#: :func:`compiled_dense_parts` call. No options by default; ``{"cpp_wrapper": True}`` launches their
#: kernels from C++ (less host time per call, a C++ compile on the first), which
#: benchmarks/global_tokens_dense_probe.py times against the default on CUDA.
_INDUCTOR_OPTIONS: dict[str, Any] = {}


class _CompiledPart:
    """A dense part compiled with :data:`_INDUCTOR_OPTIONS`; where a compile fails under them (the
    C++ wrapper needs a C++ compiler and the CUDA headers at compile time), compiled again without
    them, with a warning, and so from then on. A failure without options is raised."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        options = dict(_INDUCTOR_OPTIONS)
        #: ``(compiled function, its options)``, replaced as one (threads read it unlocked).
        self._state = (self._compile(options), options)

    def _compile(self, options: dict[str, Any]) -> Callable[..., Any]:
        return torch.compile(self._fn, fullgraph=_compat.FULLGRAPH_NEEDED, options=options or None)

    def __call__(self, *args: Any) -> Any:
        compiled, options = self._state
        try:
            return _compat.call_compiled(compiled, *args)
        except _compat.INDUCTOR_COMPILE_ERRORS as exc:
            if not options:
                raise
            with self._lock:  # several threads may fail at once: one falls back, all retry
                if self._state[1]:
                    reason = next((line for line in str(exc).splitlines() if line.strip()), "")
                    warnings.warn(
                        f"flexattn_zoo: the global-tokens dense part {self._fn.__name__} could not "
                        f"be compiled with Inductor options {options} ({type(exc).__name__}: "
                        f"{reason.strip()}); compiled without them (its kernels launch from "
                        "Python: more host time per call)",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    self._state = (self._compile({}), {})
            return _compat.call_compiled(self._state[0], *args)


@functools.cache
def compiled_dense_parts() -> DenseParts:
    """:class:`DenseParts` compiled by ``torch.compile`` (eager calls on CUDA; :class:`_CompiledPart`).
    Default (automatic) dynamic shapes: a second length or batch compiles one shape-generic graph,
    not one per shape."""
    return DenseParts(_CompiledPart(_dense_forward_one_graph), _CompiledPart(_dense_backward_one_graph))


__all__ = ["GLOBAL_ROWS_DENSE_MAX_SCORES", "WindowKernels", "global_tokens_attention"]
