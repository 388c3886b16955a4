"""``flexattn-zoo demo``: every zoo preset through ``fz.attention``, timed and checked.

Each registered mask gets a sensible parameterisation at the chosen length, plus the combinations
people use (``Causal() & Document``, ``Causal() & Chunked``), and every registered score mod runs
on top of a causal mask. For each preset the demo reports the route ``fz.attention`` chose, the
time of the first call (which includes any compilation), the median time of a few later calls,
the largest error against ``fz.testing.reference_attention`` (float64), and whether the result is
within ``fz.testing.assert_matches_reference``'s error budget.

Defaults: B=1 H=2 L=256 D=32 float32 on CPU (finishes in well under a minute on 2 cores with a
warm compile cache), B=2 H=16 L=4096 D=128 bfloat16 on a GPU.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo.cli.params import describe_spec
from flexattn_zoo.registry import MASKS, SCORES, Registry
from flexattn_zoo.spec import MaskSpec
from flexattn_zoo.tuning.timing import timed

CPU_DEFAULTS: dict[str, int | str] = {
    "batch": 1,
    "heads": 2,
    "length": 256,
    "dim": 32,
    "dtype": "float32",
    "repeats": 5,
}
GPU_DEFAULTS: dict[str, int | str] = {
    "batch": 2,
    "heads": 16,
    "length": 4096,
    "dim": 128,
    "dtype": "bfloat16",
    "repeats": 10,
}


@dataclasses.dataclass(frozen=True)
class DemoCase:
    """One demo case: a display name, a mask spec and a score spec (either may be None)."""

    name: str
    mask: Any = None
    score: Any = None


@dataclasses.dataclass(frozen=True)
class Result:
    """The outcome of one preset."""

    preset: str
    route: str
    first_s: float | None
    median_ms: float | None
    max_err: float | None
    passed: bool
    note: str = ""


def _preset(registry: Registry[Any], name: str, length: int, batch: int, heads: int) -> Any:
    """A realistic instance of registry entry ``name`` at ``length``: a spec class's
    ``typical_example``, or the spec of a registered plain function."""
    factory = registry.entry(name).factory
    if hasattr(factory, "typical_example"):
        return factory.typical_example(length, length, batch, heads)
    return factory()


def _segments_only(spec: MaskSpec, length: int, batch: int) -> bool:
    """Whether ``spec`` is exactly bidirectional segments (documents, chunks), which models
    combine with a causal mask."""
    form = spec.varlen_form(length, length, batch)
    return form is not None and form.segments is not None and form.window == (-1, -1)


def demo_cases(length: int, batch: int, heads: int) -> list[DemoCase]:
    """Every registered mask, the usual causal combinations, and every score mod on causal."""
    out = []
    built = []
    for name in MASKS.names():
        spec = _preset(MASKS, name, length, batch, heads)
        built.append(spec)
        out.append(DemoCase(describe_spec(spec), mask=spec))
    causal = masks.get("causal")
    for spec in built:
        if _segments_only(spec, length, batch):
            combo = causal & spec
            out.append(DemoCase(describe_spec(combo), mask=combo))
    for name in SCORES.names():
        spec = _preset(SCORES, name, length, batch, heads)
        out.append(DemoCase(f"causal + {describe_spec(spec)}", mask=causal, score=spec))
    return out


def _timed(
    fn: Callable[[], torch.Tensor], device: torch.device, repeats: int
) -> tuple[torch.Tensor, float, float]:
    """(output of the first call, seconds of the first call, median ms of ``repeats`` later calls)."""
    out, first = timed(fn, device)
    times = [timed(fn, device)[1] * 1e3 for _ in range(repeats)]
    return out, first, statistics.median(times)


def run_case(case: DemoCase, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, repeats: int) -> Result:
    """Run, time and check one case; any exception becomes a FAIL with its message."""
    route = "?"
    try:
        route = fz.plan(q, k, v, mask=case.mask, score_mod=case.score).backend
        out, first, median = _timed(
            lambda: fz.attention(q, k, v, mask=case.mask, score_mod=case.score), q.device, repeats
        )
        ref = fz.testing.reference_attention(q, k, v, mask=case.mask, score_mod=case.score)
        err = float((out.double() - ref).abs().max())
    except Exception as exc:  # the demo reports every failure and goes on with the next preset
        return Result(case.name, route, None, None, None, False, f"{type(exc).__name__}: {exc}")
    try:
        fz.testing.assert_matches_reference(out, q, k, v, mask=case.mask, score_mod=case.score)
    except AssertionError as exc:
        return Result(case.name, route, first, median, err, False, str(exc).splitlines()[0])
    if not math.isfinite(err):
        return Result(case.name, route, first, median, err, False, "non-finite output")
    return Result(case.name, route, first, median, err, True)


def run_demo(
    *,
    device: str | None = None,
    length: int | None = None,
    batch: int | None = None,
    heads: int | None = None,
    dim: int | None = None,
    dtype: str | None = None,
    repeats: int | None = None,
    only: Sequence[str] | None = None,
    console: Console | None = None,
    seed: int = 0,
) -> list[Result]:
    """Run the demo and print its table to ``console`` (``None``: print nothing).

    Args:
        device: ``"cpu"`` or ``"cuda"``; default cuda when available.
        length, batch, heads, dim, dtype, repeats: override the device's defaults
            (``dtype`` is a torch dtype name such as ``"bfloat16"``).
        only: keep presets whose name contains any of these strings.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "--device cuda: no CUDA GPU is visible to torch (torch.cuda.is_available() is False)"
        )
    dev = torch.device(device)
    d = dict(GPU_DEFAULTS if dev.type == "cuda" else CPU_DEFAULTS)
    given = {"length": length, "batch": batch, "heads": heads, "dim": dim, "dtype": dtype, "repeats": repeats}
    d.update({key: value for key, value in given.items() if value is not None})
    torch_dtype = getattr(torch, str(d["dtype"]))
    cases = demo_cases(int(d["length"]), int(d["batch"]), int(d["heads"]))
    if only:
        cases = [c for c in cases if any(text in c.name for text in only)]
    if not cases:
        return []
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = (int(d["batch"]), int(d["heads"]), int(d["length"]), int(d["dim"]))
    q, k, v = (torch.randn(shape, generator=gen).to(device=dev, dtype=torch_dtype) for _ in range(3))
    if console is not None:
        gpu = f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""
        console.print(
            f"flexattn_zoo demo on {dev.type}{gpu}: B={shape[0]} H={shape[1]} L={shape[2]} D={shape[3]} "
            f"{d['dtype']}, torch {torch.__version__}; median of {d['repeats']} runs after a warm-up "
            "('1st s': the first call, compilation included)"
        )
    results = []
    for case in cases:
        if console is not None and console.is_terminal:
            with console.status(f"running {escape(case.name)} ..."):
                results.append(run_case(case, q, k, v, int(d["repeats"])))
        else:
            results.append(run_case(case, q, k, v, int(d["repeats"])))
    if console is not None:
        console.print(results_table(results))
        failed = [r for r in results if not r.passed]
        for r in failed:
            console.print(f"[red]FAIL[/red] {escape(r.preset)}: {escape(r.note)}")
        console.print(f"demo: {len(results) - len(failed)} of {len(results)} presets within the error budget")
    return results


def results_table(results: Sequence[Result]) -> Table:
    table = Table(title="zoo presets through fz.attention")
    table.add_column("preset", overflow="fold")
    table.add_column("route", no_wrap=True)
    table.add_column("1st s", justify="right", no_wrap=True)
    table.add_column("median ms", justify="right", no_wrap=True)
    table.add_column("max err", justify="right", no_wrap=True)
    table.add_column("check", no_wrap=True)
    for r in results:
        table.add_row(
            escape(r.preset),
            r.route,
            "-" if r.first_s is None else f"{r.first_s:.2f}",
            "-" if r.median_ms is None else f"{r.median_ms:.3f}",
            "-" if r.max_err is None else f"{r.max_err:.2e}",
            "[green]PASS[/green]" if r.passed else "[red]FAIL[/red]",
        )
    return table
