"""PyTorch SDPA routes, each pinned to one kernel with ``sdpa_kernel`` (so nothing falls back).

SDPA is only exact for masks whose ``sdpa_form()`` is "no mask" or ``is_causal`` (top-left,
offered only when Lq == Lkv), for equal chunks of either (``Chunked``, ``Chunked & Causal``,
equal documents: each chunk becomes a batch row, see ``segments.as_chunks``), and for no score
mod: a dense boolean mask would materialize Lq x Lkv, which this library never does behind the
user's back.

``sdpa_kernel`` flips process-global flags (torch's ``_set_sdp_use_*`` setters) and restores them on
exit; two threads pinning different kernels could run each other's kernel or leave the flags
wrong for good. ``_SDPA_LOCK`` serializes our pinned calls (on CUDA only the launch, which is
asynchronous); SDPA calls elsewhere in the process can still observe the pinned flags meanwhile.
Eager calls set the same flags through ``_compat.pin_sdpa_kernel`` (a fraction of
``sdpa_kernel``'s host time); traced calls use ``sdpa_kernel``, which Dynamo turns into a setting
of the graph's SDPA node.
"""

from __future__ import annotations

import dataclasses
import threading

import torch
import torch.nn.functional as F

from flexattn_zoo import _compat
from flexattn_zoo.arch import ROCM
from flexattn_zoo.backends.base import (
    FLOATS,
    LOW_PRECISION,
    Backend,
    cpu_flash_reasons,
    cuda_kernel_reasons,
    expand_kv_heads,
    fused_layout,
)
from flexattn_zoo.problem import Problem
from flexattn_zoo.segments import as_chunks, from_chunks, segment_layout


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
        elif (call := _sdpa_call(p)) is None:
            out.append(
                f"mask {type(p.mask).__name__} has no exact SDPA form (only no mask or causal with Lq == Lkv, "
                "or equal chunks of either)"
            )
        else:
            if self.kernel == "FLASH_ATTENTION":
                out.extend(cpu_flash_reasons(p, causal=call[0]))
            if not out:
                out.extend(self.torch_reasons(p, call))
        return out

    def torch_reasons(self, p: Problem, call: tuple[bool, int]) -> list[str]:
        """torch's own ``can_use_*_attention`` verdict for the exact call ``run`` would make (CUDA
        only; the rules above are ours, this catches what torch checks that they do not). Not
        asked while ``torch.compile`` traces: the check builds fake tensors of its own."""
        if p.device_type != "cuda" or p.arch == ROCM or _compat.is_compiling():
            return []
        is_causal, chunk = call
        batch, q_len, kv_len = p.batch, p.q_len, p.kv_len
        if chunk:
            batch, q_len, kv_len = batch * (q_len // chunk), chunk, chunk
        kv_heads = p.heads if (p.gqa and self.expand_gqa) else p.kv_heads
        with _SDPA_LOCK:  # the check pins the kernel through torch's global flags
            why = _compat.sdpa_torch_refusal(
                self.kernel,
                (batch, p.heads, q_len, p.head_dim),
                (batch, kv_heads, kv_len, p.head_dim),
                p.dtype,
                p.arch,
                is_causal,
                p.gqa and not self.expand_gqa,
                p.requires_grad,
            )
        return [why] if why else []

    def run(self, q, k, v, p, *, scale, block_mask=None):
        call = _sdpa_call(p)
        assert call is not None  # mask_reasons refused the rest
        is_causal, chunk = call
        batch = q.shape[0]
        gqa = p.gqa
        if gqa and self.expand_gqa:
            # cuDNN refuses enable_gqa (H200, 32:8 causal L=8192 with k/v expanded: 4.4 / 15.6 ms
            # fwd / fwd+bwd vs 5.1 / 20.1 on Triton flex, benchmarks/results/nofa4_levers_probe_h200.txt).
            k, v = expand_kv_heads(k, v, p)
            gqa = False
        view_ok = chunk and self.kernel in CHUNK_VIEW_KERNELS and all(t.is_contiguous() for t in (q, k, v))
        if chunk:
            q, k, v = (as_chunks(t, chunk) for t in (q, k, v))
        if self.kernel != "MATH" and not view_ok:
            q, k, v = (fused_layout(t) for t in (q, k, v))
        if _compat.is_compiling():
            # Traced by torch.compile, the pin is a trace-time setting of the SDPA node (no global
            # flags flip when the graph runs), so no lock is needed -- nor could Dynamo enter one.
            with _compat.sdpa_kernel([getattr(_compat.SDPBackend, self.kernel)]):
                out = F.scaled_dot_product_attention(
                    q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa
                )
        else:
            with _SDPA_LOCK:  # see the module docstring; sdpa_kernel's effect, for less host time
                pinned = _compat.pin_sdpa_kernel(self.kernel)
                try:
                    out = F.scaled_dot_product_attention(
                        q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa
                    )
                finally:
                    _compat.restore_sdpa_kernels(pinned)
        return (from_chunks(out, batch) if chunk else out), None


def _sdpa_call(p: Problem) -> tuple[bool, int] | None:
    """``(is_causal, chunk)`` of the exact SDPA call for ``p``'s mask (``chunk`` 0: the call as it
    is, else each ``chunk`` positions as their own batch row), or None when there is none."""
    if p.mask is None:
        return False, 0
    form = p.mask.sdpa_form(p.q_len, p.kv_len)
    if form is not None:
        return form.is_causal, 0
    if p.q_len != p.kv_len:
        return None
    layout = segment_layout(p.mask, p.batch, p.q_len)
    if layout is None or layout[0] != "chunks" or layout[2] not in ((-1, -1), (-1, 0)):
        return None
    return layout[2] == (-1, 0), layout[1]


_SDPA_LOCK = threading.Lock()
#: Kernels given the chunk view of contiguous ``[B, H, L, D]`` inputs as it is (strides
#: ``(chunk*D, L*D, D, 1)`` when B == 1), not a copy: cuDNN took it with the same output, in
#: 1.76 ms instead of 2.41 ms with the copy (H200, chunked 8192 + causal, 1x16x32768x128;
#: benchmarks/results/nofa4_levers_probe_h200.txt). Other kernels keep ``fused_layout``.
CHUNK_VIEW_KERNELS = frozenset({"CUDNN_ATTENTION"})


SDPA_CUDNN = SdpaBackend(
    name="sdpa_cudnn",
    kernel="CUDNN_ATTENTION",
    devices=frozenset({"cuda"}),
    dtypes=LOW_PRECISION,
    head_dims=(8, 128),
    head_dim_multiple=8,
    min_cc=(8, 0),
    expand_gqa=True,
    deterministic=False,
    nondeterministic_why="torch refuses cuDNN SDPA in deterministic mode (its backward is not reproducible)",
    doc="cuDNN fused attention via SDPA (no mask, causal, equal chunks; GQA with k/v expanded)",
)
SDPA_FLASH = SdpaBackend(
    name="sdpa_flash",
    kernel="FLASH_ATTENTION",
    devices=frozenset({"cuda", "cpu"}),
    dtypes=FLOATS,
    cuda_dtypes=LOW_PRECISION,
    cuda_head_dims=(8, 256),
    head_dim_multiple=1,
    min_cc=(8, 0),
    needs_torch_deterministic_mode=True,  # FA2's backward: deterministic dQ accumulation only then
    rocm=True,
    doc="FlashAttention-2 via SDPA on CUDA; torch's fused flash kernel on CPU (no mask, causal, equal chunks)",
)
SDPA_EFFICIENT = SdpaBackend(
    name="sdpa_efficient",
    kernel="EFFICIENT_ATTENTION",
    devices=frozenset({"cuda"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
    head_dims=(1, 256),
    min_cc=(5, 0),
    gqa=False,
    needs_torch_deterministic_mode=True,  # forces num_splits_key=1 in its backward
    rocm=True,
    doc="memory-efficient (xFormers-style) kernel via SDPA (no mask, causal, equal chunks)",
)
SDPA_MATH = SdpaBackend(
    name="sdpa_math",
    kernel="MATH",
    devices=frozenset({"cuda", "cpu"}),
    dtypes=FLOATS,
    rocm=True,
    materializes=True,
    doc="SDPA's reference math kernel (no mask, causal, equal chunks); materializes scores internally",
)
