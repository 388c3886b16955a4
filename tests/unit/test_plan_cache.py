"""``plan_cache.PLANS``: a repeated call reuses its plan, and nothing the plan depends on is missed.

Each test swaps in an empty cache (``monkeypatch``) and counts its ``inserts``: a hit adds none.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from learned_bias import LearnedHeadBias

import flexattn_zoo as fz
from flexattn_zoo import _compat, blockmask, dispatch, masks, plan_cache, score_mods
from flexattn_zoo.backends import BACKENDS
from flexattn_zoo.backends import flex as flex_backend
from flexattn_zoo.lru import LRUCache
from flexattn_zoo.problem import Problem
from flexattn_zoo.registry import MASKS
from flexattn_zoo.testing import assert_matches_reference


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> LRUCache:
    fresh: LRUCache = LRUCache(16)
    monkeypatch.setattr(plan_cache, "PLANS", fresh)
    return fresh


def _stored(cache: LRUCache) -> list:
    """Every plan in ``cache`` (those kept per NaN/inf verdict included)."""
    out = []
    for entry in cache.values():
        out += list(entry.plans.values()) if isinstance(entry, plan_cache.ByFiniteness) else [entry]
    return [bound.plan for bound in out]


def _qkv(length: int = 64, seed: int = 0, grad: bool = False) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 2, length, 16, generator=g).requires_grad_(grad) for _ in range(3))


def test_repeat_call_hits_and_matches_reference(plans: LRUCache) -> None:
    q, k, v = _qkv()
    spec = masks.SlidingWindow(left=8)
    first = fz.attention(q, k, v, mask=spec)
    assert plans.inserts == 1
    for mask in (spec, masks.SlidingWindow(left=8)):  # the same spec, and an equal new one
        again = fz.attention(q, k, v, mask=mask)
        assert torch.equal(again, first)
    assert plans.inserts == 1
    q2, k2, v2 = _qkv(seed=1)  # new values, same kind of call: the cached plan, a new result
    out = fz.attention(q2, k2, v2, mask=spec)
    assert plans.inserts == 1
    assert_matches_reference(out, q2, k2, v2, mask=spec)


def test_key_changes_replan(plans: LRUCache) -> None:
    q, k, v = _qkv(grad=True)
    fz.attention(q, k, v, mask="causal")
    with torch.no_grad():  # fwd instead of fwdbwd
        fz.attention(q, k, v, mask="causal")
    fz.attention(q, k, v, mask="causal", return_lse=False, backend="sdpa_math")
    fz.attention(q.detach().transpose(2, 3).contiguous().transpose(2, 3), k, v, mask="causal")  # strides
    fz.attention(*_qkv(length=96), mask="causal")  # shape
    assert plans.inserts == 5
    assert {p.problem.mode for p in _stored(plans)} == {"fwd", "fwdbwd"}


def test_registry_change_is_seen(plans: LRUCache) -> None:
    q, k, v = _qkv()
    MASKS.register_function("plan_cache_probe", lambda b, h, i, j: j <= i)
    try:
        first = fz.attention(q, k, v, mask="plan_cache_probe")
        assert_matches_reference(first, q, k, v, mask="causal")
        MASKS.unregister("plan_cache_probe")
        MASKS.register_function("plan_cache_probe", lambda b, h, i, j: (j <= i) & (i - j <= 3))  # same name
        out = fz.attention(q, k, v, mask="plan_cache_probe")
        assert_matches_reference(out, q, k, v, mask=masks.SlidingWindow(left=3))
        assert not torch.allclose(out, first)
    finally:
        MASKS.unregister("plan_cache_probe")


def test_environment_is_seen(plans: LRUCache, monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(1, 4, 512, 16)
    assert fz.attention(q, q, q, mask=masks.SlidingWindow(left=8), backend="dense") is not None
    monkeypatch.setenv("FLEXATTN_ZOO_DENSE_LIMIT_MB", "1")
    with pytest.raises(ValueError, match="would materialize"):
        fz.attention(q, q, q, mask=masks.SlidingWindow(left=8), backend="dense")


def test_invalid_arguments_still_raise_after_a_hit(plans: LRUCache) -> None:
    q, k, v = _qkv()
    kv = k[:, :1], v[:, :1]
    fz.attention(q, *kv, mask="causal", enable_gqa=True)
    with pytest.raises(TypeError, match="enable_gqa"):
        fz.attention(q, *kv, mask="causal", enable_gqa=1)
    with pytest.raises(TypeError, match="deterministic"):
        fz.attention(q, *kv, mask="causal", enable_gqa=True, deterministic=1)
    with pytest.raises(TypeError, match="backend"):
        fz.attention(q, *kv, mask="causal", enable_gqa=True, backend=None)


def test_nonfinite_inputs_are_not_served_a_finite_plan(plans: LRUCache) -> None:
    q, k, v = _qkv()
    fz.attention(q, k, v, mask="causal", backend="flex_cpu")
    bad = q.clone()
    bad[0, 0, 3, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        fz.attention(bad, k, v, mask="causal", backend="flex_cpu")


def test_block_mask_calls_bypass(plans: LRUCache) -> None:
    q, k, v = _qkv()
    bm = fz.block_mask("causal", 64, 64)
    out = fz.attention(q, k, v, mask=bm, backend="flex_cpu")
    assert plans.inserts == 0
    assert_matches_reference(out, q, k, v, mask="causal")


def test_flex_calls_prepared_once(plans: LRUCache, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: LRUCache = LRUCache(4)
    monkeypatch.setattr(flex_backend, "CALLS", calls)
    q, k, v = _qkv()
    spec = masks.Document.from_lengths([20, 44]) & masks.Causal()
    with torch.no_grad():
        outs = [fz.attention(q, k, v, mask=spec, backend="flex_cpu") for _ in range(3)]
    assert calls.inserts == 1
    for out in outs:
        assert_matches_reference(out, q, k, v, mask=spec)


def test_a_flex_hit_looks_nothing_up_in_the_compile_cache_nor_reads_dynamos_config(
    plans: LRUCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repeated flex call runs its held compiled entry: no compile-cache lookup and no read of
    Dynamo's recompile limit per call (each cost host time on every call); the entry is looked
    up again only once it is retired."""
    from flexattn_zoo.compile import CACHE

    monkeypatch.setattr(flex_backend, "CALLS", LRUCache(4))
    q, k, v = _qkv()
    spec = masks.SlidingWindow(left=11, right=0)
    with torch.no_grad():
        fz.attention(q, k, v, mask=spec, backend="flex_cpu")
        counts = {"get_keyed": 0, "recompile_limit": 0}
        get_keyed, limit = CACHE.get_keyed, _compat.recompile_limit

        def counted_get_keyed(*args, **kwargs):  # type: ignore[no-untyped-def]
            counts["get_keyed"] += 1
            return get_keyed(*args, **kwargs)

        def counted_limit() -> int:
            counts["recompile_limit"] += 1
            return limit()

        monkeypatch.setattr(CACHE, "get_keyed", counted_get_keyed)
        monkeypatch.setattr(_compat, "recompile_limit", counted_limit)
        for _ in range(3):
            out = fz.attention(q, k, v, mask=spec, backend="flex_cpu")
        assert counts == {"get_keyed": 0, "recompile_limit": 0}
        assert_matches_reference(out, q, k, v, mask=spec)
        (call,) = flex_backend.CALLS.values()
        entry = call.held[0]
        entry.retired = True  # as its last compile does one graph short of the limit
        fz.attention(q, k, v, mask=spec, backend="flex_cpu")
    assert counts["get_keyed"] == 1


