"""Base classes for mask and score specs, and their algebra.

Conventions shared by every spec:

* Positions are absolute: query ``i`` in ``[0, Lq)`` and key ``j`` in ``[0, Lkv)``.
* A spec is a frozen, hashable, keyword-only dataclass. Equal parameters give equal specs and the
  *same* ``mask_mod`` / ``score_mod`` function object, so compiled kernels and BlockMasks are reused.
  Tensor parameters (document ids, per-batch prefix lengths) compare by value and hash by shape,
  dtype and a content fingerprint. The spec *owns* them: each is copied (``detach().clone()``, on
  its device, asynchronously) when the spec is built, so writing in place to the tensor you passed
  never changes a spec, nor anything cached for it. Tensors that require grad (learned biases) are
  the exception: kept as given, compared by identity, also after they are frozen (decided the first
  time a spec is given the tensor, not by its flag at each comparison). The tensors a spec holds (``spec.tensors()``,
  ``Document.doc_ids``) are its own: read them, never write to them.
* Specs wrapping raw callables (:mod:`flexattn_zoo.functions`) cannot own what the callable
  captures; they record its identity and the version counters of the tensors it captures, and
  :meth:`Spec.live` re-reads them (``fz.attention`` and ``fz.block_mask`` do on every call).
* ``MaskSpec.dense(q_len, kv_len)`` is the independent oracle: a boolean ``[B|1, H|1, Lq, Lkv]``
  tensor written without calling ``mask_mod``. It materializes ``Lq x Lkv``: it is for tests and
  the reference only.
* ``ScoreSpec.dense(scores)`` rewrites a dense float64 ``[B, H, Lq, Lkv]`` tensor of *scaled*
  scores, again written independently of ``score_mod``.

Masks compose with ``a & b``, ``a | b`` and ``~a``. Score specs chain with ``a >> b``: ``a`` is
applied first, then ``b`` (function composition read left to right).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import weakref
from collections.abc import Callable, Hashable
from typing import Any, ClassVar, TypeVar

import torch

from flexattn_zoo import _compat
from flexattn_zoo.lru import LRUCache

if sys.version_info >= (3, 11):
    from typing import Self, dataclass_transform
else:  # typing_extensions: a dependency of torch, declared for 3.10 in pyproject
    from typing_extensions import Self, dataclass_transform

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: Upper bound on cached mod functions; old entries are dropped least-recently-used first.
MOD_CACHE_SIZE = 1024


_SpecT = TypeVar("_SpecT")
_ModT = TypeVar("_ModT")


#: Spec classes seen holding a tensor when built under ``torch.inference_mode``: built outside it
#: from then on (see ``spec_dataclass``).
_HOLDS_TENSORS: set[type] = set()
#: Per spec class whose instance built without arguments holds only its fields, each a plain
#: value, and what settling derived from them (``_copyable``): that instance's attributes right
#: after it was built and settled (``spec_dataclass``'s ``build``).
_BARE_SETTLED: dict[type, dict[str, Any]] = {}


def _holds_inference_tensor(spec: Any) -> bool:
    return any(t.is_inference() for value in vars(spec).values() for t in _tensors_in(value))


# dataclass_transform tells type checkers the fields are the class's annotated attributes.
@dataclass_transform(kw_only_default=True, frozen_default=True, eq_default=False)
def spec_dataclass(cls: type[_SpecT]) -> type[_SpecT]:
    """Decorator: a frozen keyword-only dataclass whose equality/hash come from :class:`Spec`.

    Its ``__init__`` ends by taking ownership of the spec's tensor parameters (see
    :func:`_take_ownership`): after construction, nothing the caller does to the tensors it passed
    can change the spec.
    """
    klass = dataclasses.dataclass(frozen=True, kw_only=True, eq=False, repr=True)(cls)
    init = klass.__init__

    def build(self: Any, compiling: bool, *args: Any, **kwargs: Any) -> None:
        bare = not args and not kwargs and not compiling
        if bare:
            # A spec without arguments (``Causal()``, often built per call): every such spec of
            # the class is the first one, settled (see _settle_plain), so it starts as a copy.
            settled = _BARE_SETTLED.get(type(self))  # (a subclass may inherit this __init__)
            if settled is not None:
                self.__dict__.update(settled)
                return
        elif kwargs:
            _refuse_dtensors(klass.__name__, kwargs)
        init(self, *args, **kwargs)  # the class's own __post_init__ (checks, conversions) runs in here
        if compiling or not _settle_plain(self):
            _take_ownership(self)
        elif bare and _copyable(self):
            _BARE_SETTLED[type(self)] = dict(self.__dict__)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        compiling = _compat.is_compiling()
        inference = not compiling and torch.is_inference_mode_enabled()
        if inference and type(self) in _HOLDS_TENSORS:
            # Not as inference tensors: caches keyed by the spec's value hand its tensors (and
            # what __post_init__ derives from them) to later calls, training ones too.
            _compat.outside_inference_mode(lambda: build(self, compiling, *args, **kwargs))
        else:
            build(self, compiling, *args, **kwargs)
            if inference and _holds_inference_tensor(self):
                # Built again outside inference mode; and so from now on for this class (leaving
                # inference mode costs microseconds a spec without tensors need not pay).
                _HOLDS_TENSORS.add(type(self))
                _compat.outside_inference_mode(lambda: build(self, compiling, *args, **kwargs))
        if compiling:
            # Made inside a graph being traced: see graph_memo.
            object.__setattr__(self, "_graph_memo", {})

    klass.__init__ = __init__  # type: ignore[method-assign]
    return klass


# ---------------------------------------------------------------------------------------------
# Tensor ownership.
#
# Every cache of the library is keyed by spec *value*: the mod cache, BlockMasks, plans, flex
# calls, varlen offsets and layouts, and the spec's own hash (cached) and per-instance caches. A
# spec that kept the caller's tensor changed value whenever the caller wrote to that tensor in
# place, behind the back of every one of them: stale BlockMasks next to a live mask_mod, and, with
# a buffer refilled in place and a new spec built each step, an earlier step's mask whenever the
# two layouts' content hashes collided (equality short-circuits on ``a is b``, and both specs held
# the same buffer). So a spec owns its tensors: each is copied when the spec is built.


#: Tensors owned by some spec, by id (weakly): wrapping one in another spec (``dataclasses.replace``,
#: ``Spec.to``, ``bind``) needs no second copy, since no spec's tensor is ever written to.
_OWNED: dict[int, weakref.ref[torch.Tensor]] = {}
#: Tensors some spec keeps as the caller's own object (they required grad when first given to a
#: spec), by id (weakly). Such a tensor stays the caller's for good: freezing it later
#: (``requires_grad_(False)``, ``model.requires_grad_(False)``) does not turn it into a value the
#: caller cannot write to, so it is never copied, and specs keep comparing it by identity.
_BORROWED: dict[int, weakref.ref[torch.Tensor]] = {}


def _remember(table: dict[int, weakref.ref[torch.Tensor]], t: torch.Tensor) -> torch.Tensor:
    """Add ``t`` to ``table`` (``_OWNED`` or ``_BORROWED``) until it is collected."""
    key = id(t)

    def forget(ref: weakref.ref[torch.Tensor]) -> None:
        if table.get(key) is ref:
            table.pop(key, None)

    table[key] = weakref.ref(t, forget)
    return t


def _mark_owned(t: torch.Tensor) -> torch.Tensor:
    if _compat.is_compiling():
        return t  # a spec built in a traced graph: its tensors are graph values, nobody else's
    return _remember(_OWNED, t)


def _listed(table: dict[int, weakref.ref[torch.Tensor]], t: torch.Tensor) -> bool:
    ref = table.get(id(t))
    return ref is not None and ref() is t


def _is_owned(t: torch.Tensor) -> bool:
    if _compat.is_compiling():
        return False
    return _listed(_OWNED, t)


def _is_callers(t: torch.Tensor) -> bool:
    """Whether ``t``, a tensor a spec holds, is the caller's own object (a learned tensor), which
    the caller may write to: compared by identity, never by value (see ``_values_equal``).

    Decided when the spec was built (``_owned`` copies every other tensor), not by the tensor's
    current ``requires_grad``: a parameter frozen after the spec was built is still written in
    place (``load_state_dict``), so two layers' frozen, equal-valued parameters must not become
    equal specs sharing one cached score_mod and plan. While ``torch.compile`` traces (nothing is
    recorded there) the flag decides; so it does for a spec made in a traced graph and returned
    from it, whose tensors are graph values, neither copied nor kept as the caller's."""
    if _compat.is_compiling():
        return t.requires_grad
    return t.requires_grad or _listed(_BORROWED, t)


def _owned(value: Any) -> Any:
    """``value`` with every tensor in it (also inside tuples and lists) replaced by a private copy.

    A copy is a ``detach().clone()`` on the same device, contiguous: asynchronous on CUDA (no host
    sync). Not copied: tensors that require grad (learned parameters must stay the caller's
    tensor, which the optimizer updates; specs compare them by identity, see ``_values_equal``),
    tensors some spec already kept so (also once frozen: a spec rebuilt from another, by
    ``dataclasses.replace`` or ``Spec.live``, keeps the parameter live), and tensors some spec
    already owns.
    """
    if isinstance(value, torch.Tensor):
        if _is_owned(value):
            return value
        if _compat.is_compiling():
            if value.requires_grad:
                return value
        elif _listed(_BORROWED, value):
            return value  # kept as the caller's already (a learned tensor, maybe frozen since)
        elif value.requires_grad:
            return _remember(_BORROWED, value)
        return _mark_owned(value.detach().clone(memory_format=torch.contiguous_format))
    if isinstance(value, (tuple, list)) and any(isinstance(v, (torch.Tensor, tuple, list)) for v in value):
        items = [_owned(v) for v in value]
        if any(a is not b for a, b in zip(items, value, strict=True)):
            return type(value)(items)
    return value


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in a field's value (also inside tuples and lists), in a fixed order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors_in(v)]
    return []


