"""Repeated flex decode steps without the step's checks: :data:`STEPS`, a step's plan by its call.

A serving loop calls ``decode_step`` with the same arguments' kinds every step; only the length
moves. The first step of a kind runs the full path (checks, the DecodeMask, route choice); the
flex steps among them keep what they settled as a :class:`StepPlan` under :func:`step_key`, and
later steps of that kind go straight to the length update and the kernel. The key holds
everything the full path reads besides the lengths (which every hit still checks): the
``fz.attention`` plan-cache key of the call (``plan_cache.call_key``: shapes, strides, dtypes
after autocast, devices, the mask and score arguments by value or, for callables, identity and
captured-tensor versions, grad flags, process state), plus the scale itself, the head-count
flag as given, the block size, torch's determinism flags, whether sinks are given and the
calling thread. Steps that cannot take flex (``backend="dense"``, the lse or sinks on the CPU,
inputs that require grad) get no key, nor do tensors given as ``mask`` / ``score_mod`` (the full
path copies them into a spec; the key would hold the caller's object). On the CPU a hit scans
q/k/v for NaN/inf as the full path does (``flex_cpu`` refuses them) and leaves such a step to it;
only plans made for finite inputs are kept. A plan also checks that its DecodeMask is still the
one ``decode.CACHE`` holds for it, so clearing that cache (or its eviction) sends the next step
down the full path, which replaces the plan (a stale one stays in :data:`STEPS`, unused, until it
is replaced or evicted).

Paged caches (``block_table``, ``kv_layout``), traced steps and steps under torch's
``context_parallel`` always take the full path.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from flexattn_zoo import _compat, sharding
from flexattn_zoo.dispatch import _resolve_deterministic, _under_autocast
from flexattn_zoo.lru import ClockCache
from flexattn_zoo.models.decode.cache import CACHE, _caller
from flexattn_zoo.models.decode.inputs import _lengths
from flexattn_zoo.models.decode.mask import DecodeMask
from flexattn_zoo.models.decode.runs import _Run
from flexattn_zoo.models.sinks import apply_sinks, check_sinks
from flexattn_zoo.plan_cache import call_key
from flexattn_zoo.spec import Spec
from flexattn_zoo.validation import inputs_nonfinite

#: Step plans kept (a serving loop has a few step kinds per thread: layers of a few patterns).
STEP_PLANS_SIZE = 32
#: :class:`StepPlan` objects by :func:`step_key`; hits take no lock (``lru.ClockCache``).
STEPS: ClockCache[StepPlan] = ClockCache(STEP_PLANS_SIZE)

_SCALE_TYPES = (float, int, type(None))


def step_key(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    mask: Any,
    score_mod: Any,
    scale: Any,
    enable_gqa: Any,
    sinks: Any,
    return_lse: Any,
    backend: Any,
    block_size: Any,
) -> tuple[tuple[Any, ...] | None, Any, Any, Any]:
    """``(key, q, k_cache, v_cache)``: the step's :data:`STEPS` key (None: this step takes the
    full path and is not kept) and q/k/v as the step's kernel gets them (cast under
    ``torch.autocast``). For contiguous caches only: the caller passes no ``block_table`` or
    ``kv_layout``."""
    if (
        type(scale) not in _SCALE_TYPES
        or not (enable_gqa is None or type(enable_gqa) is bool)
        or not (block_size is None or type(block_size) is int)
        or not (sinks is None or type(sinks) is torch.Tensor)
        or _compat.is_compiling()
        or sharding.context_parallel_active()
    ):
        return None, q, k_cache, v_cache
    if not (type(q) is torch.Tensor and type(k_cache) is torch.Tensor and type(v_cache) is torch.Tensor):
        return None, q, k_cache, v_cache
    if isinstance(mask, torch.Tensor) or isinstance(score_mod, torch.Tensor):
        # The full path copies such a tensor into a spec (``masks.Dense``, ``score_mods.Bias``);
        # keyed by the caller's object, an in-place write to it would not miss.
        return None, q, k_cache, v_cache
    if (
        backend == "dense"
        or (not q.is_cuda and (return_lse is not False or sinks is not None))  # the CPU lse: dense
        or (
            torch.is_grad_enabled()
            and (
                q.requires_grad
                or k_cache.requires_grad
                or v_cache.requires_grad
                or (sinks is not None and sinks.requires_grad)
            )
        )  # a step that records gradients runs dense
    ):
        return None, q, k_cache, v_cache  # (no flex step: nothing would be kept under the key)
    q, k_cache, v_cache = _under_autocast(q, k_cache, v_cache)
    if isinstance(mask, Spec):
        mask = mask.live()  # a callable's captured tensors now (its plain key otherwise)
    if isinstance(score_mod, Spec):
        score_mod = score_mod.live()
    base = call_key(
        q, k_cache, v_cache, mask, score_mod, bool(enable_gqa), return_lse, _resolve_deterministic(None), backend, scale
    )  # fmt: skip
    if base is None:
        return None, q, k_cache, v_cache
    key = (
        base,
        scale,
        enable_gqa,
        block_size,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        sinks is None,
        _caller(),
    )
    return key, q, k_cache, v_cache


class StepPlan:
    """What the full path settled for one kind of flex step over a contiguous cache: its
    DecodeMask (under ``cache_key`` in ``decode.CACHE``; its batch, queries per row and capacity
    are what the lengths are checked against) and its planned run."""

    __slots__ = ("cache_key", "dm", "run")

    def __init__(self, cache_key: Hashable, dm: DecodeMask, run: _Run) -> None:
        self.cache_key, self.dm, self.run = cache_key, dm, run

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_len: Any,
        sinks: torch.Tensor | None,
        return_lse: bool,
    ) -> Any:
        """The step's output (``(out, lse)`` with ``return_lse``), or None when the DecodeMask is no
        longer the cached one, or on the CPU when q/k/v hold NaN/inf (plans are made only for
        finite inputs there): the caller then takes the full path."""
        dm = self.dm
        if CACHE.get_eager(self.cache_key) is not dm:
            return None
        if not q.is_cuda and inputs_nonfinite(q, k_cache, v_cache):
            return None  # flex_cpu refuses NaN/inf: the full path runs such a step dense
        lens = _lengths(cache_len, dm.batch, dm.q_len, dm.kv_len, q.device)  # kv_len: the capacity
        out, lse = self.run(q, k_cache, v_cache, dm.update(lens))
        if sinks is not None:
            check_sinks(sinks, q.shape[1], q.device)
            assert lse is not None  # sinks are in the key: the run was planned with the lse
            out, lse = apply_sinks(out, lse, sinks)
        return (out, lse) if return_lse else out
