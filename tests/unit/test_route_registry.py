"""Every registered route declares its facts in one place, and the order table (``arch.PRIORITY``)
names exactly the registered routes that ``backend="auto"`` may pick."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flexattn_zoo import _compat, masks, score_mods
from flexattn_zoo.arch import PRIORITY, ROCM, RULES, ordered_routes, parse_arch
from flexattn_zoo.backends import BACKENDS, BY_NAME
from flexattn_zoo.backends.base import FLOATS, Backend, Requirement
from flexattn_zoo.backends.dense import DENSE_LIMIT_ENV
from flexattn_zoo.backends.flex import FLEX, FLEX_CPU, FLEX_FLASH, FlexBackend
from flexattn_zoo.dispatch import Problem
from flexattn_zoo.plan_cache import ENV_VARS, REQUIREMENTS, process_state

ORDERED = frozenset().union(*(ordered_routes(gen) for gen in PRIORITY))


def test_names_are_unique_and_indexed() -> None:
    names = [b.name for b in BACKENDS]
    assert len(names) == len(set(names))
    assert list(BY_NAME) == names and all(BY_NAME[b.name] is b for b in BACKENDS)


@pytest.mark.parametrize("route", BACKENDS, ids=lambda b: b.name)
def test_route_declares_its_facts(route: Backend) -> None:
    assert route.name.isidentifier() and route.name != "auto"
    assert route.doc
    # capabilities
    assert route.devices and route.devices <= {"cpu", "cuda"}
    assert route.dtypes and route.dtypes <= FLOATS
    lo, hi = route.head_dims
    assert 1 <= lo <= hi and route.head_dim_multiple >= 1
    for cc in (route.min_cc, route.max_cc):
        assert cc is None or (isinstance(cc, tuple) and len(cc) == 2)
    assert route.deterministic or route.nondeterministic_why
    assert type(route).run is not Backend.run
    # decode, auto and materializes flags
    assert isinstance(route.decode, bool) and isinstance(route.auto, bool)
    assert isinstance(route.materializes, bool)
    # what it needs installed and what it reads from the process (both reach the plan cache's key)
    assert isinstance(route.requires, tuple) and isinstance(route.env_vars, tuple)
    assert all(
        isinstance(r, Requirement) and r.missing and isinstance(r.check(), bool) for r in route.requires
    )
    assert route.unavailable_reasons() == [r.missing for r in route.requires if not r.check()]
    assert set(route.requires) <= set(REQUIREMENTS)
    assert all(name.startswith("FLEXATTN_ZOO_") and name in ENV_VARS for name in route.env_vars)


def test_order_table_names_only_registered_routes() -> None:
    assert ORDERED <= set(BY_NAME), ORDERED - set(BY_NAME)
    for rule in RULES:
        assert rule.generation in PRIORITY and rule.modes and rule.front and rule.why and rule.evidence
        for mode in rule.modes:
            assert set(rule.front) <= set(PRIORITY[rule.generation][mode]), (
                rule.generation,
                mode,
                rule.front,
            )


def test_routes_that_materialize_scores_come_last() -> None:
    """Every order, with every override applied, tries the routes that hold ``Lq x Lkv`` scores
    after all others (measured route choice keeps that: it times one only where it is chosen)."""
    assert {b.name for b in BACKENDS if b.materializes} == {"dense", "sdpa_math"}
    for gen, modes in PRIORITY.items():
        for mode, order in modes.items():
            for rule in RULES:
                if rule.generation == gen and mode in rule.modes:
                    order = rule.front + tuple(r for r in order if r not in rule.front)
            flags = [BY_NAME[name].materializes for name in order]
            assert flags == sorted(flags), (gen, mode, order)


def test_every_auto_route_is_in_the_order_table() -> None:
    """A route is picked by "auto" somewhere, or says it never is (``auto=False``: debug routes)."""
    for b in BACKENDS:
        assert (b.name in ORDERED) == b.auto, (
            f"{b.name}: auto={b.auto}, in the order table: {b.name in ORDERED}"
        )


@pytest.mark.parametrize("gen", list(PRIORITY))
def test_order_lists_routes_that_can_run_there(gen: str) -> None:
    assert set(PRIORITY[gen]) == {"fwd", "fwdbwd"}
    device = "cpu" if gen == "cpu" else "cuda"
    cc = parse_arch(gen)
    for mode, order in PRIORITY[gen].items():
        assert len(order) == len(set(order)), (gen, mode)
        for name in order:
            b = BY_NAME[name]
            assert device in b.devices, (gen, name)
            assert cc is None or b.min_cc is None or cc >= b.min_cc, (gen, name)
            assert cc is None or b.max_cc is None or cc <= b.max_cc, (gen, name)
            assert mode == "fwd" or b.backward, (gen, mode, name)
            assert gen != ROCM or b.rocm, (gen, name)


def test_plan_cache_asks_every_route(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DENSE_LIMIT_ENV in ENV_VARS
    before = process_state()
    with monkeypatch.context() as m:
        m.setenv(DENSE_LIMIT_ENV, "7")
        assert process_state() != before
    assert process_state() == before
    now = _compat.flash_cute_available()
    monkeypatch.setattr(_compat, "flash_cute_available", lambda: not now)
    assert process_state() != before
    assert bool(FLEX_FLASH.unavailable_reasons()) == now


def test_decode_routes_are_the_routes_that_declare_it() -> None:
    from flexattn_zoo.models.decode import DECODE_ROUTES

    assert DECODE_ROUTES == ("auto", *(b.name for b in BACKENDS if b.decode))
    assert set(DECODE_ROUTES) == {"auto", "flex", "flex_cpu", "dense"}  # flex_flash cannot run decode masks


def test_bench_route_lists_follow_the_registry() -> None:
    from flexattn_zoo.bench.config import EXTRA_ROUTES, all_routes
    from flexattn_zoo.bench.routes import BLOCKMASK_ROUTES

    assert all_routes() == ["auto", *BY_NAME, *EXTRA_ROUTES]
    assert (
        BLOCKMASK_ROUTES
        == {b.name for b in BACKENDS if isinstance(b, FlexBackend)}
        == {"flex", "flex_flash", "flex_cpu"}
    )


def _p(arch: str, d: int = 128, dtype: torch.dtype = torch.bfloat16) -> Problem:
    return Problem(
        batch=1,
        heads=2,
        kv_heads=2,
        q_len=256,
        kv_len=256,
        head_dim=d,
        dtype=dtype,
        device_type="cuda",
        arch=arch,
        requires_grad=False,
    )


def test_flex_kernel_options_live_with_the_route() -> None:
    tiles = {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 3}
    assert FLEX.tuned_options(_p("sm90")) == tiles
    assert FLEX.tuned_options(_p("sm90", dtype=torch.float16)) == tiles
    assert FLEX.options(_p("sm90")) == tiles
    for p in (_p("sm80"), _p("sm100"), _p("sm90", d=64), _p("sm90", dtype=torch.float32)):
        assert FLEX.tuned_options(p) == {}
    assert FLEX_FLASH.options(_p("sm90")) == {"BACKEND": "FLASH"}  # the tiles are Triton's
    assert FLEX_CPU.tuned_options(_p("sm90")) == {}


def test_pinned_tiles_skip_very_sparse_masks_and_activation_attention() -> None:
    # Measured on the H200 (flexattn_zoo.backends.flex._default_tiles_faster): torch's default
    # forward tiles win there, so the route passes none of the pinned ones.
    base = _p("sm90")
    window = masks.SlidingWindow(left=7)  # 8 keys of 256: ~3% visible
    assert window.bind(256, 256).visible_fraction(256, 256) < 1 / 16
    wide = masks.SlidingWindow(left=63)  # 64 keys of 256: 25%
    assert FLEX.options(dataclasses.replace(base, mask=window)) is None
    assert FLEX.options(dataclasses.replace(base, mask=wide))["fwd_BLOCK_M"] == 128  # type: ignore[index]
    assert FLEX.options(dataclasses.replace(base, score=score_mods.Sigmoid(), return_lse=True)) is None
    assert FLEX.options(dataclasses.replace(base, score=score_mods.SoftCap(cap=30.0)))["fwd_BLOCK_N"] == 128  # type: ignore[index]
