"""Specs that wrap user functions: a raw flex ``mask_mod`` / ``score_mod`` callable as a spec.

``fz.attention`` accepts a raw flex callable where it takes a spec; :mod:`flexattn_zoo.coercion`
wraps it here so the rest of the library only ever sees specs. The dense oracle of a wrapped
function evaluates the function itself on broadcast index grids, so write it with elementwise
torch ops (which flex requires anyway).
"""

from __future__ import annotations

import dis
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from flexattn_zoo.spec import MaskMod, MaskSpec, ScoreMod, ScoreSpec, Spec, spec_dataclass


def _reads_argument(fn: Callable[..., Any], index: int) -> bool:
    """Whether ``fn`` can depend on its ``index``-th positional argument.

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


def _grids(batch: int, heads: int, q_len: int, kv_len: int) -> tuple[torch.Tensor, ...]:
    b = torch.arange(batch).view(batch, 1, 1, 1)
    h = torch.arange(heads).view(1, heads, 1, 1)
    q = torch.arange(q_len).view(1, 1, q_len, 1)
    kv = torch.arange(kv_len).view(1, 1, 1, kv_len)
    return b, h, q, kv


@spec_dataclass
class FunctionMask(MaskSpec):
    """A user ``mask_mod(b, h, q_idx, kv_idx) -> bool`` as a spec (identity = the function object)."""

    fn: Callable[..., Any]
    label: str = ""

    def uses_batch(self) -> bool:
        return _reads_argument(self.fn, 0)

    def uses_head(self) -> bool:
        return _reads_argument(self.fn, 1)

    def _make_mask_mod(self) -> MaskMod:
        return self.fn

    def tensors(self) -> list[torch.Tensor]:
        return captured_tensors(self.fn)

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        # Evaluated where the tensors the function indexes live (e.g. CUDA document ids), returned
        # on the CPU like the other specs' oracles (composites combine them).
        device = _captured_device(self.fn)
        b, h, q, kv = (g.to(device) for g in _grids(batch, heads, q_len, kv_len))
        out = torch.as_tensor(self.fn(b, h, q, kv)).cpu()
        return torch.broadcast_to(out, (batch, heads, q_len, kv_len))


@spec_dataclass
class FunctionScore(ScoreSpec):
    """A user ``score_mod(score, b, h, q_idx, kv_idx) -> score`` as a spec."""

    fn: Callable[..., Any]
    label: str = ""

    def _make_score_mod(self, *, fast: bool) -> ScoreMod:
        return self.fn

    def tensors(self) -> list[torch.Tensor]:
        # What the function closes over: a learnable bias there makes the call need a backward.
        return captured_tensors(self.fn)

    def uses_head(self) -> bool:
        return True  # unknown: a user function may read h

    def dense(self, scores: torch.Tensor) -> torch.Tensor:
        batch, heads, q_len, kv_len = scores.shape
        b, h, q, kv = (g.to(scores.device) for g in _grids(batch, heads, q_len, kv_len))
        return torch.broadcast_to(self.fn(scores, b, h, q, kv), scores.shape).to(scores.dtype)


_PROBE_HINT = (
    "index tensors (flex calls it on tensors: use elementwise ops such as &, |, torch.where, "
    "not Python if/and/or on them)"
)


def _probe_grids(device: torch.device) -> tuple[tuple[torch.Tensor, ...], ...]:
    """Scalar int32 indices (what flex's vmap passes per element) and small broadcast grids (what
    the dense route and BlockMask builder pass), so data-dependent Python control flow fails here,
    with a clear message, instead of deep inside a kernel or the reference."""
    z = torch.zeros((), dtype=torch.int32, device=device)
    # All-zero values (in range for any captured table), but multi-element shapes.
    shapes = ((1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2))
    grids = tuple(torch.zeros(shape, dtype=torch.int32, device=device) for shape in shapes)
    return (z, z, z, z), grids


#: Objects :func:`captured_tensors` visits at most (a function naming a huge global object graph).
WALK_LIMIT = 10_000


def captured_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor a user callable can read besides its arguments: its closure cells, defaults
    (positional and keyword-only) and the globals it names, recursively through the functions,
    bound methods (``self``), ``functools.partial`` objects, callable objects, ``nn.Module``
    parameters/buffers, specs and containers found there. The one walk behind both where a
    function's tables live (:func:`_captured_device`) and whether it captures learnable tensors
    (``ScoreSpec.captures_grad_tensors``, hence the problem's need for a backward)."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack: list[Any] = [obj]
    while stack and len(seen) < WALK_LIMIT:
        value = stack.pop()
        if id(value) in seen or value is None or isinstance(value, (str, bytes, int, float, bool, type)):
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, Spec):
            found.extend(value.tensors())
        elif isinstance(value, torch.nn.Module):
            found.extend(value.parameters())
            found.extend(value.buffers())
        elif isinstance(value, (tuple, list, set, frozenset)):
            stack.extend(reversed(list(value)))
        elif isinstance(value, dict):
            stack.extend(reversed(list(value.values())))
        elif inspect.ismethod(value):
            stack.extend([*_attributes_read(value.__self__, value.__func__), value.__func__])
        elif isinstance(value, functools.partial):
            stack.extend([*value.keywords.values(), *value.args, value.func])
        elif inspect.isfunction(value):
            stack.extend(reversed(_function_values(value)))
        elif callable(value) and not inspect.isbuiltin(value) and not inspect.ismodule(value):
            # A callable object (a class with __call__): the attributes its __call__ reads.
            call = next((vars(c)["__call__"] for c in type(value).__mro__ if "__call__" in vars(c)), None)
            if inspect.isfunction(call):
                stack.extend([*_attributes_read(value, call), call])
    return found


def _attributes_read(obj: Any, fn: Any) -> list[Any]:
    """The attributes of ``obj`` (a method's ``self``) that ``fn``'s code names (``self.bias``)."""
    if isinstance(obj, torch.nn.Module):
        return [obj]  # parameters and buffers
    attrs = getattr(obj, "__dict__", None) or {}
    code = getattr(fn, "__code__", None)
    return [attrs[n] for n in (code.co_names if code is not None else ()) if n in attrs]


def _function_values(fn: Any) -> list[Any]:
    values: list[Any] = []
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell (a name bound later in the enclosing function)
            continue
    values += list(fn.__defaults__ or ())
    values += list((fn.__kwdefaults__ or {}).values())
    names = fn.__globals__ or {}
    values += [names[n] for n in fn.__code__.co_names if n in names and not inspect.ismodule(names[n])]
    return values


def _captured_device(fn: Callable[..., Any]) -> torch.device:
    """Where ``fn``'s captured tensors live (:func:`captured_tensors`): the device of the first
    non-CPU one, else the CPU. The probe indexes those tensors (``doc_ids[q_idx]``), and a CUDA
    table cannot be indexed with CPU indices."""
    for t in captured_tensors(fn):
        if t.device.type != "cpu":
            return t.device
    return torch.device("cpu")


def check_mask_function(fn: Callable[..., Any], arg: str = "mask") -> None:
    """Reject a callable that is not a valid ``mask_mod`` with a TypeError naming ``arg``."""
    _check_signature(fn, arg, "mask_mod", "b, h, q_idx, kv_idx", "bool", 4)
    for grids in _probe_grids(_captured_device(fn)):
        try:
            out = fn(*grids)
        except Exception as exc:  # noqa: BLE001 - the user's function failed: say so, with the cause
            raise TypeError(f"{arg} callable failed on {_PROBE_HINT}: {exc!r}") from exc
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
            raise TypeError(f"{arg} callable must return a bool tensor (e.g. q_idx >= kv_idx), got {got}")


def check_score_function(fn: Callable[..., Any], arg: str = "score_mod") -> None:
    """Reject a callable that is not a valid ``score_mod`` with a TypeError naming ``arg``."""
    _check_signature(fn, arg, "score_mod", "score, b, h, q_idx, kv_idx", "score", 5)
    device = _captured_device(fn)
    for grids in _probe_grids(device):
        score = torch.zeros(torch.broadcast_shapes(*(g.shape for g in grids)), device=device)
        try:
            out = fn(score, *grids)
        except Exception as exc:  # noqa: BLE001 - the user's function failed: say so, with the cause
            raise TypeError(f"{arg} callable failed on {_PROBE_HINT}: {exc!r}") from exc
        if not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point:
            got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
            raise TypeError(f"{arg} callable must return a floating tensor (the new score), got {got}")
