"""The backend contract: a route declares what it supports and lists reasons when it refuses.

A backend never guesses: ``reasons(problem)`` is empty only when ``run`` computes exactly the
attention the problem describes (same mask, score mod, scale, GQA grouping, lse convention).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch

from flexattn_zoo import _compat
from flexattn_zoo.arch import ROCM, generation, parse_arch
from flexattn_zoo.problem import Problem

#: A route bound to one problem (``Backend.bind``): ``(q, k, v, scale) -> (out, lse or None)``.
BoundCall = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor | None]
]

LOW_PRECISION = frozenset({torch.float16, torch.bfloat16})
#: How a refusal that holds only while ``torch.compile`` traces names the graph (the dispatcher
#: recognises such reasons by it).
IN_GRAPH = "inside a torch.compile'd graph"
FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _dtype_names(dtypes: frozenset[torch.dtype]) -> str:
    return ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))


def cuda_kernel_reasons(
    p: Problem, dtypes: frozenset[torch.dtype], head_dims: tuple[int, int], multiple: int = 1
) -> list[str]:
    """Why the CUDA kernel of a route that also runs elsewhere refuses ``p`` ([] off CUDA)."""
    if p.device_type != "cuda":
        return []
    out = []
    if p.dtype not in dtypes:
        out.append(f"CUDA kernel needs dtype in {{{_dtype_names(dtypes)}}}")
    lo, hi = head_dims
    if not lo <= p.head_dim <= hi or p.head_dim % multiple:
        out.append(
            f"CUDA kernel needs head dim {lo}..{hi}" + (f", multiple of {multiple}" if multiple > 1 else "")
        )
    return out


def expand_kv_heads(k: torch.Tensor, v: torch.Tensor, p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA for kernels without grouped heads: k/v copied to every q head (q head h reads kv head
    h // group, as ``repeat_interleave`` lays them out); autograd sums each group's gradients back."""
    group = p.heads // p.kv_heads
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def cpu_flash_reasons(p: Problem, causal: bool) -> list[str]:
    """Why torch's CPU flash kernel (under sdpa_flash and sdpa_split) cannot run ``p`` exactly, given
    whether the call it would make is causal: on torch 2.13 it returns NaN rows for causal calls
    with ``scale <= 0`` (unmasked calls stay exact). Empty off the CPU."""
    if p.device_type == "cpu" and causal and p.nonpositive_scale:
        return ["torch's CPU flash kernel returns NaN rows for causal calls with scale <= 0"]
    return []


def fused_layout(t: torch.Tensor, traced: bool | None = None) -> torch.Tensor:
    """``t`` itself when the fused SDPA kernels read it as it is, else a contiguous copy (O(L*D),
    small next to attention): a block of a contiguous ``[B, H, L, D]`` or ``[B, L, H, D]``
    tensor (see :func:`is_dense_block`): the tensor itself, the ``[B, L, H, D]`` projection output
    viewed with ``transpose(1, 2)``, or a prefix of a KV cache (``cache[:, :, :n]``), whose copy
    per decoding step would read and write the cache once more than attention itself does.

    Other strides are not safe even with ``stride(-1) == 1``: CUDA's memory-efficient kernel has
    returned wrong results for broadcast (stride-0) k/v (pytorch#191937), and torch's CPU flash
    kernel returned garbage for a ``q`` whose rows overlap (an ``unfold`` view).

    ``traced``: whether torch.compile traces this call, where the caller knows it (None: asked here).
    """
    if t.is_contiguous():
        if t.is_cuda and not (_compat.is_compiling() if traced is None else traced) and t.data_ptr() % 16:
            # A contiguous view that starts off a 16-byte boundary (``flat[1:].view(...)``): the
            # fused kernels' vector loads fault on it (CUDA "misaligned address"), so copy it.
            return t.clone()
        return t
    if is_dense_block(t, traced):
        return t
    return t.contiguous()


