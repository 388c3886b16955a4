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
* grad mode, which inputs require grad and whether the score spec captures tensors that do
  (the mode of a call whose inputs do not; ``flex_flash`` refuses such specs in any mode),
  ``enable_gqa``, ``return_lse``, the resolved ``deterministic`` flag, ``backend``, and
  ``dropout_p`` when above 0;
* what planning reads from the process: ``FLEXATTN_ZOO_ARCH``, the variables that place the
  tuning file (``tuning.store.ENV_VARS``), and what each registered route
  declares it reads (``Backend.env_vars``) or needs installed (``Backend.requires``);
* measured route choice (:mod:`flexattn_zoo.tuning`): the call's ``tune`` argument, the
  process-wide switch (``fz.tune.enable`` / ``disable``, ``FLEXATTN_ZOO_TUNE``) and the version of
  the table of measurements, which every measurement, load and clear bumps.

On the CPU planning may also read whether q/k/v hold NaN/inf (``Problem.nonfinite``: ``flex_cpu``
refuses them), a scan of the data. Where that verdict cannot change the route (no route that
reads it, ``Backend.reads_finiteness``, is the named one or comes at or before the chosen one:
SDPA routes, named routes other than ``flex_cpu``), neither the planning call nor a hit scans,
and the plan is stored under the key alone (its ``problem.nonfinite`` is False, which nothing
that runs the route reads). Where it can, a :class:`ByFiniteness` is stored instead, holding the
plan of each verdict, and every hit scans the inputs as the full path does (``lookup``,
``store``).

Not cached (the full path runs): a ``BlockMask`` as mask, calls traced by ``torch.compile``,
calls under ``torch.func.vmap`` / ``grad`` / ``jvp``, arguments that fail validation (errors
come from the full path), and a score_mod given by registry name while grad mode is on and
q/k/v do not require grad (the mode then depends on the tensors of a spec only the full path
builds).
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from typing import Any

import torch

from flexattn_zoo import _compat, tuning
from flexattn_zoo.arch import ARCH_ENV
from flexattn_zoo.backends import BACKENDS
from flexattn_zoo.functions import capture_state
from flexattn_zoo.lru import ClockCache
from flexattn_zoo.registry import MASKS, SCORES
from flexattn_zoo.spec import ScoreSpec, Spec
from flexattn_zoo.validation import SUPPORTED_DTYPES, inputs_nonfinite

