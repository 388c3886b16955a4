"""Measured route choice (``fz.tune``): signatures, the decision, the switches, the plan cache,
persistence, traced calls, the CLI, and that timing leaves the caller's tensors alone.

Winners are decided by a fake timer (``tuning.time_routes`` replaced) wherever the test is about
selection, so nothing depends on this machine's speed; the CPU's real candidates for a causal
forward are ``sdpa_flash`` (the static choice) and ``flex_cpu``. Every test runs with an empty
table, a fresh plan cache and a cache directory of its own (the ``tuned`` fixture).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from learned_bias import LearnedHeadBias
from subclassed_specs import SquaredDistance, StrictlyCausal

import flexattn_zoo as fz
from flexattn_zoo import dispatch, masks, plan_cache, score_mods, tuning
from flexattn_zoo.cli import app as cli
from flexattn_zoo.cli import info
from flexattn_zoo.lru import LRUCache
from flexattn_zoo.testing import assert_matches_reference
from flexattn_zoo.tuning import store as tuning_store
from flexattn_zoo.tuning import timing

SHAPE = (1, 2, 64, 16)  # one causal flex_cpu kernel, compiled once for the whole module


@pytest.fixture
def tuned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty table, persistence into ``tmp_path/cache``, tuning off, a fresh plan cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(tuning_store.CACHE_DIR_ENV, str(cache))
    monkeypatch.delenv(tuning.TUNE_ENV, raising=False)
    _fresh_process(monkeypatch)
    monkeypatch.setattr(tuning, "_OVERRIDE", None)
    monkeypatch.setattr(tuning, "_SETTINGS", tuning.Settings(warmup=0, reps=2))
    return cache


def _fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a new process starts with: nothing loaded, nothing measured, no plan cached."""
    monkeypatch.setattr(tuning, "_TABLE", {})
    monkeypatch.setattr(tuning, "_LOADED", {})
    monkeypatch.setattr(plan_cache, "PLANS", LRUCache(64))


class FakeTimer:
    """``tuning.time_routes`` that runs nothing and reports ``ms[name]`` for each route it is given
    (routes in ``fail`` report an error); ``calls`` lists the routes in the order given."""

    def __init__(self, ms: dict[str, float], fail: tuple[str, ...] = ()) -> None:
        self.ms, self.fail = ms, fail
        self.calls: list[str] = []

    def __call__(
        self, steps: dict[str, Any], device: Any, warmup: int, reps: int
    ) -> dict[str, tuple[float, float] | Exception]:
        self.calls += list(steps)
        return {
            name: RuntimeError(f"{name} broke") if name in self.fail else (self.ms.get(name, 1000.0), 0.25)
            for name in steps
        }


def _qkv(shape: tuple[int, ...] = SHAPE, grad: bool = False, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g).requires_grad_(grad) for _ in range(3))


def _route(caplog: pytest.LogCaptureFixture, call: Callable[[], Any]) -> str:
    """The route ``call``'s ``fz.attention`` ran (from the dispatcher's debug log)."""
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger=dispatch.log.name):
        call()
    routes = [
        r.getMessage().split()[-1] for r in caplog.records if r.getMessage().startswith("flexattn_zoo route")
    ]
    assert routes, "no attention call was logged"
    return routes[-1]


# ---- signatures ---------------------------------------------------------------------------


def test_buckets_are_powers_of_two_with_decode_buckets() -> None:
    assert [tuning.bucket(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 1000, 1024, 1025)] == [
        1, 2, 4, 8, 8, 16, 16, 32, 1024, 1024, 2048,
    ]  # fmt: skip


def test_signature_fields_json_round_trip_and_validation() -> None:
    q, k, v = (torch.randn(2, 8, 5, 32), torch.randn(2, 2, 300, 32), torch.randn(2, 2, 300, 32))
    plan = fz.plan(q, k, v, mask=masks.Causal(align="bottom_right"), enable_gqa=True, tune=True)
    assert plan.tuning is not None
    sig = plan.tuning.signature
    assert (sig.device, sig.arch, sig.dtype, sig.head_dim, sig.v_dim, sig.gqa) == (
        "cpu",
        "cpu",
        "float32",
        32,
        32,
        4,
    )
    assert (sig.batch_heads, sig.q_len, sig.kv_len, sig.mode) == (16, 8, 512, "fwd")
    text = json.dumps(sig.to_json())
    assert tuning.Signature.from_json(json.loads(text)) == sig
    bad = {**sig.to_json(), "head_dim": "32"}
    with pytest.raises(ValueError, match="head_dim"):
        tuning.Signature.from_json(bad)
    with pytest.raises(ValueError, match="keys"):
        tuning.Signature.from_json({k: v for k, v in sig.to_json().items() if k != "mode"})


