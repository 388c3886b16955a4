"""Benchmark harness: every route for a case, side by side, in one process.

    python -m flexattn_zoo.bench smoke --out results.json --md results.md   # a packaged config
    python -m flexattn_zoo.bench my_sweep.yaml --md results.md              # or a file
    flexattn-zoo bench CONFIG [--out F.json] [--md F.md] [--png PREFIX] [--cases a,b] [--routes x,y]
                       [--modes fwd] [--iters N] [--warmup N] [--resume [--rerun]] [--time-budget S] [--no-fa4]

For each case (see :mod:`flexattn_zoo.bench.config` for the YAML schema), mode and route it
records one row: median time, TFLOP/s on visible work, peak memory, compile time, mask build time
and a status: ``ok``, ``unsupported`` (with the dispatcher's reasons), ``OOM`` (caught, or skipped by
the dense-memory estimate) or ``error`` (the exception, never a crash). Rows are written to
``--out`` after every route, so a sweep that is killed keeps what it measured; ``--resume`` skips
rows already there (``--rerun``: the selected cases/routes/modes are measured again), and
``--time-budget`` stops starting new rows after S seconds (exit code 3). Each case starts from
no compiled graphs (:func:`fresh_compiles`), as a process running only that case would.
``--report-only`` rewrites the Markdown/PNGs from an existing ``--out`` JSON.

Exit codes: 0 done, 1 matplotlib missing for ``--png`` or a file that could not be written, 2 bad input
(an output path that is a directory or in a missing folder included), 3 stopped by the time budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from flexattn_zoo.bench import routes as bench_routes
from flexattn_zoo.bench.config import (
    MODES,
    Case,
    all_routes,
    goals,
    load_config,
    packaged_configs,
    parse_names,
)
from flexattn_zoo.bench.env import block_fa4, collect_env
from flexattn_zoo.bench.report import host_bound, markdown, rich_table, write_pngs
from flexattn_zoo.bench.timing import free_memory, interleaved, visible_pairs
from flexattn_zoo.compile import CACHE as COMPILE_CACHE
from flexattn_zoo.config import check_output_file, read_text_file
from flexattn_zoo.viz import MissingDependency

FLOP_FACTOR = {"fwd": 1.0, "fwdbwd": 3.5}  # backward counted as 2.5x forward
COMMAND_ENV = "FLEXATTN_ZOO_BENCH_COMMAND"  # recorded instead of argv (e.g. by run_h200.sh)


def case_device(case: Case) -> torch.device:
    """The device a case runs on (``auto``: CUDA when torch sees a GPU)."""
    if case.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if case.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"case {case.name!r} asks for device cuda, but torch sees no GPU")
    return torch.device(case.device)


def _message(exc: BaseException, limit: int = 400) -> str:
    text = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _row(case: Case, route: str, mode: str, device: torch.device, visible: int | None) -> dict[str, Any]:
    L, lq = case.seq_len, case.lq
    # Two matmuls per visible pair: q.k (2 * D flops) and p.v (2 * Dv).
    flops = 2 * (case.head_dim + case.dv) * visible * FLOP_FACTOR[mode] if visible is not None else None
    return {
        "case": case.name,
        "route": route,
        "mode": mode,
        "status": "error",
        "reason": None,
        "chosen": None,
        "traits": None,
        "accepted": None,
        "ms": None,
        "host_ms": None,
        "tflops": None,
        "peak_mib": None,
        "base_mib": None,
        "compile_s": None,
        "blockmask_s": None,
        "blockmask_compile_s": None,
        "max_err": None,
        "err_vs": None,
        "batch": case.batch,
        "heads": case.heads,
        "kv_heads": case.kv_heads,
        "seq_len": L,
        "q_len": lq,
        "head_dim": case.head_dim,
        "v_head_dim": case.dv,
        "dtype": str(case.dtype).removeprefix("torch."),
        "device": str(device),
        "visible_pairs": visible,
        "density": visible / (case.batch * case.heads * lq * L) if visible else None,
        "flops": flops,
        "warmup": case.warmup,
        "iters": case.iters,
        "timed_iters": None,
        "compiled_graphs": None,
        "notes": [],
        "wall_s": None,
    }


def run_one(
    row: dict[str, Any],
    case: Case,
    mask: Any,
    score: Any,
    x: bench_routes.Inputs | None,
    device: torch.device,
    ref: list[Any],
) -> Callable[[], Any] | None:
    """Fill ``row`` by running its route; ``ref`` holds ``[route, out]`` of the first fwd output.
    Returns the row's warm timed call when it may be timed again (:func:`retime_interleaved`)."""
    start, graphs = time.perf_counter(), COMPILE_CACHE.total_compiles()
    outcome = None
    try:
        if x is None:
            raise RuntimeError("inputs could not be allocated")
        outcome = bench_routes.run(row["route"], case, row["mode"], mask, score, x, device)
    except bench_routes.Unsupported as exc:
        row["status"], row["reason"] = "unsupported", str(exc)
    except bench_routes.SkippedOOM as exc:
        row["status"], row["reason"] = "OOM", str(exc)
    except torch.OutOfMemoryError as exc:
        row["status"], row["reason"] = "OOM", _message(exc)
    except Exception as exc:  # a benchmark row, never a crash
        oom = "out of memory" in str(exc).lower() or "can't allocate memory" in str(exc).lower()
        row["status"], row["reason"] = ("OOM" if oom else "error"), _message(exc)
    if outcome is not None:
        row.update(
            status="ok",
            chosen=outcome.prepared.chosen,
            traits=outcome.prepared.traits,
            accepted=outcome.prepared.accepted,
            ms=outcome.ms,
            timed_iters=outcome.timed_iters,
            host_ms=outcome.host_ms,
            compile_s=outcome.compile_s,
            peak_mib=outcome.peak_mib,
            base_mib=outcome.base_mib,
            blockmask_s=outcome.prepared.blockmask_s,
            blockmask_compile_s=outcome.prepared.blockmask_compile_s,
            notes=outcome.notes,
        )
        if row["flops"] is not None and outcome.ms > 0:
            row["tflops"] = row["flops"] / (outcome.ms * 1e-3) / 1e12
        if outcome.out is not None:
            if not ref:
                ref.extend([row["route"], outcome.out])
            else:
                err = float((outcome.out.float() - ref[1].float()).abs().max())
                row["err_vs"] = ref[0]
                if math.isfinite(err):
                    row["max_err"] = err
                else:
                    row["notes"].append("output holds NaN or inf")
    delta = COMPILE_CACHE.total_compiles() - graphs
    row["compiled_graphs"] = delta if delta >= 0 else None
    row["wall_s"] = time.perf_counter() - start
    step = outcome.step if outcome is not None and _may_interleave(row) else None
    outcome = None
    free_memory(device)
    return step


