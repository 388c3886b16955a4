"""The version has one home, ``flexattn_zoo.__version__``: the package metadata reads it and the
changelog's newest entry names it."""

from __future__ import annotations

import re
from pathlib import Path

import flexattn_zoo as fz

ROOT = Path(__file__).resolve().parents[2]


def test_version_lives_in_one_place() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject
    assert 'version = { attr = "flexattn_zoo.__version__" }' in pyproject
    assert re.fullmatch(r"\d+\.\d+\.\d+(?:(?:a|b|rc)\d+)?(?:\.dev\d+)?", fz.__version__)
    # No other file of the package or its docs spells the version out.
    spelled = [
        str(p.relative_to(ROOT))
        for folder in ("flexattn_zoo", "masks", "score_mods", "docs", "tests")
        for p in (ROOT / folder).rglob("*")
        if p.suffix in (".py", ".md", ".toml", ".yaml", ".txt")
        and p != ROOT / "flexattn_zoo" / "__init__.py"
        and f'"{fz.__version__}"' in p.read_text(encoding="utf-8")
    ]
    assert not spelled and f'"{fz.__version__}"' not in (ROOT / "README.md").read_text()


def test_changelog_names_the_current_version() -> None:
    headings = re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)
    versions = [h for h in headings if h != "Unreleased"]
    assert versions and versions[0] == fz.__version__, headings


def test_subpackages_come_from_the_package_own_tree() -> None:
    # A checkout on PYTHONPATH beside another checkout installed editable (a git worktree) must not
    # take masks/ and score_mods/ from the installed one: the registries would mix two trees.
    package = Path(fz.__file__).resolve().parent
    for sub in (fz.masks, fz.score_mods):
        home = Path(sub.__file__ or "").resolve().parent.parent
        assert home in (package, package.parent), (sub.__name__, sub.__file__, fz.__file__)