def _adopt(value: Any, callers: tuple[bool, ...] = ()) -> None:
    """Record the tensors in a field's ``value`` as its spec's own, without copying them: for
    tensors only the spec can reach (unpickled or deep-copied ones). ``callers`` flags, in
    :func:`_tensors_in` order, those the original spec held as the caller's (learned tensors,
    also frozen ones): they stay so, as do tensors that require grad."""
    if _compat.is_compiling():
        return
    for i, t in enumerate(_tensors_in(value)):
        learned = t.requires_grad or (i < len(callers) and callers[i])
        _remember(_BORROWED if learned else _OWNED, t)


def _refuse_dtensors(owner: str, fields: dict[str, Any]) -> None:
    """``ValueError`` for a DTensor among a spec's arguments, before the spec reads it: a spec's
    tensors hold the whole call, indexed by its global batch rows and heads (a DTensor call runs
    each shard with them re-based, ``compose.on_shard``), and reading a sharded one would mix it
    with the kernels' plain tensors or run collectives. Decided from types alone, so every rank
    raises alike."""
    dtensor = _compat.dtensor_class()
    if dtensor is None:
        return  # nothing imported DTensor: no argument can be one
    for name, value in fields.items():
        if type(value) in _PLAIN_TYPES:
            continue  # a number, string or None (most parameters): no tensor inside
        if any(isinstance(t, dtensor) for t in _tensors_in(value)):
            raise ValueError(
                f"{owner}({name}=...) is a DTensor; specs take plain tensors of the whole call (a "
                "DTensor call re-bases them to each shard's batch rows and heads): pass "
                f"{name}.full_tensor() (the same on every rank)"
            )


#: What ``_settle_plain`` writes beside the plain key: a spec of plain parameters holds no
#: callable, no learned tensor and no other spec.
_SETTLED_ANSWERS = {
    "_holds_callables_value": False,
    "_holds_learned_value": False,
    "_parts_may_have_hazards_value": False,
}
#: Every attribute ``_settle_plain`` writes into a spec's ``__dict__``.
_SETTLED_CACHES = frozenset({"_plain_key_value", *_SETTLED_ANSWERS})


def _copyable(spec: Any) -> bool:
    """Whether a spec built without arguments and settled (its fields all plain values:
    ``_settle_plain``) may be copied into later ones of its class: it holds nothing but its fields
    and what settling wrote. Anything else a ``__post_init__`` made (a tensor, a memo dict, a
    value read from the process's state) is made anew for every spec instead: copies would share
    it, or keep it past a change to what it was read from."""
    fields = _field_names(spec)
    return all(name in _SETTLED_CACHES or name in fields for name in spec.__dict__)


def _settle_plain(spec: Any) -> bool:
    """For a freshly built spec whose parameters are all Python numbers, strings or None (a
    ``Causal()`` or ``SlidingWindow(left=...)`` built anew for every call), fill in at once what
    its first use would otherwise work out field by field: its plain key, and that it holds no
    callable and no learned tensor (nor any tensor to own). Returns whether it did. Eager calls
    only: a spec built while torch.compile traces leaves its per-instance caches alone."""
    cls = type(spec)
    if cls._fields is not Spec._fields:
        return False  # the class compares more than its parameters (e.g. the device it is bound to)
    values = spec.__dict__
    names = _FIELD_NAMES.get(cls)
    params = [values.get(name) for name in (_field_names(spec) if names is None else names)]
    for value in params:
        if type(value) not in _PLAIN_TYPES:
            return False
    values["_plain_key_value"] = (cls, *params)
    values.update(_SETTLED_ANSWERS)
    return True


def _take_ownership(spec: Any) -> None:
    """Replace every tensor field of a freshly built spec by a copy the spec owns (see ``_owned``).

    Runs after the class's ``__post_init__``, so tensors it derived from the arguments (a dtype
    conversion, a view, ``torch.as_tensor`` of a NumPy array, which shares its memory) are covered
    as well as the arguments themselves. Nested specs own their tensors already.
    """
    values = spec.__dict__
    for name in _field_names(spec):
        value = values.get(name)
        if value is None or isinstance(value, (bool, int, float, str)):
            continue  # the common parameters: nothing to own
        owned = _owned(value)
        if owned is not value:
            object.__setattr__(spec, name, owned)


#: Where ``Spec.__getstate__`` lists which tensors of each field are the caller's.
_CALLERS_STATE = "_callers_of_fields"

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fingerprint(t: torch.Tensor) -> int:
    """A content hash of ``t`` (one small reduction, one device sync).

    Spec hashes include it so that specs holding different tensors of one shape (a new Document
    every training step) land in different hash buckets: with shape-only hashes every cache
    lookup compared the new ids against every cached one (a device sync each). Floats are
    reinterpreted as integers so the sum is exact and order-independent.
    """
    if t.device.type == "meta":
        return 0  # no data to read; equality still decides
    flat = t.detach().reshape(-1)
    if flat.is_floating_point() or flat.is_complex():
        flat = flat.contiguous().view(_INT_OF_SIZE[flat.element_size()])
    flat = flat.to(torch.int64)
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64)
    sums = (
        torch.stack([flat.sum(), (flat * weights).sum()])
        if flat.numel()
        else torch.zeros(2, dtype=torch.int64, device="cpu")
    )
    a, b = sums.tolist()
    return hash((a, b))


def _freeze(value: Any) -> Hashable:
    if isinstance(value, torch.Tensor):
        if _is_callers(value):  # a learned tensor is itself, whatever it holds (see _values_equal)
            return ("learned", id(value))
        return ("tensor", tuple(value.shape), str(value.dtype), _fingerprint(value))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


_NO_KEY = object()
#: Parameter types a plain key takes as they are (``Spec.plain_key``): compared by ``==`` as
#: ``Spec.__eq__`` compares them.
_PLAIN_TYPES = frozenset({int, float, bool, str, type(None)})


def _plain(value: Any) -> Hashable | None:
    """``Spec.plain_key`` of a spec, or a parameter's share of it; None where there is none."""
    if isinstance(value, Spec):
        parts: list[Any] = [type(value)]
        for field in value._fields():
            key = _plain(field)
            if key is None and field is not None:
                return None
            parts.append(key)
        return tuple(parts)
    if type(value) in _PLAIN_TYPES:
        return value
    if type(value) is tuple:
        items = [_plain(v) for v in value]
        if any(key is None and v is not None for key, v in zip(items, value, strict=True)):
            return None
        return ("tuple", *items)
    return None


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a is b:  # sound: a spec's tensor is its own copy (or a learned tensor: itself)
            return True
        if _is_callers(a) or _is_callers(b):
            # Learned tensors (biases a score mod trains) compare by identity: two layers' equal
            # initial biases must not share one score_mod, or the second layer's gradient would
            # reach the first layer's tensor (caches key mods, plans and compiled calls by spec),
            # nor, once frozen and loaded in place, its values.
            return False
        return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


_MODS: LRUCache[Any] = LRUCache(MOD_CACHE_SIZE)


def _made_for_the_cache(make: Callable[[], _ModT]) -> _ModT:
    """``make()`` for :data:`_MODS`, which hands the mod to every later call, whatever mode the
    first call ran in: outside inference mode (see ``_compat.outside_inference_mode``) and with
    grad on, so what a mod derives from a learned tensor when it is made (``Bias``'s view of its
    bias) stays differentiable. Made under an evaluation's ``torch.no_grad()``, that view had no
    autograd history, and the training steps after it got no gradient for the bias, silently.
    While traced, just ``make()``."""
    if _compat.is_compiling():
        return make()
    with torch.inference_mode(False), torch.enable_grad():
        return make()


@dataclasses.dataclass(frozen=True)
class FunctionCheck:
    """How a mask / score function written outside this package is checked before the library
    evaluates it on broadcast index grids (the ``dense`` route and oracle, the BlockMask builder).
    A function written for flex's 0-d indices (``table[q_idx][kv_idx]``, a reduction) gives
    another answer on broadcast grids, or fails there. ``probe(fn, owner)`` (``owner``: the spec
    class's name, for errors) returns whether ``fn`` must be evaluated as flex does and what
    the compiled flex kernels cannot run in it (:meth:`Spec.flex_hazards`);
    ``as_flex(fn)`` wraps ``fn`` to be evaluated so, as a raw callable is; ``traced_hazards(fn)``
    is what can be told of the hazards from ``fn``'s code while torch.compile traces, where the
    probe cannot run."""

    probe: Callable[[Callable[..., Any], str], tuple[bool, tuple[str, ...]]]
    as_flex: Callable[[Callable[..., Any]], Callable[..., Any]]
    traced_hazards: Callable[[Callable[..., Any]], tuple[str, ...]]


#: :class:`FunctionCheck` by kind (``"mask"``, ``"score"``). :mod:`flexattn_zoo.functions`
#: installs them (it imports this module).
FUNCTION_CHECKS: dict[str, FunctionCheck] = {}


def _written_outside(cls: type, function: str, base: type) -> bool:
    """Whether ``cls``'s ``function`` (the maker of its mod) comes from a class outside this
    package: a user's spec or a user's subclass of a preset. The package's own functions are
    written for broadcast grids (each checked against its oracle by the registry-wide tests)."""
    maker = _defining_class(cls, function)
    if maker is None or maker is base:
        return False
    # The function's own module: a stand-in the package set on a user's class (a form's base
    # default, :func:`_drop_stale_forms`) is the package's.
    module = getattr(maker.__dict__[function], "__module__", None) or maker.__module__
    return not (module == "flexattn_zoo" or module.startswith("flexattn_zoo."))


