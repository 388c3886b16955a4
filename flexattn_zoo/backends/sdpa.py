"""PyTorch SDPA routes, each pinned to one kernel with ``sdpa_kernel`` (so nothing falls back).

SDPA is only exact for masks whose ``sdpa_form()`` is "no mask" or ``is_causal`` (top-left,
offered only when Lq == Lkv), for equal chunks of either (``Chunked``, ``Chunked & Causal``,
equal documents: each chunk becomes a batch row, see ``segments.as_chunks``), for either inside
residue classes of positions (a ``StridedForm`` whose class window is unbounded or causal:
dilated windows spanning the sequence, Sparse Transformer's strided heads; each class becomes
heads of its own, see ``segments.fold_strided``), and for masks and
score mods that *are* a tensor the user gave (``masks.Dense``, ``score_mods.Bias``: their form's
``attn_mask``, one per call, passed as it is). Any other score mod is refused: a dense mask or
bias built from a spec would materialize Lq x Lkv, which this library never does behind the
user's back.

``attn_mask`` calls run on the kernels that take one: math (CPU, CUDA), the CPU flash kernel
(no gradient for a bias that requires grad) and the CUDA memory-efficient kernel (only when every
query row sees a key: rows that see none are 0 on the CPU kernels and the math kernel, as this
library promises, checked for those only). cuDNN and CUDA FlashAttention-2 refuse them.

``sdpa_kernel`` flips process-global flags (torch's ``_set_sdp_use_*`` setters) and restores them on
exit; two threads pinning different kernels could run each other's kernel or leave the flags
wrong for good. ``SDPA_LOCK`` serializes our pinned calls (on CUDA only the launch, which is
asynchronous); SDPA calls elsewhere in the process can still observe the pinned flags meanwhile.
Eager calls set the same flags through ``_compat.pin_sdpa_kernel`` (a fraction of
``sdpa_kernel``'s host time); traced calls use ``sdpa_kernel``, which Dynamo turns into a setting
of the graph's SDPA node.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from flexattn_zoo import _compat
from flexattn_zoo.arch import ROCM
from flexattn_zoo.backends.base import (
    FLOATS,
    IN_GRAPH,
    LOW_PRECISION,
    Backend,
    BoundCall,
    copies_by_strides,
    cpu_flash_reasons,
    cuda_kernel_reasons,
    expand_kv_heads,
    fused_layout,
    laid_out,
)
from flexattn_zoo.problem import Problem
from flexattn_zoo.segments import (
    as_chunks,
    fold_strided,
    fold_too_wide,
    from_chunks,
    segment_layout,
    unfold_strided,
)


@dataclasses.dataclass(frozen=True)
class SdpaBackend(Backend):
    """One SDPA kernel. ``cuda_dtypes``/``cuda_head_dims`` narrow what the CUDA kernel accepts."""

    kernel: str = "MATH"
    cuda_dtypes: frozenset[torch.dtype] = FLOATS
    cuda_head_dims: tuple[int, int] = (1, 1024)

    #: GQA runs by copying k/v to every q head (for kernels without grouped heads; see ``run``).
    expand_gqa: bool = False

    def mask_reasons(self, p: Problem) -> list[str]:
        out = []
        if p.gqa and self.expand_gqa and p.q_len != p.kv_len:
            # The copy of k/v per call is O(Lkv * H * D): next to Lq x Lkv attention it is small
            # when Lq == Lkv (measured there), but a decode step would copy its whole cache.
            out.append("runs GQA by expanding k/v, done only when Lq == Lkv")
        out.extend(cuda_kernel_reasons(p, self.cuda_dtypes, self.cuda_head_dims))
        if p.user_block_mask:
            out.append("takes no BlockMask")
        elif isinstance(call := _sdpa_call(p), str):
            out.append(call)
        else:
            if call.attn_mask is not None:
                out.extend(self.attn_mask_reasons(p, call))
            if self.kernel == "FLASH_ATTENTION":
                out.extend(cpu_flash_reasons(p, causal=call.is_causal))
            if not out:
                out.extend(self.torch_reasons(p, call))
        return out

    def attn_mask_reasons(self, p: Problem, call: SdpaCall) -> list[str]:
        """Why this kernel cannot take the call's ``attn_mask`` (see the module docstring)."""
        cuda = p.device_type == "cuda"
        if self.kernel == "CUDNN_ATTENTION" or (cuda and self.kernel == "FLASH_ATTENTION"):
            return ["takes no attn_mask tensor (masks.Dense / score_mods.Bias) on this kernel"]
        out = []
        if p.score is not None and p.score.captures_grad_tensors():
            if self.kernel == "FLASH_ATTENTION":
                # In any grad mode: torch 2.13 refuses ("No available kernel") such a mask under
                # torch.no_grad() too.
                out.append("torch's CPU flash kernel takes no attn_mask that requires grad (a learned Bias)")
        if cuda and self.kernel == "EFFICIENT_ATTENTION" and call.empty_rows:
            out.append(_empty_rows_reason("this kernel is not checked to give such a row's output as 0"))
        return out

    def torch_reasons(self, p: Problem, call: SdpaCall) -> list[str]:
        """torch's own ``can_use_*_attention`` verdict for the exact call ``run`` would make (CUDA
        only; the rules above are ours, this catches what torch checks that they do not). Not
        asked while ``torch.compile`` traces: the check builds fake tensors of its own."""
        if p.device_type != "cuda" or p.arch == ROCM or _compat.is_compiling():
            return []
        is_causal, chunk, stride = call.is_causal, call.chunk, call.stride
        batch, q_len, kv_len = p.batch, p.q_len, p.kv_len
        heads = p.heads
        kv_heads = p.heads if (p.gqa and self.expand_gqa) else p.kv_heads
        if chunk:
            batch, q_len, kv_len = batch * (q_len // chunk), chunk, chunk
        if stride:
            q_len, kv_len = q_len // stride, kv_len // stride
            heads, kv_heads = heads * stride, kv_heads * stride
        # Asked only when set: torch checks dropout per kernel, and calls without it (or with
        # equal head dims) are asked, and cached, under the same key as ever.
        extra: dict[str, Any] = {}
        if p.dropout_p > 0:
            extra["dropout_p"] = p.dropout_p
        if p.v_dim != p.head_dim:
            extra["v_dim"] = p.v_dim
        with SDPA_LOCK:  # the check pins the kernel through torch's global flags
            why = _compat.sdpa_torch_refusal(
                self.kernel,
                (batch, heads, q_len, p.head_dim),
                (batch, kv_heads, kv_len, p.head_dim),
                p.dtype,
                p.arch,
                is_causal,
                p.gqa and not self.expand_gqa,
                p.requires_grad,
                **extra,
            )
        return [why] if why else []

    def run(self, q, k, v, p, *, scale, block_mask=None):
        return self.bound_run(p, q.device)(q, k, v, scale)

    def launch_kernels(self, p: Problem) -> tuple[str, ...] | None:
        """The SDPA kernels (``SDPBackend`` names) enabled for ``p``'s call, SDPA choosing among
        them; None: every kernel, SDPA's own choice as a user calls it."""
        return None if self.kernel == UNPINNED else (self.kernel,)

    def eager_bound_run(self, p: Problem, device: torch.device) -> BoundCall:
        return self.bound_run(p, device, eager=True)

    def bound_run(self, p: Problem, device: torch.device, *, eager: bool = False) -> BoundCall:
        """``run`` for ``p``; ``eager``: the call is never traced (:meth:`eager_bound_run`), so
        it does not ask per call and per tensor whether torch.compile traces it."""
        call = _sdpa_call(p)
        assert not isinstance(call, str)  # mask_reasons refused the rest
        is_causal, chunk, stride, has_tensor = (
            call.is_causal,
            call.chunk,
            call.stride,
            call.attn_mask is not None,
        )
        batch, heads = p.batch, p.heads
        # cuDNN refuses enable_gqa (H200, 32:8 causal L=8192 with k/v expanded: 4.4 / 15.6 ms
        # fwd / fwd+bwd vs 5.1 / 20.1 on Triton flex, benchmarks/results/nofa4_levers_probe_h200.txt).
        expand = p.gqa and self.expand_gqa
        gqa = p.gqa and not expand
        dropout_p = p.dropout_p  # 0.0 unless the route has dropout here (its reasons refused the rest)
        kernels = self.launch_kernels(p)
        fused = kernels != ("MATH",)
        chunk_view = chunk and kernels is not None and len(kernels) == 1 and kernels[0] in CHUNK_VIEW_KERNELS
        # Decoding on SDPA's own choice: cuDNN joins it from this bound call's second call (the
        # plan-cache key holds the exact shapes, so a shape met for the third time): a repeated
        # shape's execution plan is built once and then reused; a growing cache never repeats one.
        repeated = self.repeated_shape_kernels(p)
        adaptive = repeated != kernels
        seen = [0]  # calls of this bound call (eager, not captured)
        warm = [False]  # whether ``repeated`` ran eagerly (so a CUDA graph may capture it)
        # Eager: which of q, k, v fused_layout copies by their strides alone, decided on the first
        # call (the plan cache binds a call per key, which holds the exact shapes and strides).
        copies: list[tuple[bool, bool, bool] | None] = [None]

        def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
            attn_mask = None
            if has_tensor:
                # Per call: a learned bias is the caller's own tensor, updated in place or given
                # new data (``param.data = ...``) between steps, so neither a converted copy nor
                # a view of it (a 2-D bias's ``[None, None]``) is kept.
                form = _sdpa_call(p)
                assert not isinstance(form, str) and form.attn_mask is not None
                attn_mask = form.attn_mask.to(q.device)
                if attn_mask.dtype != torch.bool:
                    attn_mask = attn_mask.to(q.dtype)  # SDPA takes a float mask in q's dtype (differentiable)
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=gqa,
            )

        def launch(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
        ) -> tuple[torch.Tensor, None]:
            traced = False if eager else _compat.is_compiling()
            if stride:  # [B, H, L, D] -> [B, stride * H, L / stride, D]: each class its own heads
                # Folded before the k/v expansion: a view of [B, L, H, D] projection outputs, and
                # folded kv head r * Hkv + g repeated group times is q head r * H + g * group + i.
                q, k, v = (fold_strided(t.transpose(1, 2), stride).transpose(1, 2) for t in (q, k, v))
            if expand:
                k, v = expand_kv_heads(k, v, p)
            view_ok = chunk_view and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
            if chunk:
                q, k, v = as_chunks(q, chunk), as_chunks(k, chunk), as_chunks(v, chunk)
            if fused and not view_ok:
                if eager:
                    flags = copies[0]
                    if flags is None:
                        flags = copies[0] = (copies_by_strides(q), copies_by_strides(k), copies_by_strides(v))
                    q, k, v = laid_out(q, k, v, flags)
                else:
                    q, k, v = fused_layout(q, traced), fused_layout(k, traced), fused_layout(v, traced)
            enabled = kernels
            capturing = False
            if adaptive and not traced:
                if warm[0]:
                    enabled = repeated  # captured or not (host time: no capture query per call)
                else:
                    capturing = _capturing(q)
                    if seen[0] >= 1 and not capturing:
                        enabled = repeated
                    if not capturing:
                        seen[0] += 1
            out = _launch_sdpa(sdpa, q, k, v, scale, enabled, traced)
            if enabled is not kernels and not capturing:
                warm[0] = True  # after the call: its plan exists now
            if stride:
                return unfold_strided(out.transpose(1, 2), heads).transpose(1, 2), None
            return (from_chunks(out, batch) if chunk else out), None

        return launch

    def repeated_shape_kernels(self, p: Problem) -> tuple[str, ...] | None:
        """The kernels :meth:`launch_kernels` would enable once a bound call of ``p`` runs its exact
        shape again (None: every kernel, SDPA's own choice); by default the same."""
        return self.launch_kernels(p)


