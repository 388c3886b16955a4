"""Every private or version-specific torch import lives here (torch 2.10 .. 2.13).

Nothing here probes hardware at import time; feature checks are functions evaluated on use.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import inspect
import operator
import sys
import threading
import time
import types
import typing
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false as _guard_or_false
from torch.fx.experimental.symbolic_shapes import guard_or_true as _guard_or_true
from torch.fx.experimental.symbolic_shapes import statically_known_true as _statically_known_true
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

__all__ = [
    "BlockMask",
    "SDPBackend",
    "create_block_mask",
    "flex_attention",
    "sdpa_kernel",
]

_MAJOR, _MINOR = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
TORCH_VERSION: tuple[int, int] = (_MAJOR, _MINOR)

#: torch 2.11's FLASH flex backend returns lse scaled by ln 2 (fixed in 2.13): never expose it there.
FLASH_LSE_TRUSTWORTHY = TORCH_VERSION >= (2, 13)
#: Inductor's CPU flex kernel before torch 2.13 refuses one tensor passed as two of q, k, v
#: ("Unsupported for now if query, key, value are the same buffer", pytorch issue 157612): a
#: compiled call sees one graph input where self-attention passes q as k and v.
FLEX_CPU_NEEDS_DISTINCT_INPUTS = TORCH_VERSION < (2, 13)


def make_block_mask(
    seq_lengths: tuple[int, int],
    kv_num_blocks: torch.Tensor,
    kv_indices: torch.Tensor,
    full_kv_num_blocks: torch.Tensor | None,
    full_kv_indices: torch.Tensor | None,
    q_num_blocks: torch.Tensor,
    q_indices: torch.Tensor,
    full_q_num_blocks: torch.Tensor | None,
    full_q_indices: torch.Tensor | None,
    block_size: tuple[int, int],
    mask_mod: Any,
) -> BlockMask:
    """Construct a BlockMask with both kv- and q-side indices already computed.

    ``BlockMask.from_kv_blocks`` would derive the q side through a dense transpose (measured 9 ms
    and 3.8 GB at 1M tokens); we already have the block map, so we pass both sides directly. The
    positional constructor is the same in 2.10-2.13.
    """
    return BlockMask(
        seq_lengths,
        kv_num_blocks,
        kv_indices,
        full_kv_num_blocks,
        full_kv_indices,
        q_num_blocks,
        q_indices,
        full_q_num_blocks,
        full_q_indices,
        block_size,
        mask_mod,
    )


@functools.cache
def varlen_attn_fn() -> Any | None:
    """``torch.nn.attention.varlen.varlen_attn`` or None when this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def varlen_aux_request(lse: bool) -> dict[str, Any]:
    """Keyword arguments asking ``varlen_attn`` for the lse ({} when not asked).

    ``torch.nn.attention.varlen.AuxRequest``: used on 2.11 (GPU suite), checked on 2.13 (CI)."""
    if not lse:
        return {}
    from torch.nn.attention.varlen import AuxRequest

    return {"return_aux": AuxRequest(lse=True)}


def _varlen_parameters() -> frozenset[str]:
    fn = varlen_attn_fn()
    return frozenset() if fn is None else frozenset(inspect.signature(fn).parameters)


#: The parameters this torch's ``varlen_attn`` takes, read once at import: plan choices ask while
#: ``torch.compile`` traces, where a cached function is traced through (Dynamo warns on each).
VARLEN_PARAMETERS = _varlen_parameters()


def varlen_supports(param: str) -> bool:
    """Whether this torch's ``varlen_attn`` takes ``param`` (2.11 lacks enable_gqa, seqused_k...)."""
    return param in VARLEN_PARAMETERS


@functools.cache
def flash_cute_available() -> bool:
    """Whether the FlashAttention-4 CuTe DSL package (flex ``BACKEND="FLASH"``) is importable.

    Looked up once per process (every plan asks): installing flash-attn-4 needs a restart. The
    package is looked up before its submodule: ``find_spec`` of a submodule imports the parent and
    raises when there is none, which ``torch.compile`` (whose trace may make the first call) turns
    into an internal error instead of letting the ``except`` below see it."""
    try:
        if importlib.util.find_spec("flash_attn") is None:
            return False
        return importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):
        return False


# -- SDPA's fused kernels as ATen ops -------------------------------------------------------
# sdpa_split needs each part's lse and its own backward call (given the merged out and lse);
# ``F.scaled_dot_product_attention`` offers neither, so these call SDPA's private per-kernel ops.


def cudnn_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool, scale: float
) -> Any:
    """cuDNN's SDPA forward with its lse, no bias, no dropout: the op's whole result ``(out, lse,
    cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_attn_mask)``.

    ``aten._scaled_dot_product_cudnn_attention``: used on 2.11 (GPU suite); checked on 2.13 (CI: the
    op and its schema exist, a CPU build cannot run it)."""
    return torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, is_causal, False, scale=scale
    )


