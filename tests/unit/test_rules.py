"""The dispatcher's measured rules (``arch.RULES``): each is justified by committed benchmark rows,
and the sizes it reads are right (the mask's visible-fraction bounds)."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch

from flexattn_zoo import masks
from flexattn_zoo.arch import RULES
from flexattn_zoo.bench import replay
from flexattn_zoo.bench.config import load_config
from flexattn_zoo.registry import MASKS
from flexattn_zoo.spec import lower_triangle_fraction

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
SWEEP_CONFIG = {
    "generalization_h200.json": "generalization",
    "generalization_fa4replay_h100.json": "generalization",
    "h200.json": "h200",
    "zoo_tree_nofa4_h100_r58.json": "zoo",
    "zoo_global_window_h200_r59.json": "zoo",
}


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.generation}-{'+'.join(r.front[:2])}-{r.benchmark}")
def test_every_rule_is_justified_by_its_rows(rule) -> None:  # type: ignore[no-untyped-def]
    """Each evidence row exists in the committed results, and there a route the rule moves to
    the front beats the route the order without the rule would take."""
    data = json.loads((RESULTS / rule.benchmark).read_text())
    groups = {
        (g.case, g.mode): g for g in replay.groups(data["rows"], load_config(SWEEP_CONFIG[rule.benchmark]))
    }
    assert rule.evidence
    for ev in rule.evidence:
        case, mode = ev.split("/")
        assert mode in rule.modes, ev
        g = groups.get((case, mode))
        assert g is not None, f"{ev} is not in {rule.benchmark}"
        ok, why = replay.evidence_holds(rule, g)
        assert ok, why


def test_lower_triangle_fraction_is_exact() -> None:
    for lq, lkv, offset in itertools.product(range(1, 9), range(1, 9), range(-12, 12)):
        dense = torch.ones(lq, lkv, dtype=torch.float64).tril(offset).mean().item()
        assert lower_triangle_fraction(lq, lkv, offset) == pytest.approx(dense, abs=1e-12), (lq, lkv, offset)


@pytest.mark.parametrize(
    "mask",
    [
        masks.Causal(),
        masks.Causal(align="bottom_right"),
        masks.SlidingWindow(left=5),
        masks.SlidingWindow(left=3, right=9),
        masks.SlidingWindow(left=5) & masks.Causal(),
        masks.SlidingWindow(left=2) | masks.PrefixLM(prefix_len=4),
        masks.PrefixLM(prefix_len=6),
    ],
)
@pytest.mark.parametrize(("lq", "lkv"), [(17, 17), (5, 23), (23, 5), (1, 40)])
def test_visible_fraction_bounds_the_mask(mask, lq: int, lkv: int) -> None:  # type: ignore[no-untyped-def]
    """An upper bound on the share of visible pairs (the size rules must not call a large masked
    problem short), exact for causal masks."""
    dense = mask.dense(lq, lkv).double().mean().item()
    bound = mask.visible_fraction(lq, lkv)
    assert dense <= bound + 1e-12 and bound <= 1.0
    if isinstance(mask, masks.Causal):
        assert bound == pytest.approx(dense, abs=1e-12)


@pytest.mark.parametrize("name", masks.names())
def test_every_familys_visible_fraction_bounds_its_examples(name: str) -> None:
    """The size rules read ``visible_fraction``: every registered family's bound holds on its own
    examples (a bound of 1.0, "unknown", always does)."""
    family = MASKS.entry(name).factory
    for lq, lkv, batch, heads in ((64, 64, 2, 2), (48, 80, 1, 2)):
        try:
            examples = family.examples(lq, lkv, batch, heads)
        except (TypeError, ValueError):
            continue  # a family that needs Lq == Lkv, or other shapes
        for spec in examples:
            try:
                spec.validate(lq, lkv, batch, heads)
            except ValueError:
                continue
            dense = spec.dense(lq, lkv, batch=batch, heads=heads).double().mean().item()
            bound = spec.visible_fraction(lq, lkv)
            assert dense <= bound + 1e-12 and bound <= 1.0, (spec, lq, lkv)


#: The generalization sweeps, oldest first (SWEEP_CONFIG's order). The second measured 14 cases of
#: the first again (an H100) after route fa4 began replaying FA4's launches, which cut its host time
#: per call (by half forward): the first's fa4 rows of those cases time the route as it was.
SWEEPS = tuple(name for name, config in SWEEP_CONFIG.items() if config == "generalization")


def test_replay_of_the_sweeps_improves_on_the_measured_order() -> None:
    """The committed sweeps replayed under the current rules, each (case, mode) on its newest
    rows: none ends up slower than the measured auto took it, beyond 5%, and the median is the
    fastest route."""
    newest = {}
    for name in SWEEPS:
        data = json.loads((RESULTS / name).read_text())
        for g in replay.groups(data["rows"], load_config("generalization")):
            newest[(g.case, g.mode)] = g
    verdicts = [(replay.measured(g), replay.replay(g)) for g in newest.values()]
    pairs = [(m, r) for m, r in verdicts if m is not None and m.ratio is not None and r.ratio is not None]
    assert len(pairs) >= 40
    worse = [(m.case, m.mode, m.chosen, r.chosen) for m, r in pairs if r.ratio < 0.95 * m.ratio]  # type: ignore[operator]
    assert not worse, worse
    assert replay.summary(r for _, r in pairs)["median"] == 1.0


def test_traced_calls_size_the_unmasked_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    """While torch.compile traces, the size rules read no mask fraction: Dynamo reports a
    symbolic length as an int, and a float share would make the rule's guard a float one."""
    from flexattn_zoo import _compat, dispatch
    from flexattn_zoo.problem import Problem

    p = Problem(
        batch=1, heads=8, kv_heads=8, q_len=64, kv_len=64, head_dim=64, dtype=torch.bfloat16,
        device_type="cuda", arch="sm90", requires_grad=False, mask=masks.Causal(),
    )  # fmt: skip
    assert dispatch._visible(p) == pytest.approx(65 / 128)
    monkeypatch.setattr(_compat, "is_compiling", lambda: True)
    assert dispatch._visible(p) == 1.0


