"""Spec plugins: entry points in the group ``flexattn_zoo.specs``, loaded once on the first lookup.

Each test lays out fake installed distributions (a ``*.dist-info`` directory with METADATA and
entry_points.txt, beside the modules they name) in a temporary directory put on ``sys.path``, and
gives the registry module a fresh loader, so the real process state is left as it was.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import flexattn_zoo as fz
from flexattn_zoo import masks, registry, score_mods
from flexattn_zoo.cli import main
from flexattn_zoo.registry import MASKS, PLUGIN_GROUP, SCORES

GOOD = """
import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.spec import MaskSpec, spec_dataclass

# Looking names up while the plugins load neither deadlocks nor loads them again.
assert "causal" in masks.names()
LOADS = globals().get("LOADS", 0) + 1


@masks.register
@spec_dataclass
class PlugMask(MaskSpec):
    \"\"\"A plugin's mask: keys up to the query.\"\"\"

    def mask_mod(self):
        return lambda b, h, q_idx, kv_idx: kv_idx <= q_idx


def plug_score(score, b, h, q_idx, kv_idx):
    return score * 0.5


score_mods.register_function("plug_score", plug_score)
"""


def _dist(root: Path, name: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    info = root / f"{name.replace('-', '_')}-0.1.dist-info"  # escaped as in a wheel
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{PLUGIN_GROUP}]\n{lines}")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path for fake distributions; a fresh plugin loader; cleanup of what the
    plugins registered and imported."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_PLUGINS", registry._Plugins())
    before = {id(r): set(r._entries) for r in (MASKS, SCORES)}
    modules = set(sys.modules)
    yield tmp_path
    for r in (MASKS, SCORES):
        for name in set(r._entries) - before[id(r)]:
            r.unregister(name)
    for name in set(sys.modules) - modules:
        if name.startswith("fzplug_"):
            del sys.modules[name]


def test_plugin_specs_registered_on_first_lookup(site: Path) -> None:
    _dist(site, "fzplug-good", {"good": "fzplug_good"}, {"fzplug_good": GOOD})
    assert "fzplug_good" not in sys.modules and not registry._PLUGINS.done
    assert "plug_mask" in masks.names() and "plug_score" in score_mods.names()
    assert sys.modules["fzplug_good"].LOADS == 1
    # Loaded once: later lookups import nothing again.
    assert masks.get("plug_mask").name == "plug_mask"
    assert registry.plugins() == [registry.Plugin("good", "fzplug_good", "fzplug-good 0.1", None)]
    assert sys.modules["fzplug_good"].LOADS == 1
    # The plugin's specs run like the zoo's.
    import torch

    q, k, v = (torch.randn(1, 1, 8, 4) for _ in range(3))
    out = fz.attention(q, k, v, mask="plug_mask", score_mod="plug_score")
    ref = fz.attention(q, k, v, mask="causal", score_mod=lambda s, b, h, qi, ki: s * 0.5)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("lookup", ["find", "contains", "get", "entries"])
def test_every_lookup_loads_the_plugins(site: Path, lookup: str) -> None:
    _dist(site, "fzplug-good", {"good": "fzplug_good"}, {"fzplug_good": GOOD})
    if lookup == "find":
        assert MASKS.find("plug_mask") is not None
    elif lookup == "contains":
        assert "plug_mask" in MASKS
    elif lookup == "get":
        assert score_mods.get("plug_score").label == "plug_score"
    else:
        assert "plug_mask" in [e.name for e in MASKS.entries()]


def test_failing_plugin_warns_and_the_rest_loads(site: Path) -> None:
    _dist(
        site,
        "fzplug-bad",
        {"broken": "fzplug_broken", "missing": "fzplug_nowhere", "clash": "fzplug_clash:thing"},
        {
            "fzplug_broken": "raise RuntimeError('plugin bug')\n",
            # Registers a name the zoo has: the registry's ValueError is the plugin's failure.
            "fzplug_clash": "from flexattn_zoo import masks\nmasks.register_function('causal', "
            "lambda b, h, q, k: k <= q)\nthing = 1\n",
        },
    )
    _dist(site, "fzplug-good", {"good": "fzplug_good"}, {"fzplug_good": GOOD})
    with pytest.warns(RuntimeWarning) as caught:
        names = masks.names()
    text = "\n".join(str(w.message) for w in caught)
    assert "'broken' (fzplug_broken, from fzplug-bad 0.1)" in text and "plugin bug" in text
    assert "'missing' (fzplug_nowhere" in text and "ModuleNotFoundError" in text
    assert "'clash' (fzplug_clash:thing" in text and "already registered" in text
    assert "plug_mask" in names, registry.plugins()
    assert masks.get("causal") == masks.Causal()
    status = {p.name: p.loaded for p in registry.plugins()}
    assert status == {"broken": False, "clash": False, "good": True, "missing": False}


def test_cli_lists_plugin_specs_and_env_shows_them(
    site: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _dist(site, "fzplug-good", {"good": "fzplug_good"}, {"fzplug_good": GOOD})
    _dist(site, "fzplug-bad", {"broken": "fzplug_broken"}, {"fzplug_broken": "1 / 0\n"})
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.warns(RuntimeWarning, match="'broken'"):
        assert main(["list", "masks"]) == 0
    assert "plug_mask" in capsys.readouterr().out
    assert main(["env"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "good = fzplug_good (fzplug-good 0.1)" in out
    assert "broken = fzplug_broken (fzplug-bad 0.1): FAILED, ZeroDivisionError" in out


def test_not_loaded_at_import(tmp_path: Path) -> None:
    """``import flexattn_zoo`` (and the CLI module) imports no plugin; the first listing does."""
    _dist(tmp_path, "fzplug-good", {"good": "fzplug_good"}, {"fzplug_good": GOOD})
    code = textwrap.dedent(
        """
        import sys
        import flexattn_zoo, flexattn_zoo.cli.app
        from flexattn_zoo import registry
        assert not registry._PLUGINS.done and "fzplug_good" not in sys.modules
        flexattn_zoo.masks.names()
        assert registry._PLUGINS.done and "fzplug_good" in sys.modules
        """
    )
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join([str(tmp_path), str(root), os.environ.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": path})


def test_traced_lookup_loads_nothing_and_later_loading_recompiles_nothing(site: Path) -> None:
    import torch
    import torch._dynamo.testing

    _dist(site, "fzplug-good", {"good": "fzplug_good"}, {"fzplug_good": GOOD})
    counter = torch._dynamo.testing.CompileCounter()
    fn = torch.compile(lambda q, k, v: fz.attention(q, k, v, mask="causal"), backend=counter, fullgraph=True)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    fn(q, k, v)
    assert counter.frame_count == 1 and not registry._PLUGINS.done  # the trace imported nothing
    assert "plug_mask" in masks.names()  # the first eager lookup loads them
    fn(q, k, v)
    assert counter.frame_count == 1  # no guard on the loader's flag
