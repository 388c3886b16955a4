"""A one-query generation step as plain SDPA over the cache keys its query sees, without a
DecodeMask (:func:`one_query_over_live_keys` says when).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexattn_zoo import _compat, sharding
from flexattn_zoo.arch import SPLIT_DECODE_MIN_KV_LEN, SPLIT_DECODE_MIN_KV_ROWS
from flexattn_zoo.backends.base import fused_layout, slices_are_dense_blocks
from flexattn_zoo.backends.sdpa import SDPA_LOCK
from flexattn_zoo.dispatch import _under_autocast, needs_grad
from flexattn_zoo.models.decode.mask import lowest_key_at
from flexattn_zoo.spec import MaskSpec
from flexattn_zoo.validation import aligned_qkv_acceptable, check_qkv, check_scale, qkv_acceptable

#: The SDPA kernels a one-query step over a slice whose length moves (a prefix, a chunk, a window
#: filling up) may take on CUDA (SDPA's own choice among them): those without per-shape setup.
_PREFIX_KERNELS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def one_query_over_live_keys(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    length: int,
    scale: float | None,
    enable_gqa: bool | None,
    mask: MaskSpec | None = None,
) -> torch.Tensor | None:
    """A step of one query per row, every row ``length`` long, that records no gradient, outside
    a traced graph and torch's context_parallel, under a causal pattern (``mask`` None) or a mask
    whose queries see one run of keys (:meth:`~flexattn_zoo.spec.MaskSpec.sees_one_run`: sliding
    windows, chunks, prefix-LM, ``&`` / ``|`` of them); None for any other step (the general path
    takes it and names what is wrong). The query sits at the last position ``length - 1``, so it
    sees exactly the cache keys from its run's start (0 when causal) through its own, with no
    mask at all. SDPA runs that on views of the cache as they are (no copy:
    ``backends.base.fused_layout``) with its own kernel choice (on CUDA among FlashAttention-2,
    the memory-efficient and the math kernel, as cuDNN's per-shape plan would be rebuilt every
    step; over a full sliding window, whose slice keeps one shape, among all of them)
    -- its math fallback holds only ``B x H x 1 x keys`` scores -- for a fraction of the host
    time of a flex launch and its per-step mask update. Checked in a few comparisons: a decode
    step's whole host time is a few tens of microseconds. On CUDA, from
    ``arch.SPLIT_DECODE_MIN_KV_LEN`` keys with ``arch.SPLIT_DECODE_MIN_KV_ROWS`` (batch x kv head)
    rows on, None: FlashAttention-2 reads such caches at about half of HBM bandwidth, the flex
    path's kernel (split over the keys) near all of it."""
    try:
        q_shape, k_shape, v_shape = q.shape, k_cache.shape, v_cache.shape
    except RuntimeError:  # a strided nested tensor has no sizes: the general path names it
        return None
    if not (
        len(q_shape) == 4
        and len(k_shape) == 4
        and len(v_shape) == 4
        and q_shape[2] == 1
        and q_shape[0] > 0  # an empty batch: the general path's empty result
        and q_shape[0] == k_shape[0] == v_shape[0]
        and k_shape[1] == v_shape[1]
        and k_shape[2] == v_shape[2]
        and 1 <= length <= k_shape[2]
        and not needs_grad((q, k_cache, v_cache), None)
        and not _compat.is_compiling()
        and not sharding.context_parallel_active()
    ):
        return None
    start = 0 if mask is None else run_start(mask, length, q_shape[0], q_shape[1], k_shape[2])
    if start is None:
        return None
    batch, heads, _, dim = q_shape
    kv_heads = k_shape[1]
    on_cuda = q.is_cuda
    keys = length - start
    if keys >= SPLIT_DECODE_MIN_KV_LEN and batch * kv_heads >= SPLIT_DECODE_MIN_KV_ROWS and on_cuda:
        return None  # many keys over many rows: the flex path (see the docstring)
    gqa = heads != kv_heads if enable_gqa is None else enable_gqa
    if (
        not _compat.any_autocast_enabled()
        and aligned_qkv_acceptable(q, k_cache, v_cache, gqa, q_shape, k_shape)  # shapes compared above
        and (on_cuda or q.is_cpu)
        # Plain tensors only: a subclass (a DTensor, a Parameter) may define its views otherwise.
        and type(k_cache) is torch.Tensor
        and type(v_cache) is torch.Tensor
    ):
        # The caches pass exactly when their slices do (same dtype, device, batch, heads and
        # D; equal lengths), and a slice along L of a contiguous, aligned cache needs no layout
        # check: what the cache says holds every step, so no per-step slice is inspected. The
        # slices are the caches' own sizes and strides with ``keys`` keys from ``start``, the
        # view ``narrow`` gives, set directly: ``as_strided`` skips narrow's argument handling, a
        # good part of a view's host cost. On plain CPU and CUDA tensors only; the rest take
        # ``narrow`` below.
        k = _keys_view(k_cache, (batch, kv_heads, keys, dim), start)
        v = _keys_view(v_cache, (batch, kv_heads, keys, v_shape[3]), start)
        q = fused_layout(q)
        if not slices_are_dense_blocks(k_cache):
            k = fused_layout(k)
        if not slices_are_dense_blocks(v_cache):
            v = fused_layout(v)
    else:
        k, v = k_cache.narrow(2, start, keys), v_cache.narrow(2, start, keys)
        q, k, v = _under_autocast(q, k, v)  # as fz.attention: e.g. a float32 q over a bf16 cache
        if not qkv_acceptable(q, k, v, gqa):
            check_qkv(q, k, v, enable_gqa=gqa)  # names what is wrong
        q, k, v = fused_layout(q), fused_layout(k), fused_layout(v)
    scale = check_scale(scale)
    with SDPA_LOCK:  # never under another thread's pin of a kernel (backends.sdpa)
        if not on_cuda:
            return _sdpa(q, k, v, scale, gqa)
        if mask is not None and run_slides(mask, length, start):
            # One shape every step (a full window): SDPA's own choice, as a user's call over the
            # same slice makes it; cuDNN's plan for the shape is built once and reused.
            return _sdpa(q, k, v, scale, gqa)
        # Otherwise on CUDA without cuDNN: its SDPA builds an execution plan for every new shape,
        # and a generation loop meets a new length every step (45 ms per call on the H200 for a
        # new shape each call, benchmarks/results/host_cost_h200.md, decode-growing).
        token = _compat.pin_sdpa_kernel(_PREFIX_KERNELS)
        try:
            return _sdpa(q, k, v, scale, gqa)
        finally:
            _compat.restore_sdpa_kernels(token)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, gqa: bool) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with its defaults left out where they apply (SDPA parses
    fewer keyword arguments; read from ``F`` each call, as a patch of it must be seen)."""
    if scale is None and not gqa:
        return F.scaled_dot_product_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)


def _keys_view(cache: torch.Tensor, size: tuple[int, int, int, int], start: int) -> torch.Tensor:
    """``cache.narrow(2, start, size[2])``; a prefix set by strides (see the caller). Not a
    window: ``as_strided`` would need the storage offset, which a tensor under ``torch.vmap``
    does not hold as its sample's."""
    if start == 0:
        return cache.as_strided(size, cache.stride())
    return cache.narrow(2, start, size[2])


