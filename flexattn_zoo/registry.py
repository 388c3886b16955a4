"""Name -> spec registries for masks and score mods.

``MASKS`` and ``SCORES`` are exposed as ``flexattn_zoo.masks.{get,names,register,register_function}``
and the same under ``flexattn_zoo.score_mods``. Names are snake_case and unique; a duplicate or
unknown name raises ``ValueError`` listing the valid names with the nearest one suggested.

Spec plugins: an installed distribution can declare entry points in the group
``flexattn_zoo.specs`` (:data:`PLUGIN_GROUP`), each naming a module that registers its specs with
these registries when imported. They are imported once, the first time either registry is listed
or looked up by name (not at ``import flexattn_zoo``); a plugin that fails to import is reported
with a ``RuntimeWarning`` naming it and is skipped. :func:`plugins` says what was loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
import re
import threading
import warnings
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

from flexattn_zoo import _compat
from flexattn_zoo.functions import FunctionMask, FunctionScore, check_mask_function, check_score_function
from flexattn_zoo.spec import MaskSpec, ScoreSpec, Spec

S = TypeVar("S", bound=Spec)
#: A class being registered (checked at run time to derive from the registry's base).
C = TypeVar("C", bound=Spec)
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def snake_case(name: str) -> str:
    """``SlidingWindow`` -> ``sliding_window``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


@dataclasses.dataclass(frozen=True)
class Entry:
    """One registered spec: its name, its factory and what the CLI shows about it."""

    name: str
    factory: Callable[..., Spec]
    params: tuple[tuple[str, str], ...]  # (name, default as text or "required")
    doc: str

    @property
    def summary(self) -> str:
        return self.doc.strip().splitlines()[0] if self.doc.strip() else ""


def _describe_params(cls: type) -> tuple[tuple[str, str], ...]:
    out = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out.append((f.name, repr(f.default)))
        elif f.default_factory is not dataclasses.MISSING:
            out.append((f.name, repr(f.default_factory())))
        else:
            out.append((f.name, "required"))
    return tuple(out)


