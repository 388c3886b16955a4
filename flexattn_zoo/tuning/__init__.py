"""Measured route choice (``fz.tune``): time the routes ``backend="auto"`` may take for a kind of
call, keep the fastest, reuse it -- in the spirit of ``torch.backends.cudnn.benchmark`` and
Triton's autotune.

Off by default; the static order of :mod:`flexattn_zoo.arch` decides then. Switches, the
narrowest winning: ``fz.attention(..., tune=True|False)`` per call (``None``, the default, follows
the global setting); ``fz.tune.enable()`` / ``fz.tune.disable()`` / ``with fz.tune.enabled():``
for the process (the context manager restores what was set before; the setting is process-wide,
not per thread); and the environment variable ``FLEXATTN_ZOO_TUNE=1`` when neither was called.

Conventions:

* **Signature** (:class:`Signature`): the kind of call a measurement stands for -- device name,
  GPU generation, dtype, head dims, GQA ratio, power-of-two buckets of ``batch * heads``, ``Lq``
  and ``Lkv`` (``Lq <= 16`` gives the decode buckets 1, 2, 4, 8, 16), the mask's structure (its
  registry names and composition, never its tensor values; a raw callable by its qualified name)
  with a density bucket, the score mod's structure (``~approx`` when it allows a fast variant),
  mode (``fwd`` / ``fwdbwd``), ``deterministic`` and ``return_lse``.
* **Density**: the fraction of live 128-blocks (coarser blocks above 256 blocks a side) of the
  mask *at the bucket lengths*, from the spec's closed-form block map on the CPU, as the upper
  bound of a power-of-two bucket (``"1"``: more than half, ``"1/2"``, ... ``"<=1/64"``); no mask
  is ``"1"``. ``"unknown"`` for masks holding tensors (their layout changes per step; reading it
  would sync), raw callables, masks without a closed form, and a caller's BlockMask.
* **What is timed**: the routes that accept the call and are on ``auto``'s list for this
  generation and mode, except routes that hold ``Lq x Lkv`` scores (``Backend.materializes``)
  unless the static order picks one itself. Each runs on clones of the call's inputs (the
  caller's tensors, their ``.grad`` and version counters are never touched; in ``fwdbwd`` mode
  each step is forward + ``torch.autograd.grad`` with a fixed random output gradient drawn from a
  private generator). The first call is the warm-up (and compile); its seconds, less one steady
  call, are reported as ``compile_s``. Then at least ``warmup`` untimed calls and the median of
  at least ``reps`` timed ones, both raised for short calls to fill a minimum duration, the timed
  calls of all routes in interleaved rounds so that drift of the host moves them alike
  (:mod:`flexattn_zoo.tuning.timing`). A route that raises is left out, its error recorded.
* **Decision** (:func:`decide`, deterministic given the timings): the fastest route, ties broken by
  the static order; it displaces the static order's choice only when faster by more than
  ``margin`` (default 5%), so timing noise does not flip between equal kernels. A measured winner
  is used only where it accepts the call (the table proposes, the verdicts dispose).
* **Never timed** while ``torch.compile`` / ``torch.export`` traces, while a CUDA stream is
  capturing a graph, under torch's ``context_parallel``, nor for tensor subclasses: there only the
  in-memory table (loaded from disk at first use) or the static order is read. A traced call
  reads the table as plain Python, so Dynamo guards on it: a graph traced before a measurement
  retraces after it (only while the table holds entries; an empty table adds no guards).
* **Caches**: every change of the table (measurement, load, clear) bumps :func:`state`'s version,
  which, with the process-wide switch, is part of ``plan_cache.process_state()``, the key of every
  cached plan (and of ``fz.decode``'s per-signature plans); the per-call ``tune`` is part of the
  plan-cache key. A cached plan never outlives a change of what it was chosen from.
* **Persistence**: :mod:`flexattn_zoo.tuning.store` (one JSON file per device and environment,
  atomic, merged under a lock).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import sys
import threading
import typing
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from flexattn_zoo import _compat
from flexattn_zoo.arch import generation
from flexattn_zoo.backends import BY_NAME
from flexattn_zoo.compose import And, Chain, MaskOnShard, Not, Or, ScoreOnShard
from flexattn_zoo.functions import FunctionMask, FunctionScore
from flexattn_zoo.lru import LRUCache
from flexattn_zoo.problem import Problem
from flexattn_zoo.spec import MaskSpec, ScoreSpec, Spec
from flexattn_zoo.tuning import store
from flexattn_zoo.tuning.timing import time_routes
from flexattn_zoo.validation import check_device_arg, check_flag

TUNE_ENV = "FLEXATTN_ZOO_TUNE"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


# ---------------------------------------------------------------------------------------------
# Switches and settings


@dataclasses.dataclass(frozen=True)
class Settings:
    """How measurements are taken (see the module docstring). ``persist=False`` keeps the table
    in memory only: no file is read or written (what was read before stays)."""

    warmup: int = 2
    reps: int = 10
    margin: float = 0.05
    persist: bool = True


_SETTINGS = Settings()
#: ``enable()`` / ``disable()`` / ``enabled()``; None: the environment variable decides.
_OVERRIDE: bool | None = None


def configure(
    *,
    warmup: int | None = None,
    reps: int | None = None,
    margin: float | None = None,
    persist: bool | None = None,
) -> Settings:
    """Change how later measurements are taken; returns the settings in force before."""
    global _SETTINGS
    old = _SETTINGS
    changes: dict[str, Any] = {}
    for name, value, low in (("warmup", warmup, 0), ("reps", reps, 1)):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int >= {low}, got {type(value).__name__}")
            if value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
            changes[name] = value
    if margin is not None:
        if isinstance(margin, bool) or not isinstance(margin, (int, float)):
            raise TypeError(f"margin must be a number in [0, 1), got {type(margin).__name__}")
        if not 0 <= margin < 1:
            raise ValueError(f"margin must be a number in [0, 1), got {margin!r}")
        changes["margin"] = float(margin)
    if persist is not None:
        changes["persist"] = check_flag("persist", persist)
    _SETTINGS = dataclasses.replace(old, **changes)
    return old


def settings() -> Settings:
    return _SETTINGS


def enable() -> None:
    """Tune every ``fz.attention`` call of this process that does not pass ``tune=False``."""
    global _OVERRIDE
    _OVERRIDE = True


def disable() -> None:
    """Tune no call that does not pass ``tune=True`` (also overrides ``FLEXATTN_ZOO_TUNE``)."""
    global _OVERRIDE
    _OVERRIDE = False


@contextlib.contextmanager
def enabled(on: bool = True) -> Iterator[None]:
    """``enable()`` (``disable()`` for ``on=False``) inside the block, then the previous setting."""
    global _OVERRIDE
    check_flag("on", on)
    previous = _OVERRIDE
    _OVERRIDE = on
    try:
        yield
    finally:
        _OVERRIDE = previous


def is_enabled() -> bool:
    """The process-wide setting: ``enable`` / ``disable`` if called, else ``FLEXATTN_ZOO_TUNE``."""
    if _OVERRIDE is not None:
        return _OVERRIDE
    raw = os.environ.get(TUNE_ENV, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{TUNE_ENV} must be 1/true/yes/on or 0/false/no/off (or unset), got {raw!r}")


def resolve(tune: Any) -> bool:
    """Whether a call with ``tune=`` (None: the process-wide setting) is tuned."""
    return is_enabled() if tune is None else check_flag("tune", tune)


# ---------------------------------------------------------------------------------------------
# Signatures


class Signature(NamedTuple):
    """The kind of call one measurement stands for (see the module docstring). Hashable, and
    JSON-serialisable as a mapping (:meth:`to_json`)."""

    device: str
    arch: str
    dtype: str
    head_dim: int
    v_dim: int
    gqa: int
    batch_heads: int
    q_len: int
    kv_len: int
    mask: str
    density: str
    score: str
    mode: str
    deterministic: bool
    return_lse: bool

    def describe(self) -> str:
        """One line, e.g. ``cpu/cpu float32 D=16 gqa=1 BH<=2 Lq<=64 Lkv<=64 causal@1 none fwd``."""
        dims = f"D={self.head_dim}" + (f"/{self.v_dim}" if self.v_dim != self.head_dim else "")
        flags = "".join(f" {n}" for n in ("deterministic", "return_lse") if getattr(self, n))
        return (
            f"{self.device}/{self.arch} {self.dtype} {dims} gqa={self.gqa} BH<={self.batch_heads} "
            f"Lq<={self.q_len} Lkv<={self.kv_len} {self.mask}@{self.density} {self.score} {self.mode}{flags}"
        )

    def to_json(self) -> dict[str, Any]:
        return self._asdict()

    @classmethod
    def from_json(cls, data: Any) -> Signature:
        if not isinstance(data, dict) or set(data) != set(cls._fields):
            raise ValueError(f"a signature has the keys {', '.join(cls._fields)}")
        for name in cls._fields:
            want = _FIELD_TYPES[name]
            value = data[name]
            if type(value) is not want:
                raise ValueError(f"signature {name} must be a {want.__name__}, got {value!r}")
        return cls(**data)


_FIELD_TYPES: dict[str, type] = typing.get_type_hints(Signature)


def bucket(n: Any) -> int:
    """The smallest power of two >= ``n`` (0 for 0). While ``torch.compile`` traces with dynamic
    shapes ``n`` may be symbolic: the comparisons become guards on its bucket."""
    if not _compat.is_compiling():
        n = int(n)
        return 0 if n <= 0 else 1 << (n - 1).bit_length()
    b = 1
    while b < n:
        b *= 2
    return b


def spec_kind(spec: Spec | None) -> str:
    """A spec's structure as text, without parameters or tensor values: registry names (the class
    name for a class that states none, such as a subclass of a preset), ``&`` and ``|`` parts
    sorted (they commute), ``~``, ``>>`` chains in order, ``fn:module.qualname`` for raw
    callables, ``~approx`` on score specs that allow a fast variant; ``none`` for None."""
    if spec is None:
        return "none"
    if isinstance(spec, (And, Or)):
        op = " & " if isinstance(spec, And) else " | "
        return "(" + op.join(sorted(spec_kind(p) for p in spec.parts)) + ")"
    if isinstance(spec, Not):
        return "~" + spec_kind(spec.part)
    if isinstance(spec, Chain):
        return " >> ".join(spec_kind(m) for m in spec.mods)
    if isinstance(spec, (MaskOnShard, ScoreOnShard)):
        return spec_kind(spec.part)
    if isinstance(spec, (FunctionMask, FunctionScore)):
        fn = spec.fn
        name = getattr(fn, "__qualname__", None) or spec.label or type(fn).__qualname__
        return f"fn:{getattr(fn, '__module__', None) or '?'}.{name}"
    # The registry name a class states itself: a subclass inherits its parent's, but not its
    # parent's function or forms, so its measurements are its own.
    kind = type(spec).__dict__.get("name") or type(spec).__name__
    if isinstance(spec, ScoreSpec) and spec.has_fast_variant():
        kind += "~approx"
    return kind


#: Block maps evaluated for densities: at most this many blocks a side.
_DENSITY_SIDE = 256
_DENSITIES: LRUCache[str] = LRUCache(256)
_SPEC = "<spec>"


def density(mask: MaskSpec | None, q_len: int, kv_len: int) -> str:
    """The density bucket of ``mask`` at (bucket) lengths ``q_len`` x ``kv_len`` (module docstring).

    The spec is first written as plain constants (:func:`_flat`: class path and parameters), and
    the density computed from a spec rebuilt from them: eagerly (cached), and while
    ``torch.compile`` traces as a constant function of those constants run at trace time -- the
    same value both ways, with guards only on the parameters (as for any spec a call reads)."""
    if mask is None:
        return "1"
    flat = _flat(mask)
    if flat is None:
        return "unknown"
    if _compat.is_compiling():
        return _traced_density(flat, q_len, kv_len)
    return _DENSITIES.get_or_create((flat, q_len, kv_len), lambda: _density(flat, q_len, kv_len))


def _flat(spec: Spec) -> tuple[Any, ...] | None:
    """``spec`` as nested tuples of str / int / bool / None: ``("<spec>", module, qualname,
    ((field, value), ...))``; None when it holds anything else (tensors, callables, floats)."""
    items = []
    for f in dataclasses.fields(spec):  # type: ignore[arg-type]  # specs are dataclasses
        if not f.init:
            continue
        value = _flat_value(getattr(spec, f.name))
        if value is _NOT_FLAT:
            return None
        items.append((f.name, value))
    cls = type(spec)
    return (_SPEC, cls.__module__, cls.__qualname__, tuple(items))


_NOT_FLAT = object()


def _flat_value(value: Any) -> Any:
    if isinstance(value, Spec):
        flat = _flat(value)
        return _NOT_FLAT if flat is None else flat
    if isinstance(value, tuple):
        parts = tuple(_flat_value(v) for v in value)
        return _NOT_FLAT if any(p is _NOT_FLAT for p in parts) else parts
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return _compat.static_int(value)  # a model constant: specialized (guarded) when traced
    return _NOT_FLAT


def _unflat(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 4 and value[0] == _SPEC:
        _, module, qualname, items = value
        cls: Any = sys.modules[module]
        for part in qualname.split("."):
            cls = getattr(cls, part)
        return cls(**{name: _unflat(v) for name, v in items})
    if isinstance(value, tuple):
        return tuple(_unflat(v) for v in value)
    return value


def _density(flat: tuple[Any, ...], q_len: int, kv_len: int) -> str:
    if q_len <= 0 or kv_len <= 0:
        return "unknown"
    block = 128
    while max(-(-q_len // block), -(-kv_len // block)) > _DENSITY_SIDE:
        block *= 2
    try:
        mask = _unflat(flat)
        found = mask.bind(q_len, kv_len).block_map(q_len, kv_len, block, block, "cpu")
    except Exception:  # a spec that cannot describe the bucket lengths: no density
        return "unknown"
    if found is None:
        return "unknown"
    live = float(found.any.float().mean())
    if live <= 0:
        return "0"
    if live <= 1 / 64:
        return "<=1/64"
    upper = 1
    while live <= 1 / (2 * upper):
        upper *= 2
    return "1" if upper == 1 else f"1/{upper}"


_traced_density = torch.compiler.assume_constant_result(_density)


def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` for CUDA devices, the device type otherwise (``"cpu"``)."""
    if device.type != "cuda":
        return device.type
    index = device.index
    if index is None:
        index = torch.cuda.current_device()
    return _cuda_names()[index]


