"""FlashAttention-4's kernels as torch ops: ``flexattn_zoo::fa4_fwd`` and ``flexattn_zoo::fa4_bwd``.

``torch.library.custom_op`` s with fake (meta) implementations and an autograd formula, so the
``fa4`` route's kernel call is one node of a caller's ``torch.compile`` graph (and of a
``torch.export`` ed program) rather than Python that Dynamo cannot trace. Registered when this
module is imported (cheap, no kernel or package loaded); ``flash_attn.cute`` is imported only
when a real implementation runs, so the ops exist, and trace, without flash-attn-4 installed.

Conventions (FA4's own, which the ops pass through unchanged):

* Layouts. Batched: ``q [B, L, Hq, D]``, ``k [B, L, Hkv, D]``, ``v [B, L, Hkv, Dv]``. Packed:
  ``[T, H, D]`` with ``cu_seqlens`` (int32 ``[S + 1]``, the offsets of ``S`` segments, the same
  for queries and keys) and ``max_seqlen`` (the longest segment; 0 when batched). Any strides with
  a unit last stride: ``[B, H, L, D]`` tensors viewed with ``transpose(1, 2)`` go in without a
  copy. ``Hq`` is a multiple of ``Hkv``: query head ``h`` reads kv head ``h // (Hq // Hkv)``.
* Scores: ``scale * q . k``, then ``softcap * tanh(s / softcap)`` when ``softcap > 0`` (FA4
  evaluates that ``tanh`` with the hardware approximation); 0 means no soft-cap.
* Window: key ``j`` of query ``i`` (positions inside their row or segment) is visible when
  ``i - window_left <= j <= i + window_right``; ``-1`` is unbounded on that side, so
  ``(-1, 0)`` is causal and ``(-1, -1)`` no mask. Plain ints: schemas take no tuples.
* ``fa4_fwd`` returns ``(out, lse)``: ``out`` with q's dtype, ``[..., Hq, Dv]``, contiguous;
  ``lse`` float32, contiguous, the natural-log log-sum-exp of each row's scores,
  ``[B, Hq, L]`` batched and ``[Hq, T]`` packed. The lse is always computed (FA4's kernels keep
  it for the backward anyway).
* ``fa4_bwd(dout, q, k, v, out, lse, ...)`` returns ``(dq, dk, dv)`` laid out as
  ``torch.empty_like`` of ``q``, ``k``, ``v`` lays them out (FA4's own allocation; contiguous
  when an input's last stride is not 1).

Autograd reaches ``q, k, v`` through ``out`` and through ``lse`` (attention sinks read the lse):
the gradient of ``lse_i`` is ``P_i`` itself, so an lse gradient ``g`` is one more ``fa4_bwd``
call with zero values and an ``(out, dout)`` pair whose row dot product is ``-g`` (the FA
backward's ``dS = P * (dP - rowsum(dout * out))`` then is ``P * g``). That second call runs only
when the lse has a gradient: eagerly when it was used, and under ``torch.compile`` also when the
lse is an output of the compiled function (AOTAutograd passes a tangent for it, zeros if unused).
No double backward.

Plain eager calls of :func:`fa4_attention` skip the ops' dispatch (an ``autograd.Function``
around the same implementations and formula: less host time per call); traced calls, tensor
subclasses and calls under a torch function / dispatch mode or a functorch transform take the ops.

The real implementations call the module attributes ``_fwd_kernel`` / ``_bwd_kernel`` (FA4,
under :func:`~flexattn_zoo.backends.base.flash_cute_lock`, its launches replayed for kinds of
call already recorded: :mod:`~flexattn_zoo.backends.fa4_replay`); tests substitute a CPU
reference.
The ops are registered for every device (the route only ever sends CUDA tensors).
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

import torch

from flexattn_zoo import _compat
from flexattn_zoo.backends import fa4_replay
from flexattn_zoo.backends.base import flash_cute_lock

FWD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens, int max_seqlen, float scale, float softcap, "
    "int window_left, int window_right) -> (Tensor, Tensor)"
)
BWD_SCHEMA = (
    "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? cu_seqlens, "
    "int max_seqlen, float scale, float softcap, int window_left, int window_right) "
    "-> (Tensor, Tensor, Tensor)"
)


def fa4_window(window: tuple[int, int]) -> tuple[int | None, int | None]:
    """A ``VarlenForm`` window (``-1`` = unbounded) as FA4's ``window_size`` (``None`` = unbounded).

    FA4 reads ``(None, 0)`` as causal and ``(None, None)`` as no mask; key ``j`` of query ``i`` is
    visible when ``i - left <= j <= i + right`` (the same diagonal as ours since Lq == Lkv).
    """
    left, right = window
    return (None if left < 0 else left, None if right < 0 else right)


# -- the real kernels (FA4) -------------------------------------------------------------------


def _split(res: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FA4 returns ``(out, lse)`` (lse may be None when not asked for) or just ``out``."""
    if isinstance(res, tuple):
        return res[0], (res[1] if len(res) > 1 else None)
    return res, None


