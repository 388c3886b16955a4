"""Turning command-line ``--name value`` pairs into zoo specs (the CLI's helper).

Spec parameters are not known to argparse in advance (users register their own specs), so the CLI
collects every option it does not define itself and hands it here:

* values parse as ``true``/``false`` (bool), ``none``, int, float, comma lists (``3,2,1``),
  semicolon-separated rows of lists (``0,0,1;0,1,1``), or stay strings (``bottom_right``);
* ``--doc-ids`` is the parameter ``doc_ids``; ``--chunked.size 16`` targets one part of a
  combination; a plain name goes to every part that has that parameter;
* a list given to a tensor-typed field becomes a tensor, to any other field a tuple;
* a parameter that is not a field but is the argument of a ``from_*`` constructor picks that
  constructor: ``document --lengths 3,2,1`` calls ``Document.from_lengths(lengths=[3, 2, 1])``.

Combinations are written with ``+``: ``causal+chunked`` is ``Causal() & Chunked(...)`` for masks,
``alibi+softcap`` is ``Alibi(...) >> SoftCap(...)`` for score mods.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Iterable
from typing import Any

import torch

from flexattn_zoo.compose import And, Chain, Not, Or
from flexattn_zoo.registry import MASKS, SCORES, Entry, Registry
from flexattn_zoo.spec import MaskSpec, ScoreSpec, Spec


class CliError(Exception):
    """A failure to report without a traceback, with its exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


_TRUE = {"true", "yes", "on"}
_FALSE = {"false", "no", "off"}


def parse_scalar(text: str) -> Any:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    if low in ("none", "null"):
        return None
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text.strip()


def parse_value(text: str) -> Any:
    """``"3"`` -> 3, ``"0.5"`` -> 0.5, ``"true"`` -> True, ``"1,2"`` -> [1, 2], ``"1,2;3,4"`` -> [[1, 2], [3, 4]]."""
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    if ";" in body:
        return [parse_value(row) for row in body.split(";") if row.strip()]
    if "," in body:
        return [parse_scalar(part) for part in body.split(",") if part.strip()]
    return parse_scalar(body)


def split_options(
    tokens: Iterable[str], known: dict[str, bool]
) -> tuple[list[str], list[tuple[str, str | None]]]:
    """Split argv into the tokens argparse knows and ``(name, raw value)`` spec parameters.

    ``known`` maps each option string of the subcommand to whether it takes a value. An unknown
    ``--name`` takes the next token as its value unless that token is another ``--option``
    (negative numbers such as ``-1`` are values); ``--name=value`` works too.
    """
    kept: list[str] = []
    params: list[tuple[str, str | None]] = []
    items = list(tokens)
    i = 0
    while i < len(items):
        tok = items[i]
        name, eq, inline = tok.partition("=")
        if tok == "--":
            kept.extend(items[i:])
            break
        if name in known or not tok.startswith("--"):
            kept.append(tok)
            if name in known and known[name] and not eq and i + 1 < len(items):
                kept.append(items[i + 1])
                i += 1
            i += 1
            continue
        if eq:
            params.append((name[2:], inline))
        elif i + 1 < len(items) and not items[i + 1].startswith("--"):
            params.append((name[2:], items[i + 1]))
            i += 1
        else:
            params.append((name[2:], None))  # a bare flag means True
        i += 1
    return kept, params


@dataclasses.dataclass
class Part:
    """One named component of a ``+`` combination."""

    registry: Registry[Any]
    name: str
    entry: Entry
    params: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def fields(self) -> list[str]:
        return [p for p, _ in self.entry.params]

    def constructors(self) -> dict[str, inspect.Signature]:
        """``from_*`` classmethods of the spec class and their signatures."""
        factory = self.entry.factory
        if not isinstance(factory, type):
            return {}
        found = {}
        for attr in sorted(dir(factory)):
            if attr.startswith("from_") and callable(getattr(factory, attr)):
                try:
                    found[attr] = inspect.signature(getattr(factory, attr))
                except (TypeError, ValueError):
                    continue
        return found

    def accepts(self, param: str) -> bool:
        return param in self.fields or any(param in sig.parameters for sig in self.constructors().values())

    def valid_names(self) -> list[str]:
        names = list(self.fields)
        for sig in self.constructors().values():
            names.extend(p for p in sig.parameters if p not in names and p != "device")
        return names


def _suggest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    return f" Did you mean --{close[0].replace('_', '-')}?" if close else ""


def _tensor_fields(factory: Any) -> set[str]:
    if not (isinstance(factory, type) and dataclasses.is_dataclass(factory)):
        return set()
    return {f.name for f in dataclasses.fields(factory) if "Tensor" in str(f.type)}


def _build(part: Part, context: dict[str, Any]) -> Spec:
    params = dict(part.params)
    # Fill a required parameter the problem already determines (ALiBi's num_heads = heads).
    for name, default in part.entry.params:
        if default == "required" and name not in params and name in context:
            params[name] = context[name]
    extra = [p for p in params if p not in part.fields]
    if extra:
        for ctor, sig in part.constructors().items():
            accepted = set(sig.parameters)
            required = {
                n
                for n, p in sig.parameters.items()
                if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            }
            if set(extra) <= accepted and required <= set(params) and set(params) <= accepted:
                return getattr(part.entry.factory, ctor)(**params)
        # No constructor fits: let the registry produce its standard error listing valid names.
    tensors = _tensor_fields(part.entry.factory)
    for key, value in params.items():
        if isinstance(value, list):
            params[key] = _as_tensor(key, value) if key in tensors else tuple(value)
    return part.registry.get(part.name, **params)


