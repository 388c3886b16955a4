"""Every ```python block of README.md and docs/*.md runs as written, on the CPU.

Convention (also stated in docs/testing.md, "Examples in these documents"):

* The blocks of one file run in order in one fresh namespace (a module of their own), so a later
  block may use what an earlier block of the same file defined. Each block runs with a temporary
  directory (one per file) as the working directory.
* A block that cannot run on a CPU in CI is marked on the line right before its opening fence::

      <!-- docs-test: skip (needs a CUDA GPU) -->

  It is not run; its test is reported as skipped with the reason in parentheses.
* A block that needs an optional package is marked ``<!-- docs-test: requires MODULE[, MODULE] -->``:
  it runs when every MODULE imports, and is skipped (naming the module) otherwise.
* Every other ```python block must run: an unmarked block that raises fails its test. A marker
  that is misspelled or not followed by a ```python fence fails ``test_markers_are_attached``.
  ```bash`` and other fences are never executed.
* A block that is not run is still compiled: a syntax error fails its test before the skip.
* A ``print(...)`` line whose trailing comment ends in ``-> TEXT`` states what it prints::

      print(out.shape)  # -> torch.Size([13, 4, 16])
      print(plan.backend)  # on the CPU -> sdpa_split

  TEXT must be a whole line of what the block prints, and the stated lines must come in the order
  of their ``print`` calls. Leave the arrow out where the output varies (errors, timings).

Masks and score mods a file's blocks register, and ``FLEXATTN_ZOO_*`` environment variables they
set, are undone after the file, so the rest of the test session sees the state it started with.

Blocks are listed at collection time; a block selected alone (``-k``) first runs the earlier
blocks of its file. Keep examples small (tiny shapes, float32, routes that need no compile on the
CPU unless the point is flex): CI has 2 cores and a CPU flex compile costs seconds.

The user docs also must not cite files that are not in the repository or commit hashes (those
belong in benchmarks/README.md, the measurement log), their links' ``#anchors`` must name a heading
of the page linked, and every Markdown table must start with its header and separator rows (a blank
line inside a table ends it, and the rest renders as text): checked by the last tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import os
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from flexattn_zoo.registry import MASKS, SCORES

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)\s*$")
_MARKER = re.compile(r"^<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
_SKIP = re.compile(r"^skip\s*\((.+)\)$")
_REQUIRES = re.compile(r"^requires\s+([\w.]+(?:\s*,\s*[\w.]+)*)$")
# A print line's stated output: the text after the last "->" of its trailing comment.
_PRINTS = re.compile(r"^\s*print\(.*#[^#]*->\s*(.*?)\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    index: int  # among the file's python blocks
    line: int  # 1-based line of the first code line
    code: str
    marker: str | None  # the text after "docs-test:", if the line before the fence has one

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line - 1}"

    @property
    def stated_output(self) -> list[str]:
        """The lines its ``print(...)  # -> TEXT`` comments say it prints, in order."""
        return [m.group(1) for line in self.code.splitlines() if (m := _PRINTS.match(line))]