def _checked_mod(spec: Any, kind: str, key: Hashable, make: Callable[[], Any]) -> tuple[Any, tuple[str, ...]]:
    """``(mod, hazards)`` of a function written outside the package (:data:`FUNCTION_CHECKS`),
    cached per spec value under ``key``; the verdict is kept on ``spec`` too, for traced calls.

    Traced, the probe cannot run (it calls the function on real tensors): the verdict an eager
    call left on this spec object is used, else the function is evaluated as flex does (exact
    for every function flex runs) with the hazards its code shows (``traced_hazards``)."""
    check = FUNCTION_CHECKS.get(kind)
    if check is None:
        return _made_for_the_cache(make), ()
    if _compat.is_compiling():
        verdicts = spec.__dict__.get("_function_verdicts") or {}
        made = make()
        kept = verdicts.get(key)
        as_flex, hazards = (True, check.traced_hazards(made)) if kept is None else kept
        return (check.as_flex(made) if as_flex else made), hazards

    def checked() -> tuple[Any, bool, tuple[str, ...]]:
        made = _made_for_the_cache(make)
        as_flex, hazards = check.probe(made, type(spec).__name__)
        return (check.as_flex(made) if as_flex else made), as_flex, hazards

    mod, as_flex, hazards = _MODS.get_or_create((key, spec, "checked"), checked)
    verdicts = spec.__dict__.get("_function_verdicts")
    if verdicts is None:
        verdicts = {}
        object.__setattr__(spec, "_function_verdicts", verdicts)
    verdicts[key] = (as_flex, hazards)
    return mod, hazards


#: Field names per spec class (``_field_names``).
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
#: Field values that may hold tensors (``Spec.__eq__``).
_NESTED = (torch.Tensor, tuple, list)


def _storage_of(tensors: tuple[torch.Tensor, ...]) -> tuple[tuple[str, int], ...]:
    """``(device, data pointer)`` of each tensor: what :meth:`Spec._learned_storage` records."""
    return tuple((str(t.device), t.data_ptr()) for t in tensors)


def _field_names(spec: Any) -> tuple[str, ...]:
    """The dataclass field names of ``spec``, looked up once per class (``dataclasses.fields``
    filters every attribute of the class on each call). Not while torch.compile traces: Dynamo
    takes ``fields`` of an instance, and would guard on a global cache it read."""
    if _compat.is_compiling():
        return tuple(f.name for f in dataclasses.fields(spec))
    cls = type(spec)
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = tuple(f.name for f in dataclasses.fields(spec))
        _FIELD_NAMES[cls] = names
    return names


#: Verdicts of ``==`` between two distinct live specs that hold tensors, by ``(id, id)``; an entry
#: leaves when either spec is collected. Cache lookups compare a call's spec with the stored key
#: whenever their hashes match: a value-equal spec built anew (the same document layout again, a
#: second model with the same masks) compared tensor contents -- a device sync -- on every call
#: (H200: 2.2 ms per call instead of 0.7 on document_causal_d64). Specs are immutable (they own
#: their tensors: no caller can write to them), so the verdict holds for their lifetime, and an id
#: is only reused after the entry left with its spec.
_EQ_MEMO: dict[tuple[int, int], bool] = {}

#: The composites behind ``a & b``, ``a | b``, ``~a`` (masks) and ``a >> b`` (score specs), keyed by
#: operator. They live in :mod:`flexattn_zoo.compose`, which builds on this module and fills this table
#: when imported (``import flexattn_zoo`` does), so the import arrow points one way.
COMBINATORS: dict[str, Callable[..., Any]] = {}


def _memo_key(a: object, b: object) -> tuple[int, int]:
    return (id(a), id(b)) if id(a) < id(b) else (id(b), id(a))


#: The two finalizers of each ``_EQ_MEMO`` entry (one per spec): the first to run detaches the
#: other, so a long-lived spec compared with many short-lived equal ones keeps no finalizer per
#: comparison.
_EQ_FINALIZERS: dict[tuple[int, int], tuple[weakref.finalize[Any, Any], ...]] = {}


def _remember_equal(a: object, b: object, verdict: bool) -> None:
    key = _memo_key(a, b)
    if key not in _EQ_MEMO:
        _EQ_MEMO[key] = verdict
        _EQ_FINALIZERS[key] = tuple(weakref.finalize(obj, _forget_equal, key) for obj in (a, b))


def _forget_equal(key: tuple[int, int]) -> None:
    _EQ_MEMO.pop(key, None)
    for finalizer in _EQ_FINALIZERS.pop(key, ()):
        finalizer.detach()


_LiveT = TypeVar("_LiveT", bound="Spec")