def cudnn_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    forward: tuple[Any, ...],
    *,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`cudnn_attention`; ``forward`` is what it returned (its first
    entries may be dropped to None: only the lengths and rng state are read from it).

    ``aten._scaled_dot_product_cudnn_attention_backward``: used on 2.11 (GPU suite); checked on 2.13
    (CI: the op and its schema exist, a CPU build cannot run it)."""
    cum_q, cum_k, max_q, max_k, seed, offset = forward[2:8]
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        seed,
        offset,
        None,
        cum_q,
        cum_k,
        max_q,
        max_k,
        0.0,
        is_causal,
        scale=scale,
    )


def cpu_flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of torch's CPU flash kernel (no mask, no dropout).

    ``aten._scaled_dot_product_flash_attention_for_cpu``: checked on 2.13 (CI runs it); the GPU
    suite on 2.11 does not reach it."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, scale=scale
    )
    return out, lse


def cpu_flash_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`cpu_flash_attention`, given its ``out`` and ``lse``.

    ``aten._scaled_dot_product_flash_attention_for_cpu_backward``: checked on 2.13 (CI runs it); the
    GPU suite on 2.11 does not reach it."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, is_causal, scale=scale
    )


def recording_mode(on_op: Callable[[Any, tuple[Any, ...], Any], None]) -> Any:
    """A ``TorchDispatchMode`` that runs every ATen op as usual and reports ``(op, args, out)`` (the
    positional arguments, then the keyword arguments' values) to
    ``on_op``: how :mod:`flexattn_zoo.functions` sees which ops a user's mod runs on 0-d indices.

    ``torch.utils._python_dispatch.TorchDispatchMode``: private but stable since torch 1.13,
    checked on 2.13."""
    return _recording_class()(on_op)


@functools.cache
def _recording_class() -> type:
    """The mode class of :func:`recording_mode`, made once (a class per call costs ~40 us)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Recording(TorchDispatchMode):
        def __init__(self, on_op: Callable[[Any, tuple[Any, ...], Any], None]) -> None:
            super().__init__()
            self.on_op = on_op

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            self.on_op(func, (*args, *(kwargs or {}).values()), out)
            return out

    return _Recording


class _IndexWithTensors(torch.overrides.TorchFunctionMode):
    """See :func:`index_with_tensors`."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.__getitem__ and isinstance(args[0], torch.Tensor):
            table, index = args[0], args[1]
            parts = index if isinstance(index, tuple) else (index,)
            if all(isinstance(p, (torch.Tensor, int)) and not isinstance(p, bool) for p in parts):
                as_tensors = [
                    p if isinstance(p, torch.Tensor) else torch.tensor(p, device=table.device) for p in parts
                ]
                return torch.ops.aten.index.Tensor(table, as_tensors)
        return func(*args, **(kwargs or {}))


def index_with_tensors() -> Any:
    """A context in which ``table[idx]`` with tensor (and int) indices is the ``aten.index`` op
    rather than Python's conversion of a 0-d index to an int: so ``doc[q_idx]`` works under
    ``torch.vmap`` on 0-d index tensors, as in flex's eager path and ``create_mask``.

    torch's own mode (``torch._dynamo._trace_wrapped_higher_order_op.TransformGetItemToIndex``)
    routes the op through an autograd.Function whose backward batching rule takes one value per
    element only: a gradient through ``learned[h][q_idx][kv_idx]`` (a row gathered from a tensor
    that requires grad) fails there ("idx shape ... must match value shape", torch 2.13). Plain
    ``aten.index`` has the same forward and autograd's own backward."""
    return _IndexWithTensors()


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return str(triton.__version__)


#: torch's own capability check per SDPA kernel (``torch.backends.cuda.can_use_*_attention``).
_SDPA_CAN_USE = {
    "FLASH_ATTENTION": "can_use_flash_attention",
    "EFFICIENT_ATTENTION": "can_use_efficient_attention",
    "CUDNN_ATTENTION": "can_use_cudnn_attention",
}


def _sdpa_switches() -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[str, ...]] | None:
    """torch's per-kernel SDPA enable flags as ``(getters, setters, SDPBackend names)``: what
    ``sdpa_kernel`` reads and writes (``torch.nn.attention._backend_names``, torch 2.5+), or None
    when this torch lays them out otherwise (``pin_sdpa_kernel`` then enters ``sdpa_kernel``)."""
    import torch.nn.attention as attn

    names = getattr(attn, "_backend_names", None)
    if not isinstance(names, dict):
        return None
    try:
        getters = tuple(getattr(torch._C, f"_get_{n}_sdp_enabled") for n in names)
        setters = tuple(getattr(torch._C, f"_set_sdp_use_{n}") for n in names)
        kernels = tuple(str(getattr(SDPBackend, v).name) for v in names.values())
    except AttributeError:
        return None
    return getters, setters, kernels


