"""The plans of recent ``fz.attention`` calls, so a model's repeated call skips re-planning.

Planning a call (validating q/k/v and the specs, asking every route for its reasons, choosing
one) took about a third of our host time per call on the H200 (cProfile in
benchmarks/results/host_overhead_*_h200.txt), enough to leave short kernels waiting on the host.
A model calls attention with the same arguments' *kinds* every step: the key here is everything
planning reads from them, so a hit returns exactly the plan the full path would build:

* q/k/v shapes, strides, dtype and device (``Problem`` sizes, ``index_extent``, arch);
* the ``mask`` / ``score_mod`` objects themselves (specs compare by value, their learned tensors,
  names and callables by identity; a callable, or a name of a registered function, also by the
  version counters of the tensors it captures), the registries' versions (a name can be
  unregistered and registered anew);
* grad mode and which inputs require grad, ``enable_gqa``, ``return_lse``, the resolved
  ``deterministic`` flag, ``backend``; on the CPU, whether q/k/v hold NaN/inf (a check of the
  data the full path makes too);
* what planning reads from the process: ``FLEXATTN_ZOO_ARCH``, and what each registered route
  declares it reads (``Backend.env_vars``) or needs installed (``Backend.requires``).

Not cached (the full path runs): a ``BlockMask`` as mask, calls traced by ``torch.compile``,
arguments that fail validation (errors come from the full path), and a score spec whose captured
tensors require grad while q/k/v do not (its mode depends on those tensors).
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from typing import Any

import torch

from flexattn_zoo import _compat
from flexattn_zoo.arch import ARCH_ENV
from flexattn_zoo.backends import BACKENDS
from flexattn_zoo.functions import capture_state
from flexattn_zoo.lru import LRUCache
from flexattn_zoo.spec import Spec
from flexattn_zoo.validation import SUPPORTED_DTYPES, inputs_nonfinite

#: Plans by call key; a model has a handful of attention call kinds, a sweep a few hundred.
PLANS: LRUCache[Any] = LRUCache(256)
#: Environment variables the dispatcher or a route reads (routes declare theirs: ``Backend.env_vars``).
ENV_VARS = (ARCH_ENV, *dict.fromkeys(name for b in BACKENDS for name in b.env_vars))
#: What the registered routes need installed (``Backend.requires``), each distinct one once.
REQUIREMENTS = tuple(dict.fromkeys(r for b in BACKENDS for r in b.requires))


def call_key(
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    score_mod: Any,
    enable_gqa: Any,
    return_lse: Any,
    deterministic: bool,
    backend: Any,
    scale: float | None = None,
) -> Hashable | None:
    """The plan-cache key of a call, or None when the call must be planned in full.

    ``deterministic`` is the already resolved flag (it follows torch's global switch); ``scale``
    the checked scale (only its sign takes part: routes refuse ``scale <= 0`` where it breaks them).
    """
    if not (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor):
        return None  # subclasses and non-tensors: the full path validates them
    if not (type(enable_gqa) is bool and type(return_lse) is bool and type(backend) is str):
        return None  # 1 == True as a key: let the full path refuse non-bool flags
    if isinstance(mask, _compat.BlockMask) or _compat.is_compiling():
        return None
    if q.dtype not in SUPPORTED_DTYPES or not (
        k.dtype == v.dtype == q.dtype and k.device == v.device == q.device
    ):
        return None  # let the full path name what is wrong (before reading the data below)
    grad_on = torch.is_grad_enabled()
    wants_grad = q.requires_grad or k.requires_grad or v.requires_grad
    if score_mod is not None and grad_on and not wants_grad:
        return None
    key = (
        backend,
        _arg_key(mask, "mask"),
        _arg_key(score_mod, "score"),
        enable_gqa,
        return_lse,
        deterministic,
        grad_on and wants_grad,
        q.shape,
        q.stride(),
        k.shape,
        k.stride(),
        v.shape,
        v.stride(),
        q.dtype,
        q.device,
        process_state(),
        q.device.type == "cpu" and inputs_nonfinite(q, k, v),
        scale is not None and scale <= 0,
    )
    try:
        hash(key)
    except TypeError:  # an unhashable mask/score argument: the full path says what is wrong
        return None
    return key


def _arg_key(value: Any, kind: str) -> Hashable:
    """A ``mask=`` / ``score_mod=`` argument as it takes part in the key.

    Specs are themselves (by value; ``fz.attention`` passes them through ``Spec.live()`` first).
    A raw callable is its identity *and* :func:`~flexattn_zoo.functions.capture_state` (the
    versions of the tensors it captures): its plan holds a ``FunctionMask`` whose BlockMask was
    built from those tensors, so an in-place write must miss here. A registry name of a
    registered plain function likewise carries that function's state (through the factory's
    closure); a class entry has none.
    """
    if value is None or isinstance(value, Spec):
        return value
    if isinstance(value, str):
        from flexattn_zoo.registry import MASKS, SCORES

        registry = MASKS if kind == "mask" else SCORES
        if value not in registry:
            return value  # the full path names the error
        factory = registry.entry(value).factory
        return ("name", value, capture_state(factory) if not isinstance(factory, type) else None)
    if callable(value) and not isinstance(value, type):
        return ("callable", value, capture_state(value))
    return value


def process_state() -> Hashable:
    """What planning reads from the process rather than the call: the registries' versions (a
    name can be unregistered and registered anew), the environment variables the dispatcher and
    the routes read, and whether each route's requirements are installed. Part of every cached
    plan's key. Looked up per call, once per distinct variable or requirement (host time)."""
    from flexattn_zoo.registry import MASKS, SCORES

    env = tuple(os.environ.get(name) for name in ENV_VARS)
    return MASKS.version, SCORES.version, env, tuple([r.check() for r in REQUIREMENTS])


__all__ = ["ENV_VARS", "PLANS", "REQUIREMENTS", "call_key", "process_state"]