@functools.cache
def _asking_for(kernel: str) -> SdpaBackend:
    """A pinned SDPA route of ``kernel`` whose ``torch_reasons`` asks torch about that kernel
    (made once: a planned call, e.g. each step over a growing cache, asks again)."""
    return dataclasses.replace(SDPA_EFFICIENT, kernel=kernel)


def _capturing(q: torch.Tensor) -> bool:
    """Whether ``q`` is a CUDA tensor and a CUDA graph is being captured on the current stream."""
    return q.is_cuda and torch.cuda.is_current_stream_capturing()


def _launch_sdpa(
    sdpa: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    kernels: tuple[str, ...] | None,
    traced: bool | None = None,
) -> torch.Tensor:
    """``sdpa(q, k, v, scale)`` with only ``kernels`` enabled (None: SDPA's own choice);
    ``traced``: whether torch.compile traces this call, where the caller knows it (None: asked)."""
    if traced is None:
        traced = _compat.is_compiling()
    if kernels is None:
        if traced:
            return sdpa(q, k, v, scale)
        with SDPA_LOCK:  # never under another thread's pin of ours
            return sdpa(q, k, v, scale)
    if traced:
        # Traced by torch.compile, the pin is a trace-time setting of the SDPA node (no global
        # flags flip when the graph runs), so no lock is needed -- nor could Dynamo enter one.
        with _compat.sdpa_kernel([getattr(_compat.SDPBackend, name) for name in kernels]):
            return sdpa(q, k, v, scale)
    with SDPA_LOCK:  # see the module docstring; sdpa_kernel's effect, for less host time
        token = _compat.pin_sdpa_kernel(kernels)
        try:
            return sdpa(q, k, v, scale)
        finally:
            _compat.restore_sdpa_kernels(token)