def test_spec_kind_is_structure_without_parameters() -> None:
    a = masks.SlidingWindow(left=3) & masks.Causal()
    b = masks.Causal() & masks.SlidingWindow(left=100)
    assert tuning.spec_kind(a) == tuning.spec_kind(b) == "(causal & sliding_window)"
    assert tuning.spec_kind(~masks.Causal() | masks.Full()) == "(full | ~causal)"
    assert tuning.spec_kind(score_mods.SoftCap(cap=30.0, approx=True)) == "softcap~approx"
    assert tuning.spec_kind(score_mods.SoftCap(cap=30.0)) == "softcap"
    chain = score_mods.Alibi(num_heads=2) >> score_mods.SoftCap(cap=5.0)
    assert tuning.spec_kind(chain) == "alibi >> softcap"
    # A subclass of a preset runs a function of its own: its measurements are not its parent's.
    assert tuning.spec_kind(StrictlyCausal() & masks.Causal()) == "(StrictlyCausal & causal)"
    assert tuning.spec_kind(SquaredDistance(num_heads=2)) == "SquaredDistance"

    def near(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (q_idx - kv_idx).abs() <= 2

    q = torch.randn(1, 1, 8, 8)
    sig = fz.plan(q, q, q, mask=near, tune=True).tuning
    assert sig is not None
    assert sig.signature.mask == f"fn:{__name__}.{near.__qualname__}"
    assert sig.signature.density == "unknown"  # a raw callable: no closed form


def test_density_buckets() -> None:
    assert tuning.density(None, 64, 64) == "1"
    assert tuning.density(masks.Causal(), 1024, 1024) == "1"  # 36 of 64 blocks: more than half
    assert tuning.density(masks.SlidingWindow(left=127), 4096, 4096) == "1/16"
    assert tuning.density(masks.SlidingWindow(left=100), 4096, 4096) == "1/16"  # same bucket, same entry
    assert tuning.density(masks.Chunked(size=128), 8192, 8192) == "<=1/64"
    assert tuning.density(masks.Document.from_lengths([30, 34]), 64, 64) == "unknown"  # holds tensors
    # Far past 256 blocks a side the map is coarser, still O(blocks).
    assert tuning.density(masks.SlidingWindow(left=4095), 1 << 20, 1 << 20) == "<=1/64"


def test_candidates_leave_out_materializing_routes_unless_static() -> None:
    accepted = ("sdpa_flash", "flex_cpu", "sdpa_math", "dense")
    assert tuning.candidates(accepted, "sdpa_flash") == ("sdpa_flash", "flex_cpu")
    assert tuning.candidates(("sdpa_math", "dense"), "sdpa_math") == ("sdpa_math",)
    assert tuning.candidates(("dense",), "dense") == ("dense",)


def test_decide_is_deterministic_with_a_margin_for_the_static_choice() -> None:
    order = ("a", "b", "c")
    assert tuning.decide({"a": 1.0, "b": 0.9}, order, "a", 0.05) == "b"
    assert tuning.decide({"a": 1.0, "b": 0.97}, order, "a", 0.05) == "a"  # within the margin
    assert tuning.decide({"a": 1.0, "b": 0.97}, order, "a", 0.0) == "b"
    assert tuning.decide({"b": 0.5, "c": 0.5}, order, "a", 0.05) == "b"  # static failed; tie: rank
    assert tuning.decide({"c": 0.5, "b": 0.5}, order, "a", 0.05) == "b"  # insertion order is irrelevant
    assert tuning.decide({}, order, "a", 0.05) == "a"


# ---- switches ---------------------------------------------------------------------------


def test_switches_and_their_validation(tuned: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not tuning.is_enabled()
    monkeypatch.setenv(tuning.TUNE_ENV, "1")
    assert tuning.is_enabled()
    tuning.disable()
    assert not tuning.is_enabled()  # an explicit switch wins over the variable
    with tuning.enabled():
        assert tuning.is_enabled()
        with tuning.enabled(False):
            assert not tuning.is_enabled()
        assert tuning.is_enabled()
    assert not tuning.is_enabled()
    tuning.enable()
    assert tuning.is_enabled()
    monkeypatch.setattr(tuning, "_OVERRIDE", None)
    monkeypatch.setenv(tuning.TUNE_ENV, "maybe")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=tuning.TUNE_ENV):
        fz.attention(q, k, v, mask="causal")
    monkeypatch.delenv(tuning.TUNE_ENV)
    with pytest.raises(TypeError, match="tune must be a bool"):
        fz.attention(q, k, v, mask="causal", tune="yes")  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="reps"):
        tuning.configure(reps=0)
    with pytest.raises(ValueError, match="margin"):
        tuning.configure(margin=1.5)
    with pytest.raises(TypeError, match="reps must be an int"):
        tuning.configure(reps=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="margin must be a number"):
        tuning.configure(margin="0.1")  # type: ignore[arg-type]


# ---- selection ----------------------------------------------------------------------------


