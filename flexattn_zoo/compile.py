"""One compiled flex_attention per kernel (mod code + captured constants, options), never unfused.

Why a code object per key: Dynamo keeps its compiled-graph cache on the *code object* and gives
up after ``recompile_limit`` (8) entries, silently running flex unfused (which asked for 64 GiB at
L=32K in our baseline). If every spec shared one compiled function, eight specs would exhaust it.
Each key here gets its own copy of a small wrapper's code object, so its cache only ever holds
the variations of *one* kernel: grad mode and shapes. The key (:func:`mod_key`)
ignores the *values* of captured tensors, so new document ids each step reuse the kernel; an
entry about to reach the recompile limit is replaced by a fresh one.

Why static graphs first: a graph compiled with symbolic sizes runs the same kernel slower than
one compiled for the sizes it meets (on an H200, 1.24-1.39x per call for causal and sliding-window
attention at 2K-8K, forward and backward, and ~35 us more host time per call). Dynamo's automatic
dynamic shapes would compile that graph as soon as a second length is seen, and a model that
trains at one length and evaluates at another would run both on it. So each entry compiles one
static graph per input shape for its first :data:`STATIC_SHAPES` shapes, and sends later shapes
to a second code object left to automatic dynamic shapes (a static graph for the first of them,
then one dynamic-shape graph for the rest): a model with a few lengths runs them all static, and
a generation loop meeting a new cache length every step compiles a few graphs per grad mode, then
none (``STATIC_SHAPES + 2``, and one more when a size Dynamo specializes at 1, such as a count of
key blocks, passes 1).

Why fallback is impossible: the wrapper raises :class:`UnfusedFallbackError` when its body runs
outside Dynamo. Compiled, ``is_compiling()`` is constant-folded to True and the check vanishes;
the body can only execute eagerly if Dynamo refused to compile it — exactly the silent fallback.
A graph break *inside* the trace (a score_mod Dynamo cannot trace) would run flex eagerly in the
rest of the frame instead; the body turns it into an error (torch's ``error_on_graph_break``, or
``fullgraph=True`` on a torch without it).
"""

from __future__ import annotations

import itertools
import threading
import types
from collections.abc import Callable, Hashable
from typing import Any

import torch

from flexattn_zoo import _compat
from flexattn_zoo.functions import _Ref
from flexattn_zoo.lru import LRUCache

#: Upper bound of compiled entries kept (LRU); each holds its own Dynamo cache.
COMPILE_CACHE_SIZE = 128

#: Held by an entry's call of a new signature (which may compile), see ``CompiledFlex``.
_FIRST_CALLS = threading.Lock()

#: Distinct input shapes (q and k sizes) whose static graphs one entry keeps on its
#: first code object. Each shape may take two graphs there (with and without grad), so this stays
#: below half of Dynamo's recompile limit (8).
STATIC_SHAPES = 2


class UnfusedFallbackError(RuntimeError):
    """torch would have run flex_attention unfused (materializing Lq x Lkv): refused."""


def _template(kernel_options: dict[str, Any] | None, lse: bool, gqa: bool) -> Callable[..., Any]:
    aux = _compat.flex_aux_request(lse)
    flex = _compat.flex_attention
    is_compiling = _compat.is_compiling
    no_graph_breaks = _compat.no_graph_breaks

    # score_mod is an argument, like the mask_mod inside block_mask, never a captured value: calls
    # that share this entry (equal mod_key) may close over *different* tensors (decode offsets, a
    # new Document's ids), and Dynamo reads those from the function it is given on each call.
    def flexattn_zoo_flex(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        block_mask: _compat.BlockMask,
        scale: float,
        score_mod: Callable[..., Any] | None,
    ) -> Any:
        if not is_compiling():
            raise UnfusedFallbackError(
                "torch.compile did not compile flex_attention for this call (recompile limit or a "
                "graph break), so it would run unfused and materialize Lq x Lkv. flexattn_zoo "
                "refuses; please report this with the shapes and spec."
            )
        # A graph break while tracing flex (a score_mod Dynamo cannot trace) would run flex
        # eagerly, unfused, in the rest of the frame: an error instead (compiled, the context
        # manager is gone from the code that runs).
        with no_graph_breaks():
            # arg-type ignored: torch annotates kernel_options as its FlexKernelOptions TypedDict;
            # ours is the plain dict[str, Any] the backends build, which flex_attention accepts.
            return flex(
                q,
                k,
                v,
                score_mod=score_mod,
                block_mask=block_mask,
                scale=scale,
                enable_gqa=gqa,
                kernel_options=kernel_options,  # type: ignore[arg-type]
                **aux,
            )

    return flexattn_zoo_flex