def is_dense_block(t: torch.Tensor, traced: bool | None = None) -> bool:
    """Whether 4-D ``t`` is a block cut out of a contiguous tensor whose dims are in the order
    ``[B, H, L, D]`` or ``[B, L, H, D]``: rows of D contiguous, and each dim's stride at least
    the span of the dims inside it, so no two elements share memory (no broadcast, no overlap).
    Dims of size 1 take any stride. On CUDA the start and every other stride must also be
    16-byte aligned, as the fused kernels' vector loads need (the memory-efficient kernel refuses
    "query is not correctly aligned (strideM)" otherwise): ``x[..., :64]`` of a bf16 tensor whose
    last dim is 100 is a dense block, but not an aligned one. While torch.compile traces, the start
    is not read: Dynamo cannot trace ``data_ptr`` (a traced call keeps what the graph gives it).
    ``traced``: whether torch.compile traces this call, where the caller knows it (None: asked here)."""
    if not dense_block_strides(t):
        return False
    if t.is_cuda:
        if traced is None:
            traced = _compat.is_compiling()
        return traced or not t.data_ptr() % 16
    return True


def dense_block_strides(t: torch.Tensor) -> bool:
    """:func:`is_dense_block` by ``t``'s shape, strides and dtype alone, i.e. all of it but the
    alignment of its start on CUDA: the same for every tensor of the same shape, strides, dtype
    and device type."""
    shape, strides = t.shape, t.stride()
    if shape[3] > 1 and strides[3] != 1:
        return False
    if t.is_cuda:
        size = t.element_size()
        for n, s in zip(shape[:3], strides[:3], strict=True):
            if n > 1 and s * size % 16:
                return False
    for order in ((2, 1, 0), (1, 2, 0)):  # innermost first, after D
        span = shape[3]  # elements from a row's first to one past its last
        for dim in order:
            if shape[dim] == 1:
                continue
            if strides[dim] < span:
                break
            span = strides[dim] * (shape[dim] - 1) + span
        else:
            return True
    return False


def copies_by_strides(t: torch.Tensor) -> bool:
    """Whether :func:`fused_layout` copies ``t`` whatever its start: neither contiguous nor a
    dense block by its strides (:func:`dense_block_strides`). The same for every tensor of the
    same shape, strides, dtype and device type, so a call bound to those decides it once and
    leaves :func:`laid_out` only the start to check."""
    return not (t.is_contiguous() or dense_block_strides(t))


