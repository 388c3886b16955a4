"""``flexattn-zoo``: look at the zoo, the machine and the dispatcher's choices from a shell.

Subcommands (``python -m flexattn_zoo`` is the same program)::

    flexattn-zoo list [masks|score_mods|presets|all]
    flexattn-zoo show NAME [--param value ...] --len N [--kv-len M] [--png FILE]
    flexattn-zoo env
    flexattn-zoo plan --mask NAME [--param value ...] [--score NAME] --len N [--kv-len M]
                      --heads H[,HKV] --dim D --dtype bf16 [--batch B] [--arch sm90] [--grad] [--tune]
    flexattn-zoo demo [--device cpu|cuda] [--len N] [--only TEXT]
    flexattn-zoo bench CONFIG [--out F.json] [--md F.md] [--cases a,b] [--routes x,y] [--modes fwd]
    flexattn-zoo tune CONFIG [--out F.json|F.md] [--cases a,b] [--modes fwd] [--force]

Spec parameters are parsed generically (see :mod:`flexattn_zoo.cli.params`), so masks and score
mods registered by users work here too. Exit codes: 0 success, 1 a demo preset failed or an
optional dependency is missing, 2 bad input (unknown name, bad parameter: the message is printed,
no traceback; set ``FLEXATTN_ZOO_DEBUG=1`` to get the traceback).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flexattn_zoo import viz
from flexattn_zoo.cli.info import cmd_env, cmd_show
from flexattn_zoo.cli.params import CliError, build_specs, describe_params, describe_spec, split_options

DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "float16": "float16",
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "float32": "float32",
    "fp64": "float64",
    "f64": "float64",
    "double": "float64",
    "float64": "float64",
}


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _heads(text: str) -> tuple[int, int]:
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (1, 2):
        raise argparse.ArgumentTypeError(f"--heads takes H or H,HKV, got {text!r}")
    values = tuple(_positive(p) for p in parts)
    return (values[0], values[-1])


def _dtype_name(text: str) -> str:
    name = DTYPES.get(text.lower())
    if name is None:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; choose from bf16, fp16, fp32, fp64")
    return name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flexattn-zoo",
        description="Attention masks and score mods, run on the fastest exact kernel. "
        "Spec parameters are passed as --name value (e.g. --left 3, --doc-ids 0,0,1,1).",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        metavar="MODULE",
        help="import MODULE first, so the masks and score mods it registers can be used (repeatable)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("list", help="list registered masks, score mods and model presets", allow_abbrev=False)
    p.add_argument("kind", nargs="?", default="all", choices=["masks", "score_mods", "presets", "all"])
    p.add_argument("--long", action="store_true", help="full descriptions, spec classes and preset sources")

    p = sub.add_parser(
        "show",
        help="picture of a mask (or a score mod's bias) and its block sparsity",
        allow_abbrev=False,
        epilog="Any other --name value is a spec parameter (--left 3, --doc-ids 0,0,1, --lengths 3,2,1). "
        "Combine with '+': causal+chunked --size 16; target one part with --chunked.size 16.",
    )
    p.add_argument("name", help="registry name, or names joined by '+'")
    p.add_argument("--len", dest="length", metavar="N", type=_positive, required=True, help="query length")
    p.add_argument("--kv-len", metavar="M", type=_positive, help="key/value length (default: --len)")
    p.add_argument("--batch", type=_positive, default=1, help="batch size, for masks that depend on it")
    p.add_argument("--heads", type=_positive, help="number of heads (default 1; 8 for score mods)")
    p.add_argument("--head", type=int, default=0, help="head index to draw (default 0)")
    p.add_argument("--png", metavar="FILE", help="also write a heatmap (needs the 'viz' extra: matplotlib)")

    sub.add_parser(
        "env", help="versions, GPU, detected arch and which routes can run here", allow_abbrev=False
    )

    p = sub.add_parser("plan", help="which route a problem would take, and why", allow_abbrev=False)
    p.add_argument(
        "--mask", action="append", help="mask name (repeat, or join names with '+', to combine with &)"
    )
    p.add_argument(
        "--score", action="append", help="score mod name (repeat or join with '+' to chain, left first)"
    )
    p.add_argument(
        "--config", metavar="YAML", help="mask/score_mod from a YAML file instead of --mask/--score"
    )
    p.add_argument("--len", dest="length", metavar="N", type=_positive, required=True, help="query length")
    p.add_argument("--kv-len", metavar="M", type=_positive, help="key/value length (default: --len)")
    p.add_argument(
        "--heads", type=_heads, default=(8, 8), help="H or H,HKV for grouped-query attention (default 8)"
    )
    p.add_argument("--dim", type=_positive, default=128, help="head dim (default 128)")
    p.add_argument("--dtype", type=_dtype_name, default="bfloat16", help="bf16 (default), fp16, fp32, fp64")
    p.add_argument("--batch", type=_positive, default=1)
    p.add_argument("--arch", help="sm80, sm90, sm100, ... or cpu (default: this machine)")
    p.add_argument("--grad", action="store_true", help="inputs require grad (forward + backward)")
    p.add_argument("--lse", action="store_true", help="also return the log-sum-exp")
    p.add_argument(
        "--tune",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="take this machine's measured winner from the tuning cache, as fz.plan does "
        "(default: FLEXATTN_ZOO_TUNE); only for this machine's own arch",
    )

    p = sub.add_parser(
        "demo", help="run every zoo preset, time it and check it against float64", allow_abbrev=False
    )
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available, else cpu")
    p.add_argument(
        "--len", dest="length", type=_positive, help="sequence length (default 256 on CPU, 4096 on GPU)"
    )
    p.add_argument("--batch", type=_positive)
    p.add_argument("--heads", type=_positive)
    p.add_argument("--dim", type=_positive)
    p.add_argument("--dtype", type=_dtype_name)
    p.add_argument("--repeats", type=_positive, help="timed runs after the warm-up (median reported)")
    p.add_argument(
        "--only", action="append", metavar="TEXT", help="only presets whose name contains TEXT (repeatable)"
    )
    # bench has its own parser (flexattn_zoo.bench); main() hands it the raw arguments.
    sub.add_parser(
        "bench", help="time every route side by side from a YAML sweep (see bench -h)", add_help=False
    )
    # tune likewise (flexattn_zoo.cli.tune).
    sub.add_parser(
        "tune",
        help="measure auto's route choice for each case of a YAML sweep and keep it (see tune -h)",
        add_help=False,
    )
    return parser


# Options that ``show``/``plan`` define themselves; every other --option is a spec parameter.
_OWN_OPTIONS = {
    "show": {
        "--len": True,
        "--kv-len": True,
        "--batch": True,
        "--heads": True,
        "--head": True,
        "--png": True,
        "-h": False,
        "--help": False,
    },
    "plan": {
        "--mask": True,
        "--score": True,
        "--config": True,
        "--len": True,
        "--kv-len": True,
        "--heads": True,
        "--dim": True,
        "--dtype": True,
        "--batch": True,
        "--arch": True,
        "--grad": False,
        "--lse": False,
        "--tune": False,
        "--no-tune": False,
        "-h": False,
        "--help": False,
    },
}


def _version() -> str:
    """The version of the code running, not of whatever distribution is installed (a checkout on
    ``PYTHONPATH`` may run beside another installed version, or none)."""
    import flexattn_zoo

    return flexattn_zoo.__version__


# ---------------------------------------------------------------------------------------------
# list


def cmd_list(args: argparse.Namespace, console: Console) -> int:
    from flexattn_zoo.registry import MASKS, SCORES, Registry

    by_kind: dict[str, list[Registry[Any]]] = {
        "masks": [MASKS],
        "score_mods": [SCORES],
        "presets": [],
        "all": [MASKS, SCORES],
    }
    registries = by_kind[args.kind]
    for registry in registries:
        title = "masks (combine with & | ~)" if registry is MASKS else "score mods (chain with >>)"
        rows = []
        for entry in registry.entries():
            cls = entry.factory.__name__ if isinstance(entry.factory, type) else "(function)"
            summary = entry.summary.replace("``", "")
            rows.append([entry.name, *([cls] if args.long else []), describe_params(entry) or "-", summary])
        headers = ["name", *(["class"] if args.long else []), "parameters", "description"]
        _print_listing(console, title, headers, rows, args.long)
    if args.kind in ("presets", "all"):
        from flexattn_zoo.models import presets

        rows = []
        for p in presets.presets():
            params = ", ".join([*p.params, *(["num_heads (required)"] if p.needs_heads else [])])
            source = [p.source.replace("``", "")] if args.long else []
            rows.append([p.name, p.model, p.pattern, params or "-", *source])
        headers = ["name", "model", "layer pattern", "parameters", *(["source"] if args.long else [])]
        _print_listing(console, "model presets (fz.presets.get(name, layer=i))", headers, rows, args.long)
    if not args.long:
        console.print("(one line each, cut to the terminal width; --long shows everything)")
    return 0


def _print_listing(
    console: Console, title: str, headers: list[str], rows: list[list[str]], long: bool
) -> None:
    """A table with wrapped cells (``long``), or one line per row cut to the terminal's width."""
    if long:
        table = Table(title=title, title_justify="left")
        for i, header in enumerate(headers):
            table.add_column(header, style="bold" if i == 0 else None, no_wrap=i == 0, overflow="fold")
        for row in rows:
            table.add_row(*(escape(cell) for cell in row))
        console.print(table)
        return
    # Every column but the last is as wide as its widest cell (capped), the last takes what is left.
    widths = [min(max(len(c) for c in col), 24) for col in zip(headers, *rows, strict=True)][:-1]
    console.print(title, style="bold", markup=False)
    for row in [headers, *rows]:
        cells = [_fit(cell, w).ljust(w) for cell, w in zip(row[:-1], widths, strict=True)]
        line = "  ".join([*cells, row[-1]])
        console.print(_fit(line, max(console.width, 40)), markup=False)


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


