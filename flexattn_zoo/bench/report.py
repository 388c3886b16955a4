"""Tables and plots of benchmark rows: Markdown, a rich table, PNG bar charts (``viz`` extra)."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from flexattn_zoo.viz import MissingDependency

#: Routes left out of "best" when comparing auto with the fastest other route.
NOT_BEST = frozenset({"auto", "auto_tuned"})


def fmt_tflops(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def cell(row: dict[str, Any] | None) -> str:
    """A route's entry in a summary table: TFLOP/s, or why there is none."""
    if row is None:
        return ""
    status = row["status"]
    if status == "ok":
        return fmt_tflops(row["tflops"])
    if status == "unsupported":
        return "n/a"
    if status == "OOM":
        return "OOM (skipped)" if str(row.get("reason") or "").startswith("skipped") else "OOM"
    return "error"


def _order(rows: Sequence[dict[str, Any]], key: str) -> list[str]:
    return list(dict.fromkeys(r[key] for r in rows))


def _route_order(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Routes in order of first appearance, ``auto`` first (a resumed sweep appends rows late)."""
    routes = _order(rows, "route")
    return sorted(routes, key=lambda r: r != "auto")


def summary(
    rows: Sequence[dict[str, Any]], goals: dict[str, float] | None = None
) -> tuple[list[str], list[list[str]]]:
    """Header and lines: one line per case x mode, one column per route, then the ratios and,
    with ``goals`` (``{"case/mode": TFLOP/s}``), whether ``auto`` met its case's goal."""
    goals = goals or {}
    routes = _route_order(rows)
    by_key = {(r["case"], r["mode"], r["route"]): r for r in rows}
    ratios = (
        (["auto/best"] if "auto" in routes else [])
        + (["auto/raw_flex"] if {"auto", "raw_flex"} <= set(routes) else [])
        + (["goal (auto)"] if goals and "auto" in routes else [])
    )
    header = ["case", "mode", "shape", "visible", "auto chose", *routes, *ratios]
    lines = []
    for case in _order(rows, "case"):
        for mode in _order([r for r in rows if r["case"] == case], "mode"):
            cells = {rt: by_key.get((case, mode, rt)) for rt in routes}
            any_row = next(r for r in cells.values() if r is not None)
            auto = cells.get("auto")
            auto_t = auto["tflops"] if auto and auto["status"] == "ok" else None
            others = [
                r
                for rt, r in cells.items()
                if rt not in NOT_BEST and r and r["status"] == "ok" and r["tflops"]
            ]
            best = max(others, key=lambda r: r["tflops"], default=None)
            raw = cells.get("raw_flex")
            raw_t = raw["tflops"] if raw and raw["status"] == "ok" else None
            density = any_row.get("density")
            vs_best = _ratio_cell(
                auto_t, best["tflops"] if best else None, AUTO_VS_BEST, best["route"] if best else None
            )
            if "below" in vs_best and host_bound(auto):
                vs_best += " (auto host-bound)"
            ratio_cells = {
                "auto/best": vs_best,
                "auto/raw_flex": _ratio_cell(auto_t, raw_t, AUTO_VS_RAW_FLEX),
                "goal (auto)": _goal_cell(goals.get(f"{case}/{mode}"), auto_t),
            }
            lines.append(
                [
                    case,
                    mode,
                    _shape(any_row),
                    f"{100 * density:.1f}%" if density is not None else "",
                    (auto or {}).get("chosen") or "",
                    *(cell(cells[rt]) for rt in routes),
                    *(ratio_cells[name] for name in ratios),
                ]
            )
    return header, lines


#: Issue 4's rules for auto: never more than 3% below the fastest route, at least 1.3x raw_flex.
AUTO_VS_BEST = 0.97
AUTO_VS_RAW_FLEX = 1.3
#: A row whose host time per call reaches this fraction of its median time measured the host.
HOST_BOUND = 0.9


def host_bound(row: dict[str, Any] | None, share: float = HOST_BOUND) -> bool:
    """Whether issuing one call took the host at least ``share`` of the time the call took (CUDA
    rows; the default: (nearly) as long)."""
    if not row or row.get("status") != "ok" or not row.get("ms") or row.get("host_ms") is None:
        return False
    return bool(row["host_ms"] >= share * row["ms"])


def _ratio_cell(got: float | None, other: float | None, rule: float, name: str | None = None) -> str:
    """``"1.04"``, ``"1.04 (flex)"`` with the other route named; `` -- below r`` when under ``rule``."""
    if not got or not other:
        return ""
    ratio = got / other
    text = f"{ratio:.2f}" + (f" ({name})" if name else "")
    return text + (f" -- below {rule:g}" if ratio < rule else "")


def _goal_cell(goal: float | None, got: float | None) -> str:
    if goal is None:
        return ""
    if got is None:
        return f"{goal:g}: no auto result"
    return f"{goal:g}: met" if got >= goal else f"{goal:g}: NOT met ({100 * (got / goal - 1):+.1f}%)"


def _shape(row: dict[str, Any]) -> str:
    heads = f"{row['heads']}:{row['kv_heads']}" if row["kv_heads"] != row["heads"] else str(row["heads"])
    return f"{row['batch']}x{heads}x{row['seq_len']}x{row['head_dim']}"


def rich_table(
    rows: Sequence[dict[str, Any]],
    title: str = "TFLOP/s on visible work",
    goals: dict[str, float] | None = None,
) -> Table:
    header, lines = summary(rows, goals)
    table = Table(title=title, title_justify="left")
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i < 5 else "right", no_wrap=i < 2)
    for line in lines:
        table.add_row(*line)
    return table


