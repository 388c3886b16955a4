"""``flexattn-zoo list presets``: every model preset with its pattern and source."""

from __future__ import annotations

import pytest

from flexattn_zoo.cli import app as cli
from flexattn_zoo.models import presets


def test_list_presets(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["list", "presets", "--long"]) == 0
    out = capsys.readouterr().out
    for name in presets.names():
        assert name in out
    assert "arXiv:2408.00118" in out  # Gemma 2's citation (sources are in the long listing)
    assert "sliding_window" not in out.split("model presets")[0]  # masks are not listed


def test_list_all_includes_presets(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "gpt_oss" in out and "sliding_window" in out