# ---------------------------------------------------------------------------------------------
# show


def cmd_plan(args: argparse.Namespace, params: list[tuple[str, str | None]], console: Console) -> int:
    import torch

    from flexattn_zoo.arch import detect_arch, parse_arch
    from flexattn_zoo.dispatch import Problem, plan_problem

    heads, kv_heads = args.heads
    if args.config:
        if args.mask or args.score or params:
            raise ValueError("--config replaces --mask/--score and their parameters; give one or the other")
        from pathlib import Path

        from flexattn_zoo.config import load_yaml_spec

        try:  # always a file here (load_yaml_spec also takes YAML text)
            mask, score = load_yaml_spec(Path(args.config))
        except ValueError as exc:
            raise ValueError(f"--config {args.config}: {exc}") from exc
    else:
        for option, names in (("--mask", args.mask), ("--score", args.score)):
            if names is not None and not all(n.strip() for n in names):
                raise ValueError(
                    f"{option} needs a registry name (see `flexattn-zoo list`), got an empty one"
                )
        mask_names = "+".join(args.mask) if args.mask else None
        score_names = "+".join(args.score) if args.score else None
        mask, score = build_specs(mask_names, score_names, params, {"num_heads": heads})
    arch = args.arch or detect_arch()  # detect_arch checks FLEXATTN_ZOO_ARCH itself
    if args.arch:
        parse_arch(arch, "--arch")  # a ValueError naming valid forms for a typo such as "h100"
    q_len = args.length
    kv_len = args.kv_len or q_len
    for spec in (mask, score):  # what fz.plan checks too: e.g. ALiBi's head count, per-row lengths
        if spec is not None:
            spec.validate(q_len, kv_len, args.batch, heads)
    problem = Problem(
        batch=args.batch,
        heads=heads,
        kv_heads=kv_heads,
        q_len=q_len,
        kv_len=kv_len,
        head_dim=args.dim,
        dtype=getattr(torch, args.dtype),
        device_type="cpu" if arch == "cpu" else "cuda",
        arch=arch,
        requires_grad=args.grad,
        mask=mask,
        score=score,
        return_lse=args.lse,
    )
    plan = plan_problem(problem, tune=_tuned_here(args.tune, arch), device=torch.device(problem.device_type))
    # The same text as fz.plan(...).explain(), plus the specs with their parameters.
    console.print(plan.explain(), markup=False)
    console.print(f"mask: {describe_spec(mask)}    score_mod: {describe_spec(score)}", markup=False)
    return 0


