"""benchmarks/compiled_models.py: one tiny CPU row end to end, ``--resume`` and the JSON merge, and
how the report treats a row that does not compute the model's function (slow: ~15 s on a CPU)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "compiled_models.py"


@pytest.fixture(scope="module")
def cm() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compiled_models", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_tiny_row_runs_merges_and_resumes(cm: ModuleType, tmp_path: Path) -> None:
    out, md = tmp_path / "cm.json", tmp_path / "cm.md"
    argv = [
        "--tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--models", "llama",
        "--impls", "sdpa", "--modes", "prefill", "--json", str(out), "--md", str(md),
    ]  # fmt: skip
    assert cm.main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"] == "ok", row.get("error")
    assert row["graph_breaks"] == 0
    assert row["diff"]["is_reference"] and row["check"]["logits"]["shape"] == [1, 2048]
    assert cm.main([*argv, "--resume"]) == 0  # nothing left to run, nothing written
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 1 and len(data["runs"]) == 1
    text = md.read_text()
    assert "## llama, tiny B=1 L=256, prefill (reference: sdpa)" in text
    assert "`python benchmarks/compiled_models.py --tiny --device cpu" in text


def _row(cm: ModuleType, impl: str, ms: float, softcap: str, logits: list[float]) -> dict[str, Any]:
    import torch

    return {
        "model": "gemma2", "shape": "B=1 L=8", "impl": impl, "mode": "prefill", "fa4": False,
        "status": "ok", "median_ms": ms, "p10_ms": ms, "p90_ms": ms, "softcap": softcap,
        "weights_digest": [1.0, 2.0], "graph_breaks": 0, "notes": [],
        "check": {"logits": cm.encode_tensor(torch.tensor([logits]))},
    }  # fmt: skip


def test_rows_that_ignore_the_softcap_are_flagged_not_compared(cm: ModuleType) -> None:
    rows = [
        _row(cm, "sdpa", 1.0, "ignored", [1.0, 2.0]),
        _row(cm, "flex_attention", 4.0, "applied", [1.0, 2.0]),
        _row(cm, "flexattn_zoo", 2.0, "applied", [1.0, 2.5]),
    ]
    cm.compare(rows)
    by_impl = {r["impl"]: r for r in rows}
    assert by_impl["flexattn_zoo"]["diff"]["reference"] == "flex_attention"
    assert by_impl["flexattn_zoo"]["diff"]["logits_abs"] == pytest.approx(0.5)
    assert by_impl["sdpa"]["diff"]["reference"] == "flex_attention"
    text = cm.markdown({"runs": [], "rows": rows})
    lines = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "NOT the same function" in lines["sdpa"]
    # "vs best HF" counts flex_attention only (4 ms), not the faster sdpa row that skips the cap.
    assert "| 2.00x |" in lines["flexattn_zoo"] and "| 1.00x |" in lines["flex_attention"]
    assert "| - |" in lines["sdpa"]
