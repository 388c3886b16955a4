"""Type-check the package with mypy, laid out as it installs.

The repository keeps ``masks/`` and ``score_mods/`` at its root; pyproject's package-dir installs
them as ``flexattn_zoo.masks`` and ``flexattn_zoo.score_mods``. mypy has no such mapping and cannot
follow an editable install's import hook (nor the ``__path__`` extension that a PYTHONPATH checkout
relies on), so this script links the installed layout into ``build/typecheck/``, runs mypy there
with the ``[tool.mypy]`` settings of pyproject.toml, and prints paths as they are in the repository.
It works the same in a PYTHONPATH checkout and under any install mode. Besides the package it checks
the test modules in ``TESTS`` (``assert_type`` checks of the public API's types), linked in as
top-level modules.

Usage: ``python tools/typecheck.py [extra mypy arguments]``; the exit status is mypy's.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "flexattn_zoo"
#: Subpackages kept outside the package directory (pyproject [tool.setuptools.package-dir]).
MAPPED = {"masks": "masks", "score_mods": "score_mods"}
#: Test modules type-checked with the package: module name -> path in the repository.
TESTS = {"test_typing": "tests/unit/test_typing.py"}


def _link(src: Path, dst: Path) -> None:
    try:
        dst.symlink_to(src, target_is_directory=src.is_dir())
    except OSError:  # no symlinks here (e.g. Windows without the privilege): copy instead
        if src.is_dir():
            shutil.copytree(src, dst, copy_function=shutil.copy2)
        else:
            shutil.copy2(src, dst)


def build_tree() -> Path:
    tree = ROOT / "build" / "typecheck"
    shutil.rmtree(tree, ignore_errors=True)
    pkg = tree / PACKAGE
    pkg.mkdir(parents=True)
    for entry in sorted((ROOT / PACKAGE).iterdir()):
        if entry.name != "__pycache__" and entry.name not in MAPPED:
            _link(entry, pkg / entry.name)
    for sub, src in MAPPED.items():
        _link(ROOT / src, pkg / sub)
    for module, src in TESTS.items():
        _link(ROOT / src, tree / f"{module}.py")
    return tree


def main(argv: list[str]) -> int:
    tree = build_tree()
    cmd = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        str(ROOT / "pyproject.toml"),
        "--cache-dir",
        str(ROOT / ".mypy_cache"),
        # Targets on the command line replace the config's ``packages``: name the package again.
        "-p",
        PACKAGE,
        *(arg for module in TESTS for arg in ("-m", module)),
        *argv,
    ]
    # mypy puts its working directory first on the search path: run it in the tree, so that
    # flexattn_zoo resolves there and not to the repository's own flexattn_zoo/ (which lacks masks).
    proc = subprocess.run(cmd, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    mapped = re.compile(rf"^{PACKAGE}/({'|'.join(map(re.escape, MAPPED))})/", re.MULTILINE)
    tests = re.compile(rf"^({'|'.join(map(re.escape, TESTS))})\.py:", re.MULTILINE)
    out = mapped.sub(lambda m: MAPPED[m.group(1)] + "/", proc.stdout)
    sys.stdout.write(tests.sub(lambda m: TESTS[m.group(1)] + ":", out))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