class CompiledFlex:
    """A compiled flex call for one key; ``compiles`` counts graphs Dynamo built for it.

    Two code objects, each with its own Dynamo cache: one compiled with static shapes, for the
    first :data:`STATIC_SHAPES` input shapes the entry is called with, and one left to Dynamo's
    automatic dynamic shapes (made when a later shape first arrives), for all others.
    ``dynamic_graphs`` counts the graphs compiled with symbolic sizes."""

    def __init__(self, serial: int, kernel_options: dict[str, Any] | None, lse: bool, gqa: bool) -> None:
        self.compiles = 0
        self.dynamic_graphs = 0
        #: Set once either code object has one graph fewer than Dynamo's recompile limit: one
        #: call adds at most one graph, so the cache replaces the entry by a fresh one before the
        #: limit (and with it torch's unfused fallback) is reached. Checked when a graph is
        #: compiled, which is the only time the counts change (no config read per call).
        self.retired = False
        self.lse = lse
        self._serial = serial
        self._template = (kernel_options, lse, gqa)
        #: The (q, k) shapes the first code object compiles static graphs for (STATIC_SHAPES at most).
        self.static_shapes: set[Hashable] = set()
        #: Signatures (shapes, strides, grad mode and flags: what Dynamo's guards check of the
        #: inputs) of the calls the first code object has run: calls with one of these go straight
        #: to it, without the static-shape setting (their graph exists).
        self._static_seen: set[Hashable] = set()
        self._later: Callable[..., Any] | None = None
        self._fn = self._compiled("static")

    def _compiled(self, kind: str) -> Callable[..., Any]:
        fn = _template(*self._template)
        code = fn.__code__.replace(co_name=f"flexattn_zoo_flex_{self._serial}_{kind}")
        unique = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
        inductor = _compat.inductor_backend()
        graphs = 0

        def counting_backend(gm: Any, example_inputs: Any) -> Any:
            nonlocal graphs
            graphs += 1
            self.compiles += 1
            if any(_symbolic(x) for x in example_inputs):
                self.dynamic_graphs += 1
            if graphs >= _compat.recompile_limit() - 1:
                self.retired = True
            return inductor(gm, example_inputs)

        # Not fullgraph=True where torch has error_on_graph_break (the body enters it): the same
        # one graph, without fullgraph's host time on every call. Not dynamic=False either: torch
        # would set its static-shape config around every call; the first code object's first call
        # of each signature sets it instead (``__call__``).
        return torch.compile(unique, backend=counting_backend, fullgraph=_compat.FULLGRAPH_NEEDED)

    def retire_if_over_limit(self) -> bool:
        """After this entry refused a call (:class:`UnfusedFallbackError`): whether the reason is
        torch's recompile limit, lowered since the entry last compiled (it is checked only when
        the entry compiles); if so the entry is retired, and the cache's next lookup of its key
        gives a fresh one. (Counted over both code objects: a limit at or below the total may be
        the one that refused.)"""
        if self.compiles < _compat.recompile_limit():
            return False
        self.retired = True
        return True

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        block_mask: Any,
        scale: float,
        score_mod: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.run(q, k, v, block_mask, scale, score_mod)[0]

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        block_mask: Any,
        scale: float,
        score_mod: Any = None,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor | None], Callable[..., Any]]:
        """``(self(...), code)``: the call's result and the compiled code object that ran it. A
        caller whose later calls have this call's signature (q/k/v shapes and strides, grad mode,
        which inputs require grad) may give them to :meth:`rerun` with ``code``, which skips
        building and checking the signature (host time on every call)."""
        signature = (
            q.shape, k.shape, q.stride(), k.stride(), v.stride(), torch.is_grad_enabled(),
            q.requires_grad, k.requires_grad, v.requires_grad,
        )  # fmt: skip
        if signature in self._static_seen:
            code = self._fn
            out = _compat.call_compiled(code, q, k, v, block_mask, scale, score_mod)
        else:
            out, code = self._first_call(signature, q, k, v, block_mask, scale, score_mod)
        return _compat.unpack_flex_output(out, self.lse), code

    def rerun(
        self,
        code: Callable[..., Any],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        block_mask: Any,
        scale: float,
        score_mod: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``self(...)`` through ``code`` from :meth:`run` of a call with the same signature."""
        return _compat.unpack_flex_output(
            _compat.call_compiled(code, q, k, v, block_mask, scale, score_mod), self.lse
        )

    def unguarded(
        self,
        code: Callable[..., Any],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        block_mask: Any,
        scale: float,
        score_mod: Any = None,
    ) -> _compat.UnguardedGraph | None:
        """The graph ``code`` (from :meth:`run`) ran for these arguments, callable in place of
        :meth:`rerun` without Dynamo's frame evaluation (``_compat.unguarded_graph``) by
        :meth:`run_unguarded`, with arguments of the same signature and aliasing, the same
        ``block_mask`` and ``score_mod`` objects and an equal ``scale``, while the graph is
        ``usable()`` and ``_compat.unguarded_graph_allowed()``; None where none can be made."""
        return _compat.unguarded_graph(code, (q, k, v, block_mask, scale, score_mod))

    def run_unguarded(
        self,
        graph: _compat.UnguardedGraph,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        block_mask: Any,
        scale: float,
        score_mod: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``self(...)`` through ``graph`` from :meth:`unguarded` (see there for when)."""
        return _compat.unpack_flex_output(graph.fn(q, k, v, block_mask, scale, score_mod), self.lse)

    def _first_call(self, signature: tuple[Any, ...], *args: Any) -> tuple[Any, Callable[..., Any]]:
        """A call whose signature the first code object has not run: there, under the static-shape
        setting (it may compile), if its shapes are among, or still fit in, ``STATIC_SHAPES``; else
        on the later code object, left to automatic dynamic shapes. Returns the output and the
        code object that ran it."""
        shapes = signature[:2]
        with _FIRST_CALLS:
            static = shapes in self.static_shapes or len(self.static_shapes) < STATIC_SHAPES
            if static:
                self.static_shapes.add(shapes)
                # Under the lock: before torch 2.12 Dynamo's config is process-wide, and two
                # overlapping patches could restore it in the wrong order.
                with _compat.static_shape_compiles():
                    out = _compat.call_compiled(self._fn, *args)
                self._static_seen.add(signature)
                return out, self._fn
            later = self._later
            if later is None:
                later = self._later = self._compiled("later")
        return _compat.call_compiled(later, *args), later


def _symbolic(x: Any) -> bool:
    """Whether a graph input is, or has, a symbolic size."""
    if isinstance(x, torch.SymInt):
        return True
    return isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in x.shape)