_SDPA_SWITCHES = _sdpa_switches()


@functools.cache
def _sdpa_flags(kernel: str | tuple[str, ...]) -> tuple[bool, ...] | None:
    """The enable flags ``sdpa_kernel([those backends])`` sets (None: unknown kernel or layout)."""
    kernels = (kernel,) if isinstance(kernel, str) else kernel
    if _SDPA_SWITCHES is None or any(k not in _SDPA_SWITCHES[2] for k in kernels):
        return None
    return tuple(other in kernels for other in _SDPA_SWITCHES[2])


def pin_sdpa_kernel(kernel: str | tuple[str, ...]) -> Any:
    """Enable SDPA kernel ``kernel`` (an ``SDPBackend`` name, or a tuple of them for SDPA's own
    choice among those) alone, as ``sdpa_kernel([kernel])`` does on entry; returns what
    :func:`restore_sdpa_kernels` needs to undo it. Eager calls only (while tracing use
    ``sdpa_kernel``, which Dynamo understands); the flags are process-global, so callers
    serialize pinned calls with a lock.

    Why not ``sdpa_kernel`` itself: it is a generator context manager that lists, dedups and
    sorts backends and reads and writes every flag by name on entry and exit -- 10-15 us of host
    time per call on a CPU, more than the whole SDPA call on a short problem. This reads the
    flags once and writes only those that differ from the pin (:func:`_flag_writes`), with the
    same effect."""
    want = _sdpa_flags(kernel)
    if want is None or _SDPA_SWITCHES is None:
        kernels = (kernel,) if isinstance(kernel, str) else kernel
        ctx = sdpa_kernel([getattr(SDPBackend, k) for k in kernels])
        ctx.__enter__()
        return ctx
    saved = tuple([get() for get in _SDPA_SWITCHES[0]])
    if saved != want:
        for set_flag, flag in _flag_writes(saved, want):
            set_flag(flag)
    return want, saved


def restore_sdpa_kernels(token: Any) -> None:
    """Undo :func:`pin_sdpa_kernel` (``token`` is what it returned)."""
    if type(token) is not tuple:
        token.__exit__(None, None, None)
        return
    want, saved = token
    if saved != want:
        for set_flag, flag in _flag_writes(want, saved):
            set_flag(flag)


@functools.cache
def _flag_writes(old: tuple[bool, ...], new: tuple[bool, ...]) -> tuple[tuple[Any, bool], ...]:
    """``(setter, flag)`` for each SDPA enable flag that differs between states ``old`` and
    ``new`` (as read by / for :data:`_SDPA_SWITCHES`): what takes the flags from one to the other.
    Cached per pair (a few states meet in a process), so a pin writes the one or two flags it
    changes without comparing them one by one in Python."""
    setters = _SDPA_SWITCHES[1]  # type: ignore[index]
    return tuple((set_flag, b) for set_flag, a, b in zip(setters, old, new, strict=True) if a != b)


#: SDPA kernels whose torch checks read a dense call's sequence lengths only through "is it 0" and
#: "are the query and key lengths equal" (FlashAttention-2's causal flag wants them equal); cuDNN's
#: checks read the lengths themselves (divisibility rules that change with its version).
_LENGTH_BLIND_KERNELS = frozenset({"FLASH_ATTENTION", "EFFICIENT_ATTENTION"})

#: Lengths up to this are asked about as they are; longer ones by their residue mod 8 above it.
_EXACT_LENGTHS = 128


def _length_class(length: int) -> int:
    return length if length <= _EXACT_LENGTHS else _EXACT_LENGTHS + length % 8


def sdpa_torch_refusal(
    kernel: str,
    q_shape: tuple[int, ...],
    kv_shape: tuple[int, ...],
    dtype: torch.dtype,
    arch: str,
    is_causal: bool,
    enable_gqa: bool,
    requires_grad: bool,
    dropout_p: float = 0.0,
    v_dim: int | None = None,
) -> str | None:
    """Why torch's own check refuses SDPA ``kernel`` for a CUDA call of these contiguous shapes
    (torch's debug text), or None when it accepts, has no check for that kernel, or cannot
    answer (no CUDA here, or ``arch`` is not the current device's).

    The check builds fake tensors (about a millisecond of host time), so its verdicts are cached.
    For FlashAttention-2 and the memory-efficient kernel the cache key holds each sequence length
    by class (itself up to 128, else 128 plus its residue mod 8, keeping equal lengths equal and
    unequal ones unequal): generation meets a new key length at every step, and must not pay the
    check each time."""
    call_q, call_kv = q_shape, kv_shape
    if kernel in _LENGTH_BLIND_KERNELS:
        q_len, kv_len = q_shape[-2], kv_shape[-2]
        q_class, kv_class = _length_class(q_len), _length_class(kv_len)
        if q_len != kv_len and q_class == kv_class:
            kv_class += 8
        q_shape = (*q_shape[:-2], q_class, q_shape[-1])
        kv_shape = (*kv_shape[:-2], kv_class, kv_shape[-1])
    why = _sdpa_torch_refusal_exact(
        kernel, q_shape, kv_shape, dtype, arch, is_causal, enable_gqa, requires_grad, dropout_p, v_dim
    )
    if why is not None and (q_shape, kv_shape) != (call_q, call_kv):
        why += f" (torch was asked about q / k shapes {q_shape} / {kv_shape}, this call's length class)"
    return why


