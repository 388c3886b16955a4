"""``deterministic=True``: which routes accept it (dispatch decisions, checked on CPU with
``Problem`` objects for sm90), and bitwise-identical repeated runs on the accepted CPU routes.

Per route (torch 2.11/2.13; see ``Backend.deterministic`` and ``needs_torch_deterministic_mode``):

* ``sdpa_cudnn`` refuses: torch itself refuses cuDNN SDPA in deterministic mode.
* ``flex_flash`` refuses: FA4's block-sparse backward is deterministic only on sm100+ with dQ
  write-order metadata, which our BlockMasks do not carry.
* ``sdpa_flash``, ``sdpa_efficient``, ``varlen`` (CUDA) accept, and run their backward under
  torch's deterministic mode (FA2's deterministic dQ accumulation; mem-efficient num_splits_key=1).
* ``flex`` accepts: its Triton backward writes dQ per query block and dK/dV per key block (the
  GQA group is a loop inside one program), with no atomics.
* ``dense``, ``sdpa_math``, CPU ``sdpa_flash`` and ``flex_cpu`` (forward only) accept.
* Every route refuses when a score_mod captures tensors that require grad: those gradients are
  scatter-added in a run-dependent order.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from learned_bias import LearnedHeadBias

import flexattn_zoo as fz
from flexattn_zoo import _compat, masks, score_mods
from flexattn_zoo.backends import BACKENDS, BY_NAME
from flexattn_zoo.backends.base import _DeterministicBackward
from flexattn_zoo.dispatch import Problem, plan_problem

CAUSAL = masks.Causal()


def _problem(
    mask: Any = CAUSAL,
    score: Any = None,
    *,
    det: bool = True,
    grad: bool = True,
    arch: str = "sm90",
    d: int = 128,
    heads: tuple[int, int] = (16, 16),
    dtype: torch.dtype = torch.bfloat16,
) -> Problem:
    device = "cpu" if arch == "cpu" else "cuda"
    return Problem(
        batch=2,
        heads=heads[0],
        kv_heads=heads[1],
        q_len=1024,
        kv_len=1024,
        head_dim=d,
        dtype=dtype,
        device_type=device,
        arch=arch,
        requires_grad=grad,
        mask=mask,
        score=score,
        deterministic=det,
    )


@pytest.mark.parametrize(
    ("problem", "route"),
    [
        # A short problem (B=2 L=1024): SDPA's routes first (arch.RULES).
        (_problem(det=False), "sdpa"),  # unchanged without the switch
        (_problem(), "sdpa_flash"),  # sdpa and cuDNN refuse; FA2 is deterministic under torch's mode
        (_problem(grad=False, d=64), "sdpa_flash"),
        (_problem(arch="sm80"), "sdpa_flash"),  # FA2 first on sm80, deterministic under torch's mode
        (_problem(masks.SlidingWindow(left=127)), "flex"),
        (_problem(masks.Causal(), score_mods.SoftCap(cap=30.0)), "flex"),
        (_problem(masks.SlidingWindow(left=3), arch="cpu", dtype=torch.float32), "dense"),
        (_problem(masks.SlidingWindow(left=3), arch="cpu", dtype=torch.float32, grad=False), "flex_cpu"),
        (_problem(masks.Causal(), arch="cpu", dtype=torch.float32), "sdpa_flash"),
    ],
)
def test_deterministic_route_choice(problem: Problem, route: str) -> None:
    assert plan_problem(problem).backend == route


def test_nondeterministic_routes_refuse_with_reasons() -> None:
    plan = plan_problem(_problem())
    assert "mode fwdbwd, deterministic)" in plan.explain()
    by = {c.name: c for c in plan.candidates}
    assert any("torch refuses cuDNN SDPA in deterministic mode" in r for r in by["sdpa_cudnn"].reasons)
    assert any("FA4's backward with a block mask" in r for r in by["flex_flash"].reasons)
    for ok in ("flex", "sdpa_flash", "sdpa_math"):
        assert not any("deterministic" in r for r in by[ok].reasons), ok
    with pytest.raises(ValueError, match=r"backend 'sdpa_cudnn' cannot run this call: not deterministic"):
        plan_problem(_problem(), "sdpa_cudnn")
    assert BY_NAME["sdpa_flash"].needs_torch_deterministic_mode
    assert BY_NAME["sdpa_efficient"].needs_torch_deterministic_mode
    assert BY_NAME["varlen"].needs_torch_deterministic_mode
    assert not BY_NAME["flex"].needs_torch_deterministic_mode


def test_learned_score_tensors_are_refused_everywhere() -> None:
    score = LearnedHeadBias(bias=torch.zeros(16, requires_grad=True))
    with pytest.raises(ValueError, match=r"no route .* scatter-added"):
        plan_problem(_problem(masks.Causal(), score))
    with pytest.raises(ValueError, match=r"scatter-added"):
        plan_problem(_problem(masks.Causal(), score, arch="cpu", dtype=torch.float32), "dense")
    # Without the switch, or in a forward that needs no gradient, the call is fine.
    assert plan_problem(_problem(masks.Causal(), score, det=False)).backend == "flex"
    assert plan_problem(_problem(masks.Causal(), score, grad=False)).backend == "flex"


def test_default_follows_torch_deterministic_mode() -> None:
    q = torch.randn(1, 2, 16, 16)
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    try:
        torch.use_deterministic_algorithms(True)
        assert fz.plan(q, q, q).problem.deterministic
        assert not fz.plan(q, q, q, deterministic=False).problem.deterministic
        torch.use_deterministic_algorithms(True, warn_only=True)  # torch would still run cuDNN
        assert not fz.plan(q, q, q).problem.deterministic
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    assert not fz.plan(q, q, q).problem.deterministic
    assert fz.plan(q, q, q, deterministic=True).problem.deterministic


# -- the backward wrapper (CUDA FA2 / mem-efficient / varlen), exercised on CPU tensors ---------


def test_backward_runs_under_torch_deterministic_mode_and_restores_it() -> None:
    seen: list[bool] = []

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, None]:
        q.register_hook(lambda g: seen.append(torch.are_deterministic_algorithms_enabled()))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), None

    q, k, v = (torch.randn(1, 2, 24, 16, requires_grad=True) for _ in range(3))
    before = torch.are_deterministic_algorithms_enabled()
    out, lse = _DeterministicBackward.apply(run, q, k, v)
    assert lse is None and torch.are_deterministic_algorithms_enabled() == before
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    assert seen == [True] and torch.are_deterministic_algorithms_enabled() == before
    want_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    want = torch.autograd.grad(want_out, (q, k, v), grad_out)
    assert torch.equal(out, want_out) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_execute_wraps_only_routes_that_need_torch_mode() -> None:
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=g, requires_grad=True) for _ in range(3))
    p = Problem(
        batch=1,
        heads=2,
        kv_heads=2,
        q_len=32,
        kv_len=32,
        head_dim=16,
        dtype=torch.float32,
        device_type="cuda",
        arch="sm90",
        requires_grad=True,
        mask=CAUSAL,
        deterministic=True,
    )
    for route, wrapped in (("sdpa_flash", True), ("sdpa_math", False)):
        # The Problem says CUDA but the tensors are on the CPU: the same kernels run, and only the
        # wrapping (decided from the Problem) differs.
        out, _ = BY_NAME[route].execute(q, k, v, p, scale=0.25)
        assert ("DeterministicBackward" in type(out.grad_fn).__name__) == wrapped
        grad_out = torch.randn(out.shape, generator=g)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        fz.testing.assert_matches_reference(
            out, q, k, v, mask="causal", scale=0.25, grads=grads, grad_out=grad_out
        )


def test_deterministic_mode_context_is_reference_counted() -> None:
    before = torch.are_deterministic_algorithms_enabled()
    with _compat.deterministic_algorithms():
        with _compat.deterministic_algorithms():
            assert torch.are_deterministic_algorithms_enabled()
        assert torch.are_deterministic_algorithms_enabled()  # the inner exit must not switch it off
    assert torch.are_deterministic_algorithms_enabled() == before


# -- bitwise reproducibility on the CPU routes that accept it -----------------------------------

CASES = {
    # route: (mask, score_mod, kv heads, requires grad)
    "dense": (
        masks.SlidingWindow(left=40) & masks.Causal(),
        score_mods.Alibi(num_heads=4) >> score_mods.SoftCap(cap=5.0),
        2,
        True,
    ),
    "sdpa_math": (masks.Causal(), None, 2, True),
    "sdpa_flash": (masks.Causal(), None, 2, True),
    "flex_cpu": (masks.Causal(), None, 2, False),  # torch has no CPU flex backward
}


def test_every_deterministic_cpu_route_has_a_case() -> None:
    assert set(CASES) == {b.name for b in BACKENDS if "cpu" in b.devices and b.deterministic}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("route", list(CASES))
def test_ten_runs_are_bitwise_identical(route: str, dtype: torch.dtype) -> None:
    mask, score, hkv, grad = CASES[route]
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(2, h, 200, 32, generator=g).to(dtype) for h in (4, hkv, hkv)]
    grad_out = torch.randn(2, 4, 200, 32, generator=g).to(dtype)
    kw: dict[str, Any] = dict(mask=mask, score_mod=score, enable_gqa=True, deterministic=True)
    runs = []
    for _ in range(10):
        ins = [t.clone().requires_grad_(grad) for t in base]
        out = fz.attention(*ins, backend=route, **kw)
        runs.append((out, *(torch.autograd.grad(out, ins, grad_out) if grad else ())))
    for run in runs[1:]:
        for a, b in zip(runs[0], run, strict=True):
            assert torch.equal(a, b), f"{route} {dtype}: a repeated run differs"