_CUDA_NAMES: list[tuple[str, ...]] = []


@torch.compiler.assume_constant_result
def _cuda_names() -> tuple[str, ...]:
    """Every visible CUDA device's name, looked up once (a constant while traced)."""
    if not _CUDA_NAMES:
        _CUDA_NAMES.append(tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
    return _CUDA_NAMES[0]


def signature(problem: Problem, device: torch.device) -> Signature:
    """The :class:`Signature` of ``problem`` run on ``device``."""
    p = problem
    q_len, kv_len = bucket(p.q_len), bucket(p.kv_len)
    mask = "block_mask" if p.user_block_mask else spec_kind(p.mask)
    dens = "unknown" if p.user_block_mask else density(p.mask, q_len, kv_len)
    assert p.v_dim is not None  # Problem.__post_init__ fills it in
    return Signature(
        device=device_name(device),
        arch=generation(p.arch),
        dtype=str(p.dtype).removeprefix("torch."),
        head_dim=p.head_dim,
        v_dim=p.v_dim,
        gqa=p.heads // p.kv_heads,
        batch_heads=bucket(p.batch * p.heads),
        q_len=q_len,
        kv_len=kv_len,
        mask=mask,
        density=dens,
        score=spec_kind(p.score),
        mode=p.mode,
        deterministic=p.deterministic,
        return_lse=p.return_lse,
    )


# ---------------------------------------------------------------------------------------------
# Entries and the table


def _pairs(data: Any, kind: type | tuple[type, ...], what: str) -> tuple[tuple[str, Any], ...]:
    if not isinstance(data, dict):
        raise ValueError(f"entry {what} must be a mapping")
    out = []
    for name, value in data.items():
        ok = isinstance(value, kind) and not isinstance(value, bool)
        if not isinstance(name, str) or not ok:
            raise ValueError(f"entry {what}: bad item {name!r}: {value!r}")
        out.append((name, value if kind is str else float(value)))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One measurement: the ``winner``, the static order's choice then (``static``), per-route
    median milliseconds (``ms``) and first-call seconds less a steady call (``compile_s``), the
    errors of routes that failed, the settings used and the UTC date (ISO 8601)."""

    winner: str
    static: str
    ms: tuple[tuple[str, float], ...]
    compile_s: tuple[tuple[str, float], ...]
    errors: tuple[tuple[str, str], ...] = ()
    reps: int = 0
    warmup: int = 0
    date: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "winner": self.winner,
            "static": self.static,
            "ms": dict(self.ms),
            "compile_s": dict(self.compile_s),
            "errors": dict(self.errors),
            "reps": self.reps,
            "warmup": self.warmup,
            "date": self.date,
        }

    @classmethod
    def from_json(cls, data: Any) -> Entry:
        if not isinstance(data, dict):
            raise ValueError("an entry is a mapping")
        for name in ("winner", "static", "date"):
            if not isinstance(data.get(name), str):
                raise ValueError(f"entry {name} must be a string")
        for name in ("reps", "warmup"):
            if type(data.get(name)) is not int:
                raise ValueError(f"entry {name} must be an int")
        return cls(
            winner=data["winner"],
            static=data["static"],
            ms=_pairs(data.get("ms"), (int, float), "ms"),
            compile_s=_pairs(data.get("compile_s"), (int, float), "compile_s"),
            errors=_pairs(data.get("errors", {}), str, "errors"),
            reps=data["reps"],
            warmup=data["warmup"],
            date=data["date"],
        )


@dataclasses.dataclass(frozen=True)
class TuneInfo:
    """What tuning said about one plan: the call's signature, its table entry (None: not
    measured) and the routes a measurement compares for it (``candidates``, in static order)."""

    signature: Signature
    entry: Entry | None
    candidates: tuple[str, ...]

    def untimed(self) -> tuple[str, ...]:
        """This call's candidates the entry's measurement did not compare (neither timed nor
        failed): one signature covers a bucket of lengths, and a route may accept some of them
        only (equal chunks, Lq == Lkv), so a winner over other routes says nothing about them."""
        e = self.entry
        if e is None:
            return self.candidates
        seen = {n for n, _ in e.ms} | {n for n, _ in e.errors}
        return tuple(c for c in self.candidates if c not in seen)

    def measured(self, backend: str) -> bool:
        """Whether ``backend`` is this signature's measured winner (timed, not only left over)
        against every route this call could take."""
        e = self.entry
        return (
            e is not None
            and e.winner == backend
            and any(n == backend for n, _ in e.ms)
            and not self.untimed()
        )

    def chosen(self, static: str) -> str:
        """The route to take: the measured winner where it is a candidate here and was measured
        against all of this call's candidates, else ``static``."""
        e = self.entry
        return e.winner if e is not None and e.winner in self.candidates and not self.untimed() else static

    def describe(self, backend: str) -> str:
        e = self.entry
        if e is None:
            if len(self.candidates) < 2:
                return f"tuning: on; nothing to compare ({', '.join(self.candidates)} alone): static order"
            return "tuning: on; not measured yet for this signature: static order"
        if e.winner != backend:
            if e.winner in self.candidates and self.untimed():
                return (
                    f"tuning: measured winner {e.winner} was not compared with "
                    f"{', '.join(self.untimed())}, which can run this call: static order"
                )
            return f"tuning: measured winner {e.winner} cannot run this call: static order"
        if not self.measured(backend):
            failed = "; ".join(f"{n}: {m}" for n, m in e.errors)
            return f"tuning: the measurement failed ({failed}): static order"
        ms = ", ".join(f"{n} {t:.4g} ms" for n, t in e.ms)
        comp = ", ".join(f"{n} {t:.3g} s" for n, t in e.compile_s)
        failed = "".join(f"; {n} failed: {m}" for n, m in e.errors)
        return (
            f"tuning: chosen by measurement ({e.date}, median of >= {e.reps} calls after >= {e.warmup} "
            "warm-ups): "
            f"{ms}; first-call compile {comp}{failed}; static order: {e.static}"
        )


