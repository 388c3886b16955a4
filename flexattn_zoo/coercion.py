"""Coercion of every accepted ``mask=`` / ``score_mod=`` form into a spec.

``fz.attention`` accepts a spec object, a registry name, a raw flex callable (wrapped by
:mod:`flexattn_zoo.functions`), or a tensor as SDPA's ``attn_mask`` (see :func:`tensor_args`);
everything past this module only ever sees specs.

Tensors, following SDPA:

* ``mask=`` a bool tensor (True = attend) is ``masks.Dense(mask=t)``;
* ``score_mod=`` a floating tensor is ``score_mods.Bias(bias=t)``, added to the scaled scores;
* ``mask=`` a floating tensor is an additive mask, as SDPA's float ``attn_mask``: it becomes
  ``score_mod=Bias(bias=t)`` (``-inf`` hides a key), and is refused (``ValueError`` naming
  ``mask``) when a ``score_mod`` is given as well, since the order of the two would be a guess;
* ``score_mod=`` a bool tensor, and tensors of other dtypes, are refused (naming the argument).
"""

from __future__ import annotations

from typing import Any

import torch

from flexattn_zoo import _compat
from flexattn_zoo.functions import (
    FunctionMask,
    FunctionScore,
    Probed,
    check_mask_function,
    check_score_function,
    traced_hazards,
)
from flexattn_zoo.registry import MASKS, SCORES
from flexattn_zoo.spec import MaskSpec, ScoreSpec

# _check_callables_eagerly: a raw callable's checks (its signature, a probe call on small index
# grids) run only eagerly. While torch.compile traces, Dynamo cannot inspect signatures, and the
# callable is traced into the graph anyway, so a bad one fails there with Dynamo's own error;
# run the model once eagerly (or call fz.attention with the callable) for the named TypeError.
# Without the probe's verdict a traced callable is evaluated on index grids as flex does (exact
# for every callable flex runs; a broadcast call is not, for one written for 0-d indices), and
# its hazards are what its code shows (functions.traced_hazards).


def _traced_verdict(fn: Any) -> Probed:
    return Probed(True, traced_hazards(fn))


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
    if isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool:
            what = (
                "an additive mask: pass it as score_mod= (or score_mods.Bias)"
                if mask.is_floating_point()
                else "not a mask"
            )
            raise TypeError(f"{arg} got a {mask.dtype} tensor ({what}); a mask tensor is bool, True = attend")
        return MASKS.get("dense", mask=mask)
    if isinstance(mask, ScoreSpec):
        raise TypeError(f"{arg} got a score spec ({type(mask).__name__}); pass it as score_mod=")
    _refuse_spec_class(mask, arg)
    if callable(mask):
        # see _check_callables_eagerly
        probed = check_mask_function(mask, arg) if not _compat.is_compiling() else _traced_verdict(mask)
        label = getattr(mask, "__name__", "mask_mod")
        return FunctionMask(fn=mask, label=label, scalar=probed.scalar, hazards=probed.hazards)
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
    if isinstance(score, torch.Tensor):
        if score.dtype == torch.bool:
            raise ValueError(
                f"{arg} got a bool tensor; a boolean mask (True = attend) goes in mask=, a score_mod "
                "tensor is a floating additive bias"
            )
        if not score.is_floating_point():
            raise TypeError(f"{arg} got a {score.dtype} tensor; an additive bias is a floating tensor")
        return SCORES.get("bias", bias=score)
    if isinstance(score, MaskSpec):
        raise TypeError(f"{arg} got a mask spec ({type(score).__name__}); pass it as mask=")
    _refuse_spec_class(score, arg)
    if callable(score):
        # see _check_callables_eagerly
        probed = check_score_function(score, arg) if not _compat.is_compiling() else _traced_verdict(score)
        label = getattr(score, "__name__", "score_mod")
        return FunctionScore(fn=score, label=label, scalar=probed.scalar, hazards=probed.hazards)
    raise TypeError(
        f"{arg} must be None, a score spec (e.g. score_mods.SoftCap(cap=30.0)), a registry name "
        f"(one of {', '.join(SCORES.names())}) or a score_mod callable; got {type(score).__name__}"
    )


