"""Regret report of a generalization sweep: how far ``auto`` is from the fastest route per
(case, mode), with and without FlashAttention-4, as measured and as the current rules replay it.

    python benchmarks/regret.py benchmarks/results/generalization_h200.json

writes ``generalization_h200.md`` and ``generalization_h200-nofa4.{json,md}`` next to the input.
The no-FA4 view is derived from the same rows (every route was timed in one process): the FA4
routes are dropped and the dispatcher's order is replayed (flexattn_zoo.bench.replay); with
``--nofa4-auto FILE`` (a sweep run with ``--no-fa4``) its ``auto`` rows are that view's measured auto.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from flexattn_zoo.arch import RULES
from flexattn_zoo.bench import replay
from flexattn_zoo.bench.config import load_config
from flexattn_zoo.bench.report import HOST_BOUND, host_bound


def _fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.3f}"


def _ratio(v: replay.Verdict | None) -> str:
    return "-" if v is None or v.ratio is None else f"{v.ratio:.2f}"


def _hb(g: replay.Group, route: str | None) -> str:
    """`` (h)`` when ``route``'s row in ``g`` was host-bound (its time is mostly host time)."""
    return " (h)" if route is not None and host_bound(g.rows.get(route)) else ""


def _summary_rows(label: str, s: dict[str, Any]) -> str:
    if not s.get("n"):
        return f"| {label} | 0 | | | | | |"
    return (
        f"| {label} | {s['n']} | {s['median']:.2f} | {s['p10']:.2f} | {s['worst']:.2f} | "
        f"{100 * s['within_5pct']:.0f}% | {100 * s['within_10pct']:.0f}% |"
    )