#: Bound plans (``dispatch.BoundPlan``) by call key; a model has a handful of attention call kinds, a sweep a
#: few hundred. Read on every eager call, so hits take no lock (``lru.ClockCache``).
PLANS: ClockCache[Any] = ClockCache(256)
#: Environment variables the dispatcher or a route reads (routes declare theirs: ``Backend.env_vars``).
ENV_VARS = (
    ARCH_ENV,
    tuning.TUNE_ENV,
    *tuning.store.ENV_VARS,  # where the tuning file is: a plan may come from its table
    *dict.fromkeys(name for b in BACKENDS for name in b.env_vars),
)
#: What the registered routes need installed (``Backend.requires``), each distinct one once.
REQUIREMENTS = tuple(dict.fromkeys(r for b in BACKENDS for r in b.requires))
_REQUIREMENT_CHECKS = tuple(r.check for r in REQUIREMENTS)
_SUPPORTED_DTYPES = frozenset(SUPPORTED_DTYPES)


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
    tune: Any = None,
    kernel_options: tuple[tuple[str, Any], ...] | None = None,
    dropout_p: float = 0.0,
) -> Hashable | None:
    """The plan-cache key of a call, or None when the call must be planned in full (so may a key
    holding an unhashable argument: :func:`lookup` returns :data:`UNHASHABLE` for it).

    ``kernel_options`` is the checked tuple (``coercion.check_kernel_options``): part of the key.

    ``deterministic`` is the already resolved flag (it follows torch's global switch); ``scale``
    the checked scale (only its sign takes part: routes refuse ``scale <= 0`` where it breaks them);
    ``tune`` the call's argument as given (None, True or False; the switch it follows and the
    table's version are in ``process_state``). ``dropout_p`` is the checked value: above 0 it is
    part of the key (the problem holds it, and routes read it when they run); 0.0 leaves the key
    exactly as a call without dropout has it.
    """
    if not (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor):
        return None  # subclasses and non-tensors: the full path validates them
    try:
        sizes = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride())
    except RuntimeError:
        return None  # a strided nested tensor is a plain Tensor whose .shape raises: the full path refuses it
    if not (type(enable_gqa) is bool and type(return_lse) is bool and type(backend) is str):
        return None  # 1 == True as a key: let the full path refuse non-bool flags
    if tune is not None and type(tune) is not bool:
        return None
    if isinstance(mask, _compat.BlockMask):
        return None
    if _compat.under_func_transform():
        return None  # planned apart (Problem.func_transform), and q/k/v are the transform's wrappers
    device = q.device
    dtype = q.dtype
    if dtype not in _SUPPORTED_DTYPES or not (
        k.dtype == dtype and v.dtype == dtype and k.device == device and v.device == device
    ):
        return None  # let the full path name what is wrong (before reading the data below)
    grad_on = torch.is_grad_enabled()
    q_grad, k_grad, v_grad = q.requires_grad, k.requires_grad, v.requires_grad
    wants_grad = q_grad or k_grad or v_grad
    # Whether the score spec captures tensors that require grad: the call's mode when q/k/v do not
    # (``dispatch.needs_grad``), and a verdict of routes in any mode (``FlexFlashBackend``). A
    # spec's learned tensors are compared by identity, so their flag is read here, per call; a raw
    # callable's is in its captured state (a tensor that requires grad is recorded without a
    # version); a registry name's score spec is built only by the full path.
    if score_mod is None:
        score_grad: Any = False
    elif isinstance(score_mod, ScoreSpec):
        score_grad = score_mod.captures_grad_tensors()
    elif isinstance(score_mod, Spec):
        return None  # a mask spec as score_mod: the full path names the mistake
    elif grad_on and not wants_grad and (isinstance(score_mod, str) or not callable(score_mod)):
        return None
    else:
        score_grad = "captured"
    key: tuple[Any, ...] = (
        backend,
        _arg_key(mask, "mask"),
        _arg_key(score_mod, "score"),
        enable_gqa,
        return_lse,
        deterministic,
        grad_on,
        q_grad,  # each input's flag, not only whether one requires grad: a flex route's bound
        k_grad,  # call runs its compiled code directly, which Dynamo compiled for these flags
        v_grad,
        score_grad,
        sizes,
        dtype,
        device,
        process_state(),
        scale is not None and scale <= 0,
        tune,
        kernel_options,
    )
    if dropout_p > 0:
        key = (*key, ("dropout_p", dropout_p))
    return key  # may hold an unhashable argument: ``lookup`` tells (hashing twice costs host time)


class ByFiniteness:
    """What :data:`PLANS` holds for a call whose route depends on whether q/k/v hold NaN/inf:
    the bound plan made for each verdict (``plans[nonfinite]``), filled as calls of each kind come."""

    __slots__ = ("plans",)

    def __init__(self) -> None:
        self.plans: dict[bool, Any] = {}


#: What :func:`lookup` returns for a key holding an unhashable mask/score argument: such a call
#: is planned in full (which says what is wrong) and not stored.
UNHASHABLE = object()