#: How many hops through module globals :func:`mod_key` follows (a mod calling a module-level
#: helper, which calls another...): Dynamo inlines them, and bakes the Python values they read
#: into the graph too. Closure cells are followed all the way (a mask composed of many nested
#: ``and_masks`` must keep sharing its entry), with a guard against cycles.
MOD_KEY_DEPTH = 4
#: Entries of a global container (list, tuple, dict) or attributes of an object a key takes by
#: value at most; a larger one is keyed by its identity (a module-level table of thousands of
#: entries is not walked for every key).
MOD_KEY_ITEMS = 64
#: Python values Dynamo bakes into a graph as constants (and guards on).
_SCALARS = (bool, int, float, complex, str, bytes, type(None))


def mod_key(fn: Any) -> Hashable:
    """What a compiled graph depends on in a mask_mod / score_mod: its code and captured constants.

    Captured *tensors* count only by shape, dtype and device: Dynamo lifts them into graph inputs,
    so a new ``Document`` (new ids, same length) per training step reuses the compiled kernel
    instead of compiling a new one every step. Captured Python values (window sizes, caps) are
    baked into the kernel, so they stay part of the key, however the mod reads them: closure
    cells, default arguments, the module globals its code names, the attributes its code names
    on a bound method's object or a global object (``self.cap``, ``CONFIG.cap``), and the same in
    the functions it calls. Two mods that differ in such a value and shared an entry made Dynamo
    recompile it with the value symbolic (automatic dynamic), which torch's CPU flex kernel
    cannot lower. Attributes the code does not name (a step counter on the same object) stay out
    of the key. Dynamo's own guards keep each call correct; this key only decides which calls
    share a compile cache.
    """
    return _mod_key(fn, MOD_KEY_DEPTH, frozenset())