@functools.lru_cache(maxsize=512)
def _sdpa_torch_refusal_exact(
    kernel: str,
    q_shape: tuple[int, ...],
    kv_shape: tuple[int, ...],
    dtype: torch.dtype,
    arch: str,
    is_causal: bool,
    enable_gqa: bool,
    requires_grad: bool,
    dropout_p: float = 0.0,
    v_dim: int | None = None,
) -> str | None:
    """:func:`sdpa_torch_refusal` for these exact shapes.

    The check runs on fake tensors (no memory) inside ``sdpa_kernel([kernel])``, so only the
    kernel's own constraints count, not the process's enable flags. Results depend only on the
    arguments and the GPU's capability (``arch``, part of the cache key: torch checks the
    current device), hence the cache.
    """
    name = _SDPA_CAN_USE.get(kernel)
    check = getattr(torch.backends.cuda, name, None) if name else None
    if check is None or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    if arch != f"sm{major}{minor}":
        return None  # a problem described for another GPU (FLEXATTN_ZOO_ARCH, a hand-built plan)
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = torch.device("cuda")
    with FakeTensorMode():
        q = torch.empty(q_shape, dtype=dtype, device=device, requires_grad=requires_grad)
        k = torch.empty(kv_shape, dtype=dtype, device=device, requires_grad=requires_grad)
        v_shape = kv_shape if v_dim is None else (*kv_shape[:-1], v_dim)
        v = torch.empty(v_shape, dtype=dtype, device=device, requires_grad=requires_grad)
    params = torch.backends.cuda.SDPAParams(q, k, v, None, dropout_p, is_causal, enable_gqa)
    with warnings.catch_warnings(record=True) as caught, sdpa_kernel([getattr(SDPBackend, kernel)]):
        warnings.simplefilter("always")
        ok = check(params, True)
    if ok:
        return None
    why = "; ".join(str(w.message).strip() for w in caught) or "no reason given"
    return f"torch's {name} refuses it: {why}"


@torch.compiler.assume_constant_result
def strict_deterministic_mode() -> bool:
    """``torch.use_deterministic_algorithms(True)`` is on, and not warn-only.

    A constant to Dynamo: both flags are part of the global state every compiled graph is guarded
    on, so a graph traced under one setting never runs under another."""
    return (
        torch.are_deterministic_algorithms_enabled()
        and not torch.is_deterministic_algorithms_warn_only_enabled()
    )


@torch.compiler.assume_constant_result
def _tracing_in_this_thread() -> bool:
    """Whether this thread is being traced: Dynamo's tracing context, or the fake / proxy modes
    of a non-strict export, all thread-local. Called by Dynamo at trace time (a constant)."""
    if torch._guards.TracingContext.try_get() is not None:
        return True
    keys = torch._C._TorchDispatchModeKey
    return any(torch._C._get_dispatch_mode(key) is not None for key in (keys.FAKE, keys.PROXY))


def known_true(cond: Any) -> bool:
    """``cond`` as a bool, but False, without a guard, when it reads a data-dependent (unbacked)
    size that ``torch.compile`` cannot decide at trace time (a cache position read from a tensor).
    For decisions where False is always safe: "is this offset known to be 0?", "are future keys
    known to be hidden?". Plain bools and conditions on ordinary symbolic sizes answer as usual."""
    return bool(_guard_or_false(cond))


def true_without_guard(cond: Any) -> bool:
    """``cond`` as a bool where it is decided without adding a guard: plain ints compare as
    usual; a condition on traced sizes is True only where what the trace already knows proves it
    (a data-dependent size, or a relation between independent symbolic sizes, answers False).
    For shortcuts that must not make a compiled graph specialize on a length: the traced code
    takes the general path instead. (A ``type(x) is int`` test cannot say this: Dynamo answers
    ``int`` for the type of a SymInt.)"""
    return bool(_statically_known_true(cond))


def maybe_true(cond: Any) -> bool:
    """``cond`` as a bool, but True, without a guard, when it reads a data-dependent size (see
    :func:`known_true`): for decisions where True is the safe side."""
    return bool(_guard_or_true(cond))