def run_start(mask: MaskSpec, length: int, batch: int, heads: int, capacity: int) -> int | None:
    """The first key the query at position ``length - 1`` sees under ``mask`` (positions absolute
    over a cache of ``capacity``), when it sees one run of keys through its own
    (:meth:`~flexattn_zoo.spec.MaskSpec.sees_one_run`) and ``mask`` holds no tensor (its bound is
    arithmetic, read on the host by ``decode.mask.lowest_key_at``); None otherwise, or when
    ``mask`` does not fit the cache (the general path names what is wrong)."""
    if not mask.sees_one_run() or mask.tensors():
        return None
    try:
        mask.validate(capacity, capacity, batch, heads)
    except ValueError:
        return None
    return _start_at(mask, length - 1)


def run_slides(mask: MaskSpec, length: int, start: int) -> bool:
    """Whether the run that starts at ``start`` for the query at ``length - 1`` (see
    :func:`run_start`) is as long as the previous position's: a full sliding window, whose slice
    of the cache keeps one shape from step to step."""
    return start > 0 and _start_at(mask, length - 2) == start - 1


def _start_at(mask: MaskSpec, position: int) -> int:
    """The first key of the run the query at ``position`` sees (its own key at the latest)."""
    return min(lowest_key_at(mask, position), position)