def _mod_key(fn: Any, depth: int, seen: frozenset[int]) -> Hashable:
    if fn is None:
        return None
    code = getattr(fn, "__code__", None)
    if code is None:
        return ("object", fn)
    if id(fn) in seen:
        return ("cycle", code)  # a closure that captures itself (a recursive helper)
    if depth <= 0:
        return ("function", code, _Ref(fn))  # past the depth: only this very function shares it
    seen = seen | {id(fn)}
    func = getattr(fn, "__func__", fn)  # a bound method's function
    cells = tuple(_cell_key(c, depth, seen) for c in (getattr(func, "__closure__", None) or ()))
    return ("function", code, cells, *_read_constants(fn, func, code, depth, seen))


def _cell_key(cell: Any, depth: int, seen: frozenset[int]) -> Hashable:
    try:
        value = cell.cell_contents
    except ValueError:  # an empty cell (a name the enclosing function binds later)
        return ("empty",)
    return _captured_key(value, depth, seen)


def _read_constants(
    fn: Any, func: Any, code: types.CodeType, depth: int, seen: frozenset[int]
) -> tuple[Hashable, ...]:
    """The values besides closure cells that ``fn`` may read and Dynamo would bake into its graph:
    default arguments, the globals its code names, and the attributes it names on a bound
    method's object."""
    parts: list[Hashable] = []
    defaults = (
        *(getattr(func, "__defaults__", None) or ()),
        *(getattr(func, "__kwdefaults__", None) or {}).items(),
    )
    if defaults:
        parts.append(("defaults", tuple(_captured_key(d, depth, seen) for d in defaults)))
    names = _compat.global_names(code)  # co_names: the globals and the attributes the code loads
    module = getattr(func, "__globals__", None)
    if isinstance(module, dict):
        found = []
        for name in names:
            if name in module:
                value = _global_key(module[name], names, depth, seen)
                if value is not None:
                    found.append((name, value))
        if found:
            parts.append(("globals", tuple(found)))
    if isinstance(fn, types.MethodType):
        parts.append(("self", type(fn.__self__), _attributes_key(fn.__self__, names, seen)))
    return tuple(parts)


def _global_key(value: Any, names: tuple[str, ...], depth: int, seen: frozenset[int]) -> Hashable | None:
    """A global's share of a key; None for what Dynamo treats as fixed (modules, classes,
    torch's own functions) or cannot read as a constant anyway."""
    if isinstance(value, (types.ModuleType, type)):
        return None
    if isinstance(value, types.FunctionType):
        if (value.__module__ or "").split(".")[0] == "torch":
            return None
        return _mod_key(value, depth - 1, seen)
    if isinstance(value, (*_SCALARS, torch.Tensor)):
        return _captured_key(value, depth, seen)
    if isinstance(value, (list, tuple, dict)):
        if len(value) > MOD_KEY_ITEMS:
            return ("id", _Ref(value))
        if isinstance(value, dict):
            return ("dict", _items_key(value, value.items(), depth, seen))
        return _captured_key(value, depth, seen)
    if callable(value):
        return None  # builtins, partials, callable objects: their identity does not change
    if hasattr(value, "__dict__"):
        return (type(value), _attributes_key(value, names, seen))
    return None


def _attributes_key(obj: Any, names: tuple[str, ...], seen: frozenset[int]) -> Hashable:
    """The attributes of ``obj`` that the code names (``names``: what a method reading
    ``self.cap`` bakes into its graph): Python values by value, tensors by shape, dtype and
    device; submodules, parameter dicts and attributes it never reads stay out."""
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict):
        return ("id", _Ref(obj))
    read = [(name, attrs[name]) for name in names if name in attrs]
    return _items_key(obj, read, MOD_KEY_DEPTH, seen, plain_only=True)


def _items_key(
    owner: Any, items: Any, depth: int, seen: frozenset[int], *, plain_only: bool = False
) -> Hashable:
    """``(name, key)`` of the named values in ``items``; with ``plain_only`` only Python scalars
    (baked into a graph) and tensors (lifted into it) take part. More than
    :data:`MOD_KEY_ITEMS` entries: ``owner``'s identity instead."""
    try:
        listed = list(items)
    except RuntimeError:  # changed size while read (another thread): no sharing by value
        return ("id", _Ref(owner))
    if len(listed) > MOD_KEY_ITEMS:
        return ("id", _Ref(owner))
    return tuple(
        (name, _captured_key(value, depth, seen))
        for name, value in listed
        if not plain_only or isinstance(value, (*_SCALARS, torch.Tensor))
    )


