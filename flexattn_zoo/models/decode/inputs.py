"""``decode_step``'s checks of q, the caches and the lengths, naming what is wrong.

Every step runs them, so the well-formed case costs a few comparisons. Values are read only where
they are on the host: reading a CUDA tensor would sync with the device every step (and break CUDA
graph capture); there the block counts are clamped instead (``DecodeMask.update``).
"""

from __future__ import annotations

from numbers import Integral
from typing import Any

import torch

from flexattn_zoo.validation import check_strided


def _lengths(
    cache_len: Any, batch: int, q_len: int, capacity: int, device: torch.device
) -> torch.Tensor | int:
    """``cache_len`` as an integer ``[B]`` on ``device``, its values checked where they are on the
    host; an int stays an int (checked), one length for every row (``DecodeMask.update`` takes
    both). A tensor keeps its integer dtype: ``DecodeMask.update`` converts it where it copies it
    into the mask, so an int32 device tensor (a CUDA graph's) costs no separate cast per step."""
    if isinstance(cache_len, Integral) and not isinstance(cache_len, bool):
        cache_len = int(cache_len)  # numpy's integers (not int subclasses) as a plain int
        if cache_len < q_len or cache_len > capacity:
            raise ValueError(
                f"cache_len {cache_len} is out of range: each row's cache_len must be >= Lq = {q_len} (the "
                f"new tokens are already in the cache) and <= the cache capacity {capacity}"
            )
        return cache_len
    if isinstance(cache_len, torch.Tensor):
        if cache_len.dtype == torch.bool or cache_len.is_floating_point() or cache_len.is_complex():
            raise TypeError(
                f"cache_len must be an int or an integer tensor [B], got a {cache_len.dtype} tensor "
                "(lengths are counts of tokens; a float would be truncated)"
            )
        lens = cache_len.to(device=device).reshape(-1)
        if lens.numel() == 1:
            lens = lens.expand(batch)
        # Values are checked only when they are on the host: reading a CUDA tensor would sync with
        # the device every step (and break graph capture). On CUDA the block counts are clamped to
        # the capacity instead, so a bad device-side length cannot make the kernel read past the cache.
        on_host = cache_len.device.type == "cpu" and cache_len.numel() > 0
        bounds = (int(cache_len.min()), int(cache_len.max())) if on_host else None
    else:
        raise TypeError(f"cache_len must be an int or an integer tensor [B], got {type(cache_len).__name__}")
    if lens.numel() != batch:
        raise ValueError(f"cache_len must hold one length per batch row ({batch}), got {lens.numel()}")
    if bounds is not None:
        lo, hi = bounds
        if lo < q_len or hi > capacity:
            bad = lo if lo < q_len else hi
            raise ValueError(
                f"cache_len {bad} is out of range: each row's cache_len must be >= Lq = {q_len} (the new "
                f"tokens are already in the cache) and <= the cache capacity {capacity}"
            )
    return lens


def _check_inputs(q: Any, k_cache: Any, v_cache: Any, block_size: Any, paged: bool) -> None:
    try:
        if _well_formed(q, k_cache, v_cache, block_size, paged):
            return  # the common case, in a few comparisons (every step runs this)
    except RuntimeError:
        pass  # a strided nested tensor's .shape raises: named below
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"decode_step {name} must be a torch.Tensor, got {type(t).__name__}")
        check_strided(f"decode_step {name}", t)
        if t.dim() != 4:
            layout = (
                "[B, H, Lq, D]"
                if name == "q"
                else (
                    "[1, Hkv, n_pages * block_size, D] (a paged pool)" if paged else "[B, Hkv, capacity, D]"
                )
            )
            raise ValueError(f"decode_step {name} must have 4 dims {layout}, got shape {tuple(t.shape)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"decode_step block_size must be a positive int, got {type(block_size).__name__}")
    if block_size <= 0:
        raise ValueError(f"decode_step block_size must be a positive int, got {block_size}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"k_cache and v_cache must agree in batch, heads and length (dims 0-2), got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if not paged and k_cache.shape[0] != q.shape[0]:
        raise ValueError(
            f"k_cache/v_cache hold {k_cache.shape[0]} rows but q has batch {q.shape[0]}: a contiguous cache "
            "is [B, Hkv, capacity, D] with q's B (a shared page pool [1, ...] needs block_table=)"
        )


def _well_formed(q: Any, k_cache: Any, v_cache: Any, block_size: Any, paged: bool) -> bool:
    """Whether :func:`_check_inputs` has nothing to say (it names what is wrong otherwise)."""
    tensor = torch.Tensor
    return (
        isinstance(q, tensor)
        and isinstance(k_cache, tensor)
        and isinstance(v_cache, tensor)
        and q.dim() == 4
        and k_cache.dim() == 4
        and v_cache.dim() == 4
        and type(block_size) is int
        and block_size > 0
        and k_cache.shape[:3] == v_cache.shape[:3]
        and (paged or k_cache.shape[0] == q.shape[0])
    )