def test_evidence_check_rejects_a_rule_its_rows_contradict() -> None:
    """The check above can fail: the same rows do not justify a rule that moves the slowest
    measured route to the front."""
    import dataclasses

    rule = RULES[0]
    data = json.loads((RESULTS / rule.benchmark).read_text())
    groups = {
        (g.case, g.mode): g for g in replay.groups(data["rows"], load_config(SWEEP_CONFIG[rule.benchmark]))
    }
    case, mode = rule.evidence[0].split("/")
    g = groups[(case, mode)]
    timed = [(g.time(r), r) for r in g.accepted(fa4=True, sdpa_stand_in=True) if g.time(r) is not None]
    slowest = max(timed)[1]
    ok, why = replay.evidence_holds(dataclasses.replace(rule, front=(slowest,)), g)
    assert not ok, why


def test_replay_counts_routes_measured_after_the_auto_row() -> None:
    """A resumed sweep adds rows for routes that did not exist when a case's ``auto`` row ran;
    the replay counts them (it took only the auto row's list of accepting routes before, and so
    replayed ``sdpa`` as absent where it had been measured)."""
    row = {"case": "c", "mode": "fwd", "status": "ok", "batch": 1, "heads": 1, "seq_len": 64, "head_dim": 64}
    rows = [
        {**row, "route": "auto", "ms": 2.0, "chosen": "fa4", "accepted": ["fa4", "sdpa_flash"]},
        {**row, "route": "fa4", "ms": 2.0},
        {**row, "route": "sdpa_flash", "ms": 3.0},
        {**row, "route": "sdpa", "ms": 1.0},  # measured later, in a resumed run
    ]
    (g,) = replay.groups(rows)
    assert g.accepted(fa4=True, sdpa_stand_in=True) == {"fa4", "sdpa_flash", "sdpa"}
    assert replay.replay(g).best == "sdpa"


def test_routes_timed_alike_are_named_the_same_in_every_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two routes of equal time: the fastest is the first by name, not whichever a set of routes
    (ordered by string hashes, which differ per process) yields first."""
    row = {"case": "c", "mode": "fwd", "status": "ok", "batch": 1, "heads": 1, "seq_len": 64, "head_dim": 64}
    rows = [
        {**row, "route": "auto", "ms": 0.3, "chosen": "sdpa", "accepted": ["sdpa", "fa4", "flex_flash"]},
        {**row, "route": "sdpa", "ms": 0.3},
        {**row, "route": "flex_flash", "ms": 0.241},
        {**row, "route": "fa4", "ms": 0.241},
    ]
    (g,) = replay.groups(rows)
    assert replay.measured(g).best == "fa4"  # type: ignore[union-attr]
    for order in (["flex_flash", "fa4", "sdpa"], ["fa4", "flex_flash", "sdpa"]):
        monkeypatch.setattr(replay.Group, "accepted", lambda self, *a, order=order: order)
        assert replay.replay(g).best == "fa4"


def test_long_decoding_goes_to_sdpa_first() -> None:
    """One query over 8192+ keys with 256+ (batch x kv head) rows: SDPA's own choice first (cuDNN
    once a shape repeats, FlashAttention-2 while the cache grows: 0.34 ms per step against fa4's
    0.55 in a growing loop), and flex not ahead of SDPA's kernels (in a generation loop the length
    changes every call and flex's dynamic-shape kernel is slower than FlashAttention-2; only
    ``decode_step`` keeps flex's shapes fixed)."""
    from flexattn_zoo.arch import Sizes, priority

    order = priority("sm90", "fwd", frozenset(), Sizes(32, 32, 1, 8192, 128, 1.0, 8))
    assert order[0] == "sdpa"
    assert order.index("sdpa_flash") < order.index("flex") < order.index("fa4")