def did_you_mean(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


#: The entry-point group of spec plugins: each entry point names a module (``pkg.masks``) or an
#: object in one (``pkg.masks:register``); importing it registers its specs.
PLUGIN_GROUP = "flexattn_zoo.specs"


@dataclasses.dataclass(frozen=True)
class Plugin:
    """One entry point of :data:`PLUGIN_GROUP` and how loading it went."""

    name: str
    value: str  # what the entry point names: "module" or "module:attr"
    dist: str  # the distribution declaring it ("name version"), or "" if unknown
    error: str | None  # None: loaded; else why it was skipped

    @property
    def loaded(self) -> bool:
        return self.error is None


class _Plugins:
    """Loads the spec plugins once, on the first lookup or listing of a registry."""

    def __init__(self) -> None:
        #: Read without the lock on every lookup (one attribute read; set once, never reset).
        self.done = False
        self._loading = False
        self._lock = threading.RLock()
        self.found: list[Plugin] = []

    def load(self) -> None:
        # A traced lookup does not import (Dynamo cannot trace imports or locks): the plugins load
        # at the first eager lookup instead.
        if self.done or _compat.is_compiling():
            return
        with self._lock:  # reentrant: a plugin that looks a name up while loading sees the rest
            if self.done or self._loading:
                return
            self._loading = True
            try:
                self.found = [self._load_one(ep) for ep in _entry_points()]
            finally:
                self._loading = False
                self.done = True

    @staticmethod
    def _load_one(ep: importlib.metadata.EntryPoint) -> Plugin:
        dist = getattr(ep, "dist", None)
        label = f"{dist.name} {dist.version}" if dist is not None else ""
        try:
            ep.load()
        except Exception as exc:  # a broken plugin must not break the library
            error = f"{type(exc).__name__}: {exc}"
            warnings.warn(
                f"flexattn_zoo: spec plugin {ep.name!r} ({ep.value}"
                f"{', from ' + label if label else ''}) failed to load and was skipped: {error}",
                RuntimeWarning,
                stacklevel=4,
            )
            return Plugin(ep.name, ep.value, label, error)
        return Plugin(ep.name, ep.value, label, None)


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    try:
        found = importlib.metadata.entry_points(group=PLUGIN_GROUP)
    except Exception as exc:  # a broken metadata directory on sys.path
        warnings.warn(f"flexattn_zoo: could not list spec plugins: {exc}", RuntimeWarning, stacklevel=4)
        return []
    # Sorted by name: a stable load order, so name clashes between plugins resolve the same way.
    # One entry point per (name, value): a distribution seen twice on sys.path loads once.
    unique = {(ep.name, ep.value): ep for ep in found}
    return [unique[k] for k in sorted(unique)]


_PLUGINS = _Plugins()


def _load_plugins() -> None:
    """Load the plugins unless done, or unless torch.compile traces this call. The tracing check
    comes first: Dynamo then never reads the flag, so no guard on it recompiles the caller's graph
    once an eager lookup has loaded the plugins."""
    if not _compat.is_compiling() and not _PLUGINS.done:
        _PLUGINS.load()


def plugins() -> list[Plugin]:
    """The spec plugins found in :data:`PLUGIN_GROUP` (loading them if that has not happened)."""
    _PLUGINS.load()
    return list(_PLUGINS.found)


class Registry(Generic[S]):
    """A thread-safe name -> spec-factory map."""

    def __init__(self, kind: str, base: type[S]) -> None:
        self.kind = kind
        self.base = base
        self._entries: dict[str, Entry] = {}
        self._lock = threading.Lock()
        #: Bumped on every (un)registration: caches keyed by a name include it (plan_cache).
        self.version = 0

    def _add(self, entry: Entry) -> None:
        if not isinstance(entry.name, str):  # re.match's own TypeError names no argument
            raise TypeError(f"{self.kind} name must be a snake_case str, got {type(entry.name).__name__}")
        if not _NAME.match(entry.name):
            raise ValueError(f"{self.kind} name must be snake_case ([a-z][a-z0-9_]*), got {entry.name!r}")
        with self._lock:
            if entry.name in self._entries:
                raise ValueError(
                    f"{self.kind} name {entry.name!r} is already registered; registered names: "
                    f"{', '.join(sorted(self._entries))}"
                )
            self._entries[entry.name] = entry
            self.version += 1

    @overload
    def register(self, cls: type[C], *, name: str | None = None) -> type[C]: ...
    @overload
    def register(self, cls: None = None, *, name: str | None = None) -> Callable[[type[C]], type[C]]: ...

    def register(
        self, cls: type[C] | None = None, *, name: str | None = None
    ) -> type[C] | Callable[[type[C]], type[C]]:
        """Class decorator: ``@masks.register`` or ``@masks.register(name="my_mask")``.

        The class must be a spec dataclass deriving from the registry's base class; its name
        defaults to the snake_case of the class name.
        """

        def decorate(klass: type[C]) -> type[C]:
            if not (isinstance(klass, type) and issubclass(klass, self.base)):
                raise TypeError(f"register expects a subclass of {self.base.__name__}, got {klass!r}")
            # A plain @dataclass registers fine but its instances then fail at every use with
            # "unhashable type" (eq=True drops Spec.__hash__, which plans and caches key on): only
            # spec_dataclass's frozen, eq=False dataclasses keep Spec's equality and hash.
            params = getattr(klass, "__dataclass_params__", None)
            if not dataclasses.is_dataclass(klass) or params is None or params.eq or not params.frozen:
                how = "not a dataclass" if not dataclasses.is_dataclass(klass) else "a plain dataclass"
                raise TypeError(
                    f"{klass.__name__} must be a spec dataclass, got {how}: decorate it with "
                    f"@spec_dataclass (from flexattn_zoo.spec) placed below @{self._decorator_name()}, "
                    "so that it is applied first"
                )
            reg_name = name or snake_case(klass.__name__)
            self._add(Entry(reg_name, klass, _describe_params(klass), klass.__doc__ or ""))
            klass.name = reg_name
            return klass

        return decorate(cls) if cls is not None else decorate

    def _decorator_name(self) -> str:
        """How users spell this registry's class decorator, for error messages."""
        return "masks.register" if self.base is MaskSpec else "score_mods.register"

    def register_function(
        self, name: str, fn: Callable[..., Any], *, doc: str | None = None
    ) -> Callable[..., Any]:
        """Register a plain ``mask_mod`` / ``score_mod`` function (no parameters) under ``name``.

        ``fn`` is checked as ``fz.attention`` checks a raw callable (flex signature, a bool /
        floating result on index tensors): TypeError naming ``mask`` / ``score_mod`` otherwise.

        ``get(name)`` then returns a spec wrapping ``fn``; its dense oracle evaluates ``fn`` as flex
        does (see :mod:`flexattn_zoo.functions`). Returns ``fn`` so this also works as ``@register_function`` helper.
        """
        if not callable(fn):
            raise TypeError(f"register_function(fn=...) must be callable, got {type(fn).__name__}")
        # The checks fz.attention makes on a raw callable, now rather than at the first call.
        if self.base is MaskSpec:
            probed = check_mask_function(fn, f"register_function({name!r}) mask")
        else:
            probed = check_score_function(fn, f"register_function({name!r}) score_mod")
        wrapper: type[FunctionMask | FunctionScore] = FunctionMask if self.base is MaskSpec else FunctionScore
        text = doc or fn.__doc__ or f"user function {getattr(fn, '__name__', name)}"

        def factory() -> Spec:
            return wrapper(fn=fn, label=name, scalar=probed.scalar, hazards=probed.hazards)

        self._add(Entry(name, factory, (), text))
        return fn

    def unregister(self, name: str) -> None:
        """Remove ``name`` (mainly for tests that register temporary specs)."""
        with self._lock:
            found = self._entries.pop(name, None)
            self.version += 1
        if found is None:
            # Outside the lock: _unknown() calls names(), which takes the (non-reentrant) lock.
            raise ValueError(self._unknown(name))

    def _unknown(self, name: str) -> str:
        names = self.names()
        return f"unknown {self.kind} {name!r}; valid names: {', '.join(names)}.{did_you_mean(name, names)}"

    def entry(self, name: str) -> Entry:
        if not isinstance(name, str):
            raise TypeError(f"{self.kind} name must be a str, got {type(name).__name__}")
        _load_plugins()
        # One dict read is atomic; no lock, so torch.compile can trace a lookup by name.
        found = self._entries.get(name)
        if found is None:
            raise ValueError(self._unknown(name))
        return found

    def find(self, name: str) -> Entry | None:
        """The entry registered as ``name``, or None (one dict read: the plan cache's lookup)."""
        # The flag alone, first: this is the eager per-call path (plan-cache keys are not made
        # while tracing; a traced read would cost at most one recompile, see _load_plugins).
        if not _PLUGINS.done:
            _PLUGINS.load()
        return self._entries.get(name)

    def get(self, name: str, **params: Any) -> S:
        """Build the spec registered as ``name`` with ``params``; bad parameters raise ValueError."""
        entry = self.entry(name)
        valid = [p for p, _ in entry.params]
        unknown = [p for p in params if p not in valid]
        if unknown:
            raise ValueError(
                f"{self.kind} {name!r} got unknown parameter(s) {', '.join(map(repr, unknown))}; "
                f"valid parameters: {', '.join(valid) or '(none)'}.{did_you_mean(unknown[0], valid)}"
            )
        missing = [p for p, d in entry.params if d == "required" and p not in params]
        if missing:
            raise ValueError(f"{self.kind} {name!r} needs parameter(s): {', '.join(missing)}")
        spec = entry.factory(**params)
        assert isinstance(spec, self.base)  # register / register_function store factories of the base
        return spec

    def names(self) -> list[str]:
        _load_plugins()
        with self._lock:
            return sorted(self._entries)

    def entries(self) -> list[Entry]:
        _load_plugins()
        with self._lock:
            return [self._entries[n] for n in sorted(self._entries)]

    def __contains__(self, name: object) -> bool:
        _load_plugins()
        return name in self._entries


MASKS: Registry[MaskSpec] = Registry("mask", MaskSpec)
SCORES: Registry[ScoreSpec] = Registry("score_mod", ScoreSpec)