def _tuned_here(tune: bool | None, arch: str) -> bool:
    """Whether ``plan`` reads the tuning cache: asked for (``--tune``, else ``FLEXATTN_ZOO_TUNE``)
    and planning for this machine, whose measurements are the only ones the cache holds."""
    import torch

    from flexattn_zoo import tuning
    from flexattn_zoo.arch import detect_arch

    if not tuning.resolve(tune):
        return False
    here = detect_arch()
    if arch != here:
        if tune:  # asked for by name: say why it cannot be
            raise ValueError(
                f"--tune reads this machine's measurements ({here}); --arch {arch} is another machine"
            )
        return False
    tuning.ensure_loaded(torch.device("cpu" if arch == "cpu" else "cuda"))
    return True


# ---------------------------------------------------------------------------------------------
# demo


def cmd_demo(args: argparse.Namespace, console: Console) -> int:
    from flexattn_zoo.cli import demo

    results = demo.run_demo(
        device=args.device,
        length=args.length,
        batch=args.batch,
        heads=args.heads,
        dim=args.dim,
        dtype=args.dtype,
        repeats=args.repeats,
        only=args.only,
        console=console,
    )
    if not results:
        raise CliError(f"no preset matches --only {' '.join(args.only or [])}", code=2)
    return 0 if all(r.passed for r in results) else 1


# ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (the console script exits with it)."""
    tokens = list(sys.argv[1:] if argv is None else argv)
    params: list[tuple[str, str | None]] = []
    modules: list[str] = []
    # Global "--import MODULE" options (before the command) load user specs into the registries.
    while len(tokens) >= 2 and tokens[0] == "--import":
        modules.append(tokens[1])
        tokens = tokens[2:]
    if modules and os.getcwd() not in sys.path and "" not in sys.path:
        # `python -m flexattn_zoo` finds modules in the current directory; the console script
        # must too, or `flexattn-zoo --import my_masks` fails where `python -m` works.
        sys.path.insert(0, os.getcwd())
    for module in modules:
        try:
            if not module or module.startswith("."):
                raise ImportError("give an absolute module name such as my_masks or pkg.masks")
            importlib.import_module(module)
        except ImportError as exc:
            Console(stderr=True, soft_wrap=True).print(
                f"error: --import {module}: {exc}", style="bold red", markup=False
            )
            return 2
    if tokens and tokens[0] in _OWN_OPTIONS:
        kept, params = split_options(tokens[1:], _OWN_OPTIONS[tokens[0]])
        tokens = [tokens[0], *kept]
    if tokens and tokens[0] == "bench":
        from flexattn_zoo.bench import runner as bench

        return bench.main(tokens[1:], prog="flexattn-zoo bench")
    if tokens and tokens[0] == "tune":
        from flexattn_zoo.cli import tune

        return tune.main(tokens[1:], prog="flexattn-zoo tune")
    # soft_wrap: text lines are never hard-wrapped (pipes and greps see whole lines); tables still fit.
    console = Console(highlight=False, soft_wrap=True)
    errors = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        args = build_parser().parse_args(tokens)
        if args.command == "list":
            return cmd_list(args, console)
        if args.command == "show":
            return cmd_show(args, params, console)
        if args.command == "env":
            return cmd_env(args, console)
        if args.command == "plan":
            return cmd_plan(args, params, console)
        return cmd_demo(args, console)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2, message already printed)
        return exc.code if isinstance(exc.code, int) else 2
    except CliError as exc:
        errors.print(f"error: {exc}", style="bold red", markup=False)
        return exc.code
    except viz.MissingDependency as exc:
        errors.print(f"error: {exc}", style="bold red", markup=False)
        return 1
    except (ValueError, TypeError, ArithmeticError) as exc:  # bad input (OverflowError included)
        if os.environ.get("FLEXATTN_ZOO_DEBUG"):
            raise
        errors.print(f"error: {exc}", style="bold red", markup=False)
        return 2
    except OSError as exc:  # e.g. writing --png failed: not bad input, but no traceback either
        if os.environ.get("FLEXATTN_ZOO_DEBUG"):
            raise
        errors.print(f"error: {exc}", style="bold red", markup=False)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