_LOCK = threading.RLock()
_TABLE: dict[Signature, Entry] = {}
_VERSION = 0
#: Device name -> the file its entries were loaded from.
_LOADED: dict[str, Path] = {}
#: One measurement at a time per process (concurrent timings would disturb each other).
_MEASURE_LOCK = threading.Lock()


def _bump() -> None:
    global _VERSION
    _VERSION += 1


def state() -> tuple[bool | None, int]:
    """What tuning contributes to ``plan_cache.process_state()``: the process-wide switch (as
    set by enable/disable; the environment variable is read there as well) and the table version."""
    return _OVERRIDE, _VERSION


def table() -> dict[Signature, Entry]:
    """A copy of the current table (this machine's file for the default device loaded first)."""
    if not _compat.is_compiling():
        _load(device_name(_default_device()))
    with _LOCK:
        return dict(_TABLE)


def cache_path(device: torch.device | str | None = None) -> Path:
    """The file holding ``device``'s measurements in this environment (default: the current CUDA
    device when there is one, else the CPU). It may not exist yet.

    Raises:
        OSError: there is no cache directory (no home directory, and no variable naming one).
    """
    if device is None:
        return store.path_for(device_name(_default_device()))
    return store.path_for(device_name(check_device_arg(device, "fz.tune.cache_path(device=...)")))