def _captured_key(value: Any, depth: int = MOD_KEY_DEPTH, seen: frozenset[int] = frozenset()) -> Hashable:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type)
    if callable(value) and hasattr(value, "__code__"):
        return _mod_key(value, depth, seen)
    if isinstance(value, (list, tuple)):
        if id(value) in seen:
            return ("cycle", type(value).__name__)  # a list that holds itself
        inner = seen | {id(value)}
        return (type(value).__name__, *(_captured_key(v, depth, inner) for v in value))
    try:
        hash(value)
    except TypeError:
        # Unhashable and unknown: shared only by calls capturing this very object (a reference
        # to it, not its id, which a new object may reuse once this one is collected).
        return ("id", _Ref(value))
    return (type(value).__name__, value)


class EntryKey:
    """A compiled-entry key (a tuple of :func:`mod_key` parts and options) with its hash worked
    out once. A caller that keeps its key (``backends.flex``) looks its entry up on every call,
    and hashing the tuple again each time walks the mods' code objects and captured constants
    (microseconds of host time per call). The parts are immutable, so the hash never goes stale."""

    __slots__ = ("_hash", "parts")

    def __init__(self, parts: tuple[Hashable, ...]) -> None:
        self.parts = parts
        self._hash = hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, EntryKey):
            return NotImplemented
        return self._hash == other._hash and self.parts == other.parts

    def __repr__(self) -> str:
        return f"EntryKey{self.parts!r}"


class CompileCache:
    """Thread-safe LRU of :class:`CompiledFlex` entries, one per kernel key."""

    def __init__(self, size: int) -> None:
        self._entries: LRUCache[CompiledFlex] = LRUCache(size)
        self._serial = itertools.count(1)

    @property
    def size(self) -> int:
        return self._entries.size

    def get(
        self,
        mask_mod: Any,
        score_mod: Any,
        kernel_options: dict[str, Any] | None,
        lse: bool,
        gqa: bool,
        model_shape: Hashable = None,
        block_size: tuple[int, int] | None = None,
    ) -> CompiledFlex:
        """The entry for this kernel; ``model_shape`` (heads, kv heads, head dim, dtype) separates
        calls whose model constants differ, so only lengths and batch vary inside one entry;
        ``block_size`` is the BlockMask's ``(q, kv)`` sparse block size (None: no BlockMask).

        Why: with one entry per mask code, a mask used at D=128 and then at D=64 (or 16 vs 32
        heads) recompiles that entry, and Dynamo compiles the second graph with dynamic sizes
        (automatic dynamic shapes) although those sizes never vary within one model.
        (The H200 slowdowns first blamed on this -- document_causal_d64 flex_flash at 74 -- were
        the spec-comparison sync fixed in 07f7535.)

        Why the block size: a kernel is tiled to it, and mods may compute with it (a paged decode
        mask maps keys to pages). Two block sizes in one entry let Dynamo's automatic dynamic
        shapes make a size symbolic in the second graph, which torch 2.13's CPU flex template
        cannot compile (C++ errors); one entry per block size compiles each statically.
        """
        key = self.key(mask_mod, score_mod, kernel_options, lse, gqa, model_shape, block_size)
        return self.get_keyed(key, kernel_options, lse, gqa)

    @staticmethod
    def key(
        mask_mod: Any,
        score_mod: Any,
        kernel_options: dict[str, Any] | None,
        lse: bool,
        gqa: bool,
        model_shape: Hashable = None,
        block_size: tuple[int, int] | None = None,
    ) -> Hashable:
        """The entry key of :meth:`get`'s arguments (a caller may keep it: see ``get_keyed``)."""
        return EntryKey(
            (
                mod_key(mask_mod),
                mod_key(score_mod),
                tuple(sorted((kernel_options or {}).items())),
                lse,
                gqa,
                model_shape,
                block_size,
            )
        )

    def get_keyed(
        self, key: Hashable, kernel_options: dict[str, Any] | None, lse: bool, gqa: bool
    ) -> CompiledFlex:
        """:meth:`get` for a key from :meth:`key` with the same options, lse and gqa."""

        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries.put(key, CompiledFlex(next(self._serial), kernel_options, lse, gqa))
        if entry.retired:  # one graph short of Dynamo's recompile limit: a fresh code object
            entry = self._entries.replace(key, CompiledFlex(next(self._serial), kernel_options, lse, gqa))
        return entry

    def entries(self) -> list[CompiledFlex]:
        return self._entries.values()

    def total_compiles(self) -> int:
        return sum(e.compiles for e in self._entries.values())

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


CACHE = CompileCache(COMPILE_CACHE_SIZE)
