"""decode_step's step plans (``fz.decode`` ``hits``): a repeated flex step skips the step's
checks and planning, stays exact, and never outlives what it was built from.

Plans are process-wide: each test uses a mask of its own, so that no test hits another's plan."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from flexattn_zoo import masks, score_mods
from flexattn_zoo.models import decode
from flexattn_zoo.models.decode import step as step_module
from flexattn_zoo.models.decode.hits import step_key
from flexattn_zoo.testing import reference_attention

B, H, HKV, D, CAP = 2, 4, 2, 16, 256


def _reference(q, k, v, n: int, mask: Any, score: Any = None, scale: Any = None, sinks: Any = None):  # type: ignore[no-untyped-def]
    """float64 oracle: each row's query at position ``n - 1`` over the cache's first ``n`` keys."""
    full_q = torch.zeros(q.shape[0], q.shape[1], n, q.shape[3], dtype=torch.float64)
    full_q[:, :, n - 1 :] = q.double()
    out = reference_attention(
        full_q, k[:, :, :n].double(), v[:, :, :n].double(), mask=mask, score_mod=score,
        enable_gqa=True, scale=scale, sinks=sinks,
    )  # fmt: skip
    return out[:, :, n - 1 :]


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)


def _inputs(seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, HKV, CAP, D, generator=g), torch.randn(B, HKV, CAP, D, generator=g)
    return g, k, v


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts decode_step's full path (its input checks run once per full-path step)."""
    seen: list[int] = []
    full_check = step_module._check_inputs

    def counted(*args: Any, **kwargs: Any) -> None:
        seen.append(1)
        full_check(*args, **kwargs)

    monkeypatch.setattr(step_module, "_check_inputs", counted)
    return seen


def test_repeated_flex_steps_take_their_plan_and_stay_exact(checks: list[int]) -> None:
    g, k, v = _inputs(1)
    mask, score = masks.SlidingWindow(left=100) & masks.Causal(), score_mods.SoftCap(cap=2.0)
    with torch.no_grad():
        for n in (150, 151, 200, 90, 256):
            q = torch.randn(B, H, 1, D, generator=g)
            out = decode.decode_step(q, k, v, n, mask=mask, score_mod=score, backend="flex_cpu")
            _close(out, _reference(q, k, v, n, mask, score))
    assert len(checks) == 1  # the first step only: the others ran its plan


def test_a_step_plan_keys_the_scale(checks: list[int]) -> None:
    """Steps differing only in the scale (which the planned run holds) each get their own plan.
    (Sinks and the lse are keyed too; on the CPU such steps take the dense route, kept by none.)"""
    g, k, v = _inputs(2)
    mask = masks.SlidingWindow(left=64) & masks.Causal()
    with torch.no_grad():
        for _ in range(2):
            for scale in (None, 0.125):
                q = torch.randn(B, H, 1, D, generator=g)
                out = decode.decode_step(q, k, v, 120, mask=mask, scale=scale, backend="flex_cpu")
                _close(out, _reference(q, k, v, 120, mask, scale=scale))
    assert len(checks) == 2  # one full-path step per scale


def test_a_hit_still_checks_the_length(checks: list[int]) -> None:
    g, k, v = _inputs(3)
    mask = masks.SlidingWindow(left=65) & masks.Causal()
    q = torch.randn(B, H, 1, D, generator=g)
    with torch.no_grad():
        decode.decode_step(q, k, v, 100, mask=mask, backend="flex_cpu")
        with pytest.raises(ValueError, match="cache_len 257 is out of range"):
            decode.decode_step(q, k, v, CAP + 1, mask=mask, backend="flex_cpu")
        with pytest.raises(ValueError, match="out of range"):
            decode.decode_step(q, k, v, torch.tensor([100, 0]), mask=mask, backend="flex_cpu")
    assert len(checks) == 1  # both errors came from the kept plan's own check


def test_a_callables_captured_tensor_written_in_place_misses_its_plan(checks: list[int]) -> None:
    """The key holds the versions of the tensors a raw callable captures: a write in place sends
    the next step down the full path (which builds the DecodeMask from the new values); steps
    without a write hit."""
    g, k, v = _inputs(4)
    width = torch.tensor(40)

    def window(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= width)

    with torch.no_grad():
        for w in (None, None, 10, None):
            if w is not None:
                width.fill_(w)
            q = torch.randn(B, H, 1, D, generator=g)
            out = decode.decode_step(q, k, v, 200, mask=window, backend="flex_cpu")
            _close(out, _reference(q, k, v, 200, masks.SlidingWindow(left=int(width)) & masks.Causal()))
    assert len(checks) == 2  # the first step and the one after the write


def test_a_tensor_mask_written_in_place_is_read_anew() -> None:
    """A mask tensor is copied into a spec by the full path; the step's key never holds the
    caller's tensor, so a write to it is seen by the next step."""
    g, k, v = _inputs(8)
    allowed = torch.ones(1, 1, CAP, CAP, dtype=torch.bool).tril()
    with torch.no_grad():
        for hide in (0, 0, 50, 50):
            allowed[..., :hide] = False
            q = torch.randn(B, H, 1, D, generator=g)
            out = decode.decode_step(q, k, v, 120, mask=allowed)
            _close(out, _reference(q, k, v, 120, masks.Dense(mask=allowed[..., :120, :120].clone())))