def _default_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _newer(a: Entry, b: Entry | None) -> bool:
    return b is None or a.date > b.date


def _parse(raw: list[dict[str, Any]], path: Path, device: str) -> dict[Signature, Entry]:
    out: dict[Signature, Entry] = {}
    bad = 0
    for item in raw:
        try:
            sig = Signature.from_json(item.get("signature"))
            entry = Entry.from_json(item)
        except (ValueError, TypeError, ArithmeticError):  # OverflowError: an int beyond float's range
            bad += 1
            continue
        if sig.device == device and _newer(entry, out.get(sig)):
            out[sig] = entry
    if bad:
        warnings.warn(f"flexattn_zoo tuning: dropped {bad} malformed entries of {path}", stacklevel=3)
    return out


def ensure_loaded(device: torch.device) -> None:
    """Load ``device``'s file into the table, once (again if the cache directory changed). While
    ``torch.compile`` traces, the load runs eagerly at trace time (a constant of the graph)."""
    if _compat.is_compiling():
        _traced_load(device.type, -1 if device.index is None else device.index)
        return
    _load(device_name(device))


@torch.compiler.assume_constant_result
def _traced_load(device_type: str, index: int) -> bool:
    _load(device_name(torch.device(device_type) if index < 0 else torch.device(device_type, index)))
    return True