def _fa4_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int,
    scale: float,
    softcap: float,
    window_left: int,
    window_right: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FA4's public forward (``flash_attn_func`` / ``flash_attn_varlen_func``) with its lse, replayed
    from its recorded launch for a kind of call already recorded (:mod:`~flexattn_zoo.backends.fa4_replay`)."""
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func, interface

    common: dict[str, Any] = dict(
        softmax_scale=scale,
        causal=False,
        window_size=fa4_window((window_left, window_right)),
        softcap=softcap,
        return_lse=True,
    )

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None) -> Any:
        if cu_seqlens is None:
            return flash_attn_func(q, k, v, **common)
        return flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen,
            **common,
        )

    inputs = (q, k, v, cu_seqlens)
    # No autograd graph of FA4's own: the op's autograd formula is ours (fa4_bwd).
    with torch.no_grad():
        if fa4_replay.enabled():
            key = (
                "fwd",
                *_replay_key(inputs, interface),
                max_seqlen,
                scale,
                softcap,
                window_left,
                window_right,
            )
            res = fa4_replay.launch(key, interface, call, inputs)
        else:
            res = call(*inputs)
    out, lse = _split(res)
    if lse is None:
        raise RuntimeError("flash_attn.cute returned no lse although return_lse=True was asked")
    return out, lse


@functools.cache
def _parameters(fn: Any) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def _fa4_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int,
    scale: float,
    softcap: float,
    window_left: int,
    window_right: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA4's backward launcher ``flash_attn.cute.interface._flash_attn_bwd`` (private: FA4 has no
    public backward), called as FA4's own autograd Functions call it. Its keyword parameters
    differ between flash-attn-4 releases, so they are matched against its signature; one this
    call needs (a window, cu_seqlens) and the installed release lacks is an error, not dropped."""
    from flash_attn.cute import interface
    from flash_attn.cute.interface import _flash_attn_bwd

    left, right = fa4_window((window_left, window_right))
    wanted: dict[str, Any] = dict(
        softmax_scale=scale,
        causal=False,
        softcap=softcap,
        window_size_left=left,
        window_size_right=right,
    )
    if cu_seqlens is not None:
        wanted.update(
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen,
        )
    known = _parameters(_flash_attn_bwd)
    lacking = [
        name for name, value in wanted.items() if name not in known and value not in (None, False, 0.0)
    ]
    if lacking:
        raise RuntimeError(
            f"this flash-attn-4's backward (_flash_attn_bwd) takes no {', '.join(lacking)}: "
            "upgrade flash-attn-4, or pick another route for this mask"
        )
    kwargs = {name: value for name, value in wanted.items() if name in known and name not in _CU_SEQLENS}

    def call(*tensors: torch.Tensor | None) -> Any:
        *qkv_out_dout_lse, cu = tensors
        cu_kwargs = {name: cu for name in _CU_SEQLENS if name in known} if cu is not None else {}
        return _flash_attn_bwd(*qkv_out_dout_lse, **kwargs, **cu_kwargs)

    inputs = (q, k, v, out, dout, lse, cu_seqlens)
    with torch.no_grad():
        if fa4_replay.enabled():
            key = ("bwd", *_replay_key(inputs, interface), tuple(sorted(kwargs.items())))
            # FA4's backward accumulates dq (and dk/dv with grouped heads) with atomics: the check
            # run of a recording compares within a tolerance.
            dq, dk, dv = fa4_replay.launch(key, interface, call, inputs, exact=False)
        else:
            dq, dk, dv = call(*inputs)
    return dq, dk, dv


