"""``decode_step``: checks a step, picks its route and runs it (the design, the routes and the
conventions are in the package docstring, ``flexattn_zoo.models.decode``).

``decode_step`` looks up :func:`one_query_over_live_keys` in this module's globals: a test that
spies on the one-query path patches it here (``flexattn_zoo.models.decode.step``).
"""

from __future__ import annotations

from typing import Any, Literal, overload

import torch

from flexattn_zoo import _compat
from flexattn_zoo.coercion import as_mask_spec, as_score_spec
from flexattn_zoo.dispatch import needs_grad
from flexattn_zoo.functions import FunctionMask, FunctionScore, kernel_hazards
from flexattn_zoo.masks import Causal
from flexattn_zoo.models.decode.cache import CACHE, _caller
from flexattn_zoo.models.decode.hits import STEPS, StepPlan, step_key
from flexattn_zoo.models.decode.inputs import _check_inputs, _lengths
from flexattn_zoo.models.decode.launch import _attend, _rows_per_launch, _run_and_keep
from flexattn_zoo.models.decode.mask import DEFAULT_BLOCK_SIZE, DecodeMask
from flexattn_zoo.models.decode.one_query import one_query_over_live_keys
from flexattn_zoo.models.decode.paged import (
    KV_LAYOUTS,
    _check_block_table,
    _check_pages,
    _gather_pages,
    _layout_views,
)
from flexattn_zoo.models.decode.routes import DECODE_ROUTES, MIN_FLEX_PAGE
from flexattn_zoo.models.sinks import apply_sinks, check_sinks
from flexattn_zoo.spec import MaskSpec
from flexattn_zoo.validation import check_flag

#: The default pattern, one object (a spec is immutable): the DecodeMask cache key then hashes
#: and compares it by identity instead of a new spec's fields every step.
_CAUSAL = Causal()