#: ``SdpaBackend.kernel`` of the route that lets SDPA choose its kernel itself.
UNPINNED = "UNPINNED"

#: Lengths (mod this) at which cuDNN's SDPA backward with an ``attn_mask`` can give NaN dQ.
CUDNN_MASKED_BACKWARD_TILE = 128
CUDNN_MASKED_BACKWARD_REMAINDER = 64


def cudnn_masked_backward_hazard(p: Problem) -> bool:
    """Whether SDPA's own choice must leave cuDNN out of ``p``: a call that will run backward,
    with an ``attn_mask`` tensor, at a length of 64 mod 128, on CUDA with torch 2.11 or later.

    There cuDNN's backward (SDPA's pick on sm90) scores the padded half of the last 128-wide key
    tile as 0 rather than -inf, and a query row whose logsumexp is below about -88.7 (all its
    scores strongly negative, as in heads with massive activations) gets NaN in dQ
    (pytorch/pytorch#196678: forward, dK and dV are right; ``is_causal`` without a mask tensor,
    FlashAttention-2 and the memory-efficient kernel are not affected). Such calls take the
    memory-efficient kernel instead; at other lengths, without gradients or without a mask
    tensor cuDNN stays in the choice. Both lengths are checked (the report's lengths are equal).
    """
    if p.device_type != "cuda" or p.arch == ROCM or not p.requires_grad or _compat.TORCH_VERSION < (2, 11):
        return False
    call = _sdpa_call(p)
    if isinstance(call, str) or call.attn_mask is None:
        return False
    return any(
        _compat.maybe_true(n % CUDNN_MASKED_BACKWARD_TILE == CUDNN_MASKED_BACKWARD_REMAINDER)
        for n in (p.q_len, p.kv_len)
    )


