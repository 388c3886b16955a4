"""Replays of FlashAttention-4's launches: FA4's Python once per kind of call, its kernels every call.

FA4's launchers (``flash_attn_func``, ``flash_attn_varlen_func``, ``_flash_attn_bwd``) spend tens
of microseconds of host time per call in Python (checks, tile and scheduler choice, the JIT-cache
key) before they allocate their outputs and call compiled CuTe kernels. For inputs with the same
shapes, strides, dtypes, device, pointer alignment and scalar arguments they take the same
decisions every time, so a kind of call needs that Python once.

**Recording.** The first call of a kind (:func:`launch` with a new ``key``) runs FA4's launcher
and notes the kind, so that kinds met once (a new document count every batch) cost nothing more.
The second runs it again while two things watch it: every compiled function FA4 looks up in the
JIT caches of ``flash_attn.cute.interface`` is wrapped to log its arguments when this thread
calls it, and a ``TorchDispatchMode`` logs every torch op the launcher runs. The call becomes a
:class:`Program` when everything it did is one of

* an allocation (``empty``, ``zeros``, ``empty_like``, ...) or an in-place fill (``zero_``,
  ``fill_``): re-run with the same arguments;
* a view (``transpose``, ``as_strided``, ...): re-run; ``detach`` and ``alias`` are passed
  through, so the kernels get the tensor itself (the same memory; FA4's kernels take tensors
  through DLPack's C exchange, which does not look at ``requires_grad``);
* a compiled-kernel call whose tensor arguments are the call's inputs or tensors made by the
  steps above, and whose other arguments are plain values (numbers, strings, ``None``, dtypes,
  and tuples of these and of such tensors);

and the launcher's result is made of such tensors. Anything else (a copy, such as FA4's clone of
an input whose pointer is not aligned, a reduction, a read of a tensor's value on the host, an
argument the recording cannot place, a kernel launched outside the JIT caches) makes the kind
*refused*: its calls keep running FA4's own launcher. Before a program is kept it is run once on
the recorded call's inputs, its uninitialized allocations first filled with NaN (-1, ``True``),
so that a kernel the recording missed cannot pass by reading what FA4's own call left in reused
memory, and must give what FA4 gave: the same bits, or for kernels that accumulate with atomics
(FA4's backward) values within 2% of the largest magnitude, where a bfloat16 rounding moves a
value by 0.4% and a program that misses work is off by far more. A check run that raises (other
than running out of memory, below) refuses the kind; FA4's result of that call is returned
either way. A recording is inconclusive, and a
later call records again, when the call compiled a kernel (compilation runs torch ops of its
own), when an inexact comparison meets NaN or infinity, or when the check run runs out of memory;
after ``MAX_INCONCLUSIVE`` such recordings the kind is refused.

**Replaying.** A later call of the kind runs the program's steps on its own inputs: fresh
outputs and scratch buffers allocated (and filled) as FA4 allocates them, the same kernels
with the same non-tensor arguments. The kernels take the stream from torch's current stream
when they are called, as FA4's own calls do. A program keeps its compiled kernels alive: after
clearing FA4's JIT caches, clear :data:`PROGRAMS` too.

**Keys.** The caller's key must hold everything the launcher reads: each tensor's shape,
strides, dtype, device, ``data_ptr() % 256`` and ``requires_grad`` (:func:`tensor_key`), the
scalar arguments, which inputs are the same tensor (:func:`identities`), and what FA4 reads from
the process per call (the fa4 route's key: the environment variables FA4 reads per call, FA4's
log level, the scheduling tunables of ``flash_attn.cute.interface``). Nothing is recorded while a CUDA graph is
being captured (the check run compares on the host); programs recorded before a capture replay
inside it (their allocations come from the graph's pool).

``FLEXATTN_ZOO_FA4_REPLAY=0`` turns replays off (every call runs FA4's launcher);
:data:`PROGRAMS` holds the programs and refusals (``PROGRAMS.clear()`` forgets them).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flexattn_zoo.lru import ClockCache

#: How many kinds of FA4 call keep a program (or a refusal).
FA4_REPLAY_CACHE_SIZE = 64

_ALLOCATIONS_AND_FILLS = frozenset(
    {
        "empty",
        "empty_strided",
        "zeros",
        "ones",
        "full",
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "new_ones",
        "new_full",
        "zero_",
        "fill_",
    }
)
#: Allocations whose memory is whatever was there: a check run fills them with a poison first.
_UNINITIALIZED = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})
#: Views the kernels cannot tell from their source: passed through instead of re-run.
_SAME_MEMORY = frozenset({"detach", "alias"})
_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


@dataclass(frozen=True)
class _Ref:
    """A tensor of the program: index into the values of a run (the inputs first)."""

    index: int


@dataclass(frozen=True)
class _Nested:
    """A tuple (or NamedTuple) argument holding tensors: rebuilt with the run's tensors."""

    kind: type
    items: tuple[Any, ...]


