"""``flexattn-zoo tune CONFIG.yaml``: measure a model's route choices ahead of time (``fz.tune``)
and print the table.

    flexattn-zoo tune CONFIG [--out F.json|F.md] [--cases a,b] [--modes fwd] [--reps N] [--warmup N]
                      [--force] [--no-save] [--quiet]

CONFIG is a benchmark sweep (:mod:`flexattn_zoo.bench.config`: cases with shapes, mask, score mod,
dtype, device, modes). For each case and mode the inputs are made as the benchmark makes them and
``fz.attention(..., tune=True)`` is called once: a signature not yet measured is timed (a case's
``warmup`` and ``iters`` are the measurement's least warm-up calls and repetitions), one already in the
cache file is read (``--force`` measures it again). ``routes`` is ignored: tuning compares the
routes ``backend="auto"`` may take. Each row gives the signature, the route ``auto`` now takes,
the static order's choice, the median milliseconds and the first-call compile seconds of every
route compared, and the errors of those that failed. ``--no-save`` keeps the measurements in
this process (nothing written to the cache file).

Exit codes: 0 done (a case that failed is a row with its error), 2 bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import flexattn_zoo as fz
from flexattn_zoo import tuning
from flexattn_zoo.bench.config import MODES, Case, load_config, packaged_configs, parse_names
from flexattn_zoo.bench.report import md_table
from flexattn_zoo.bench.routes import Inputs
from flexattn_zoo.bench.runner import case_device
from flexattn_zoo.config import check_output_file

HEADER = ["case", "mode", "signature", "route", "static", "median ms", "compile s"]


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Measure which route backend='auto' should take for each case of a YAML sweep "
        "(measured route choice, fz.tune), keep it in the cache file and print the table.",
        allow_abbrev=False,
    )
    p.add_argument(
        "config",
        help="YAML sweep config in the benchmark format: a file, or the name of a packaged one "
        f"({', '.join(packaged_configs())})",
    )
    p.add_argument("--out", type=Path, help="write the table: Markdown for a .md name, else JSON")
    p.add_argument("--cases", help="comma-separated case names (default: all)")
    p.add_argument("--modes", help="comma-separated modes: fwd, fwdbwd (default: the config's)")
    p.add_argument("--reps", type=int, help="timed calls per route (default: the case's iters)")
    p.add_argument(
        "--warmup", type=int, help="least untimed calls after the first (default: the case's warmup)"
    )
    p.add_argument("--force", action="store_true", help="measure again signatures already in the cache")
    p.add_argument("--no-save", action="store_true", help="keep measurements in memory: write no cache file")
    p.add_argument("--quiet", action="store_true", help="print no table")
    return p


def _message(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def tune_case(case: Case, mode: str, *, force: bool = False) -> dict[str, Any]:
    """Measure (or read) ``case``'s route choice in ``mode``; one row of the table."""
    row: dict[str, Any] = {"case": case.name, "mode": mode, "status": "ok", "reason": None}
    try:
        device = case_device(case)
        mask, score = case.specs(device)
        x = Inputs.make(case, mode, device)
        kwargs: dict[str, Any] = {"mask": mask, "score_mod": score, "enable_gqa": case.gqa, "tune": True}
        with torch.no_grad() if mode == "fwd" else contextlib.nullcontext():
            before = fz.plan(x.q, x.k, x.v, **kwargs)
            if force and before.tuning is not None and before.tuning.entry is not None:
                tuning.clear(before.tuning.signature)
            fz.attention(x.q, x.k, x.v, **kwargs)
            plan = fz.plan(x.q, x.k, x.v, **kwargs)
    except Exception as exc:  # a row, never a crash
        row.update(status="error", reason=_message(exc))
        return row
    info = plan.tuning
    entry = info.entry if info is not None else None
    row.update(
        signature=info.signature.to_json() if info is not None else None,
        signature_text=info.signature.describe() if info is not None else "",
        route=plan.backend,
        static=info.candidates[0] if info is not None else plan.backend,
        measured=plan.measured,
        candidates=list(info.candidates) if info is not None else [plan.backend],
        ms=dict(entry.ms) if entry is not None else {},
        compile_s=dict(entry.compile_s) if entry is not None else {},
        errors=dict(entry.errors) if entry is not None else {},
        date=entry.date if entry is not None else None,
    )
    return row