@dataclasses.dataclass(frozen=True)
class SdpaChoiceBackend(SdpaBackend):
    """SDPA with its own kernel choice (``F.scaled_dot_product_attention`` as a user calls it).

    torch picks among cuDNN, FlashAttention-2, the memory-efficient and the math kernel per call,
    from the shapes, and runs grouped-query attention natively where a kernel can (cuDNN, FA2),
    which the pinned routes cannot all do. Accepted only where a fused kernel takes the call (its
    math fallback would hold the ``B x H x Lq x Lkv`` scores); not for reproducible runs (the kernel is not pinned), nor for an ``attn_mask`` that may leave a
    row seeing no key (kernels differ there). On CUDA with at most ``DECODE_QUERIES`` queries per
    row (decoding) cuDNN is left out of the choice at first: it builds an execution plan for every
    new shape (tens of milliseconds), and a generation loop meets a new cache length at every step.
    On sm90, without gradients, a shape called a third time (its plan-cache entry's second call: a
    fixed-size cache, cross-attention over an encoder's output, lengths that cycle) lets SDPA
    choose cuDNN too, which decodes faster once its plan exists; a CUDA graph captures it only
    after it ran eagerly. Training calls with a mask tensor at a length of 64 mod 128 leave cuDNN
    out (:func:`cudnn_masked_backward_hazard`).
    """

    def mask_reasons(self, p: Problem) -> list[str]:
        out = super().mask_reasons(p)
        call = _sdpa_call(p)
        if not out and not isinstance(call, str) and call.chunk:
            # Chunks become batch rows by a copy here; sdpa_cudnn reads them as a view, faster.
            out.append("runs equal chunks only through sdpa_cudnn's view of them")
        return out

    def attn_mask_reasons(self, p: Problem, call: SdpaCall) -> list[str]:
        if call.empty_rows:
            return [_empty_rows_reason("SDPA's kernels differ on such rows")]
        return []

    def launch_kernels(self, p: Problem) -> tuple[str, ...] | None:
        # Decoding on CUDA: a generation loop meets a new cache length every step, and cuDNN
        # builds an execution plan for every new shape (plain SDPA took 57.8 ms per step on the
        # H200, FlashAttention-2 0.115: benchmarks/results/decode_growing_probe_h200.txt).
        if p.device_type == "cuda" and p.arch != ROCM and p.q_len <= DECODE_QUERIES:
            return WITHOUT_CUDNN
        if cudnn_masked_backward_hazard(p):
            return WITHOUT_CUDNN
        return None

    def repeated_shape_kernels(self, p: Problem) -> tuple[str, ...] | None:
        # A repeated decoding shape, forward only, on sm90: cuDNN with a warm plan (H200, one
        # query over 8K keys, B=32, 32:8 heads: 0.24 ms against FlashAttention-2's 0.39-0.47,
        # benchmarks/results/decode_kernel_probe_h200_r21.txt; plain SDPA 1.6-1.9x faster than FA2
        # on the decoding rows of benchmarks/results/generalization_h200.json). Not elsewhere:
        # measured only there, and torch reports cuDNN decoding wrong on sm100 with fewer than 8
        # kv heads (pytorch/pytorch#193893) and its backward for one query row giving NaN
        # (NVIDIA/cudnn-frontend#1072). Short caches too: there a step is host-bound and cuDNN's
        # plan lookup costs no more host time than FlashAttention-2's launch (H100, 2 MB to 1 GB
        # of k/v: benchmarks/results/decode_kernel_probe_h100_r41.txt).
        if p.arch == "sm90" and not p.requires_grad:
            return None
        return self.launch_kernels(p)

    def torch_reasons(self, p: Problem, call: SdpaCall) -> list[str]:
        if p.device_type != "cuda" or p.arch == ROCM or _compat.is_compiling():
            return []
        kernels: tuple[str, ...] = ("EFFICIENT_ATTENTION",) if call.attn_mask is not None else FUSED_KERNELS
        allowed = self.launch_kernels(p)
        if allowed is not None:
            kernels = tuple(name for name in kernels if name in allowed)
        for kernel in kernels:  # the first kernel torch accepts settles it
            if not SdpaBackend.torch_reasons(_asking_for(kernel), p, call):
                return []
        return ["no fused SDPA kernel takes the call (SDPA would fall back to its math kernel)"]