def _load(name: str) -> None:
    """Merge device ``name``'s file into the table, once per file: a changed cache directory
    replaces the entries read from the previous one. Nothing is read with ``persist=False``."""
    if not _SETTINGS.persist:
        return
    try:
        path = store.path_for(name)
    except OSError as exc:  # no cache directory: nothing to read, what is in memory stays
        warnings.warn(f"flexattn_zoo tuning: {exc}; measurements stay in memory", stacklevel=3)
        return
    if _LOADED.get(name) == path:
        return
    with _LOCK:
        previous = _LOADED.get(name)
        if previous == path:
            return
        changed = False
        if previous is not None:  # FLEXATTN_ZOO_CACHE_DIR changed: the other file's entries go
            for sig in [s for s in _TABLE if s.device == name]:
                del _TABLE[sig]
                changed = True
        for sig, entry in _parse(store.read(path) or [], path, name).items():
            if _newer(entry, _TABLE.get(sig)):
                _TABLE[sig] = entry
                changed = True
        _LOADED[name] = path
        if changed:
            _bump()


def _save(name: str, drop: frozenset[Signature] = frozenset()) -> None:
    """Merge this process's entries for device ``name`` into its file (and the file's into the
    table), leaving out ``drop``: under the file's lock, atomically. Warns instead of raising."""
    if not _SETTINGS.persist:
        return
    try:
        path = store.path_for(name)
    except OSError as exc:  # no cache directory
        warnings.warn(f"flexattn_zoo tuning: {exc}; kept in memory", stacklevel=3)
        return
    try:
        with store.locked(path):
            try:
                found = store.read(path, unreadable_raises=True)
            except OSError as exc:  # entries of other processes may be there: never replace them
                warnings.warn(f"flexattn_zoo tuning: cannot read {path}: {exc}; kept in memory", stacklevel=3)
                return
            disk = {s: e for s, e in _parse(found or [], path, name).items() if s not in drop}
            with _LOCK:
                merged = dict(disk)
                for sig, entry in _TABLE.items():
                    if sig.device == name and _newer(entry, merged.get(sig)):
                        merged[sig] = entry
                changed = False
                for sig, entry in disk.items():
                    if _newer(entry, _TABLE.get(sig)):
                        _TABLE[sig] = entry
                        changed = True
                if changed:
                    _bump()
                _LOADED[name] = path
            rows = [{"signature": s.to_json(), **e.to_json()} for s, e in sorted(merged.items())]
            store.write(path, store.environment(name), rows)
    except OSError as exc:
        warnings.warn(f"flexattn_zoo tuning: cannot write {path}: {exc}; kept in memory", stacklevel=3)


