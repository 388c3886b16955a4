"""Mask / score-mod pairs from YAML, with strict keys.

Format (every key optional, nothing else allowed)::

    mask: {name: sliding_window, left: 1023}        # a mapping: one registry entry
    score_mod: {name: softcap, cap: 30.0}

``mask`` may also be a list of mappings, combined with ``&`` (e.g. document & causal), and
``score_mod`` a list, chained in order (``a >> b``).
"""

from __future__ import annotations

import functools
import operator
import os
from pathlib import Path
from typing import Any

import yaml

from flexattn_zoo.registry import MASKS, SCORES, Registry, did_you_mean
from flexattn_zoo.spec import MaskSpec, ScoreSpec

TOP_LEVEL_KEYS = ("mask", "score_mod")


def _entry(reg: Registry[Any], item: Any, where: str) -> Any:
    if not isinstance(item, dict):
        raise ValueError(
            f"{where} must be a mapping like {{name: ..., param: value}}, got {type(item).__name__}"
        )
    if "name" not in item:
        raise ValueError(f"{where} needs a 'name' key (one of {', '.join(reg.names())})")
    params = {k: v for k, v in item.items() if k != "name"}
    try:
        return reg.get(item["name"], **params)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from exc


def spec_from_dict(data: Any) -> tuple[MaskSpec | None, ScoreSpec | None]:
    """Build ``(mask, score_mod)`` from an already-parsed mapping (see module doc)."""
    if data is None:
        return None, None
    if not isinstance(data, dict):
        raise ValueError(
            f"YAML config must be a mapping with keys {TOP_LEVEL_KEYS}, got {type(data).__name__}"
        )
    unknown = [k for k in data if k not in TOP_LEVEL_KEYS]
    if unknown:
        raise ValueError(
            f"unknown YAML key(s) {unknown}; valid keys: {', '.join(TOP_LEVEL_KEYS)}."
            f"{did_you_mean(str(unknown[0]), list(TOP_LEVEL_KEYS))}"
        )
    mask_spec = _combined(MASKS, data.get("mask"), "mask", operator.and_)
    score_spec = _combined(SCORES, data.get("score_mod"), "score_mod", operator.rshift)
    return mask_spec, score_spec


def _combined(reg: Registry[Any], value: Any, key: str, combine: Any) -> Any:
    """One ``{name: ...}`` mapping, or a list of them folded with ``combine`` (& or >>)."""
    if value is None:
        return None
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ValueError(f"{key}: an empty list; give at least one {{name: ...}} entry")
    where = (lambda i: f"{key}[{i}]") if isinstance(value, list) else (lambda i: key)
    return functools.reduce(combine, [_entry(reg, item, where(i)) for i, item in enumerate(items)])


def read_text_file(path: str | os.PathLike[str], what: str) -> str:
    """The UTF-8 text of the file ``path`` (``what`` names it in errors: "YAML config file").

    ValueError, never a bare OSError/UnicodeDecodeError, for a missing path, a directory, an
    unreadable file or bytes that are not UTF-8.
    """
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{what} {str(p)!r} is a directory, not a file")
    if not p.is_file():
        raise ValueError(f"{what} {str(p)!r} does not exist")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{what} {str(p)!r} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
            "save it as UTF-8"
        ) from None
    except OSError as exc:
        raise ValueError(f"{what} {str(p)!r} cannot be read: {exc.strerror or exc}") from None


def check_output_file(path: str | os.PathLike[str], option: str) -> None:
    """ValueError naming ``option`` when ``path`` cannot be an output file: a directory, or in a
    folder that does not exist. Checked before a command's work, so a long run is not lost at the
    end to a typo in its output path."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{option} {str(p)!r} is a directory; give a file name")
    folder = p.absolute().parent
    if not folder.is_dir():
        raise ValueError(f"{option} {str(p)!r}: folder {str(folder)!r} does not exist")


def load_yaml_spec(source: str | os.PathLike[str]) -> tuple[MaskSpec | None, ScoreSpec | None]:
    """Parse YAML text, or a path to a YAML file, into ``(mask, score_mod)`` specs."""
    text = str(source)
    if isinstance(source, os.PathLike) or (("\n" not in text) and text.endswith((".yaml", ".yml"))):
        text = read_text_file(source, "YAML config file")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"malformed YAML config: {exc}") from exc
    return spec_from_dict(data)