def _fill(template: Any, values: list[Any]) -> Any:
    if type(template) is _Ref:
        return values[template.index]
    if type(template) is _Nested:
        items = [_fill(item, values) for item in template.items]
        return template.kind(*items) if hasattr(template.kind, "_fields") else template.kind(items)
    return template


@dataclass(frozen=True)
class Refused:
    """A kind of call that runs FA4's own launcher every time, and why."""

    reason: str


@dataclass(frozen=True)
class _Inconclusive:
    """A recording that says nothing for good about its kind, and why: a later call records."""

    reason: str


#: Factory overloads replayed through their public functions, which parse their arguments in C++
#: (calling the overload from Python costs several microseconds more per allocation).
_FAST = {
    "aten::empty.memory_format": torch.empty,
    "aten::empty_like": torch.empty_like,
    "aten::empty_strided": torch.empty_strided,
    "aten::zeros": torch.zeros,
    "aten::zeros_like": torch.zeros_like,
}


@dataclass(frozen=True)
class _Step:
    """One step of a :class:`Program`: ``fn(*args, **kwargs)`` with the run's tensors put at
    ``refs`` (``(position, value index)``, keyword positions by name); ``nested``: some argument
    is a :class:`_Nested` (rebuilt by :func:`_fill`); ``makes``: the result is a new value."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    refs: tuple[tuple[int | str, int], ...]
    nested: bool
    makes: bool
    uninitialized: bool = False

    @classmethod
    def of(cls, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], makes: bool) -> _Step:
        name = fn.name() if isinstance(fn, torch._ops.OpOverload) else None
        named: list[tuple[int | str, Any]] = [*enumerate(args), *kwargs.items()]
        return cls(
            fn=_FAST.get(name, fn) if name is not None else fn,
            args=args,
            kwargs=kwargs,
            refs=tuple((where, a.index) for where, a in named if type(a) is _Ref),
            nested=any(type(a) is _Nested for _, a in named),
            makes=makes,
            uninitialized=isinstance(fn, torch._ops.OpOverload)
            and fn.overloadpacket.__name__ in _UNINITIALIZED,
        )

    def __call__(self, values: list[Any]) -> Any:
        if self.nested:
            return self.fn(
                *[_fill(a, values) for a in self.args],
                **{k: _fill(a, values) for k, a in self.kwargs.items()},
            )
        if not self.refs:
            return self.fn(*self.args, **self.kwargs)
        args, kwargs = list(self.args), dict(self.kwargs)
        for where, index in self.refs:
            if isinstance(where, int):
                args[where] = values[index]
            else:
                kwargs[where] = values[index]
        return self.fn(*args, **kwargs)


@dataclass
class Program:
    """A recorded FA4 launch: :class:`_Step` s run on values that start as the call's inputs;
    ``result`` templates the launcher's return value."""

    steps: list[_Step] = field(default_factory=list)
    result: Any = None

    def run(self, inputs: Sequence[Any], poison: bool = False) -> Any:
        """The launch on ``inputs``; ``poison`` (a check run): uninitialized allocations are
        filled with NaN (-1, ``True`` for integers and booleans) first, so that a kernel the
        recording missed cannot pass by reading what FA4's own call left in reused memory."""
        values = list(inputs)
        for step in self.steps:
            out = step(values)
            if step.makes:
                if poison and step.uninitialized:
                    _poison(out)
                values.append(out)
        return _fill(self.result, values)


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max if not t.dtype.is_signed else -1)


