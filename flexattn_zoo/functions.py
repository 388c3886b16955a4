"""Specs that wrap user functions: a raw flex ``mask_mod`` / ``score_mod`` callable as a spec.

``fz.attention`` accepts a raw flex callable where it takes a spec; :mod:`flexattn_zoo.coercion`
wraps it here so the rest of the library only ever sees specs.

How a callable is evaluated off the kernels (the float64 oracle, the ``dense`` route, the
BlockMask builder): flex calls a mod on 0-d index tensors, one (b, h, q_idx, kv_idx) at a time
(``torch.vmap`` eagerly, a scalar per element in the compiled kernel), so ``table[q_idx][kv_idx]``,
``intervals[image[kv_idx]][0]`` and reductions over a captured row are all valid mods. The
library evaluates a callable on broadcast index grids (one batched call, the fast way) only where
the probe (:func:`check_mask_function`) found that call to give what flex's scalar evaluation
gives; otherwise the spec is marked ``scalar`` and :func:`evaluate_as_flex` evaluates it exactly
as flex does, under ``torch.vmap`` over every element, in chunks of ``SCALAR_CHUNK_ELEMENTS``.
The probe compares the two on all-zero indices (in range for any captured table) over grids of
distinct extents: a broadcast call that fails, returns a wrong shape, or differs there (a
reduction summing over the grid) selects the scalar evaluation; one that agrees there but not
at other index values would not be caught.
What flex rejects (Python ``if``/``and``/``or``, ``bool()``, ``int()``, ``.item()`` on a value
computed from the indices) is refused with a TypeError that says so.
The verdict is kept per callable and captured state (:data:`PROBED`) and per structure
(:data:`PROBED_STRUCTURES`, :func:`_structure`): a closure built anew every step over new tensors
of the same shapes is probed once, and each new one only traced at zero indices to check it runs
the same ops.

Captured state: a spec cannot own what a callable captures, so a wrapped callable's identity is
not enough of a cache key (a BlockMask built for ``ids`` would survive ``ids[:] = ...`` and pair
its stale block sparsity with the live ``mask_mod``). :func:`capture_state` records the identity
and in-place version counter of every tensor the callable reaches (closure cells, defaults,
globals it names, ``functools.partial`` arguments, recursively through the functions and
containers among them, and one level of attributes of the objects found there: a bound method's
``self``, a captured module's own buffers) and the invalidation epochs of :func:`invalidate`;
``FunctionMask`` / ``FunctionScore`` hold it as a field, so it takes part in equality and hashing,
and :meth:`Spec.live` re-reads it on every call.
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import inspect
import itertools
import sys
import threading
import types
import weakref
from collections.abc import Callable, Container, Hashable, Iterator
from typing import Any, ClassVar, TypeVar

import torch

from flexattn_zoo import _compat
from flexattn_zoo.lru import LRUCache
from flexattn_zoo.spec import (
    FUNCTION_CHECKS,
    FunctionCheck,
    MaskMod,
    MaskSpec,
    ScoreMod,
    ScoreSpec,
    Spec,
    index_grids,
    spec_dataclass,
)


def _reads_argument(fn: Callable[..., Any], index: int) -> bool:
    """Whether ``fn`` can depend on its ``index``-th positional argument. While ``torch.compile``
    traces: True (assumed), since Dynamo cannot hand a closure made inside the graph to the
    bytecode reader; a BlockMask with batch/head dims is exact either way.
    """
    if _compat.is_compiling():
        return True
    return _reads_argument_eagerly(fn, index)


def _reads_argument_eagerly(fn: Callable[..., Any], index: int) -> bool:
    """:func:`_reads_argument` read from the bytecode.

    Exact for plain Python functions: an argument whose name is never loaded (nor captured by an
    inner function) cannot influence the result. Anything else is assumed to read it. A bound
    method's ``__code__`` is its function's, whose first argument is ``self``: skip it.
    """
    if inspect.ismethod(fn):
        fn, index = fn.__func__, index + 1
    code = getattr(fn, "__code__", None)
    if code is None or index >= code.co_argcount:
        return True
    arg = code.co_varnames[index]
    if arg in code.co_cellvars:
        return True
    for ins in dis.get_instructions(code):
        if ins.opname.startswith("LOAD") and (
            ins.argval == arg or (isinstance(ins.argval, tuple) and arg in ins.argval)
        ):
            return True
    return False


def _positional_arity(fn: Callable[..., Any]) -> int | None:
    """How many positional arguments ``fn`` *requires* (those without a default), as flex counts
    them to tell a ``mask_mod`` (4) from a ``score_mod`` (5); extra parameters with defaults
    (``lambda b, h, q, kv, doc=doc: ...``) do not count. None when the signature is unknown or
    takes ``*args`` (the probe call decides then)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return sum(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params
    )