class Spec:
    """Common behaviour: value equality, hashing, device moves."""

    #: Registry name (snake_case); set by the registry decorator.
    name: ClassVar[str] = ""
    #: Fields that only ever hold Python numbers (the spec's ``__post_init__`` makes them so), which
    #: ``tensors()`` skips. While ``torch.compile`` traces with dynamic shapes, reading a float field
    #: makes it a symbolic graph input, and an unused one costs a second trace of the whole call
    #: (Dynamo restarts to specialize it). Kernels read such floats through a constant path
    #: (``static_float``).
    scalar_fields: ClassVar[frozenset[str]] = frozenset()
    #: Whether constructing this spec reads its tensors' values in Python (``Tree`` derives its
    #: ancestor table from ``parents``), so it cannot be constructed again while ``torch.compile``
    #: traces: :meth:`map_tensors` leaves it as it is there.
    built_from_values: ClassVar[bool] = False
    #: Whether this spec's own mod may read one of its tensors at an index that depends on both
    #: the query and the key (a bias or mask table, a relative-position table). Triton's flex
    #: kernel streams such a value as a ``[BLOCK_M, BLOCK_N]`` tile through shared memory beside K
    #: and V, which the flex route's tile choice must leave room for (:meth:`loads_pairs`).
    #: ``None``: whenever the spec holds tensors of its own (the safe answer); specs whose tensors
    #: are read per query or per key only (document ids, lengths, flags) set ``False``.
    pair_loads: ClassVar[bool | None] = None
    #: Whether those per-pair reads are gathers from a small table at an index computed from the
    #: positions alone (a relative position, or its bucket: Sandwich, T5), not a tile of a tensor
    #: indexed by (query, key) (a bias, Graphormer's distances). The flex route starts such
    #: problems on its shallower forward pipeline instead of trying torch's defaults first
    #: (:meth:`gathers_pairs_only`).
    pair_gathers: ClassVar[bool] = False
    #: Whether this class's mod is made by a function written outside the package, which the
    #: library checks before evaluating it on index grids (:data:`FUNCTION_CHECKS`); set per class.
    _CHECKS_FUNCTION: ClassVar[bool] = False
    #: The same for a score spec's ``_make_past_score_mod`` (False for every other spec).
    _CHECKS_PAST_FUNCTION: ClassVar[bool] = False

    def _fields(self) -> tuple[Any, ...]:
        values = [getattr(self, name) for name in _field_names(self)]
        if self._holds_learned():
            values.append(self._learned_storage())
        return tuple(values)

    def _own_learned(self) -> tuple[torch.Tensor, ...]:
        """The tensors of this spec's own fields (not its parts') held as the caller's objects:
        learned tensors (see :func:`_owned`), also once frozen."""
        return tuple(v for v in self._parts() if isinstance(v, torch.Tensor) and _is_callers(v))

    def _holds_learned(self) -> bool:
        """Whether this spec or a part of it holds a learned tensor (cached per instance)."""
        cached = self.__dict__.get("_holds_learned_value")
        if cached is None:
            cached = any(
                (isinstance(v, torch.Tensor) and _is_callers(v))
                or (isinstance(v, Spec) and v._holds_learned())
                for v in self._parts()
            )
            if not _compat.is_compiling():
                object.__setattr__(self, "_holds_learned_value", cached)
        return bool(cached)

    def _learned_storage(self) -> tuple[Any, ...]:
        """Where this spec's own learned tensors kept their data when the spec was first used
        (``(device, data pointer)`` each), recorded once per instance and part of its equality.

        A learned tensor stays the caller's object, and the mods built from it read views of its
        storage: an optimizer's in-place step is seen, but ``param.data = new`` (an EMA swap, a
        re-initialization, ``module.to(...)``) gives the object new storage, which those views
        never see. :meth:`live` returns a copy of the spec when the storage moved, and the copy,
        unequal to the old one, misses every cache keyed by it. Empty while traced."""
        cached = self.__dict__.get("_learned_storage_value")
        if cached is None:
            cached = () if _compat.is_compiling() else _storage_of(self._own_learned())
            if not _compat.is_compiling():
                object.__setattr__(self, "_learned_storage_value", cached)
        return cached

    def __eq__(self, other: object) -> bool:
        if type(self) is not type(other):
            return NotImplemented
        if self is other:
            return True
        mine, theirs = self._fields(), other._fields()
        if not any(isinstance(value, _NESTED) for value in mine):
            # Plain parameters (a new ``Causal()`` or ``SlidingWindow(left=...)`` per call):
            # comparing them reads no tensor, so there is nothing to remember.
            return all(_values_equal(a, b) for a, b in zip(mine, theirs, strict=True))
        known = _EQ_MEMO.get(_memo_key(self, other))
        if known is not None:
            return known
        verdict = all(_values_equal(a, b) for a, b in zip(mine, theirs, strict=True))
        if self.tensors():  # comparing read tensor contents: don't do it again for this pair
            _remember_equal(self, other, verdict)
        return verdict

    def __hash__(self) -> int:
        # Cached: specs are immutable (their tensors are private copies, see _take_ownership) and
        # hashing a tensor parameter reads it.
        cached = self.__dict__.get("_hash_value")
        if cached is None:
            cached = hash((type(self).__qualname__, _freeze(self._fields())))
            object.__setattr__(self, "_hash_value", cached)
        return cached

    def live(self: _LiveT) -> _LiveT:
        """This spec with the current state of any raw callable in it (``self`` when unchanged).

        A spec holding a user ``mask_mod`` / ``score_mod`` (:class:`~flexattn_zoo.functions.FunctionMask`,
        possibly inside a composite) records the versions of the tensors the callable captures when
        it is built. After an in-place write to one of them, ``live()`` returns an equal-but-for-that
        spec with the new versions, so every cache keyed by the spec misses and rebuilds (the
        BlockMask above all). The same when a learned tensor in it got new storage
        (``param.data = ...``; see :meth:`_learned_storage`). Specs without callables or learned
        tensors return ``self`` at the cost of one lookup. While ``torch.compile`` traces, ``self``:
        no cache is read there, and the graph reads the captured tensors as inputs.
        """
        if self.__dict__.get("_plain_key_value") is not None:
            return self  # all parameters plain (``_settle_plain``): no callable, nothing learned
        if _compat.is_compiling() or (not self._holds_callables() and not self._holds_learned()):
            return self
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, Spec):
                fresh = value.live()
                if fresh is not value:
                    changes[f.name] = fresh
            elif isinstance(value, tuple) and any(isinstance(v, Spec) for v in value):
                fresh_t = tuple(v.live() if isinstance(v, Spec) else v for v in value)
                if any(a is not b for a, b in zip(fresh_t, value, strict=True)):
                    changes[f.name] = fresh_t
        if changes:
            return dataclasses.replace(self, **changes)  # type: ignore[type-var]
        own = self._own_learned()
        if own and not _compat.is_compiling() and _storage_of(own) != self._learned_storage():
            return dataclasses.replace(self)  # type: ignore[type-var]  # records the new storage
        return self

    def plain_key(self) -> Hashable | None:
        """``(class, parameter values)`` when every parameter is a Python number, string, None, a
        spec with a plain key, or a tuple of those -- no tensor, callable or other object -- else
        None. Specs with equal plain keys are equal specs; the key is what the plan cache keys a
        call by, so a spec built anew for every call (``mask=masks.Causal()``) is looked up by
        comparing a tuple of plain values (in C) instead of two specs field by field. Cached per
        instance (specs are immutable)."""
        cached = self.__dict__.get("_plain_key_value", _NO_KEY)
        if cached is _NO_KEY:
            cached = _plain(self)
            object.__setattr__(self, "_plain_key_value", cached)
        return cached

    def _holds_callables(self) -> bool:
        """Whether this spec or a part of it wraps a raw callable whose captured state is tracked."""
        cached = self.__dict__.get("_holds_callables_value")
        if cached is None:
            cached = any(isinstance(v, Spec) and v._holds_callables() for v in self._parts())
            if not _compat.is_compiling():  # a trace writing to the caller's spec could guard on it
                object.__setattr__(self, "_holds_callables_value", cached)
        return bool(cached)

    def flex_hazards(self) -> tuple[str, ...]:
        """What the raw callables in this spec (or its parts), and its own function where written
        outside the package, do that some compiled flex kernel mishandles
        (:func:`flexattn_zoo.functions.check_mask_function` finds it), each as a phrase completing
        "a mod that ..."; () for the package's own specs without callables. Each flex route
        refuses the part its kernel has (``functions.KERNEL_HAZARDS``)."""
        cls = type(self)
        found = list(self._function_hazards()) if cls._CHECKS_FUNCTION or cls._CHECKS_PAST_FUNCTION else []
        if not self._parts_may_have_hazards():
            return tuple(found)
        for part in self._parts():
            if isinstance(part, Spec):
                found += [h for h in part.flex_hazards() if h not in found]
        return tuple(found)

    def _parts_may_have_hazards(self) -> bool:
        """Whether a part of this spec (at any depth) wraps a raw callable or has a function
        written outside the package (:attr:`_CHECKS_FUNCTION`): the parts
        :meth:`flex_hazards` must ask. Cached per spec object, as :meth:`_holds_callables`."""
        cached = self.__dict__.get("_parts_may_have_hazards_value")
        if cached is None:
            cached = self._holds_callables() or any(
                isinstance(v, Spec)
                and (type(v)._CHECKS_FUNCTION or type(v)._CHECKS_PAST_FUNCTION or v._parts_may_have_hazards())
                for v in self._parts()
            )
            if not _compat.is_compiling():
                object.__setattr__(self, "_parts_may_have_hazards_value", cached)
        return bool(cached)

    def _function_hazards(self) -> tuple[str, ...]:
        """:meth:`flex_hazards` of this spec's own function (MaskSpec / ScoreSpec)."""
        return ()

    def __getstate__(self) -> dict[str, Any]:
        # The cached hash hashes a str (the class name), which differs between processes
        # (PYTHONHASHSEED): unpickled elsewhere it would not match equal specs built there.
        state = dict(self.__dict__)
        state.pop("_hash_value", None)
        state.pop("_tensors_value", None)  # rebuilt on use (from the unpickled fields)
        state.pop("_learned_storage_value", None)  # this process's addresses
        state.pop("_function_verdicts", None)  # probed again on use
        # Which tensors are the caller's (learned, possibly frozen since): unpickled or
        # deep-copied (``copy.deepcopy(model)`` for an EMA copy) they stay compared by identity.
        callers = {}
        for name in _field_names(self):
            flags = tuple(_is_callers(t) for t in _tensors_in(state.get(name)))
            if any(flags):
                callers[name] = flags
        if callers:
            state[_CALLERS_STATE] = callers
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        callers: dict[str, tuple[bool, ...]] = state.pop(_CALLERS_STATE, {})
        self.__dict__.update(state)
        # Unpickled (or deep-copied) tensors are new objects nobody else holds: the spec owns
        # them as it owns the copies it makes, so equal specs compare by value again; those the
        # original spec held as the caller's stay so (see ``__getstate__``).
        for name in _field_names(self):
            _adopt(state.get(name), callers.get(name, ()))

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        """A few valid instances for a problem of this shape; the registry-wide tests and the
        hypothesis strategies draw from them. The default is the no-argument instance."""
        return [cls()]

    @classmethod
    def typical_example(cls, q_len: int, kv_len: int, batch: int, heads: int) -> Spec:
        """One realistic instance for a problem of this shape: the parameters a model would use
        at these lengths (e.g. a window of an eighth of the sequence), as demos show it. The
        default is the first of :meth:`examples`."""
        return cls.examples(q_len, kv_len, batch, heads)[0]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this spec captures (recursively), e.g. to check devices."""
        # Cached per spec (equality and the plan cache's key ask on every call): its fields never
        # change. Not for specs wrapping raw callables, whose captured tensors are read live, nor
        # while torch.compile traces (what it would store are the trace's values).
        if _compat.is_compiling():
            return self._collect_tensors()  # read from the fields, as Dynamo tracks them
        cached = self.__dict__.get("_tensors_value")
        if cached is not None:
            return list(cached)
        found = self._collect_tensors()
        if not self._holds_callables():
            object.__setattr__(self, "_tensors_value", tuple(found))
        return found

    def _parts(self) -> list[Any]:
        """The values of this spec's fields, a tuple field's elements one by one; ``scalar_fields``
        (numbers only) are skipped: reading them while traced costs a retrace. A list, not a
        generator: Dynamo traces it (``tensors()`` and ``_holds_callables()`` run while traced)."""
        skip = type(self).scalar_fields
        parts: list[Any] = []
        for name in _field_names(self):
            if name in skip:
                continue
            value = getattr(self, name)
            parts.extend(value if isinstance(value, tuple) else (value,))
        return parts

    def loads_pairs(self) -> bool:
        """Whether this spec or a part of it reads a tensor per (query, key) pair (see
        :attr:`pair_loads`; any raw callable counts as one: what it reads is not looked into)."""
        own = type(self).pair_loads
        for part in self._parts():
            if isinstance(part, Spec):
                if part.loads_pairs():
                    return True
            elif own is None and isinstance(part, torch.Tensor):
                return True
        return bool(own)

    def pair_tiles(self) -> int:
        """How many tensors this spec and its parts read per (query, key) pair (0 exactly when
        :meth:`loads_pairs` is False): each is a ``[BLOCK_M, BLOCK_N]`` tile in Triton flex's
        shared memory. Its own tensors count one each when :attr:`pair_loads` is None, one in all
        when it is True (a table that is not a field), its parts theirs; a raw callable counts
        one, whatever it captures (what it reads is not looked into)."""
        own = type(self).pair_loads
        count = 1 if own else 0
        for part in self._parts():
            if isinstance(part, Spec):
                count += part.pair_tiles()
            elif own is None and isinstance(part, torch.Tensor):
                count += 1
        return count

    def gathers_pairs_only(self) -> bool:
        """Whether this spec reads values per (query, key) pair (:meth:`loads_pairs`) and every
        such read, its own and its parts', is a positional gather (:attr:`pair_gathers`)."""
        if not self.loads_pairs():
            return False
        if type(self).pair_gathers:
            return True
        parts = self._parts()
        own = type(self).pair_loads
        # Loops, not any() / all() over generators: traced calls read this (see
        # ``backends.flex._pair_gathers_only``).
        if own:
            return False  # reads a tensor of its own per pair, not declared a gather
        loading = []
        for part in parts:
            if own is None and isinstance(part, torch.Tensor):
                return False
            if isinstance(part, Spec) and part.loads_pairs():
                loading.append(part)
        # No loading part: the reads are this spec's own (a raw callable's captured tensors),
        # which nothing declares a gather.
        if not loading:
            return False
        for part in loading:
            if not part.gathers_pairs_only():
                return False
        return True

    def _collect_tensors(self) -> list[torch.Tensor]:
        found: list[torch.Tensor] = []
        for part in self._parts():
            if isinstance(part, torch.Tensor):
                found.append(part)
            elif isinstance(part, Spec):
                found.extend(part.tensors())
        return found

    def to(self, device: torch.device | str) -> Self:
        """A copy with every captured tensor on ``device`` (``self`` if nothing moves).

        Nested specs move through their own ``to``: a part that keeps state on a device besides
        its tensor fields (a captured offset, a precomputed table) moves that state too."""
        dev = torch.device(device)
        return self._rebuilt(lambda t: t if t.device == dev else t.to(dev), lambda part: part.to(dev))

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Self:
        """A copy, constructed again, with ``fn(t)`` for every captured tensor ``t``, nested specs
        included (``self`` where ``fn`` returns every tensor unchanged, and, while traced, for a
        spec :attr:`built_from_values`)."""
        return self._rebuilt(fn, lambda part: part.map_tensors(fn))

    def _rebuilt(self, fn: Callable[[torch.Tensor], torch.Tensor], nested: Callable[[Spec], Spec]) -> Self:
        """This spec with ``fn`` applied to its tensor fields and ``nested`` to its spec fields
        (alone or in a tuple); ``self`` where nothing changes."""
        if type(self).built_from_values and tracing():
            return self
        changes: dict[str, Any] = {}
        skip = type(self).scalar_fields  # no tensor there (see scalar_fields)
        for f in dataclasses.fields(self):  # type: ignore[arg-type]  # mixin: concrete specs are dataclasses
            if f.name in skip:
                continue
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                new = fn(value)
                if new is not value:
                    # A fresh tensor (or a learned tensor's non-leaf copy): the new spec owns it as is.
                    changes[f.name] = new if new.requires_grad else _mark_owned(new)
            elif isinstance(value, Spec):
                mapped = nested(value)
                if mapped is not value:
                    changes[f.name] = mapped
            elif isinstance(value, tuple) and any(isinstance(v, Spec) for v in value):
                mapped_t = tuple(nested(v) if isinstance(v, Spec) else v for v in value)
                if any(a is not b for a, b in zip(mapped_t, value, strict=True)):
                    changes[f.name] = mapped_t
        return dataclasses.replace(self, **changes) if changes else self  # type: ignore[type-var]  # as above


