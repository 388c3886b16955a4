"""Soak, CPU form: many threads, many random calls, small caches, buffers rewritten in place between calls.

The machinery (the four kinds of call, the checks, the rounds, the memory samples) lives in
``tests/soak_harness.py``, shared with the GPU form (``tests/gpu/test_soak_gpu.py``); its
docstring says what each call does. Every result is compared with the float64 reference (or, for
BlockMasks, with the spec's dense oracle at block level), so a cache that ever serves an entry for
another value -- a stale BlockMask after an in-place write, a spec mistaken for one with a
colliding hash, an entry torn by a concurrent eviction -- fails here. The caches are shrunk
(monkeypatched) so eviction happens all the time under load.

CPU form: ``doc`` and ``closure`` calls run on ``flex_cpu``; registry specs (a random example of
every registered mask and score spec per call) run on the ``dense`` route and reach the BlockMask
cache through ``block_mask`` calls. Shapes come from fixed buckets so the compiled kernels stay
bounded: both forms compile three flex kernels (document, document & causal, the closure) at one
shape (``auto`` on the CPU would compile one kernel per spec value and length: every window size
is baked into its kernel).

Memory: resident set size (``/proc/self/statm``) is sampled after every round; after the warm-up
rounds (which compile kernels and fill the caches to their bounds) it must stay within a bound
(see ``RSS_GROWTH_BOUND_MB``). ``test_soak_short`` runs in CI (< 60 s on 2 cores);
``test_soak_long`` is marked ``slow``. Both print their numbers (``-s`` shows them).

``test_soak_gpu_form_rehearsed_on_cpu`` (``slow``) runs the GPU form's code (a fixed pool of
registry specs, the coverage round, persistent threads, named routes checked with ``fz.plan``
falling back to ``auto``, the report and its JSON summary) on the CPU at a small size, with fake
device-memory samples, so that code stays exercised on machines without a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import soak_harness  # tests/soak_harness.py (tests/ is on sys.path via conftest)
import torch
from soak_harness import RSS_GROWTH_BOUND_MB, SoakConfig, growth, report, run_soak


def test_soak_short(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = SoakConfig(
        threads=4,
        rounds=7,
        warmup_rounds=2,
        calls_per_round=12,
        lengths=(16, 48, 128, 200),
        flex_length=256,
        batches=(1, 2),
        registry_routes=("dense",),
        seed=1,
    )
    stats = run_soak(cfg, monkeypatch)
    report("soak (short)", cfg, stats)
    assert sum(stats.calls.values()) == cfg.threads * cfg.rounds * cfg.calls_per_round
    assert growth(stats.rss, cfg.warmup_rounds) < RSS_GROWTH_BOUND_MB


@pytest.mark.slow
def test_soak_long(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = SoakConfig(
        threads=8,
        rounds=30,
        warmup_rounds=3,
        calls_per_round=60,
        lengths=(16, 48, 64, 128, 200, 256),
        flex_length=256,
        batches=(1, 2),
        registry_routes=("dense",),
        seed=2,
    )
    stats = run_soak(cfg, monkeypatch)
    report("soak (long)", cfg, stats)
    assert growth(stats.rss, cfg.warmup_rounds) < RSS_GROWTH_BOUND_MB


@pytest.mark.slow
def test_soak_gpu_form_rehearsed_on_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    samples = iter(range(1000))

    def fake_device_memory(device: str) -> tuple[float, float, float]:
        n = next(samples)
        return 100.0 + (n % 3) * 0.25, 200.0, 300.0 + n

    monkeypatch.setattr(soak_harness, "device_memory_mb", fake_device_memory)
    monkeypatch.setenv(soak_harness.CALLS_ENV, "96")
    monkeypatch.delenv(soak_harness.STREAMS_ENV, raising=False)
    monkeypatch.setenv(soak_harness.SUMMARY_ENV, str(tmp_path / "soak.json"))
    # The GPU form's named CUDA routes refuse on the CPU (auto runs instead); dense accepts.
    routes = {
        "doc": ("auto", "flex", "dense"),
        "closure": ("auto", "flex"),
        "registry": ("auto", "flex", "dense"),
    }
    soak_harness.gpu_form_soak(
        monkeypatch,
        device="cpu",
        routes=routes,
        threads=4,
        rounds=3,
        warmup_rounds=2,
        pool_size=3,
        dtypes=(torch.float32, torch.bfloat16),
        lengths=(16, 48, 128, 200),
        flex_length=256,
        heads=2,
        head_dim=16,
    )
    summary = json.loads((tmp_path / "soak.json").read_text())
    assert summary["calls"] > 4 * 2 * 12 and len(summary["pool"]) == 3
    assert summary["device_alloc_mb"][0] == 100.0 and summary["device_max_memory_allocated_mb"] == 302.0
    assert summary["named_route_refused"].get("doc:flex", 0) > 0  # CUDA-only: auto ran instead
    assert summary["calls_by_route"].get("doc:dense", 0) > 0
    assert summary["compiles_after_round"][-1] == summary["compiles_after_round"][0]  # all in round 0


def test_the_gpu_forms_object_count_fails_on_a_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    """A round that leaves more live objects than the bound allows fails the GPU form's check."""
    leaked: list[list[int]] = []
    round_work = soak_harness._round_work

    def leaking_round_work(tid: int, cfg: soak_harness.SoakConfig, round_no: int, *args: object) -> None:
        round_work(tid, cfg, round_no, *args)
        if round_no >= cfg.warmup_rounds:  # a leak that starts after warm-up, like a slow one would
            # Lists: the collector tracks containers (what a leaked spec, plan or closure is made
            # of), not atoms such as a bare ``object()``.
            leaked.extend([i] for i in range(soak_harness.OBJECT_GROWTH_FLOOR))

    monkeypatch.setattr(soak_harness, "_round_work", leaking_round_work)
    monkeypatch.setenv(soak_harness.CALLS_ENV, "16")
    monkeypatch.delenv(soak_harness.SUMMARY_ENV, raising=False)
    with pytest.raises(AssertionError, match="Python objects grew by"):
        soak_harness.gpu_form_soak(
            monkeypatch,
            device="cpu",
            routes={"doc": ("dense",), "closure": ("dense",), "registry": ("dense",)},
            threads=2,
            rounds=3,
            warmup_rounds=2,
            pool_size=1,
            coverage=False,
            dtypes=(torch.float32,),
            lengths=(16, 48),
            flex_length=64,
            heads=1,
            head_dim=8,
        )