def laid_out(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, copies: tuple[bool, bool, bool]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`fused_layout` of an eager call's ``q, k, v`` (on one device) given
    ``copies_by_strides`` of each: a contiguous copy of each that copies, or that is on CUDA and
    starts off a 16-byte boundary; the others as they are. The usual case (nothing to copy) is
    one check (host time: this runs on every call of a bound SDPA route)."""
    if not (copies[0] or copies[1] or copies[2]) and not (
        q.is_cuda and (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16
    ):
        return q, k, v
    return _laid_out(q, copies[0]), _laid_out(k, copies[1]), _laid_out(v, copies[2])


def _laid_out(t: torch.Tensor, copies: bool) -> torch.Tensor:
    if copies or (t.is_cuda and t.data_ptr() % 16):
        return t.clone(memory_format=torch.contiguous_format)
    return t


def slices_are_dense_blocks(cache: torch.Tensor) -> bool:
    """Whether every slice along L, ``cache.narrow(2, start, n)``, of a ``[B, H, capacity, D]``
    cache is a dense block (:func:`is_dense_block`) by the cache alone: a slice of a contiguous
    cache is one (its strides, a shorter length), aligned on CUDA when the cache's start and a row
    of D are 16-byte aligned (every stride is a multiple of D, and so is each slice's start).
    False: ``fused_layout`` decides per slice. Not for traced calls (reads the start)."""
    if not cache.is_contiguous():
        return False
    return not cache.is_cuda or (
        cache.data_ptr() % 16 == 0 and cache.shape[3] * cache.element_size() % 16 == 0
    )


@dataclasses.dataclass(frozen=True)
class Requirement:
    """Something a route needs installed on this machine (an optional package, a torch feature).

    ``check`` is called on every plan (cheap: cache what is slow), so tests can fake the package
    by patching the ``_compat`` function it calls.
    """

    #: Shown as the refusal reason when ``check()`` is False.
    missing: str
    check: Callable[[], bool]

    def __post_init__(self) -> None:
        _ALL_REQUIREMENTS.append(self)


#: Every Requirement made (each registers itself), so their verdicts can be read all at once.
_ALL_REQUIREMENTS: list[Requirement] = []


@torch.compiler.assume_constant_result
def unmet_requirements() -> tuple[str, ...]:
    """``missing`` of every requirement whose ``check()`` fails now. A trace-time constant to
    ``torch.compile`` (what is installed cannot change within a process; no arguments, since
    Dynamo cannot pass objects such as a Requirement to a constant function on torch 2.11)."""
    return tuple(r.missing for r in _ALL_REQUIREMENTS if not r.check())


_CUTE_LOCK = threading.Lock()


def flash_cute_lock() -> contextlib.AbstractContextManager[Any]:
    """Held around every call into FA4's CuTe DSL kernels (routes ``fa4`` and ``flex_flash``).

    The DSL compiles a kernel on its first call with new parameters, and that compile is not
    thread-safe: two threads compiling at once aborted the process (H200 GPU soak, 8 threads,
    flash-attn-4 4.0.0b36: "An MLIR function requires a Location" in a second thread). Later
    calls only launch, asynchronously, so holding the lock costs host time only. While
    ``torch.compile`` traces there is nothing to hold (Dynamo cannot enter a lock).
    """
    return contextlib.nullcontext() if _compat.is_compiling() else _CUTE_LOCK


#: FlashAttention-4's CuTe DSL kernels (the flash-attn-4 package), for fa4 and flex ``BACKEND="FLASH"``.
FLASH_CUTE = Requirement(
    "flash_attn.cute (flash-attn-4) is not installed", lambda: _compat.flash_cute_available()
)


@dataclasses.dataclass(frozen=True)
class Backend:
    """Every fact about one route: capabilities, what it needs installed, what it reads from the
    process, whether it serves decoding. Subclasses add mask-form checks and ``run``; kernel
    options of their own (e.g. ``FlexBackend.tuning``) are fields of the subclass.

    The route's place in the dispatch order is the one fact kept elsewhere: ``arch.PRIORITY``
    (per generation and mode, so routes can be compared in one table).
    """

    name: str
    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    head_dims: tuple[int, int] = (1, 1024)  # inclusive range
    head_dim_multiple: int = 1
    #: On CUDA, per GPU generation (``arch.generation``), the only head dims the kernels take there
    #: (within ``head_dims``); a generation not listed takes none. Empty: ``head_dims`` alone.
    head_dims_by_generation: tuple[tuple[str, frozenset[int]], ...] = ()
    min_cc: tuple[int, int] | None = None
    max_cc: tuple[int, int] | None = None
    score_mods: bool = False
    lse: bool = False
    backward: bool = True
    gqa: bool = True
    #: Takes a value head dim ``Dv`` other than the q/k head dim (``v`` ``[B, Hkv, Lkv, Dv]``,
    #: output ``[B, H, Lq, Dv]``: DeepSeek-style attention, q/k 192 with v 128), within ``head_dims``.
    value_dims: bool = False
    #: The devices on which the route's kernel applies dropout to the attention probabilities
    #: (``dropout_p > 0``, SDPA's meaning); elsewhere such a call is refused with the reason.
    #: A set, not a flag: torch's CPU flash kernel has no dropout where its CUDA FA2 kernel has.
    dropout_devices: frozenset[str] = frozenset()
    #: Forward and backward are bitwise reproducible run to run (same inputs, machine, torch).
    deterministic: bool = True
    #: Why not, when ``deterministic`` is False (shown in the refusal).
    nondeterministic_why: str = ""
    #: The kernel's backward is deterministic only under torch's deterministic mode (FA2 and the
    #: memory-efficient kernel on CUDA read that flag when their backward runs).
    needs_torch_deterministic_mode: bool = False
    # What the route reads from the process rather than the problem; ``plan_cache.process_state``
    # looks up both for every registered route, so a cached plan never outlives a change of them.
    #: What must be installed for this route to run at all (see ``unavailable_reasons``).
    requires: tuple[Requirement, ...] = ()
    #: Environment variables its verdicts read.
    env_vars: tuple[str, ...] = ()
    #: Serves ``fz.decode.decode_step``, which takes only these route names (and "auto"): the flex
    #: routes run its in-place-updated BlockMask, dense its mask over the live cache. Not flex_flash:
    #: decode BlockMasks carry no full-block tensors, which torch's FA4 lowering needs.
    decode: bool = False
    #: False for routes that never appear in ``arch.PRIORITY`` (debug or reference routes, run only
    #: when named); the unit tests hold the table and this flag to each other.
    auto: bool = True
    #: Whether the route runs on ROCm (HIP) builds of torch, whose GPUs are "cuda" devices too:
    #: torch's SDPA flash/efficient/math kernels and Triton do; cuDNN, FlashAttention-4 and the
    #: varlen kernel are CUDA-only.
    rocm: bool = False
    #: Holds the ``Lq x Lkv`` scores in memory (dense, SDPA's math kernel). The static orders put
    #: such routes after every route that does not, and measured route choice (``fz.tune``)
    #: keeps it so: it times one only where the static order picks it.
    materializes: bool = False
    #: Its verdicts read ``Problem.nonfinite`` (whether q/k/v hold NaN/inf, scanned on the CPU
    #: only): ``fz.attention`` scans the inputs of a call it plans only where such a route comes
    #: at or before the route it would take (the scan reads every element).
    reads_finiteness: bool = False
    doc: str = ""

    # -- machine-level ------------------------------------------------------------------------
    def unavailable_reasons(self) -> list[str]:
        """Why this route cannot run on this machine at all (imports, torch version); [] if it can."""
        unmet = unmet_requirements()
        return [r.missing for r in self.requires if r.missing in unmet]

    # -- problem-level ------------------------------------------------------------------------
    def reasons(self, p: Problem) -> list[str]:
        """Every reason this route refuses ``p``; empty means it runs ``p`` exactly."""
        out = list(self.unavailable_reasons())
        if p.device_type not in self.devices:
            out.append(f"runs on {'/'.join(sorted(self.devices))}, not {p.device_type}")
        if p.dtype not in self.dtypes:
            out.append(f"dtype {str(p.dtype).removeprefix('torch.')} not in {{{_dtype_names(self.dtypes)}}}")
        lo, hi = self.head_dims
        if not lo <= p.head_dim <= hi or p.head_dim % self.head_dim_multiple:
            extra = f", multiple of {self.head_dim_multiple}" if self.head_dim_multiple > 1 else ""
            out.append(f"head dim {p.head_dim} outside {lo}..{hi}{extra}")
        elif self.head_dims_by_generation and p.device_type == "cuda":
            gen = generation(p.arch)
            dims = dict(self.head_dims_by_generation).get(gen, frozenset())
            if p.head_dim not in dims:
                listed = ", ".join(map(str, sorted(dims))) or "none"
                out.append(f"head dim {p.head_dim}: the kernels run at {listed} on {gen}")
        v_dim = p.head_dim if p.v_dim is None else p.v_dim  # filled in by Problem.__post_init__
        if v_dim != p.head_dim:
            if not self.value_dims:
                out.append(f"value head dim {v_dim} differs from q/k head dim {p.head_dim}")
            elif not lo <= v_dim <= hi or v_dim % self.head_dim_multiple:
                out.append(f"value head dim {v_dim} outside {lo}..{hi}")
        if p.device_type == "cuda" and "cuda" in self.devices and p.arch == ROCM and not self.rocm:
            out.append("CUDA-only: not available on ROCm (HIP) builds of torch")
        cc = parse_arch(p.arch) if p.device_type == "cuda" else None
        if cc is not None:
            if self.min_cc and cc < self.min_cc:
                out.append(f"needs compute capability >= {self.min_cc[0]}.{self.min_cc[1]}, have {p.arch}")
            if self.max_cc and cc > self.max_cc:
                out.append(f"needs compute capability <= {self.max_cc[0]}.{self.max_cc[1]}, have {p.arch}")
        if p.score is not None and not self.score_mods:
            out.append("cannot apply a score_mod")
        if p.return_lse and not self.lse:
            activation = p.score is not None and p.score.is_activation()
            out.append(
                "cannot return the lse activation attention runs through"
                if activation
                else "cannot return lse"
            )
        if p.requires_grad and not self.backward:
            out.append("has no backward (q/k/v or tensors the score_mod captures require grad)")
        if p.gqa and not self.gqa:
            out.append(f"no grouped-query attention ({p.heads} q heads vs {p.kv_heads} kv heads)")
        if p.dropout_p > 0 and p.device_type not in self.dropout_devices:
            # (Not said again for a device the route does not run on: that reason stands above.)
            if not self.dropout_devices:
                out.append(f"no dropout in this kernel (dropout_p={p.dropout_p})")
            elif p.device_type in self.devices:
                out.append(f"no dropout in this kernel on {p.device_type} (dropout_p={p.dropout_p})")
        if p.deterministic:
            out.extend(self.determinism_reasons(p))
            if _compat.is_compiling() and self._deterministic_backward(p):
                out.append(
                    "a deterministic backward in a compiled graph needs torch.use_deterministic_algorithms(True)"
                    " (not warn-only; the mode cannot be switched inside the graph)"
                )
        if p.kernel_options is not None:
            out.extend(self.kernel_options_reasons(p))
        if p.func_transform:
            blocker = self.func_transform_blocker(p)
            if blocker:
                out.append(f"{blocker}, which torch.func.vmap / grad / jvp cannot call")
        out.extend(self.mask_reasons(p))
        return out

    def func_transform_blocker(self, p: Problem) -> str | None:
        """What this route runs ``p`` through eagerly that torch.func transforms cannot call
        (``Problem.func_transform``), completing "..., which torch.func.vmap / grad / jvp cannot
        call"; None where nothing (plain torch ops)."""
        return None

    def kernel_options_reasons(self, p: Problem) -> list[str]:
        """Why this route cannot take the caller's ``kernel_options`` (flex routes override)."""
        return ["takes no kernel_options (they are flex_attention's: only the flex routes take them)"]

    def determinism_reasons(self, p: Problem) -> list[str]:
        """Why this route cannot promise bitwise-reproducible forward and backward for ``p``."""
        if not self.deterministic:
            return [f"not deterministic: {self.nondeterministic_why}"]
        if p.requires_grad and p.score is not None and p.score.captures_grad_tensors():
            # Every route accumulates gradients of captured tensors by scatter-add (atomics on
            # CUDA, a parallel loop on CPU): the summation order changes between runs. Traced,
            # a raw callable that cannot be walked is taken to capture one.
            return [
                "not deterministic: gradients of tensors captured by the score_mod are scatter-added"
                + (
                    " (while traced, what a raw score_mod captures may be unknown: it counts)"
                    if _compat.is_compiling()
                    else ""
                )
            ]
        return []

    def execute(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        p: Problem,
        *,
        scale: float,
        block_mask: object = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``run``, with the backward under torch's deterministic mode when ``p`` asks for it, and
        activation attention's ``out * exp(lse)`` (:func:`activation_output`) applied."""
        if self._deterministic_backward(p):
            run = lambda a, b, c: self.run(a, b, c, p, scale=scale, block_mask=block_mask)  # noqa: E731
            out, lse = _DeterministicBackward.apply(run, q, k, v)
        else:
            out, lse = self.run(q, k, v, p, scale=scale, block_mask=block_mask)
        if p.score is not None and p.score.is_activation():
            return activation_output(out, lse)
        return out, lse

    def _deterministic_backward(self, p: Problem) -> bool:
        """Whether ``execute`` must replay ``p``'s backward under torch's deterministic mode. Not
        while traced under that mode already: the compiled backward runs under it (and Dynamo
        cannot trace the replay's lock); without the mode, :meth:`reasons` refuses such a call
        while traced."""
        return (
            p.deterministic
            and p.requires_grad
            and self.needs_torch_deterministic_mode
            and p.device_type == "cuda"
            and not (_compat.is_compiling() and _compat.strict_deterministic_mode())
        )

    def bind(self, p: Problem, device: torch.device) -> BoundCall:
        """``execute`` for eager calls of problem ``p`` on ``device`` (no caller BlockMask), as a
        function of ``(q, k, v, scale)`` with what the route derives from ``p`` alone worked out
        once. The dispatcher's plan cache keeps one beside each cached plan: its key pins
        everything ``p`` holds, so a repeated call goes straight to the kernel."""
        if self._deterministic_backward(p) or (p.score is not None and p.score.is_activation()):
            execute = self.execute

            def executed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Any:
                return execute(q, k, v, p, scale=scale)

            return executed
        return self.eager_bound_run(p, device)

    def eager_bound_run(self, p: Problem, device: torch.device) -> BoundCall:
        """:meth:`bound_run` for the plan cache's bound calls, which run only eagerly (the
        dispatcher traces a compiled caller's call afresh): routes may leave out their checks for
        tracing there; by default the same."""
        return self.bound_run(p, device)

    def bound_run(self, p: Problem, device: torch.device) -> BoundCall:
        """``run`` for ``p`` as a function of ``(q, k, v, scale)``: routes override it to hoist
        the work that depends only on ``p`` out of the call (see :meth:`bind`)."""
        run = self.run

        def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Any:
            return run(q, k, v, p, scale=scale)

        return call

    def mask_reasons(self, p: Problem) -> list[str]:
        """Reasons specific to the mask form this route needs (override)."""
        return []

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        p: Problem,
        *,
        scale: float,
        block_mask: object = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Compute ``(out, lse or None)``; only called when ``reasons(p)`` is empty."""
        raise NotImplementedError


def activation_output(out: torch.Tensor, lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation attention from a route's softmax of the log-weights: ``(out * exp(lse), lse)``.

    ``out [B, H, Lq, Dv]`` is ``sum_j w_ij v_j / W_i`` and ``lse [B, H, Lq]`` is ``log W_i``, so the
    product is ``sum_j w_ij v_j``; computed in float32 (float64 for float64 ``out``), returned in
    ``out``'s dtype, with the lse in the API's dtype (:func:`lse_in_api_dtype`). A row with no
    weight has ``out = 0`` and ``lse = -inf``: ``0 * 0 = 0``.
    """
    if lse is None:  # the problem asked the route for it (Problem.return_lse)
        raise RuntimeError("activation attention needs the route's lse, which it did not return")
    compute = torch.float64 if out.dtype == torch.float64 else torch.float32
    total = torch.exp(lse.to(compute)).unsqueeze(-1)
    return (out.to(compute) * total).to(out.dtype), lse_in_api_dtype(lse, out.dtype)


def api_lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the lse ``fz.attention`` returns for inputs of ``dtype``: float32, or float64
    for float64 inputs (a float32 lse would cost them their precision wherever it is used again:
    sinks, activation attention, merges of partial results)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def lse_in_api_dtype(lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``lse`` in :func:`api_lse_dtype` of inputs of ``dtype``."""
    return lse.to(api_lse_dtype(dtype))


class _DeterministicBackward(torch.autograd.Function):
    """Runs ``fn`` as usual and replays its backward inside ``_compat.deterministic_algorithms()``.

    The flag must be on when the kernel's *backward* runs, which is long after ``fz.attention``
    returned; setting it around the forward call would not help. The route's own autograd graph
    is kept on ``ctx`` and freed after one backward (a second backward raises, as usual).
    """

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        ctx.set_materialize_grads(False)
        inner = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
        with torch.enable_grad():
            out, lse = fn(*inner)
        ctx.graph = (inner, out, lse)
        return out.detach(), (None if lse is None else lse.detach())

    @staticmethod
    def backward(ctx: Any, g_out: torch.Tensor | None, g_lse: torch.Tensor | None) -> Any:
        inner, out, lse = ctx.graph
        ctx.graph = None
        pairs = [(t, g) for t, g in ((out, g_out), (lse, g_lse)) if g is not None and t is not None]
        pairs = [(t, g) for t, g in pairs if t.requires_grad]
        wants = [t for t in inner if t.requires_grad]
        if not pairs or not wants:
            return None, None, None, None
        with _compat.deterministic_algorithms():
            got = iter(
                torch.autograd.grad(
                    [t for t, _ in pairs],
                    wants,
                    [g for _, g in pairs],
                    allow_unused=True,
                    create_graph=torch.is_grad_enabled(),
                )
            )
        return (None, *(next(got) if t.requires_grad else None for t in inner))