def record(sig: Signature, entry: Entry) -> None:
    """Put ``entry`` in the table and in its device's file."""
    with _LOCK:
        _TABLE[sig] = entry
        _bump()
    _save(sig.device)


def clear(signature: Signature | None = None) -> None:
    """Forget every measurement (or only ``signature``'s), in memory and in this environment's
    files (those of the devices this process has seen, the CPU and every visible CUDA device)."""
    if signature is not None and not isinstance(signature, Signature):
        raise TypeError(
            f"fz.tune.clear(signature=...) must be a Signature (a key of fz.tune.table()) or None, "
            f"got {type(signature).__name__}"
        )
    with _LOCK:
        if signature is None:
            names = {s.device for s in _TABLE} | set(_LOADED) | {"cpu"}
            if not _compat.is_compiling() and torch.cuda.is_available():
                names |= set(_cuda_names())
            _TABLE.clear()
        else:
            names = {signature.device}
            _TABLE.pop(signature, None)
        _bump()
        if _SETTINGS.persist:  # the files go below: nothing left to load from them
            for name in names:
                try:
                    _LOADED[name] = store.path_for(name)
                except OSError:  # no cache directory: no file to clear (warned below)
                    _LOADED.pop(name, None)
    if not _SETTINGS.persist:
        return
    for name in sorted(names):
        try:
            if signature is None:
                store.remove(store.path_for(name))
            else:
                _save(name, drop=frozenset({signature}))
        except OSError as exc:  # the message names the file, or says there is no directory
            warnings.warn(f"flexattn_zoo tuning: cannot clear the {name} cache file: {exc}", stacklevel=2)


