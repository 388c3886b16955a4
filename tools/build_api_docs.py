"""Build the API reference (HTML, from the docstrings) with pdoc into ``build/api/``.

Documents the public modules: ``flexattn_zoo`` (``fz``) with the subpackages it exports
(``masks``, ``score_mods``, ``testing``, ``viz``), and the modules it exports under other names
(``fz.layers``, ``fz.presets``, ``fz.decode``, ``fz.tune``) plus ``flexattn_zoo.hf`` (needs the
``hf`` extra). Docstrings are read as Google style (``Args:``/``Returns:``) over reStructuredText
(````literal````, ``:class:`` roles), as they are written.

Fails (exit status 1) on any error and on every warning pdoc gives -- a module it cannot find or
import, a docstring it cannot process, an annotation it cannot evaluate -- so a broken import or a
broken docstring breaks the build rather than leaving a page out. Warnings from elsewhere (torch's
own, while the package imports) are shown but do not count.

Usage (from the repository root, with the ``docs`` extra: ``pip install -e '.[docs,hf]'``)::

    python tools/build_api_docs.py [--out DIR]

Works the same from a PYTHONPATH checkout and from an install (the repository root is put first on
``sys.path``, so the checkout's sources are the ones documented).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The public modules, as importable names. ``flexattn_zoo`` takes its subpackages from its
#: ``__all__`` (masks, score_mods, testing, viz); the others are exported under another name.
MODULES = (
    "flexattn_zoo",
    "flexattn_zoo.models.layers",
    "flexattn_zoo.models.presets",
    "flexattn_zoo.models.sinks",
    "flexattn_zoo.models.decode",
    "flexattn_zoo.tuning",
    "flexattn_zoo.hf",
)
#: Modules whose pages must be built (a check that the package's own walk found its subpackages).
REQUIRED = (
    "flexattn_zoo",
    "flexattn_zoo.masks",
    "flexattn_zoo.score_mods",
    "flexattn_zoo.testing",
    "flexattn_zoo.viz",
    "flexattn_zoo.models.decode",
)


def _from_pdoc(w: warnings.WarningMessage) -> bool:
    """Whether pdoc gave the warning (its own code, or ``warnings.warn`` with a stacklevel that
    points into it), rather than a library imported while documenting."""
    import pdoc

    pdoc_dir = os.path.dirname(os.path.abspath(pdoc.__file__)) + os.sep
    return os.path.abspath(w.filename).startswith(pdoc_dir)


def build(out: Path) -> list[str]:
    """Render MODULES into ``out`` (emptied first); the problems found, as text."""
    import pdoc
    import pdoc.render

    if out.exists():
        shutil.rmtree(out)
    pdoc.render.configure(docformat="google", show_source=False, footer_text="flexattn-zoo")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            pdoc.pdoc(*MODULES, output_directory=out)
        except Exception as e:  # a module that does not import; a docstring pdoc cannot process
            cause = "".join(traceback.format_exception(e)).rstrip()
            return [f"pdoc failed: {type(e).__name__}: {e}\n{cause}"]
    problems = []
    for w in caught:
        text = f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})"
        if _from_pdoc(w):
            problems.append(text)
        else:
            print(f"(not pdoc's, ignored) {text}", file=sys.stderr)
    for name, module in sorted(sys.modules.items()):
        where = getattr(module, "__file__", None)
        if name.split(".")[0] == "flexattn_zoo" and where and ROOT not in Path(where).resolve().parents:
            problems.append(f"{name} was imported from {where}, not from this checkout ({ROOT})")
    for name in REQUIRED:
        page = out / (name.replace(".", "/") + ".html")
        if not page.is_file():
            problems.append(f"no page for {name} ({page})")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "api", help="output directory")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    start = time.perf_counter()
    problems = build(args.out)
    if problems:
        print(f"API docs: {len(problems)} problem(s):", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        return 1
    pages = sorted(args.out.rglob("*.html"))
    print(f"API docs: {len(pages)} pages in {args.out} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