#: Rows up to this many milliseconds keep their call for :func:`retime_interleaved` (short calls,
#: whose inputs and state are small; longer ones are not host-bound).
INTERLEAVE_MAX_MS = 5.0
#: Routes never timed again: ``auto_tuned`` made its choice under a tuning directory of its own,
#: which its row's call no longer sees.
NOT_INTERLEAVED = frozenset({"auto_tuned"})
#: A row whose host time per call is at least this share of its time has its case and mode timed
#: again interleaved. Lower than the report's "host-bound" mark: the host time is taken per call
#: without waiting on the GPU, so it shows less than a call's whole host cost, and rows whose
#: host time is 0.6-0.8 of their time still move with the host (benchmarks/README.md).
HOST_AFFECTED = 0.5


def host_affected(row: dict[str, Any] | None) -> bool:
    """Whether the host may have set ``row``'s time (CUDA rows: those with a host time)."""
    return host_bound(row, HOST_AFFECTED)


def _may_interleave(row: dict[str, Any]) -> bool:
    return (
        row.get("status") == "ok" and row["route"] not in NOT_INTERLEAVED and row["ms"] <= INTERLEAVE_MAX_MS
    )


def retime_interleaved(
    kept: dict[str, tuple[dict[str, Any], Callable[[], Any]]], device: torch.device
) -> None:
    """Time the kept rows of one case and mode again, interleaved (``timing.interleaved``), when
    the host may have set one of their times (:func:`host_affected`): host time drifts over a
    process, and rows timed one after another would compare the drift. Each row keeps its first
    median as ``ms_alone``."""
    if len(kept) < 2 or not any(host_affected(row) for row, _ in kept.values()):
        return
    try:
        timings = interleaved(
            {route: (step, row.get("timed_iters") or 1) for route, (row, step) in kept.items()}, device
        )
    except Exception as exc:  # the rows keep their first timings; the sweep goes on
        for row, _ in kept.values():
            row["notes"].append(f"not timed again interleaved: {_message(exc)}")
        return
    for route, t in timings.items():
        row = kept[route][0]
        row["ms_alone"] = row["ms"]
        row.update(ms=t.median_ms, host_ms=t.host_ms, timed_iters=len(t.times_ms))
        if row["flops"] is not None and t.median_ms > 0:
            row["tflops"] = row["flops"] / (t.median_ms * 1e-3) / 1e12
        row["notes"].append(
            f"timed again interleaved with {len(kept) - 1} other rows ({route} alone: {row['ms_alone']:.4g} ms)"
        )


