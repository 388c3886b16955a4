"""``torch.nn.attention.varlen``: packed sequences with cu_seqlens and FA windows.

Exact for masks whose ``varlen_form()`` exists: block-diagonal segments (documents, chunks) with a
``(left, right)`` window inside each (causal is ``(-1, 0)``). Inputs ``[B, H, L, D]`` are packed
to ``[B*L, H, D]``; each batch row contributes its own segments.
"""

from __future__ import annotations

import dataclasses

import torch

from flexattn_zoo import _compat
from flexattn_zoo.backends.base import LOW_PRECISION, Backend, Requirement
from flexattn_zoo.lru import LRUCache
from flexattn_zoo.problem import Problem
from flexattn_zoo.spec import MaskSpec, VarlenForm

#: Upper bound of cached cu_seqlens (least recently used dropped first).
CU_SEQLENS_CACHE_SIZE = 64
#: Thread-safe LRU; ``CU_SEQLENS_CACHE.size`` is its bound.
CU_SEQLENS_CACHE: LRUCache[tuple[torch.Tensor, int, tuple[int, int]]] = LRUCache(CU_SEQLENS_CACHE_SIZE)


CuSeqlens = tuple[torch.Tensor, int, tuple[int, int]]


def cu_seqlens(mask: MaskSpec | None, batch: int, length: int, device: str) -> CuSeqlens:
    """Cumulative offsets of every segment of every row, the longest segment, and the window.

    Keyed by the (value-hashed) spec, so repeated calls with an equal spec reuse the offsets.
    """
    key = (mask, batch, length, device)
    build = lambda: _build_cu_seqlens(mask, batch, length, device)  # noqa: E731
    return CU_SEQLENS_CACHE.get_or_create(key, build)


def _build_cu_seqlens(mask: MaskSpec | None, batch: int, length: int, device: str) -> CuSeqlens:
    form = mask.varlen_form(length, length, batch) if mask is not None else VarlenForm(None)
    assert form is not None
    if form.segments is None:
        seg = torch.full((batch, 1), length, dtype=torch.int64)
    else:
        seg = form.segments.detach().to("cpu", torch.int64)
        seg = seg.expand(batch, -1) if seg.dim() == 1 else seg
    lengths = seg[seg > 0]  # row-major: row 0's segments, then row 1's...
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    return cu.to(device), int(lengths.max()), form.window


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
            out.append("builds cu_seqlens from the mask's data: not inside a torch.compile'd graph")
        if p.gqa and not _compat.varlen_supports("enable_gqa"):
            out.append("this torch's varlen_attn has no enable_gqa (added after 2.11)")
        if p.user_block_mask:
            out.append("takes no BlockMask")
        elif p.q_len != p.kv_len:
            out.append("needs Lq == Lkv")
        elif p.mask is None:
            pass
        elif p.mask.varlen_form(p.q_len, p.kv_len, p.batch) is None:
            out.append(f"mask {type(p.mask).__name__} has no exact varlen form (segments + window)")
        return out

    def run(self, q, k, v, p, *, scale, block_mask=None):
        cu, max_len, window = cu_seqlens(p.mask, p.batch, p.q_len, str(q.device))
        b, h, length, d = q.shape

        def pack(t: torch.Tensor) -> torch.Tensor:
            return t.transpose(1, 2).reshape(b * length, t.shape[1], t.shape[3])

        kwargs: dict[str, object] = {"scale": scale, "window_size": window}
        if p.gqa:
            kwargs["enable_gqa"] = True
        kwargs.update(_compat.varlen_aux_request(p.return_lse))
        fn = _compat.varlen_attn_fn()
        assert fn is not None  # the TORCH_VARLEN requirement refuses this route otherwise
        res = fn(pack(q), pack(k), pack(v), cu, cu, max_len, max_len, **kwargs)
        out, lse = res if p.return_lse else (res, None)
        out = out.view(b, length, h, d).transpose(1, 2)
        if lse is not None:
            # varlen returns lse per packed token; bring it back to [B, H, L].
            lse = (
                lse.view(h, b, length).transpose(0, 1)
                if lse.shape[0] == h
                else lse.view(b, length, h).transpose(1, 2)
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