def test_auto_takes_the_measured_winner_and_a_named_route_is_unchanged(
    tuned: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    timer = FakeTimer({"sdpa_flash": 2.0, "flex_cpu": 1.0})
    monkeypatch.setattr(tuning, "time_routes", timer)
    q, k, v = _qkv()
    assert fz.plan(q, k, v, mask="causal").backend == "sdpa_flash"  # static order
    # A named route: never timed, never changed, even with tuning on.
    assert (
        _route(caplog, lambda: fz.attention(q, k, v, mask="causal", backend="sdpa_flash", tune=True))
        == "sdpa_flash"
    )
    assert timer.calls == []
    out = None

    def call() -> None:
        nonlocal out
        out = fz.attention(q, k, v, mask="causal", tune=True)

    assert _route(caplog, call) == "flex_cpu"
    assert timer.calls == ["sdpa_flash", "flex_cpu"]
    assert out is not None
    assert_matches_reference(out, q, k, v, mask="causal")
    assert _route(caplog, call) == "flex_cpu"
    assert timer.calls == ["sdpa_flash", "flex_cpu"]  # measured once per signature
    plan = fz.plan(q, k, v, mask="causal", tune=True)
    assert plan.backend == "flex_cpu" and plan.measured
    assert "chosen by measurement" in plan.explain() and "flex_cpu 1 ms" in plan.explain()
    assert "chosen (measured)" in plan.explain()
    named = fz.plan(q, k, v, mask="causal", backend="sdpa_flash", tune=True)
    assert named.backend == "sdpa_flash" and named.tuning is None
    assert fz.plan(q, k, v, mask="causal", tune=False).backend == "sdpa_flash"
    static = fz.plan(q, k, v, mask="causal", tune=False)
    assert "tuning:" not in static.explain() and not static.measured


def test_routes_are_timed_through_the_bound_call_repeated_calls_run(
    tuned: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timed step of each route is the bound call the plan cache keeps (what every later
    call of the signature runs), not the route's full path, whose extra host work per call
    (BlockMask and compiled-entry lookups on flex routes) would count against it."""
    bound: list[str] = []
    full: list[str] = []
    real_of, real_execute = dispatch.BoundPlan.of, dispatch.execute_plan

    def of(plan: Any, device: Any) -> Any:
        made = real_of(plan, device)
        call = made.run

        def counted(*args: Any) -> Any:
            bound.append(plan.backend)
            return call(*args)

        made.run = counted
        return made

    def execute(plan: Any, *args: Any, **kw: Any) -> Any:
        full.append(plan.backend)
        return real_execute(plan, *args, **kw)

    monkeypatch.setattr(dispatch.BoundPlan, "of", of)
    monkeypatch.setattr(dispatch, "execute_plan", execute)

    def timer(steps: dict[str, Any], device: Any, warmup: int, reps: int) -> dict[str, tuple[float, float]]:
        for name, step in steps.items():
            before = len(full)
            step()
            step()
            assert bound[-2:] == [name, name]
            assert len(full) == before  # not the full path
        return {name: ({"sdpa_flash": 2.0, "flex_cpu": 1.0}[name], 0.25) for name in steps}

    monkeypatch.setattr(tuning, "time_routes", timer)
    q, k, v = _qkv()
    out = fz.attention(q, k, v, mask="causal", tune=True)
    assert sorted(set(bound)) == ["flex_cpu", "sdpa_flash"]
    assert_matches_reference(out, q, k, v, mask="causal")


def test_a_route_failing_while_timed_is_left_out(tuned: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    timer = FakeTimer({"sdpa_flash": 2.0, "flex_cpu": 1.0}, fail=("flex_cpu",))
    monkeypatch.setattr(tuning, "time_routes", timer)
    q, k, v = _qkv()
    out = fz.attention(q, k, v, mask="causal", tune=True)
    plan = fz.plan(q, k, v, mask="causal", tune=True)
    assert plan.backend == "sdpa_flash"
    assert plan.tuning is not None and plan.tuning.entry is not None
    assert dict(plan.tuning.entry.errors) == {"flex_cpu": "RuntimeError: flex_cpu broke"}
    assert dict(plan.tuning.entry.ms) == {"sdpa_flash": 2.0}
    assert "flex_cpu failed" in plan.explain()
    assert_matches_reference(out, q, k, v, mask="causal")


def test_a_measured_winner_that_refuses_the_call_falls_back_to_static(tuned: Path) -> None:
    q, k, v = _qkv()
    sig = fz.plan(q, k, v, mask="causal", tune=True).tuning
    assert sig is not None
    tuning.record(sig.signature, _entry("flex_cpu"))
    assert fz.plan(q, k, v, mask="causal", tune=True).backend == "flex_cpu"
    bad = q.clone()
    bad[0, 0, 0, 0] = float("nan")  # flex_cpu refuses non-finite inputs: same signature
    plan = fz.plan(bad, k, v, mask="causal", tune=True)
    assert plan.backend == "sdpa_flash" and not plan.measured
    assert "cannot run this call" in plan.explain()


def test_a_winner_not_compared_with_every_candidate_falls_back_to_static(tuned: Path) -> None:
    """One signature covers a bucket of lengths; a route may accept only some of them (equal
    chunks, Lq == Lkv). A winner measured without such a route says nothing against it."""
    q, k, v = _qkv()
    sig = fz.plan(q, k, v, mask="causal", tune=True).tuning
    assert sig is not None
    entry = _entry("flex_cpu")  # compared sdpa_flash and flex_cpu
    same = tuning.TuneInfo(sig.signature, entry, ("sdpa_flash", "flex_cpu"))
    assert same.chosen("sdpa_flash") == "flex_cpu" and same.measured("flex_cpu") and not same.untimed()
    wider = tuning.TuneInfo(sig.signature, entry, ("sdpa_split", "sdpa_flash", "flex_cpu"))
    assert wider.untimed() == ("sdpa_split",)
    assert wider.chosen("sdpa_split") == "sdpa_split" and not wider.measured("flex_cpu")
    assert "not compared with sdpa_split" in wider.describe("sdpa_split")


def _entry(winner: str, date: str = "2000-01-01T00:00:00.000000+00:00") -> tuning.Entry:
    return tuning.Entry(
        winner=winner,
        static="sdpa_flash",
        ms=(("sdpa_flash", 2.0), ("flex_cpu", 1.0)),
        compile_s=(("sdpa_flash", 0.0), ("flex_cpu", 1.0)),
        reps=2,
        warmup=0,
        date=date,
    )


# ---- the caller's tensors -----------------------------------------------------------------


def test_timing_leaves_the_callers_tensors_grads_and_rng_alone(
    tuned: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real timing in fwdbwd mode (the CPU has one such candidate for causal; every accepting
    route is compared here), then the user's own backward: exact against float64."""
    monkeypatch.setattr(tuning, "candidates", lambda accepted, static: tuple(accepted))
    q, k, v = _qkv((1, 2, 32, 16), grad=True)
    versions = [t._version for t in (q, k, v)]
    copies = [t.detach().clone() for t in (q, k, v)]
    rng = torch.get_rng_state()
    out = fz.attention(q, k, v, mask="causal", tune=True)
    entry = fz.plan(q, k, v, mask="causal", tune=True).tuning
    assert entry is not None and entry.entry is not None
    assert {n for n, _ in entry.entry.ms} == {"sdpa_flash", "sdpa_math", "dense"}  # really timed
    assert [t._version for t in (q, k, v)] == versions
    assert all(torch.equal(t.detach(), c) for t, c in zip((q, k, v), copies, strict=True))
    assert all(t.grad is None for t in (q, k, v))
    assert torch.equal(torch.get_rng_state(), rng)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(out, q, k, v, mask="causal", grads=grads, grad_out=grad_out)


def test_timing_accumulates_no_grad_into_a_learned_score_tensor(tuned: Path) -> None:
    bias = torch.randn(2, requires_grad=True)
    spec = LearnedHeadBias(bias=bias)
    q, k, v = _qkv((1, 2, 16, 8))
    plan = fz.plan(q, k, v, score_mod=spec, tune=True)  # fwdbwd: the spec captures a learnable tensor
    assert plan.problem.mode == "fwdbwd" and plan.tuning is not None
    seen: list[bool] = []

    def run(name: str, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> Any:
        out, lse = dispatch.execute_plan(dataclasses.replace(plan, backend="dense"), a, b, c, scale=None)
        seen.append(out.requires_grad)
        a.add_(1.0)  # a route that writes to its inputs writes to copies
        return out, lse

    info = dataclasses.replace(plan.tuning, candidates=("dense",))
    version = bias._version
    before = [(t._version, t.clone()) for t in (q, k, v)]
    entry = tuning.measure(info, "dense", run, q, k, v, plan.problem)
    assert entry.winner == "dense" and not entry.errors and seen and all(seen)
    assert bias.grad is None and bias._version == version
    assert all(t._version == n and torch.equal(t, c) for t, (n, c) in zip((q, k, v), before, strict=True))


# ---- the plan cache -----------------------------------------------------------------------


def test_the_plan_cache_follows_every_change_of_tuning(
    tuned: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    timer = FakeTimer({"sdpa_flash": 2.0, "flex_cpu": 1.0})
    monkeypatch.setattr(tuning, "time_routes", timer)
    q, k, v = _qkv()

    def route(**kw: Any) -> str:
        return _route(caplog, lambda: fz.attention(q, k, v, mask="causal", **kw))

    assert route() == "sdpa_flash"  # tuning off: the static plan is cached
    tuning.enable()
    assert route() == "flex_cpu" and timer.calls == ["sdpa_flash", "flex_cpu"]
    inserts = plan_cache.PLANS.inserts
    assert route() == "flex_cpu"
    assert plan_cache.PLANS.inserts == inserts  # a hit
    tuning.disable()
    assert route() == "sdpa_flash"
    assert route(tune=True) == "flex_cpu"  # per call, from the table: not measured again
    with tuning.enabled():
        assert route() == "flex_cpu"
    assert route() == "sdpa_flash"
    tuning.enable()
    tuning.clear()
    timer.ms = {"sdpa_flash": 1.0, "flex_cpu": 2.0}
    assert route() == "sdpa_flash" and timer.calls[2:] == ["sdpa_flash", "flex_cpu"]  # measured anew
    sig = fz.plan(q, k, v, mask="causal").tuning
    assert sig is not None
    tuning.record(sig.signature, _entry("flex_cpu", date="2999-01-01T00:00:00.000000+00:00"))
    assert route() == "flex_cpu"  # a new entry (another process's, merged): seen at once


# ---- persistence --------------------------------------------------------------------------


def test_round_trip_through_the_cache_file(tuned: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuning, "time_routes", FakeTimer({"sdpa_flash": 2.0, "flex_cpu": 1.0}))
    q, k, v = _qkv()
    fz.attention(q, k, v, mask="causal", tune=True)
    path = tuning.cache_path()
    assert path.parent == tuned and path.is_file()
    data = json.loads(path.read_text())
    assert data["env"]["device"] == "cpu" and data["env"]["torch"] == torch.__version__
    before = tuning.table()
    assert len(before) == 1
    _fresh_process(monkeypatch)
    timer = FakeTimer({}, fail=("sdpa_flash", "flex_cpu"))
    monkeypatch.setattr(tuning, "time_routes", timer)
    assert tuning.table() == before
    plan = fz.plan(q, k, v, mask="causal", tune=True)
    assert plan.backend == "flex_cpu" and plan.measured
    out = fz.attention(q, k, v, mask="causal", tune=True)  # read, not measured
    assert_matches_reference(out, q, k, v, mask="causal")
    assert timer.calls == []
    # Another cache directory is another table, for the plan cache too; back again, the first.
    monkeypatch.setenv(tuning_store.CACHE_DIR_ENV, str(tuned.parent / "elsewhere"))
    assert fz.plan(q, k, v, mask="causal", tune=True).backend == "sdpa_flash"
    fz.attention(q, k, v, mask="causal", tune=True)  # not in that table: measured (both fail here)
    assert timer.calls == ["sdpa_flash", "flex_cpu"]
    monkeypatch.setenv(tuning_store.CACHE_DIR_ENV, str(tuned))
    assert fz.plan(q, k, v, mask="causal", tune=True).backend == "flex_cpu"


@pytest.mark.parametrize("variable", ["XDG_CACHE_HOME", "HOME"])
def test_every_variable_placing_the_cache_file_keys_the_plan_cache(
    variable: str,
    tuned: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Without FLEXATTN_ZOO_CACHE_DIR the file is under XDG_CACHE_HOME, else under HOME: moving
    # either mid-run is another table, so a plan cached from the old one must not be reused.
    monkeypatch.delenv(tuning_store.CACHE_DIR_ENV)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv(variable, str(tuned / "first"))
    monkeypatch.setattr(tuning, "time_routes", FakeTimer({"sdpa_flash": 2.0, "flex_cpu": 1.0}))
    q, k, v = _qkv()

    def call() -> None:
        fz.attention(q, k, v, mask="causal", tune=True)

    assert _route(caplog, call) == "flex_cpu"
    assert tuning.cache_path().is_relative_to(tuned / "first")
    monkeypatch.setenv(variable, str(tuned / "second"))
    timer = FakeTimer({"sdpa_flash": 1.0, "flex_cpu": 2.0})
    monkeypatch.setattr(tuning, "time_routes", timer)
    assert _route(caplog, call) == "sdpa_flash"  # that directory's table: measured there
    assert timer.calls == ["sdpa_flash", "flex_cpu"]
    assert tuning.cache_path().is_relative_to(tuned / "second")


@pytest.mark.parametrize("variable", [tuning_store.CACHE_DIR_ENV, "XDG_CACHE_HOME"])
def test_a_relative_cache_directory_keeps_its_meaning_after_a_change_of_directory(
    variable: str,
    tuned: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Cached plans key on the variables' values: a relative value read again after os.chdir must
    # not name another directory (another table) while a plan chosen from the first one is reused.
    monkeypatch.delenv(tuning_store.CACHE_DIR_ENV)
    relative = f"relative-{tuned.parent.name}"  # unique: the process keeps each value's meaning
    monkeypatch.setenv(variable, relative)
    (tuned / "a").mkdir(parents=True)
    (tuned / "b").mkdir()
    monkeypatch.chdir(tuned / "a")
    monkeypatch.setattr(tuning, "time_routes", FakeTimer({"sdpa_flash": 2.0, "flex_cpu": 1.0}))
    q, k, v = _qkv()

    def call() -> None:
        fz.attention(q, k, v, mask="causal", tune=True)

    assert _route(caplog, call) == "flex_cpu"
    first = tuning.cache_path()
    assert first.is_relative_to(tuned / "a") and first.is_file()
    monkeypatch.chdir(tuned / "b")
    assert tuning.cache_path() == first
    _fresh_process(monkeypatch)  # nothing loaded or cached: the same file is read again
    timer = FakeTimer({"sdpa_flash": 1.0, "flex_cpu": 2.0})
    monkeypatch.setattr(tuning, "time_routes", timer)
    assert _route(caplog, call) == "flex_cpu" and timer.calls == []
    assert not (tuned / "b" / relative).exists()


def test_an_environment_change_starts_a_new_file(tuned: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuning, "time_routes", FakeTimer({"sdpa_flash": 2.0, "flex_cpu": 1.0}))
    q, k, v = _qkv()
    fz.attention(q, k, v, mask="causal", tune=True)
    old_path = tuning.cache_path()
    real = tuning_store.environment
    monkeypatch.setattr(tuning_store, "environment", lambda name: {**real(name), "torch": "9.99.0"})
    _fresh_process(monkeypatch)
    new_path = tuning.cache_path()
    assert new_path != old_path and new_path.parent == old_path.parent
    plan = fz.plan(q, k, v, mask="causal", tune=True)
    assert plan.backend == "sdpa_flash" and plan.tuning is not None and plan.tuning.entry is None
    monkeypatch.setattr(tuning, "time_routes", FakeTimer({"sdpa_flash": 1.0, "flex_cpu": 2.0}))
    fz.attention(q, k, v, mask="causal", tune=True)
    assert old_path.is_file() and new_path.is_file()
    assert json.loads(new_path.read_text())["env"]["torch"] == "9.99.0"


def test_a_corrupt_file_is_ignored_with_a_warning(tuned: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    timer = FakeTimer({"sdpa_flash": 1.0, "flex_cpu": 2.0})
    monkeypatch.setattr(tuning, "time_routes", timer)
    path = tuning.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text("{ not json")
    q, k, v = _qkv()
    with pytest.warns(UserWarning, match="not valid JSON"):
        out = fz.attention(q, k, v, mask="causal", tune=True)
    assert_matches_reference(out, q, k, v, mask="causal")
    assert timer.calls == ["sdpa_flash", "flex_cpu"]
    rows = json.loads(path.read_text())["entries"]  # replaced by a good file
    assert len(rows) == 1 and rows[0]["winner"] == "sdpa_flash"
    # One malformed entry among good ones: dropped, the rest read.
    rows.append({**rows[0], "ms": "fast"})
    path.write_text(json.dumps({**json.loads(path.read_text()), "entries": rows}))
    _fresh_process(monkeypatch)
    with pytest.warns(UserWarning, match="dropped 1 malformed"):
        plan = fz.plan(q, k, v, mask="causal", tune=True)
    assert plan.tuning is not None and plan.tuning.entry is not None


def _huge_number_file(path: Path) -> bytes:
    q, k, v = _qkv()
    info = fz.plan(q, k, v, mask="causal", tune=True).tuning
    assert info is not None
    row = {"signature": info.signature.to_json(), **_entry("sdpa_flash").to_json()}
    return json.dumps({"format": 1, "entries": [{**row, "ms": {"sdpa_flash": 10**400}}]}).encode()


@pytest.mark.parametrize(
    "contents",
    [
        lambda path: b'{"format": 1, "entries": [\xff\xfe',  # not UTF-8 (a corrupt disk block)
        lambda path: b"[" * 100_000,  # nested beyond the JSON parser's depth
        _huge_number_file,  # an entry whose number does not fit a float
    ],
    ids=["not-utf8", "too-deep", "huge-number"],
)
def test_no_corrupt_file_raises_into_a_call(
    contents: Callable[[Path], bytes], tuned: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tuning.cache_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(contents(path))
    _fresh_process(monkeypatch)
    monkeypatch.setattr(tuning, "time_routes", FakeTimer({"sdpa_flash": 1.0, "flex_cpu": 2.0}))
    q, k, v = _qkv()
    with pytest.warns(UserWarning, match="not valid JSON|malformed"):
        out = fz.attention(q, k, v, mask="causal", tune=True)
    assert_matches_reference(out, q, k, v, mask="causal")
    rows = json.loads(path.read_text())["entries"]  # replaced by a good file
    assert len(rows) == 1 and rows[0]["winner"] == "sdpa_flash"


def test_an_unwritable_cache_warns_and_keeps_the_measurement(
    tuned: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tuned.parent / "a_file"
    blocker.write_text("")
    monkeypatch.setenv(tuning_store.CACHE_DIR_ENV, str(blocker / "cache"))  # a directory under a file
    monkeypatch.setattr(tuning, "time_routes", FakeTimer({"sdpa_flash": 2.0, "flex_cpu": 1.0}))
    q, k, v = _qkv()
    with pytest.warns(UserWarning) as caught:  # cannot read it either: both said
        fz.attention(q, k, v, mask="causal", tune=True)
    assert any("cannot write" in str(w.message) for w in caught)
    assert fz.plan(q, k, v, mask="causal", tune=True).backend == "flex_cpu"


def test_a_file_that_cannot_be_read_is_never_replaced(tuned: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Other processes' entries may be in it: a writer that could not read them keeps its own in
    # memory instead of writing a file without them. A corrupt file, by contrast, is replaced.
    monkeypatch.setattr(tuning, "time_routes", FakeTimer({"sdpa_flash": 2.0, "flex_cpu": 1.0}))
    q, k, v = _qkv()
    fz.attention(q, k, v, mask="causal", tune=True)
    path = tuning.cache_path()
    before = path.read_bytes()
    real = Path.read_bytes

    def denied(self: Path) -> bytes:
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", denied)
    q2, k2, v2 = _qkv((1, 2, 32, 16))
    with pytest.warns(UserWarning, match="cannot read"):
        fz.attention(q2, k2, v2, mask="causal", tune=True)
    monkeypatch.setattr(Path, "read_bytes", real)
    assert path.read_bytes() == before
    assert fz.plan(q2, k2, v2, mask="causal", tune=True).measured  # kept in memory


def test_the_cache_file_takes_the_users_umask_not_owner_only(
    tuned: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tuning, "time_routes", FakeTimer({"sdpa_flash": 2.0, "flex_cpu": 1.0}))
    old = os.umask(0o022)
    try:
        q, k, v = _qkv()
        fz.attention(q, k, v, mask="causal", tune=True)
    finally:
        os.umask(old)
    assert tuning.cache_path().stat().st_mode & 0o777 == 0o644
    assert not list(tuned.glob("*.tmp"))


def test_no_home_directory_keeps_measurements_in_memory(tuned: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # HOME unset and a uid without a password entry (a container's): pathlib cannot place "~".
    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv(tuning_store.CACHE_DIR_ENV)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    monkeypatch.setattr(tuning, "time_routes", FakeTimer({"sdpa_flash": 1.0, "flex_cpu": 2.0}))
    q, k, v = _qkv()
    with pytest.warns(UserWarning, match="no tuning cache directory"):
        out = fz.attention(q, k, v, mask="causal", tune=True)
    assert_matches_reference(out, q, k, v, mask="causal")
    plan = fz.plan(q, k, v, mask="causal", tune=True)
    assert plan.tuning is not None and plan.tuning.entry is not None  # measured, kept in memory
    with pytest.raises(OSError, match=tuning_store.CACHE_DIR_ENV):
        tuning.cache_path()  # asked for by name: says what to set
    with pytest.warns(UserWarning, match="cannot clear"):
        tuning.clear()
    assert tuning.table() == {}
    assert info._tuning_summary()[1].startswith("none: no tuning cache directory")
    assert cli.main(["env"]) == 0


def test_clear_one_signature_or_all(tuned: Path) -> None:
    q, k, v = _qkv()
    one = fz.plan(q, k, v, mask="causal", tune=True).tuning
    two = fz.plan(q, k, v, mask=masks.SlidingWindow(left=3), tune=True).tuning
    assert one is not None and two is not None
    tuning.record(one.signature, _entry("flex_cpu"))
    tuning.record(two.signature, _entry("flex_cpu"))
    path = tuning.cache_path()
    assert len(json.loads(path.read_text())["entries"]) == 2
    tuning.clear(one.signature)
    assert set(tuning.table()) == {two.signature}
    assert len(json.loads(path.read_text())["entries"]) == 1
    tuning.clear()
    assert tuning.table() == {} and not path.exists()


def _write_entries(cache_dir: str, tag: str, count: int, barrier: Any) -> None:
    """One process of the concurrency test: ``count`` measurements of its own signatures."""
    os.environ[tuning_store.CACHE_DIR_ENV] = cache_dir
    from flexattn_zoo import tuning as t

    barrier.wait()
    for i in range(count):
        sig = t.Signature(
            device="cpu", arch="cpu", dtype="float32", head_dim=16, v_dim=16, gqa=1, batch_heads=2,
            q_len=1 << i, kv_len=1 << i, mask=f"proc_{tag}", density="1", score="none", mode="fwd",
            deterministic=False, return_lse=False,
        )  # fmt: skip
        t.record(
            sig, t.Entry(winner="sdpa_flash", static="sdpa_flash", ms=(("sdpa_flash", 1.0),), compile_s=())
        )


def test_two_processes_writing_at_once_keep_every_entry(tuned: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    count = 12
    procs = [ctx.Process(target=_write_entries, args=(str(tuned), tag, count, barrier)) for tag in "ab"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]
    rows = tuning_store.read(tuning.cache_path())
    assert rows is not None
    masks_seen = sorted((r["signature"]["mask"], r["signature"]["q_len"]) for r in rows)
    assert masks_seen == sorted((f"proc_{tag}", 1 << i) for tag in "ab" for i in range(count))
    assert len(tuning.table()) == 2 * count  # and this process reads them all


# ---- traced calls -------------------------------------------------------------------------


def test_traced_calls_read_the_table_and_never_time(tuned: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    timer = FakeTimer({"sdpa_flash": 2.0, "flex_cpu": 1.0})
    monkeypatch.setattr(tuning, "time_routes", timer)
    q, k, v = _qkv()
    fz.attention(q, k, v, mask="causal", tune=True)  # eager: measured, flex_cpu wins
    assert len(timer.calls) == 2
    _fresh_process(monkeypatch)  # a new process: the first traced call loads the file
    tuning.enable()
    graphs: list[set[str]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm

    def layer(x: torch.Tensor) -> torch.Tensor:
        return fz.attention(x, x, x, mask=masks.Causal())

    def uses_flex(targets: set[str]) -> bool:
        return any("flex_attention" in t for t in targets)

    torch._dynamo.reset()
    try:
        for dynamic in (False, True):
            torch._dynamo.reset()
            graphs.clear()
            compiled = torch.compile(layer, backend=backend, fullgraph=True, dynamic=dynamic)
            out = compiled(q)
            assert len(graphs) == 1 and uses_flex(graphs[0])  # the measured winner
            assert_matches_reference(out, q, q, q, mask="causal")
            longer = torch.randn(1, 2, 200, 16)  # another length bucket: never measured
            out = compiled(longer)
            assert not uses_flex(graphs[-1])  # the static order
            assert_matches_reference(out, longer, longer, longer, mask="causal")
        torch._dynamo.reset()
        explained = torch._dynamo.explain(layer)(q)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        assert len(timer.calls) == 2  # nothing was timed while traced
        torch._dynamo.reset()
        graphs.clear()
        compiled = torch.compile(layer, backend=backend, fullgraph=True)
        compiled(q)
        assert len(graphs) == 1 and uses_flex(graphs[0])
        tuning.clear()  # the table changed: the graph traced before must not keep the old winner
        compiled(q)
        assert len(graphs) == 2 and not uses_flex(graphs[1])
        assert len(timer.calls) == 2
    finally:
        torch._dynamo.reset()


def test_a_call_that_cannot_measure_leaves_it_to_the_next(
    tuned: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As under CUDA graph capture: the static route runs, and its plan is not cached, so the
    next eager call measures."""
    timer = FakeTimer({"sdpa_flash": 2.0, "flex_cpu": 1.0})
    monkeypatch.setattr(tuning, "time_routes", timer)
    q, k, v = _qkv()
    with monkeypatch.context() as m:
        m.setattr(tuning, "can_measure", lambda q: False)
        out = fz.attention(q, k, v, mask="causal", tune=True)
    assert timer.calls == [] and len(plan_cache.PLANS) == 0
    assert_matches_reference(out, q, k, v, mask="causal")
    fz.attention(q, k, v, mask="causal", tune=True)
    assert timer.calls == ["sdpa_flash", "flex_cpu"]
    assert fz.plan(q, k, v, mask="causal", tune=True).backend == "flex_cpu"


def test_no_room_for_the_copies_keeps_the_static_order(tuned: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(*args: Any) -> Any:
        raise torch.OutOfMemoryError("no room for the copies")

    monkeypatch.setattr(tuning, "_steps", no_memory)
    monkeypatch.setattr(tuning, "time_routes", FakeTimer({"flex_cpu": 1.0}))
    q, k, v = _qkv()
    out = fz.attention(q, k, v, mask="causal", tune=True)
    assert_matches_reference(out, q, k, v, mask="causal")
    plan = fz.plan(q, k, v, mask="causal", tune=True)
    assert plan.backend == "sdpa_flash" and plan.tuning is not None and plan.tuning.entry is not None
    assert dict(plan.tuning.entry.errors) == {"(inputs)": "OutOfMemoryError: no room for the copies"}
    assert not plan.measured and "the measurement failed ((inputs): OutOfMemoryError" in plan.explain()


def test_no_measurement_for_tensor_subclasses() -> None:
    assert tuning.can_measure(torch.zeros(1))
    assert not tuning.can_measure(torch.nn.Parameter(torch.zeros(1)))


# ---- the CLI ------------------------------------------------------------------------------

TINY = """
defaults: {dtype: fp32, device: cpu, warmup: 0, iters: 2, modes: [fwd, fwdbwd]}
cases:
  - {name: causal, batch: 1, heads: 2, seq_len: 64, head_dim: 16, mask: {name: causal}}
"""


def test_tune_cli_on_a_tiny_config(tuned: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    timer = FakeTimer({"sdpa_flash": 1.0, "flex_cpu": 3.0})
    monkeypatch.setattr(tuning, "time_routes", timer)
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    out = tmp_path / "tune.json"
    assert cli.main(["tune", str(config), "--out", str(out), "--quiet"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"], r["mode"], r["status"]) for r in rows] == [
        ("causal", "fwd", "ok"),
        ("causal", "fwdbwd", "ok"),
    ]
    fwd, fwdbwd = rows
    assert (
        fwd["route"] == "sdpa_flash" and fwd["measured"] and fwd["ms"] == {"sdpa_flash": 1.0, "flex_cpu": 3.0}
    )
    assert fwd["compile_s"] == pytest.approx(
        {"sdpa_flash": 0.249, "flex_cpu": 0.247}
    )  # first call less a step
    assert fwd["signature"]["mask"] == "causal" and fwd["signature"]["q_len"] == 64
    assert fwdbwd["candidates"] == ["sdpa_flash"] and fwdbwd["ms"] == {}  # one route: nothing to time
    assert timer.calls == ["sdpa_flash", "flex_cpu"]
    assert tuning.cache_path().is_file()
    md = tmp_path / "tune.md"
    assert cli.main(["tune", str(config), "--out", str(md), "--quiet", "--modes", "fwd"]) == 0
    assert timer.calls == ["sdpa_flash", "flex_cpu"]  # read from the cache
    text = md.read_text()
    assert "| causal | fwd |" in text and "sdpa_flash 1, flex_cpu 3" in text
    assert cli.main(["tune", str(config), "--quiet", "--modes", "fwd", "--force", "--reps", "3"]) == 0
    assert timer.calls[2:] == ["sdpa_flash", "flex_cpu"]  # measured again
    assert cli.main(["tune", str(config), "--modes", "sideways"]) == 2


def test_plan_cli_reads_this_machines_measurements_when_tuning_is_on(
    tuned: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The static order puts sdpa_flash first for this problem; the measurement says flex_cpu.
    monkeypatch.setattr(tuning, "time_routes", FakeTimer({"sdpa_flash": 2.0, "flex_cpu": 1.0}))
    q, k, v = _qkv()
    fz.attention(q, k, v, mask="causal", tune=True)
    _fresh_process(monkeypatch)  # another process: the CLI reads the file
    args = ["plan", "--mask", "causal", "--len", "64", "--heads", "2", "--dim", "16", "--dtype", "fp32"]
    args += ["--arch", "cpu"]

    def route(*extra: str) -> str:
        capsys.readouterr()
        assert cli.main([*args, *extra]) == 0
        return capsys.readouterr().out.splitlines()[0]

    assert "route: sdpa_flash" in route()  # tuning off (FLEXATTN_ZOO_TUNE unset)
    assert "route: flex_cpu" in route("--tune")
    monkeypatch.setenv(tuning.TUNE_ENV, "1")
    assert "route: flex_cpu" in route()
    assert "route: sdpa_flash" in route("--no-tune")
    capsys.readouterr()
    assert cli.main([*args[:-2], "--arch", "sm90", "--tune"]) == 2  # another machine's plan
    assert "--tune reads this machine's measurements" in capsys.readouterr().err


def test_tune_cli_no_save_writes_nothing(
    tuned: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tuning, "time_routes", FakeTimer({"sdpa_flash": 1.0, "flex_cpu": 3.0}))
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    assert cli.main(["tune", str(config), "--modes", "fwd", "--no-save", "--quiet"]) == 0
    assert not tuned.exists()
    assert tuning.settings().persist  # restored


class FakeClock:
    """``time.perf_counter`` that advances only when a fake step runs; ``log`` lists the steps run."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 0.0
        self.log: list[str] = []
        monkeypatch.setattr(timing.time, "perf_counter", lambda: self.now)

    def step(
        self, name: str, seconds: Callable[[float], float], fail_after: int | None = None
    ) -> Callable[[], None]:
        """A step named ``name`` taking ``seconds(now)``; after ``fail_after`` calls it raises."""

        def run() -> None:
            if fail_after is not None and self.log.count(name) >= fail_after:
                raise RuntimeError(f"{name} broke")
            self.log.append(name)
            self.now += seconds(self.now)

        return run


CPU = torch.device("cpu")


def _ms(result: tuple[float, float] | Exception) -> float:
    assert not isinstance(result, Exception), result
    return result[0]


def test_time_routes_counts_are_minimums_filled_to_a_duration(monkeypatch: pytest.MonkeyPatch) -> None:
    """A short call is warmed for MIN_WARMUP_S and timed over MIN_TIMED_S (at most MAX_REPS calls);
    a long one keeps the configured counts."""
    clock = FakeClock(monkeypatch)
    out = tuning.time_routes({"short": clock.step("short", lambda t: 1e-4)}, CPU, warmup=2, reps=10)
    assert out["short"] == (pytest.approx(0.1), pytest.approx(1e-4))
    warm = len(clock.log) - 1 - timing.MAX_REPS  # 0.1 ms calls: MIN_TIMED_S would need more than the cap
    assert int(timing.MIN_WARMUP_S / 1e-4) <= warm <= 2 * int(timing.MIN_WARMUP_S / 1e-4) + 2
    clock.log.clear()
    out = tuning.time_routes({"long": clock.step("long", lambda t: 1.0)}, CPU, warmup=2, reps=5)
    # the first call, the warm-up's lone first call and its batch of 1, the 5 timed calls
    assert _ms(out["long"]) == pytest.approx(1000.0) and len(clock.log) == 1 + 1 + 1 + 5


def test_one_time_work_after_the_first_call_does_not_cut_the_timed_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 0.1 ms call whose second call does 50 ms of one-time work (SDPA's decoding route builds
    cuDNN's plan for the shape on its second call) is still a short call: timed over MIN_TIMED_S
    (at most MAX_REPS calls), not over the handful of calls a 25 ms call would get."""
    clock = FakeClock(monkeypatch)
    calls = [0]

    def seconds(now: float) -> float:
        calls[0] += 1
        return 0.05 if calls[0] == 2 else 1e-4

    out = tuning.time_routes({"decode": clock.step("decode", seconds)}, CPU, warmup=2, reps=10)
    assert _ms(out["decode"]) == pytest.approx(0.1)
    warm = 1 + 1  # the warm-up's lone first call (50 ms, past MIN_WARMUP_S) and one more
    assert len(clock.log) == 1 + warm + timing.MAX_REPS


def test_time_routes_interleaves_so_drift_moves_every_route_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two routes of equal cost on a host that slows down while they are timed (each call takes
    longer the later it runs): timed one after the other, the first looks faster by the drift over
    its whole measurement; in rotated rounds both see the same drift."""
    clock = FakeClock(monkeypatch)

    def drifting(t: float) -> float:
        return 1e-3 * (1 + 5 * t)

    steps = {"a": clock.step("a", drifting), "b": clock.step("b", drifting)}
    out = tuning.time_routes(steps, CPU, warmup=0, reps=10)
    a, b = _ms(out["a"]), _ms(out["b"])
    assert max(a, b) / min(a, b) < 1.05, (a, b)
    # Runs of one route's calls: its first call and warm-up (a, then b), then the rounds, each
    # starting with the route the last one ended with (a b | b a | a b ...), so runs merge.
    runs = [name for i, name in enumerate(clock.log) if i == 0 or clock.log[i - 1] != name]
    assert runs == ["a", "b"] + [("a", "b")[r % 2] for r in range(timing.ROUNDS + 1)], runs
    # the same routes timed one after the other: the drift decides
    first = _ms(tuning.time_routes({"a": steps["a"]}, CPU, warmup=0, reps=10)["a"])
    second = _ms(tuning.time_routes({"b": steps["b"]}, CPU, warmup=0, reps=10)["b"])
    assert second / first > 1.15, (first, second)


def test_time_routes_drops_a_failing_route_and_times_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(monkeypatch)
    steps = {
        "first_call": clock.step("first_call", lambda t: 1e-3, fail_after=0),
        "later": clock.step("later", lambda t: 1e-3, fail_after=40),  # past warm-up: in a timed round
        "ok": clock.step("ok", lambda t: 2e-3),
    }
    out = tuning.time_routes(steps, CPU, warmup=2, reps=10)
    assert list(out) == ["first_call", "later", "ok"]
    assert [str(out[n]) for n in ("first_call", "later")] == ["first_call broke", "later broke"]
    assert _ms(out["ok"]) == pytest.approx(2.0)


def test_the_routes_revision_is_part_of_the_environment_key() -> None:
    """Timings measured while a route cost more per call (the fa4 route before its launches were
    replayed) must not choose routes after: the revision starts a fresh file."""
    env = tuning_store.environment("cpu")
    assert env["routes"] == tuning_store.ROUTES_REVISION >= 2
    older = {**env, "routes": tuning_store.ROUTES_REVISION - 1}
    assert tuning_store.env_hash(older) != tuning_store.env_hash(env)
