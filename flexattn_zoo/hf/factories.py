"""transformers' mask-function factories, and what they were called with, readable inside a compiled model.

transformers builds each layer's mask function from small factories (``and_masks``,
``sliding_window_overlay(sliding_window)``, ``packed_sequence_mask_function(ids)``, ...), each
returning a closure over its arguments. Eagerly the mask reader reads those arguments from the
closure's cells. Inside ``torch.compile`` the closures are made in the graph, and Dynamo can call
them but not read their cells (``__closure__``): without help a compiled model would get only an
opaque mask function (no closed-form BlockMask, no SDPA or FlashAttention route).

:func:`install` gives Dynamo a stand-in for each factory (``torch.compiler.substitute_in_graph``):
it calls a copy of transformers' own function, so the closure is the one transformers builds, and
records the arguments on it as ``fz_factory = (kind, {parameter: value})``. Only traced code sees
the stand-ins; eager calls run transformers' functions untouched. Other attention
implementations traced in the same process get the same closures, with that one attribute more.
"""

from __future__ import annotations

import inspect
import logging
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

#: The attribute the stand-ins set on the closures they return.
ATTRIBUTE = "fz_factory"
#: The factories the mask reader understands: its name for each -> transformers' function name.
FACTORIES = {
    "and": "and_masks",
    "or": "or_masks",
    "sliding": "sliding_window_overlay",
    "sliding_bidirectional": "sliding_window_bidirectional_overlay",
    "chunked": "chunked_overlay",
    "packed": "packed_sequence_mask_function",
    "remap": "remap_positions_for_packed_sequence",
    "padding": "padding_mask_function",
}
#: Overlays that model modules define for themselves, read eagerly by their code object: the
#: reader's name for each -> ``(module, function name)`` of every copy (a module or function that
#: this transformers lacks is skipped). Gemma 3 (and Step3p7) with
#: ``use_bidirectional_attention=True``: ``abs(q_idx - kv_idx) < sliding_window``.
MODEL_FACTORIES: dict[str, tuple[tuple[str, str], ...]] = {
    "window_bidirectional": (
        ("transformers.models.gemma3.modeling_gemma3", "_bidirectional_window_overlay"),
        ("transformers.models.step3p7.modeling_step3p7", "_bidirectional_window_overlay"),
    ),
}
#: Positional arguments that make a sample closure of each model overlay.
MODEL_EXAMPLE_ARGS: dict[str, tuple[Any, ...]] = {"window_bidirectional": (1,)}


def example_args(masking_utils: Any) -> dict[str, tuple[Any, ...]]:
    """Positional arguments that make a sample closure of each factory: :func:`install` checks on
    it that the closure holds exactly its arguments, and the eager reader takes its code object."""
    t = torch.zeros(1, 1, dtype=torch.long)
    causal = masking_utils.causal_mask_function
    return {
        "and": (causal,),
        "or": (causal,),
        "sliding": (1,),
        "sliding_bidirectional": (1,),
        "chunked": (1, t[0]),
        "packed": (t,),
        "remap": (causal, t),
        "padding": (t,),
    }


#: The functions already substituted (Dynamo takes one stand-in per function, for the process),
#: and those left out (so a later install neither checks nor warns again). The functions
#: themselves, held weakly, not their ids: a new function may live at a collected one's address.
_INSTALLED: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
_SKIPPED: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
_LOCK = threading.Lock()


def _parameters(original: Callable[..., Any]) -> tuple[tuple[str, ...], bool, dict[str, Any]]:
    """Parameter names, whether the first is ``*args``, and the defaults."""
    params = list(inspect.signature(original).parameters.values())
    names = tuple(p.name for p in params)
    variadic = bool(params) and params[0].kind is inspect.Parameter.VAR_POSITIONAL
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    return names, variadic, defaults


def _recording(kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """The stand-in for ``original``: its result, with the arguments recorded on it."""
    # A copy, not ``original`` itself: Dynamo would send a call of the original to this stand-in.
    copy = types.FunctionType(
        original.__code__,
        original.__globals__,
        original.__name__,
        original.__defaults__,
        original.__closure__,
    )
    copy.__kwdefaults__ = original.__kwdefaults__
    names, variadic, defaults = _parameters(original)

    def recording(*args: Any, **kwargs: Any) -> Any:
        fn = copy(*args, **kwargs)
        recorded = dict(defaults)
        if variadic:
            recorded[names[0]] = args
        else:
            recorded.update(zip(names[: len(args)], args, strict=True))
        recorded.update(kwargs)
        fn.fz_factory = (kind, recorded)
        return fn

    return recording


def _captures_its_arguments(original: Callable[..., Any], args: tuple[Any, ...]) -> bool:
    """Whether the closure ``original(*args)`` holds exactly the arguments, under their parameter
    names (what the recorded arguments stand for: the values the closure computes with)."""
    names, variadic, _ = _parameters(original)
    given = {names[0]: args} if variadic else dict(zip(names, args, strict=False))
    fn = original(*args)
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is None or set(code.co_freevars) - set(given):
        return False
    held = dict(zip(code.co_freevars, (c.cell_contents for c in cells), strict=True))

    def same(a: Any, b: Any) -> bool:  # *args arrive as a new tuple of the same objects
        if isinstance(a, tuple) and isinstance(b, tuple):
            return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
        return a is b

    return all(same(value, given[name]) for name, value in held.items())


def install(masking_utils: Any) -> list[str]:
    """Substitute the stand-ins for the factories this ``transformers.masking_utils`` has (once
    each) and return the names newly left out: a factory whose closure does not hold exactly its
    arguments, or one another library already substituted (its closures then stay unreadable
    while traced, and take the exact generic path)."""
    skipped = []
    samples = example_args(masking_utils)
    with _LOCK:
        for kind, name in FACTORIES.items():
            original = getattr(masking_utils, name, None)
            if not isinstance(original, types.FunctionType) or original in _INSTALLED or original in _SKIPPED:
                continue
            try:
                fits = _captures_its_arguments(original, samples[kind])
                if fits:
                    torch.compiler.substitute_in_graph(original, skip_signature_check=True)(
                        _recording(kind, original)
                    )
            except (TypeError, ValueError):  # another stand-in registered, or a changed signature
                fits = False
            if not fits:
                skipped.append(name)
                _SKIPPED.add(original)
                continue
            _INSTALLED.add(original)
    if skipped:
        log.warning(
            "flexattn_zoo.hf: transformers mask factories not read inside compiled models: %s", skipped
        )
    return skipped


def recorded(fn: Any) -> tuple[str, dict[str, Any]] | None:
    """``(kind, arguments)`` a stand-in recorded on ``fn``, or None (eager closures, other callables)."""
    return getattr(fn, ATTRIBUTE, None)


__all__ = [
    "ATTRIBUTE",
    "FACTORIES",
    "MODEL_EXAMPLE_ARGS",
    "MODEL_FACTORIES",
    "example_args",
    "install",
    "recorded",
]
