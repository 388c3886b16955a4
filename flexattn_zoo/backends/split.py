"""``sdpa_split``: a mask made of a few unmasked, causal or small masked rectangles
(``MaskSpec.split_form``, e.g. ``PrefixLM``, a draft ``Tree`` after its context), one fused SDPA
kernel call per unmasked or causal rectangle, merged by log-sum-exp.

Forward: part ``p`` gives ``out_p`` and ``lse_p`` over its own keys; where parts share query rows
they merge as ``fz.merge_attention`` does (``lse = logaddexp(lse_a, lse_b)``,
``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``, float32 math; the same function,
:func:`flexattn_zoo.backends.merge.merge_core`). This is exact because the parts' keys are disjoint in
every row. A row no part covers sees no key: output 0, lse ``-inf``.

Backward: the attention backward of part ``p``, given the *merged* ``out`` and ``lse``, is the
gradient of the whole attention restricted to ``p``'s keys (its softmax probabilities are
``exp(s - lse)`` of the whole row, and its ``rowsum(dO * out)`` is the whole row's), so the parts'
``dq`` add up and their ``dk`` / ``dv`` land on disjoint keys -- as in ring attention.

Kernels: cuDNN on CUDA (``_compat.cudnn_attention``; H200, prefix-LM 2048 at
4x16x8192x128: 2.02 / 9.01 ms forward / forward+backward vs 2.68 / 10.53 on Triton flex,
benchmarks/results/h200-nofa4.md), torch's flash kernel on CPU. Causal parts must be square:
the kernels' ``is_causal`` is only unambiguous (top-left = bottom-right) when Lq == Lkv. A part
with a ``mask`` (at most ``spec.SPLIT_MASK_PAIRS`` pairs) runs as dense scores in float32 at least
(float64 inputs stay float64; a few small matrix products, forward and backward), whatever the
device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from flexattn_zoo import _compat
from flexattn_zoo.backends.base import (
    FLOATS,
    LOW_PRECISION,
    Backend,
    cpu_flash_reasons,
    cuda_kernel_reasons,
    expand_kv_heads,
    fused_layout,
)
from flexattn_zoo.backends.merge import compiled_merge_two, finite_lse, merge_two
from flexattn_zoo.problem import Problem
from flexattn_zoo.spec import SplitForm, SplitPart


def _cuda_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> Any:
    res = _compat.cudnn_attention(q, k, v, is_causal=causal, scale=scale)
    # Its backward takes the rest back (lengths, rng state); not the part's own output (memory).
    return res[0], res[1], (None, *res[1:])


def _cuda_backward(g, q, k, v, out, lse, saved, causal: bool, scale: float) -> Any:
    return _compat.cudnn_attention_backward(g, q, k, v, out, lse, saved, is_causal=causal, scale=scale)


def _cpu_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> Any:
    out, lse = _compat.cpu_flash_attention(q, k, v, is_causal=causal, scale=scale)
    return out, lse, (None, lse)  # [1]: the lse as the kernel laid it out, as on CUDA


def _cpu_backward(g, q, k, v, out, lse, saved, causal: bool, scale: float) -> Any:
    return _compat.cpu_flash_attention_backward(g, q, k, v, out, lse, is_causal=causal, scale=scale)


_KERNELS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "cuda": (_cuda_forward, _cuda_backward),
    "cpu": (_cpu_forward, _cpu_backward),
}


def _masked_probs(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float, lse: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A masked part's probabilities ``exp(s - lse)`` (hidden pairs 0) and its lse: its own when
    ``lse`` is None, else the given (merged) one. float32 at least."""
    acc = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    s = s.masked_fill(~mask.to(s.device), -math.inf)
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)
    ref = finite_lse(lse).to(acc)  # a row that sees no key: exp(-inf - 0) = 0 in every product
    return torch.exp(s - ref.unsqueeze(-1)), lse


def _masked_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, *, mask: torch.Tensor
) -> Any:
    probs, lse = _masked_probs(q, k, mask, scale, None)
    out = torch.matmul(probs, v.to(probs.dtype)).to(q.dtype)
    return out, lse, (None, lse)