def _cells(row: dict[str, Any]) -> list[str]:
    if row["status"] != "ok":
        return [row["case"], row["mode"], "", "error", "", row["reason"] or "", ""]
    if not row["ms"] and not row["errors"]:
        note = "(only route)" if len(row["candidates"]) < 2 else "(not measured)"
        return [row["case"], row["mode"], row["signature_text"], row["route"], row["static"], note, ""]
    ms = [f"{n} {t:.4g}" for n, t in row["ms"].items()] + [f"{n} failed" for n in row["errors"]]
    comp = [f"{n} {t:.3g}" for n, t in row["compile_s"].items()]
    route = row["route"] + (" (measured)" if row["measured"] else "")
    return [
        row["case"],
        row["mode"],
        row["signature_text"],
        route,
        row["static"],
        ", ".join(ms),
        ", ".join(comp),
    ]


def rich_table(rows: Sequence[dict[str, Any]], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for i, name in enumerate(HEADER):
        table.add_column(name, no_wrap=i < 2, overflow="fold")
    for row in rows:
        table.add_row(*(escape(c) for c in _cells(row)))
    return table


def markdown(rows: Sequence[dict[str, Any]], title: str) -> str:
    lines = [f"# {title}", "", *md_table(HEADER, [_cells(r) for r in rows])]
    errors = [
        (r["case"], r["mode"], n, m) for r in rows if r["status"] == "ok" for n, m in r["errors"].items()
    ]
    if errors:
        lines += ["", "Routes that failed while timing:", ""]
        lines += [f"* {c} {mode} {n}: {m}" for c, mode, n, m in errors]
    return "\n".join(lines) + "\n"


def _select(cases: list[Case], args: argparse.Namespace) -> list[Case]:
    if args.cases:
        wanted = parse_names("--cases", args.cases, [c.name for c in cases])
        cases = [c for c in cases if c.name in wanted]
    if args.modes:
        modes = parse_names("--modes", args.modes, list(MODES))
        cases = [dataclasses.replace(c, modes=modes) for c in cases]
    for name, low in (("reps", 1), ("warmup", 0)):
        value = getattr(args, name)
        if value is not None and value < low:
            raise ValueError(f"--{name} must be >= {low}, got {value}")
    return cases


def run(cases: Sequence[Case], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (case, mode) row, with the measurement settings of each case."""
    rows: list[dict[str, Any]] = []
    old = tuning.settings()
    try:
        for case in cases:
            tuning.configure(
                warmup=args.warmup if args.warmup is not None else case.warmup,
                reps=args.reps if args.reps is not None else case.iters,
                persist=not args.no_save,
            )
            rows.extend(tune_case(case, mode, force=args.force) for mode in case.modes)
    finally:
        tuning.configure(warmup=old.warmup, reps=old.reps, margin=old.margin, persist=old.persist)
    return rows


def main(argv: Sequence[str] | None = None, prog: str = "flexattn-zoo tune") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 250)
    errors = Console(stderr=True, highlight=False)
    try:
        args = build_parser(prog).parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        cases = _select(load_config(args.config), args)
        if args.out is not None:
            check_output_file(args.out, "--out")
        rows = run(cases, args)
        title = f"flexattn_zoo route choice by measurement: {Path(args.config).stem}"
        if not args.quiet:
            console.print(rich_table(rows, title))
            if not args.no_save:
                try:
                    where = str(tuning.cache_path())
                except OSError as exc:  # no cache directory: the measurements were kept in memory
                    where = f"none ({exc})"
                console.print(f"cache: {where}", markup=False)
        if args.out is not None:
            if args.out.suffix.lower() == ".md":
                args.out.write_text(markdown(rows, title))
            else:
                args.out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
        return 0
    except (ValueError, TypeError) as exc:
        if os.environ.get("FLEXATTN_ZOO_DEBUG"):
            raise
        errors.print(f"error: {exc}", style="bold red", markup=False)
        return 2
    except OSError as exc:
        if os.environ.get("FLEXATTN_ZOO_DEBUG"):
            raise
        errors.print(f"error: {exc}", style="bold red", markup=False)
        return 1


if __name__ == "__main__":
    sys.exit(main())