@overload
def decode_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len: int | torch.Tensor,
    *,
    mask: Any = ...,
    score_mod: Any = ...,
    scale: float | None = ...,
    enable_gqa: bool | None = ...,
    sinks: torch.Tensor | None = ...,
    block_table: torch.Tensor | None = ...,
    return_lse: Literal[False] = ...,
    backend: str = ...,
    block_size: int | None = ...,
    kv_layout: str | None = ...,
) -> torch.Tensor: ...
@overload
def decode_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len: int | torch.Tensor,
    *,
    mask: Any = ...,
    score_mod: Any = ...,
    scale: float | None = ...,
    enable_gqa: bool | None = ...,
    sinks: torch.Tensor | None = ...,
    block_table: torch.Tensor | None = ...,
    return_lse: Literal[True],
    backend: str = ...,
    block_size: int | None = ...,
    kv_layout: str | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def decode_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len: int | torch.Tensor,
    *,
    mask: Any = ...,
    score_mod: Any = ...,
    scale: float | None = ...,
    enable_gqa: bool | None = ...,
    sinks: torch.Tensor | None = ...,
    block_table: torch.Tensor | None = ...,
    return_lse: bool = ...,
    backend: str = ...,
    block_size: int | None = ...,
    kv_layout: str | None = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def decode_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len: int | torch.Tensor,
    *,
    mask: Any = None,
    score_mod: Any = None,
    scale: float | None = None,
    enable_gqa: bool | None = None,
    sinks: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    block_size: int | None = None,
    kv_layout: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of the newest ``Lq`` tokens to a KV cache (see the module docstring).

    Args:
        q: ``[B, H, Lq, D]``, the queries at absolute positions ``cache_len - Lq .. cache_len - 1``.
        k_cache, v_cache: ``[B, Hkv, capacity, D]`` caches whose first ``cache_len`` entries are
            valid (the new tokens included); with ``block_table``, page pools: by default
            ``[1, Hkv, n_pages * block_size, D]``, with ``kv_layout`` the serving stacks' pools
            (below).
        cache_len: valid length, an int or an integer tensor ``[B]`` (rows may differ), each in
            ``Lq .. capacity`` (checked when an int or a CPU tensor: a CUDA one is not read).
        mask: the pattern over absolute positions (spec, name or callable); default ``Causal()``.
        score_mod: a score spec / name / callable over absolute positions.
        scale, enable_gqa (None: from head counts), sinks ``[H]``, return_lse: as for the layers.
        block_table: ``[B, max_pages]`` int, physical page of each logical page (-1: none); page
            numbers are checked when it is a CPU tensor.
        backend: ``"auto"``, ``"flex"``, ``"flex_cpu"`` or ``"dense"`` (the routes with
            ``decode=True``). ``"auto"``: SDPA over the keys a plain one-query step sees (the
            live prefix, or the run a sliding window, chunk or prefix-LM leaves: see the module
            docstring) but on CUDA from 8192 such keys with 256 or more (batch x kv head) rows,
            else on CUDA ``"flex"`` (torch's flex-decoding kernel for short ``Lq``).
        block_size: kv block size, and the page size of paged caches (None: 128; with
            ``kv_layout``, the pools' page size, which it must equal if given).
        kv_layout: None, or the page layout of the pools a ``block_table`` points into, as
            vLLM, FlashInfer and FlashAttention keep them: ``"NHD"``, ``k_cache`` / ``v_cache``
            ``[n_pages, page_size, Hkv, D]``; ``"HND"``, ``[n_pages, Hkv, page_size, D]``. Any
            page size. The pools are read in place through a strided view (no copy; a pool whose
            last dim is not contiguous, or whose page stride is not a multiple of a page of its
            token stride, is copied contiguous first), with ``block_table`` ``[B, max_pages]``
            (int32 or int64) and ``cache_len`` ``[B]`` as above. Pages below
            :data:`MIN_FLEX_PAGE` of the device (CUDA: 16 keys, the Triton kernels' smallest
            tile) cannot be a flex block: those steps take the exact ``dense`` route over the
            row's live pages gathered in logical order (a copy of the live keys per step).
    """
    if (
        score_mod is None
        and sinks is None
        and block_table is None
        and return_lse is False  # (not ``not return_lse``: 0 must reach the check below)
        and backend == "auto"
        and block_size is None
        and kv_layout is None
        and type(cache_len) is int
        and type(q) is torch.Tensor
        and type(k_cache) is torch.Tensor
        and type(v_cache) is torch.Tensor
    ):
        # Perhaps a plain generation step: one query per row over an int length, seeing one run
        # of the cache's keys (None: it is not).
        # The default pattern needs no run start (None: the live prefix); any other spec is asked.
        plain = mask is None or (type(mask) is Causal and mask.plain_key() == _CAUSAL.plain_key())
        if plain or isinstance(mask, MaskSpec):
            out = one_query_over_live_keys(
                q, k_cache, v_cache, cache_len, scale, enable_gqa, None if plain else mask
            )
            if out is not None:
                return out
    hit_key = None
    if block_table is None and kv_layout is None:
        # A step of a kind already run: its plan (see .hits), without the checks below.
        hit_key, q_run, k_run, v_run = step_key(
            q, k_cache, v_cache, mask, score_mod, scale, enable_gqa, sinks, return_lse, backend, block_size
        )  # fmt: skip
        try:
            step_plan = STEPS.get_eager(hit_key) if hit_key is not None else None
        except TypeError:  # an unhashable mask/score argument: the full path names the error
            hit_key = step_plan = None
        if step_plan is not None:
            result = step_plan(q_run, k_run, v_run, cache_len, sinks, return_lse)
            if result is not None:
                return result
    check_flag("return_lse", return_lse)
    spec = _CAUSAL if mask is None else as_mask_spec(mask)
    if spec is not None:
        spec = spec.live()  # a raw callable's captured tensors now
    score = None if score_mod is None else as_score_spec(score_mod)
    if score is not None:
        score = score.live()
        if score.is_activation():
            raise ValueError(
                f"decode_step runs softmax attention; score_mod {type(score).__name__} is activation "
                "attention (unnormalised weights): call fz.attention over the cache instead"
            )
    paged = block_table is not None
    n_pages: int | None = None  # pages in a kv_layout pool (its view counts page slots instead)
    slot_stride = 1  # page p of a kv_layout pool is page slot p * slot_stride of its view
    q_block_size = None
    if kv_layout is not None:
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(
                f"decode_step kv_layout must be None, {' or '.join(map(repr, KV_LAYOUTS))}; got {kv_layout!r}"
            )
        if not paged:
            raise ValueError(
                f"decode_step kv_layout={kv_layout!r} names a page pool layout: it needs block_table="
            )
        k_cache, v_cache, block_size, slot_stride, n_pages = _layout_views(
            k_cache, v_cache, kv_layout, block_size
        )
        # q blocks of 128 rows whatever the page: the CUDA kernels tile queries in blocks of
        # 16 .. 128 rows, which must divide the q block (flex's _decode_kernel_has_no_config).
        q_block_size = max(block_size, DEFAULT_BLOCK_SIZE)
    elif block_size is None:
        block_size = DEFAULT_BLOCK_SIZE
    _check_inputs(q, k_cache, v_cache, block_size, paged)
    on_cuda = q.is_cuda
    batch, heads, q_len, _ = q.shape
    gqa = heads != k_cache.shape[1] if enable_gqa is None else enable_gqa
    if paged:
        assert block_table is not None
        if k_cache.shape[0] != 1 or k_cache.shape[2] % block_size:
            raise ValueError(
                f"paged caches are pools [1, Hkv, n_pages * {block_size}, D]; got {tuple(k_cache.shape)}"
            )
        _check_block_table(block_table, batch)
        capacity = block_table.shape[1] * block_size
        n_physical: int | None = k_cache.shape[2] // block_size
    else:
        capacity, n_physical = k_cache.shape[2], None
    lens = _lengths(cache_len, batch, q_len, capacity, q.device)
    if paged:
        assert block_table is not None and n_physical is not None
        _check_pages(block_table, n_physical if n_pages is None else n_pages, block_size)
        if slot_stride != 1:
            block_table = torch.where(block_table >= 0, block_table * slot_stride, -1)
    if spec is not None:
        try:  # positions are absolute: the pattern must describe all of 0 .. capacity - 1
            spec.validate(capacity, capacity, batch, heads)
        except ValueError as exc:
            raise ValueError(f"decode_step mask does not fit a cache of capacity {capacity}: {exc}") from exc
    if score is not None:
        # Over absolute positions too (a Bias is read at query row cache_len - Lq + i, not i: one of
        # [.., Lq, capacity] passed this check and then read past its rows), and e.g. Alibi(num_heads)
        # against H.
        try:
            score.validate(capacity, capacity, batch, heads)
        except ValueError as exc:
            raise ValueError(
                f"decode_step score_mod does not fit a cache of capacity {capacity}: {exc}"
            ) from exc
    need_lse = sinks is not None or return_lse
    grad = needs_grad((q, k_cache, v_cache, sinks), score)  # a learned bias in score_mod counts
    small_page = block_size < MIN_FLEX_PAGE.get(q.device.type, 1)
    # What torch's compiled flex kernel mishandles in the user's functions (the flex routes refuse
    # the same for fz.attention): decode's own wrappers hide them from the routes' check.
    hazards = kernel_hazards((spec, score), "cuda" if on_cuda else "cpu")  # decode runs Triton flex on CUDA
    use_flex = (
        backend != "dense" and not grad and (on_cuda or not need_lse) and not small_page and not hazards
    )
    if backend not in DECODE_ROUTES:
        raise ValueError(f"decode_step backend must be one of {', '.join(DECODE_ROUTES)}; got {backend!r}")
    if not use_flex and backend not in ("auto", "dense"):
        if small_page:
            why = (
                f"kv blocks of {block_size} keys are below the {MIN_FLEX_PAGE[q.device.type]} flex needs "
                f"on {q.device.type}"
            )
        elif hazards:
            kernel = "compiled flex kernel" if on_cuda else "compiled CPU flex kernel"
            why = f"the {kernel} cannot run a mod that {'; '.join(hazards)}"
        else:
            why = "needs lse on CPU, or inputs require grad"
        raise ValueError(f"backend {backend!r} cannot run this decode step ({why})")
    if batch == 0:  # no live rows (a serving loop's empty batch); a DecodeMask needs a row
        return _no_rows(q, k_cache, v_cache, scale, gqa, sinks, return_lse)
    if use_flex and on_cuda:
        backend = "flex" if backend == "auto" else backend
    if use_flex and not paged and batch > 1:
        rows = _rows_per_launch(k_cache, v_cache)
        if rows < batch:  # a cache too large for one flex launch: decode it a slice of rows at a time
            outs, lses = [], []
            for i in range(0, batch, rows):
                part = decode_step(
                    q[i : i + rows],
                    k_cache[i : i + rows],
                    v_cache[i : i + rows],
                    lens if isinstance(lens, int) else lens[i : i + rows],
                    mask=spec,
                    score_mod=score,
                    scale=scale,
                    enable_gqa=gqa,
                    sinks=sinks,
                    # As asked, not always: on the CPU a step that needs lse leaves flex_cpu for
                    # the dense route (and a named flex_cpu raised), so each slice asks only for
                    # what the caller asked.
                    return_lse=return_lse,
                    backend=backend,
                    block_size=block_size,
                )
                if isinstance(part, tuple):
                    lses.append(part[1])
                    part = part[0]
                outs.append(part)
            out = torch.cat(outs)
            return (out, torch.cat(lses)) if return_lse else out
    # Per calling thread (see _caller): the mask's tensors are written by this step's update and
    # read by this step's kernel, so no two threads may share them.
    cache_key = (spec, batch, q_len, capacity, n_physical, block_size, q_block_size, q.device, _caller())
    # Built outside inference mode: later steps outside it (a no_grad loop after an
    # inference_mode one) update the mask's tensors in place, which inference tensors refuse.
    dm = CACHE.get_or_create(
        cache_key,
        lambda: _compat.outside_inference_mode(
            lambda: DecodeMask(
                spec,
                batch,
                q_len,
                capacity,
                n_physical=n_physical,
                device=q.device,
                block_size=block_size,
                q_block_size=q_block_size,
            )
        ),
    )
    inner_score = score.score_mod(fast=on_cuda) if score is not None else None
    if use_flex:
        bm = dm.update(lens, block_table)
        k_run, v_run = k_cache, v_cache
        if k_cache.shape[0] != batch:  # a page pool shared by every row
            k_run, v_run = k_cache.expand(batch, -1, -1, -1), v_cache.expand(batch, -1, -1, -1)
        run_score = dm.score_spec(inner_score) if inner_score is not None else None
        if q_len > 0:
            out, lse, run = _run_and_keep(dm, q, k_run, v_run, bm, run_score, scale, gqa, need_lse, backend)
            # Kept for contiguous caches (the only ones keyed) and finite inputs: on the CPU a
            # step holding NaN/inf is planned on dense (flex_cpu refuses them), which the key,
            # leaving the verdict to each hit's scan, must not hand to finite steps.
            if hit_key is not None and not run.plan.problem.nonfinite:
                # replace: a plan whose DecodeMask left decode.CACHE is stale (see StepPlan)
                STEPS.replace(hit_key, StepPlan(cache_key, dm, run))
        else:  # no queries: fz.attention's empty result
            out, lse = _attend(
                q,
                k_run,
                v_run,
                need_lse,
                mask=bm,
                score_mod=run_score,
                scale=scale,
                enable_gqa=gqa,
                backend=backend,
            )
    else:
        dm.update(lens, block_table if paged else None)
        live = lens if isinstance(lens, int) else (int(lens.max()) if lens.numel() else 0)
        if live > capacity:
            raise ValueError(f"cache_len {live} exceeds the cache capacity {capacity}")
        pages = max(1, -(-live // block_size))
        if paged:
            assert block_table is not None
            k_run = _gather_pages(k_cache, block_table, pages, block_size)
            v_run = _gather_pages(v_cache, block_table, pages, block_size)
        else:
            stop = min(capacity, pages * block_size)
            k_run, v_run = k_cache[:, :, :stop], v_cache[:, :, :stop]
        # Untracked (as in DecodeMask.score_spec): the dense route evaluates them live each call.
        run_mask = FunctionMask(fn=dm.logical_mask_mod, label="decode", tracked=False)
        dense_score = (
            FunctionScore(fn=dm.score_mod(inner_score, paged=False), label="decode", tracked=False)
            if inner_score is not None
            else None
        )
        out, lse = _attend(
            q,
            k_run,
            v_run,
            need_lse,
            mask=run_mask,
            score_mod=dense_score,
            scale=scale,
            enable_gqa=gqa,
            backend="dense",
        )
    if sinks is not None:
        check_sinks(sinks, heads, q.device)
        assert lse is not None  # need_lse: sinks asked the route for it
        out, lse = apply_sinks(out, lse, sinks)
    if not return_lse:
        return out
    assert lse is not None  # need_lse: return_lse asked the route for it
    return out, lse


def _no_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float | None,
    gqa: bool,
    sinks: torch.Tensor | None,
    return_lse: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A step of batch 0, its arguments checked: ``fz.attention``'s empty result (as SDPA gives
    one for an empty batch), ``[0, H, Lq, Dv]`` and lse ``[0, H, Lq]``, connected to the inputs'
    graph (a paged pool's ``[1, ...]`` taken as no rows of it)."""
    need_lse = sinks is not None or return_lse
    out, lse = _attend(q, k_cache[:0], v_cache[:0], need_lse, scale=scale, enable_gqa=gqa, backend="dense")
    if sinks is not None:
        check_sinks(sinks, q.shape[1], q.device)
        assert lse is not None
        out, lse = apply_sinks(out, lse, sinks)
    if not return_lse:
        return out
    assert lse is not None
    return out, lse
