"""Coercion of every accepted ``mask=`` / ``score_mod=`` form into a spec.

``fz.attention`` accepts a spec object, a registry name, or a raw flex callable (wrapped by
:mod:`flexattn_zoo.functions`); everything past this module only ever sees specs.
"""

from __future__ import annotations

from typing import Any

from flexattn_zoo import _compat
from flexattn_zoo.functions import FunctionMask, FunctionScore, check_mask_function, check_score_function
from flexattn_zoo.registry import MASKS, SCORES
from flexattn_zoo.spec import MaskSpec, ScoreSpec

# _check_callables_eagerly: a raw callable's checks (its signature, a probe call on small index
# grids) run only eagerly. While torch.compile traces, Dynamo cannot inspect signatures, and the
# callable is traced into the graph anyway, so a bad one fails there with Dynamo's own error;
# run the model once eagerly (or call fz.attention with the callable) for the named TypeError.


def _refuse_spec_class(value: Any, arg: str) -> None:
    """A spec *class* (``mask=masks.Causal``) is callable, so it would be taken for a mask_mod and
    fail with a confusing signature error; name the mistake instead."""
    if isinstance(value, type) and issubclass(value, (MaskSpec, ScoreSpec)):
        raise TypeError(
            f"{arg} got the class {value.__name__}, not a spec; pass an instance, e.g. "
            f"{arg}={value.__name__}(...) with its parameters"
        )


def as_mask_spec(mask: Any, *, arg: str = "mask") -> MaskSpec | None:
    """Coerce ``None`` / spec / registry name / callable into a :class:`MaskSpec` (or None)."""
    if mask is None or isinstance(mask, MaskSpec):
        return mask
    if isinstance(mask, str):
        return MASKS.get(mask)
    if isinstance(mask, ScoreSpec):
        raise TypeError(f"{arg} got a score spec ({type(mask).__name__}); pass it as score_mod=")
    _refuse_spec_class(mask, arg)
    if callable(mask):
        if not _compat.is_compiling():  # see _check_callables_eagerly
            check_mask_function(mask, arg)
        return FunctionMask(fn=mask, label=getattr(mask, "__name__", "mask_mod"))
    raise TypeError(
        f"{arg} must be None, a mask spec (e.g. masks.Causal()), a registry name (one of "
        f"{', '.join(MASKS.names())}), a mask_mod callable or a BlockMask; got {type(mask).__name__}"
    )


def as_score_spec(score: Any, *, arg: str = "score_mod") -> ScoreSpec | None:
    """Coerce ``None`` / spec / registry name / callable into a :class:`ScoreSpec` (or None)."""
    if score is None or isinstance(score, ScoreSpec):
        return score
    if isinstance(score, str):
        return SCORES.get(score)
    if isinstance(score, MaskSpec):
        raise TypeError(f"{arg} got a mask spec ({type(score).__name__}); pass it as mask=")
    _refuse_spec_class(score, arg)
    if callable(score):
        if not _compat.is_compiling():  # see _check_callables_eagerly
            check_score_function(score, arg)
        return FunctionScore(fn=score, label=getattr(score, "__name__", "score_mod"))
    raise TypeError(
        f"{arg} must be None, a score spec (e.g. score_mods.SoftCap(cap=30.0)), a registry name "
        f"(one of {', '.join(SCORES.names())}) or a score_mod callable; got {type(score).__name__}"
    )