def _save(path: Path | None, data: dict[str, Any]) -> None:
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def _line(row: dict[str, Any]) -> str:
    what = f"{row['case']} {row['mode']} {row['route']}" + (
        f" -> {row['chosen']}" if row.get("chosen") else ""
    )
    if row["status"] == "ok":
        return (
            f"{what}: {row['tflops'] or 0:.4g} TFLOP/s ({row['ms']:.3f} ms, compile {row['compile_s']:.1f} s)"
        )
    return f"{what}: {row['status']}: {row['reason']}"


def fresh_compiles() -> None:
    """Forget every compiled graph (Dynamo's caches; the library's compiled entries compile again
    on their next call, outside any timed region), so a case runs as in a process that only ever
    ran its shapes. Without it a flex entry shared by two cases of different lengths would run
    Dynamo's dynamic-shape graph in the second one (its automatic dynamic shapes), which is slower
    on the host and in the kernel than the static-shape graph a one-shape process compiles."""
    torch.compiler.reset()


def run_sweep(
    cases: Sequence[Case],
    data: dict[str, Any],
    *,
    out: Path | None = None,
    time_budget: float | None = None,
    console: Console | None = None,
    quiet: bool = False,
    rerun: bool = False,
) -> bool:
    """Run every missing row of ``cases`` into ``data["rows"]``; False if the time budget stopped it.

    ``rerun``: every row of ``cases``, each measured row replacing its earlier one, so a run that
    the budget (or a crash) stops keeps the earlier rows it did not reach."""
    console = console or Console(stderr=True, highlight=False)
    rows: list[dict[str, Any]] = data.setdefault("rows", [])
    done = set() if rerun else {(r["case"], r["route"], r["mode"]) for r in rows}
    todo = {c.name: [(m, r) for m in c.modes for r in c.routes if (c.name, r, m) not in done] for c in cases}
    start = time.monotonic()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=quiet, transient=False) as progress:
        task = progress.add_task("sweep", total=sum(len(t) for t in todo.values()))
        for case in cases:
            if not todo[case.name]:
                continue
            fresh_compiles()
            device = case_device(case)
            try:
                mask, score = case.specs(device)
                visible: int | None = visible_pairs(
                    mask, case.seq_len, case.batch, case.heads, device, case.lq
                )
            except Exception as exc:  # a broken case gives error rows, the sweep goes on
                mask = score = visible = None
                case_failure: str | None = _message(exc)
            else:
                case_failure = None
            for mode in MODES:
                routes = [r for m, r in todo[case.name] if m == mode]
                if not routes:
                    continue
                x, failure = None, case_failure
                if failure is None:
                    try:
                        x = bench_routes.Inputs.make(case, mode, device)
                    except torch.OutOfMemoryError as exc:
                        failure = _message(exc)
                ref: list[Any] = []
                kept: dict[str, tuple[dict[str, Any], Callable[[], Any]]] = {}
                for route in routes:
                    if time_budget is not None and time.monotonic() - start > time_budget:
                        return False
                    progress.update(task, description=f"{case.name} {mode} {route}")
                    row = _row(case, route, mode, device, visible)
                    if failure is not None:
                        row["reason"] = failure
                        row["status"] = "OOM" if "OutOfMemory" in failure else "error"
                    else:
                        step = run_one(row, case, mask, score, x, device, ref)
                        if step is not None:
                            kept[route] = (row, step)
                    if rerun:
                        rows[:] = [
                            r for r in rows if (r["case"], r["route"], r["mode"]) != (case.name, route, mode)
                        ]
                    rows.append(row)
                    _save(out, data)
                    if not quiet:
                        progress.console.print(_line(row), markup=False, highlight=False)
                    progress.advance(task)
                if time_budget is None or time.monotonic() - start <= time_budget:
                    retime_interleaved(kept, device)
                _save(out, data)
                del x, ref, kept
                free_memory(device)
    return True


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "config",
        help=f"YAML sweep config file, or the name of a packaged one ({', '.join(packaged_configs())})",
    )
    p.add_argument("--out", type=Path, help="JSON results file (written after every row)")
    p.add_argument("--md", type=Path, help="Markdown report file")
    p.add_argument(
        "--png", metavar="PREFIX", help="bar charts PREFIX-fwd.png, PREFIX-fwdbwd.png (needs matplotlib)"
    )
    p.add_argument("--cases", help="comma-separated case names to run (default: all)")
    p.add_argument(
        "--routes", help=f"comma-separated routes, overriding the config ({', '.join(all_routes())})"
    )
    p.add_argument("--modes", help="comma-separated modes: fwd, fwdbwd")
    p.add_argument("--iters", type=int, help="override the least timed calls per row (more fill 100 ms)")
    p.add_argument("--warmup", type=int, help="override the least warm-up calls per row (and 25 ms)")
    p.add_argument(
        "--resume", action="store_true", help="keep the rows already in --out and run only the others"
    )
    p.add_argument(
        "--rerun",
        action="store_true",
        help="with --resume: measure the selected cases/routes/modes again, replacing their rows",
    )
    p.add_argument("--time-budget", type=float, metavar="S", help="start no new row after S seconds (exit 3)")
    p.add_argument("--no-fa4", action="store_true", help="hide flash_attn.cute (FA4) from this process")
    p.add_argument("--report-only", action="store_true", help="only rewrite --md/--png from the --out JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar or per-row lines")
    return p