@dataclasses.dataclass(frozen=True)
class SdpaCall:
    """The exact SDPA call for a problem: ``is_causal``, ``chunk`` (0: the call as it is, else each
    ``chunk`` positions as their own batch row), ``stride`` (0, else each residue class of
    positions mod ``stride`` as heads of its own, ``is_causal`` inside each), the ``attn_mask``
    tensor (``[B|1, H|1, Lq|1, Lkv|1]``, bool or float) or None, and whether that mask may leave a
    row seeing no key."""

    is_causal: bool
    chunk: int = 0
    stride: int = 0
    attn_mask: torch.Tensor | None = None
    empty_rows: bool = False


_NO_FORM = (
    "mask {} has no exact SDPA form (only no mask or causal with Lq == Lkv, equal chunks of either, "
    "either inside residue classes of a stride dividing the length, or an attn_mask tensor: masks.Dense)"
)


def _mask_call(p: Problem, beside_bias: bool) -> SdpaCall | str:
    """The exact SDPA call for ``p``'s mask alone, or the reason there is none."""
    if p.mask is None:
        return SdpaCall(is_causal=False)
    form = p.mask.sdpa_form(p.q_len, p.kv_len)
    if form is not None:
        return SdpaCall(is_causal=form.is_causal, attn_mask=form.attn_mask, empty_rows=form.empty_rows)
    name = type(p.mask).__name__
    if beside_bias:
        return _NO_FORM.format(name) + " to take beside a Bias"
    if p.q_len != p.kv_len:
        return _NO_FORM.format(name)
    layout = segment_layout(p.mask, p.batch, p.q_len)
    if layout is None or layout[0] not in ("chunks", "strided"):
        return _NO_FORM.format(name)
    kind, size, window = layout  # a window spanning the chunks or classes reads as unbounded
    if window not in ((-1, -1), (-1, 0)):
        return _NO_FORM.format(name)
    too_wide = fold_too_wide(size, p.heads, p.device_type) if kind == "strided" else None
    if too_wide:
        return f"mask {name}: {too_wide}"
    is_causal = window == (-1, 0)
    return SdpaCall(is_causal=is_causal, chunk=size) if kind == "chunks" else SdpaCall(is_causal, stride=size)