def lookup(key: Hashable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
    """The cached ``dispatch.BoundPlan`` of a call with ``key`` (from :func:`call_key`), or None:
    the entry itself, or for a :class:`ByFiniteness` entry the one of these inputs' NaN/inf
    verdict; :data:`UNHASHABLE` when the key cannot be hashed. Eager calls only: ``fz.attention``
    takes its traced path before it looks up."""
    try:
        found = PLANS.get_eager(key)
    except TypeError:
        return UNHASHABLE
    if type(found) is ByFiniteness:
        return found.plans.get(inputs_nonfinite(q, k, v))
    return found


def store(key: Hashable, bound: Any, finiteness_matters: bool) -> None:
    """Keep ``bound`` (a ``dispatch.BoundPlan`` made for a call with ``key``);
    ``finiteness_matters``: whether a call with the same key but the other NaN/inf verdict could
    be routed otherwise."""
    if not finiteness_matters:
        PLANS.put(key, bound)
        return
    entry = PLANS.get(key)
    if type(entry) is not ByFiniteness:
        entry = PLANS.put(key, ByFiniteness())
    entry.plans.setdefault(bound.plan.problem.nonfinite, bound)


#: Tags a spec's plain key in a call key: a private object, so no argument a caller passes (a
#: tuple that looks like a plain key) can compare equal to it and skip validation.
_PLAIN = object()


def _arg_key(value: Any, kind: str) -> Hashable:
    """A ``mask=`` / ``score_mod=`` argument as it takes part in the key.

    Specs are their ``plain_key()`` where they have one, else themselves (by value;
    ``fz.attention`` passes them through ``Spec.live()`` first).
    A raw callable is its identity *and* :func:`~flexattn_zoo.functions.capture_state` (the
    versions of the tensors it captures): its plan holds a ``FunctionMask`` whose BlockMask was
    built from those tensors, so an in-place write must miss here. A registry name of a
    registered plain function likewise carries that function's state (through the factory's
    closure); a class entry has none.
    """
    if isinstance(value, Spec):
        plain = value.plain_key()  # compared in C, where specs compare field by field in Python
        return value if plain is None else (_PLAIN, plain)
    if value is None:
        return value
    if isinstance(value, str):
        registry = MASKS if kind == "mask" else SCORES
        entry = registry.find(value)
        if entry is None:
            return value  # the full path names the error
        factory = entry.factory
        learned = kind == "mask"
        state = None if isinstance(factory, type) else capture_state(factory, learned_versions=learned)
        return ("name", value, state)
    if callable(value) and not isinstance(value, type):
        return ("callable", value, capture_state(value, learned_versions=kind == "mask"))
    return value


def _environ_reader() -> Any:
    """A function returning the values of :data:`ENV_VARS` in ``os.environ`` as a tuple.

    ``os.environ.get`` encodes the name and decodes the value on every read (about 1 us each);
    CPython's ``os.environ`` keeps its variables in a dict of encoded names and values
    (``_data``), which every write through ``os.environ`` (and ``monkeypatch.setenv``) updates, so
    reading that dict by pre-encoded names sees exactly the same variables. The values stay
    encoded: they are only compared. Falls back to ``os.environ.get`` on a Python without it, or
    when ``os.environ`` was replaced by another mapping.
    """
    environ = os.environ
    data = getattr(environ, "_data", None)
    encode = getattr(environ, "encodekey", None)
    if not isinstance(data, dict) or encode is None:
        return lambda: tuple([os.environ.get(name) for name in ENV_VARS])
    keys = tuple(encode(name) for name in ENV_VARS)

    def read() -> tuple[Any, ...]:
        if os.environ is not environ:
            return tuple([os.environ.get(name) for name in ENV_VARS])
        return tuple(map(data.get, keys))

    return read


_read_environ = _environ_reader()


def process_state() -> Hashable:
    """What planning reads from the process rather than the call: the registries' versions (a
    name can be unregistered and registered anew), the environment variables the dispatcher and
    the routes read, whether each route's requirements are installed, and tuning's switch and
    table version (``tuning.state``). Part of every cached plan's key. Looked up per call, once
    per distinct variable or requirement (host time)."""
    return (
        MASKS.version,
        SCORES.version,
        _read_environ(),
        tuple([check() for check in _REQUIREMENT_CHECKS]),
        tuning.state(),
    )


__all__ = [
    "ENV_VARS",
    "PLANS",
    "REQUIREMENTS",
    "UNHASHABLE",
    "ByFiniteness",
    "call_key",
    "lookup",
    "process_state",
    "store",
]