def clamp_int(value: Any, low: int, high: int) -> Any:
    """``min(high, max(low, value))`` that stays symbolic for a traced (possibly data-dependent)
    size instead of guarding on it.

    Dynamo turns the builtins ``min``/``max`` of a traced size into ``torch.sym_min``/``sym_max``
    in the graph itself (torch 2.11's Dynamo refuses to call those directly: "torch.* op returned
    non-Tensor"); outside Dynamo a symbolic size (``make_fx``, non-strict export) takes them as they
    are, where the builtins would compare and guard."""
    if isinstance(value, int) or torch.compiler.is_dynamo_compiling():
        return max(low, min(high, value))
    return torch.sym_max(low, torch.sym_min(high, value))


_T = TypeVar("_T")


def outside_inference_mode(make: Callable[[], _T]) -> _T:
    """``make()``, run as a normal (non-inference) computation where ``torch.inference_mode()``
    is on, with grad still off: for what the library caches beyond the call (specs' tensors, mods
    and the tensors they capture, BlockMasks, varlen offsets). Those caches are keyed by value,
    so an entry built during an evaluation under ``inference_mode`` (Lightning's validation, for
    one) serves the training steps that follow; inference tensors there cannot be saved for
    backward (flex_attention's backward saves the BlockMask's tensors and the mods' captured
    ones: a RuntimeError on the first training step). Outside inference mode, or while traced,
    just ``make()``."""
    if is_compiling() or not torch.is_inference_mode_enabled():
        return make()
    with torch.inference_mode(False), torch.no_grad():
        return make()