def test_head_dim_256_trains_on_cudnn_or_fa4_before_flex() -> None:
    from flexattn_zoo.arch import Sizes, priority

    local = Sizes(1, 8, 8192, 8192, 256, 1024 / 8192, 4)  # short by visible work: FA4 still first
    order = priority("sm90", "fwdbwd", frozenset(), local)
    assert order[:3] == ("sdpa", "sdpa_cudnn", "fa4") and order.index("fa4") < order.index("flex")
    same_at_128 = priority("sm90", "fwdbwd", frozenset(), dataclasses.replace(local, head_dim=128))
    assert same_at_128.index("flex") < same_at_128.index("fa4")
    # Forward from 1e10 of visible work: fa4 (generalization_h200: 0.252 vs flex 0.272 ms at a
    # 1024-key window, 1.6e10); below it the short-forward order, flex first.
    forward = priority("sm90", "fwd", frozenset(), local)
    assert forward[0] == "fa4"
    narrow = priority("sm90", "fwd", frozenset(), dataclasses.replace(local, visible=512 / 8192))
    assert narrow.index("flex") < narrow.index("fa4")
    assert priority("sm90", "fwd", frozenset(), dataclasses.replace(local, head_dim=128))[0] != "fa4"


def test_measured_views_read_the_run_they_describe() -> None:
    """``measured`` times a row's choice by the chosen route's own row against the fastest route
    (without FA4: of the routes that run without it); ``with_rows`` takes the ``auto`` /
    ``auto_tuned`` rows of another run (the no-FA4 view) and drops a group's own, so a choice
    made with FA4 never stands for a machine without it."""
    row = {"case": "c", "mode": "fwd", "status": "ok", "batch": 1, "heads": 1, "seq_len": 64, "head_dim": 64}
    rows = [
        {**row, "route": "auto", "ms": 1.1, "chosen": "fa4", "accepted": ["fa4", "sdpa_flash", "flex"]},
        {**row, "route": "auto_tuned", "ms": 1.0, "chosen": "fa4"},
        {**row, "route": "fa4", "ms": 1.0},
        {**row, "route": "sdpa_flash", "ms": 2.0},
        {**row, "route": "flex", "ms": 4.0},
    ]
    (g,) = replay.groups(rows)
    v = replay.measured(g)
    assert (v.chosen, v.chosen_ms, v.best, v.ratio) == ("fa4", 1.0, "fa4", 1.0)  # type: ignore[union-attr]
    assert replay.measured(g, "auto_tuned").ratio == 1.0  # type: ignore[union-attr]
    other = [{**row, "route": "auto", "ms": 4.1, "chosen": "flex"}]
    (h,) = replay.with_rows([g], other, ["auto", "auto_tuned"])
    assert replay.measured(h, "auto_tuned") is None
    v = replay.measured(h, "auto", fa4=False)
    assert (v.chosen, v.chosen_ms, v.best, v.ratio) == ("flex", 4.0, "sdpa_flash", 0.5)  # type: ignore[union-attr]
    (empty,) = replay.with_rows([g], [], ["auto", "auto_tuned"])
    assert replay.measured(empty, "auto", fa4=False) is None


def test_same_calls_compares_the_auto_row_with_its_routes_own_row() -> None:
    """The noise floor of the regret report: ``auto``'s row and its chosen route's row time the
    same calls, so faster / slower of the two is the rows' noise; no verdict without both rows
    (or when ``auto`` names itself)."""

    def row(route: str, ms: float, chosen: str | None = None, status: str = "ok") -> dict[str, object]:
        return {"route": route, "ms": ms, "status": status, "chosen": chosen}

    g = replay.Group("c", "fwd", {"auto": row("auto", 0.05, "sdpa"), "sdpa": row("sdpa", 0.078)})
    v = replay.same_calls(g)
    assert v is not None and v.chosen == "sdpa" and v.ratio == pytest.approx(0.05 / 0.078)
    flipped = replay.Group("c", "fwd", {"auto": row("auto", 0.078, "sdpa"), "sdpa": row("sdpa", 0.05)})
    assert replay.same_calls(flipped).ratio == pytest.approx(v.ratio)  # type: ignore[union-attr]
    assert replay.same_calls(replay.Group("c", "fwd", {"auto": row("auto", 0.05, "sdpa")})) is None
    failed = {"auto": row("auto", 0.05, "sdpa"), "sdpa": row("sdpa", 0.07, status="error")}
    assert replay.same_calls(replay.Group("c", "fwd", failed)) is None
    assert replay.same_calls(replay.Group("c", "fwd", {"auto": row("auto", 0.05, "auto")})) is None
    assert replay.summary([v])["worst"] == pytest.approx(0.05 / 0.078)


def test_a_shortfall_counts_only_beyond_its_pairs_own_noise() -> None:
    def verdict(chosen_ms: float, best_ms: float) -> replay.Verdict:
        return replay.Verdict("c", "fwd", "sdpa", chosen_ms, "fa4", best_ms)

    assert not replay.beyond_noise(verdict(1.0, 0.98), None)  # within 3%
    assert replay.beyond_noise(verdict(1.0, 0.9), None)  # no noise floor: any shortfall
    assert not replay.beyond_noise(verdict(1.0, 0.9), verdict(1.0, 0.85))  # the rows' noise is larger
    assert replay.beyond_noise(verdict(1.0, 0.8), verdict(1.0, 0.85))
    assert not replay.beyond_noise(None, None)