# ---------------------------------------------------------------------------------------------
# Cheap exact forms a spec offers about itself; routes and tools read these, never spec classes.


@dataclasses.dataclass(frozen=True)
class SdpaForm:
    """The mask (or score mod) is exactly one SDPA call's ``is_causal`` flag (top-left; only
    offered when Lq == Lkv) or its ``attn_mask``.

    ``attn_mask`` (with ``is_causal`` False) is a 4-D tensor broadcastable to ``[B, H, Lq, Lkv]``:
    bool (True = attend; ``masks.Dense``) or float, added to the scaled scores
    (``score_mods.Bias``). ``empty_rows`` is False only when every query row is known to see a
    key through it (kernels differ on rows that see none; see ``backends.sdpa``).
    """

    is_causal: bool
    attn_mask: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    empty_rows: bool = dataclasses.field(default=False, compare=False)


@dataclasses.dataclass(frozen=True)
class VarlenForm:
    """The mask is exactly block-diagonal segments, each with an FA-style window.

    ``segments`` holds, per batch row, the lengths of consecutive segments that tile ``[0, L)``
    (``None`` means one segment per row). ``window`` is ``(left, right)`` with -1 for unbounded,
    relative to the diagonal inside each segment. Offered when Lq == Lkv, and for packed calls
    (one row, B = 1) whose key segments differ from the query segments (``kv_segments``).

    With ``kv_segments``, segment ``i`` is ``segments[i]`` queries and ``kv_segments[i]`` keys
    (every length positive; each tiles its own axis), and the window is bottom-right aligned as in
    FlashAttention: query ``r`` of a segment with ``Lq_i`` queries and ``Lk_i`` keys sits at key
    position ``r + Lk_i - Lq_i``. Only offered when every query row sees at least one key (a
    varlen kernel's lse of an empty row is not the library's ``-inf``).
    """

    segments: torch.Tensor | None  # int64 [B, S] padded with 0, or [S] shared by every row
    window: tuple[int, int] = (-1, -1)
    #: The length of every segment, when the spec knows it without reading ``segments`` (the
    #: last one may be shorter); lets a traced call see equal chunks (see ``tracing``).
    uniform: int | None = None
    #: int64 ``[S]`` key lengths, one per entry of a 1-D ``segments``, when keys are segmented
    #: differently from queries (then Lq may differ from Lkv); None: the same as ``segments``.
    kv_segments: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class StridedForm:
    """The mask keeps only pairs whose positions agree modulo ``stride``, with an FA-style window
    in each residue class's own positions: query ``i`` sees key ``j`` iff ``i % stride == j %
    stride`` and ``-left <= j // stride - i // stride <= right`` for ``window = (left, right)``
    (``-1``: unbounded). Offered when Lq == Lkv (a dilated window).

    Position ``t * stride + r`` is position ``t`` of class ``r``, so a kernel that knows only
    windows runs the call on the classes as separate sequences: with ``L`` a multiple of
    ``stride``, ``[B, L, H, D]`` is ``[B, L / stride, stride * H, D]`` (no copy for that layout),
    head ``r * H + h`` holding class ``r`` of head ``h``.
    """

    stride: int
    window: tuple[int, int] = (-1, -1)


#: The most (query, key) pairs a :class:`SplitPart` may list in a ``mask``: routes evaluate such a
#: part as dense scores (``[B, H, Tq, Tk]`` in float32), which must stay small next to attention.
SPLIT_MASK_PAIRS = 1 << 16


@dataclasses.dataclass(frozen=True)
class SplitPart:
    """Queries ``q[0] <= i < q[1]`` see keys ``kv[0] <= j < kv[1]``: all of them, or when
    ``is_causal`` those with ``j - kv[0] <= i - q[0]`` (causal inside a square rectangle: as many
    queries as keys, so top-left and bottom-right alignment agree), or when ``mask`` is given the
    pairs it marks: a bool tensor ``[q[1] - q[0], kv[1] - kv[0]]`` (True: visible), the same for
    every batch row and head, of at most :data:`SPLIT_MASK_PAIRS` pairs (a small irregular block,
    such as a draft tree's own keys, which routes evaluate as dense scores). Parts compare by their
    ranges and flags; the mask is not compared."""

    q: tuple[int, int]
    kv: tuple[int, int]
    is_causal: bool
    mask: torch.Tensor | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        (q0, q1), (k0, k1) = self.q, self.kv
        if not (0 <= q0 < q1 and 0 <= k0 < k1):
            raise ValueError(
                f"SplitPart ranges must be non-empty [start, stop) from 0 up, got q={self.q}, kv={self.kv}"
            )
        if self.is_causal and q1 - q0 != k1 - k0:
            # Kernels' is_causal alignment (top-left vs bottom-right) only agrees on squares.
            raise ValueError(f"SplitPart is causal but not square: q={self.q}, kv={self.kv}")
        if self.mask is None:
            return
        if self.is_causal:
            raise ValueError(
                "SplitPart takes is_causal or a mask, not both (put the causal pairs in the mask)"
            )
        if not isinstance(self.mask, torch.Tensor) or self.mask.dtype != torch.bool:
            raise TypeError(f"SplitPart(mask=...) must be a bool tensor, got {self.mask!r:.80}")
        if tuple(self.mask.shape) != (q1 - q0, k1 - k0):
            raise ValueError(
                f"SplitPart(mask=...) must have shape [{q1 - q0}, {k1 - k0}] (its query and key "
                f"ranges), got {tuple(self.mask.shape)}"
            )
        if self.mask.numel() > SPLIT_MASK_PAIRS:
            raise ValueError(
                f"SplitPart(mask=...) lists {self.mask.numel()} pairs, more than SPLIT_MASK_PAIRS = "
                f"{SPLIT_MASK_PAIRS} (routes evaluate a masked part as dense scores)"
            )


@dataclasses.dataclass(frozen=True)
class SplitForm:
    """The mask is exactly the union of ``parts`` -- unmasked, causal or small masked rectangles
    (:class:`SplitPart`) -- no two of which show one (query, key) pair; a row no part covers sees
    no key. Fused kernels that know only "no mask" and causal run each unmasked or
    causal part, and the results merge by log-sum-exp."""

    parts: tuple[SplitPart, ...]


#: The most global positions a :class:`GlobalTokensForm` may list: routes score every query
#: against the global keys densely (``[B, H, L, G]`` in float32), which must stay small.
GLOBAL_FORM_MAX_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class GlobalTokensForm:
    """The mask is a window plus global tokens, the same in every batch row and head: query ``i``
    sees key ``j`` iff ``-left <= j - i <= right`` for ``window = (left, right)`` (``-1``:
    unbounded on that side), or ``i`` is one of ``positions``, or ``j`` is one. Offered when
    Lq == Lkv, with at least one and at most :data:`GLOBAL_FORM_MAX_TOKENS` positions.

    A kernel that knows only windows runs the window over every row; each row's global keys
    outside its window are scored apart and merged in by log-sum-exp, and the global rows (which
    see every key) are computed apart and written over theirs.
    """

    #: int64 ``[G]``, ascending, distinct, each in ``[0, L)``; on the mask's device.
    positions: torch.Tensor = dataclasses.field(compare=False)
    window: tuple[int, int] = (-1, -1)