def report(
    data: dict[str, Any],
    fa4: bool,
    source: str,
    config: str,
    auto_rows: tuple[str, list[dict[str, Any]]] | None = None,
    nofa4_file: str | None = None,
) -> tuple[str, dict[str, Any]]:
    """The Markdown report and its JSON summary; ``auto_rows``: ``(file, rows)`` of a run without
    FA4, whose ``auto`` / ``auto_tuned`` rows are the no-FA4 view's measured ones; ``nofa4_file``:
    that file as the report's command line names it."""
    groups = replay.groups(data["rows"], load_config(config))
    # The measured choices of a run with FA4 say nothing about a machine without it: the no-FA4
    # view reads them from the run without FA4 (the replays below keep the source's auto rows,
    # which record the problem's traits).
    seen = (
        groups if fa4 else replay.with_rows(groups, auto_rows[1] if auto_rows else [], ["auto", "auto_tuned"])
    )
    old = [replay.measured(g, "auto", fa4) for g in seen]
    by_hand = [replay.measured(g, "auto", fa4, hand_written=True) for g in seen]
    tuned = [replay.measured(g, "auto_tuned", fa4) for g in seen]
    noise = [replay.same_calls(g) for g in seen]
    stand_in = [replay.replay(g, fa4=fa4, sdpa_stand_in=True) for g in groups]
    without = [replay.replay(g, fa4=fa4, sdpa_stand_in=False) for g in groups]
    sums = {
        "measured_auto": replay.summary(old),
        "measured_auto_vs_hand_written": replay.summary(by_hand),
        "measured_auto_tuned": replay.summary(tuned),
        "same_calls": replay.summary(noise),
        "rules_sdpa_as_plain": replay.summary(stand_in),
        "rules_without_sdpa_route": replay.summary(without),
    }
    env = data.get("env", {})
    if not fa4:
        view = "without FA4 (FA4 routes dropped from the same rows)"
    elif env.get("flash_attn_cute") is False:
        view = "every route that ran (FA4 was not importable in this run)"
    else:
        view = "with FA4"
    history = [*env.get("previous_commands", []), f"{env.get('command', '?')} @ {env.get('git', '?')}"]
    if not fa4 and auto_rows is None:
        measured_line = "* measured auto: not measured without FA4 (no `--nofa4-auto` file given)."
    elif auto_rows is not None:
        measured_line = (
            f"* measured auto: the `auto` rows of `{auto_rows[0]}` (a run without FA4), each timed by"
            " the chosen route's own row in the source, as every other route is."
        )
    else:
        measured_line = (
            "* measured auto: the `auto` rows as run (by the latest command below that measured"
            " them), each timed by the chosen route's own row, as every other route is."
        )
    lines = [
        f"# Generalization sweep on the {env.get('gpu', 'GPU')}: regret of `auto`, {view}",
        "",
        f"Source: `{source}` ({len(data['rows'])} rows, {len(groups)} (case, mode) pairs of "
        "flexattn_zoo/bench/configs/generalization.yaml); report: `python benchmarks/regret.py "
        f"{source}{f' --nofa4-auto {nofa4_file}' if nofa4_file else ''}`. torch {env.get('torch', '?')}, "
        f"FA4 importable: {env.get('flash_attn_cute', '?')}.",
        "",
        "Ratio = fastest route's time / chosen route's time (1.00: auto took the fastest). The",
        "fastest is over the routes `auto` may take that ran (not the baselines `plain_sdpa`,",
        "`raw_flex`, `sdpa_dense_mask`, `fa4_direct`).",
        "",
        measured_line,
        "* measured auto, also against hand-written calls: the same, with the fastest taken over",
        "  plain SDPA (`plain_sdpa`) and compiled `flex_attention` (`raw_flex`) too, which run without",
        "  this library's host time per call.",
        "* measured auto_tuned: the same for `auto` with measured route choice (`tune=True` from an",
        "  empty table), where the run has such rows.",
        "* same calls: not a regret, the noise floor: the `auto` row against its chosen route's own",
        "  row, two timings of the same calls in one process (faster / slower). A measured-auto ratio",
        "  above a pair's same-calls ratio is within what the rows' noise can explain.",
        "* rules, sdpa as plain: the current `arch.RULES` replayed; where a case has no `sdpa` row",
        "  (SDPA's own kernel choice through the library, a route added after its rows were measured)",
        "  the `plain_sdpa` row stands in, i.e. without the library's host time per call: an upper bound.",
        "* rules without sdpa: the same order with route `sdpa` absent: a lower bound.",
        f"* `(h)`: the chosen route's row was host-bound (issuing a call took at least {HOST_BOUND:g} of",
        "  the call's time), so its time is mostly this machine's host time, which varies run to run.",
        "",
        "| view | n | median | p10 | worst | within 5% | within 10% |",
        "|---|---|---|---|---|---|---|",
    ]
    labels = (
        "measured auto",
        "measured auto, also against hand-written calls",
        "measured auto_tuned",
        "same calls (noise floor, not a regret)",
        "rules, sdpa as plain",
        "rules without sdpa",
    )
    lines += [_summary_rows(label, s) for label, s in zip(labels, sums.values(), strict=True)]
    short = [(o, n) for o, n in zip(old, noise, strict=True) if replay.beyond_noise(o, n)]
    lines += [
        "",
        f"Measured auto below {replay.SHORTFALL:g} of the fastest route by more than its pair's own noise "
        f"floor (same calls): {len(short)} of {sums['measured_auto'].get('n', 0)} pairs.",
        "",
    ]
    lines += [
        f"* {o.case} {o.mode}: {o.chosen} {_fmt(o.chosen_ms)} vs {o.best} {_fmt(o.best_ms)} ({_ratio(o)}; "
        f"same calls {_ratio(n) if n else '-'})"
        for o, n in short
    ]
    sums["beyond_noise"] = {"n": len(short), "pairs": [f"{o.case}/{o.mode}" for o, _ in short]}
    lines += ["", "Commands that measured the source's rows, oldest first:", ""]
    lines += [f"* `{c}`" for c in history]
    any_tuned = any(t is not None for t in tuned)
    lines += [
        "",
        "| case | mode | shape | measured auto (ms) | "
        + ("auto_tuned (ms) | " if any_tuned else "")
        + "rules pick (ms) | rules w/o sdpa (ms) | fastest (ms) | ratio measured / "
        + ("tuned / " if any_tuned else "")
        + "rules / w/o sdpa | plain_sdpa | raw_flex |",
        "|---|---|---|---|" + ("---|" if any_tuned else "") + "---|---|---|---|---|---|",
    ]
    for g, o, t, s, w in zip(groups, old, tuned, stand_in, without, strict=True):
        sz = g.sizes()
        r0 = next(iter(g.rows.values()))
        heads = f"{r0['heads']}:{r0['kv_heads']}" if r0["kv_heads"] != r0["heads"] else str(r0["heads"])
        shape = f"{sz.batch}x{heads}x{sz.q_len}/{sz.kv_len}x{sz.head_dim}"
        measured = f"{o.chosen} {_fmt(o.chosen_ms)}{_hb(g, o.chosen)}" if o else "-"
        tuned_cell = (f"{t.chosen} {_fmt(t.chosen_ms)} | " if t else "- | ") if any_tuned else ""
        tuned_ratio = f"{_ratio(t)} / " if any_tuned else ""
        lines.append(
            f"| {g.case} | {g.mode} | {shape} | {measured} | {tuned_cell}{s.chosen} {_fmt(s.chosen_ms)} | "
            f"{w.chosen} {_fmt(w.chosen_ms)} | {s.best} {_fmt(s.best_ms)} | "
            f"{_ratio(o)} / {tuned_ratio}{_ratio(s)} / {_ratio(w)} | {_fmt(g.ms('plain_sdpa'))} | "
            f"{_fmt(g.ms('raw_flex'))} |"
        )
    if fa4:
        lines += ["", "## Rules and the rows that justify them", ""]
        for rule in RULES:
            lines.append(
                f"* **{rule.generation} {'/'.join(rule.modes)} front {', '.join(rule.front)}** "
                f"({rule.benchmark}): {rule.why}"
            )
            if rule.benchmark == Path(source).name:
                by = {(g.case, g.mode): g for g in groups}
                for ev in rule.evidence:
                    g = by.get(tuple(ev.split("/")))  # type: ignore[arg-type]
                    if g is None:
                        lines.append(f"  - {ev}: not in this file")
                        continue
                    ok, why = replay.evidence_holds(rule, g)
                    lines.append(f"  - {'holds' if ok else 'DOES NOT HOLD'}: {why}")
    verdicts = {
        "measured_auto": [vars(v) | {"ratio": v.ratio} for v in old if v is not None],
        "measured_auto_vs_hand_written": [vars(v) | {"ratio": v.ratio} for v in by_hand if v is not None],
        "measured_auto_tuned": [vars(v) | {"ratio": v.ratio} for v in tuned if v is not None],
        "same_calls": [vars(v) | {"ratio": v.ratio} for v in noise if v is not None],
        "rules_sdpa_as_plain": [vars(v) | {"ratio": v.ratio} for v in stand_in],
        "rules_without_sdpa_route": [vars(v) | {"ratio": v.ratio} for v in without],
    }
    return "\n".join(lines) + "\n", {"derived_from": source, "fa4": fa4, "summary": sums, **verdicts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--config", default="generalization", help="the sweep config the rows came from")
    ap.add_argument(
        "--nofa4-auto",
        type=Path,
        default=None,
        help="a sweep JSON measured with --no-fa4: its auto rows are the no-FA4 view's measured auto",
    )
    args = ap.parse_args()
    data = json.loads(args.results.read_text())
    stem, folder = args.results.stem, args.results.parent
    nofa4 = args.nofa4_auto
    named = str(nofa4) if nofa4 else None
    md, _ = report(data, True, str(args.results), args.config, nofa4_file=named)
    (folder / f"{stem}.md").write_text(md)
    auto_rows = (str(nofa4), json.loads(nofa4.read_text())["rows"]) if nofa4 else None
    md, derived = report(data, False, str(args.results), args.config, auto_rows, named)
    (folder / f"{stem}-nofa4.md").write_text(md)
    (folder / f"{stem}-nofa4.json").write_text(json.dumps(derived, indent=1) + "\n")
    print(f"wrote {folder / stem}.md, {stem}-nofa4.md, {stem}-nofa4.json")


if __name__ == "__main__":
    main()