def _memory(t: torch.Tensor) -> Hashable:
    return (t.data_ptr(), t.dtype, t.shape, t.stride(), t.device)


class _Refusal(Exception):
    pass


class _Recorder:
    """Builds a :class:`Program` from what one launcher call does (see the module docstring)."""

    def __init__(self, inputs: Sequence[Any]) -> None:
        self.program = Program()
        self.index: dict[int, int] = {}
        self.memory: dict[Hashable, set[int]] = {}  # the values of each exact (memory, layout)
        self.keep: list[Any] = []  # every tensor seen stays alive, so ids are not reused
        self.refusal: str | None = None
        self.compiled = False
        self.kernels = 0
        self.thread = threading.get_ident()  # FA4 calls of other threads are not this call's
        for i, t in enumerate(inputs):
            if isinstance(t, torch.Tensor):
                self._know(t, i)
        self.count = len(inputs)

    def _know(self, t: torch.Tensor, i: int) -> None:
        self.index[id(t)] = i
        self.keep.append(t)
        self.memory.setdefault(_memory(t), set()).add(i)

    def release(self) -> None:
        """Let go of every tensor seen (the program holds none)."""
        self.keep.clear()
        self.index.clear()
        self.memory.clear()

    def refuse(self, reason: str) -> None:
        if self.refusal is None:
            self.refusal = reason

    def template(self, value: Any, what: str) -> Any:
        if isinstance(value, torch.Tensor):
            i = self.index.get(id(value))
            if i is None:
                # A new object over the memory and layout of exactly one value (an alias made
                # below torch's dispatcher, e.g. by autograd returning a function's output).
                same = self.memory.get(_memory(value), set())
                if len(same) != 1:
                    raise _Refusal(f"{what} is a tensor the recording cannot place")
                i = next(iter(same))
            return _Ref(i)
        if isinstance(value, (tuple, list)):
            items = tuple(self.template(v, what) for v in value)
            if any(type(v) in (_Ref, _Nested) for v in items):
                return _Nested(type(value), items)
            return list(value) if isinstance(value, list) else value  # a copy FA4 cannot change
        if isinstance(value, _PLAIN):
            return value
        raise _Refusal(f"{what} is a {type(value).__name__}, not a plain value")

    def op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if self.refusal is not None:
            return
        name = func.overloadpacket.__name__
        try:
            if name in _SAME_MEMORY and isinstance(out, torch.Tensor):
                source = self.index.get(id(args[0]))
                if source is None:
                    self.refuse(f"FA4 took aten.{name} of a tensor the recording cannot place")
                else:
                    self._know(out, source)
                return
            if name not in _ALLOCATIONS_AND_FILLS and not func.is_view:
                self.refuse(f"FA4 ran aten.{name}, which is not an allocation, a fill or a view")
                return
            if not isinstance(out, torch.Tensor):
                self.refuse(f"aten.{name} returned {type(out).__name__}")
                return
            step_args = tuple(self.template(a, f"an argument of aten.{name}") for a in args)
            step_kwargs = {k: self.template(a, f"argument {k} of aten.{name}") for k, a in kwargs.items()}
        except _Refusal as exc:
            self.refuse(str(exc))
            return
        if id(out) in self.index:  # an in-place fill returns its target
            self.program.steps.append(_Step.of(func, step_args, step_kwargs, False))
            return
        self.program.steps.append(_Step.of(func, step_args, step_kwargs, True))
        self._know(out, self.count)
        self.count += 1

    def call(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.refusal is not None:
            return
        try:
            step_args = tuple(
                self.template(a, f"argument {i} of a compiled kernel") for i, a in enumerate(args)
            )
            step_kwargs = {
                k: self.template(a, f"argument {k} of a compiled kernel") for k, a in kwargs.items()
            }
        except _Refusal as exc:
            self.refuse(str(exc))
            return
        self.program.steps.append(_Step.of(fn, step_args, step_kwargs, False))
        self.kernels += 1


class _Watch(TorchDispatchMode):
    """Logs every torch op run under it into a :class:`_Recorder` (after running it)."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.recorder.op(func, tuple(args), dict(kwargs), out)
        return out


class _CacheSpy:
    """Stands in for one FA4 JIT cache during a recording: lookups go to the real cache, each
    compiled function handed out logs its calls, and a store (a compile) is noted."""

    def __init__(self, inner: Any, recorder: _Recorder) -> None:
        self.inner = inner
        self.recorder = recorder

    def __contains__(self, key: Any) -> bool:
        return key in self.inner

    def __setitem__(self, key: Any, value: Any) -> None:
        if threading.get_ident() == self.recorder.thread:
            self.recorder.compiled = True
        self.inner[key] = value

    def __getitem__(self, key: Any) -> Callable[..., Any]:
        fn = self.inner[key]
        recorder = self.recorder

        def logged(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            if threading.get_ident() != recorder.thread:
                return result
            if result is not None:
                recorder.refuse(f"a compiled kernel returned {type(result).__name__}")
            recorder.call(fn, args, kwargs)
            return result

        return logged

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _jit_cached(module: Any) -> list[Any]:
    """The functions of ``module`` that keep a JIT cache (``fn.compile_cache``)."""
    return [fn for fn in vars(module).values() if callable(fn) and hasattr(fn, "compile_cache")]


#: How far an inexact check run may be from FA4's own result, relative to the largest magnitude:
#: atomics reorder float32 sums, and a gradient rounded to bfloat16 then moves by one unit in the
#: last place (0.4% of a value near the largest); a program that misses work is off by far more.
_TOLERANCE = 2e-2


def _finite(value: Any) -> bool:
    """Whether every floating-point tensor of ``value`` is finite: an inexact comparison needs
    that (a difference of infinities is NaN)."""
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    if isinstance(value, (tuple, list)):
        return all(_finite(v) for v in value)
    return True


#: Integer dtypes of each element size, to compare floating-point results bit for bit.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _close(got: Any, want: Any, exact: bool) -> bool:
    """Whether a check run's result ``got`` is FA4's ``want``: bit for bit when ``exact`` (the
    same kernels on the same inputs give the same bits, NaN included), else within
    ``_TOLERANCE`` of ``want``'s largest magnitude (finite values: :func:`_finite`), with one
    temporary of a result's size."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.stride() != want.stride():
            return False
        if got.dtype != want.dtype:
            return False
        if exact or not want.is_floating_point() or not want.numel():
            bits = _BITS.get(want.element_size()) if want.is_floating_point() else None
            return bool(torch.equal(got.view(bits), want.view(bits)) if bits else torch.equal(got, want))
        low, high = torch.aminmax(want)
        largest = max(-float(low), float(high))
        return float((got - want).abs_().max()) <= _TOLERANCE * largest + 1e-6
    if isinstance(want, (tuple, list)):
        return (
            isinstance(got, (tuple, list))
            and len(got) == len(want)
            and all(_close(g, w, exact) for g, w in zip(got, want, strict=True))
        )
    return got is want or got == want


def record(
    module: Any, call: Callable[..., Any], inputs: Sequence[Any], exact: bool
) -> tuple[Any, Program | Refused | _Inconclusive]:
    """Run ``call(*inputs)`` (FA4's launcher) while recording it: ``(its result, the program,
    the refusal, or why the recording says nothing for good)``. ``module`` holds the JIT-cached
    functions (``flash_attn.cute.interface``); ``exact``: the check run must give FA4's result
    bit for bit. FA4's result is returned whatever happens to the recording."""
    recorder = _Recorder(inputs)
    watched = _jit_cached(module)
    saved = [fn.compile_cache for fn in watched]
    for fn, cache in zip(watched, saved, strict=True):
        fn.compile_cache = _CacheSpy(cache, recorder)
    try:
        with _Watch(recorder):
            result = call(*inputs)
    finally:
        for fn, cache in zip(watched, saved, strict=True):
            fn.compile_cache = cache
    return result, _verdict(recorder, result, inputs, exact)


def _verdict(
    recorder: _Recorder, result: Any, inputs: Sequence[Any], exact: bool
) -> Program | Refused | _Inconclusive:
    if recorder.compiled:
        return _Inconclusive("the call compiled a kernel")
    if recorder.refusal is not None:
        return Refused(recorder.refusal)
    if recorder.kernels == 0:
        return Refused("FA4 called no compiled kernel")
    try:
        recorder.program.result = recorder.template(result, "the launcher's result")
    except _Refusal as exc:
        return Refused(str(exc))
    program = recorder.program
    recorder.release()  # FA4's scratch goes before the check run (which poisons what it reuses)
    if not exact and not _finite(result):
        return _Inconclusive("the result held NaN or infinity")
    try:
        if not _close(program.run(inputs, poison=True), result, exact):
            return Refused("the recorded program's check run differed from FA4's own call")
    except torch.OutOfMemoryError as exc:
        return _Inconclusive(f"the check run ran out of memory: {exc}")
    except Exception as exc:  # the call was served by FA4: the recording alone fails
        return Refused(f"the recorded program's check run raised {type(exc).__name__}: {exc}")
    return program


class _Seen:
    """A kind met, not yet recorded: its next call records (a kind met once costs no recording);
    ``tries``: recordings so far that said nothing for good (:class:`_Inconclusive`)."""

    def __init__(self) -> None:
        self.tries = 0

    def __repr__(self) -> str:
        return f"Seen(tries={self.tries})"


#: Inconclusive recordings after which a kind is refused (its results keep holding NaN, its
#: check runs keep running out of memory): each costs a recording and a host synchronization.
MAX_INCONCLUSIVE = 3


#: Programs (and refusals) per kind of FA4 call (module docstring).
PROGRAMS: ClockCache[Program | Refused | _Seen] = ClockCache(FA4_REPLAY_CACHE_SIZE)


def tensor_key(t: torch.Tensor | None) -> Hashable:
    """What an FA4 launcher reads from a tensor argument (the values it never reads)."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 256, t.requires_grad)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def identities(tensors: Sequence[Any]) -> tuple[int, ...]:
    """Which arguments are the same object (for each, the first position holding it): FA4
    decides by identity in places (``k is v``)."""
    ids = [id(t) for t in tensors]
    return tuple(ids.index(i) for i in ids)


def enabled() -> bool:
    return os.environ.get("FLEXATTN_ZOO_FA4_REPLAY", "1") != "0"


def launch(
    key: Hashable, module: Any, call: Callable[..., Any], inputs: Sequence[Any], exact: bool = True
) -> Any:
    """``call(*inputs)``, or its program's replay once the kind ``key`` has one (module docstring).
    The first call of a kind runs ``call`` and notes the kind; the second records."""
    key = (key, torch.get_default_dtype())  # what factory ops without a dtype allocate
    entry = PROGRAMS.get_eager(key)
    if type(entry) is Program:
        return entry.run(inputs)
    if entry is None:
        PROGRAMS.put(key, _Seen())
        return call(*inputs)
    if type(entry) is not _Seen or _capturing():
        return call(*inputs)
    result, made = record(module, call, inputs, exact)
    if isinstance(made, _Inconclusive):
        entry.tries += 1
        if entry.tries >= MAX_INCONCLUSIVE:
            PROGRAMS.replace(
                key, Refused(f"{entry.tries} recordings were inconclusive, the last: {made.reason}")
            )
    else:
        PROGRAMS.replace(key, made)
    return result


__all__ = [
    "FA4_REPLAY_CACHE_SIZE",
    "PROGRAMS",
    "Program",
    "Refused",
    "enabled",
    "identities",
    "launch",
    "record",
    "tensor_key",
]