_CU_SEQLENS = ("cu_seqlens_q", "cu_seqlens_k")


#: Environment variables FA4's launchers read on every call (SM count; sm100 backward tiles and
#: MLA kernel choice).
_FA4_PER_CALL_ENV = (
    "FLASH_ATTENTION_NUM_SMS",
    "FLASH_ATTENTION_BWD_TILE_N",
    "FLASH_ATTENTION_HD256_GENERIC_BWD",
    "FLASH_ATTENTION_MLA_1CTA",
)


def _replay_key(tensors: tuple[torch.Tensor | None, ...], interface: Any) -> tuple[Any, ...]:
    """What FA4's launchers read from their tensor arguments and the process (fa4_replay): the
    environment variables of ``_FA4_PER_CALL_ENV``, FA4's log level (part of its kernels' compile
    key; ``set_fa_log_level``) and the module-level tunables of ``flash_attn.cute.interface``
    its varlen scheduling reads."""
    return (
        *(fa4_replay.tensor_key(t) for t in tensors),
        fa4_replay.identities(tensors),
        *(os.environ.get(name) for name in _FA4_PER_CALL_ENV),
        _fa4_log_level()(),
        getattr(interface, "BIN_BATCH_SEARCH_THRESH", None),
        getattr(interface, "USE_BLOCKS_TO_BATCH", None),
    )


@functools.cache
def _fa4_log_level() -> Any:
    """FA4's log-level getter (imported once; a constant ``None`` where FA4 has none)."""
    from flash_attn.cute import fa_logging

    return getattr(fa_logging, "get_fa_log_level", lambda: None)


#: What the ops' real implementations call; tests replace them with a CPU reference.
_fwd_kernel = _fa4_forward
_bwd_kernel = _fa4_backward


# -- layouts of the results (the fake implementations and the real ones agree) ----------------


def _grad_like(t: torch.Tensor) -> torch.Tensor:
    """An empty gradient for ``t`` laid out as FA4 allocates it: ``empty_like`` of ``t``, after
    FA4's own ``contiguous()`` when the last stride is not 1."""
    fmt = torch.preserve_format if t.stride(-1) == 1 else torch.contiguous_format
    return torch.empty_like(t, memory_format=fmt)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span without gaps or overlaps (strides a
    permutation of contiguous ones), when ``empty_like`` keeps its strides."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _as_grad_of(g: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``g`` in :func:`_grad_like`'s layout (a copy only if the kernel laid it out otherwise)."""
    if t.stride(-1) == 1 and g.stride() == t.stride() and _dense(t):
        return g  # the usual case, known without allocating
    want = _grad_like(t)
    if g.stride() == want.stride():
        return g
    return want.copy_(g)


def _lse_shape(q: torch.Tensor, packed: bool) -> tuple[int, ...]:
    return (q.shape[1], q.shape[0]) if packed else (q.shape[0], q.shape[2], q.shape[1])


# -- the ops ----------------------------------------------------------------------------------