def tensor_args(mask: Any, score_mod: Any) -> tuple[Any, Any]:
    """``(mask, score_mod)`` with tensors turned into specs (see the module docstring): a bool
    ``mask`` becomes ``masks.Dense``, a floating ``score_mod`` ``score_mods.Bias``, and a floating
    ``mask`` (SDPA's additive ``attn_mask``) moves to ``score_mod`` as a ``Bias``. Anything else
    is returned as given (and coerced later)."""
    mask_is_tensor = isinstance(mask, torch.Tensor)
    if not mask_is_tensor and not isinstance(score_mod, torch.Tensor):
        return mask, score_mod  # no tensor argument (most calls): nothing to turn into a spec
    if mask_is_tensor and mask.is_floating_point():
        if score_mod is not None:
            raise ValueError(
                "mask got a floating tensor, an additive mask (SDPA's float attn_mask, added to the scaled "
                "scores), and score_mod is given too: the order of the two is ambiguous. Chain them "
                "explicitly as score_mod=score_mods.Bias(bias=t) >> your_score_mod (or the reverse), or "
                "pass a bool mask (True = attend)"
            )
        return None, as_score_spec(mask, arg="mask")
    if mask_is_tensor:
        mask = as_mask_spec(mask)
    if isinstance(score_mod, torch.Tensor):
        score_mod = as_score_spec(score_mod)
    return mask, score_mod


def with_causal(mask: Any, is_causal: Any, *, arg: str = "is_causal") -> Any:
    """``mask`` with SDPA's ``is_causal`` applied: ``masks.Causal()`` (top-left aligned: key ``j``
    visible to query ``i`` iff ``j <= i``, also when Lq != Lkv, as SDPA) when ``mask`` is None,
    else ``mask & Causal()``. ``mask`` as given when ``is_causal`` is False. A BlockMask is
    refused (build the causal part into it)."""
    if type(is_causal) is not bool:
        raise TypeError(f"{arg} must be a bool, got {type(is_causal).__name__}")
    if not is_causal:
        return mask
    if isinstance(mask, _compat.BlockMask):
        raise ValueError(
            f"{arg}=True cannot be combined with a BlockMask mask; build the causal part into it"
        )
    causal = MASKS.get("causal")
    spec = as_mask_spec(mask)
    return causal if spec is None else spec & causal


def check_kernel_options(options: Any) -> tuple[tuple[str, Any], ...] | None:
    """``kernel_options`` (a dict of flex ``kernel_options``, or None) as a sorted, hashable tuple."""
    if options is None:
        return None
    if not isinstance(options, dict):
        raise TypeError(
            f"kernel_options must be a dict (flex_attention's kernel_options) or None, got {type(options).__name__}"
        )
    out = []
    for key, value in options.items():
        if not isinstance(key, str):
            raise TypeError(f"kernel_options keys must be str, got {key!r}")
        if not isinstance(value, (bool, int, float, str)):
            raise TypeError(
                f"kernel_options[{key!r}] must be a bool, int, float or str, got {type(value).__name__}"
            )
        out.append((key, value))
    if "BACKEND" in options:
        # flex_attention checks these two itself, but inside the compiled call, where Dynamo turns
        # its error into "Unsupported: Observed exception": checked here, by the same rules.
        backends = _compat.FLEX_BACKENDS
        if backends and options["BACKEND"] not in backends:
            raise ValueError(
                f"kernel_options['BACKEND'] must be one of {', '.join(map(repr, backends))}, "
                f"got {options['BACKEND']!r}"
            )
        if options.get("FORCE_USE_FLEX_ATTENTION", False):
            raise ValueError(
                "kernel_options: BACKEND supersedes the legacy FORCE_USE_FLEX_ATTENTION; give only BACKEND"
            )
    return tuple(sorted(out)) or None  # {}: no options
