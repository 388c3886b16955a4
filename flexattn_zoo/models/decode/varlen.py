"""``decode_step_varlen``: paged causal or sliding-window decode on FlashAttention's varlen
kernel (CUDA, torch >= 2.13; not covered by CPU tests).
"""

from __future__ import annotations

import torch

from flexattn_zoo import _compat
from flexattn_zoo.validation import check_count


def decode_step_varlen(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    cache_len: torch.Tensor,
    block_table: torch.Tensor,
    *,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Paged causal (or sliding-window) decode on FlashAttention varlen (CUDA, torch >= 2.13).

    ``q [B, H, Lq, D]``; ``k_pages``/``v_pages`` ``[n_pages, page_size, Hkv, D]`` (varlen's paged
    layout); ``cache_len [B]`` valid keys per row (new tokens included); ``block_table [B,
    max_pages]`` int32; ``window``: Hugging Face ``sliding_window`` (W >= 1 keys, own included) or None.
    FlashAttention aligns causal masks bottom-right to ``cache_len``, which is the decode
    convention. Returns ``[B, H, Lq, D]``. Not covered by CPU tests (varlen is CUDA-only).
    """
    if window is not None:
        # Checked before the kernel: window=0 became FlashAttention's left=-1, i.e. no window at all.
        window = check_count("decode_step_varlen(window=...)", window)
    fn = _compat.varlen_attn_fn()
    if fn is None or not _compat.varlen_supports("block_table") or not q.is_cuda:
        raise ValueError(
            "decode_step_varlen needs CUDA and torch.nn.attention.varlen with block_table (torch >= 2.13)"
        )
    batch, heads, q_len, d = q.shape
    flat_q = q.transpose(1, 2).reshape(batch * q_len, heads, d)
    cu_q = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * q_len
    seqused = cache_len.to(q.device, torch.int32)
    max_k = block_table.shape[1] * k_pages.shape[1]
    left = -1 if window is None else window - 1
    out = fn(
        flat_q,
        k_pages,
        v_pages,
        cu_q,
        None,
        q_len,
        max_k,
        scale=scale,
        window_size=(left, 0),
        enable_gqa=heads != k_pages.shape[2],
        seqused_k=seqused,
        block_table=block_table.to(torch.int32),
    )
    return out.view(batch, q_len, heads, -1).transpose(1, 2)