def test_an_sdpa_hit_asks_whether_it_is_traced_only_in_the_dispatcher(
    plans: LRUCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan cache's bound call runs only eagerly, so a repeated SDPA call does not ask again
    per tensor and per launch whether torch.compile traces it (each ask cost host time on CUDA,
    where the layout check asks once per q, k and v): the dispatcher asks, once; the cache lookup
    after it does not ask again."""
    q, k, v = _qkv()
    fz.attention(q, k, v, mask="causal", backend="sdpa_flash")
    asked = {"n": 0}
    real = _compat.is_compiling

    def counted() -> bool:
        asked["n"] += 1
        return real()

    monkeypatch.setattr(_compat, "is_compiling", counted)
    inserts = plans.inserts
    out = fz.attention(q, k, v, mask="causal", backend="sdpa_flash")
    assert plans.inserts == inserts  # a hit
    assert asked["n"] == 1, asked  # dispatch.attention alone
    assert_matches_reference(out, q, k, v, mask="causal")


def test_equal_learned_tensors_keep_their_own_gradients(plans: LRUCache) -> None:
    """Two layers whose learned biases start equal (zeros) are different parameters: each gets
    its own gradient, although every cache (mods, plans) keys by spec."""
    q = torch.randn(1, 2, 32, 16, requires_grad=True)
    first, second = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    assert LearnedHeadBias(bias=first) != LearnedHeadBias(bias=second)
    assert LearnedHeadBias(bias=first) == LearnedHeadBias(bias=first)
    for bias in (first, second):
        out = fz.attention(q, q, q, mask="causal", score_mod=LearnedHeadBias(bias=bias), backend="dense")
        out.square().sum().backward()
    assert first.grad is not None and second.grad is not None
    assert torch.allclose(first.grad, second.grad) and first.grad.abs().sum() > 0


# ---- host-cost shortcuts of the hit path: each must still see what it stands for ----------------


def test_environment_reads_follow_every_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """``process_state`` reads the environment through CPython's dict behind ``os.environ``
    (cheaper than ``os.environ.get``): direct writes and deletions, ``monkeypatch``, and an
    ``os.environ`` replaced by another mapping are all seen."""
    import os

    name = plan_cache.ENV_VARS[-1]
    monkeypatch.delenv(name, raising=False)
    before = plan_cache.process_state()
    os.environ[name] = "7"
    try:
        seven = plan_cache.process_state()
        assert seven != before
        os.environ[name] = "8"
        assert plan_cache.process_state() not in (before, seven)
    finally:
        del os.environ[name]
    assert plan_cache.process_state() == before
    monkeypatch.setenv(name, "7")
    assert plan_cache.process_state() == seven
    monkeypatch.setattr(os, "environ", {**os.environ, name: "9"})
    assert plan_cache.process_state() not in (before, seven)


def test_score_spec_in_grad_mode_hits(plans: LRUCache) -> None:
    """Grad mode on, inputs without grad (inference without no_grad): a score spec's call is
    cached too (its mode is read from the spec's tensors per call)."""
    q, k, v = _qkv()
    outs = [fz.attention(q, k, v, mask="causal", score_mod=score_mods.SoftCap(cap=20.0)) for _ in range(3)]
    assert plans.inserts == 1
    for out in outs:
        assert_matches_reference(out, q, k, v, mask="causal", score_mod=score_mods.SoftCap(cap=20.0))


def test_learned_tensor_requires_grad_is_seen(plans: LRUCache) -> None:
    """A score spec's learned tensor decides the mode of a call whose inputs need no grad; turning
    its requires_grad off (the spec keeps the tensor itself) must replan, not reuse fwdbwd."""
    q, k, v = _qkv()
    bias = torch.zeros(2, requires_grad=True)
    spec = LearnedHeadBias(bias=bias)
    assert fz.attention(q, k, v, mask="causal", score_mod=spec).requires_grad
    assert fz.attention(q, k, v, mask="causal", score_mod=spec).requires_grad
    assert plans.inserts == 1
    bias.requires_grad_(False)
    assert not fz.attention(q, k, v, mask="causal", score_mod=spec).requires_grad
    assert plans.inserts == 2
    assert {p.problem.mode for p in _stored(plans)} == {"fwd", "fwdbwd"}


def test_raw_score_callable_capturing_a_learned_tensor_is_seen(plans: LRUCache) -> None:
    q, k, v = _qkv()
    bias = torch.zeros(2, requires_grad=True)

    def head_bias(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return score + bias[h]

    assert fz.attention(q, k, v, mask="causal", score_mod=head_bias).requires_grad
    bias.requires_grad_(False)
    assert not fz.attention(q, k, v, mask="causal", score_mod=head_bias).requires_grad
    assert plans.inserts == 2


def test_route_blind_to_nan_skips_the_scan(plans: LRUCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only flex_cpu reads whether q/k/v hold NaN/inf: a call routed where that cannot matter
    (SDPA, causal) is served without scanning the inputs, and NaN still propagates as documented."""
    q, k, v = _qkv()
    fz.attention(q, k, v, mask="causal")
    scans: list[int] = []
    monkeypatch.setattr(plan_cache, "inputs_nonfinite", lambda *a: scans.append(1) or False)
    bad = q.clone()
    bad[0, 0, 3, 0] = float("nan")
    out = fz.attention(bad, k, v, mask="causal")
    assert scans == [] and plans.inserts == 1
    assert torch.isnan(out[0, 0, 3]).all() and not torch.isnan(out[0, 1]).any()


def test_route_reading_nan_scans_every_hit(plans: LRUCache) -> None:
    """Sliding windows go to flex_cpu, which refuses NaN inputs: both verdicts keep their own plan
    under one key, and every call is routed by its own inputs."""
    q, k, v = _qkv()
    spec = masks.SlidingWindow(left=8)
    bad = q.clone()
    bad[0, 0, 3, 0] = float("nan")
    first = fz.attention(q, k, v, mask=spec)
    for _ in range(2):
        out = fz.attention(bad, k, v, mask=spec)
        assert torch.isnan(out[0, 0, 3]).all() and not torch.isnan(out[0, 1]).any()
        assert torch.equal(fz.attention(q, k, v, mask=spec), first)
    assert plans.inserts == 1
    (entry,) = plans.values()
    assert isinstance(entry, plan_cache.ByFiniteness)
    assert {nonfinite: b.plan.backend for nonfinite, b in entry.plans.items()} == {
        False: "flex_cpu",
        True: "dense",
    }


def test_planning_a_route_blind_to_nan_skips_the_scan(
    plans: LRUCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call that misses the cache (a growing KV cache: a new length every step) is planned
    without reading q/k/v where no route that refuses NaN/inf comes at or before the route it
    takes (the scan reads every element, several times the kernel of a short decode step)."""
    scans: list[int] = []
    real = dispatch.inputs_nonfinite
    monkeypatch.setattr(dispatch, "inputs_nonfinite", lambda *a: scans.append(1) or real(*a))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 1, 16, generator=g)
    cache = torch.randn(2, 1, 2, 96, 16, generator=g)
    cache[0, 0, 0, 50, 0] = float("nan")  # a key the step at length 51 on sees
    for length in range(40, 60):
        k, v = cache[0, :, :, :length], cache[1, :, :, :length]
        out = fz.attention(q, k, v)
        if length > 50:  # the NaN key is in head 0: that head's row is NaN, the other exact
            assert torch.isnan(out[0, 0]).all() and not torch.isnan(out[0, 1]).any(), length
        else:
            assert_matches_reference(out, q, k, v)
    assert scans == [] and plans.inserts == 20
    assert {p.backend for p in _stored(plans)} == {"sdpa_flash"}


def test_planning_a_route_that_reads_nan_scans_and_routes_around_it(plans: LRUCache) -> None:
    """Where a route that refuses NaN/inf would be taken (flex_cpu for sliding windows), a call
    planned anew is scanned: NaN inputs are planned onto a route that propagates them, and
    every new shape is routed by its own inputs."""
    spec = masks.SlidingWindow(left=8)
    for length in (48, 56):
        q, k, v = _qkv(length)
        bad = q.clone()
        bad[0, 0, 3, 0] = float("nan")
        out = fz.attention(bad, k, v, mask=spec)  # planned with NaN first
        assert torch.isnan(out[0, 0, 3]).all() and not torch.isnan(out[0, 1]).any()
        assert_matches_reference(fz.attention(q, k, v, mask=spec), q, k, v, mask=spec)
    routes = sorted((p.problem.q_len, p.problem.nonfinite, p.backend) for p in _stored(plans))
    assert routes == [
        (48, False, "flex_cpu"),
        (48, True, "dense"),
        (56, False, "flex_cpu"),
        (56, True, "dense"),
    ]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize(
    "mask",
    [None, masks.Causal(), masks.SlidingWindow(left=8), masks.PrefixLM(prefix_len=5), masks.Chunked(size=16)],
    ids=["none", "causal", "window", "prefix", "chunked"],
)
def test_only_routes_declaring_it_read_finiteness(mask, device: str) -> None:  # type: ignore[no-untyped-def]
    """``Backend.reads_finiteness`` is what lets a call skip the NaN/inf scan: every route whose
    verdict on a problem changes with ``Problem.nonfinite`` must declare it."""
    for arch, dtype in (("cpu", torch.float32), ("sm90", torch.bfloat16), ("sm80", torch.float16)):
        if (device == "cpu") != (arch == "cpu"):
            continue
        for grad in (False, True):
            p = Problem(
                batch=2, heads=4, kv_heads=4, q_len=64, kv_len=64, head_dim=64, v_dim=64, dtype=dtype,
                device_type=device, arch=arch, requires_grad=grad, mask=mask, score=None,
                return_lse=False, user_block_mask=False, deterministic=False, nonfinite=False,
                index_extent=2 * 4 * 64 * 64, nonpositive_scale=False, kernel_options=None, dropout_p=0.0,
            )  # fmt: skip
            flipped = dataclasses.replace(p, nonfinite=True)
            for b in BACKENDS:
                if b.reasons(p) != b.reasons(flipped):
                    assert b.reads_finiteness, (b.name, arch, mask, grad)


def test_user_block_masks_share_prepared_calls_by_mask_mod(
    plans: LRUCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flex route keeps what it prepares for a caller's BlockMask by its mask_mod and block size
    (the BlockMask itself is passed per call): two masks of one problem never share."""
    calls: LRUCache = LRUCache(8)
    monkeypatch.setattr(flex_backend, "CALLS", calls)
    q, k, v = _qkv()
    sliding = masks.SlidingWindow(left=4)
    pairs = ((fz.block_mask("causal", 64, 64), "causal"), (fz.block_mask(sliding, 64, 64), sliding))
    with torch.no_grad():
        for _ in range(2):
            for bm, spec in pairs:
                assert_matches_reference(
                    fz.attention(q, k, v, mask=bm, backend="flex_cpu"), q, k, v, mask=spec
                )
    assert calls.inserts == 2
    assert all(call.block_mask is None for call in calls.values())


def test_spec_tensor_list_is_cached_but_not_shared() -> None:
    doc = masks.Document.from_lengths([20, 44]) & masks.Causal()
    found = doc.tensors()
    found.clear()
    assert len(doc.tensors()) == 1 and doc.tensors()[0] is doc.tensors()[0]
    import pickle

    assert "_tensors_value" not in pickle.loads(pickle.dumps(doc)).__dict__


def test_plain_keys_agree_with_spec_equality() -> None:
    """``Spec.plain_key`` (what the plan cache keys specs by) is equal exactly when the specs are:
    over every registered example, pairwise, and for specs holding tensors it is None."""
    from flexattn_zoo.testing import spec_examples

    specs = [s for _, s in spec_examples("mask", 64, 64, batch=2, heads=4)]
    specs += [s for _, s in spec_examples("score", 64, 64, batch=2, heads=4)]
    specs += [masks.SlidingWindow(left=3) & masks.Causal(), masks.Causal() & masks.SlidingWindow(left=3)]
    keyed = [s for s in specs if s.plain_key() is not None]
    assert len(keyed) >= 10
    for a in specs:
        if a.tensors():
            assert a.plain_key() is None, a
        for b in keyed:
            if a.plain_key() is not None:
                assert (a.plain_key() == b.plain_key()) == (a == b), (a, b)
    # Values that compare equal as Python numbers are equal parameters either way.
    assert masks.SlidingWindow(left=3).plain_key() == masks.SlidingWindow(left=3).plain_key()
    assert masks.SlidingWindow(left=3).plain_key() != masks.SlidingWindow(left=4).plain_key()


def test_what_a_new_spec_settles_when_built_is_what_its_first_use_works_out() -> None:
    """A spec whose parameters are plain values gets its plain key and its "no callable, no
    learned tensor" answers when built (a spec built anew for every call); they must be exactly
    what the field-by-field computations give, over every registered example."""
    import dataclasses

    from flexattn_zoo.spec import _plain
    from flexattn_zoo.testing import spec_examples

    specs = [s for _, s in spec_examples("mask", 64, 64, batch=2, heads=4)]
    specs += [s for _, s in spec_examples("score", 64, 64, batch=2, heads=4)]
    specs += [masks.SlidingWindow(left=3) & masks.Causal(), masks.Causal(), masks.SlidingWindow(left=2**40)]
    settled = 0
    for spec in specs:
        fresh = dataclasses.replace(spec)
        caches = ("_plain_key_value", "_holds_callables_value", "_holds_learned_value")
        found = {name: fresh.__dict__.get(name) for name in caches}
        settled += found["_plain_key_value"] is not None
        for name in caches:
            fresh.__dict__.pop(name, None)
        assert fresh.plain_key() == _plain(fresh), spec
        if found["_plain_key_value"] is not None:
            assert found["_plain_key_value"] == fresh.plain_key(), spec
            assert found["_holds_callables_value"] is fresh._holds_callables() is False, spec
            assert found["_holds_learned_value"] is fresh._holds_learned() is False, spec
            assert fresh.tensors() == [], spec
    assert settled >= 10


def test_a_spec_built_without_arguments_is_its_class_own_settled_value() -> None:
    """``Causal()`` built per call starts as a copy of the first such spec of its class: equal,
    its own object, and keyed by its own class, also for a subclass that inherits the spec's
    ``__init__`` (a template shared with the parent would give the subclass's instances the
    parent's plain key, so they would hit the parent's cached plans)."""

    class Tagged(masks.Causal):  # not a spec_dataclass of its own: the parent's __init__
        pass

    for first, second in ((masks.Causal(), Tagged()), (Tagged(), masks.Causal())):
        again = type(first)()
        assert again == first and again is not first and again.__dict__ == first.__dict__
        assert type(again) is type(first) and again.plain_key()[0] is type(first)
        assert second.plain_key()[0] is type(second) and second != first
    assert masks.Causal() == masks.Causal(align="top_left") and hash(masks.Causal()) == hash(
        masks.Causal(align="top_left")
    )


def test_a_spec_whose_post_init_makes_objects_is_built_anew_each_time() -> None:
    """Only a spec made of its plain fields is copied into later argument-less specs: a memo dict
    or a tensor a ``__post_init__`` makes stays each spec's own (copies would share it), one made
    under ``torch.inference_mode`` is not handed to specs built outside it, and a value read from
    the process's state is read again."""
    from flexattn_zoo.spec import MaskSpec, spec_dataclass

    @spec_dataclass
    class Slopes(MaskSpec):
        heads: int = 4

        def __post_init__(self) -> None:
            object.__setattr__(self, "_slopes", torch.arange(self.heads, dtype=torch.float32))
            object.__setattr__(self, "_memo", {})

    with torch.inference_mode():
        first = Slopes()
    second, third = Slopes(), Slopes()
    assert not second._slopes.is_inference() and not third._slopes.is_inference()
    assert second._slopes is not third._slopes and second._memo is not third._memo
    assert second == third == first

    serials = iter(range(100))

    @spec_dataclass
    class Stamped(MaskSpec):
        """A plain value read from the process's state in ``__post_init__``: read per spec."""

        def __post_init__(self) -> None:
            object.__setattr__(self, "_serial", next(serials))

    assert [Stamped()._serial for _ in range(3)] == [0, 1, 2]


def test_a_new_spec_per_call_hits(plans: LRUCache) -> None:
    q, k, v = _qkv()
    fz.attention(q, k, v, mask=masks.SlidingWindow(left=5) & masks.Causal())
    inserts = plans.inserts
    out = fz.attention(q, k, v, mask=masks.SlidingWindow(left=5) & masks.Causal())
    assert plans.inserts == inserts
    assert_matches_reference(out, q, k, v, mask=masks.SlidingWindow(left=5) & masks.Causal())
    fz.attention(q, k, v, mask=masks.SlidingWindow(left=6) & masks.Causal())
    assert plans.inserts == inserts + 1


def test_a_new_plain_spec_per_call_is_looked_up_without_comparing_specs(
    plans: LRUCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flexattn_zoo.spec import Spec

    q, k, v = _qkv()
    fz.attention(q, k, v, mask=masks.SlidingWindow(left=5) & masks.Causal())
    compared = []
    original = Spec.__eq__
    monkeypatch.setattr(Spec, "__eq__", lambda a, b: compared.append(1) or original(a, b))
    inserts = plans.inserts
    fz.attention(q, k, v, mask=masks.SlidingWindow(left=5) & masks.Causal())
    assert plans.inserts == inserts and compared == []


def test_a_learned_bias_given_new_data_is_read_anew(plans: LRUCache) -> None:
    """A cached SDPA call reads a learned bias as it is now: after ``param.data = ...`` (EMA swaps,
    weight loading) as after an in-place update, never a view of the old storage."""
    gen = torch.Generator().manual_seed(0)
    bias = torch.nn.Parameter(torch.randn(8, 8, generator=gen))
    q, k, v = (torch.randn(1, 2, 8, 16, generator=gen) for _ in range(3))
    spec = score_mods.Bias(bias=bias)
    fz.attention(q, k, v, score_mod=spec, backend="sdpa_math")
    bias.data = torch.zeros(8, 8)
    out = fz.attention(q, k, v, score_mod=spec, backend="sdpa_math")
    assert_matches_reference(out.detach(), q, k, v)  # a zero bias: plain attention
    with torch.no_grad():
        bias.add_(1.0)  # a constant bias changes nothing either
    assert_matches_reference(fz.attention(q, k, v, score_mod=spec, backend="sdpa_math").detach(), q, k, v)


def test_bound_flex_calls_keep_no_more_block_masks_than_the_prepared_calls_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Packed-document training builds a new Document (new ids) every step: a plan per step, but
    the BlockMasks alive stay within ``backends.flex.CALLS``'s bound (plans hold them weakly)."""
    import gc

    plans: LRUCache = LRUCache(64)
    monkeypatch.setattr(plan_cache, "PLANS", plans)
    monkeypatch.setattr(flex_backend.CALLS, "size", 4)
    monkeypatch.setattr(blockmask.CACHE, "size", 4)
    flex_backend.CALLS.clear()
    blockmask.CACHE.clear()
    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, _compat.BlockMask)}  # other tests'
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(24):
            ids = torch.sort(torch.randint(0, 6, (128,), generator=gen)).values
            q = torch.randn(1, 2, 128, 16, generator=gen)
            out = fz.attention(q, q, q, mask=masks.Document(doc_ids=ids), backend="flex_cpu")
    gc.collect()
    assert len(plans) == 24  # a plan per step
    alive = sum(isinstance(o, _compat.BlockMask) and id(o) not in before for o in gc.get_objects())
    assert alive <= 8  # CALLS' and the BlockMask cache's (mostly the same ones)
    assert_matches_reference(out, q, q, q, mask=masks.Document(doc_ids=ids))


def test_arguments_that_look_like_a_plain_key_are_still_refused(plans: LRUCache) -> None:
    q, k, v = _qkv()
    fz.attention(q, k, v, mask=masks.Causal())
    for fake in (("plain", (masks.Causal, "top_left")), (masks.Causal, "top_left")):
        with pytest.raises(TypeError, match="mask must be"):
            fz.attention(q, k, v, mask=fake)


def test_cpu_flash_refuses_a_learned_bias_in_any_grad_mode() -> None:
    bias = torch.zeros(8, 8, requires_grad=True)
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    with torch.no_grad():
        out = fz.attention(q.requires_grad_(True), k, v, score_mod=score_mods.Bias(bias=bias))
        assert fz.plan(q, k, v, score_mod=score_mods.Bias(bias=bias)).backend != "sdpa_flash"
    assert_matches_reference(out, q.detach(), k, v)


def test_an_unhashable_argument_is_planned_in_full_and_not_stored(plans: LRUCache) -> None:
    """The key is hashed once, by the cache lookup: a key holding an unhashable mask argument
    comes back as ``UNHASHABLE`` and the call takes the full path, which names the argument."""
    q = torch.randn(1, 2, 8, 4)
    key = plan_cache.call_key(q, q, q, [1, 2], None, False, False, False, "auto")
    assert key is not None and plan_cache.lookup(key, q, q, q) is plan_cache.UNHASHABLE
    with pytest.raises(TypeError, match="mask must be"):
        fz.attention(q, q, q, mask=[1, 2])  # type: ignore[arg-type]
    assert len(plans) == 0


def test_unmasked_flex_plans_cycling_over_more_shapes_than_calls_holds_prepare_once(
    plans: LRUCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decoding through ``fz.attention`` over a set of cache lengths larger than
    ``backends.flex.CALLS``: with no mask the bound plans keep their prepared calls (there is no
    BlockMask to bound), so no call prepares again once every length has been seen (the prepared
    calls' LRU evicted each one just before its next use: a prepare on every call)."""
    monkeypatch.setattr(flex_backend, "CALLS", LRUCache(4))
    prepares = [0]
    prepare = flex_backend.FlexBackend._prepare

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        prepares[0] += 1
        return prepare(self, *args, **kwargs)

    monkeypatch.setattr(flex_backend.FlexBackend, "_prepare", counted)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 1, 16, generator=g)
    k_cache, v_cache = torch.randn(2, 2, 48, 16, generator=g), torch.randn(2, 2, 48, 16, generator=g)
    lengths = range(30, 38)  # 8 shapes, twice CALLS' size
    with torch.no_grad():
        for length in lengths:
            fz.attention(
                q, k_cache[:, :, :length], v_cache[:, :, :length], enable_gqa=True, backend="flex_cpu"
            )
        assert prepares[0] == len(lengths)
        for length in lengths:
            k, v = k_cache[:, :, :length], v_cache[:, :, :length]
            out = fz.attention(q, k, v, enable_gqa=True, backend="flex_cpu")
            assert_matches_reference(out, q, k, v, enable_gqa=True)
    assert prepares[0] == len(lengths)


def test_an_sdpa_hit_gives_the_full_paths_result_and_what_changes_the_plan_misses(
    plans: LRUCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hit gives exactly what the full path gives (strided inputs included), while grad mode,
    requires_grad, the environment and ``deterministic`` key the plan anew, and the argument
    checks that run before the lookup still refuse bad values on a warm cache."""
    q, k, v = _qkv()
    strided = torch.randn(1, 64, 2, 16).transpose(1, 2)  # copied to the fused layout per call
    for args in ((q, k, v), (strided, k, v)):
        plans.clear()
        full = fz.attention(*args, mask="causal", backend="sdpa_flash")
        assert plans.inserts == 1
        hit = fz.attention(*args, mask="causal", backend="sdpa_flash")
        assert plans.inserts == 1
        assert torch.equal(full, hit)
        assert torch.equal(hit, fz.attention(*args, is_causal=True, backend="sdpa_flash", dropout_p=0.0))
        assert_matches_reference(hit, *args, mask="causal")

    def inserted(**kwargs: object) -> int:
        before = plans.inserts
        fz.attention(q, k, v, mask="causal", **kwargs)  # type: ignore[call-overload]
        return plans.inserts - before

    assert inserted() == 1  # "auto", a new key
    assert inserted() == 0
    with torch.no_grad():
        assert inserted() == 1
        assert inserted() == 0
    assert inserted(deterministic=True) == 1
    assert inserted(deterministic=True) == 0
    monkeypatch.setenv("FLEXATTN_ZOO_TUNE", "0")
    assert inserted() == 1
    assert inserted() == 0
    g = torch.randn(1, 2, 64, 16, requires_grad=True)
    before = plans.inserts
    out = fz.attention(g, k, v, mask="causal")
    assert plans.inserts == before + 1
    out.sum().backward()
    assert g.grad is not None
    # The argument checks before the lookup, with a plan of the same call kind cached.
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        fz.attention(q, k, v, is_causal=1)  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="dropout_p must be a float"):
        fz.attention(q, k, v, dropout_p=True)
    with pytest.raises(TypeError, match="kernel_options must be a dict"):
        fz.attention(q, k, v, kernel_options=[("x", 1)])  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="scale must be None or a finite real number"):
        fz.attention(q, k, v, scale="0.5")  # type: ignore[call-overload]
