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
import types
from collections.abc import Callable
from typing import Any

import torch

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

#: The functions already substituted (Dynamo takes one stand-in per function, for the process).
_INSTALLED: set[int] = set()


def _recording(kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """The stand-in for ``original``: its result, with the arguments recorded on it."""
    # A copy, not ``original`` itself: Dynamo would send a call of the original to this stand-in.
    code = original.__code__
    copy = types.FunctionType(
        code,
        original.__globals__,
        original.__name__,
        original.__defaults__,
        original.__closure__,
    )
    copy.__kwdefaults__ = original.__kwdefaults__
    params = list(inspect.signature(original).parameters.values())
    names = tuple(p.name for p in params)
    variadic = bool(params) and params[0].kind is inspect.Parameter.VAR_POSITIONAL

    def recording(*args: Any, **kwargs: Any) -> Any:
        fn = copy(*args, **kwargs)
        recorded = {names[0]: args} if variadic else dict(zip(names[: len(args)], args, strict=True))
        recorded.update(kwargs)
        fn.fz_factory = (kind, recorded)
        return fn

    return recording


def install(masking_utils: Any) -> None:
    """Substitute the stand-ins for the factories this ``transformers.masking_utils`` has (once each)."""
    for kind, name in FACTORIES.items():
        original = getattr(masking_utils, name, None)
        if not isinstance(original, types.FunctionType) or id(original) in _INSTALLED:
            continue
        torch.compiler.substitute_in_graph(original, skip_signature_check=True)(_recording(kind, original))
        _INSTALLED.add(id(original))


def recorded(fn: Any) -> tuple[str, dict[str, Any]] | None:
    """``(kind, arguments)`` a stand-in recorded on ``fn``, or None (eager closures, other callables)."""
    return getattr(fn, ATTRIBUTE, None)


__all__ = ["ATTRIBUTE", "FACTORIES", "install", "recorded"]
