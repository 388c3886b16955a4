"""Packed variable-length sequences (FlashAttention's varlen convention) on ``fz.attention``.

``fz.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` takes
``[T, H, D]`` rows of many sequences packed end to end (:mod:`flexattn_zoo.packed.api`); the
masks that keep each query inside its own sequence are in :mod:`flexattn_zoo.packed.specs`.
"""

from flexattn_zoo.packed.api import varlen_attention
from flexattn_zoo.packed.specs import PackedScore, PackedSequences

__all__ = ["PackedScore", "PackedSequences", "varlen_attention"]