def _select(cases: list[Case], args: argparse.Namespace) -> list[Case]:
    if args.cases:
        wanted = parse_names("--cases", args.cases, [c.name for c in cases])
        cases = [c for c in cases if c.name in wanted]
    changes: dict[str, Any] = {}
    if args.routes:
        changes["routes"] = parse_names("--routes", args.routes, all_routes())
    if args.modes:
        changes["modes"] = parse_names("--modes", args.modes, list(MODES))
    for key in ("iters", "warmup"):
        value = getattr(args, key)
        if value is not None:
            if value < (1 if key == "iters" else 0):
                raise ValueError(f"--{key} must be >= {1 if key == 'iters' else 0}, got {value}")
            changes[key] = value
    return [dataclasses.replace(c, **changes) for c in cases]


def main(argv: Sequence[str] | None = None, prog: str = "python -m flexattn_zoo.bench") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Summary tables are wide: don't squeeze them into 80 columns when stdout is a file or pipe.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 250)
    errors = Console(stderr=True, highlight=False)
    try:
        args = build_parser(prog).parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    command = os.environ.get(COMMAND_ENV) or shlex.join([*shlex.split(prog), *argv])
    try:
        if args.no_fa4:
            block_fa4()
        if args.png:
            from flexattn_zoo.bench.report import have_matplotlib

            if not have_matplotlib():
                raise MissingDependency("--png needs matplotlib: pip install 'flexattn-zoo[viz]'")
        if (args.resume or args.report_only) and args.out is None:
            raise ValueError("--resume and --report-only need --out")
        for option, path in (("--out", args.out), ("--md", args.md), ("--png", args.png)):
            if path is not None:  # --png is a prefix: its folder must exist, as for a file
                check_output_file(path, option)
        if args.rerun and not args.resume:
            raise ValueError("--rerun only makes sense with --resume (without it every row is measured anew)")
        complete = True
        if args.report_only:
            data = json.loads(read_text_file(args.out, "--out results file"))
            cases = load_config(args.config)
        else:
            cases = _select(load_config(args.config), args)
            data = {"env": {}, "rows": []}
            if args.resume and args.out.is_file():
                data = json.loads(read_text_file(args.out, "--out results file"))
                previous = data.get("env", {})
                # Each kept command names its commit: a resumed table mixes rows of several.
                last = previous.get("command")
                if last and previous.get("git"):
                    last = f"{last} @ {previous['git']}"
                history = [*previous.get("previous_commands", []), last]
            else:
                history = []
            env = collect_env(case_device(cases[0]), command)
            env["no_fa4"] = bool(args.no_fa4)
            if history:
                env["previous_commands"] = [h for h in history if h]
            data["env"] = env
            complete = run_sweep(
                cases, data, out=args.out, time_budget=args.time_budget, quiet=args.quiet, rerun=args.rerun
            )
            _save(args.out, data)
        # The goals are targets for a machine with every route installed (H200 with FA4).
        data["goals"] = {} if data.get("env", {}).get("no_fa4") else goals(cases)
        title = f"flexattn_zoo benchmark: {Path(args.config).stem}"
        if not args.quiet:
            console.print(rich_table(data["rows"], title=title, goals=data["goals"]))
        if args.md:
            args.md.write_text(markdown(data, title=title))
        if args.png:
            write_pngs(data["rows"], args.png, title=Path(args.config).stem)
        if not complete:
            errors.print(
                f"stopped by --time-budget {args.time_budget:g} s; run again with --resume to finish",
                markup=False,
            )
            return 3
        return 0
    except MissingDependency as exc:
        errors.print(f"error: {exc}", style="bold red", markup=False)
        return 1
    except (ValueError, TypeError, json.JSONDecodeError) as exc:
        if os.environ.get("FLEXATTN_ZOO_DEBUG"):
            raise
        errors.print(f"error: {exc}", style="bold red", markup=False)
        return 2
    except OSError as exc:  # writing a report failed (disk full, permissions): no traceback either
        if os.environ.get("FLEXATTN_ZOO_DEBUG"):
            raise
        errors.print(f"error: {exc}", style="bold red", markup=False)
        return 1


if __name__ == "__main__":
    sys.exit(main())
