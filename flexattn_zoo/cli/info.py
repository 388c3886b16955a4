"""``flexattn-zoo show`` and ``flexattn-zoo env``: pictures of specs, and what this machine can run."""

from __future__ import annotations

import argparse
import os
import platform
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

import flexattn_zoo
from flexattn_zoo import viz
from flexattn_zoo.bench.env import dist_version
from flexattn_zoo.cli.params import CliError, build_specs, describe_spec

if TYPE_CHECKING:
    from flexattn_zoo.spec import MaskSpec, ScoreSpec


def _print_lines(console: Console, lines: list[str]) -> None:
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def cmd_show(args: argparse.Namespace, params: list[tuple[str, str | None]], console: Console) -> int:
    from flexattn_zoo.registry import MASKS, SCORES, did_you_mean

    q_len = args.length
    kv_len = args.kv_len or q_len
    for option, length in (("--len", q_len), ("--kv-len", kv_len)):
        if length > viz.MAX_LENGTH:
            raise ValueError(f"{option} must be at most 2**52 ({viz.MAX_LENGTH}) to draw, got {length}")
    first = args.name.split("+")[0].strip()
    is_mask = first in MASKS
    if not is_mask and first not in SCORES:
        known = MASKS.names() + SCORES.names()
        raise ValueError(
            f"unknown mask or score_mod {first!r}; masks: {', '.join(MASKS.names())}; "
            f"score mods: {', '.join(SCORES.names())}.{did_you_mean(first, known)}"
        )
    spec: MaskSpec | ScoreSpec | None
    if is_mask:
        heads = args.heads or 1
        spec, _ = build_specs(args.name, None, params, {"num_heads": heads})
    else:
        heads = args.heads or 8
        _, spec = build_specs(None, args.name, params, {"num_heads": heads})
        heads = getattr(spec, "num_heads", heads)
    assert spec is not None  # args.name names at least one registered spec (checked above)
    per_head = bool(spec.uses_head())
    if not 0 <= args.head < heads:
        raise ValueError(f"--head must be in [0, {heads}), got {args.head}")
    if args.png:
        folder = os.path.dirname(os.path.abspath(args.png))
        if not os.path.isdir(folder):
            raise ValueError(f"--png {args.png}: folder {folder!r} does not exist")
    if args.png and not viz.have_matplotlib():
        raise CliError("--png needs matplotlib, which is not installed: pip install 'flexattn-zoo[viz]'")
    console.print(f"[bold]{escape(describe_spec(spec))}[/bold]")
    console.print(
        f"q_len={q_len} kv_len={kv_len}"
        + (f" batch={args.batch}" if args.batch > 1 else "")
        + (f" head {args.head} of {heads}" if per_head else "")
    )
    if is_mask:
        return _show_mask(args, spec, q_len, kv_len, heads, console)
    return _show_score(args, spec, q_len, kv_len, heads, console)