def parse(path: Path) -> tuple[list[Block], list[str]]:
    """The python blocks of ``path`` and the problems found with markers (line: message)."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        marker_m = _MARKER.match(lines[i])
        if marker_m:
            nxt = _FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            if nxt is None or nxt.group(2) != "python":
                problems.append(f"line {i + 1}: docs-test marker not right before a ```python fence")
            text = marker_m.group(1)
            if not (_SKIP.match(text) or _REQUIRES.match(text)):
                problems.append(f"line {i + 1}: unknown docs-test marker {text!r}")
        if m is None:
            i += 1
            continue
        ticks, lang = m.group(1), m.group(2)
        end = i + 1
        while end < len(lines) and lines[end].strip() != ticks:
            end += 1
        if lang == "python":
            prev = _MARKER.match(lines[i - 1]) if i > 0 else None
            blocks.append(
                Block(
                    path,
                    len(blocks),
                    i + 2,
                    "\n".join(lines[i + 1 : end]) + "\n",
                    prev.group(1) if prev else None,
                )
            )
        i = end + 1
    return blocks, problems


BLOCKS = [b for path in DOC_FILES for b in parse(path)[0]]


def _why_not_run(block: Block) -> str | None:
    """The skip message for a marked block, or None when it must run here."""
    if block.marker is None:
        return None
    skip = _SKIP.match(block.marker)
    if skip:
        return f"{block.id}: marked docs-test skip: {skip.group(1)}"
    requires = _REQUIRES.match(block.marker)
    if requires:
        missing = [
            m.strip() for m in requires.group(1).split(",") if importlib.util.find_spec(m.strip()) is None
        ]
        return f"{block.id}: needs {', '.join(missing)} (not installed)" if missing else None
    return None  # an unknown marker: the block runs (and test_markers_are_attached fails)


class FileRun:
    """One documentation file's namespace, run so far in block order."""

    def __init__(self, path: Path, workdir: Path) -> None:
        self.path = path
        self.workdir = workdir
        self.done = 0  # blocks [0, done) have been run or skipped
        self.failed: Block | None = None
        slug = re.sub(r"\W", "_", str(path.relative_to(ROOT)))
        self.module = types.ModuleType(f"docs_example_{slug}")
        self.module.__file__ = str(path)
        sys.modules[self.module.__name__] = self.module
        self.masks, self.scores = set(MASKS.names()), set(SCORES.names())
        self.environ = _library_environ()

    def run_through(self, block: Block) -> None:
        """Run this file's blocks up to and including ``block`` (earlier ones first)."""
        blocks = [b for b in BLOCKS if b.path == self.path]
        while self.done <= block.index:
            current = blocks[self.done]
            self.done += 1
            if self.failed is not None:
                pytest.fail(f"an earlier block of this file ({self.failed.id}) failed", pytrace=False)
            if _why_not_run(current) is not None:
                continue
            code = _compile(current)
            printed = io.StringIO()
            try:
                with contextlib.redirect_stdout(printed):
                    exec(code, self.module.__dict__)
                _check_stated_output(current, printed.getvalue())
            except BaseException:
                self.failed = current
                raise
            finally:
                print(printed.getvalue(), end="")  # still shown with -s and in failure reports

    def finish(self) -> None:
        for name in set(MASKS.names()) - self.masks:
            MASKS.unregister(name)
        for name in set(SCORES.names()) - self.scores:
            SCORES.unregister(name)
        for name in set(_library_environ()) - set(self.environ):
            del os.environ[name]
        os.environ.update(self.environ)
        sys.modules.pop(self.module.__name__, None)


def _compile(block: Block) -> types.CodeType:
    # Pad with blank lines so tracebacks point at the Markdown file's own line numbers.
    return compile("\n" * (block.line - 1) + block.code, str(block.path), "exec")


def _check_stated_output(block: Block, printed: str) -> None:
    lines = [line.rstrip() for line in printed.splitlines()]
    at = 0
    for want in block.stated_output:
        try:
            at = lines.index(want, at) + 1
        except ValueError:
            raise AssertionError(
                f"{block.id}: the page says a print gives {want!r}; it printed (from line {at + 1} on):\n"
                + "\n".join(lines[at:])
            ) from None


_RUNS: dict[Path, FileRun] = {}


def _library_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("FLEXATTN_ZOO_")}


