"""Replay the dispatcher's route order on a sweep's measured rows: which route ``auto`` would take
for each (case, mode), how far that is from the fastest route measured, and which measured rows
justify each of ``arch.RULES``.

Every route of a case is timed side by side in one process, so any route order can be evaluated
offline: ``auto`` takes the first route of the order that accepted the problem. The accepted set of
a (case, mode) is what its ``auto`` row recorded (``accepted``), else the routes that ran (``ok``).

``plain_sdpa`` (SDPA as a user calls it) stands in for the route ``sdpa`` (the same call through
``fz.attention``) in rows measured before that route existed, with ``sdpa_stand_in=True``; its time
then leaves out the library's host time per call, so such replays are an upper bound.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Iterable
from typing import Any

from flexattn_zoo.arch import RULES, Rule, Sizes, priority
from flexattn_zoo.bench.config import Case

#: Routes that need flash-attn-4; dropped from the rows for the no-FA4 view.
FA4_ROUTES = frozenset({"fa4", "flex_flash", "fa4_direct"})
#: Rows that are baselines, not routes ``auto`` can take.
BASELINES = frozenset({"auto", "auto_tuned", "plain_sdpa", "raw_flex", "sdpa_dense_mask", "fa4_direct"})


@dataclasses.dataclass
class Group:
    """The rows of one (case, mode)."""

    case: str
    mode: str
    rows: dict[str, dict[str, Any]]
    #: The case mask's ``visible_fraction`` bound, as the dispatcher sizes the problem by it.
    visible: float = 1.0

    @property
    def auto(self) -> dict[str, Any] | None:
        return self.rows.get("auto")

    def ms(self, route: str) -> float | None:
        row = self.rows.get(route)
        return row["ms"] if row is not None and row["status"] == "ok" else None

    def sizes(self) -> Sizes:
        r = next(iter(self.rows.values()))
        lq = r.get("q_len") or r["seq_len"]
        return Sizes(r["batch"], r["heads"], lq, r["seq_len"], r["head_dim"], self.visible, r.get("kv_heads"))

    def traits(self) -> frozenset[str]:
        """The traits the auto row recorded, with those the case's shape says (rows measured
        before a trait existed do not record it)."""
        auto = self.auto
        traits = set((auto or {}).get("traits") or ())
        sizes = self.sizes()
        if sizes.kv_heads is not None and sizes.kv_heads < sizes.heads:
            traits.add("gqa")
        return frozenset(traits)

    def accepted(self, fa4: bool = True, sdpa_stand_in: bool = False) -> set[str]:
        auto = self.auto or {}
        # The routes the auto row saw accept the problem, and every route measured since (a
        # resumed sweep adds routes that did not exist when the auto row ran).
        names = set(auto.get("accepted") or ()) | {r for r in self.rows if r not in BASELINES}
        names = {n for n in names if self.ms(n) is not None}
        if not sdpa_stand_in:
            names.discard("sdpa")  # the order as it was before the route existed
        elif "sdpa" not in self.rows and self.ms("plain_sdpa") is not None:
            names.add("sdpa")
        return names if fa4 else names - FA4_ROUTES

    def time(self, route: str) -> float | None:
        if route == "sdpa" and "sdpa" not in self.rows:
            return self.ms("plain_sdpa")
        return self.ms(route)


def groups(rows: Iterable[dict[str, Any]], cases: Iterable[Case] = ()) -> list[Group]:
    """Rows grouped by (case, mode), in the order they first appear; ``cases`` (the sweep's config)
    give each group its mask's visible-fraction bound."""
    visible = {}
    for c in cases:
        mask, _ = c.specs()
        visible[c.name] = 1.0 if mask is None else mask.visible_fraction(c.lq, c.seq_len)
    by: dict[tuple[str, str], dict[str, dict[str, Any]]] = collections.defaultdict(dict)
    for r in rows:
        by[(r["case"], r["mode"])][r["route"]] = r
    return [Group(c, m, d, visible.get(c, 1.0)) for (c, m), d in by.items()]


def order(g: Group, arch: str = "sm90", rules: Iterable[Rule] = RULES) -> tuple[str, ...]:
    """The route order for ``g`` under ``rules`` (``arch.priority`` with a rule set of choice)."""
    return priority(arch, g.mode, g.traits(), g.sizes(), rules)


def pick(routes: tuple[str, ...], accepted: set[str]) -> str | None:
    """The first of ``routes`` that accepted the problem (as ``auto`` takes it)."""
    return next((r for r in routes if r in accepted), None)


@dataclasses.dataclass
class Verdict:
    case: str
    mode: str
    chosen: str | None
    chosen_ms: float | None
    best: str | None
    best_ms: float | None

    @property
    def ratio(self) -> float | None:
        """Fastest route's time over the chosen route's (1.0: auto took the fastest)."""
        if self.chosen_ms is None or self.best_ms is None:
            return None
        return self.best_ms / self.chosen_ms


def fastest(timed: dict[str, float | None]) -> str | None:
    """The route of least time in ``timed``; of routes timed alike, the first by name, so a
    report names the same route whatever order a set of routes comes in."""
    return min(timed, key=lambda r: (timed[r] or 0.0, r), default=None)


def replay(
    g: Group, *, fa4: bool = True, rules: Iterable[Rule] = RULES, sdpa_stand_in: bool = True
) -> Verdict:
    """What ``auto`` takes for ``g`` under ``rules`` and how it compares with the fastest route."""
    accepted = g.accepted(fa4, sdpa_stand_in)
    chosen = pick(order(g, rules=rules), accepted)
    timed = {r: g.time(r) for r in accepted}
    best = fastest({r: t for r, t in timed.items() if t is not None})
    return Verdict(
        g.case,
        g.mode,
        chosen,
        timed.get(chosen) if chosen else None,
        best,
        timed.get(best) if best else None,
    )


#: The hand-written calls a user would otherwise make: plain SDPA and compiled ``flex_attention``.
HAND_WRITTEN = frozenset({"plain_sdpa", "raw_flex"})


def measured(g: Group, route: str = "auto", fa4: bool = True, hand_written: bool = False) -> Verdict | None:
    """The route the ``route`` row (``auto``, or ``auto_tuned``: auto with measured route choice)
    took, timed by that route's own row as every other route is (an ``auto`` row's own time
    differs by run-to-run noise only), against the fastest route measured (``fa4=False``: of the
    routes that run without FA4); ``hand_written``: against the fastest of those and of
    :data:`HAND_WRITTEN` (the call without this library's host time per call)."""
    row = g.rows.get(route)
    if row is None or row["status"] != "ok":
        return None
    skip = (BASELINES - HAND_WRITTEN if hand_written else BASELINES) | (frozenset() if fa4 else FA4_ROUTES)
    timed = {r: g.ms(r) for r in g.rows if r not in skip and g.ms(r) is not None}
    best = fastest(timed)
    chosen_ms = g.ms(row["chosen"]) or row["ms"]
    return Verdict(g.case, g.mode, row["chosen"], chosen_ms, best, timed.get(best) if best else None)


def same_calls(g: Group, route: str = "auto") -> Verdict | None:
    """The ``route`` row (``auto``) against its chosen route's own row: two timings of the same
    calls in one process, so their ratio (the faster over the slower) is the noise of a
    comparison between rows of ``g``; a shortfall of ``measured`` within it is not beyond noise.
    None where either row is missing or failed, or the chosen route's row is the only timing."""
    row = g.rows.get(route)
    if row is None or row["status"] != "ok" or not row.get("chosen") or row["chosen"] == route:
        return None
    own, other = row["ms"], g.ms(row["chosen"])
    if other is None:
        return None
    slow, fast = max(own, other), min(own, other)
    return Verdict(g.case, g.mode, row["chosen"], slow, row["chosen"], fast)


#: A measured ratio below this is a shortfall (the 3% the sweep's rules allow).
SHORTFALL = 0.97


def beyond_noise(measured: Verdict | None, noise: Verdict | None) -> bool:
    """Whether ``measured`` (a :func:`measured` verdict) falls short of the fastest route by more
    than :data:`SHORTFALL` and by more than its group's own noise floor (``noise``, the
    :func:`same_calls` verdict; without one, any shortfall counts)."""
    if measured is None or measured.ratio is None or measured.ratio >= SHORTFALL:
        return False
    return noise is None or noise.ratio is None or measured.ratio < noise.ratio


def with_rows(groups: Iterable[Group], rows: Iterable[dict[str, Any]], routes: Iterable[str]) -> list[Group]:
    """``groups`` with their rows of ``routes`` taken from ``rows`` instead (e.g. the ``auto`` rows
    of a run without FA4): a group's own rows of those routes are dropped, present in ``rows`` or not."""
    wanted = frozenset(routes)
    extra: dict[tuple[str, str], dict[str, dict[str, Any]]] = collections.defaultdict(dict)
    for r in rows:
        if r["route"] in wanted:
            extra[(r["case"], r["mode"])][r["route"]] = r
    out = []
    for g in groups:
        kept = {name: row for name, row in g.rows.items() if name not in wanted}
        out.append(dataclasses.replace(g, rows={**kept, **extra.get((g.case, g.mode), {})}))
    return out


def summary(verdicts: Iterable[Verdict | None]) -> dict[str, Any]:
    """Regret distribution: how many groups, the median / 10th percentile / worst ratio, and the
    share of groups within 5% and 10% of the fastest route."""
    ratios = sorted(v.ratio for v in verdicts if v is not None and v.ratio is not None)
    if not ratios:
        return {"n": 0}
    tenth = ratios[max(0, round(0.1 * len(ratios)) - 1)]
    return {
        "n": len(ratios),
        "median": statistics.median(ratios),
        "p10": tenth,
        "worst": ratios[0],
        "within_5pct": sum(r >= 0.95 for r in ratios) / len(ratios),
        "within_10pct": sum(r >= 0.90 for r in ratios) / len(ratios),
    }


def evidence_holds(rule: Rule, g: Group, arch: str = "sm90") -> tuple[bool, str]:
    """Whether ``g`` (a row named in ``rule.evidence``) supports the rule: a route of
    ``rule.front`` that accepted the problem is faster than the (different) route the order without
    this rule picks. Returns the verdict and a line saying why."""
    others = [r for r in RULES if r is not rule]
    accepted = g.accepted(fa4=True, sdpa_stand_in=True)
    displaced = pick(order(g, arch, others), accepted)
    fronts = [(g.time(r), r) for r in rule.front if r in accepted and g.time(r) is not None]
    if displaced is None or not fronts:
        return False, f"{g.case}/{g.mode}: no displaced route ({displaced}) or no front route measured"
    best_ms, best = min(fronts)
    displaced_ms = g.time(displaced)
    assert best_ms is not None and displaced_ms is not None
    line = f"{g.case}/{g.mode}: {best} {best_ms:.3f} ms vs {displaced} {displaced_ms:.3f} ms without the rule"
    return best != displaced and best_ms < displaced_ms, line