def fa4_fwd_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int,
    scale: float,
    softcap: float,
    window_left: int,
    window_right: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flexattn_zoo::fa4_fwd``'s implementation (FA4 under the lock; contiguous ``out``, float32
    ``lse``), also called directly by the eager path."""
    with flash_cute_lock():
        out, lse = _fwd_kernel(q, k, v, cu_seqlens, max_seqlen, scale, softcap, window_left, window_right)
    return out.contiguous(), lse.float().contiguous()


fa4_fwd = torch.library.custom_op("flexattn_zoo::fa4_fwd", mutates_args=(), schema=FWD_SCHEMA)(fa4_fwd_eager)


@fa4_fwd.register_fake
def _fa4_fwd_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int,
    scale: float,
    softcap: float,
    window_left: int,
    window_right: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse = q.new_empty(_lse_shape(q, cu_seqlens is not None), dtype=torch.float32)
    return out, lse


def fa4_bwd_eager(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int,
    scale: float,
    softcap: float,
    window_left: int,
    window_right: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``flexattn_zoo::fa4_bwd``'s implementation (FA4 under the lock; gradients laid out as
    :func:`_grad_like`), also called directly by the eager path."""
    with flash_cute_lock():
        dq, dk, dv = _bwd_kernel(
            dout, q, k, v, out, lse, cu_seqlens, max_seqlen, scale, softcap, window_left, window_right
        )
    return _as_grad_of(dq, q), _as_grad_of(dk, k), _as_grad_of(dv, v)


fa4_bwd = torch.library.custom_op("flexattn_zoo::fa4_bwd", mutates_args=(), schema=BWD_SCHEMA)(fa4_bwd_eager)