def _empty_rows_reason(consequence: str) -> str:
    """A refusal for an attn_mask that may leave a query row seeing no key: while traced a
    data mask's rows are not read (its verdict is unknown there, so the reason says it is the
    graph's), eagerly they were and some row may see none."""
    if _compat.is_compiling():
        return (
            f"cannot read the attn_mask's rows {IN_GRAPH}, so a query row may see no key, and {consequence}"
        )
    return f"the attn_mask may leave a query row seeing no key, and {consequence}"


def _sdpa_call(p: Problem) -> SdpaCall | str:
    """The exact SDPA call for ``p``'s mask and score mod, or the reason(s) there is none."""
    if p.score is None:
        return _mask_call(p, beside_bias=False)
    score = p.score.sdpa_form(p.q_len, p.kv_len)
    if score is None or score.attn_mask is None:
        why = (
            f"cannot apply score_mod {type(p.score).__name__} (only an additive bias tensor, "
            "score_mods.Bias, is an SDPA attn_mask)"
        )
        mask_only = _mask_call(p, beside_bias=False)  # the mask's own reason too, if any
        return f"{why}; {mask_only}" if isinstance(mask_only, str) else why
    call = _mask_call(p, beside_bias=True)
    if isinstance(call, str):
        return call
    if call.is_causal or call.attn_mask is not None:
        # SDPA takes one attn_mask and no is_causal beside it; merging would build a new tensor.
        return f"takes one attn_mask: mask {type(p.mask).__name__} beside a Bias has no single SDPA call"
    return SdpaCall(is_causal=False, attn_mask=score.attn_mask, empty_rows=score.empty_rows)


SDPA_LOCK = threading.Lock()
#: Kernels given the chunk view of contiguous ``[B, H, L, D]`` inputs as it is (strides
#: ``(chunk*D, L*D, D, 1)`` when B == 1), not a copy: cuDNN took it with the same output, in
#: 1.76 ms instead of 2.41 ms with the copy (H200, chunked 8192 + causal, 1x16x32768x128;
#: benchmarks/results/nofa4_levers_probe_h200.txt). Other kernels keep ``fused_layout``.
CHUNK_VIEW_KERNELS = frozenset({"CUDNN_ATTENTION"})