# ---------------------------------------------------------------------------------------------
# Planning and measuring


def candidates(accepted: Sequence[str], static: str) -> tuple[str, ...]:
    """The routes a measurement compares: ``accepted`` (auto's accepting routes, in static order)
    less those that hold ``Lq x Lkv`` scores, unless that is the static choice ``static``."""
    return tuple(n for n in accepted if n == static or not BY_NAME[n].materializes)


def consult(problem: Problem, device: torch.device, accepted: Sequence[str], static: str) -> TuneInfo | None:
    """Tuning's view of a call ``auto`` plans (read only: nothing is timed or loaded here).
    While ``torch.compile`` traces, an empty table is not consulted at all (no guards)."""
    if _compat.is_compiling() and not _TABLE:
        return None
    sig = signature(problem, device)
    return TuneInfo(sig, _TABLE.get(sig), candidates(accepted, static))


def can_measure(q: Any) -> bool:
    """Whether a call with query ``q`` may be timed now: eagerly, on a plain tensor, not while a
    CUDA stream captures a graph."""
    if _compat.is_compiling() or type(q) is not torch.Tensor:
        return False
    return not (q.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def needs_measuring(info: TuneInfo | None) -> bool:
    return info is not None and info.entry is None and len(info.candidates) > 1


def decide(ms: dict[str, float], order: Sequence[str], static: str, margin: float) -> str:
    """The winner of timings ``ms`` (see the module docstring)."""
    if not ms:
        return static
    rank = {n: i for i, n in enumerate(order)}
    best = min(ms, key=lambda n: (ms[n], rank.get(n, len(rank))))
    if static in ms and best != static and not ms[best] < ms[static] * (1 - margin):
        return static
    return best


Run = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, Any]]