def test_an_unhashable_mask_gets_the_full_paths_error() -> None:
    g, k, v = _inputs(9)
    q = torch.randn(B, H, 1, D, generator=g)
    with torch.no_grad(), pytest.raises(TypeError, match="mask must be"):
        decode.decode_step(q, k, v, 100, mask=[1, 2])


def test_a_cpu_step_with_nan_leaves_its_plan_to_the_full_path(checks: list[int]) -> None:
    """On the CPU a hit scans q/k/v for NaN/inf as the full path does: flex_cpu refuses them, and
    such a step runs on the dense route (NaN in its row), without touching the plan."""
    g, k, v = _inputs(10)
    # Keys with gaps: a one-query step under a plain window would be SDPA over the window instead.
    mask = masks.DilatedSlidingWindow(left=66, dilation=2)
    with torch.no_grad():
        for poison in (False, False, True, False):
            q = torch.randn(B, H, 1, D, generator=g)
            if poison:
                q[0, 0, 0, 0] = float("nan")
            out = decode.decode_step(q, k, v, 150, mask=mask)
            if poison:
                assert out[0, 0].isnan().all() and not out[1].isnan().any()
            else:
                _close(out, _reference(q, k, v, 150, mask))
    assert len(checks) == 2  # the first step and the poisoned one
    (plan,) = [p for p in decode.STEPS.values() if p.dm.spec == mask.bind(CAP, CAP) and p.dm.batch == B]
    assert plan.run.backend == "flex_cpu"  # the poisoned step's dense plan was not kept for the others


def test_clearing_the_decode_cache_drops_the_step_plans(checks: list[int]) -> None:
    """A plan runs only while its DecodeMask is the one ``decode.CACHE`` holds: after a clear the
    next step builds a new mask through the full path (and keeps a new plan)."""
    g, k, v = _inputs(5)
    mask = masks.SlidingWindow(left=32) & masks.Causal()
    with torch.no_grad():
        for clear in (False, False, True, False):
            if clear:
                decode.CACHE.clear()
            q = torch.randn(B, H, 1, D, generator=g)
            _close(
                decode.decode_step(q, k, v, 77, mask=mask, backend="flex_cpu"), _reference(q, k, v, 77, mask)
            )
    assert len(checks) == 2
    (plan,) = [p for p in decode.STEPS.values() if p.dm.spec == mask.bind(CAP, CAP)]
    assert decode.CACHE.get(plan.cache_key) is plan.dm


def test_each_thread_gets_its_own_step_plan() -> None:
    """DecodeMasks are per thread (one step's update must not land between another thread's update
    and its kernel); so are the plans that hold them."""
    g, k, v = _inputs(6)
    mask = masks.SlidingWindow(left=50) & masks.Causal()
    q = torch.randn(B, H, 1, D, generator=g)
    masks_seen: list[Any] = []

    def steps() -> None:
        with torch.no_grad():
            for n in (60, 61):
                _close(
                    decode.decode_step(q, k, v, n, mask=mask, backend="flex_cpu"),
                    _reference(q, k, v, n, mask),
                )
        masks_seen.append({id(p.dm) for p in decode.STEPS.values() if p.dm.spec == mask.bind(CAP, CAP)})

    steps()
    worker = threading.Thread(target=steps)
    worker.start()
    worker.join()
    assert len(masks_seen[1] - masks_seen[0]) == 1  # the worker's own mask and plan


def test_steps_that_cannot_take_flex_keep_no_plan(checks: list[int]) -> None:
    """Steps that record gradients, or need the lse on the CPU, run dense: every one takes the
    full path, and none is kept."""
    g, k, v = _inputs(7)
    mask = masks.SlidingWindow(left=51) & masks.Causal()
    inserts = decode.STEPS.inserts
    q = torch.randn(B, H, 1, D, generator=g, requires_grad=True)
    for _ in range(2):
        out = decode.decode_step(q, k, v, 90, mask=mask)  # dense: the flex kernel records none
        _close(out.detach(), _reference(q.detach(), k, v, 90, mask))
    with torch.no_grad():
        for _ in range(2):
            out, lse = decode.decode_step(q.detach(), k, v, 90, mask=mask, return_lse=True)
            _close(out, _reference(q.detach(), k, v, 90, mask))
    assert len(checks) == 4 and decode.STEPS.inserts == inserts
    with torch.no_grad():
        assert step_key(q.detach(), k, v, mask, None, None, None, None, True, "auto", None)[0] is None
        assert step_key(q.detach(), k, v, mask, None, None, None, None, False, "dense", None)[0] is None
        assert step_key(q.detach(), k, v, mask, None, None, None, None, False, "auto", None)[0] is not None
    assert step_key(q, k, v, mask, None, None, None, None, False, "auto", None)[0] is None  # records grad