def dtensor_class() -> type | None:
    """torch's DTensor class if anything imported it (else no tensor can be one); one dict lookup."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def is_compiling() -> bool:
    """Whether torch.compile or torch.export is tracing *this* call.

    ``torch.compiler.is_compiling()`` alone reads a process-wide flag that a compile running in
    another thread sets: an eager call made meanwhile would take the traced path (no locks, no
    caches, spec tensors not owned). So a True flag is confirmed with thread-local state."""
    return bool(torch.compiler.is_compiling()) and _tracing_in_this_thread()


def under_func_transform() -> bool:
    """Whether an eager call runs under a ``torch.func`` transform that torch.compile'd functions
    cannot be called in (``vmap``, ``grad``, ``jvp``: Dynamo refuses them and the function runs
    uncompiled, pytorch/pytorch#128711). Inside a traced graph Dynamo inlines the transform
    instead: False there. (Asked on every eager call: the transform stack first, which is empty
    outside transforms, so those calls do not ask ``is_compiling``.)"""
    top = torch._C._functorch.peek_interpreter_stack()
    if top is None or is_compiling():
        return False
    kind = torch._C._functorch.TransformType
    return top.key() in (kind.Vmap, kind.Grad, kind.Jvp)


#: What Dynamo raises when a compiled function is called while torch's FX tracing flag is set.
_NESTED_FX_TRACE = "symbolically trace a dynamo-optimized function"
#: How long :func:`call_compiled` waits for another thread's trace to end (torch without
#: ``force_compile_during_fx_trace``), in seconds.
NESTED_FX_WAIT_S = 600.0


def _can_force_compile_during_fx_trace() -> bool:
    return hasattr(torch._dynamo.config, "force_compile_during_fx_trace")


def call_compiled(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` for a ``torch.compile``'d ``fn`` called eagerly.

    torch keeps "an FX trace is running" in one process-wide flag, which a compile in *another*
    thread sets while AOTAutograd traces its graph; Dynamo then refuses any compiled call,
    before running it, as a nested FX trace (found by the multi-threaded GPU soak). Such a call is
    retried with Dynamo told to run the compiled code anyway (``force_compile_during_fx_trace``),
    or, on a torch without that option, once the other thread's trace has ended. The first try
    costs nothing more than a plain call."""
    try:
        return fn(*args)
    except RuntimeError as exc:
        if _NESTED_FX_TRACE not in str(exc):
            raise
    if _can_force_compile_during_fx_trace():
        with torch._dynamo.config.patch(force_compile_during_fx_trace=True):
            return fn(*args)
    from torch.fx import _symbolic_trace

    deadline = time.monotonic() + NESTED_FX_WAIT_S
    while getattr(_symbolic_trace, "_is_fx_tracing_flag", False) and time.monotonic() < deadline:
        time.sleep(0.001)
    return fn(*args)


def static_int(value: Any) -> int:
    """``value`` as a plain int while ``torch.compile`` traces with dynamic shapes: a ``SymInt``
    (a tensor size, or an int Dynamo chose to make symbolic) is specialized to the value it
    has now, and Dynamo guards on it (a new value recompiles). For what never varies within a
    model (heads, head dims, a spec's window or chunk size); a length only where a kernel cannot
    take it symbolic, as a deliberate choice (``CapturedOffsets._offset_tensor``).

    ``operator.index`` is how Dynamo is asked for that (CPython's ``PyNumber_Index`` forces a
    concrete int, and Dynamo specializes the SymInt to match); ``int()`` keeps it symbolic.
    Eagerly it returns a plain int as it is. (No ``type(value) is int`` shortcut: Dynamo
    answers ``int`` for the type of a SymInt.)"""
    return operator.index(value)


#: Whether a ``torch.autocast`` region of any device type is active: one C call (a constant to
#: Dynamo, which guards the autocast state), so calls outside autocast skip the per-device check.
#: Always True where this torch lacks it, so that callers check the device type as before.
any_autocast_enabled: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def dist_version(*names: str) -> str | None:
    """The installed version of the first distribution found among ``names`` (or None)."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def recompile_limit() -> int:
    """Dynamo's per-code-object recompile limit (read only; the library never sets it)."""
    cfg = torch._dynamo.config
    # The fallback only when needed: reading a config entry takes microseconds, and older names
    # go through torch's alias and deprecation handling.
    limit = getattr(cfg, "recompile_limit", None)
    return int(limit if limit is not None else getattr(cfg, "cache_size_limit", 8))


def tensor_version(t: torch.Tensor) -> int | None:
    """``t``'s in-place version counter (``Tensor._version``, private but stable since torch 1.x).

    torch bumps it on every in-place write to ``t`` or to any view or ``.detach()`` alias sharing
    its storage (``t[:] = ...``, ``t.copy_(...)``, ``t.add_(...)``, also under ``no_grad`` and
    ``inference_mode``), which is what :mod:`flexattn_zoo.functions` needs to see that a raw
    ``mask_mod`` / ``score_mod`` closure's captured tensor changed. Reading it is a host-side field
    access: no device sync. Writes through ``t.data`` or through a NumPy / DLPack view of the
    memory do not bump it (measured, torch 2.13); ``fz.invalidate`` covers those.

    Returns None for tensors without a version counter (inference tensors, created under
    ``torch.inference_mode``): callers must then treat the tensor as changed on every use.
    """
    try:
        return int(t._version)
    except RuntimeError:  # "Inference tensors do not track version counter."
        return None


#: The logger Dynamo reports recompile-limit hits on (a private module's name).
DYNAMO_LOGGER = "torch._dynamo"


#: Whether this torch's flex_attention asks for the lse through ``return_aux`` (2.9+) rather than
#: ``return_lse``; read once, so a traced call does not inspect signatures.
_FLEX_RETURN_AUX = "return_aux" in inspect.signature(flex_attention).parameters

#: The values flex_attention's ``kernel_options["BACKEND"]`` takes in this torch, read once (empty
#: where it has no such option, which then leaves the value to torch).
FLEX_BACKENDS: tuple[str, ...] = typing.get_args(
    getattr(sys.modules[flex_attention.__module__], "_Backend", None)
)


def flex_aux_request(lse: bool) -> dict[str, Any]:
    """Keyword arguments asking flex_attention for the lse in this torch's spelling."""
    if _FLEX_RETURN_AUX:
        from torch.nn.attention.flex_attention import AuxRequest

        return {"return_aux": AuxRequest(lse=True)} if lse else {}
    return {"return_lse": True} if lse else {}


class UnguardedGraph:
    """A graph Dynamo compiled, callable as a plain function (see :func:`unguarded_graph`)."""

    __slots__ = ("_source", "_state", "fn")

    def __init__(self, fn: Callable[..., Any], source: types.CodeType) -> None:
        #: The graph's code as a function of the compiled function's arguments.
        self.fn = fn
        self._source = source  # the compiled function's code, whose cache entries Dynamo keeps
        # The process state Dynamo's global guard compares (grad mode, deterministic flags,
        # torch's thread count, default dtype, TF32, autocast, torch function state), as now.
        self._state = torch._C._dynamo.guards.GlobalStateGuard()

    def usable(self) -> bool:
        """Whether the process state is still the one this graph was picked under (Dynamo's own
        global-state check: a kernel compiled for one CPU thread count corrupts memory under
        another) and Dynamo still keeps its cache entry (``torch.compiler.reset`` or an eviction
        drops it; the caller then compiles again, through Dynamo). About a microsecond."""
        try:
            if not self._state.check():
                return False
            code = self.fn.__code__
            return any(entry.code is code for entry in _cache_entries(self._source))
        except Exception:  # noqa: BLE001 - private torch structures: any surprise says no
            return False


def _cache_entries(code: types.CodeType) -> list[Any]:
    return torch._dynamo.eval_frame._debug_get_cache_entry_list(code)


def unguarded_graph(compiled: Callable[..., Any], args: tuple[Any, ...]) -> UnguardedGraph | None:
    """The graph a ``torch.compile``'d function runs for ``args``, as a plain function taking the
    same arguments, without Dynamo's frame evaluation (tens of microseconds of host time per
    call); None where this torch does not expose what that needs.

    Dynamo keeps, per compiled code object, a list of cache entries: each a guard set and the code
    it runs when those guards pass (bytecode that reads the graph's inputs from the arguments and
    calls the compiled graph, which it names in the function's globals). This picks the entry
    Dynamo itself would run for ``args`` (the first in its list whose guards pass) and makes a
    function of its code, with the globals it reads bound now. A caller may call it only with
    arguments on which those guards would pass again: what they check of tensors (shapes,
    strides, dtype, device, requires-grad, aliasing, the negative bit) must be pinned, the other
    arguments the same objects or equal constants, and what callables read besides their
    arguments unchanged; and only while :meth:`UnguardedGraph.usable` (the global state they
    check) and :func:`unguarded_graph_allowed`. (Checking the entry's guards on every call
    instead costs most of what skipping Dynamo saves: ~40 us per call on the CPU.)"""
    original: Any = getattr(compiled, "_torchdynamo_orig_callable", None)
    code = getattr(original, "__code__", None)
    if code is None or not unguarded_graph_allowed():
        return None
    closure = original.__closure__ or ()
    try:
        f_locals = dict(zip(code.co_varnames[: code.co_argcount], args, strict=True))
        f_locals.update(zip(code.co_freevars, (cell.cell_contents for cell in closure), strict=True))
        for entry in _cache_entries(code):
            if not entry.guard_manager.check(f_locals):
                continue
            graph_code = entry.code
            if graph_code.co_freevars != code.co_freevars:
                return None
            module = original.__globals__
            names = {"__builtins__", *global_names(graph_code)}
            bound = {name: module[name] for name in names if name in module}
            fn = types.FunctionType(graph_code, bound, code.co_name, None, original.__closure__)
            return UnguardedGraph(fn, code)
    except Exception:  # noqa: BLE001 - private torch structures: any surprise keeps the guarded call
        return None
    return None


@functools.lru_cache(maxsize=4096)
def global_names(code: types.CodeType) -> tuple[str, ...]:
    """Every name ``code`` and the code objects nested in it may load as a global, in order of
    first use. Traced, call ``global_names.__wrapped__``: Dynamo warns at an lru_cache wrapper."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(global_names(const))
    return tuple(dict.fromkeys(names))


def unguarded_graph_allowed() -> bool:
    """Whether the process state is one an :func:`unguarded_graph` may run under: no torch
    function or dispatch mode active (they would not see the graph's ops), no functorch transform
    (vmap, grad) wrapping the inputs. A few C calls. Autocast needs no check here: its state (per
    device type: enabled, dtype, weight cache) is part of the global state
    :meth:`UnguardedGraph.usable` compares, so a graph picked under one autocast region runs only
    under the same one, as Dynamo's own global guard would allow."""
    return (
        torch._C._len_torch_function_stack() == 0
        and torch._C._len_torch_dispatch_stack() == 0
        and torch._C._functorch.get_dynamic_layer_stack_depth() == 0
    )


def unpack_flex_output(out: Any, lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not lse:
        return out, None
    if isinstance(out, tuple) and len(out) == 2 and not isinstance(out[1], torch.Tensor):
        return out[0], out[1].lse  # (out, AuxOutput)
    return out[0], out[1]


_FAST_TANH_OP: Any = None
_FAST_TANH_LOCK = __import__("threading").Lock()


def _register_fast_tanh() -> Any:
    """Register ``flexattn_zoo::tanh_approx``: torch.tanh eagerly, PTX ``tanh.approx.f32`` when
    Inductor lowers it into a Triton kernel (measured on H200 flex softcap: 195 -> 351 TFLOP/s).

    Registered on first use, never at import. Uses Inductor's private lowering API.
    """
    from torch._inductor.lowering import make_pointwise, register_lowering
    from torch._inductor.virtualized import ops

    @torch.library.custom_op("flexattn_zoo::tanh_approx", mutates_args=())
    def tanh_approx(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)

    @tanh_approx.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.save_for_backward(output)

    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)

    tanh_approx.register_autograd(backward, setup_context=setup_context)

    def lowering(x: Any) -> Any:
        def inner(value: Any) -> Any:
            return ops.inline_asm_elementwise(
                value,
                asm="tanh.approx.f32 $0, $1;",
                constraints="=r,r",
                dtype=torch.float32,
                is_pure=True,
                pack=1,
            )

        return make_pointwise(inner)(x)

    register_lowering(torch.ops.flexattn_zoo.tanh_approx)(lowering)
    return torch.ops.flexattn_zoo.tanh_approx


def fast_tanh_op() -> Any | None:
    """The tanh op that compiles to the hardware approximation in CUDA Triton kernels, registered
    on first call (call it when building a score_mod, not inside one being traced); None when this
    torch lacks the Inductor hooks.

    While torch.compile traces (the flex route builds its score_mod in the caller's graph), the
    op is registered by a trace-time constant and looked up by name: Dynamo can neither enter the
    lock nor register an op (a fullgraph trace failed), and ``_FAST_TANH_OP`` is neither read nor
    filled there (a trace that filled it would fail its own guard on it at the next call)."""
    if is_compiling():
        return torch.ops.flexattn_zoo.tanh_approx if _fast_tanh_registered() else None
    return _load_fast_tanh()


def _load_fast_tanh() -> Any | None:
    global _FAST_TANH_OP
    with _FAST_TANH_LOCK:
        if _FAST_TANH_OP is None:
            try:
                _FAST_TANH_OP = _register_fast_tanh()
            except (ImportError, AttributeError, RuntimeError):
                _FAST_TANH_OP = False
    return _FAST_TANH_OP or None


@torch.compiler.assume_constant_result
def _fast_tanh_registered() -> bool:
    """Whether the op is registered (registering it now if not): run eagerly at trace time."""
    return _load_fast_tanh() is not None


#: torch's ``error_on_graph_break`` context manager (torch >= 2.9), or None. Entered inside a
#: function that ``torch.compile`` traces, it turns any graph break there into an error, as
#: ``fullgraph=True`` does, without the latter's per-call cost on every call of the compiled
#: function (measured on the H200, torch 2.11: +6 us per call, benchmarks/compiled_entry_probe.py).
ERROR_ON_GRAPH_BREAK: Callable[[bool], Any] | None = getattr(torch._dynamo, "error_on_graph_break", None)


def no_graph_breaks() -> Any:
    """A context manager for the body of a compiled function that must be one graph: torch's
    ``error_on_graph_break(True)`` where it exists (compile such functions with
    ``fullgraph=False``), else a no-op (compile them with ``fullgraph=True``: see
    :data:`FULLGRAPH_NEEDED`). Enter it only in code that runs compiled: run eagerly, torch's
    context manager flips a process-wide flag, which another thread's compile would read."""
    return ERROR_ON_GRAPH_BREAK(True) if ERROR_ON_GRAPH_BREAK is not None else contextlib.nullcontext()


#: Whether functions using :func:`no_graph_breaks` must be compiled with ``fullgraph=True``.
FULLGRAPH_NEEDED = ERROR_ON_GRAPH_BREAK is None


def static_shape_compiles() -> Any:
    """A context manager under which Dynamo compiles graphs for the sizes it sees (no automatic
    dynamic shapes): what ``torch.compile(dynamic=False)`` sets around *every* call of the
    function it returns (microseconds of host time per call), for the one call that compiles."""
    return torch._dynamo.config.patch(automatic_dynamic_shapes=False, assume_static_by_default=True)


def _inductor_compile_errors() -> tuple[type[BaseException], ...]:
    import torch._dynamo.exc
    import torch._inductor.exc

    names = (
        (torch._dynamo.exc, "BackendCompilerFailed"),
        (torch._inductor.exc, "InductorError"),
        (torch._inductor.exc, "CppCompileError"),
    )
    return tuple(getattr(module, name) for module, name in names if hasattr(module, name))


#: What a ``torch.compile``'d call raises when Inductor fails to compile its graph (Dynamo's
#: wrapper of a backend's failure, Inductor's own error, a C++ compile error), on this torch.
INDUCTOR_COMPILE_ERRORS = _inductor_compile_errors()


def inductor_backend() -> Any:
    """The callable torch.compile uses for ``backend="inductor"`` (wrapped to count compiles)."""
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend("inductor")


_DETERMINISTIC_LOCK = threading.Lock()
_DETERMINISTIC_DEPTH = 0
_DETERMINISTIC_SAVED: tuple[bool, bool] = (False, False)


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """Run the body with torch's deterministic mode on (not warn-only), then restore it.

    The flag is process-global (``at::globalContext()``), so overlapping uses from several threads
    share one reference count: the first entry saves the caller's setting, the last exit restores
    it, and no thread switches the mode off under another. Uses the ``torch._C`` setters rather
    than ``torch.use_deterministic_algorithms``, which would also overwrite Inductor's
    ``deterministic`` config on restore.
    """
    global _DETERMINISTIC_DEPTH, _DETERMINISTIC_SAVED
    with _DETERMINISTIC_LOCK:
        if _DETERMINISTIC_DEPTH == 0:
            _DETERMINISTIC_SAVED = (
                torch._C._get_deterministic_algorithms(),
                torch._C._get_deterministic_algorithms_warn_only(),
            )
            torch._C._set_deterministic_algorithms(True, warn_only=False)
        _DETERMINISTIC_DEPTH += 1
    try:
        yield
    finally:
        with _DETERMINISTIC_LOCK:
            _DETERMINISTIC_DEPTH -= 1
            if _DETERMINISTIC_DEPTH == 0:
                mode, warn_only = _DETERMINISTIC_SAVED
                torch._C._set_deterministic_algorithms(mode, warn_only=warn_only)