def _steps(
    run: Run, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: Problem
) -> Callable[[str], Callable[[], None]]:
    """Per route name, one step on private clones of q/k/v: a forward (``fwd``), or a forward and
    ``torch.autograd.grad`` for the clones and the learnable tensors the score spec captures
    (``fwdbwd``; ``autograd.grad`` accumulates into no ``.grad``)."""
    qc, kc, vc = (t.detach().clone().requires_grad_(t.requires_grad) for t in (q, k, v))
    if problem.mode == "fwd":

        def forward(name: str) -> Callable[[], None]:
            def step() -> None:
                with torch.no_grad():
                    run(name, qc, kc, vc)

            return step

        return forward
    captured = [t for t in problem.score.tensors() if t.requires_grad] if problem.score is not None else []
    wrt = [t for t in (qc, kc, vc) if t.requires_grad] + captured
    gen = torch.Generator(device=q.device).manual_seed(0)
    assert problem.v_dim is not None
    shape = (problem.batch, problem.heads, problem.q_len, problem.v_dim)
    grad_out = torch.randn(shape, generator=gen, device=q.device, dtype=torch.float32).to(q.dtype)

    def training(name: str) -> Callable[[], None]:
        def step() -> None:
            with torch.enable_grad():
                out, _ = run(name, qc, kc, vc)
                torch.autograd.grad(out, wrt, grad_out, allow_unused=True)

        return step

    return training


def _message(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def measure(
    info: TuneInfo, static: str, run: Run, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: Problem
) -> Entry:
    """Time ``info.candidates`` (``run(name, q, k, v)`` runs one route), record the winner and
    return the entry (another thread's, if it measured the signature meanwhile)."""
    with _MEASURE_LOCK:
        found = _TABLE.get(info.signature)
        if found is not None:
            return found
        cfg = _SETTINGS
        ms: dict[str, float] = {}
        compile_s: dict[str, float] = {}
        errors: dict[str, str] = {}
        names: Sequence[str] = info.candidates
        try:
            step_of = _steps(run, q, k, v, problem)
        except Exception as exc:  # no room for the copies: nothing is timed, the static order stays
            errors["(inputs)"] = _message(exc)
            names = ()
        timed = time_routes({name: step_of(name) for name in names}, q.device, cfg.warmup, cfg.reps)
        for name, result in timed.items():
            if isinstance(result, Exception):  # a route that fails while timed is left out, with the reason
                errors[name] = _message(result)
                continue
            median, first = result
            ms[name] = median
            compile_s[name] = max(0.0, first - median / 1e3)
        entry = Entry(
            winner=decide(ms, info.candidates, static, cfg.margin),
            static=static,
            ms=tuple(ms.items()),
            compile_s=tuple(compile_s.items()),
            errors=tuple(errors.items()),
            reps=cfg.reps,
            warmup=cfg.warmup,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds"),
        )
        record(info.signature, entry)
        return entry


__all__ = [
    "TUNE_ENV",
    "Entry",
    "Settings",
    "Signature",
    "TuneInfo",
    "bucket",
    "cache_path",
    "clear",
    "configure",
    "decide",
    "disable",
    "enable",
    "enabled",
    "is_enabled",
    "settings",
    "signature",
    "spec_kind",
    "table",
    "time_routes",
]