def _as_tensor(key: str, value: list[Any]) -> torch.Tensor:
    """A list parsed from ``--key`` as a tensor; ValueError naming the option when it is not one."""
    option = "--" + key.replace("_", "-")
    flat = [x for row in value for x in (row if isinstance(row, list) else [row])]
    bad = [x for x in flat if isinstance(x, bool) or not isinstance(x, (int, float))]
    if bad:
        raise ValueError(
            f"{option} takes comma-separated numbers (rows separated by ';', e.g. 0,0,1;0,1,1), "
            f"got the non-number {bad[0]!r}"
        )
    try:
        return torch.tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise ValueError(
            f"{option} takes comma-separated numbers (rows of equal length separated by ';', each "
            f"within int64): {exc}"
        ) from None


def _parts(text: str, registry: Registry[Any]) -> list[Part]:
    names = [n.strip() for n in text.split("+")]
    if not all(names):
        raise ValueError(
            f"bad {registry.kind} combination {text!r}: write names joined by '+', e.g. causal+chunked"
        )
    return [Part(registry, n, registry.entry(n)) for n in names]


def build_specs(
    mask: str | None,
    score: str | None,
    raw_params: list[tuple[str, str | None]],
    context: dict[str, Any] | None = None,
) -> tuple[MaskSpec | None, ScoreSpec | None]:
    """Build the mask spec and the score spec named on the command line from their parameters.

    Raises:
        ValueError: unknown names, parameters no part accepts, or values a spec rejects.
    """
    mask_parts = _parts(mask, MASKS) if mask else []
    score_parts = _parts(score, SCORES) if score else []
    parts = mask_parts + score_parts
    for raw_name, raw_value in raw_params:
        value = True if raw_value is None else parse_value(raw_value)
        target, dot, name = raw_name.replace("-", "_").rpartition(".")
        if not dot:
            target, name = "", raw_name.replace("-", "_")
        chosen = [p for p in parts if (not target or p.name == target) and p.accepts(name)]
        if not chosen:
            if target and not any(p.name == target for p in parts):
                raise ValueError(
                    f"--{raw_name}: {target!r} is not part of this command's specs "
                    f"({', '.join(p.name for p in parts) or 'none given'})"
                )
            valid = sorted({n for p in parts for n in p.valid_names()})
            pretty = ", ".join(f"--{n.replace('_', '-')}" for n in valid) or "(none)"
            raise ValueError(
                f"unknown parameter --{raw_name} for {'+'.join(p.name for p in parts) or 'this command'}; "
                f"valid parameters: {pretty}.{_suggest(name, valid)}"
            )
        for p in chosen:
            p.params[name] = value
    ctx = context or {}
    mask_specs = [_build(p, ctx) for p in mask_parts]
    score_specs = [_build(p, ctx) for p in score_parts]
    mask_spec: MaskSpec | None = None
    for m in mask_specs:
        assert isinstance(m, MaskSpec)  # built from MASKS entries
        mask_spec = m if mask_spec is None else mask_spec & m
    score_spec: ScoreSpec | None = None
    for s in score_specs:
        assert isinstance(s, ScoreSpec)  # built from SCORES entries
        score_spec = s if score_spec is None else score_spec >> s
    return mask_spec, score_spec


def describe_params(entry: Entry) -> str:
    """``left, right=0`` for the CLI listing."""
    return ", ".join(name if default == "required" else f"{name}={default}" for name, default in entry.params)


def describe_spec(spec: Any) -> str:
    """Compact text of a spec: ``document(doc_ids=<8192>) & causal``, ``alibi(num_heads=8) >> softcap(cap=30.0)``.

    Shows the registry name and only the parameters that differ from their defaults; tensors
    appear as their shape.
    """
    if spec is None:
        return "none"
    if isinstance(spec, (And, Or)):
        op = " & " if isinstance(spec, And) else " | "
        return op.join(_grouped(p) for p in spec.parts)
    if isinstance(spec, Not):
        return "~" + _grouped(spec.part)
    if isinstance(spec, Chain):
        return " >> ".join(_grouped(m) for m in spec.mods)
    label = getattr(spec, "label", None)
    if isinstance(label, str) and label:  # a registered plain function (FunctionMask / FunctionScore)
        return label
    name = getattr(spec, "name", "") or type(spec).__name__
    parts = []
    if dataclasses.is_dataclass(spec):
        for f in dataclasses.fields(spec):
            value = getattr(spec, f.name)
            if isinstance(value, torch.Tensor):
                parts.append(f"{f.name}=<{'x'.join(map(str, value.shape))}>")
            elif isinstance(value, Spec):  # a wrapped spec (PerDocument's inner, its documents)
                parts.append(f"{f.name}={describe_spec(value)}")
            elif f.default is dataclasses.MISSING or value != f.default:
                parts.append(f"{f.name}={value!r}")
    return f"{name}({', '.join(parts)})" if parts else name


def _grouped(spec: Any) -> str:
    text = describe_spec(spec)
    return f"({text})" if isinstance(spec, (And, Or, Chain)) else text
