"""KV-cache decoding: a few new queries against a long cache, without rebuilding masks per step.

``decode_step(q, k_cache, v_cache, cache_len)`` attends the newest ``Lq`` tokens (already written
into the cache at positions ``cache_len - Lq .. cache_len - 1``) to the first ``cache_len`` cached
keys, under a pattern given over *absolute* positions (``mask=``, default ``Causal()``; e.g.
``SlidingWindow.from_hf(4096)`` or ``Chunked(8192) & Causal()``), with score mods and sinks.

Design: one BlockMask per (pattern, batch, Lq, cache capacity) and calling thread, built once
and **updated in place** each step. Its ``mask_mod`` and the score mods read the current lengths
from a captured int32 tensor ``cache_len[b]`` (a query's absolute position is
``cache_len[b] - Lq + q_idx``); the per-step update writes that tensor and the kv block list
(``kv_num_blocks``/``kv_indices``: the blocks from the pattern's lowest visible key to
``cache_len - 1``) with a few device ops, no host sync and no new objects. So the compiled kernel
(keyed by the ``mask_mod`` object), the BlockMask and all tensor shapes stay the same from step to
step: no rebuild, no recompile, and the kernel reads only the live blocks of the cache, not its
capacity. Why not the alternatives: ``fz.attention`` with a ``Causal(align="bottom_right")`` per
step shares one kernel too (its offset is a captured tensor) but builds a new BlockMask every
step and needs the cache sliced to each length (a dynamic-shape kernel); bucketing lengths
bounds the shapes but still rebuilds masks. Per thread because the mask is state: shared, one
thread's update could land between another's update and its kernel (see :func:`_caller`).
The q-side block indices are not maintained (they only serve the backward): decoding with
inputs that require grad takes the exact ``dense`` route instead.

Paged KV (``block_table=``): the cache is a pool of pages and ``block_table[b, p]`` is the
physical page of row ``b``'s logical page ``p``. Pools come in the serving stacks' layouts
(``kv_layout="NHD"``: ``[n_pages, page_size, Hkv, D]``, vLLM / FlashAttention / FlashInfer;
``"HND"``: ``[n_pages, Hkv, page_size, D]``), any page size, read in place through a strided view
(:func:`pool_view`), or in flexattn_zoo's own ``[1, Hkv, n_pages * block_size, D]``. The BlockMask
then lists physical pages (one flex kv block per page) and the ``mask_mod`` maps a physical key
index back to its logical position through a captured page-to-position table (updated in place
like the lengths). :func:`append_kv` writes new tokens into the pools through the block table;
``fz.pages.PageAllocator`` owns a block table and the lengths, hands out pages from a free list
and writes through ``append_kv``.
On CUDA with torch >= 2.13, :func:`decode_step_varlen` runs the same paged decode on
FlashAttention's varlen kernel (``block_table`` + ``seqused_k``) for causal or sliding-window
patterns.

Serving: a step is planned (validated and routed) once per call signature (:func:`run_signature`;
on the CPU it includes whether q and the cache hold NaN/inf, which the inputs are scanned for
every step, as ``fz.attention`` does). A flex step over a contiguous cache whose arguments'
kinds were seen before (the same shapes, specs, scale, flags and thread; any lengths) goes from
its second call straight to the length update and the kernel, skipping the step's checks and
planning (:data:`STEPS`, keyed like ``fz.attention``'s plan cache; a plan runs only while its
DecodeMask is the one :data:`CACHE` holds, so clearing that cache sends steps down the full path). On CUDA a step is capturable in a CUDA graph: capture one ``decode_step`` call, then write ``cache_len`` (a device
tensor) and the new tokens in place and replay; nothing syncs with the host or reallocates.
Eager flex steps cost about 0.1 ms of host time on an H100 host, graphed ones run at the kernel's
speed (benchmarks/results/decode_h200.md). A graph-captured mask is kept alive whatever the cache
drops (:data:`CAPTURED`). Values held in CUDA tensors (``cache_len``, ``block_table``) are not
checked (that would be a sync); block counts and page numbers are clamped instead, so bad values
can never make the kernel read outside the cache. Ints and CPU tensors are checked. A contiguous
cache of >= 2**31 elements is decoded a slice of rows at a time (see
``backends.flex.MAX_FLEX_ELEMENTS``).

Routes: one query per row with an int ``cache_len`` (no score mod, sinks, lse, pages or
gradients: a plain generation step) under a pattern whose queries see one run of keys through
their own (``MaskSpec.sees_one_run``: causal, sliding windows, chunks, prefix-LM, and ``&`` /
``|`` of them) is SDPA over that run of the cache, ``cache[:, :, start:cache_len]`` (``start``
from the pattern's lowest visible key; 0 when causal), which that query sees exactly, read in
place, no DecodeMask (eager host time of a plain SDPA call instead of a flex launch and a mask
update), except on CUDA over many keys with many rows (8192 keys and 256 (batch x kv head) rows
or more), where FlashAttention-2 leaves half of HBM bandwidth unused and the flex kernel,
splitting the keys, does not. Otherwise CUDA uses ``flex`` (any pattern, score mod, lse and sinks); CPU uses ``flex_cpu`` when
no lse is needed (no sinks, no ``return_lse``), else the ``dense`` route over the live prefix of
the cache (the pages gathered for paged caches): exact, but it materialises ``Lq x cache_len``.
Pages smaller than a device's flex minimum (:data:`MIN_FLEX_PAGE`: 16 keys on CUDA) take that
``dense`` route too.
"""