def _required_keyword_only(fn: Callable[..., Any]) -> list[str]:
    """Keyword-only parameters of ``fn`` without a default (flex never passes them)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [p.name for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY and p.default is p.empty]


def _check_signature(
    fn: Callable[..., Any], arg: str, kind: str, names: str, returns: str, count: int
) -> None:
    arity = _positional_arity(fn)
    required_kw = _required_keyword_only(fn)
    if (arity is not None and arity != count) or required_kw:
        got = (
            f"requires keyword-only argument(s) {', '.join(required_kw)}"
            if required_kw
            else f"requires {arity} positional argument(s)"
        )
        raise TypeError(
            f"{arg} callable must have the flex {kind} signature ({names}) -> {returns}, i.e. exactly "
            f"{count} positional arguments without defaults (extra parameters need defaults); "
            f"{getattr(fn, '__name__', fn)!r} {got}"
        )


# ---------------------------------------------------------------------------------------------
# What a callable captures, and its version.

#: Values visited per callable at most (a captured container of thousands of entries is not
#: walked whole; what lies past the limit is not tracked: ``invalidate`` covers it).
WALK_LIMIT = 4096


def _children(value: Any, expand: bool) -> tuple[list[Any], bool]:
    """What ``value`` holds that a call of it may read, and whether objects among those may be
    expanded in turn. Functions, partials, methods and containers pass ``expand`` on; an object's
    attributes are walked only when ``expand`` holds (the callable itself, a bound method's object,
    an object a closure captures: ``self.ids`` of a captured module), and objects found among them
    are not expanded again (a captured model is not walked whole on every call)."""
    if isinstance(value, types.FunctionType):
        out: list[Any] = []
        for cell in value.__closure__ or ():
            try:
                out.append(cell.cell_contents)
            except ValueError:  # an empty cell (a name bound later in the enclosing function)
                continue
        out += list(value.__defaults__ or ())
        out += list((value.__kwdefaults__ or {}).values())
        names = value.__globals__
        # Traced, the function under the cache (Dynamo warns at an lru_cache and traces through it).
        listed = _compat.global_names.__wrapped__ if _compat.is_compiling() else _compat.global_names
        out += [names[n] for n in listed(value.__code__) if n in names]
        return out, expand
    if isinstance(value, types.MethodType):
        return [value.__func__, value.__self__], expand
    if isinstance(value, functools.partial):
        return [value.func, *value.args, *value.keywords.values()], expand
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value), expand
    if isinstance(value, dict):
        return list(value.values()), expand
    if expand and not isinstance(value, (type, types.ModuleType)) and hasattr(value, "__dict__"):
        call = getattr(type(value), "__call__", None)  # noqa: B004 - the method itself, to walk it
        return [*([call] if isinstance(call, types.FunctionType) else []), *vars(value).values()], False
    return [], False


def _reachable(fn: Any) -> Iterator[Any]:
    """Every tensor and every Python callable ``fn`` reaches (see the module docstring), each once."""
    visited: set[tuple[int, bool]] = set()
    found: set[int] = set()
    stack: list[tuple[Any, bool]] = [(fn, True)]
    while stack and len(visited) < WALK_LIMIT:
        value, expand = stack.pop()
        if (id(value), expand) in visited or isinstance(value, (str, bytes, int, float, complex, type(None))):
            continue
        visited.add((id(value), expand))
        if isinstance(value, Spec):
            # A spec owns its tensors (specs are immutable), but not the raw callables it wraps
            # (``FunctionMask``), whose captured state is the user's: those are walked.
            if value._holds_callables():
                parts = value._parts()
                stack.extend(
                    (part, expand) for part in reversed(parts) if isinstance(part, Spec) or callable(part)
                )
            continue
        if isinstance(value, torch.Tensor) or (
            callable(value) and not isinstance(value, (type, types.BuiltinFunctionType))
        ):
            if id(value) not in found:
                found.add(id(value))
                yield value
            if isinstance(value, torch.Tensor):
                continue
        children, expand_children = _children(value, expand)
        stack.extend((child, expand_children) for child in reversed(children))


class _Ref:
    """An identity key for a captured object: equal only to a reference to the same live object.

    Holds it weakly where possible, so a cache key never keeps a tensor alive, and a key whose
    object was collected never equals a key of a new object that reuses its address.
    """

    __slots__ = ("_id", "_ref")

    def __init__(self, obj: Any) -> None:
        self._id = id(obj)
        try:
            self._ref: Callable[[], Any] = weakref.ref(obj)
        except TypeError:  # not weakly referenceable: hold it
            self._ref = lambda: obj

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Ref):
            return NotImplemented
        if self._id != other._id:
            return False
        obj = self._ref()
        return obj is not None and obj is other._ref()

    def __hash__(self) -> int:
        return self._id

    def __repr__(self) -> str:
        obj = self._ref()
        return f"<{type(obj).__name__ if obj is not None else 'collected'} at {self._id:#x}>"


_EPOCH_LOCK = threading.Lock()
#: ``invalidate(fn)`` counts, by id of the callable (with a reference to check it is the same one).
_EPOCHS: dict[int, tuple[_Ref, int]] = {}
#: ``invalidate()`` without an argument: every callable's state changes.
_GLOBAL_EPOCH = [0]
#: A fresh number per read of an untrackable tensor (no version counter): never equal twice.
_UNTRACKED = itertools.count()


def _epoch(obj: Any) -> int:
    entry = _EPOCHS.get(id(obj))
    return entry[1] if entry is not None and entry[0] == _Ref(obj) else 0


def invalidate(fn: Any = None) -> None:
    """Declare that what ``fn`` (a ``mask_mod`` / ``score_mod`` callable) reads has changed.

    In-place writes to tensors a callable captures are seen without this (their version counters
    are part of every cache key derived from the callable). Call it after changing anything else
    it reads: a captured Python list or dict, an attribute of a captured object other than its own
    tensors, a tensor written through ``.data`` or NumPy or received by a ``torch.distributed``
    collective (``broadcast``, ``all_reduce``: no version bump). Every BlockMask, plan and call entry
    built for ``fn`` (also inside composites, ``fz.Attention`` layers and other callables that
    capture it) is rebuilt on next use. Passing a new function object does the same.
    ``invalidate()`` with no argument does it for every callable.
    """
    if fn is not None and not callable(fn):
        # A spec, a name or a tensor would be recorded and never matched: nothing rebuilt, silently.
        kind = " (a spec's own tensors are tracked by their versions)" if isinstance(fn, Spec) else ""
        raise TypeError(
            f"fz.invalidate(fn=...) takes the mask_mod / score_mod callable whose state changed, or "
            f"nothing (every callable); got {type(fn).__name__}{kind}"
        )
    with _EPOCH_LOCK:
        if fn is None:
            _GLOBAL_EPOCH[0] += 1
            return
        target = fn.__func__ if isinstance(fn, types.MethodType) else fn
        key = id(target)
        entry = _EPOCHS.get(key)
        if entry is not None and entry[0] == _Ref(target):
            _EPOCHS[key] = (entry[0], entry[1] + 1)
            return
        ref = _Ref(target)
        _EPOCHS[key] = (ref, 1)
        try:  # leave with the callable (one finalizer per callable, however often invalidated)
            weakref.finalize(target, _forget_epoch, key, ref)
        except TypeError:
            pass


def _forget_epoch(key: int, ref: _Ref) -> None:
    with _EPOCH_LOCK:
        entry = _EPOCHS.get(key)
        if entry is not None and entry[0] is ref:
            _EPOCHS.pop(key, None)


def capture_state(fn: Any, *, learned_versions: bool = False) -> Hashable:
    """A hashable snapshot of what ``fn`` reads besides its arguments: the identity and in-place
    version of every tensor it reaches, and the :func:`invalidate` epochs. Tensors that require
    grad count by identity alone unless ``learned_versions``: a score mod's learned values are
    read live by the kernels and nothing cached derives from them (an optimizer step must not
    rebuild anything), while a mask_mod's values decide its BlockMask, so mask callables pass
    True. Equal snapshots mean nothing a cache derived from ``fn`` has changed.
    Host-only (no device sync); microseconds for a typical closure. While ``torch.compile``
    traces, ``()``: Dynamo guards the callable itself, and cannot read the cells of a closure made
    inside the graph (transformers builds its mask functions in the model's forward)."""
    if _compat.is_compiling():
        return ()
    tensors: list[tuple[_Ref, int | None]] = []
    epochs: list[tuple[_Ref, int]] = []
    for value in _reachable(fn):
        if isinstance(value, torch.Tensor):
            if value.requires_grad and not learned_versions:
                tensors.append((_Ref(value), None))
            else:
                version = _compat.tensor_version(value)
                tensors.append((_Ref(value), next(_UNTRACKED) if version is None else version))
        else:
            count = _epoch(value.__func__ if isinstance(value, types.MethodType) else value)
            if count:
                epochs.append((_Ref(value), count))
    return (_GLOBAL_EPOCH[0], tuple(epochs), tuple(tensors))


_TrackedT = TypeVar("_TrackedT", bound="_TracksCallable")


class _TracksCallable(Spec):
    """Shared by :class:`FunctionMask` and :class:`FunctionScore`: ``state`` is the callable's
    :func:`capture_state` when the spec was built (``()`` when ``tracked`` is False); ``live()``
    returns a new spec when it changed."""

    fn: Callable[..., Any]
    tracked: bool
    state: Hashable
    #: Whether the versions of captured tensors that require grad count (see :func:`capture_state`).
    _LEARNED_VERSIONS: ClassVar[bool] = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", self._capture())

    def _capture(self) -> Hashable:
        return capture_state(self.fn, learned_versions=self._LEARNED_VERSIONS) if self.tracked else ()

    def _holds_callables(self) -> bool:
        return self.tracked

    def loads_pairs(self) -> bool:
        # How the function indexes what it captures is unknown, and listing what it captures
        # walks its closure, which Dynamo cannot trace: any user callable counts.
        return True

    def pair_tiles(self) -> int:
        return 1  # what it captures is not looked into (see loads_pairs)

    def flex_hazards(self) -> tuple[str, ...]:
        return tuple(getattr(self, "hazards", ()))

    def live(self: _TrackedT) -> _TrackedT:
        # Traced, ``capture_state`` is ``()`` (see there), which never equals the state of a spec
        # built eagerly: the probe would run in the graph (its verdict reads tensor data). Nothing
        # is cached while traced, and Dynamo guards the callable, so the spec is live as it is.
        if not self.tracked or _compat.is_compiling():
            return self
        state = self._capture()
        if state == self.state:
            return self
        # What the callable captures changed (an in-place write, ``fz.invalidate``): how it must
        # be evaluated may have too, so it is probed again, as a callable passed anew would be.
        probed = self._probe()
        fresh = dataclasses.replace(self, scalar=probed.scalar, hazards=probed.hazards)  # type: ignore[type-var]
        object.__setattr__(fresh, "state", state)  # what __post_init__ just walked for again
        return fresh

    def _probe(self) -> Probed:
        """The probe's verdict on ``fn`` now (:func:`check_mask_function` / :func:`check_score_function`)."""
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("state", None)  # identities and versions of this process's objects
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        object.__setattr__(self, "state", self._capture())


@spec_dataclass
class FunctionMask(_TracksCallable, MaskSpec):
    """A user ``mask_mod(b, h, q_idx, kv_idx) -> bool`` as a spec: equal when it wraps the same
    function object *and* the tensors it captures are unchanged (see :func:`capture_state`).

    ``tracked=False`` is for the library's own closures over tensors it rewrites in place on
    purpose (decode offsets), which only kernels read: nothing cached derives from their values.
    """

    fn: Callable[..., Any]
    label: str = ""
    tracked: bool = dataclasses.field(default=True, repr=False)
    #: Evaluated as flex does (:func:`evaluate_as_flex`) on index grids, not by one broadcast
    #: call: set where the probe found the broadcast call wrong or failing (see the module doc).
    scalar: bool = dataclasses.field(default=False, repr=False)
    #: What the probe saw the callable do that a compiled flex kernel mishandles (:data:`REDUCES`,
    #: :data:`READS_GATHERED_ROW`, :data:`SELECTS_PER_HEAD`, ...): each flex route refuses the
    #: ones its kernel has (:data:`KERNEL_HAZARDS`).
    hazards: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    state: Hashable = dataclasses.field(default=(), init=False, repr=False)
    # Its BlockMask is built from the values it captures, learned or not.
    _LEARNED_VERSIONS: ClassVar[bool] = True

    def _probe(self) -> Probed:
        return check_mask_function(self.fn)

    def uses_batch(self) -> bool:
        return _reads_argument(self.fn, 0)

    def uses_head(self) -> bool:
        return _reads_argument(self.fn, 1)

    def _make_mask_mod(self) -> MaskMod:
        return _scalar_mask_mod(self.fn) if self.scalar else self.fn

    def tensors(self) -> list[torch.Tensor]:
        return captured_tensors(self.fn)

    def index_offsets(self) -> tuple[int, int]:
        """What the query and key indices are shifted by before ``fn`` reads them (none here)."""
        return 0, 0

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        # Evaluated where the tensors the function indexes live (e.g. CUDA document ids), returned
        # on the CPU like the other specs' oracles (composites combine them).
        device = _captured_device(self.fn)
        b, h, q, kv = (g.to(device) for g in index_grids(batch, heads, q_len, kv_len))
        q_offset, kv_offset = self.index_offsets()
        fn = _scalar_mask_mod(self.fn) if self.scalar else self.fn
        out = torch.as_tensor(fn(b, h, q + q_offset, kv + kv_offset)).cpu()
        return torch.broadcast_to(out, (batch, heads, q_len, kv_len))


@spec_dataclass
class FunctionScore(_TracksCallable, ScoreSpec):
    """A user ``score_mod(score, b, h, q_idx, kv_idx) -> score`` as a spec (equality as for
    :class:`FunctionMask`)."""

    fn: Callable[..., Any]
    label: str = ""
    tracked: bool = dataclasses.field(default=True, repr=False)
    #: As :attr:`FunctionMask.scalar` and :attr:`FunctionMask.hazards`.
    scalar: bool = dataclasses.field(default=False, repr=False)
    hazards: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    state: Hashable = dataclasses.field(default=(), init=False, repr=False)

    def _probe(self) -> Probed:
        return check_score_function(self.fn)

    def _make_score_mod(self, *, fast: bool) -> ScoreMod:
        return _scalar_score_mod(self.fn) if self.scalar else self.fn

    def uses_head(self) -> bool:
        return True  # unknown: a user function may read h

    def tensors(self) -> list[torch.Tensor]:
        # What the function closes over: a learnable bias there makes the call need a backward.
        return captured_tensors(self.fn)

    def reads_scalar_tensors(self) -> bool:
        # Whether the function loads a one-element tensor is a hazard the probe traces
        # (:data:`LOADS_ONE_ELEMENT`); what it merely reaches (a module's unused buffers) is not.
        return False

    def captures_grad_tensors(self) -> bool:
        if _compat.is_compiling():
            # Not walked in the graph (see walkable_at_trace_time); where it cannot be walked at
            # trace time either, what it captures is unknown, so it may be a learned tensor, whose
            # gradient needs a route with a backward.
            return _captures_grad_at_trace_time(self.fn) if walkable_at_trace_time(self.fn) else True
        return super().captures_grad_tensors()

    def dense(self, scores: torch.Tensor) -> torch.Tensor:
        batch, heads, q_len, kv_len = scores.shape
        b, h, q, kv = (g.to(scores.device) for g in index_grids(batch, heads, q_len, kv_len))
        fn = _scalar_score_mod(self.fn) if self.scalar else self.fn
        return torch.broadcast_to(fn(scores, b, h, q, kv), scores.shape).to(scores.dtype)


# ---------------------------------------------------------------------------------------------
# Evaluating a callable as flex does.

#: Elements evaluated at once by :func:`evaluate_as_flex` (at most: a chunk is one slice of the
#: grid along its longest axis, and grows past this only where one row of that axis does).
SCALAR_CHUNK_ELEMENTS = 1 << 20


def _flex_scalars(args: tuple[Any, ...]) -> bool:
    """Whether a mod wrapper was called the way flex calls it: 0-d index tensors (the compiled
    kernel's scalars, traced or not, or eager flex's and ``create_mask``'s vmap). Index grids
    (the ``dense`` route, the BlockMask builder), traced or not, are evaluated as flex does."""
    return all(isinstance(a, torch.Tensor) and a.dim() == 0 for a in args)


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def _vmapped(fn: Callable[..., Any], args: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """``fn`` under one ``torch.vmap`` per axis of ``shape`` (as flex's ``_vmap_for_bhqkv``): an
    argument of extent 1 along an axis the grid spans is not mapped there (squeezed), so no index
    grid is ever expanded to the full shape."""
    mapped = [[a.shape[d] == shape[d] for d in range(len(shape))] for a in args]
    squeezed = []
    for a, dims in zip(args, mapped, strict=True):
        keep = [d for d in range(len(shape)) if dims[d]]
        squeezed.append(a.reshape([a.shape[d] for d in keep]))
    call = fn
    for d in reversed(range(len(shape))):
        call = torch.vmap(call, in_dims=tuple(0 if m[d] else None for m in mapped), out_dims=0)
    return call(*squeezed)


def _evaluate_chunked(
    fn: Callable[..., Any], args: list[torch.Tensor], shape: tuple[int, ...]
) -> torch.Tensor:
    total = _numel(shape)
    # Traced, one call: chunks would put a copy of the mod per chunk in the graph, and compare
    # symbolic lengths with the chunk size (a guard and a recompile per size class).
    if _compat.is_compiling() or total <= SCALAR_CHUNK_ELEMENTS or max(shape) == 1:
        out = _vmapped(fn, args, shape)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape:
            got = tuple(out.shape[len(shape) :]) if isinstance(out, torch.Tensor) else type(out).__name__
            raise TypeError(
                f"a mod must return one value per (b, h, q_idx, kv_idx) (a 0-d tensor, as flex "
                f"requires), got {got} per element"
            )
        return out
    axis = max(range(len(shape)), key=lambda d: shape[d])
    rows = max(1, SCALAR_CHUNK_ELEMENTS // (total // shape[axis]))
    # split, not narrow: the gradient of a split tensor (the scores) is one concatenation.
    pieces = [a.split(rows, dim=axis) if a.shape[axis] > 1 else None for a in args]
    outs = []
    for n, start in enumerate(range(0, shape[axis], rows)):
        part = [p[n] if p is not None else a for a, p in zip(args, pieces, strict=True)]
        sub = list(shape)
        sub[axis] = min(rows, shape[axis] - start)
        outs.append(_evaluate_chunked(fn, part, tuple(sub)))
    return torch.cat(outs, dim=axis)


def evaluate_as_flex(fn: Callable[..., Any], args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``fn(*args)`` evaluated the way flex evaluates a mod: once per element of the broadcast of
    ``args``, each call seeing 0-d tensors (``torch.vmap`` per axis, inside
    :func:`_compat.index_with_tensors` so that ``table[q_idx]`` indexes), as torch's eager
    ``flex_attention`` and ``create_mask`` do. Returns a tensor of the broadcast shape.

    The grid is cut along its longest axis into chunks of at most ``SCALAR_CHUNK_ELEMENTS``
    elements (or one row of that axis), so what the callable builds per element is bounded by the
    chunk, not by the grid. Differentiable (a score_mod's scores, tensors it captures).
    """
    shape = tuple(torch.broadcast_shapes(*(a.shape for a in args)))
    device = args[0].device
    if _numel(shape) == 0:  # nothing to call fn on: an empty result of the dtype flex would give
        floating = any(a.is_floating_point() for a in args)
        return torch.empty(shape, device=device, dtype=args[0].dtype if floating else torch.bool)
    padded = [a.reshape((1,) * (len(shape) - a.dim()) + tuple(a.shape)) for a in args]
    with _compat.index_with_tensors():
        return _evaluate_chunked(fn, padded, shape)


def _scalar_mask_mod(fn: Callable[..., Any]) -> MaskMod:
    """``fn`` as a mask_mod that flex's kernels call as is (0-d indices), and that index grids
    (the oracle, the ``dense`` route, the BlockMask builder, composites) evaluate as flex does."""

    # An index fn never reads is evaluated at one value (the result broadcasts over that dim).
    # Traced, every index is (Dynamo cannot read the function's bytecode; the values are the same).
    reads = (True,) * 4 if _compat.is_compiling() else tuple(_reads_argument_eagerly(fn, i) for i in range(4))

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        args = (b, h, q_idx, kv_idx)
        if _flex_scalars(args):
            return fn(*args)
        return evaluate_as_flex(
            fn, tuple(a if r else a.reshape(-1)[:1] for a, r in zip(args, reads, strict=True))
        )

    mask_mod.__name__ = getattr(fn, "__name__", "mask_mod")
    return mask_mod


def _scalar_score_mod(fn: Callable[..., Any]) -> ScoreMod:
    """:func:`_scalar_mask_mod` for a score_mod."""

    def score_mod(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        args = (score, b, h, q_idx, kv_idx)
        if _flex_scalars(args):
            return fn(*args)
        return evaluate_as_flex(fn, args)

    score_mod.__name__ = getattr(fn, "__name__", "score_mod")
    return score_mod


# ---------------------------------------------------------------------------------------------
# Probing a callable.

#: How torch's vmap words a mod that flex cannot run: Python control flow on a tensor's value.
_DATA_DEPENDENT = ("data-dependent control flow", ".item()")


def _probe_grids(device: torch.device) -> tuple[torch.Tensor, ...]:
    """Small broadcast index grids of distinct extents (2, 3, 4, 5: a mixed-up axis shows), all
    zero (in range for any captured table), int32 as flex's kernels pass them."""
    shapes = ((2, 1, 1, 1), (1, 3, 1, 1), (1, 1, 4, 1), (1, 1, 1, 5))
    return tuple(torch.zeros(shape, dtype=torch.int32, device=device) for shape in shapes)


#: :attr:`FunctionMask.hazards`; these five measured with torch 2.13's compiled CPU flex, also without
#: the library (tests/unit/test_scalar_callables.py has the callables;
#: benchmarks/flex_mod_hazards_probe.py runs torch alone). A reduction inside a mod, over a
#: captured row (``(starts <= q_idx).sum()``) or a 0-d value (``(q_idx - kv_idx).abs().amax()``),
#: fails to lower ("Buffers cannot be created while lowering a pointwise subgraph").
REDUCES = "reduces over a tensor (sum, any, amax...) inside the mod"
#: Reading a row the mod gathered itself (``table[q_idx][kv_idx]``, ``bounds[i][0]``,
#: ``lo, hi = bounds[i]``) compiles but reads out of bounds: "index out of bounds" at run time,
#: or a corrupted heap (the process aborts). The same values read with one index
#: (``table[q_idx, kv_idx]``, ``bounds[i, 0]``) run exactly.
READS_GATHERED_ROW = "reads from a row it gathered (x[i][j], lo, hi = x[i]; write x[i, j])"
#: ``torch.stack`` / ``torch.cat`` inside a mod fails to lower (an assertion on ``aten.cat``).
CONCATENATES = "joins tensors (torch.stack, torch.cat) inside the mod"
#: Any other op that is not element by element (``sort``, ``topk``, ``median``, ``cumsum``,
#: ``isin``...): ``median`` and ``topk`` fail to lower as reductions do; the rest are refused
#: alike rather than tried (an out-of-bounds read aborts the process).
SCANS = "sorts or scans a tensor (sort, topk, median, cumsum...) inside the mod"
#: ``torch.searchsorted`` / ``torch.bucketize`` of an index in a captured sorted tensor (a
#: document's number from its starts) is element by element, and fails to lower all the same
#: (torch 2.13 CPU: an unbacked-symbol ``LoweringException``; torch 2.11 CUDA: "Buffers cannot
#: be created while lowering a pointwise subgraph"). Searched once outside the mod, the result is
#: a table the mod reads with one index, which every kernel runs.
SEARCHES = (
    "searches a sorted tensor (torch.searchsorted, torch.bucketize) inside the mod; search once "
    "outside it (ids = torch.searchsorted(starts, torch.arange(L), right=True)) and read ids[q_idx]"
)

#: A ``torch.where`` whose condition and values come from ``b`` / ``h`` alone (a per-head value
#: picked by ``torch.where(h == k, slope_k, ...)``), in a mod for FA4's CuTe flex kernel
#: (``BACKEND="FLASH"``, flash-attn-4 4.0.0b36, torch 2.11, H100): such a value times an index
#: term (``slope * (q_idx - kv_idx)``) came out wrong, a silent error of order 1 in the output
#: (benchmarks/flex_flash_mod_ops_probe.py). The same value added to the score, or the
#: per-head value read from a captured table (``slopes[h]``), a sum of indicators
#: (``(h == k).float() * slope_k``) or a ``where`` between index terms, matched Triton flex; the
#: route refuses every such ``where`` rather than the products alone (what else the lowering
#: gets wrong is not known), and ``masked_fill`` / ``lerp`` with it (Inductor lowers both to a
#: ``where``). Triton flex and the CPU kernel run it exactly.
SELECTS_PER_HEAD = (
    "selects a per-head or per-batch value with torch.where (or masked_fill / lerp, which compile "
    "to it) from b or h alone, which FA4's CuTe kernel computes wrongly; read it from a captured "
    "table instead (slopes[h])"
)

#: A read of a captured tensor of one element (a 0-d offset, or a table whose every dim is 1),
#: in a mod for FA4's CuTe flex kernel (flash-attn-4 4.0.0b36, torch 2.11, H200): Inductor
#: loads it at a fixed index, spelled ``ssa_to_indexable(0, Int32)``, which the CuTe DSL rejects
#: while compiling ("Expected TensorSSA, but got <class 'int'>"). Tables indexed by ``q_idx`` /
#: ``kv_idx`` along a dim of two or more compile. Triton flex and the CPU kernel run it. User
#: functions are traced for it; the package's specs declare it (``reads_scalar_tensors``), and
#: the flex routes whose kernel has it refuse either.
LOADS_ONE_ELEMENT = (
    "reads a captured tensor of one element (0-d, or every dim 1: the offset of Band or of Causal "
    "between unequal lengths, a one-element Dense, BlockSelect table or Bias), which FA4's CuTe "
    "code generator cannot load (a function may capture a Python number instead)"
)

#: A function traced by ``torch.compile`` before an eager call could probe it (a raw callable
#: passed inside the compiled region, or a spec's function on its first, traced call) whose code
#: names ``where``, ``masked_fill`` or ``lerp``: it may make a :data:`SELECTS_PER_HEAD`, which
#: cannot be told from its code alone, so ``flex_flash`` refuses it (``flex`` runs it).
MAY_SELECT_PER_HEAD = (
    "may select a per-head or per-batch value with torch.where, masked_fill or lerp (traced before "
    "an eager call could check which), which FA4's CuTe kernel computes wrongly"
)

#: The hazards of each compiled flex kernel, by :attr:`FlexBackend.hazard_kernel`: torch's CPU
#: kernel (torch 2.13) has every one but :data:`SELECTS_PER_HEAD` and :data:`LOADS_ONE_ELEMENT`;
#: the CUDA (Triton) kernel (H100, torch 2.11, benchmarks/flex_mod_hazards_probe.py) fails to
#: lower a join and a search, and runs reductions and gathered rows exactly; FA4's CuTe kernel
#: (``flash``) has the Triton kernel's, :data:`SELECTS_PER_HEAD` (with
#: :data:`MAY_SELECT_PER_HEAD`) and :data:`LOADS_ONE_ELEMENT`.
CUDA_HAZARDS = frozenset({CONCATENATES, SEARCHES})
KERNEL_HAZARDS = {
    "cpu": frozenset({REDUCES, READS_GATHERED_ROW, CONCATENATES, SCANS, SEARCHES}),
    "cuda": CUDA_HAZARDS,
    "flash": CUDA_HAZARDS | {SELECTS_PER_HEAD, MAY_SELECT_PER_HEAD, LOADS_ONE_ELEMENT},
}

#: Attribute and global names of the selecting ops (:data:`MAY_SELECT_PER_HEAD`).
_SELECT_NAMES = frozenset({"where", "masked_fill", "masked_fill_", "lerp", "lerp_"})


def traced_hazards(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The hazards of a function that could not be probed, traced by ``torch.compile``: from its
    code alone (:data:`MAY_SELECT_PER_HEAD` where it or a function it reaches names a selecting
    op, or where what it reaches cannot be walked) and what it reaches (:data:`LOADS_ONE_ELEMENT`
    where that holds a tensor of one element). Traced, the walk runs at trace time outside the
    graph, its result a constant of it (no graph break); where it cannot
    (:func:`walkable_at_trace_time`), :data:`MAY_SELECT_PER_HEAD` alone."""
    if _compat.is_compiling():
        # Not walked in the graph (see walkable_at_trace_time); where it cannot be walked at
        # trace time either, nothing is looked into, and flex_flash refuses.
        return _walked_at_trace_time(fn) if walkable_at_trace_time(fn) else (MAY_SELECT_PER_HEAD,)
    return _walked_hazards(fn)


def walkable_at_trace_time(fn: Any) -> bool:
    """Traced: whether what ``fn`` reaches can be walked at trace time, outside the graph
    (:func:`_walked_at_trace_time`, :func:`_captures_grad_at_trace_time`). Never in the graph:
    reading a closure's cells there made Dynamo fail when it later inlined the same function
    ("Expected CellVariable, got UserDefinedObjectVariable in load_cell", torch 2.11 and 2.13; a
    raw mod over captured document ids or slopes), and torch 2.11's Dynamo cannot take ``id()``
    of a module or a float among the globals. At trace time: from torch 2.13 (2.11 raised
    NotImplementedError for the function argument; earlier versions take the conservative
    answers), and only for a function made outside the compiled region (Dynamo shows one made
    inside it no ``__closure__``, and cannot hand it to a trace-time call)."""
    if _compat.TORCH_VERSION < TRACE_TIME_WALK_SINCE:
        return False
    try:
        fn.__closure__  # noqa: B018 - the attribute's presence is the answer
    except AttributeError:
        return False
    return True


def _walked_hazards(fn: Callable[..., Any]) -> tuple[str, ...]:
    """:func:`traced_hazards` by walking what ``fn`` reaches (eagerly, or at trace time outside
    the graph)."""
    listed = _compat.global_names
    found: list[str] = []
    try:
        for value in _reachable(fn):
            if isinstance(value, torch.Tensor):
                if value.numel() == 1 and LOADS_ONE_ELEMENT not in found:
                    found.append(LOADS_ONE_ELEMENT)
            elif (
                MAY_SELECT_PER_HEAD not in found
                and isinstance(value, types.FunctionType)
                and not _SELECT_NAMES.isdisjoint(listed(value.__code__))
            ):
                found.append(MAY_SELECT_PER_HEAD)
    except AttributeError:  # a closure or globals it cannot read
        return (MAY_SELECT_PER_HEAD,)
    return tuple(found)


@torch.compiler.assume_constant_result
def _walked_at_trace_time(fn: Callable[..., Any]) -> tuple[str, ...]:
    """:func:`_walked_hazards`, which Dynamo calls at trace time instead of tracing it (see
    :func:`walkable_at_trace_time`). A function of its own: the decorator marks the function it
    is given."""
    return _walked_hazards(fn)


@torch.compiler.assume_constant_result
def _captures_grad_at_trace_time(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` reaches a tensor that requires grad, which Dynamo calls at trace time
    instead of tracing it (see :func:`walkable_at_trace_time`); True where its closure or globals
    cannot be read."""
    try:
        return any(t.requires_grad for t in captured_tensors(fn))
    except AttributeError:
        return True


#: The torch from which Dynamo runs :func:`_walked_at_trace_time` at trace time (2.13 does; 2.11
#: raised NotImplementedError for its function argument).
TRACE_TIME_WALK_SINCE = (2, 13)


def kernel_hazards(specs: tuple[Any, ...], kernel: str) -> tuple[str, ...]:
    """What compiled flex kernel ``kernel`` (a key of :data:`KERNEL_HAZARDS`: ``"cpu"``, ``"cuda"``
    for Triton, ``"flash"`` for FA4's CuTe kernel) cannot run in the user functions of ``specs``
    (mask / score specs or None): :meth:`Spec.flex_hazards` of each that the kernel has,
    each phrase once. The flex routes and ``decode_step`` refuse these."""
    found = dict.fromkeys(h for spec in specs if spec is not None for h in spec.flex_hazards())
    has = KERNEL_HAZARDS[kernel]
    return tuple(h for h in found if h in has)


_aten = torch.ops.aten
#: What ``torch.tensor`` / ``as_tensor`` in a call reach dispatch as (a view of the new tensor).
_LIFTS = frozenset({_aten.lift_fresh.default})
#: Ops that join tensors along a dimension (:data:`CONCATENATES`).
_JOINS = frozenset({_aten.cat.default, _aten.stack.default})
#: Ops not tagged pointwise that still act element by element on their tensor arguments (or
#: gather from a table at them), so one broadcast call computes what flex's 0-d calls do; the
#: compiled kernels lower them, but for the searches (``bucketize`` here, ``searchsorted`` where
#: its sorted sequence is not computed from the indices: :func:`_trace_ops`), :data:`SEARCHES`.
_ELEMENTWISE = frozenset(
    {
        _aten.index.Tensor,
        _aten._to_copy.default,
        _aten.copy_.default,
        _aten.lift_fresh_copy.default,
        _aten.scalar_tensor.default,
        _aten.where.Scalar,
        _aten.where.ScalarOther,
        _aten.where.ScalarSelf,
        _aten.floor_divide.default,
        _aten.bucketize.Tensor,
        _aten.zeros_like.default,
        _aten.ones_like.default,
        _aten.full_like.default,
        _aten.empty_like.default,
    }
)
_SEARCHSORTED = frozenset({_aten.searchsorted.Tensor, _aten.searchsorted.Scalar})
#: Ops that select between values by a condition, as ``where`` (``masked_fill`` and ``lerp`` reach
#: the compiled kernel as ``where``: Inductor decomposes them so).
_WHERES = frozenset(
    {
        _aten.where.self,
        _aten.where.self_out,
        _aten.where.Scalar,
        _aten.where.ScalarOther,
        _aten.where.ScalarSelf,
        _aten.masked_fill.Scalar,
        _aten.masked_fill.Tensor,
        _aten.masked_fill_.Scalar,
        _aten.masked_fill_.Tensor,
        _aten.lerp.Tensor,
        _aten.lerp.Scalar,
        _aten.lerp_.Tensor,
        _aten.lerp_.Scalar,
    }
)
#: Ops whose output takes only its input's shape and dtype, not its values: their outputs derive
#: from no argument's value (``torch.full_like(score, 0.5)`` is a constant).
_VALUE_FREE = frozenset(
    {
        _aten.zeros_like.default,
        _aten.ones_like.default,
        _aten.full_like.default,
        _aten.empty_like.default,
        _aten.new_zeros.default,
        _aten.new_ones.default,
        _aten.new_full.default,
        _aten.new_empty.default,
    }
)
_SEARCHES = _SEARCHSORTED | {_aten.bucketize.Tensor, _aten.bucketize.Scalar}


@dataclasses.dataclass(frozen=True)
class Probed:
    """What :func:`check_mask_function` / :func:`check_score_function` learned of a callable:
    whether it needs the scalar evaluation, and its hazards (:data:`REDUCES`,
    :data:`READS_GATHERED_ROW`, :data:`CONCATENATES`, :data:`SCANS`, :data:`SEARCHES`)."""

    scalar: bool
    hazards: tuple[str, ...]
    #: Whether the call read a tensor's value on the host (``bool()``, ``.item()``, ``.tolist()``,
    #: ``torch.equal`` on what it captures) or made a shape from one (``row[keep]``): its ops may
    #: then change with those values, so the verdict holds for these tensors only, not for every
    #: callable of the same structure (:func:`_structure`).
    reads_values: bool = False
    #: The ops the call ran at zero indices (:attr:`_Traced.signature`): a callable of the same
    #: structure takes this verdict only where its own call runs the same ops.
    signature: Hashable = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class _Traced:
    """What one call of a mod on 0-d indices did (:func:`_trace_ops`)."""

    hazards: tuple[str, ...]
    #: Whether an op that is not element by element read a value computed from the index (or
    #: score) arguments, or one of them with dimensions of its own (a gathered row): on
    #: broadcast grids that op spans or shifts the grid's dims, so only the scalar evaluation is
    #: exact (however the zero-index probe compares).
    whole_grid_op: bool
    #: Whether the call handed a tensor's values to Python or made a shape from them
    #: (:attr:`Probed.reads_values`).
    reads_values: bool
    #: Every op the call ran, in order, with its scalar arguments and the dtype and shape of each
    #: tensor it read or made, which of the arguments that tensor derives from, and whether it
    #: was made by the call: everything the hazards and ``whole_grid_op`` are read from.
    signature: Hashable = None


def _flat_tensors(values: Any) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from _flat_tensors(value)


def _elementwise(op: Any, op_args: tuple[Any, ...], derived: Container[int]) -> bool:
    """Whether ``op`` acts element by element on its arguments (see :data:`_ELEMENTWISE`)."""
    if torch.Tag.pointwise in op.tags or op.is_view or op in _ELEMENTWISE:
        return True
    if op in _SEARCHSORTED:
        return not (isinstance(op_args[0], torch.Tensor) and id(op_args[0]) in derived)
    return False


def _trace_ops(fn: Callable[..., Any], args: tuple[torch.Tensor, ...]) -> _Traced:
    """Call ``fn`` once on 0-d ``args`` (what flex's compiled kernel traces: ``b, h, q_idx,
    kv_idx``, after ``score`` for a score mod) and list what it does that a compiled flex kernel
    mishandles (:data:`REDUCES`, :data:`CONCATENATES`, :data:`SCANS`: an op that is not element
    by element; :data:`SEARCHES`: a search of a sorted tensor; :data:`READS_GATHERED_ROW`: an op
    whose input is a tensor of more than one element that the call itself made, a gathered row
    or a view of one; :data:`SELECTS_PER_HEAD`: a ``where`` computed from ``b`` / ``h`` alone;
    :data:`LOADS_ONE_ELEMENT`: an op that reads, or a result that is, a captured tensor of one
    element or a view of one).
    Also follows which of ``args`` each tensor derives from (through the ops' positional and
    keyword arguments), for those and for :attr:`_Traced.whole_grid_op`."""
    found: list[str] = []
    made: list[torch.Tensor] = []  # kept alive, so their storages' addresses and ids stay theirs
    made_storages: set[int] = set()
    # Which arguments (by position) each tensor derives from; ``b`` and ``h`` come last but two.
    sources: dict[int, frozenset[int]] = {id(a): frozenset({i}) for i, a in enumerate(args)}
    derived = sources.keys()
    batch_or_head = frozenset({len(args) - 4, len(args) - 3})
    whole_grid = [False]
    reads_values = [False]
    signature: list[Hashable] = []

    def note(hazard: str) -> None:
        if hazard not in found:
            found.append(hazard)

    def captured_one_element(t: torch.Tensor) -> bool:
        """Whether ``t`` is a captured tensor of one element, or a view of a captured tensor
        (neither derived from the arguments nor made by the call) with one element."""
        return t.numel() == 1 and id(t) not in derived and t.untyped_storage().data_ptr() not in made_storages

    def on_op(op: Any, op_args: tuple[Any, ...], out: Any) -> None:
        inputs = list(_flat_tensors(op_args))
        if not op.is_view and any(captured_one_element(t) for t in inputs):
            note(LOADS_ONE_ELEMENT)
        from_args = [t for t in inputs if id(t) in derived]
        read = frozenset().union(*(sources[id(t)] for t in from_args))
        elementwise = _elementwise(op, op_args, derived)
        if not elementwise and inputs:
            note(REDUCES if torch.Tag.reduction in op.tags else CONCATENATES if op in _JOINS else SCANS)
        elif op in _SEARCHES:
            note(SEARCHES)
        elif op in _WHERES and read and read <= batch_or_head:
            note(SELECTS_PER_HEAD)
        # A non-pointwise op on a derived value with dims of its own (``row[0]``, ``row[kv_idx]``
        # for a gathered ``row``) reads another dim of the grid in a broadcast call.
        pointwise = torch.Tag.pointwise in op.tags
        if from_args and (not elementwise or (not pointwise and any(t.dim() for t in from_args))):
            whole_grid[0] = True
        first = op_args[0] if op_args else None
        if (
            elementwise
            and isinstance(first, torch.Tensor)
            and first.numel() > 1
            and first.untyped_storage().data_ptr() in made_storages
        ):
            note(READS_GATHERED_ROW)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if any(not isinstance(o, torch.Tensor) for o in outs) or _shape_from_values(op, op_args):
            reads_values[0] = True
        signature.append(
            (op, tuple(_op_arg_token(a, sources, made_storages) for a in op_args), _op_out_token(outs))
        )
        for t in _flat_tensors(outs):
            made.append(t)
            if from_args:
                # Still derived (on broadcast grids it has the grid's shape), from no value.
                sources[id(t)] = frozenset() if op in _VALUE_FREE else read
            if not op.is_view or op in _LIFTS:  # torch.tensor(...) in the call: made by it
                made_storages.add(t.untyped_storage().data_ptr())

    host_reads = _HostReads()
    try:
        with host_reads, _compat.index_with_tensors(), _compat.recording_mode(on_op):
            result = fn(*args)
    except Exception:  # noqa: BLE001 - the vmap probe ran it; nothing more to learn here
        return _Traced((), False, True)
    if any(captured_one_element(t) for t in _flat_tensors((result,))):
        note(LOADS_ONE_ELEMENT)  # returned as it is: the kernel loads it
    return _Traced(tuple(found), whole_grid[0], reads_values[0] or host_reads.seen, tuple(signature))


def _op_arg_token(value: Any, sources: dict[int, frozenset[int]], made_storages: set[int]) -> Hashable:
    """One argument of an op in :attr:`_Traced.signature`."""
    if isinstance(value, torch.Tensor):
        made = value.untyped_storage().data_ptr() in made_storages
        return (value.dtype, tuple(value.shape), sources.get(id(value)), made)
    if isinstance(value, (tuple, list)):
        return tuple(_op_arg_token(v, sources, made_storages) for v in value)
    if isinstance(value, float):
        return repr(value)
    try:
        hash(value)
    except TypeError:
        return object()  # equal to nothing: a callable whose ops take one is probed in full
    return value


def _op_out_token(outs: Any) -> Hashable:
    return tuple(
        (o.dtype, tuple(o.shape)) if isinstance(o, torch.Tensor) else (type(o), repr(o)) for o in outs
    )


#: Tensor methods that hand a tensor's values to Python (some reach no ATen op: ``tolist``).
_TO_PYTHON = frozenset(
    {
        torch.Tensor.tolist,
        torch.Tensor.numpy,
        torch.Tensor.item,
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__float__,
        torch.Tensor.__index__,
        torch.Tensor.__complex__,
        torch.Tensor.__array__,
        torch.Tensor.__repr__,
        torch.Tensor.__format__,
    }
)


class _HostReads(torch.overrides.TorchFunctionMode):
    """Notes whether a call hands a tensor's values to Python (:attr:`Probed.reads_values`)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _TO_PYTHON:
            self.seen = True
        return func(*args, **(kwargs or {}))


def _shape_from_values(op: Any, op_args: tuple[Any, ...]) -> bool:
    """Whether ``op``'s output shape depends on its inputs' values (``t[mask]``, ``nonzero``,
    ``unique``): gathering by integer indices (``aten.index`` is tagged so) does not."""
    if torch.Tag.dynamic_output_shape not in op.tags:
        return False
    if op is not _aten.index.Tensor:
        return True
    return any(t.dtype in (torch.bool, torch.uint8) for t in _flat_tensors(op_args[1:]))


def _probe(fn: Callable[..., Any], arg: str, grids: tuple[torch.Tensor, ...], *, score: bool) -> Probed:
    """Run ``fn`` on ``grids`` as flex does and by one broadcast call: whether it needs the
    scalar evaluation, and its hazards. TypeError when flex could not run it either (naming
    ``arg``)."""
    zeros = tuple(g.reshape(-1)[0] for g in grids)  # 0-d, as flex's kernel passes them
    scalar = _needs_scalar(fn, arg, grids, score=score)
    traced = _trace_ops(fn, zeros)
    return Probed(scalar or traced.whole_grid_op, traced.hazards, traced.reads_values, traced.signature)


def _fits(shape: torch.Size, full: torch.Size) -> bool:
    """Whether a result of ``shape`` broadcasts to the grids' ``full`` shape without growing it."""
    try:
        return torch.broadcast_shapes(shape, full) == full
    except RuntimeError:
        return False


def _needs_scalar(fn: Callable[..., Any], arg: str, grids: tuple[torch.Tensor, ...], *, score: bool) -> bool:
    """See :func:`_probe`."""
    full = torch.broadcast_shapes(*(g.shape for g in grids))
    kind = "floating tensor (the new score)" if score else "bool tensor (e.g. q_idx >= kv_idx)"

    def result_ok(out: Any) -> bool:
        if score:
            return isinstance(out, torch.Tensor) and out.dtype.is_floating_point
        return isinstance(out, torch.Tensor) and out.dtype == torch.bool

    def refuse_result(out: Any) -> TypeError:
        got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        return TypeError(f"{arg} callable must return a {kind}, got {got}")

    try:
        broadcast = fn(*grids)
        broadcast_error: Exception | None = None
    except Exception as exc:  # noqa: BLE001 - a broadcast failure only selects the scalar evaluation
        broadcast, broadcast_error = None, exc
    try:
        scalar = evaluate_as_flex(fn, grids)
    except Exception as exc:  # noqa: BLE001 - the user's function failed as flex calls it: say why
        text = str(exc)
        if isinstance(exc, TypeError) and "one value per" in text:
            raise TypeError(f"{arg} callable: {text}") from exc
        if broadcast_error is None and result_ok(broadcast) and _fits(broadcast.shape, full):
            return False  # runs on the grids as before (e.g. an op vmap has no rule for)
        if any(marker in text for marker in _DATA_DEPENDENT):
            raise TypeError(
                f"{arg} callable uses data-dependent Python control flow (Python if/while/and/or/not, "
                "bool(), int() or .item() on a value computed from b, h, q_idx, kv_idx), which flex "
                "rejects too: it calls the mod on 0-d index tensors under torch.vmap or "
                "torch.compile, where such a value has no Python truth value. Write the choice with "
                f"tensor ops (torch.where, &, |, ~); torch said: {text.splitlines()[0]}"
            ) from exc
        dtensor = _compat.dtensor_class()
        if dtensor is not None and any(isinstance(t, dtensor) for t in captured_tensors(fn)):
            raise TypeError(
                f"{arg} callable captures a DTensor; mask and score callables index plain tensors of "
                "the whole call (a DTensor call re-bases the indices to each shard): capture "
                f"t.full_tensor() instead (the same on every rank); torch said: {text.splitlines()[0]}"
            ) from exc
        raise TypeError(
            f"{arg} callable failed when called as flex calls it (0-d int index tensors, under "
            f"torch.vmap): {exc!r}"
        ) from exc
    if not result_ok(scalar):
        raise refuse_result(scalar)
    if broadcast_error is not None or not result_ok(broadcast):
        return True
    try:
        same = torch.equal(torch.broadcast_to(broadcast, full), scalar.to(broadcast.dtype))
    except RuntimeError:  # a wrong shape (e.g. table[q_idx][kv_idx] on grids)
        return True
    return not same


def captured_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor a user callable can read besides its arguments (the walk of
    :func:`capture_state`): where its tables live (:func:`_captured_device`) and whether it
    captures learnable tensors (``ScoreSpec.captures_grad_tensors``: the call needs a backward)."""
    return [v for v in _reachable(obj) if isinstance(v, torch.Tensor)]


def _captured_device(fn: Callable[..., Any]) -> torch.device:
    """Where ``fn``'s captured tensors live (:func:`captured_tensors`): the device of the first
    non-CPU one, else the CPU. The probe indexes those tensors (``doc_ids[q_idx]``), and a CUDA
    table cannot be indexed with CPU indices."""
    for t in captured_tensors(fn):
        if t.device.type != "cpu":
            return t.device
    return torch.device("cpu")


#: Probe verdicts per (callable, :func:`capture_state`): a model calling ``fz.attention`` with the
#: same callable and new shapes (a plan cache miss) probes it once (a few ms: the vmap call).
PROBED: LRUCache[Probed] = LRUCache(256)
#: Probe verdicts per callable structure (:func:`_structure`): a training or generation loop that
#: builds its mask function (or its spec) anew every step, over new tensors of the same shapes,
#: probes it once rather than every step.
PROBED_STRUCTURES: LRUCache[Probed] = LRUCache(256)


def _probed(
    fn: Callable[..., Any], kind: str, probe: Callable[[], Probed], ops: Callable[[], Hashable]
) -> Probed:
    """``probe()``'s verdict on ``fn``, from :data:`PROBED` or :data:`PROBED_STRUCTURES` where it
    holds; a verdict by structure is taken only where ``ops()`` (``fn``'s call at zero indices,
    :attr:`_Traced.signature`, None where it failed or read values) is the probed callable's."""
    if _compat.is_compiling():
        return probe()
    state = capture_state(fn, learned_versions=kind == "mask")
    key = (kind, _Ref(fn), state)
    found = PROBED.get(key)
    if found is not None:
        return found
    # The invalidation epochs take part: after ``fz.invalidate`` a callable is probed again.
    structure = _structure(fn, state[:2] if isinstance(state, tuple) else state)
    if structure is not None:
        found = PROBED_STRUCTURES.get((kind, structure))
        if found is not None and found.signature is not None and ops() == found.signature:
            return PROBED.put(key, found)
    probed = PROBED.put(key, probe())
    if structure is not None and not probed.reads_values:
        PROBED_STRUCTURES.put((kind, structure), probed)
    return probed


class _Absent:
    """An empty closure cell, or a global name a function loads that its module lacks."""


_ABSENT = _Absent()
_TORCH_VALUES = (
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    type(_aten.add.Tensor),
    type(_aten.add),
)


def _from_library(module: str | None) -> bool:
    """Whether ``module`` is torch's, this package's or one of Python's own that mods call."""
    if not module:
        return False
    return module in ("torch", "builtins", "math", "operator", "flexattn_zoo") or module.startswith(
        ("torch.", "flexattn_zoo.")
    )


def _structure_token(value: Any) -> tuple[Hashable, list[Any]] | None:
    """``(token, children)`` of one value of the walk of :func:`_structure`, or None where the
    value cannot be keyed by its structure. Only what is listed here is keyed; everything else
    (an object's attributes, a class's, a bound method's ``self``, a user module, a NumPy array)
    makes the callable unkeyed, probed per value as before. Tokens hold no reference to the
    user's objects (tensors by their layout only), so a cached key keeps nothing alive."""
    if value is _ABSENT:
        return ("absent",), []
    if isinstance(value, torch.Tensor):
        # A subclass may carry state of its own (a DTensor's placements); a nested tensor has no
        # one shape.
        if (
            type(value) not in (torch.Tensor, torch.nn.Parameter)
            or value.layout != torch.strided
            or value.is_nested
        ):
            return None
        token = (type(value), value.dtype, value.device, value.requires_grad, tuple(value.shape))
        return (*token, value.stride(), value.storage_offset()), []
    if isinstance(value, types.FunctionType):
        if value.__dict__:
            return None  # attributes a call may read (``fn.table``)
        module = sys.modules.get(value.__module__ or "")
        if (
            value.__closure__ is None
            and _from_library(value.__module__)
            and value.__globals__ is getattr(module, "__dict__", None)
        ):
            return ("library", value), []  # module-level and long-lived: by identity
        code = value.__code__
        cells = []
        for cell in value.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # an empty cell
                cells.append(_ABSENT)
        names = value.__globals__
        loaded = [names.get(n, _ABSENT) for n in _compat.global_names(code)]
        return ("function", code), [*cells, value.__defaults__, value.__kwdefaults__, *loaded]
    if isinstance(value, functools.partial):
        return ("partial", len(value.args), tuple(value.keywords)), [
            value.func,
            *value.args,
            *value.keywords.values(),
        ]
    if type(value) in (tuple, list):  # not subclasses: their own state is not walked
        return (type(value), len(value)), list(value)
    if type(value) is dict:
        if not all(isinstance(k, (str, int, bool)) for k in value):
            return None
        return (dict, tuple(value)), list(value.values())
    if isinstance(value, types.ModuleType):
        return (("module", value.__name__), []) if _from_library(value.__name__) else None
    if isinstance(value, types.BuiltinFunctionType):
        owner = value.__self__
        return (("builtin", value), []) if owner is None or isinstance(owner, types.ModuleType) else None
    if isinstance(value, type):
        return (("type", value), []) if _from_library(value.__module__) else None
    if isinstance(value, _TORCH_VALUES):
        return ("value", value), []
    return None


def _structure(fn: Callable[..., Any], epochs: Hashable) -> Hashable | None:
    """What decides the probe's verdict on ``fn``, or None where it cannot be told (see
    :func:`_structure_token` for what is keyed): the code of every function ``fn`` reaches
    (through closure cells, defaults, the globals it loads, ``functools.partial``), the scalars and
    containers among those by value, and the dtype, device, shape and strides of every tensor, but
    not the tensors' values; with ``epochs`` (those of :func:`invalidate`). The verdict (which ops
    run, whether a broadcast call computes what flex's 0-d calls compute) does not depend on the
    values unless the function reads one on the host or makes a shape from one
    (:attr:`Probed.reads_values`), which the probe notices. None past :data:`WALK_LIMIT`."""
    tokens: list[Hashable] = [epochs]
    first_seen: dict[int, int] = {}
    keep: list[Any] = []  # what the walk reaches stays alive during it, so ids stay unique
    stack: list[Any] = [fn]
    while stack:
        if len(tokens) >= WALK_LIMIT:
            return None
        value = stack.pop()
        if value is None or isinstance(value, (str, bytes, int, bool)):
            tokens.append((type(value), value))
            continue
        if isinstance(value, (float, complex)):
            tokens.append((type(value), repr(value)))  # -0.0 is not 0.0
            continue
        seen = first_seen.get(id(value))
        if seen is not None:
            tokens.append(("again", seen))
            continue
        first_seen[id(value)] = len(tokens)
        keep.append(value)
        found = _structure_token(value)
        if found is None:
            return None
        token, children = found
        tokens.append(token)
        stack.extend(reversed(children))
    return tuple(tokens)


def check_mask_function(fn: Callable[..., Any], arg: str = "mask") -> Probed:
    """Reject a callable that is not a valid ``mask_mod`` with a TypeError naming ``arg``; return
    whether it needs the scalar (flex-style) evaluation on index grids and its hazards
    (``FunctionMask.scalar`` / ``.hazards``)."""
    _check_signature(fn, arg, "mask_mod", "b, h, q_idx, kv_idx", "bool", 4)
    return _probed_function(fn, "mask", arg)


def check_score_function(fn: Callable[..., Any], arg: str = "score_mod") -> Probed:
    """Reject a callable that is not a valid ``score_mod`` with a TypeError naming ``arg``; return
    what :func:`check_mask_function` returns (``FunctionScore.scalar`` / ``.hazards``)."""
    _check_signature(fn, arg, "score_mod", "score, b, h, q_idx, kv_idx", "score", 5)
    return _probed_function(fn, "score", arg)


def _probed_function(fn: Callable[..., Any], kind: str, arg: str) -> Probed:
    """The probe's verdict on a ``kind`` (``"mask"`` / ``"score"``) function, cached."""

    def probe() -> Probed:
        grids = _probe_grids(_captured_device(fn))
        if kind == "mask":
            return _probe(fn, arg, grids, score=False)
        score = torch.zeros(torch.broadcast_shapes(*(g.shape for g in grids)), device=grids[0].device)
        return _probe(fn, arg, (score, *grids), score=True)

    def ops_at_zero() -> Hashable:
        """The ops ``fn`` runs at all-zero 0-d indices (a fraction of the probe's cost), or None where
        that call fails (a new value read out of range: the full probe names the error) or reads
        values on the host."""
        device = _captured_device(fn)
        zeros = [torch.zeros((), dtype=torch.int32, device=device) for _ in range(4)]
        if kind == "score":
            zeros.insert(0, torch.zeros((), device=device))
        traced = _trace_ops(fn, tuple(zeros))
        return None if traced.reads_values else traced.signature

    return _probed(fn, kind, probe, ops_at_zero)


def _spec_function_check(kind: str) -> FunctionCheck:
    """:data:`flexattn_zoo.spec.FUNCTION_CHECKS` for a ``kind`` function written outside the
    package: probed as a raw callable is, evaluated as flex does where the probe found a
    broadcast call wrong or failing."""

    def probe(fn: Callable[..., Any], owner: str) -> tuple[bool, tuple[str, ...]]:
        probed = _probed_function(fn, kind, f"{owner}'s {kind}_mod")
        return probed.scalar, probed.hazards

    return FunctionCheck(
        probe=probe,
        as_flex=_scalar_mask_mod if kind == "mask" else _scalar_score_mod,
        traced_hazards=traced_hazards,
    )


FUNCTION_CHECKS.update(mask=_spec_function_check("mask"), score=_spec_function_check("score"))
