"""The package's shape: public import paths users rely on, and import arrows that point one way.

The core (``flexattn_zoo/*.py``, ``flexattn_zoo/backends/`` and ``flexattn_zoo/tuning/``) never
imports a wing (the other subpackages: bench, cli, hf, models, testing), and no two modules import
each other in a cycle.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import flexattn_zoo as fz

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "flexattn_zoo"
CORE_SUBPACKAGES = {"backends", "tuning"}
# The package's front doors re-export the public API (fz.Attention, fz.presets) and start the CLI.
ENTRY_POINTS = {"flexattn_zoo", "flexattn_zoo.__main__"}
WINGS = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} - CORE_SUBPACKAGES


def test_public_paths_import() -> None:
    import flexattn_zoo.hf  # noqa: F401 - needs the hf extra, installed in CI
    from flexattn_zoo import decode, presets, testing

    assert fz.testing is testing and callable(testing.reference_attention)
    assert fz.presets is presets and presets.names()
    assert fz.decode is decode and callable(decode.decode_step)
    assert callable(fz.layers.Attention) and fz.Attention is fz.layers.Attention
    assert callable(importlib.import_module("flexattn_zoo.hf").register)
    out = subprocess.run(
        [sys.executable, "-m", "flexattn_zoo.bench", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    assert "usage: python -m flexattn_zoo.bench" in out.stdout


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    out = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        out |= {t for t in targets if t in known and t != name and t != "flexattn_zoo"}
    return out


def _wing(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in WINGS else None


def test_core_never_imports_a_wing() -> None:
    mods = _modules()
    bad = [
        f"{m} imports {t}"
        for m, path in mods.items()
        if m not in ENTRY_POINTS and _wing(m) is None
        for t in _imports(m, path, set(mods))
        if _wing(t) is not None
    ]
    assert not bad, bad


def test_no_import_cycles() -> None:
    mods = _modules()
    graph = {m: _imports(m, p, set(mods)) - {m} for m, p in mods.items()}
    # A package imports its own submodules; a submodule naming its package is not a cycle.
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                pytest.fail("import cycle: " + " -> ".join([*stack[stack.index(t) :], t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_top_of_the_package_stays_small() -> None:
    assert len(list(PACKAGE.glob("*.py"))) <= 20