@pytest.fixture(scope="module", autouse=True)
def _undo_file_side_effects() -> Any:
    yield
    for run in _RUNS.values():
        run.finish()
    _RUNS.clear()


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_doc_block_runs(
    block: Block, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    why = _why_not_run(block)
    if why is not None:
        _compile(block)  # a block that is not run must still be valid Python
    if why is not None and block.marker is not None and _SKIP.match(block.marker):
        pytest.skip(why)
    run = _RUNS.get(block.path)
    if run is None:
        for other in _RUNS.values():  # files run one after another: undo the previous one now
            other.finish()
        _RUNS.clear()
        run = _RUNS[block.path] = FileRun(block.path, tmp_path_factory.mktemp("docs"))
    monkeypatch.chdir(run.workdir)
    run.run_through(block)
    if why is not None:
        pytest.skip(why)


def test_every_doc_file_has_examples_parsed() -> None:
    assert (ROOT / "README.md").exists() and len(DOC_FILES) > 1, DOC_FILES
    assert any(b.path.name == "README.md" for b in BLOCKS), "README.md has no ```python block"


def test_markers_are_attached() -> None:
    problems = [f"{path.relative_to(ROOT)} {p}" for path in DOC_FILES for p in parse(path)[1]]
    assert not problems, "\n".join(problems)


def test_readme_keeps_the_ci_test_command() -> None:
    # .ci/run runs exactly this command; the README tells users to run the same.
    command = 'python -m pytest -m "not gpu and not slow" -q -n auto'
    assert command in (ROOT / "README.md").read_text()
    assert command in (ROOT / ".ci" / "run").read_text()


_LINK = re.compile(r"\]\(([^)\s]+)\)")
_MD_NAME = re.compile(r"(?<![\w./-])([\w][\w./-]*\.md)\b")
_COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
_TABLE_RULE = re.compile(r"^\|(\s*:?-{3,}:?\s*\|)+\s*$")


def _prose(text: str) -> str:
    """``text`` with its fenced blocks blanked out, line numbers kept."""
    return re.sub(r"^(`{3,}).*?^\1\s*$", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.M | re.S)


def _anchors(path: Path) -> set[str]:
    """The ``#anchors`` GitHub gives the headings of ``path``: lower case, punctuation dropped,
    spaces as hyphens, ``-1``, ``-2`` ... after repeated titles."""
    counts: dict[str, int] = {}
    anchors = set()
    for title in _HEADING.findall(_prose(path.read_text())):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title).lower()  # a link's text only
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        n = counts.get(slug, 0)
        counts[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


@pytest.mark.parametrize("path", DOC_FILES, ids=[str(p.relative_to(ROOT)) for p in DOC_FILES])
def test_user_docs_link_only_to_files_in_the_repo(path: Path) -> None:
    text = path.read_text()
    missing, no_anchor = [], []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        linked = path.parent / file if file else path
        if not linked.exists():
            missing.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            no_anchor.append(target)
    assert not missing, f"{path.name} links to files not in the repository: {missing}"
    assert not no_anchor, f"{path.name} links to headings that do not exist: {no_anchor}"
    # Markdown files named in the prose (not only linked) must exist too, relative to the repository
    # or to this file: users cannot read notes that were never committed.
    # Fenced blocks are left out: their commands name output files (--md report.md).
    prose = _prose(text)
    named = {m for m in _MD_NAME.findall(prose) if not (ROOT / m).exists() and not (path.parent / m).exists()}
    assert not named, f"{path.name} names Markdown files not in the repository: {sorted(named)}"


@pytest.mark.parametrize("path", DOC_FILES, ids=[str(p.relative_to(ROOT)) for p in DOC_FILES])
def test_user_docs_cite_no_commits(path: Path) -> None:
    found = _COMMIT.findall(path.read_text())
    assert not found, (
        f"{path.name} cites what look like commit hashes {found}; they belong in benchmarks/README.md"
    )


@pytest.mark.parametrize("path", DOC_FILES, ids=[str(p.relative_to(ROOT)) for p in DOC_FILES])
def test_user_docs_tables_start_with_a_header(path: Path) -> None:
    # A table's rows after a blank line are a new "table" with no header: GitHub renders them as a
    # paragraph of pipes, and a reader loses those rows.
    lines = _prose(path.read_text()).splitlines()
    headless = [
        i + 1
        for i, line in enumerate(lines)
        if line.startswith("|")
        and (i == 0 or not lines[i - 1].startswith("|"))
        and not (i + 1 < len(lines) and _TABLE_RULE.match(lines[i + 1]))
    ]
    assert not headless, f"{path.name}: table rows without a header row and |---| rule at lines {headless}"