@dataclasses.dataclass(frozen=True)
class BlockMap:
    """Block-level visibility, computed in closed form (O(n_q_blocks * n_kv_blocks), never O(L^2)).

    ``any[b, h, r, c]`` is True when query block ``r`` sees at least one key of key block ``c``;
    ``full[b, h, r, c]`` when it sees all of them. Leading dims are 1 when the spec does not depend
    on batch/head. Conventions follow ``create_block_mask``: positions past ``Lq``/``Lkv`` count as
    masked, so a trailing incomplete block is never full. ``full`` implies ``any``.
    """

    any: torch.Tensor
    full: torch.Tensor


@dataclasses.dataclass(frozen=True)
class SoftCapForm:
    """The score mod is exactly soft-capping: a scaled score ``s`` becomes ``cap * tanh(s / cap)``.

    ``cap`` is finite and > 0. ``approx`` is True when the spec allows ``tanh`` to be evaluated
    with a hardware approximation (a few ulps off), as kernels with a native soft-cap argument do
    (FA4's ``softcap``); False asks for the exact ``tanh``.
    """

    cap: float
    approx: bool = False


@dataclasses.dataclass(frozen=True)
class LinearBiasForm:
    """The score mod is exactly an additive linear distance penalty per head (ALiBi).

    The scaled score ``s`` of query ``i``, key ``j`` under query head ``h`` becomes
    ``s - slopes[h] * |i - j|``, with absolute positions as ``score_mod`` sees them. The bias does
    not depend on ``s``, so the whole score mod is a float bias added to the scores (what SDPA's
    float ``attn_mask`` takes). ``slopes`` holds one finite float per query head (any sign). Where
    ``j <= i`` the penalty is ``slopes[h] * (i - j)``, which is what
    ``score_mod(future_keys_hidden=True)`` computes.
    """

    slopes: tuple[float, ...]


def lower_triangle_fraction(q_len: int, kv_len: int, offset: int) -> float:
    """Share of pairs with ``kv_idx <= q_idx + offset`` in a ``q_len x kv_len`` grid (exact)."""
    first = min(q_len, max(0, -offset))  # rows before it see no key
    last = min(q_len, max(first, kv_len - offset))  # rows from it on see every key
    partial = (last - first) * (offset + 1) + (first + last - 1) * (last - first) // 2
    return (partial + (q_len - last) * kv_len) / max(1, q_len * kv_len)


def graph_memo(spec: Any) -> dict[Hashable, Any] | None:
    """Where a trace keeps what it derived from ``spec`` (its BlockMask's tensors) for the rest
    of the trace, or None (not tracing, or ``spec`` was made outside the graph). What is kept
    must be something Dynamo can rebuild (tensors, ints, tuples): a spec may leave the graph.

    A model builds one mask spec in its forward and hands it to every layer: without this, the
    graph built its BlockMask once per layer. Only a spec made while tracing has one, a fresh
    object of that trace: writing to a spec made outside would be a side effect Dynamo replays
    after the graph (and guards on next call). Specs are immutable, so what is kept stays true.
    """
    if not _compat.is_compiling():
        return None
    return getattr(spec, "_graph_memo", None)


def tracing() -> bool:
    """Whether ``torch.compile`` is tracing the current call. Spec methods that would read the
    *data* of a tensor they hold (a form derived from document ids) return None then: Dynamo can
    only branch on data by breaking the graph, and the answer would be baked into the compiled
    graph although the data changes every step. Routes that need such a form refuse."""
    return _compat.is_compiling()


#: A spec parameter as a plain int while ``torch.compile`` traces (see ``_compat.static_int``).
#: Mods apply it to the ints they capture: a spec passed to a compiled function as an argument
#: has its int fields made symbolic under dynamic shapes, and Inductor's CPU flex kernel fails
#: to compile a ``mask_mod`` closing over one (C++ errors, torch 2.13). A spec's parameters never
#: vary within a model, so specializing them costs nothing but a guard.
static_int = _compat.static_int


def keep_static_float(spec: Spec, name: str, value: float) -> None:
    """Set the float field ``name`` of a frozen spec to ``value``, and keep its exact text for
    :func:`static_float` (call from ``__post_init__``)."""
    object.__setattr__(spec, name, value)
    object.__setattr__(spec, f"_{name}_text", repr(value))


def static_float(spec: Spec, name: str) -> float:
    """The float field ``name``, read so that ``torch.compile`` sees a constant: under dynamic
    shapes Dynamo makes every float it reads from an object symbolic, which a flex ``score_mod``
    cannot capture (nor Inductor's CPU flex kernel load as a tensor); a str it never does, and it
    guards on its value. ``repr`` of a float round-trips exactly. Falls back to the field itself
    for a spec pickled before its text was kept (see :func:`keep_static_float`)."""
    text = spec.__dict__.get(f"_{name}_text")
    return float(getattr(spec, name)) if text is None else float(text)


#: Decisions on position parameters that may be data-dependent while a compiled decode step
#: traces (see ``_compat.known_true``): offered forms need ``known_true``; the safe side of a
#: choice between exact specs, ``maybe_true``; clamps, ``clamp_int``; shortcuts that must not
#: make a traced graph specialize on a length, ``true_without_guard``.
known_true = _compat.known_true
true_without_guard = _compat.true_without_guard
maybe_true = _compat.maybe_true
clamp_int = _compat.clamp_int