SDPA_CUDNN = SdpaBackend(
    score_mods=True,  # only a Bias (see _sdpa_call)
    name="sdpa_cudnn",
    dropout_devices=frozenset({"cuda"}),  # cuDNN SDPA takes dropout_p (torch docs; untested on GPU here)
    kernel="CUDNN_ATTENTION",
    devices=frozenset({"cuda"}),
    dtypes=LOW_PRECISION,
    head_dims=(8, 256),
    head_dim_multiple=8,
    min_cc=(8, 0),
    expand_gqa=True,
    value_dims=True,  # q/k 192 with v 128 forward and backward (H200, cuDNN 9.19)
    deterministic=False,
    nondeterministic_why="torch refuses cuDNN SDPA in deterministic mode (its backward is not reproducible)",
    doc="cuDNN fused attention via SDPA (no mask, causal, equal chunks, spanning dilated windows; "
    "GQA with k/v expanded)",
)
#: The kernels SDPA chooses among before its math fallback.
FUSED_KERNELS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")
#: Queries per row up to which the route ``sdpa`` leaves cuDNN out on CUDA (decoding).
DECODE_QUERIES = 16
#: What it chooses among then.
WITHOUT_CUDNN = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
SDPA_CHOICE = SdpaChoiceBackend(
    score_mods=True,  # only a Bias (see _sdpa_call)
    name="sdpa",
    dropout_devices=frozenset({"cuda"}),  # its fused kernels all take dropout_p (torch docs)
    kernel=UNPINNED,
    devices=frozenset({"cuda"}),
    dtypes=LOW_PRECISION,
    head_dims=(1, 256),
    value_dims=True,  # SDPA's kernels that take v's own head dim (cuDNN) run it; torch's check says which
    deterministic=False,
    nondeterministic_why="SDPA chooses its kernel per call; name a pinned sdpa_* route for reproducible runs",
    doc="SDPA with its own kernel choice (cuDNN, FA2, memory-efficient; native GQA); no mask, causal, "
    "spanning dilated windows, attn_mask tensors",
)
SDPA_FLASH = SdpaBackend(
    score_mods=True,  # only a Bias (see _sdpa_call)
    name="sdpa_flash",
    # FA2 drops on CUDA; torch 2.13's CPU flash kernel has no dropout (SDPA: "No available kernel").
    dropout_devices=frozenset({"cuda"}),
    kernel="FLASH_ATTENTION",
    devices=frozenset({"cuda", "cpu"}),
    dtypes=FLOATS,
    cuda_dtypes=LOW_PRECISION,
    cuda_head_dims=(8, 256),
    head_dim_multiple=1,
    min_cc=(8, 0),
    needs_torch_deterministic_mode=True,  # FA2's backward: deterministic dQ accumulation only then
    rocm=True,
    doc="FlashAttention-2 via SDPA on CUDA; torch's fused flash kernel on CPU (no mask, causal, equal "
    "chunks, spanning dilated windows)",
)
SDPA_EFFICIENT = SdpaBackend(
    score_mods=True,  # only a Bias (see _sdpa_call)
    name="sdpa_efficient",
    dropout_devices=frozenset({"cuda"}),  # takes dropout_p (torch docs; untested on GPU here)
    kernel="EFFICIENT_ATTENTION",
    devices=frozenset({"cuda"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
    head_dims=(1, 256),
    min_cc=(5, 0),
    gqa=False,
    needs_torch_deterministic_mode=True,  # forces num_splits_key=1 in its backward
    rocm=True,
    doc="memory-efficient (xFormers-style) kernel via SDPA (no mask, causal, equal chunks, spanning "
    "dilated windows)",
)
SDPA_MATH = SdpaBackend(
    score_mods=True,  # only a Bias (see _sdpa_call)
    name="sdpa_math",
    dropout_devices=frozenset({"cuda", "cpu"}),  # dropout on the probabilities (tested on CPU)
    kernel="MATH",
    devices=frozenset({"cuda", "cpu"}),
    dtypes=FLOATS,
    rocm=True,
    materializes=True,
    value_dims=True,
    doc="SDPA's reference math kernel (no mask, causal, equal chunks, spanning dilated windows); "
    "materializes scores internally",
)