@fa4_bwd.register_fake
def _fa4_bwd_fake(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int,
    scale: float,
    softcap: float,
    window_left: int,
    window_right: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _grad_like(q), _grad_like(k), _grad_like(v)


# -- autograd -----------------------------------------------------------------------------------


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, cu_seqlens, max_seqlen, scale, softcap, window_left, window_right = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.scalars = (max_seqlen, scale, softcap, window_left, window_right)
    ctx.eager = False  # the op's own formula (traceable); _EagerFA4 sets True
    ctx.set_materialize_grads(False)  # an unused out or lse gives None: no work for it


def fa4_lse_backward(
    g_lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    rest: tuple[Any, ...],
    bwd: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dq, dk)`` of ``sum(g_lse * lse)``, by one ``fa4_bwd`` call (module docstring).

    The FA backward computes ``dS = P * (dout . v_j - D)`` with ``D = rowsum(dout * out)``; with
    ``v = 0`` and ``D = -g`` that is ``P * g``, the gradient of ``g * lse`` with respect to the
    scores (soft-cap, window and segments applied by the kernel as for any gradient). ``g`` goes
    in as two low-precision parts ``hi + lo`` (summed in float32 by the kernel's ``D``), so it
    keeps about 16 bits rather than the 8 of one bfloat16.
    """
    g = g_lse.transpose(-1, -2).float()  # [B, H, L] -> [B, L, H]; [H, T] -> [T, H]
    hi = g.to(q.dtype)
    parts = [hi, (g - hi.float()).to(q.dtype)][: out.shape[-1]]
    pad = out.shape[-1] - len(parts)
    d_out = torch.nn.functional.pad(-torch.stack(parts, dim=-1), (0, pad))
    ones = torch.ones(*g.shape, len(parts), dtype=q.dtype, device=q.device)
    o = torch.nn.functional.pad(ones, (0, pad))
    dq, dk, _ = bwd(d_out, q, k, torch.zeros_like(v), o, lse, *rest)
    return dq, dk


def _backward(ctx: Any, g_out: torch.Tensor | None, g_lse: torch.Tensor | None) -> tuple[Any, ...]:
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    rest = (cu_seqlens, *ctx.scalars)
    # Eager only when the forward was and the backward is (compiled autograd traces backwards).
    bwd = fa4_bwd_eager if ctx.eager and _plain_eager(g_out, g_lse) else torch.ops.flexattn_zoo.fa4_bwd
    if g_out is not None:
        dq, dk, dv = bwd(g_out, q, k, v, out, lse, *rest)
    else:
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if g_lse is not None:
        lq, lk = fa4_lse_backward(g_lse, q, k, v, out, lse, rest, bwd)
        dq, dk = dq + lq, dk + lk
    return dq, dk, dv, None, None, None, None, None, None


fa4_fwd.register_autograd(_backward, setup_context=_setup_context)


# -- the eager path -----------------------------------------------------------------------------
#
# A custom op costs host time on every eager call (the dispatcher, schema checks, its autograd
# wrapper: with stub kernels on a CPU, 5-9 us more per forward and 80-120 us more per forward +
# backward than this path; benchmarks/fa4_op_overhead_probe.py), which FA4's host-bound calls pay
# on top of FA4's own Python. Plain eager calls therefore run the same implementations and the
# same autograd formula through an ``autograd.Function``; anything that needs the op as a graph
# node takes the op: torch.compile / export / jit tracing, tensor subclasses (FakeTensor,
# DTensor, nn.Parameter), and any active TorchFunctionMode, TorchDispatchMode or functorch
# transform (they intercept ops, e.g. FLOP counters, ``with torch.device(...)``, vmap and grad).
# Plain eager calls without gradients (inference, decoding) skip the ``autograd.Function`` too:
# with stub kernels on a CPU, 6 us per forward against 17 through it.


class _EagerFA4(torch.autograd.Function):
    """``flexattn_zoo::fa4_fwd`` with its autograd formula, without the op's dispatch."""

    @staticmethod
    def forward(ctx: Any, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fa4_fwd's arguments
        out, lse = fa4_fwd_eager(*args)
        _setup_context(ctx, args, (out, lse))
        ctx.eager = True
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # no double backward, as the op (which raises)
    def backward(ctx: Any, g_out: torch.Tensor | None, g_lse: torch.Tensor | None) -> tuple[Any, ...]:
        return _backward(ctx, g_out, g_lse)


def _plain_eager(*tensors: torch.Tensor | None) -> bool:
    """Whether a call may skip the op: eager, plain tensors, and nothing intercepting ops."""
    return (
        all(t is None or type(t) is torch.Tensor for t in tensors)
        and not _compat.is_compiling()
        and not torch.jit.is_tracing()
        and not torch._C._is_torch_function_mode_enabled()
        and torch._C._len_torch_dispatch_stack() == 0
        and torch._C._functorch.peek_interpreter_stack() is None
    )


def plain_eager(*tensors: torch.Tensor | None) -> bool:
    """Whether a call with ``tensors`` is a plain eager one (see :func:`fa4_attention`): callers
    that run FA4's eager implementations directly may only do so then."""
    return _plain_eager(*tensors)


def fa4_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    softcap: float = 0.0,
    window: tuple[int, int] = (-1, -1),
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flexattn_zoo::fa4_fwd`` with the window as a ``VarlenForm`` pair: ``(out, lse)`` in FA4's
    layouts (module docstring), differentiable through both. Plain eager calls run the op's
    implementation and autograd formula without the op's dispatch (see "the eager path")."""
    args = (q, k, v, cu_seqlens, max_seqlen, scale, softcap, window[0], window[1])
    if _plain_eager(q, k, v, cu_seqlens):
        if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
            return fa4_fwd_eager(*args)  # nothing to differentiate: no autograd.Function either
        out, lse = _EagerFA4.apply(*args)
    else:
        out, lse = torch.ops.flexattn_zoo.fa4_fwd(*args)
    return out, lse


__all__ = [
    "BWD_SCHEMA",
    "FWD_SCHEMA",
    "fa4_attention",
    "fa4_bwd",
    "fa4_bwd_eager",
    "fa4_fwd",
    "fa4_fwd_eager",
    "fa4_lse_backward",
    "fa4_window",
    "plain_eager",
]
