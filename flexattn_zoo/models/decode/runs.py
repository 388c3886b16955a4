"""A decode step's plan, made once per call signature and kept on its DecodeMask.

:func:`run_signature` is the key: everything a plan depends on besides the DecodeMask. :class:`_Run`
is the plan (an ``fz.plan`` result) and how to launch it. Kept apart from :mod:`.launch` (which
plans through a DecodeMask) because ``mask`` imports ``_Run`` for the DecodeMask's ``runs``
cache: this module imports no DecodeMask, so the two never import each other.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import torch

from flexattn_zoo import _compat, sharding
from flexattn_zoo.backends import BY_NAME
from flexattn_zoo.backends.flex import FlexBackend, FlexCall
from flexattn_zoo.dispatch import execute_plan, needs_grad
from flexattn_zoo.plan_cache import process_state
from flexattn_zoo.validation import inputs_nonfinite


def run_signature(q, k, v, score, scale, gqa: bool, need_lse: bool, backend: str) -> Hashable:
    """Everything a decode step's plan depends on besides its DecodeMask: shapes, strides, dtypes,
    devices, the score mod, scale, GQA, lse, the requested route, torch's determinism switch,
    whether the step records gradients (routes differ by mode), whether torch's context_parallel
    is active (it narrows the routes), the process state the dispatcher reads
    (``plan_cache.process_state``) and, on the CPU, whether q/k/v hold NaN/inf (``flex_cpu``
    refuses them: the scan the full path makes)."""
    device = q.device
    return (
        q.shape,
        q.stride(),
        q.dtype,
        k.shape,
        k.stride(),
        k.dtype,
        v.shape,
        v.stride(),
        v.dtype,
        device,
        k.device,
        v.device,
        score,
        scale,
        gqa,
        need_lse,
        backend,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        needs_grad((q, k, v), score),
        process_state(),
        sharding.context_parallel_active(),
        device.type == "cpu" and inputs_nonfinite(q, k, v),
    )


class _Run:
    """A decode step's plan for one signature (:func:`run_signature`) and how to launch it.

    On a flex route that lets its caller launch (``FlexBackend.caller_mask_call``) the route's
    prepared call for this DecodeMask's BlockMask is kept too: later steps go straight to the
    compiled kernel, without the plan's route lookup and the route's own cache lookup (a few
    microseconds of host time per step), and from the second step without Dynamo's frame
    evaluation and guards (see ``ran``). The prepared call depends only on the plan's problem,
    the device and the DecodeMask's mask_mod and block size, none of which change for the
    DecodeMask and signature this run is stored under.
    """

    __slots__ = ("call", "plan", "ran", "scale")

    def __init__(self, chosen: Any, bm: _compat.BlockMask, device: torch.device, scale: float | None) -> None:
        self.plan = chosen
        route = BY_NAME[chosen.backend]
        self.call: FlexCall | None = None
        #: ``FlexCall.launch``'s memo of this run's last launch: every step of one signature has
        #: the same q/k/v shapes, strides and grad flags, and the DecodeMask's BlockMask (the same
        #: object, updated in place), so from the second step the compiled graph runs directly.
        self.ran: list[Any] = [None]
        if isinstance(route, FlexBackend) and not chosen.problem.requires_grad:
            self.call = route.caller_mask_call(chosen.problem, device, bm)
        # execute_plan's default scale, worked out once.
        self.scale = 1.0 / math.sqrt(chosen.problem.head_dim) if scale is None else float(scale)

    @property
    def backend(self) -> str:
        return str(self.plan.backend)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bm: _compat.BlockMask
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.call is not None:
            return self.call.launch(q, k, v, self.scale, bm, self.ran)
        return execute_plan(self.plan, q, k, v, scale=self.scale, block_mask=bm)