def _masked_backward(g, q, k, v, out, lse, saved, causal: bool, scale: float, *, mask: torch.Tensor) -> Any:
    probs, _ = _masked_probs(q, k, mask, scale, lse)
    acc = probs.dtype
    g32 = g.to(acc)
    dv = torch.matmul(probs.transpose(-1, -2), g32)
    # dS = P * (dP - rowsum(dO * O)), with O the merged output of the whole row.
    ds = probs * (torch.matmul(g32, v.to(acc).transpose(-1, -2)) - (g32 * out.to(acc)).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k.to(acc)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _part_kernels(part: SplitPart, device_type: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The forward and backward that run ``part``: the device's fused kernel, or dense scores for
    a masked part."""
    if part.mask is None:
        return _KERNELS[device_type]
    return (
        functools.partial(_masked_forward, mask=part.mask),
        functools.partial(_masked_backward, mask=part.mask),
    )


def _rows(t: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    return t[:, :, span[0] : span[1]]


class _SplitAttention(torch.autograd.Function):
    """``out`` of attention over the union of ``parts`` (see the module docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        parts: tuple[SplitPart, ...],
        scale: float,
    ) -> torch.Tensor:
        merge = compiled_merge_two() if q.device.type == "cuda" else merge_two
        b, h, q_len = q.shape[:3]
        out = lse = None
        saved = []
        covered: list[tuple[int, int]] = []  # the row ranges of the parts run so far
        for part in parts:
            forward, _ = _part_kernels(part, q.device.type)
            o, part_lse, state = forward(
                _rows(q, part.q), _rows(k, part.kv), _rows(v, part.kv), part.is_causal, scale
            )
            saved.append(state)
            part_lse = part_lse.reshape(b, h, -1).to(torch.promote_types(part_lse.dtype, torch.float32))
            if out is None or lse is None:
                if part.q == (0, q_len):  # covers every row: the start of the merge
                    out, lse = o, part_lse.clone()
                    covered.append(part.q)
                    continue
                # Rows no part covers keep output 0 and lse -inf (they see no key).
                out = o.new_zeros(b, h, q_len, o.shape[-1])
                lse = part_lse.new_full((b, h, q_len), -math.inf)
            (q0, q1) = part.q
            if all(q1 <= start or q0 >= stop for start, stop in covered):  # rows not reached yet
                _rows(out, part.q).copy_(o)
                _rows(lse, part.q).copy_(part_lse)
            else:
                merged_out, merged_lse = merge(_rows(out, part.q), _rows(lse, part.q), o, part_lse)
                _rows(out, part.q).copy_(merged_out)
                _rows(lse, part.q).copy_(merged_lse)
            covered.append(part.q)
        assert out is not None and lse is not None
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.parts, ctx.scale, ctx.states = parts, scale, saved
        return out

    @staticmethod
    @once_differentiable  # the kernels' backwards have no derivative: say so instead of a wrong one
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        q, k, v, out, lse = ctx.saved_tensors
        g = g.contiguous()
        grads: list[torch.Tensor | None] = [None, None, None]
        for part, state in zip(ctx.parts, ctx.states, strict=True):
            _, backward = _part_kernels(part, q.device.type)
            rows, keys = part.q, part.kv
            # The kernels take the merged out / lse / dO of their rows, laid out as they wrote them.
            part_lse = _kernel_lse(_rows(lse, rows), state[1])
            d = backward(
                _rows(g, rows).contiguous(),
                _rows(q, rows),
                _rows(k, keys),
                _rows(v, keys),
                _rows(out, rows).contiguous(),
                part_lse,
                state,
                part.is_causal,
                ctx.scale,
            )
            for i, (full, span, piece) in enumerate(zip((q, k, v), (rows, keys, keys), d, strict=True)):
                grads[i] = _accumulate(grads[i], piece, full, span)
        return grads[0], grads[1], grads[2], None, None


def _kernel_lse(lse: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Rows of the merged ``[B, H, n]`` lse in the shape, dtype and strides of the part's own."""
    return torch.empty_like(like).copy_(lse.reshape(like.shape))


def _accumulate(
    acc: torch.Tensor | None, piece: torch.Tensor, like: torch.Tensor, span: tuple[int, int]
) -> torch.Tensor:
    if acc is None and span == (0, like.shape[2]):
        return piece
    if acc is None:
        acc = torch.zeros_like(like)
    _rows(acc, span).add_(piece)
    return acc


@dataclasses.dataclass(frozen=True)
class SplitBackend(Backend):
    """Runs ``split_form`` masks part by part on SDPA's fused kernel (cuDNN / CPU flash)."""

    cuda_dtypes: frozenset[torch.dtype] = LOW_PRECISION
    cuda_head_dims: tuple[int, int] = (8, 128)

    def func_transform_blocker(self, p: Problem) -> str | None:
        return "it runs its parts as a torch.autograd.Function without functorch rules"

    def mask_reasons(self, p: Problem) -> list[str]:
        out = cuda_kernel_reasons(p, self.cuda_dtypes, self.cuda_head_dims, multiple=8)  # cuDNN's limits
        form = None if p.user_block_mask or p.mask is None else p.mask.split_form(p.q_len, p.kv_len)
        if p.user_block_mask:
            out.append("takes no BlockMask")
        elif form is None:
            name = type(p.mask).__name__ if p.mask is not None else "none"
            out.append(
                f"mask {name} has no split form (unmasked / causal / small masked rectangles, e.g. "
                "PrefixLM with Lq == Lkv)"
            )
        else:
            out.extend(cpu_flash_reasons(p, causal=any(part.is_causal for part in form.parts)))
        return out

    def run(self, q, k, v, p, *, scale, block_mask=None):
        form: SplitForm | None = p.mask.split_form(p.q_len, p.kv_len)
        assert form is not None  # mask_reasons refused the rest
        if p.gqa:  # neither kernel takes grouped heads
            k, v = expand_kv_heads(k, v, p)
        q, k, v = (fused_layout(t) for t in (q, k, v))
        return _SplitAttention.apply(q, k, v, form.parts, scale), None


SDPA_SPLIT = SplitBackend(
    name="sdpa_split",
    devices=frozenset({"cuda", "cpu"}),
    dtypes=FLOATS,
    min_cc=(8, 0),
    deterministic=False,
    nondeterministic_why="its CUDA kernel is cuDNN's, whose backward is not reproducible",
    doc="split masks (PrefixLM, a draft Tree after its context): one fused SDPA call per unmasked/causal "
    "part (cuDNN; flash on CPU), small masked parts as dense scores, merged by lse",
)

__all__ = ["SDPA_SPLIT", "SplitBackend"]
