"""Counts how a flex route's compiled entry is called (shared by CPU and GPU tests)."""

from __future__ import annotations

import pytest

from flexattn_zoo.compile import CompiledFlex

#: ``run``: the signature-checked call; ``rerun``: the code object its last call ran, through
#: Dynamo's guards; ``run_unguarded``: the compiled graph without Dynamo's frame evaluation.
METHODS = ("run", "rerun", "run_unguarded")


def spy_compiled_flex(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """Patch :class:`CompiledFlex` so each of :data:`METHODS` appends to its list when called."""
    calls: dict[str, list[int]] = {name: [] for name in METHODS}
    for name, seen in calls.items():
        original = getattr(CompiledFlex, name)

        def spy(self, *args, _original=original, _seen=seen):  # type: ignore[no-untyped-def]
            _seen.append(1)
            return _original(self, *args)

        monkeypatch.setattr(CompiledFlex, name, spy)
    return calls


def counts(calls: dict[str, list[int]]) -> tuple[int, int, int]:
    """``(run, rerun, run_unguarded)`` call counts."""
    return len(calls["run"]), len(calls["rerun"]), len(calls["run_unguarded"])