def _show_mask(
    args: argparse.Namespace, spec: Any, q_len: int, kv_len: int, heads: int, console: Console
) -> int:
    import flexattn_zoo as fz

    spec.validate(q_len, kv_len, args.batch, heads)
    cells = viz.mask_cells(spec, q_len, kv_len, batch=args.batch, heads=heads, head_index=args.head)
    if cells.downsampled:
        how = "sampled at points of each cell" if cells.sampled else "exact"
        console.print(
            f"downsampled: each character is {cells.row_step} queries x {cells.col_step} keys "
            f"('#' all visible, '+' some visible, '.' none; {how})"
        )
    else:
        console.print("rows are queries, columns keys ('#' visible, '.' masked)")
    _print_lines(console, viz.render_cells(cells.frac))
    if cells.visible is not None:
        # The count is of the picture: one batch row (0) and one head, so the total is too.
        total = q_len * kv_len
        where = " in batch row 0" if args.batch > 1 and spec.uses_batch() else ""
        console.print(
            f"visible: {cells.visible} of {total} positions{where} ({100 * cells.visible / total:.1f}%)"
        )
    qb = kvb = viz.BLOCK_SIZE
    n_blocks = -(-q_len // qb) * -(-kv_len // kvb)
    n_blocks *= (args.batch if spec.uses_batch() else 1) * (heads if spec.uses_head() else 1)
    if n_blocks > viz.BLOCK_LIMIT:
        # The BlockMask holds index tensors of n_q x n_kv blocks (and building it a block map of
        # that size): at --len 10M that is 6e9 blocks. The picture above is sampled instead.
        console.print(
            f"BlockMask {qb}x{kvb}: not built at this length ({n_blocks} blocks > {viz.BLOCK_LIMIT}); "
            "block sparsity is shown for shorter lengths"
        )
        if args.png:
            big = viz.mask_cells(
                spec, q_len, kv_len, batch=args.batch, heads=heads, head_index=args.head, max_cells=512
            )
            viz.write_cells_png(
                args.png,
                f"{args.name} (Lq={q_len}, Lkv={kv_len})",
                big.frac,
                cell_label="visible fraction",
                lengths=(q_len, kv_len),
            )
            console.print(f"wrote {args.png}")
        return 0
    bm = fz.block_mask(spec, q_len, kv_len, batch=args.batch, heads=heads, device="cpu", block_size=qb)
    counts = viz.block_counts(bm, q_len, kv_len)
    console.print(
        f"BlockMask {qb}x{kvb}: block sparsity {100 * counts['empty'] / counts['total']:.1f}% (blocks skipped); "
        f"{counts['total']} block{'s' if counts['total'] != 1 else ''}: {counts['full']} full, {counts['partial']} partial, {counts['empty']} empty"
    )
    codes = viz.block_codes(bm, q_len, kv_len, batch_index=0, head_index=args.head)
    if codes.numel() > 1:
        lines, r_step, c_step = viz.render_block_codes(codes)
        group = f", each character {r_step}x{c_step} blocks" if r_step > 1 or c_step > 1 else ""
        console.print(f"blocks ('#' full, '+' partial, '.' empty{group}):")
        _print_lines(console, lines)
    if args.png:
        big = viz.mask_cells(
            spec, q_len, kv_len, batch=args.batch, heads=heads, head_index=args.head, max_cells=512
        )
        viz.write_cells_png(
            args.png,
            f"{args.name} (Lq={q_len}, Lkv={kv_len})",
            big.frac,
            blocks=codes,
            cell_label="visible fraction",
            lengths=(q_len, kv_len),
        )
        console.print(f"wrote {args.png}")
    return 0


def _show_score(
    args: argparse.Namespace, spec: Any, q_len: int, kv_len: int, heads: int, console: Console
) -> int:
    spec.validate(q_len, kv_len, args.batch, heads)
    if q_len * kv_len > viz.DENSE_LIMIT:
        raise ValueError(f"score mod pictures are dense: keep len * kv_len <= {viz.DENSE_LIMIT}")
    bias = viz.score_matrix(spec, q_len, kv_len, head_index=args.head, batch=args.batch, heads=heads)
    # Activation attention's score mod returns log-weights (the route applies exp and drops the
    # softmax's normalisation), not a bias on a softmax score: say what the numbers are.
    what = "log-weight of a zero score" if spec.is_activation() else "bias added to a zero score"
    if bool((bias == 0).all()):
        console.print("adds no position-dependent bias (a zero score stays 0 everywhere)")
    elif q_len <= 16 and kv_len <= 16:
        console.print(f"{what} (rows queries, columns keys):")
        _print_lines(console, viz.render_numbers(bias))
    else:
        lines, r_step, c_step = viz.render_shades(bias)
        note = f"; each character {r_step}x{c_step} positions" if r_step > 1 or c_step > 1 else ""
        console.print(
            f"{what}, shaded from ' ' = {float(bias.min()):.3g} to '@' = {float(bias.max()):.3g}{note}:"
        )
        _print_lines(console, lines)
    inputs = [-100.0, -10.0, -1.0, 0.0, 1.0, 10.0, 100.0]
    outputs = viz.score_response(spec, inputs, heads=heads, head_index=args.head)
    if any(
        abs((y - outputs[3]) - x) > 1e-12 * max(1.0, abs(x)) for x, y in zip(inputs, outputs, strict=True)
    ):
        table = Table(title="at i=0, j=0", title_justify="left")
        table.add_column("score in", justify="right")
        table.add_column("score out", justify="right")
        for x, y in zip(inputs, outputs, strict=True):
            table.add_row(f"{x:g}", f"{y:.4g}")
        console.print(table)
    if args.png:
        viz.write_cells_png(
            args.png, f"{args.name} bias, head {args.head}", bias, cell_label="bias", cmap="viridis"
        )
        console.print(f"wrote {args.png}")
    return 0


# ---------------------------------------------------------------------------------------------
# env


def _tuning_summary() -> tuple[str, str]:
    """``fz.tune``'s switch and entries, and its cache file (for the default device)."""
    from flexattn_zoo import tuning

    try:
        state = "on" if tuning.is_enabled() else "off"
    except ValueError as exc:  # a bad FLEXATTN_ZOO_TUNE: say so here, it fails the next call
        state = str(exc)
    summary = f"{state} (FLEXATTN_ZOO_TUNE, fz.tune); {len(tuning.table())} entries"
    try:
        return summary, str(tuning.cache_path())
    except OSError as exc:  # no cache directory: measurements would stay in memory
        return summary, f"none: {exc}"


def _plugins_summary() -> str:
    """The spec plugins' entry points and whether each loaded (``registry.plugins``)."""
    from flexattn_zoo.registry import plugins

    return "; ".join(
        f"{p.name} = {p.value}"
        + (f" ({p.dist})" if p.dist else "")
        + ("" if p.loaded else f": FAILED, {p.error}")
        for p in plugins()
    )


def cmd_env(args: argparse.Namespace, console: Console) -> int:
    import torch

    from flexattn_zoo.arch import detect_arch
    from flexattn_zoo.backends import BACKENDS

    info = Table(title="environment", show_header=False)
    info.add_column("what", style="bold")
    info.add_column("value", overflow="fold")
    info.add_row("flexattn_zoo", flexattn_zoo.__version__)
    info.add_row("python", f"{platform.python_version()} ({platform.platform()})")
    info.add_row("torch", torch.__version__)
    info.add_row("triton", dist_version("triton", "pytorch-triton") or "not installed")
    info.add_row("flash-attn-4 (flex FLASH)", dist_version("flash-attn-4", "flash_attn_4") or "not installed")
    info.add_row("CUDA (torch built with)", str(torch.version.cuda or "none (CPU build)"))
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    info.add_row("cuDNN", str(cudnn) if cudnn else "not available")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            info.add_row(f"GPU {i}", f"{torch.cuda.get_device_name(i)} (compute capability {major}.{minor})")
    else:
        info.add_row("GPU", "none visible to torch")
    info.add_row("CPU cores", str(os.cpu_count()))
    info.add_row("detected arch", detect_arch())
    info.add_row("matplotlib (viz extra)", dist_version("matplotlib") or "not installed")
    state, path = _tuning_summary()
    info.add_row("measured route choice", escape(state))
    info.add_row("tuning cache file", escape(path))
    info.add_row("spec plugins (flexattn_zoo.specs)", escape(_plugins_summary()) or "none installed")
    console.print(info)

    routes = Table(title="routes on this machine")
    routes.add_column("route", style="bold")
    routes.add_column("runs on")
    routes.add_column("available here")
    routes.add_column("why not")
    present = {"cpu"} | ({"cuda"} if torch.cuda.is_available() else set())
    for backend in BACKENDS:
        reasons = list(backend.unavailable_reasons())
        devices = sorted(getattr(backend, "devices", ()) or ())
        if devices and not present & set(devices):
            reasons.append(f"needs a {'/'.join(d.upper() if d == 'cuda' else d for d in devices)} device")
        routes.add_row(
            backend.name,
            "/".join(devices) or "?",
            "[red]no[/red]" if reasons else "[green]yes[/green]",
            escape("; ".join(reasons)),
        )
    console.print(routes)
    return 0


# ---------------------------------------------------------------------------------------------
# plan
