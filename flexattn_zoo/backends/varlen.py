"""``torch.nn.attention.varlen``: packed sequences with cu_seqlens and FA windows.

Exact for masks whose ``varlen_form()`` exists: block-diagonal segments (documents, chunks) with a
``(left, right)`` window inside each (causal is ``(-1, 0)``). Inputs ``[B, H, L, D]`` are packed
to ``[B*L, H, D]``; each batch row contributes its own segments.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from flexattn_zoo import _compat
from flexattn_zoo.backends.base import IN_GRAPH, LOW_PRECISION, Backend, Requirement
from flexattn_zoo.lru import LRUCache
from flexattn_zoo.problem import Problem
from flexattn_zoo.spec import MaskSpec, VarlenForm


class CuSeqlens(NamedTuple):
    """A packed call's segments as a varlen kernel takes them."""

    cu_q: torch.Tensor  # int32 [S + 1]: 0, then the running total of query lengths
    cu_k: torch.Tensor  # the same for keys (the same tensor unless keys are segmented differently)
    max_q: int  # the longest query segment
    max_k: int
    window: tuple[int, int]  # (left, right), -1 unbounded; bottom-right aligned per segment


#: Upper bound of cached cu_seqlens (least recently used dropped first).
CU_SEQLENS_CACHE_SIZE = 64
#: Thread-safe LRU; ``CU_SEQLENS_CACHE.size`` is its bound.
CU_SEQLENS_CACHE: LRUCache[CuSeqlens] = LRUCache(CU_SEQLENS_CACHE_SIZE)


def cu_seqlens(mask: MaskSpec | None, batch: int, q_len: int, kv_len: int, device: str) -> CuSeqlens:
    """The offsets of every segment of every row (row-major), from the mask's ``varlen_form``.

    Keyed by the (value-hashed) spec and the call's sizes, so repeated calls with an equal spec
    reuse the offsets. The mask must have a varlen form for these sizes.
    """
    key = (mask, batch, q_len, kv_len, device)

    def build() -> CuSeqlens:
        # Never as inference tensors: an evaluation's entry serves later training calls too.
        return _compat.outside_inference_mode(lambda: _build_cu_seqlens(mask, batch, q_len, kv_len, device))

    return CU_SEQLENS_CACHE.get_or_create(key, build)


def _offsets(seg: torch.Tensor | None, batch: int, length: int) -> torch.Tensor:
    """int64 lengths of every non-empty segment, row 0's first; one segment per row when None."""
    if seg is None:
        return torch.full((batch,), length, dtype=torch.int64, device="cpu")
    seg = seg.detach().to("cpu", torch.int64)
    seg = seg.expand(batch, -1) if seg.dim() == 1 else seg
    return seg[seg > 0]  # row-major: row 0's segments, then row 1's...


def _cumulative(lengths: torch.Tensor, device: str) -> torch.Tensor:
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device="cpu")
    cu[1:] = lengths.cumsum(0)
    return cu.to(device)


def _build_cu_seqlens(mask: MaskSpec | None, batch: int, q_len: int, kv_len: int, device: str) -> CuSeqlens:
    form = mask.varlen_form(q_len, kv_len, batch) if mask is not None else VarlenForm(None)
    assert form is not None
    lengths_q = _offsets(form.segments, batch, q_len)
    cu_q = _cumulative(lengths_q, device)
    if form.kv_segments is None:
        max_q = int(lengths_q.max())
        return CuSeqlens(cu_q, cu_q, max_q, max_q, form.window)
    # Every pair has a positive length on both sides (VarlenForm's contract): no pair is dropped.
    lengths_k = form.kv_segments.detach().to("cpu", torch.int64)
    cu_k = _cumulative(lengths_k, device)
    return CuSeqlens(cu_q, cu_k, int(lengths_q.max()), int(lengths_k.max()), form.window)


#: ``torch.nn.attention.varlen``, which older torch builds lack.
TORCH_VARLEN = Requirement(
    "torch.nn.attention.varlen is missing from this torch", lambda: _compat.varlen_attn_fn() is not None
)


@dataclasses.dataclass(frozen=True)
class VarlenBackend(Backend):
    def mask_reasons(self, p: Problem) -> list[str]:
        out = []
        if _compat.is_compiling():
            # cu_seqlens and max_seqlen are read from the segments (data-dependent shapes).
            out.append(f"builds cu_seqlens from the mask's data: not {IN_GRAPH}")
        if p.gqa and not _compat.varlen_supports("enable_gqa"):
            out.append("this torch's varlen_attn has no enable_gqa (added after 2.11)")
        if p.user_block_mask:
            out.append("takes no BlockMask")
        elif p.mask is None:
            if p.q_len != p.kv_len:
                out.append(
                    "needs Lq == Lkv without a mask (packed sequences of other lengths: fz.varlen_attention)"
                )
        elif p.mask.varlen_form(p.q_len, p.kv_len, p.batch) is None:
            out.append(
                f"mask {type(p.mask).__name__} has no exact varlen form (segments + window"
                + (", Lq == Lkv unless packed by fz.varlen_attention)" if p.q_len != p.kv_len else ")")
            )
        return out

    def run(self, q, k, v, p, *, scale, block_mask=None):
        seqs = cu_seqlens(p.mask, p.batch, p.q_len, p.kv_len, str(q.device))

        def pack(t: torch.Tensor) -> torch.Tensor:  # [B, H, L, D] -> [B * L, H, D]
            b, h, length, d = t.shape
            return t.transpose(1, 2).reshape(b * length, h, d)

        kwargs: dict[str, object] = {"scale": scale, "window_size": seqs.window}
        if p.gqa:
            kwargs["enable_gqa"] = True
        kwargs.update(_compat.varlen_aux_request(p.return_lse))
        fn = _compat.varlen_attn_fn()
        assert fn is not None  # the TORCH_VARLEN requirement refuses this route otherwise
        res = fn(pack(q), pack(k), pack(v), seqs.cu_q, seqs.cu_k, seqs.max_q, seqs.max_k, **kwargs)
        out, lse = res if p.return_lse else (res, None)
        b, h, lq, _ = q.shape
        out = out.view(b, lq, h, out.shape[-1]).transpose(1, 2)
        if lse is not None:
            # varlen returns lse per packed token; bring it back to [B, H, L].
            lse = (
                lse.view(h, b, lq).transpose(0, 1)
                if lse.shape[0] == h
                else lse.view(b, lq, h).transpose(1, 2)
            )
        return out, lse


VARLEN = VarlenBackend(
    name="varlen",
    devices=frozenset({"cuda"}),
    dtypes=LOW_PRECISION,
    head_dims=(8, 256),
    head_dim_multiple=8,
    min_cc=(8, 0),
    lse=True,
    requires=(TORCH_VARLEN,),
    needs_torch_deterministic_mode=True,  # FA2 varlen backward, like sdpa_flash
    doc="torch.nn.attention.varlen (FlashAttention varlen): documents/chunks via cu_seqlens, windows",
)