def block_ranges(
    length: int, block: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(start, last, complete)`` per block of ``[0, length)``: first index, last valid index,
    and whether the block is complete (holds ``block`` valid positions)."""
    n = -(-length // block)
    start = torch.arange(n, device=device) * block
    last = torch.clamp(start + block - 1, max=length - 1)
    complete = (start + block) <= length
    return start, last, complete


# ---------------------------------------------------------------------------------------------
# Forms follow the function they describe


def _defining_class(cls: type, name: str) -> type | None:
    """The class in ``cls``'s MRO whose own namespace defines ``name`` (None: none does)."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass
    return None


def _drop_stale_forms(
    cls: type,
    base: type,
    function: str,
    flags: tuple[str, ...],
    oracle: Callable[..., Any],
) -> None:
    """Give ``cls`` the ``base`` defaults of the forms (``base.FORMS``) it inherits from a class
    whose ``function`` (the maker of its mask_mod / score_mod) ``cls`` or a class between them
    replaced, and, where it replaced a parent's function, set the dependence ``flags`` it does not
    set itself (``depends_on_batch`` / ``depends_on_head``) to True. An oracle (``dense``)
    inherited the same way describes the replaced function too: ``cls`` gets ``oracle`` in its
    place, which evaluates its own function.

    A form (an SDPA flag, a block map, a lower bound on the keys, a bias's slopes...) is a claim
    about one function: a subclass of ``masks.Causal`` that hides the diagonal too inherits
    ``sdpa_form`` = ``is_causal``, which its function no longer matches, and a route that trusts
    the form would run the parent's mask. The defaults claim no form (the safe answer), and the
    flags, which the defaults of ``uses_batch`` / ``uses_head`` read, claim that the new function
    may read the batch row and the head (one BlockMask per row and head: exact, if more work, for
    a function that reads neither); so such a class runs exactly on the routes that evaluate its
    function. A form or flag the subclass defines itself, or a form it inherits from a class that
    does not define the function (a mixin), is kept; a class whose new function keeps a parent's
    form true can say so by naming it in its body (``sdpa_form = masks.Causal.sdpa_form``,
    ``depends_on_batch = False``)."""
    maker = _defining_class(cls, function)
    if maker is None or maker is base:
        return
    replaced = _replaced_by(cls, maker, function)
    if replaced is not None and replaced is not base:
        below_maker = cls.__mro__[: cls.__mro__.index(maker) + 1]
        for flag in flags:
            if not any(flag in k.__dict__ for k in below_maker):
                setattr(cls, flag, True)
    stand_ins = {name: base.__dict__[name] for name in base.FORMS}  # type: ignore[attr-defined]
    stand_ins["dense"] = oracle
    for name, stand_in in stand_ins.items():
        if name in cls.__dict__:
            continue
        owner = _defining_class(cls, name)
        if owner is None or owner is base:
            continue
        written_beside = _defining_class(owner, function)
        if written_beside is None or written_beside is base or written_beside is maker:
            continue
        setattr(cls, name, stand_in)


def _replaced_by(cls: type, maker: type, function: str) -> type | None:
    """The class whose ``function`` ``maker``'s replaces in ``cls``: the next one along ``cls``'s
    MRO that defines it (``maker`` may be a mixin, with no such class above it in its own MRO)."""
    mro = cls.__mro__
    return next((k for k in mro[mro.index(maker) + 1 :] if function in k.__dict__), None)


def index_grids(
    batch: int, heads: int, q_len: int, kv_len: int, dtype: torch.dtype = torch.int64
) -> tuple[torch.Tensor, ...]:
    """CPU ``(b, h, q_idx, kv_idx)`` of shapes ``[B,1,1,1]``, ``[1,H,1,1]``, ``[1,1,Lq,1]``,
    ``[1,1,1,Lkv]`` (int64, or ``dtype``: flex's kernels pass int32): a spec's function called on
    them gives its values on the whole grid."""
    b = torch.arange(batch, dtype=dtype, device="cpu").view(batch, 1, 1, 1)
    h = torch.arange(heads, dtype=dtype, device="cpu").view(1, heads, 1, 1)
    q = torch.arange(q_len, dtype=dtype, device="cpu").view(1, 1, q_len, 1)
    kv = torch.arange(kv_len, dtype=dtype, device="cpu").view(1, 1, 1, kv_len)
    return b, h, q, kv


def function_mask_oracle(
    self: MaskSpec, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1
) -> torch.Tensor:
    """``dense`` of a class that replaced a parent's mask function without writing its own oracle
    (the parent's describes the parent's function): the class's function (of the spec bound to
    the lengths, where the class restates ``bind``) called on the index grids, as the ``dense``
    route calls it, where its tensors live; returned on the CPU like every oracle. Not
    independent of the function, as a raw callable's is not."""
    device = next((t.device for t in self.tensors() if t.device.type != "cpu"), torch.device("cpu"))
    b, h, q, kv = (g.to(device) for g in index_grids(batch, heads, q_len, kv_len))
    mask_mod = self.bind(q_len, kv_len).mask_mod()
    visible = torch.as_tensor(mask_mod(b, h, q, kv), device=device).bool()
    return torch.broadcast_to(visible, (batch, heads, q_len, kv_len)).cpu()


def function_score_oracle(self: ScoreSpec, scores: torch.Tensor) -> torch.Tensor:
    """``dense`` of a class that replaced a parent's score function without writing its own oracle:
    the class's exact function (``fast=False``) called on ``scores`` and the index grids, in the
    dtype of ``scores``."""
    grids = (g.to(scores.device) for g in index_grids(*scores.shape))
    return torch.broadcast_to(self.score_mod()(scores, *grids), scores.shape).to(scores.dtype)


def unused_forms(spec: Any) -> list[tuple[type, type, type, tuple[str, ...]]]:
    """For ``spec`` and every spec inside it (a composite's parts), each class whose function
    replaced a parent's: ``(class, the class defining its function, parent, the parent's forms the
    class does not use)``, where that list is not empty. Routes that need those forms refuse the
    class (what ``explain`` says why)."""
    found: list[tuple[type, type, type, tuple[str, ...]]] = []
    seen: set[type] = set()

    def visit(value: Any) -> None:
        if not isinstance(value, Spec):
            return
        cls = type(value)
        base, function = (
            (MaskSpec, "_make_mask_mod") if isinstance(value, MaskSpec) else (ScoreSpec, "_make_score_mod")
        )
        maker = _defining_class(cls, function)
        if cls not in seen and maker is not None and maker is not base:
            seen.add(cls)
            parent = _replaced_by(cls, maker, function)
            if parent is not None and parent is not base:
                defaults = base.__dict__
                unused = tuple(
                    name
                    for name in base.FORMS
                    if getattr(cls, name) is defaults[name] and getattr(parent, name) is not defaults[name]
                )
                if unused:
                    found.append((cls, maker, parent, unused))
        for part in value._parts():
            visit(part)

    visit(spec)
    return found


def keeps_function_of(spec: Any, cls: type) -> bool:
    """Whether ``spec`` is a ``cls`` that runs ``cls``'s own mask / score function (no subclass
    between them replaced it): what a claim made of a class, rather than read from a form, needs
    (a subclass of ``masks.Full`` that hides keys is no longer free of a mask)."""
    if not isinstance(spec, cls):
        return False
    function = "_make_mask_mod" if isinstance(spec, MaskSpec) else "_make_score_mod"
    return _defining_class(type(spec), function) is _defining_class(cls, function)


# ---------------------------------------------------------------------------------------------
# Masks


class MaskSpec(Spec):
    """Base class of every mask spec. Subclasses implement ``_make_mask_mod`` and ``dense``."""

    #: True when visibility depends on the batch index (e.g. per-row documents).
    depends_on_batch: ClassVar[bool] = False
    #: True when visibility depends on the head index.
    depends_on_head: ClassVar[bool] = False

    #: The methods that state facts about the function ``_make_mask_mod`` makes; a subclass that
    #: replaces that function without restating one gets the default here (:func:`_drop_stale_forms`).
    FORMS: ClassVar[tuple[str, ...]] = (
        "bind",
        "block_map",
        "global_tokens_form",
        "hides_future_keys",
        "lowest_visible_key",
        "past_key_starts",
        "reads_scalar_tensors",
        "sdpa_form",
        "sees_one_run",
        "split_form",
        "starts_mask_mod",
        "strided_form",
        "uses_batch",
        "uses_head",
        "varlen_form",
        "visible_fraction",
    )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _drop_stale_forms(
            cls,
            MaskSpec,
            "_make_mask_mod",
            ("depends_on_batch", "depends_on_head"),
            function_mask_oracle,
        )
        cls._CHECKS_FUNCTION = _written_outside(cls, "_make_mask_mod", MaskSpec)

    def uses_batch(self) -> bool:
        """Whether this spec instance depends on the batch index (composites override)."""
        return self.depends_on_batch

    def uses_head(self) -> bool:
        """Whether this spec instance depends on the head index (composites override)."""
        return self.depends_on_head

    def bind(self, q_len: int, kv_len: int) -> MaskSpec:
        """This spec specialised to ``q_len`` x ``kv_len`` (``self`` for most specs).

        ``mask_mod`` receives no lengths, so a spec whose rule mentions them (e.g.
        ``Causal(align="bottom_right")``, which needs ``Lkv - Lq``) returns an equivalent spec with
        the length-derived value made explicit. Callers building kernels call
        ``spec.bind(Lq, Lkv)`` before asking for ``mask_mod()``.
        """
        return self

    def mask_mod(self) -> MaskMod:
        """The flex ``mask_mod(b, h, q_idx, kv_idx) -> bool``; one function object per value.

        ``_make_mask_mod`` passes the int parameters its function captures through
        :func:`static_int` (a constant to ``torch.compile``, whatever the spec's source)."""
        if self._CHECKS_FUNCTION:
            return _checked_mod(self, "mask", "mask", self._make_mask_mod)[0]
        return _MODS.get_or_create(("mask", self), lambda: _made_for_the_cache(self._make_mask_mod))

    def _make_mask_mod(self) -> MaskMod:
        raise NotImplementedError

    def _function_hazards(self) -> tuple[str, ...]:
        if not self._CHECKS_FUNCTION:
            return ()
        return _checked_mod(self, "mask", "mask", self._make_mask_mod)[1]

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        """Independent boolean oracle of shape ``[B|1, H|1, q_len, kv_len]``.

        ``batch``/``heads`` only matter to specs that depend on them; others return size-1 dims.
        """
        raise NotImplementedError

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        """Raise ``ValueError`` if the spec cannot describe a problem of this shape."""

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        """Exact SDPA form, or None."""
        return None

    def varlen_form(self, q_len: int, kv_len: int, batch: int) -> VarlenForm | None:
        """Exact varlen form, or None."""
        return None

    def split_form(self, q_len: int, kv_len: int) -> SplitForm | None:
        """Exact split into unmasked, causal or small masked rectangles (see :class:`SplitForm`),
        or None."""
        return None

    def strided_form(self, q_len: int, kv_len: int) -> StridedForm | None:
        """Exact form as a window inside residue classes of positions (see :class:`StridedForm`),
        or None. Only read where the mask has no ``varlen_form``."""
        return None

    def global_tokens_form(self, q_len: int, kv_len: int) -> GlobalTokensForm | None:
        """Exact form as a window plus global tokens (see :class:`GlobalTokensForm`), or None.
        Only read where the mask has no ``varlen_form`` or ``strided_form``."""
        return None

    def reads_scalar_tensors(self) -> bool:
        """True when the ``mask_mod`` loads a captured tensor of one element: a 0-d tensor
        (position offsets kept out of the compiled kernel's constants, so one kernel serves every
        offset) or a table whose every dim is 1 (a broadcast ``[1, 1, 1, 1]`` mask), which a
        compiled kernel reads at a fixed index. A kernel generator that cannot load one refuses
        the spec with that reason (``flex_flash``)."""
        return False

    def visible_fraction(self, q_len: int, kv_len: int) -> float:
        """An upper bound on the share of (query, key) pairs visible at these lengths (1.0 when
        unknown), known without evaluating the mask; the dispatcher sizes problems by it."""
        return 1.0

    def hides_future_keys(self, q_len: int, kv_len: int) -> bool:
        """True when no pair with ``kv_idx > q_idx`` is visible at these lengths (indices as the
        bound spec's ``mask_mod`` sees them). Then a score_mod's value on those pairs is never used,
        so kernels may run ``score.score_mod(future_keys_hidden=True)``. False is always safe."""
        return False

    def past_key_starts(self, q_len: int, kv_len: int) -> torch.Tensor | None:
        """Exact form of this mask over the keys at or before each query, or None.

        A tensor ``starts`` (int32, ``[L]`` or ``[B, L]`` with ``L >= max(q_len, kv_len)``) such
        that, for every ``kv_idx <= q_idx``, the pair is visible iff
        ``starts[q_idx] <= kv_idx`` (``starts[b, q_idx]`` when 2-D). ANDed with a mask that hides
        future keys, a kernel may compare one value per query instead of evaluating this mask's
        ``mask_mod`` (packed documents: one label lookup per query and one per key). None while
        traced (read from tensor values)."""
        return None

    def starts_mask_mod(self, q_len: int, kv_len: int) -> MaskMod | None:
        """A ``mask_mod`` equal to this bound spec's at these lengths, spelled with per-query key
        starts instead of per-key lookups, or None where there is no such spelling: ``&``
        composites where one part offers :meth:`past_key_starts` and another hides future keys,
        ``PerDocument`` whose inner mask hides future keys, and ``SharedPrefix``. Measured faster
        on Triton flex for ``Document & Causal``, slower on FA4's CuTe kernel, so routes choose
        whether to ask."""
        return None

    def lowest_visible_key(self, q_idx: torch.Tensor) -> torch.Tensor | None:
        """A lower bound on the keys each query may see, or None when there is none above 0.

        ``q_idx`` is an int64 tensor of query positions (any shape; indices as the bound spec's
        ``mask_mod`` sees them). The result ``lo`` has the shape and dtype of ``q_idx`` and
        promises, for every batch row and head:

        * no key ``j < lo[n]`` is visible to query ``q_idx[n]`` (values may be negative: no key
          lies below 0, so a negative bound says nothing);
        * ``lo`` never decreases as the query position grows, so the bound of a block's first
          query holds for the whole block.

        Single specs give the exact bound: the lowest key a query sees, when it sees any, is
        ``max(lo, 0)``. ``&`` and ``|`` composites may give a lower bound. None means every key
        from 0 on may be visible (e.g. causal). KV-cache decoding skips the cache blocks below the
        bound.
        """
        return None

    def sees_one_run(self) -> bool:
        """True when, at equal lengths (``Lq == Lkv``) and for every batch row and head, each
        query sees one contiguous run of keys that holds the query's own position and begins at
        ``max(lowest_visible_key(q), 0)`` (at 0 where that is None). False is always safe.

        Then the query at position ``p`` of a KV cache whose keys ``0 .. p`` are valid sees exactly
        the keys from its run's start through ``p``, whatever the run does past ``p``: KV-cache
        decoding runs such a one-query step as plain attention over that slice of the cache
        (causal masks, sliding windows, chunks, prefix-LM, and ``&`` / ``|`` of them).
        """
        return False

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        """Closed-form block visibility (see :class:`BlockMap`), or None if there is none.

        None sends ``fz.block_mask`` to the generic builder, which evaluates ``mask_mod`` in
        bounded-memory chunks.
        """
        return None

    def __and__(self, other: MaskSpec) -> MaskSpec:
        return COMBINATORS["&"](self, other)

    def __or__(self, other: MaskSpec) -> MaskSpec:
        return COMBINATORS["|"](self, other)

    def __invert__(self) -> MaskSpec:
        return COMBINATORS["~"](self)


# ---------------------------------------------------------------------------------------------
# Score modifications


class ScoreSpec(Spec):
    """Base class of every score spec. Subclasses implement ``_make_score_mod`` and ``dense``."""

    depends_on_head: ClassVar[bool] = False
    #: True for activation (non-softmax) attention, e.g. ``score_mods.Sigmoid``: the score mod and
    #: ``dense`` give log-weights ``log w_ij`` and the attention is ``sum_j w_ij v_j``, unnormalised
    #: (see :meth:`is_activation`).
    activation: ClassVar[bool] = False
    #: The methods that state facts about the function ``_make_score_mod`` makes (the variant for
    #: masks that hide future keys among them); a subclass that replaces that function without
    #: restating one gets the default here (:func:`_drop_stale_forms`).
    FORMS: ClassVar[tuple[str, ...]] = (
        "_make_past_score_mod",
        "linear_bias_form",
        "sdpa_form",
        "softcap_form",
        "uses_head",
    )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _drop_stale_forms(cls, ScoreSpec, "_make_score_mod", ("depends_on_head",), function_score_oracle)
        cls._CHECKS_FUNCTION = _written_outside(cls, "_make_score_mod", ScoreSpec)
        cls._CHECKS_PAST_FUNCTION = _written_outside(cls, "_make_past_score_mod", ScoreSpec)

    def score_mod(self, *, fast: bool = False, future_keys_hidden: bool = False) -> ScoreMod:
        """The flex ``score_mod(score, b, h, q_idx, kv_idx)``; one function object per value.

        ``fast=True`` asks for the variant a GPU kernel should run (e.g. a hardware tanh); it is
        only different for specs that opted in (``SoftCap(approx=True)``).
        ``future_keys_hidden=True`` is the caller's promise that its mask hides every pair with
        ``kv_idx > q_idx`` (``MaskSpec.hides_future_keys``): the function returned need only be
        right where ``kv_idx <= q_idx`` (ALiBi then drops its ``abs``). Specs without such a
        variant return the same function object either way, so compiled kernels are shared.
        """
        if future_keys_hidden:
            if self._CHECKS_PAST_FUNCTION:
                make = functools.partial(self._make_past_score_mod, fast=fast)
                return _checked_mod(self, "score", ("score", fast, "past"), make)[0]
            return _MODS.get_or_create(
                ("score", self, fast, "past"),
                lambda: _made_for_the_cache(lambda: self._make_past_score_mod(fast=fast)),
            )
        if self._CHECKS_FUNCTION:
            return _checked_mod(
                self, "score", ("score", fast), functools.partial(self._make_score_mod, fast=fast)
            )[0]
        return _MODS.get_or_create(
            ("score", self, fast),
            lambda: _made_for_the_cache(lambda: self._make_score_mod(fast=fast)),
        )

    def _make_score_mod(self, *, fast: bool) -> ScoreMod:
        raise NotImplementedError

    def _make_past_score_mod(self, *, fast: bool) -> ScoreMod:
        """The score_mod for ``future_keys_hidden=True``: it must equal ``score_mod(fast=fast)`` on
        every pair with ``kv_idx <= q_idx``. Default: that very function."""
        return self.score_mod(fast=fast)

    def _function_hazards(self) -> tuple[str, ...]:
        # Both variants: the CPU flex route runs the one for masks that hide future keys
        # (``score_mod(future_keys_hidden=True)``) where the call's mask does.
        found: list[str] = []
        if self._CHECKS_FUNCTION:
            make = functools.partial(self._make_score_mod, fast=False)
            found += _checked_mod(self, "score", ("score", False), make)[1]
        if self._CHECKS_PAST_FUNCTION:
            make = functools.partial(self._make_past_score_mod, fast=False)
            found += [
                h for h in _checked_mod(self, "score", ("score", False, "past"), make)[1] if h not in found
            ]
        return tuple(found)

    def has_fast_variant(self) -> bool:
        """True when ``score_mod(fast=True)`` may differ from the exact one (an opted-in approximation)."""
        return False

    def is_activation(self) -> bool:
        """Whether this spec or a part of it is activation attention (:attr:`activation`).

        Such a call runs on the routes that apply the score mod and return the lse: the route
        computes the softmax of the log-weights, ``out = sum_j w_ij v_j / sum_j w_ij`` with
        ``lse_i = log sum_j w_ij``, and ``fz.attention`` returns ``out * exp(lse)``. Chained after another score spec the weights
        are those of the chain's final scores (``Alibi() >> Sigmoid()``: ``sigmoid(s + bias_alibi)``).
        """
        if type(self).activation:
            return True
        return any(isinstance(part, ScoreSpec) and part.is_activation() for part in self._parts())

    def uses_head(self) -> bool:
        """Whether the score may depend on the head index (composites and user functions override)."""
        return self.depends_on_head

    def dense(self, scores: torch.Tensor) -> torch.Tensor:
        """Apply to a dense ``[B, H, Lq, Lkv]`` float64 tensor of scaled scores (oracle)."""
        raise NotImplementedError

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        """Raise ``ValueError`` if the spec cannot serve a problem of this shape."""

    def softcap_form(self) -> SoftCapForm | None:
        """Exact soft-cap form (see :class:`SoftCapForm`), or None."""
        return None

    def linear_bias_form(self) -> LinearBiasForm | None:
        """Exact additive per-head linear-bias form (ALiBi; see :class:`LinearBiasForm`), or None."""
        return None

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        """The score mod as SDPA's float ``attn_mask`` (an additive bias; see :class:`SdpaForm`), or None."""
        return None

    def captures_grad_tensors(self) -> bool:
        """True when the score_mod closes over tensors that require grad (learned biases). Traced,
        a composite that wraps a raw callable asks each part (a raw callable's own answer is read
        without walking it in the graph: ``functions.walkable_at_trace_time``)."""
        if _compat.is_compiling() and self._holds_callables():
            for part in self._parts():  # a loop: traced (see backends.flex._pair_gathers_only)
                if isinstance(part, ScoreSpec) and part.captures_grad_tensors():
                    return True
                if isinstance(part, torch.Tensor) and part.requires_grad:
                    return True
            return False
        return any(t.requires_grad for t in self.tensors())

    def reads_scalar_tensors(self) -> bool:
        """True when the ``score_mod`` may load a captured tensor of one element, which a compiled
        kernel reads at a fixed index (as :meth:`MaskSpec.reads_scalar_tensors`): by default,
        when a tensor this spec captures (:meth:`tensors`) has one element. A spec whose function
        reads a one-element table it derives from its fields says so itself."""
        return any(t.numel() == 1 for t in self.tensors())

    def __rshift__(self, other: ScoreSpec) -> ScoreSpec:
        if not isinstance(other, ScoreSpec):
            raise TypeError(
                "score >> expects another score spec (e.g. score_mods.SoftCap(cap=30.0)), "
                f"got {type(other).__name__}"
            )
        return COMBINATORS[">>"](self, other)


def as_4d(mask: torch.Tensor) -> torch.Tensor:
    """View a ``[Lq, Lkv]`` or ``[B, Lq, Lkv]`` boolean mask as ``[B|1, H|1, Lq, Lkv]``."""
    if mask.dim() == 2:
        return mask[None, None]
    if mask.dim() == 3:
        return mask[:, None]
    return mask


__all__ = [
    "COMBINATORS",
    "BlockMap",
    "GLOBAL_FORM_MAX_TOKENS",
    "GlobalTokensForm",
    "LinearBiasForm",
    "MaskMod",
    "MaskSpec",
    "ScoreMod",
    "ScoreSpec",
    "SdpaForm",
    "SoftCapForm",
    "Spec",
    "SPLIT_MASK_PAIRS",
    "SplitForm",
    "SplitPart",
    "StridedForm",
    "VarlenForm",
    "as_4d",
    "block_ranges",
    "function_mask_oracle",
    "function_score_oracle",
    "index_grids",
    "keep_static_float",
    "keeps_function_of",
    "spec_dataclass",
    "static_float",
    "static_int",
    "unused_forms",
]