from __future__ import annotations

# The modules, each with one job (the names below are re-exported so that
# ``flexattn_zoo.models.decode.X`` keeps working; mutable state lives in one module only, and a
# test that patches a name patches it in the module that looks it up, not here):
#   step       decode_step: checks a step, picks its route, runs it
#   one_query  one_query_over_live_keys: a one-query step, SDPA over the keys its mask leaves
#   mask       DecodeMask (updated in place each step), lowest_key, CAPTURED
#   cache      CACHE, the DecodeMasks per calling thread
#   hits       STEPS: repeated flex steps' plans (their DecodeMask and run), by the call's key
#   runs       run_signature and a step's plan (_Run), kept per DecodeMask
#   launch     running a step's attention (_run_planned, _attend), rows per flex launch
#   routes     DECODE_ROUTES, MIN_FLEX_PAGE
#   inputs     checks of q, the caches and cache_len
#   paged      page pools: KV_LAYOUTS, pool_view, append_kv, page checks and gathers
#   varlen     decode_step_varlen (FlashAttention varlen, CUDA)
from flexattn_zoo.models.decode.cache import CACHE as CACHE
from flexattn_zoo.models.decode.cache import DECODE_CACHE_SIZE as DECODE_CACHE_SIZE
from flexattn_zoo.models.decode.hits import STEP_PLANS_SIZE as STEP_PLANS_SIZE
from flexattn_zoo.models.decode.hits import STEPS as STEPS
from flexattn_zoo.models.decode.launch import _run_planned as _run_planned
from flexattn_zoo.models.decode.mask import CAPTURED as CAPTURED
from flexattn_zoo.models.decode.mask import DEFAULT_BLOCK_SIZE as DEFAULT_BLOCK_SIZE
from flexattn_zoo.models.decode.mask import RUNS_PER_MASK as RUNS_PER_MASK
from flexattn_zoo.models.decode.mask import DecodeMask, lowest_key
from flexattn_zoo.models.decode.mask import _bounded_below as _bounded_below
from flexattn_zoo.models.decode.one_query import _PREFIX_KERNELS as _PREFIX_KERNELS
from flexattn_zoo.models.decode.one_query import one_query_over_live_keys as one_query_over_live_keys
from flexattn_zoo.models.decode.paged import KV_LAYOUT_SHAPES as KV_LAYOUT_SHAPES
from flexattn_zoo.models.decode.paged import KV_LAYOUTS as KV_LAYOUTS
from flexattn_zoo.models.decode.paged import _gather_pages as _gather_pages
from flexattn_zoo.models.decode.paged import append_kv, pool_view
from flexattn_zoo.models.decode.routes import DECODE_ROUTES as DECODE_ROUTES
from flexattn_zoo.models.decode.routes import MIN_FLEX_PAGE as MIN_FLEX_PAGE
from flexattn_zoo.models.decode.runs import run_signature as run_signature
from flexattn_zoo.models.decode.step import decode_step
from flexattn_zoo.models.decode.varlen import decode_step_varlen

__all__ = ["DecodeMask", "append_kv", "decode_step", "decode_step_varlen", "lowest_key", "pool_view"]