def md_table(header: list[str], lines: list[list[str]]) -> list[str]:
    """A Markdown table (one string per line); "|" in cells escaped."""

    def esc(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out.extend("| " + " | ".join(esc(c) for c in line) + " |" for line in lines)
    return out


def _num(value: Any, spec: str) -> str:
    return "" if value is None else format(value, spec)


def markdown(data: dict[str, Any], title: str = "flexattn_zoo benchmark") -> str:
    """The whole report: header (command, versions), summary table, notes, per-row details."""
    env, rows = data.get("env", {}), data.get("rows", [])
    gpu = env.get("gpu") or "none"
    if env.get("cc"):
        gpu += f" (sm{env['cc'].replace('.', '')})"
    fa4 = env.get("flash_attn_cute")
    history = [c for c in env.get("previous_commands") or [] if c]
    earlier = (
        [
            "Rows kept from earlier runs of the sweep (`--resume`), oldest first: "
            + "; ".join(f"`{c}`" for c in history),
            "",
        ]
        if history
        else []
    )
    parts = [
        f"# {title}",
        "",
        f"Command: `{env.get('command', '?')}`",
        "",
        *earlier,
        f"torch {env.get('torch')}, triton {env.get('triton') or '-'}, CUDA {env.get('cuda') or '-'}, "
        f"cuDNN {env.get('cudnn') or '-'}; device {env.get('device')}; GPU {gpu}; "
        f"flash_attn.cute (FA4) {'available' if fa4 else 'not available'}"
        + (f" ({env['flash_attn_4']})" if env.get("flash_attn_4") else "")
        + f"; flexattn_zoo {env.get('flexattn_zoo')}"
        + (f" @ {env['git'][:12]}{env['git'][40:]}" if env.get("git") else "")
        + f"; {env.get('date', '')}",
        "",
        "TFLOP/s on visible work only: forward 4·B·H·visible_pairs·D, forward+backward 3.5x that "
        "(backward counted as 2.5x forward). Median of the timed runs after warm-up "
        "(CUDA events on GPU). `n/a`: the route cannot run the case exactly (reasons below); "
        "`auto/best`: auto's TFLOP/s over the fastest other route's (named; `auto_tuned`, auto with "
        "measured route choice, is not a route of its own); it and `auto/raw_flex` "
        f"say `below` where auto misses the rules ({AUTO_VS_BEST:g} and {AUTO_VS_RAW_FLEX:g}x); "
        f"`auto host-bound`: auto's host time per call was at least {HOST_BOUND:g} of its time, so that "
        "row measured the host (see `host ms` below)."
        + (" `goal (auto)`: the config's target TFLOP/s for auto, met or not." if data.get("goals") else ""),
        "",
    ]
    header, lines = summary(rows, data.get("goals"))
    parts += md_table(header, lines)
    problems = [r for r in rows if r["status"] not in ("ok", "unsupported")]
    if problems:
        parts += ["", "## OOM and errors", ""]
        parts += [
            f"- {r['case']} / {r['mode']} / {r['route']}: {r['status']}: {r.get('reason') or ''}"
            for r in problems
        ]
    unsupported: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        if r["status"] == "unsupported":
            unsupported.setdefault((r["route"], r.get("reason") or ""), []).append(f"{r['case']}/{r['mode']}")
    if unsupported:
        parts += ["", "## Why routes were not run (n/a)", ""]
        for (route, reason), where in unsupported.items():
            parts.append(f"- **{route}** ({', '.join(dict.fromkeys(where))}): {reason}")
    notes = [r for r in rows if r.get("notes")]
    if notes:
        parts += ["", "## Notes", ""]
        parts += [f"- {r['case']} / {r['mode']} / {r['route']}: {'; '.join(r['notes'])}" for r in notes]
    detail_header = [
        "case",
        "mode",
        "route",
        "status",
        "ms",
        "host ms",
        "TFLOP/s",
        "peak MiB",
        "compile s",
        "mask build ms",
        "max err",
    ]
    detail = [
        [
            r["case"],
            r["mode"],
            r["route"] + (f" -> {r['chosen']}" if r.get("chosen") else ""),
            r["status"],
            _num(r.get("ms"), ".3f"),
            _num(r.get("host_ms"), ".3f"),
            fmt_tflops(r.get("tflops")) if r["status"] == "ok" else "",
            _num(r.get("peak_mib"), ".0f"),
            _num(r.get("compile_s"), ".2f"),
            _num(r["blockmask_s"] * 1e3 if r.get("blockmask_s") is not None else None, ".2f"),
            _num(r.get("max_err"), ".2e"),
        ]
        for r in rows
        if r["status"] == "ok"
    ]
    if detail:
        parts += [
            "",
            "## Every timed row",
            "",
            "`compile s` = first call minus a steady call (a kernel another route already compiled "
            "in this process shows ~0); `mask build ms` = fz.block_mask (flex routes), compiled "
            "create_block_mask (raw_flex) or the dense mask (sdpa_dense_mask); `max err` = max |out - "
            "out of the first route run| (fwd only); `host ms` = the host's time to issue one call (CUDA): "
            "when it reaches `ms`, the call is host-bound and `ms` measures the host.",
            "",
            "<details><summary>table</summary>",
            "",
        ]
        parts += md_table(detail_header, detail)
        parts += ["", "</details>"]
    return "\n".join(parts) + "\n"


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def write_pngs(rows: Sequence[dict[str, Any]], prefix: str | Path, title: str = "") -> list[Path]:
    """One grouped bar chart per mode (cases on x, routes as bars): ``PREFIX-fwd.png`` etc."""
    if not have_matplotlib():
        raise MissingDependency("PNG plots need matplotlib: pip install 'flexattn-zoo[viz]'")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    routes = _route_order(rows)
    for mode in _order(rows, "mode"):
        mine = [r for r in rows if r["mode"] == mode]
        cases = _order(mine, "case")
        by_key = {(r["case"], r["route"]): r for r in mine}
        fig, ax = plt.subplots(figsize=(max(8.0, 1.1 * len(cases) + 3.0), 5.0))
        width = 0.8 / max(1, len(routes))
        for j, route in enumerate(routes):
            values = []
            for c in cases:
                r = by_key.get((c, route))
                values.append(r["tflops"] if r and r["status"] == "ok" and r["tflops"] else 0.0)
            ax.bar([i + j * width for i in range(len(cases))], values, width, label=route)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], cases, rotation=30, ha="right")
        ax.set_ylabel("TFLOP/s (visible work)")
        ax.set_title(f"{title} {mode}".strip())
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        path = Path(f"{prefix}-{mode}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
