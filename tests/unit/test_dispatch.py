"""Dispatcher: route choice (per arch, mode, spec), explicit backends, CPU routes vs the reference.

CPU compiles cost seconds each, so flex_cpu runs only a handful of specs here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from compiled_flex_spy import counts, spy_compiled_flex

import flexattn_zoo as fz
from flexattn_zoo import _compat, masks, score_mods
from flexattn_zoo.backends import BACKENDS
from flexattn_zoo.compile import CACHE as COMPILE_CACHE
from flexattn_zoo.compile import STATIC_SHAPES, UnfusedFallbackError
from flexattn_zoo.dispatch import Problem, plan_problem
from flexattn_zoo.testing import assert_matches_reference, reference_attention


def _problem(
    mask=None,
    score=None,
    *,
    arch="sm90",
    dtype=torch.bfloat16,
    d=128,
    lq=1024,
    lkv=None,
    grad=False,
    heads=(16, 16),
    lse=False,
    device="cuda",
    batch=256,
    v_dim=None,
):
    """A problem for planning only; the default sizes are above the short-problem rule's bound."""
    return Problem(
        batch=batch,
        heads=heads[0],
        kv_heads=heads[1],
        q_len=lq,
        kv_len=lkv or lq,
        head_dim=d,
        v_dim=v_dim,
        dtype=dtype,
        device_type=device,
        arch=arch,
        requires_grad=grad,
        mask=mask,
        score=score,
        return_lse=lse,
    )


def _global_tokens(length: int, window: int, **kw) -> Problem:  # type: ignore[no-untyped-def]
    """A [CLS]-style global token and a window of ``window`` keys on each side, ``length`` long."""
    return _problem(
        masks.GlobalWindow.from_positions([0], length, left=window, right=window), lq=length, **kw
    )


DOC = masks.Document.from_lengths([300, 500, 224])
LONG_DOC = masks.Document.from_lengths([4096, 2048, 6144, 4096])
GEMMA_LOCAL = masks.SlidingWindow(left=4095) & masks.Causal()


@pytest.mark.parametrize(
    ("problem", "route"),
    [
        # SDPA's own choice: cuDNN, with GQA native (generalization_h200: Llama-3-8B 8K causal
        # 0.89 / 3.48 ms vs 1.03 / 3.65 through sdpa_cudnn with k/v expanded)
        (_problem(masks.Causal()), "sdpa"),
        (_problem(None), "sdpa"),
        (_problem(masks.Causal(), d=64), "sdpa"),
        (_problem(masks.Causal(), grad=True), "sdpa"),
        (_problem(masks.Causal(), heads=(32, 8)), "sdpa"),
        (_problem(masks.Causal(), heads=(32, 8), grad=True), "sdpa"),
        (_problem(None, heads=(32, 8), lq=16, lkv=4096), "sdpa"),  # decoding, GQA native
        # q/k 192 with v 128 (DeepSeek): SDPA runs it on cuDNN (h200 mla_d192: plain SDPA 622 / 484
        # TFLOP/s vs Triton flex 308 / 171)
        (_problem(masks.Causal(), d=192, v_dim=128, grad=True), "sdpa"),
        (_problem(masks.Causal(), lq=1000, lkv=1200), "flex"),  # no SDPA form when Lq != Lkv
        (_problem(DOC & masks.Causal()), "flex"),  # measured: flex >= varlen on sm90
        (_problem(masks.SlidingWindow(left=127)), "flex"),
        # prefix-LM as two cuDNN parts merged by lse (cudnn_decomp_probe_h200.txt)
        (_problem(masks.PrefixLM(prefix_len=300)), "sdpa_split"),
        (_problem(masks.PrefixLM(prefix_len=300), grad=True, heads=(32, 8)), "sdpa_split"),
        (_problem(masks.PrefixLM(prefix_len=torch.tensor([3, 300]))), "flex"),  # per-row prefixes: no split
        (_problem(masks.PrefixLM(prefix_len=300), lse=True), "flex"),  # the split route returns no lse
        (_problem(masks.Chunked(size=256) & masks.Causal()), "sdpa_cudnn"),  # equal chunks as batch rows
        (_problem(masks.Chunked(size=256), grad=True), "sdpa_cudnn"),
        (_problem(masks.Chunked(size=300) & masks.Causal()), "flex"),  # unequal: no SDPA form
        (_problem(masks.Causal(), score_mods.SoftCap(cap=30.0)), "flex"),
        (_problem(masks.Causal(), dtype=torch.float32), "flex"),
        (_problem(masks.Causal(), arch="sm80"), "sdpa_flash"),
        (_problem(masks.Causal(), arch="sm86"), "sdpa_flash"),
        (_problem(masks.Causal(), device="cpu", arch="cpu", dtype=torch.float32), "sdpa_flash"),
        (_problem(masks.SlidingWindow(left=3), device="cpu", arch="cpu", dtype=torch.float32), "flex_cpu"),
        # prefix-LM: torch's CPU flash kernel per part (benchmarks/results/cpu_prefix.md)
        (
            _problem(masks.PrefixLM(prefix_len=300), device="cpu", arch="cpu", dtype=torch.float32),
            "sdpa_split",
        ),
        (
            _problem(
                masks.PrefixLM(prefix_len=300), device="cpu", arch="cpu", dtype=torch.float32, grad=True
            ),
            "sdpa_split",
        ),
        (
            _problem(
                masks.Chunked(size=64) & masks.Causal(),
                device="cpu",
                arch="cpu",
                dtype=torch.float32,
                grad=True,
            ),
            "sdpa_flash",
        ),
        (
            _problem(
                masks.SlidingWindow(left=3), device="cpu", arch="cpu", dtype=torch.float32, grad=True, batch=2
            ),
            "dense",
        ),
        (
            _problem(
                masks.SlidingWindow(left=3), device="cpu", arch="cpu", dtype=torch.float32, lse=True, batch=2
            ),
            "dense",
        ),
    ],
)
def test_auto_route_table(problem: Problem, route: str) -> None:
    # On this CPU machine flash-attn-4 is not installed, so flex_flash always refuses.
    assert plan_problem(problem).backend == route


@pytest.mark.parametrize(
    ("problem", "route"),
    [
        (_problem(masks.Causal()), "fa4"),
        (_problem(masks.Causal(), d=64), "fa4"),  # H200: fa4 547 vs cuDNN 460 fwd
        (_problem(masks.Causal(), heads=(32, 8), grad=True), "fa4"),
        (_problem(masks.SlidingWindow(left=127)), "fa4"),
        (_problem(masks.Chunked(size=256) & masks.Causal()), "fa4"),  # equal chunks: no packing
        (_problem(DOC & masks.Causal()), "flex_flash"),  # packing q/k/v costs fa4 the forward
        (_problem(DOC & masks.Causal(), grad=True), "fa4"),
        (_problem(DOC & masks.Causal(), grad=True, d=64), "fa4"),  # 235 vs flex_flash 161
        (_problem(DOC & masks.Causal(), d=64), "flex"),  # row starts on Triton: 212 vs flex_flash 196
        (_problem(DOC & masks.Causal(), heads=(32, 8)), "flex_flash"),  # 342 vs fa4 268
        (_problem(DOC & masks.Causal(), heads=(32, 8), grad=True), "fa4"),
        # one batch row of documents at D=128: FA4's varlen kernel (Mixtral 8K: 0.22 vs 0.29 ms)
        (_problem(LONG_DOC & masks.Causal(), heads=(32, 8), batch=1, lq=16384), "fa4"),
        (_problem(LONG_DOC & masks.Causal(), heads=(32, 8), batch=1, lq=16384, d=64), "flex"),
        (_problem(LONG_DOC & masks.Causal(), heads=(32, 8), batch=2, lq=16384), "flex_flash"),
        # the top of the short range (2e10-4e10), FA4's launches replayed: FA4 forward (H100,
        # generalization_fa4replay_h100: a Gemma-3-27B-style 4K sequence, 3.4e10, 0.233 vs sdpa
        # 0.298 ms; a Llama-3.2-3B-style 4 x 2K batch, 2.6e10, 0.205 vs 0.225), and training
        # without GQA (DINOv2-g, 2.3e10: 0.73 vs 0.91 ms on the H200); training with GQA stays on
        # SDPA (H200: 0.87 vs fa4 1.19 on the Llama-3.2-3B batch, 1.06 vs 1.10 on Gemma-3-27B);
        # below 2e10 SDPA (Llama-3-8B heads at B=32, L=512, 1.7e10: 0.197 vs fa4 0.269 forward,
        # 1.22 vs 1.33 training)
        (_problem(masks.Causal(), heads=(32, 16), batch=1, lq=4096), "fa4"),
        (_problem(masks.Causal(), heads=(24, 8), batch=4, lq=2048), "fa4"),
        (_problem(masks.Causal(), heads=(32, 16), batch=1, lq=4096, grad=True), "sdpa"),
        (_problem(masks.Causal(), heads=(24, 8), batch=4, lq=2048, grad=True), "sdpa"),
        (_problem(None, heads=(24, 24), batch=8, lq=1370, d=64, grad=True), "fa4"),
        # a window plus global tokens: fa4 runs it (windowed kernel + merged global keys) but
        # slower than flex_flash's one call (H200: 1.50 vs 0.50 ms forward, 6.27 vs 2.16 training)
        *((_global_tokens(8192, 512, batch=2, grad=grad), "flex_flash") for grad in (False, True)),
        # ... also where a head-dim-256 rule would put fa4 first, and below the rule's size (flex)
        *(
            (_global_tokens(2048, 64, d=256, batch=2, heads=(8, 8), grad=grad), "flex")
            for grad in (False, True)
        ),
        (_problem(masks.Causal(), heads=(32, 8), batch=32, lq=512), "sdpa"),
        (_problem(masks.Causal(), heads=(32, 8), batch=32, lq=512, grad=True), "sdpa"),
        # exact score mods above the short forwards (3e10): flex_flash; below: flex
        (
            _problem(masks.Causal(), score_mods.Alibi(num_heads=32), heads=(32, 32), batch=4, lq=2048),
            "flex_flash",
        ),
        (
            _problem(masks.Causal(), score_mods.Alibi(num_heads=32), heads=(32, 32), batch=4, lq=2048, d=64),
            "flex",
        ),  # at D=64 flex and flex_flash tie forward
        (
            _problem(None, score_mods.Alibi(num_heads=16), heads=(16, 16), batch=8, lq=2048, d=64, grad=True),
            "flex_flash",
        ),
        (_problem(masks.Causal(), score_mods.Alibi(num_heads=32), heads=(32, 32), batch=1, lq=2048), "flex"),
        (
            _problem(
                masks.Causal(), score_mods.SoftCap(cap=30.0, approx=True), heads=(32, 32), batch=4, lq=2048
            ),
            "flex",
        ),  # approximate: Triton's hardware tanh
        # flex_flash's backward gets dQ wrong for head-dependent scores under GQA: flex instead
        (_problem(masks.Causal(), score_mods.Alibi(num_heads=16), heads=(16, 4), grad=True), "flex"),
        (
            _problem(
                masks.Causal(),
                score_mods.Alibi(num_heads=16) >> score_mods.SoftCap(cap=5.0),
                heads=(16, 4),
                grad=True,
            ),
            "flex",
        ),
        (
            _problem(masks.Causal(), score_mods.Alibi(num_heads=16), heads=(16, 4)),
            "flex_flash",
        ),  # fwd is right
        (_problem(masks.Causal(), score_mods.SoftCap(cap=5.0), heads=(16, 4), grad=True), "flex_flash"),
        (_problem(masks.Causal(), score_mods.SoftCap(cap=30.0)), "flex_flash"),
        (_problem(masks.Causal(), score_mods.SoftCap(cap=30.0, approx=True)), "flex"),  # Triton's fast tanh
        (_problem(masks.Causal(), score_mods.SoftCap(cap=30.0, approx=True), grad=True), "flex_flash"),
        (_problem(masks.PrefixLM(prefix_len=100)), "flex_flash"),  # no FA4 form
        (_problem(masks.PrefixLM(prefix_len=100), grad=True), "flex_flash"),  # 558 vs sdpa_split ~440
        (_problem(masks.Causal(), lq=1000, lkv=1200), "flex_flash"),
        # Gemma-2 at head dim 256 with exact soft-capping (FA4's own kernels soft-cap only
        # approximately): flex_flash on 64-key blocks, forward and training (H100: 411 / 296
        # TFLOP/s vs Triton flex 166 / 112, generalization_d256_h100_r44)
        (
            _problem(GEMMA_LOCAL, score_mods.SoftCap(cap=50.0), d=256, heads=(16, 8), batch=1, lq=8192),
            "flex_flash",
        ),
        (
            _problem(
                GEMMA_LOCAL, score_mods.SoftCap(cap=50.0), d=256, heads=(16, 8), batch=1, lq=8192, grad=True
            ),
            "flex_flash",
        ),
        # approximate soft-capping at 256: FA4's own kernel, forward (436 vs flex_flash 435 on the
        # H100) and training (332 vs flex_flash 304)
        (
            _problem(
                GEMMA_LOCAL, score_mods.SoftCap(cap=50.0, approx=True), d=256, heads=(16, 8), batch=2, lq=8192
            ),
            "fa4",
        ),
        (
            _problem(
                GEMMA_LOCAL,
                score_mods.SoftCap(cap=50.0, approx=True),
                d=256,
                heads=(16, 8),
                batch=2,
                lq=8192,
                grad=True,
            ),
            "fa4",
        ),
    ],
)
def test_auto_route_table_with_fa4(problem: Problem, route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """sm90 with flash-attn-4 installed (faked: only the planning is exercised here)."""
    monkeypatch.setattr(_compat, "flash_cute_available", lambda: True)
    assert plan_problem(problem).backend == route


@pytest.mark.parametrize("fa4", [False, True])
@pytest.mark.parametrize(
    ("problem", "route"),
    [
        # Short problems (B*H*Lq*Lkv*D <= 3e10 forward, 4e10 training): SDPA's kernels before FA4's
        # host time.
        (_problem(masks.Causal(), batch=2), "sdpa"),
        (_problem(None, batch=2, grad=True, heads=(32, 8)), "sdpa"),
        (_problem(masks.SlidingWindow(left=127), batch=2), "flex"),  # no SDPA form: flex before fa4
        # Decoding from a cache of up to 128K keys.
        (_problem(None, lq=1, lkv=131072, batch=1, heads=(32, 8)), "sdpa"),
        (_problem(None, lq=16, lkv=8192, batch=32, heads=(32, 8)), "sdpa"),
        (_problem(masks.Chunked(size=256) & masks.Causal()), "sdpa_cudnn"),  # chunks: cuDNN's view
    ],
)
def test_shape_rules(problem: Problem, route: str, fa4: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The measured size rules (``arch.RULES``) hold with and without flash-attn-4."""
    monkeypatch.setattr(_compat, "flash_cute_available", lambda: fa4)
    if fa4 and route == "sdpa_cudnn":
        route = "fa4"  # long equal chunks: FA4 with its chunk window
    assert plan_problem(problem).backend == route


def test_rule_bounds() -> None:
    from flexattn_zoo.arch import RULES, Sizes

    short = next(r for r in RULES if r.max_work is not None and r.modes == ("fwd",))
    assert short.applies("sm90", "fwd", frozenset(), Sizes(1, 1, 1, 1, short.max_work))
    assert not short.applies("sm90", "fwd", frozenset(), Sizes(1, 1, 1, 1, short.max_work + 1))
    assert not short.applies("sm80", "fwd", frozenset(), Sizes(1, 1, 1, 1, 1))
    assert not short.applies("sm90", "fwd", frozenset(), None)  # size rules need sizes
    assert not short.applies("sm90", "fwdbwd", frozenset(), Sizes(1, 1, 1, 1, 1))  # its own rule below
    training = next(r for r in RULES if r.max_work is not None and r.modes == ("fwdbwd",))
    assert training.max_work is not None and training.max_work > short.max_work  # FA4's longer host time
    assert training.applies(
        "sm90", "fwdbwd", frozenset({"score_mod"}), Sizes(32, 32, 1, 32768, 128)
    )  # decoding


def test_rule_lower_bounds_batch_bound_and_absent_traits() -> None:
    from flexattn_zoo.arch import Rule, Sizes

    rule = Rule(
        generation="sm90", modes=("fwd",), front=("flex",), why="", benchmark="", evidence=(),
        traits=frozenset({"score_mod"}), absent=frozenset({"fast_score_mod"}), min_work=100, max_batch=2,
    )  # fmt: skip
    exact = frozenset({"score_mod"})
    assert rule.applies("sm90", "fwd", exact, Sizes(2, 1, 10, 10, 1))
    assert not rule.applies("sm90", "fwd", exact, Sizes(1, 1, 9, 10, 1))  # work 90 < 100
    assert not rule.applies("sm90", "fwd", exact, Sizes(3, 1, 10, 10, 1))  # batch 3 > 2
    assert not rule.applies("sm90", "fwd", exact | {"fast_score_mod"}, Sizes(2, 1, 10, 10, 1))
    assert not rule.applies("sm90", "fwd", exact, None)  # size rules need sizes


def test_priority_overrides_apply_only_with_all_traits() -> None:
    from flexattn_zoo.arch import Sizes, priority

    plain = priority("sm90", "fwdbwd")
    assert plain[:2] == ("fa4", "flex_flash")
    assert priority("sm90", "fwdbwd", frozenset({"packed_segments"})) == plain
    assert priority("sm90", "fwd", frozenset({"packed_segments", "score_mod"}))[:2] == ("flex_flash", "fa4")
    fast = frozenset({"score_mod", "fast_score_mod"})
    assert priority("sm90", "fwd", fast, Sizes(8, 16, 4096, 4096, 128))[:2] == ("flex", "flex_flash")
    # Gemma-2's D=256: FA4's own soft-capping kernel, then flex_flash (64-key blocks there)
    assert priority("sm90", "fwd", fast, Sizes(2, 16, 8192, 8192, 256))[:2] == ("fa4", "flex_flash")
    assert priority("sm80", "fwd", frozenset({"score_mod", "packed_segments"})) == priority("sm80", "fwd")


def test_cuda_kernel_limits_of_multi_device_routes() -> None:
    """Routes that also run on the CPU name their CUDA kernel's limits (and only on CUDA)."""
    with pytest.raises(ValueError, match=r"CUDA kernel needs dtype in \{bfloat16, float16\}"):
        plan_problem(_problem(masks.Causal(), dtype=torch.float32), "sdpa_flash")
    with pytest.raises(ValueError, match="CUDA kernel needs head dim 8..128, multiple of 8"):
        plan_problem(_problem(masks.PrefixLM(prefix_len=300), d=100), "sdpa_split")
    cpu = _problem(masks.PrefixLM(prefix_len=300), d=100, dtype=torch.float32, device="cpu", arch="cpu")
    assert plan_problem(cpu, "sdpa_split").backend == "sdpa_split"


def test_plan_lists_every_route_with_reasons() -> None:
    p = plan_problem(_problem(masks.SlidingWindow(left=127)))
    names = [c.name for c in p.candidates]
    assert set(names) == {b.name for b in BACKENDS}
    text = p.explain()
    for c in p.candidates:
        assert c.name in text
    sdpa = next(c for c in p.candidates if c.name == "sdpa_cudnn")
    assert not sdpa.accepted and any("SDPA form" in r for r in sdpa.reasons)


def test_arch_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    from flexattn_zoo.arch import detect_arch

    monkeypatch.setenv("FLEXATTN_ZOO_ARCH", "sm80")
    assert detect_arch("cuda") == "sm80"
    assert detect_arch("cpu") == "cpu"  # CPU tensors are CPU whatever the override says
    monkeypatch.setenv("FLEXATTN_ZOO_ARCH", "volta")
    with pytest.raises(ValueError, match="FLEXATTN_ZOO_ARCH must look like"):
        detect_arch("cuda")
    monkeypatch.setenv("FLEXATTN_ZOO_ARCH", "sm9")  # no minor version: refused the same way
    with pytest.raises(ValueError, match="FLEXATTN_ZOO_ARCH must look like .* got 'sm9'"):
        detect_arch("cuda")


def test_parse_arch_reads_major_and_minor() -> None:
    from flexattn_zoo.arch import parse_arch

    assert [parse_arch(a) for a in ("sm80", "sm86", "sm90", "sm100", "sm120", "cpu")] == [
        (8, 0), (8, 6), (9, 0), (10, 0), (12, 0), None,
    ]  # fmt: skip
    for bad in ("sm9", "sm", "sm1000", "h100", "SM90"):
        with pytest.raises(ValueError, match=f"arch must look like .* got '{bad}'"):
            parse_arch(bad)


def test_named_backend_never_falls_back() -> None:
    q = torch.randn(1, 2, 64, 16)
    with pytest.raises(ValueError, match="backend 'sdpa_math' cannot run this call: mask SlidingWindow"):
        fz.attention(q, q, q, mask=masks.SlidingWindow(left=4), backend="sdpa_math")
    with pytest.raises(ValueError, match="backend 'flex' cannot run.*runs on cuda, not cpu"):
        fz.attention(q, q, q, backend="flex")
    with pytest.raises(ValueError, match="unknown backend 'flax'; valid: auto, sdpa, sdpa_cudnn"):
        fz.attention(q, q, q, backend="flax")
    q.requires_grad_(True)
    with pytest.raises(ValueError, match="has no backward"):
        fz.attention(q, q, q, mask="causal", backend="flex_cpu")


@pytest.mark.parametrize(
    "mask",
    [
        None,
        masks.Causal(),
        masks.Causal(align="bottom_right"),
        masks.SlidingWindow(left=5, right=2),
        DOC & masks.Causal(),
        masks.PrefixLM(prefix_len=17) | masks.Chunked(size=32),
    ],
)
@pytest.mark.parametrize("lq_lkv", [(70, 70), (90, 61)])
def test_dense_route_forward_backward(mask, lq_lkv) -> None:  # type: ignore[no-untyped-def]
    lq, lkv = lq_lkv
    g = torch.Generator().manual_seed(lq)
    q = torch.randn(2, 4, lq, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 2, lkv, 16, generator=g, requires_grad=True)
    v = torch.randn(2, 2, lkv, 16, generator=g, requires_grad=True)
    out, lse = fz.attention(q, k, v, mask=mask, enable_gqa=True, return_lse=True, backend="dense")
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(
        out, q, k, v, mask=mask, enable_gqa=True, lse=lse, grads=grads, grad_out=grad_out
    )


def test_auto_cpu_training_uses_exact_route_with_grads() -> None:
    q = torch.randn(1, 2, 50, 16, requires_grad=True)
    spec = masks.SlidingWindow(left=7) & masks.Causal()
    score = score_mods.Alibi(num_heads=2) >> score_mods.SoftCap(cap=5.0)
    assert fz.plan(q, q, q, mask=spec, score_mod=score).backend == "dense"
    out = fz.attention(q, q, q, mask=spec, score_mod=score)
    grad_out = torch.randn_like(out)
    (dq,) = torch.autograd.grad(out, (q,), grad_out)
    assert dq.abs().sum() > 0
    assert_matches_reference(out, q, q, q, mask=spec, score_mod=score)


def test_dense_memory_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXATTN_ZOO_DENSE_LIMIT_MB", "1")
    q = torch.randn(1, 4, 512, 16, requires_grad=True)
    with pytest.raises(ValueError, match="no route in the cpu priority list.*dense: would materialize"):
        fz.attention(q, q, q, mask=masks.SlidingWindow(left=8))


def test_sdpa_cpu_routes_match_reference() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 96, 32, generator=g) for _ in range(3))
    chunks = (
        masks.Chunked(size=32),
        masks.Chunked(size=24) & masks.Causal(),
        masks.Document.from_lengths([48, 48]),
    )
    for backend in ("sdpa_flash", "sdpa_math"):
        for mask in (None, "causal", masks.Causal(align="bottom_right"), *chunks):
            out = fz.attention(q, k, v, mask=mask, backend=backend, scale=0.3)
            assert_matches_reference(out, q, k, v, mask=mask, scale=0.3)


def test_sdpa_chunks_backward_and_refusals() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 96, 32, generator=g).requires_grad_(True) for _ in range(3))
    mask = masks.Chunked(size=32) & masks.Causal()
    out = fz.attention(q, k, v, mask=mask, backend="sdpa_flash")
    grad_out = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(out, q, k, v, mask=mask, grads=grads, grad_out=grad_out)
    # Unequal chunks and windows inside chunks have no SDPA call.
    for bad in (masks.Chunked(size=40), masks.Chunked(size=32) & masks.SlidingWindow(left=4)):
        with pytest.raises(ValueError, match="no exact SDPA form"):
            fz.attention(q, k, v, mask=bad, backend="sdpa_math")


# -- flex on CPU (compiled; each distinct spec costs one compile) ---------------------------------


def test_flex_cpu_matches_reference_and_fully_masked_rows() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 150, 32, generator=g)
    k = torch.randn(2, 2, 100, 32, generator=g)
    v = torch.randn(2, 2, 100, 32, generator=g)
    spec = masks.Causal(align="bottom_right")  # Lq > Lkv: the first 50 query rows see nothing
    plan = fz.plan(q, k, v, mask=spec, enable_gqa=True)
    assert plan.backend == "flex_cpu"
    out = fz.attention(q, k, v, mask=spec, enable_gqa=True)
    assert torch.equal(out[:, :, :50], torch.zeros_like(out[:, :, :50]))
    assert_matches_reference(out, q, k, v, mask=spec, enable_gqa=True)


def test_flex_cpu_score_mod_chain_and_document() -> None:
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 200, 32, generator=g) for _ in range(3))
    spec = masks.Document(doc_ids=torch.tensor([[0] * 120 + [1] * 80, [0] * 30 + [1] * 170])) & masks.Causal()
    score = score_mods.Alibi(num_heads=4) >> score_mods.SoftCap(cap=20.0)
    out = fz.attention(q, k, v, mask=spec, score_mod=score, backend="flex_cpu")
    assert_matches_reference(out, q, k, v, mask=spec, score_mod=score)


def test_compile_cache_reuses_graphs_across_equal_specs_and_lengths() -> None:
    """A value-equal spec reuses the entry's graphs; its first two lengths get static graphs (a
    dynamic-shape graph runs the same kernel slower), later lengths share one dynamic-shape graph,
    and the static ones keep serving their lengths."""

    def run(spec, length):  # type: ignore[no-untyped-def]
        q = torch.randn(1, 2, length, 16)
        out = fz.attention(q, q, q, mask=spec, backend="flex_cpu")
        assert_matches_reference(out, q, q, q, mask=spec)

    def graphs() -> tuple[int, int]:
        entries = COMPILE_CACHE.entries()
        return sum(e.compiles for e in entries), sum(e.dynamic_graphs for e in entries)

    assert STATIC_SHAPES == 2
    COMPILE_CACHE.clear()  # sums over the entries: none evicted by this test's own (LRU)
    start = graphs()
    run(masks.SlidingWindow(left=9, right=1), 100)
    before = graphs()
    run(masks.SlidingWindow(left=9, right=1), 100)  # a value-equal spec: same mod, same graph
    assert graphs() == before
    run(masks.SlidingWindow(left=9, right=1), 130)
    assert graphs() == (start[0] + 2, start[1])  # two lengths, two static graphs
    for length in (170, 260, 333, 100, 130):  # the third length's own graph, then one dynamic one
        run(masks.SlidingWindow(left=9, right=1), length)
    assert graphs() == (start[0] + 4, start[1] + 1)


def test_a_known_shape_in_the_other_grad_mode_compiles_a_static_graph() -> None:
    """Grad mode is part of the graph (a guard): a shape the entry has run, met again in the
    other grad mode, compiles under the static-shape setting as well, not Dynamo's automatic
    dynamic shapes (which would make it symbolic: the entry has seen two lengths)."""
    spec = masks.SlidingWindow(left=11, right=2)

    def graphs() -> tuple[int, int]:
        entries = COMPILE_CACHE.entries()
        return sum(e.compiles for e in entries), sum(e.dynamic_graphs for e in entries)

    COMPILE_CACHE.clear()  # sums over the entries: none evicted by this test's own (LRU)
    start = graphs()
    for grad in (True, False):
        for length in (64, 96):
            q = torch.randn(1, 2, length, 16)
            with torch.set_grad_enabled(grad):
                out = fz.attention(q, q, q, mask=spec, backend="flex_cpu")
            assert_matches_reference(out, q, q, q, mask=spec)
    assert graphs() == (start[0] + 4, start[1])


def test_a_known_shape_in_another_layout_compiles_a_static_graph() -> None:
    """Dynamo's guards check strides too: a shape the entry has run, met again in another layout
    (a projection's transposed view), compiles under the static-shape setting as well, not as a
    dynamic-shape graph (the entry has seen two lengths by then)."""
    from flexattn_zoo.compile import CompiledFlex

    entry = CompiledFlex(20_000, None, False, False)
    g = torch.Generator().manual_seed(5)
    for length, transposed in ((128, False), (256, False), (128, True)):
        q, k, v = (
            torch.randn(1, length, 2, 16, generator=g).transpose(1, 2)
            if transposed
            else torch.randn(1, 2, length, 16, generator=g)
            for _ in range(3)
        )
        out, _ = entry(q, k, v, fz.block_mask(masks.Causal(), length, length), 0.25, None)
        assert_matches_reference(out, q, k, v, mask=masks.Causal(), scale=0.25)
    assert (entry.compiles, entry.dynamic_graphs) == (3, 0)


def test_unfused_fallback_is_refused() -> None:
    """If torch ever ran our flex call outside a compiled graph, we raise instead."""
    q = torch.randn(1, 2, 64, 16)
    with torch.compiler.set_stance("force_eager"):
        with pytest.raises(UnfusedFallbackError, match="would run unfused"):
            fz.attention(q, q, q, mask=masks.SlidingWindow(left=3), backend="flex_cpu")


def test_a_graph_break_inside_the_compiled_flex_call_is_an_error_not_an_unfused_run() -> None:
    """A score_mod Dynamo cannot trace breaks the graph inside flex's trace; compiled without
    fullgraph and without the body's no-graph-breaks guard, torch then runs flex eagerly,
    unfused (it did on torch 2.13). The entry must raise instead, and a later call of the same
    entry with a traceable score_mod must still compile and run fused."""
    from flexattn_zoo.compile import CompiledFlex

    q = torch.randn(1, 2, 64, 16)
    bm = fz.block_mask(masks.Causal(), 64, 64)

    def breaking(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        torch._dynamo.graph_break()
        return score

    k, v = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    entry = CompiledFlex(10_000, None, False, False)
    with pytest.raises(Exception, match="graph_break"):
        entry(q, k, v, bm, 0.25, breaking)
    assert entry.compiles == 0  # nothing ran: no partial graph was compiled around an eager flex
    out, _ = entry(q, k, v, bm, 0.25, None)
    assert entry.compiles == 1
    assert_matches_reference(out, q, k, v, mask=masks.Causal(), scale=0.25)


def test_self_attention_reaches_the_cpu_flex_kernel_as_three_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before torch 2.13 Inductor's CPU flex kernel refuses q passed again as k / v (one graph
    input for two): the flex route then launches views, three tensor objects, same values."""
    from flexattn_zoo import _compat
    from flexattn_zoo.compile import CompiledFlex

    monkeypatch.setattr(_compat, "FLEX_CPU_NEEDS_DISTINCT_INPUTS", True)
    seen: list[tuple[torch.Tensor, ...]] = []
    call = CompiledFlex.run

    def spy(self, q, k, v, *rest):  # type: ignore[no-untyped-def]
        seen.append((q, k, v))
        return call(self, q, k, v, *rest)

    monkeypatch.setattr(CompiledFlex, "run", spy)
    x = torch.randn(1, 2, 64, 32)  # not padded (see test_flex_cpu_at_small_head_dims_...)
    spec = masks.SlidingWindow(left=5, right=0)
    out = fz.attention(x, x, x, mask=spec, backend="flex_cpu")
    assert_matches_reference(out, x, x, x, mask=spec)
    q, k, v = seen[-1]
    assert q is not k and q is not v and k is not v
    assert all(t.data_ptr() == x.data_ptr() for t in (q, k, v))  # views, not copies


def test_user_block_mask_path() -> None:
    q = torch.randn(1, 2, 100, 16)
    bm = fz.block_mask(masks.SlidingWindow(left=9, right=1), 100, 100)
    assert fz.plan(q, q, q, mask=bm).backend == "flex_cpu"
    out = fz.attention(q, q, q, mask=bm)
    assert_matches_reference(out, q, q, q, mask=masks.SlidingWindow(left=9, right=1))
    with pytest.raises(ValueError, match="built for lengths"):
        fz.attention(q[:, :, :50], q, q, mask=bm)
    with pytest.raises(ValueError, match="takes no BlockMask"):
        fz.attention(q, q, q, mask=bm, backend="sdpa_math")


def test_zero_length_sequences() -> None:
    q = torch.randn(1, 2, 5, 16, requires_grad=True)
    kv = torch.randn(1, 2, 0, 16, requires_grad=True)
    out, lse = fz.attention(q, kv, kv, return_lse=True)
    assert out.shape == (1, 2, 5, 16) and torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
    out.sum().backward()
    assert q.grad is not None and torch.equal(q.grad, torch.zeros_like(q))
    empty_q = torch.randn(1, 2, 0, 16)
    assert fz.attention(empty_q, q.detach(), q.detach()).shape == (1, 2, 0, 16)


def test_new_document_ids_each_step_reuse_the_compiled_kernel() -> None:
    """Packed training builds a new Document every step: same kernel, new ids, no recompiles."""
    q = torch.randn(1, 2, 256, 16)
    compiles = []
    for lengths in ([43, 51, 130, 32], [22, 65, 27, 142], [40, 216], [256]):
        spec = masks.Document.from_lengths(lengths) & masks.Causal()
        out = fz.attention(q, q, q, mask=spec, backend="flex_cpu")
        assert_matches_reference(out, q, q, q, mask=spec)  # the new ids were used, not stale ones
        compiles.append(COMPILE_CACHE.total_compiles())
    assert len(set(compiles)) == 1, compiles  # only the first step compiled


def test_score_mods_sharing_a_kernel_each_use_their_own_captured_tensors() -> None:
    """Two score mods with the same code share one compiled entry; each call must still read its
    own captured tensor (a decode offset, a learned bias), not the first caller's."""

    def head_bias(bias: torch.Tensor):  # type: ignore[no-untyped-def]
        def score(s, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return s + bias[h] * kv_idx / 32  # a per-row constant would cancel in the softmax

        return score

    q = torch.randn(1, 2, 128, 16)
    entries = set()
    for bias in (torch.tensor([0.0, 0.0]), torch.tensor([3.0, -3.0])):
        score = head_bias(bias)
        out = fz.attention(q, q, q, mask="causal", score_mod=score, backend="flex_cpu")
        assert_matches_reference(out, q, q, q, mask="causal", score_mod=score)
        entries.add(
            id(COMPILE_CACHE.get(masks.Causal().bind(128, 128).mask_mod(), score, None, False, False))
        )
    assert len(entries) == 1  # the point of the test: one shared compiled entry


def test_entry_near_recompile_limit_is_replaced_not_run_unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    from flexattn_zoo import _compat

    monkeypatch.setattr(_compat, "recompile_limit", lambda: 2)
    spec = masks.SlidingWindow(left=5, right=5)
    for length in (64, 96, 128, 160):  # static graph, then dynamic: would pass a limit of 2
        q = torch.randn(1, 2, length, 16)
        out = fz.attention(q, q, q, mask=spec, backend="flex_cpu")
        assert_matches_reference(out, q, q, q, mask=spec)


def test_a_recompile_limit_lowered_below_an_entrys_graphs_gets_a_fresh_entry() -> None:
    """Entries check torch's recompile limit when they compile. Lowered afterwards below an
    entry's graph count, the entry's next new graph is refused by Dynamo (the body would run
    eagerly: UnfusedFallbackError); the call then runs on a fresh entry instead of failing."""
    spec = masks.SlidingWindow(left=7, right=2)
    for length in (64, 96):  # two graphs: static, then dynamic
        q = torch.randn(1, 2, length, 16)
        fz.attention(q, q, q, mask=spec, backend="flex_cpu")
    before = len(COMPILE_CACHE)
    with torch._dynamo.config.patch(recompile_limit=2):
        # The projections' [B, L, H, D] layout (kept as a view): new strides, a third graph.
        q = torch.randn(1, 80, 2, 16).transpose(1, 2)
        out = fz.attention(q, q, q, mask=spec, backend="flex_cpu")
    assert_matches_reference(out, q, q, q, mask=spec)
    assert len(COMPILE_CACHE) >= before  # replaced in place, or one entry more


@pytest.mark.parametrize(
    ("lq", "heads", "q_block", "forced"),
    [
        (64, (8, 2), 128, True),  # 64 x 4 rows > 128: torch's decoding kernel has no config
        (32, (8, 2), 128, False),  # 128 rows fit
        (64, (8, 8), 128, False),
        (1, (32, 8), 128, False),  # decode steps keep the decoding kernel
        (100, (8, 1), 128, True),
        (128, (8, 2), 128, False),  # Lq >= 128: the main kernel anyway
        (16, (8, 2), 32, True),
    ],
)
def test_short_gqa_queries_avoid_the_decoding_kernel_without_a_config(lq, heads, q_block, forced) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from flexattn_zoo.backends.flex import _decode_kernel_has_no_config

    p = _problem(masks.Causal(), lq=lq, lkv=1024, heads=heads)
    assert _decode_kernel_has_no_config(p, SimpleNamespace(BLOCK_SIZE=(q_block, 128))) is forced
    assert not _decode_kernel_has_no_config(dataclasses.replace(p, device_type="cpu"), None)


def test_a_kv_pool_shared_by_the_batch_is_not_copied() -> None:
    """decode_step's paged pool is expanded to [B, ...]; a copy would cost B x the pool."""
    from flexattn_zoo.backends.flex import _canonical_layout

    q = torch.randn(4, 2, 1, 16)
    pool = torch.randn(1, 2, 256, 16)
    k, v = pool.expand(4, -1, -1, -1), pool.expand(4, -1, -1, -1)
    out = _canonical_layout(q, k, v)
    assert all(a is b for a, b in zip(out, (q, k, v), strict=True))
    sliced = torch.randn(4, 2, 64, 32)[..., :16]  # other strided inputs still become contiguous
    assert all(t.is_contiguous() for t in _canonical_layout(sliced, sliced, sliced))


def test_the_live_prefix_of_a_kv_cache_is_not_copied() -> None:
    """A decoding step's ``cache[:, :, :n]`` is read where it lies: a contiguous copy per step
    read and wrote the cache once more than attention reads it (measured on the H200: 1486 us
    per step against 245 for SDPA at B=32, 8K keys). Views that are not a cache prefix (rows
    not dense, heads out of order) are still copied."""
    from flexattn_zoo.backends.flex import _canonical_layout

    q = torch.randn(4, 8, 1, 16)
    cache = torch.randn(4, 2, 256, 16)
    k, v = cache[:, :, :100], cache[:, :, :100]
    out = _canonical_layout(q, k, v)
    assert all(a is b for a, b in zip(out, (q, k, v), strict=True))
    one_row = torch.randn(1, 1, 256, 16)[:, :, :7]
    assert _canonical_layout(q, one_row, one_row)[1] is one_row
    for other in (
        torch.randn(4, 2, 100, 32)[..., :16],  # rows of D not consecutive
        torch.randn(2, 4, 256, 16).transpose(0, 1)[:, :, :100],  # batch rows not spaced by the heads
    ):
        assert all(t.is_contiguous() for t in _canonical_layout(q, other, other)[1:])


def test_flex_over_cache_prefixes_matches_the_reference() -> None:
    """The flex route on live prefixes of one cache, the length changing every step (one
    dynamic-length graph), against float64."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 16, generator=gen)
    k_cache, v_cache = (torch.randn(2, 2, 96, 16, generator=gen) for _ in range(2))
    for n in (40, 41, 77, 96):
        k, v = k_cache[:, :, :n], v_cache[:, :, :n]
        out = fz.attention(q, k, v, enable_gqa=True, backend="flex_cpu")
        assert_matches_reference(out, q, k, v, enable_gqa=True)


@pytest.mark.parametrize("head_dim", [8, 16])
def test_flex_cpu_at_small_head_dims_matches_the_reference(
    head_dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's compiled CPU flex kernel returned wrong values (NaN among them) at head dims 8 and
    16 for key lengths 24, 40, 56, ... at static shapes (torch 2.13 on an AVX2 machine); the route
    pads the head dims with zeros instead (``FlexBackend.pad_head_dims_to``). Each length compiled
    static, as a first call does, on every path that reaches the kernel: the route's run (a first
    call), its bound call (a repeated call, from the plan cache), the prepared call ``fz.decode``
    launches itself for its BlockMask, and the call traced into a caller's ``torch.compile``."""
    from flexattn_zoo import plan_cache
    from flexattn_zoo.backends.flex import CPU_FLEX_MIN_HEAD_DIM
    from flexattn_zoo.lru import LRUCache
    from flexattn_zoo.models import decode

    plans: LRUCache = LRUCache(16)
    monkeypatch.setattr(plan_cache, "PLANS", plans)
    gen = torch.Generator().manual_seed(0)
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        for lq, kv_len, kv_heads in ((1, 40, 2), (8, 24, 4), (8, 56, 4)):
            gqa = kv_heads != 4
            for repeat in (False, True):  # planned and run, then the plan cache's bound call
                inserts = plans.inserts
                q = torch.randn(2, 4, lq, head_dim, generator=gen)
                k, v = (torch.randn(2, kv_heads, kv_len, head_dim, generator=gen) for _ in range(2))
                out = fz.attention(q, k, v, enable_gqa=gqa, backend="flex_cpu")
                assert plans.inserts == inserts + (not repeat)
                assert_matches_reference(out, q, k, v, enable_gqa=gqa)
        # Value head dim apart from q/k's, each padded on its own.
        q, k = (torch.randn(1, 2, 24, head_dim, generator=gen) for _ in range(2))
        v = torch.randn(1, 2, 24, 48, generator=gen)
        out = fz.attention(q, k, v, mask="causal", backend="flex_cpu")
        assert out.shape == (1, 2, 24, 48)
        assert_matches_reference(out, q, k, v, mask="causal")
        # fz.decode's own launch of the prepared call, over caches of those lengths.
        decode.CACHE.clear()
        with torch.no_grad():
            for capacity in (24, 40):
                q = torch.randn(2, 4, 1, head_dim, generator=gen)
                k, v = (torch.randn(2, 2, capacity, head_dim, generator=gen) for _ in range(2))
                out = decode.decode_step(q, k, v, capacity - 3, backend="flex_cpu")
                live = k[:, :, : capacity - 3], v[:, :, : capacity - 3]
                assert_matches_reference(out, q, *live, enable_gqa=True)
            runs = [run for dm in decode.CACHE.values() for run in dm.runs.values()]
            assert runs and all(
                run.call is not None and run.call.pad_to == CPU_FLEX_MIN_HEAD_DIM for run in runs
            )
        # Traced into a caller's graph (fullgraph: padding breaks none), v's head dim its own.
        q, k, v = (torch.randn(2, 4, 40, head_dim, generator=gen) for _ in range(3))
        compiled = torch.compile(
            lambda a, b, c: fz.attention(a, b, c[:, :, :, :4], backend="flex_cpu"), fullgraph=True
        )
        out = compiled(q[:, :, :1], k, v)
        assert out.shape == (2, 4, 1, 4)
        assert_matches_reference(out, q[:, :, :1], k, v[..., :4])


def test_flex_kernel_options_for_the_decoding_kernel() -> None:
    """The decoding kernel drops the forward's BLOCK_M (128 rows would replace its 16 packed
    ones); inputs spanning >= 2**31 elements, which its template cannot compile, take the main
    kernel; longer queries keep the tuned forward options."""
    from types import SimpleNamespace

    from flexattn_zoo.backends.flex import FLEX, MAX_FLEX_ELEMENTS

    bm = SimpleNamespace(BLOCK_SIZE=(128, 128))
    decode = _problem(masks.Causal(), lq=1, lkv=4096, heads=(32, 8), arch="sm90", dtype=torch.bfloat16, d=128)
    opts = FLEX.options(decode, bm)
    assert "fwd_BLOCK_M" not in opts and opts["fwd_BLOCK_N"] == 128 and "BACKEND" not in opts
    huge = dataclasses.replace(decode, index_extent=MAX_FLEX_ELEMENTS)
    assert FLEX.options(huge, bm)["BACKEND"] == "TRITON"
    assert "BACKEND" not in FLEX.options(dataclasses.replace(decode, index_extent=MAX_FLEX_ELEMENTS - 1), bm)
    prefill = _problem(
        masks.Causal(), lq=4096, lkv=4096, heads=(32, 8), arch="sm90", dtype=torch.bfloat16, d=128
    )
    assert FLEX.options(prefill, bm)["fwd_BLOCK_M"] == 128
    # A paged decode of 16-key pages: the measured 128-key tile cannot walk a 16-key block.
    small = FLEX.options(decode, SimpleNamespace(BLOCK_SIZE=(128, 16)))
    assert "fwd_BLOCK_N" not in small and small["fwd_num_warps"] == 8
    assert "fwd_BLOCK_M" not in FLEX.options(prefill, SimpleNamespace(BLOCK_SIZE=(64, 64)))


def test_problems_record_the_index_extent_of_their_inputs() -> None:
    q = torch.randn(2, 4, 8, 16)
    pool = torch.randn(1, 4, 32, 16).expand(2, -1, -1, -1)  # shared across the batch: counted once
    assert fz.plan(q, pool, pool).problem.index_extent == max(q.numel(), pool[0].numel())
    t = torch.randn(2, 8, 4, 16).transpose(1, 2)
    assert fz.plan(t, t, t).problem.index_extent == t.numel()


# ---- inputs torch's CPU fused kernels get wrong --------------------------------------------------


def _qkv(*shape: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) for _ in range(3)]


@pytest.mark.parametrize("scale", [0.0, -0.5])
@pytest.mark.parametrize(
    "mask",
    [None, "causal", masks.PrefixLM(prefix_len=9), masks.Chunked(size=16) & masks.Causal()],
    ids=["none", "causal", "prefix_lm", "chunked_causal"],
)
def test_nonpositive_scale_matches_the_reference_on_cpu(mask: object, scale: float) -> None:
    # torch's CPU flash kernel returns NaN rows for causal calls with scale <= 0; sdpa_flash and
    # sdpa_split refuse those, so auto takes another route. A positive-scale call first: its cached
    # plan must not serve the non-positive one.
    q, k, v = _qkv(1, 2, 64, 8)
    fz.attention(q, k, v, mask=mask, scale=0.3)
    out = fz.attention(q, k, v, mask=mask, scale=scale)
    assert_matches_reference(out, q, k, v, mask=mask, scale=scale)


def test_cpu_flash_routes_refuse_causal_calls_with_nonpositive_scale() -> None:
    q, k, v = _qkv(1, 2, 64, 8)
    with pytest.raises(ValueError, match=r"sdpa_flash.*scale <= 0"):
        fz.attention(q, k, v, mask="causal", scale=0.0, backend="sdpa_flash")
    with pytest.raises(ValueError, match=r"sdpa_split.*scale <= 0"):
        fz.attention(q, k, v, mask=masks.PrefixLM(prefix_len=9), scale=-1.0, backend="sdpa_split")
    out = fz.attention(q, k, v, scale=0.0, backend="sdpa_flash")  # unmasked calls stay exact
    assert_matches_reference(out, q, k, v, scale=0.0)


@pytest.mark.parametrize(
    ("backend", "mask"),
    [("sdpa_flash", None), ("sdpa_flash", "causal"), ("sdpa_split", masks.PrefixLM(prefix_len=2))],
)
def test_overlapping_query_rows_are_copied_for_fused_cpu_kernels(backend: str, mask: object) -> None:
    # An unfold view: [2, 3, 5, 8] with strides (36, 12, 1, 1), so rows share memory. torch's CPU
    # flash kernel returned garbage (errors up to 3e26, or NaN) when given it as it is.
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 12, generator=gen).unfold(-1, 8, 1)
    k, v = (torch.randn(2, 3, 5, 8, generator=gen) for _ in range(2))
    out = fz.attention(q, k, v, mask=mask, backend=backend)
    assert_matches_reference(out, q, k, v, mask=mask)


def _views() -> dict[str, tuple[torch.Tensor, bool]]:
    """4-D views and whether each is a block of a contiguous [B,H,L,D] / [B,L,H,D] tensor."""
    cache = torch.randn(2, 4, 40, 16)
    return {
        "contiguous": (cache, True),
        "cache prefix": (cache[:, :, :25], True),
        "bshd view": (cache.transpose(1, 2), True),
        "bshd prefix": (cache.transpose(1, 2)[:, :25].transpose(1, 2), True),
        "every other row": (cache[:, :, ::2], True),
        "d slice": (cache[..., :8], True),
        "one query row": (cache[:, :, 7:8], True),
        "broadcast heads": (cache[:, :1].expand(2, 4, 40, 16), False),
        "d strided": (cache.transpose(2, 3), False),
        "overlapping rows": (torch.randn(2, 4, 48).unfold(-1, 16, 1)[:, :, :40], False),
    }


@pytest.mark.parametrize("name", list(_views()))
def test_fused_sdpa_kernels_read_dense_blocks_without_a_copy(name: str) -> None:
    from flexattn_zoo.backends.base import copies_by_strides, fused_layout, is_dense_block, laid_out

    view, dense = _views()[name]
    assert is_dense_block(view) is dense or view.is_contiguous()
    assert (fused_layout(view) is view) is (dense or view.is_contiguous())
    # What a bound SDPA call decides once per shape and strides, and then does per call.
    assert copies_by_strides(view) is not (dense or view.is_contiguous())
    other = torch.randn(2, 4, 40, 16)  # contiguous: never copied, beside a view that may be
    for position in range(3):
        given = [other, other, other]
        given[position] = view
        flags = tuple(copies_by_strides(t) for t in given)
        laid = laid_out(*given, flags)
        assert (laid[position] is view) is (dense or view.is_contiguous())
        assert laid[position].is_contiguous() or laid[position] is view
        assert torch.equal(laid[position], view)
        assert all(laid[i] is other for i in range(3) if i != position)


@pytest.mark.parametrize("name", list(_views()))
def test_repeated_calls_on_views_match_the_reference(name: str) -> None:
    # Every call below runs the bound SDPA call the plan cache keeps for these shapes and strides
    # (the second one a hit), which decides on its first call which inputs the kernel reads as
    # they are: broadcast, overlapping and D-strided views must be copied every time.
    view = _views()[name][0]
    for _ in range(2):
        out = fz.attention(view, view, view, backend="sdpa_flash")
        assert_matches_reference(out, view, view, view)


@pytest.mark.parametrize("name", ["cache prefix", "bshd prefix", "every other row", "one query row"])
@pytest.mark.parametrize("backend", ["sdpa_flash", "sdpa_math", "auto"])
def test_sliced_kv_cache_views_match_the_reference(name: str, backend: str) -> None:
    # A decode step over the live prefix of a cache (k_cache[:, :, :n]) runs on the view itself.
    k = _views()[name][0]
    v = torch.randn(k.shape[0], k.shape[1], 64, k.shape[3])[:, :, : k.shape[2]]
    q = torch.randn(2, 4, 3, 16)
    out = fz.attention(q, k, v, backend=backend)
    assert_matches_reference(out, q, k, v)


def test_flex_flash_refuses_masks_that_read_captured_scalar_offsets() -> None:
    # FA4's CuTe mask codegen (torch 2.11) cannot load a captured 0-d tensor; OffsetCausal and Band
    # keep their offsets in such tensors (one compiled kernel for every decode step).
    from flexattn_zoo.backends.flex import FLEX, FLEX_FLASH
    from flexattn_zoo.masks.band import Band
    from flexattn_zoo.masks.causal import OffsetCausal

    reason = "reads a captured tensor of one element"
    for mask, lq, lkv in [
        (OffsetCausal(offset=3), 256, 256),
        (masks.Causal(align="bottom_right"), 200, 2047),  # binds to OffsetCausal
        (Band(lo=-4, hi=0) & masks.Document(doc_ids=torch.zeros(256, dtype=torch.long)), 256, 256),
        (~OffsetCausal(offset=1), 256, 256),
    ]:
        p = _problem(mask, lq=lq, lkv=lkv)
        assert any(reason in r for r in FLEX_FLASH.mask_reasons(p)), mask
        assert not any(reason in r for r in FLEX.mask_reasons(p))
    for mask in (
        masks.Causal(),
        masks.SlidingWindow(left=64),
        masks.Document(doc_ids=torch.zeros(256, dtype=torch.long)),
    ):
        assert not any(reason in r for r in FLEX_FLASH.mask_reasons(_problem(mask, lq=256, lkv=256)))


def test_sdpa_route_refusals() -> None:
    """Route ``sdpa`` (SDPA's own kernel choice) refuses what it cannot promise: reproducible
    runs, rows an attn_mask may leave empty, and equal chunks (sdpa_cudnn's view)."""
    assert plan_problem(_problem(masks.Causal()), "sdpa").backend == "sdpa"
    det = dataclasses.replace(_problem(masks.Causal()), deterministic=True)
    with pytest.raises(ValueError, match="SDPA chooses its kernel per call"):
        plan_problem(det, "sdpa")
    padded = masks.KeyPadding(valid=torch.tensor([[True, True, False], [False, False, False]]))
    with pytest.raises(ValueError, match="may leave a query row seeing no key"):
        plan_problem(_problem(padded, lq=3, batch=2), "sdpa")
    full_rows = masks.KeyPadding(valid=torch.tensor([[True, True, False], [True, False, False]]))
    assert plan_problem(_problem(full_rows, lq=3, batch=2), "sdpa").backend == "sdpa"
    with pytest.raises(ValueError, match="equal chunks only through sdpa_cudnn"):
        plan_problem(_problem(masks.Chunked(size=256) & masks.Causal()), "sdpa")
    with pytest.raises(ValueError, match="score_mod"):
        plan_problem(_problem(masks.Causal(), score_mods.SoftCap(cap=30.0)), "sdpa")


def test_fa4_head_dims_per_generation() -> None:
    """The fa4 route takes the head dims its kernels ran at, per GPU generation (sm90: 64 to 256
    but 80; sm100: 64/96/128), and says why it refuses the others."""
    from flexattn_zoo.backends.fa4 import FA4

    def said(d: int, arch: str = "sm90") -> list[str]:
        return [r for r in FA4.reasons(_problem(masks.Causal(), d=d, arch=arch)) if "head dim" in r]

    for d in (64, 96, 128, 192, 256):
        assert not said(d), d
    assert said(80) == ["head dim 80: the kernels run at 64, 96, 128, 192, 256 on sm90"]
    assert said(512) == ["head dim 512 outside 64..256"]
    assert said(256, "sm100") and not said(128, "sm100")


@pytest.mark.parametrize("arch", ["sm80", "sm90", "sm100", "cpu"])
def test_lazy_plans_choose_what_full_plans_choose(arch: str) -> None:
    """``plan_problem(lazy=True)`` (the eager call's plan: only the routes the choice needs are
    asked) picks the route the full verdicts pick, and its ``candidates`` are the full verdicts."""
    from flexattn_zoo.dispatch import plan_problem
    from flexattn_zoo.testing import spec_examples

    device = "cpu" if arch == "cpu" else "cuda"
    dtypes = [torch.float32, torch.bfloat16] if device == "cpu" else [torch.bfloat16]
    specs = [None, *(s for _, s in spec_examples("mask", 256, 256, batch=2, heads=4))]
    seen = set()
    for mask in specs:
        for dtype in dtypes:
            for lq, grad, heads in ((256, False, (4, 4)), (1, False, (4, 2)), (256, True, (4, 2))):
                try:
                    p = _problem(
                        mask,
                        arch=arch,
                        dtype=dtype,
                        d=64,
                        lq=lq,
                        lkv=256,
                        grad=grad,
                        heads=heads,
                        device=device,
                        batch=2,
                    )
                except ValueError:
                    continue  # a spec that does not fit these sizes
                for backend in ("auto", "dense", "flex"):
                    try:
                        full = plan_problem(p, backend)
                    except ValueError as exc:
                        with pytest.raises(ValueError) as lazy_exc:
                            plan_problem(p, backend, lazy=True)
                        assert str(lazy_exc.value) == str(exc)
                        continue
                    lazy = plan_problem(p, backend, lazy=True)
                    assert lazy.verdicts is None
                    assert (lazy.backend, lazy.requested) == (full.backend, full.requested)
                    assert lazy.candidates == full.candidates
                    seen.add(lazy.backend)
    assert len(seen) >= 3, seen


def test_sdpa_route_leaves_cudnn_out_when_decoding_on_cuda() -> None:
    """The route ``sdpa`` (SDPA's own choice) decoding on CUDA chooses among FlashAttention-2, the
    memory-efficient and the math kernel: cuDNN plans every new shape, and generation meets a new
    cache length every step. Longer query blocks keep SDPA's full choice; pinned routes their kernel."""
    from flexattn_zoo.backends.sdpa import DECODE_QUERIES, SDPA_CHOICE, SDPA_CUDNN, WITHOUT_CUDNN

    decode = _problem(lq=1, lkv=4096, heads=(32, 8), d=128)
    prefill = _problem(lq=4096, lkv=4096, heads=(32, 8), d=128)
    assert SDPA_CHOICE.launch_kernels(decode) == WITHOUT_CUDNN
    assert "CUDNN_ATTENTION" not in WITHOUT_CUDNN
    assert SDPA_CHOICE.launch_kernels(_problem(lq=DECODE_QUERIES, lkv=4096)) == WITHOUT_CUDNN
    assert SDPA_CHOICE.launch_kernels(_problem(lq=DECODE_QUERIES + 1, lkv=4096)) is None
    assert SDPA_CHOICE.launch_kernels(prefill) is None
    assert (
        SDPA_CHOICE.launch_kernels(_problem(lq=1, lkv=64, device="cpu", arch="cpu", dtype=torch.float32))
        is None
    )
    assert SDPA_CUDNN.launch_kernels(decode) == ("CUDNN_ATTENTION",)


def test_sdpa_route_lets_cudnn_decode_a_shape_it_meets_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bound decoding call (one per exact shape in the plan cache) runs without cuDNN at first
    and, on sm90 without gradients, with SDPA's full choice from its second call on (cuDNN's plan
    for a repeated shape is built once); never under torch.compile, and a CUDA graph captures
    cuDNN only after it ran eagerly. Prefill calls keep SDPA's full choice from the first call."""
    from flexattn_zoo.backends import sdpa as sdpa_module
    from flexattn_zoo.backends.sdpa import SDPA_CHOICE, WITHOUT_CUDNN

    enabled: list[Any] = []
    capturing = [False]

    def recording(sdpa, q, k, v, scale, kernels, traced=None):  # type: ignore[no-untyped-def]
        enabled.append(kernels)
        return q

    asked = [0]

    def is_capturing(q: torch.Tensor) -> bool:
        asked[0] += 1
        return capturing[0]

    monkeypatch.setattr(sdpa_module, "_launch_sdpa", recording)
    monkeypatch.setattr(sdpa_module, "_capturing", is_capturing)
    q = torch.zeros(2, 4, 1, 8)
    kv = torch.zeros(2, 4, 64, 8)
    decode = _problem(lq=1, lkv=64, heads=(4, 4), d=8, batch=2)
    run = SDPA_CHOICE.bound_run(decode, torch.device("cpu"))
    for _ in range(3):
        run(q, kv, kv, 0.5)
    assert enabled == [WITHOUT_CUDNN, None, None]

    enabled.clear()
    run = SDPA_CHOICE.bound_run(decode, torch.device("cpu"))
    capturing[0] = True
    for _ in range(3):  # captured before cuDNN ever ran eagerly: never cuDNN, and not counted
        run(q, kv, kv, 0.5)
    capturing[0] = False
    run(q, kv, kv, 0.5)
    run(q, kv, kv, 0.5)  # the second eager call: cuDNN joins, eagerly
    capturing[0] = True
    asked[0] = 0
    run(q, kv, kv, 0.5)  # now it may be captured
    assert enabled == [WITHOUT_CUDNN] * 4 + [None, None]
    assert asked[0] == 0  # once cuDNN ran eagerly, capture no longer matters: not asked per call

    for other in (  # measured on sm90 forward only; cuDNN decoding bugs reported elsewhere
        _problem(lq=1, lkv=64, heads=(4, 4), d=8, batch=2, arch="sm100"),
        _problem(lq=1, lkv=64, heads=(4, 4), d=8, batch=2, grad=True),
    ):
        enabled.clear()
        run = SDPA_CHOICE.bound_run(other, torch.device("cpu"))
        for _ in range(3):
            run(q, kv, kv, 0.5)
        assert enabled == [WITHOUT_CUDNN] * 3

    enabled.clear()
    prefill = _problem(lq=64, lkv=64, heads=(4, 4), d=8, batch=2)
    run = SDPA_CHOICE.bound_run(prefill, torch.device("cpu"))
    capturing[0] = False
    run(kv, kv, kv, 0.5)
    assert enabled == [None]

    enabled.clear()
    compiling = torch.compile(
        lambda a, b: SDPA_CHOICE.bound_run(decode, torch.device("cpu"))(a, b, b, 0.5)[0],
        backend="eager",
        fullgraph=True,
    )
    for _ in range(3):
        compiling(q, kv)
    assert enabled and all(kernels == WITHOUT_CUDNN for kernels in enabled)


def _reasons_while_traced(backend: Any, p: Problem) -> list[str]:
    """``backend.mask_reasons(p)`` computed inside a compiled function (as a traced call plans)."""
    found: list[list[str]] = []

    def probe(t: torch.Tensor) -> torch.Tensor:
        found.append(backend.mask_reasons(p))
        return t + 1

    torch._dynamo.reset()
    torch.compile(probe, backend="eager", fullgraph=True)(torch.ones(1))
    return found[0]


def test_flex_flash_refuses_forward_only_graphs() -> None:
    """In a forward-only compiled graph Inductor's CuTe flex template failed (inputs computed in
    the graph, tensors the mask captures): flex_flash refuses there, naming the graph, and keeps
    training graphs and eager calls."""
    from flexattn_zoo.backends.flex import FLEX, FLEX_FLASH

    reason = "inside a torch.compile'd graph without gradients"
    doc = masks.Document(doc_ids=torch.zeros(256, dtype=torch.long)) & masks.Causal()
    for mask in (doc, masks.SlidingWindow(left=64)):
        inference, training = _problem(mask, lq=256), _problem(mask, lq=256, grad=True)
        assert any(reason in r for r in _reasons_while_traced(FLEX_FLASH, inference))
        assert not any(reason in r for r in _reasons_while_traced(FLEX_FLASH, training))
        assert not any(reason in r for r in FLEX_FLASH.mask_reasons(inference))
        assert not any(reason in r for r in _reasons_while_traced(FLEX, inference))


def test_a_named_route_refusing_a_data_mask_in_a_graph_names_the_graph() -> None:
    """A named route's refusal while traced, for a call whose mask holds tensors, says that the
    graph does not read them (forms built from their values are why routes accept such calls
    eagerly); without tensors, or eagerly, the refusal is the route's own."""
    from flexattn_zoo.dispatch import TRACED_DATA_NOTE

    doc = masks.Document(doc_ids=torch.zeros(256, dtype=torch.long)) & masks.Causal()
    errors: list[str] = []

    def probe(t: torch.Tensor, mask: Any) -> torch.Tensor:
        try:
            plan_problem(_problem(mask, lq=256), "sdpa_flash")
        except ValueError as err:
            errors.append(str(err))
        return t + 1

    for mask in (doc, masks.SlidingWindow(left=64)):
        torch._dynamo.reset()
        torch.compile(lambda t, m=mask: probe(t, m), backend="eager", fullgraph=True)(torch.ones(1))
        with pytest.raises(ValueError) as eager:
            plan_problem(_problem(mask, lq=256), "sdpa_flash")
        assert TRACED_DATA_NOTE not in str(eager.value)
    assert TRACED_DATA_NOTE in errors[0]
    assert TRACED_DATA_NOTE not in errors[1]


def test_the_layout_checks_read_no_data_pointer_while_traced(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused SDPA routes check a CUDA input's start for 16-byte alignment (the kernels fault
    on a misaligned one) -- but not while torch.compile traces them, where ``data_ptr`` cannot be
    traced (Dynamo stops: here it raises, on fake CUDA tensors): a graph must not break there."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from flexattn_zoo import _compat
    from flexattn_zoo.backends.base import fused_layout, is_dense_block

    def traced_data_ptr(self: torch.Tensor) -> int:
        raise RuntimeError("data_ptr read while traced")  # Dynamo: "Unsupported"

    monkeypatch.setattr(_compat, "is_compiling", lambda: True)
    monkeypatch.setattr(torch.Tensor, "data_ptr", traced_data_ptr)
    monkeypatch.setattr(FakeTensor, "data_ptr", traced_data_ptr, raising=False)
    with FakeTensorMode():
        contiguous = torch.empty(2, 3, 8, 16, device="cuda", dtype=torch.bfloat16)
        bshd = torch.empty(2, 8, 3, 16, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        assert fused_layout(contiguous) is contiguous
        assert is_dense_block(bshd) and fused_layout(bshd) is bshd


def test_fa4_takes_deepseek_value_dims_on_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """q/k 192 with v 128: FA4's kernels run it on sm90 (forward with any heads, backward without
    grouped-query attention); other pairs and generations are refused by name, and with FA4
    installed auto takes it for the long causal case (DeepSeek-style attention)."""
    from flexattn_zoo.backends.fa4 import FA4

    monkeypatch.setattr(_compat, "flash_cute_available", lambda: True)
    mla = dict(d=192, v_dim=128, batch=2, lq=8192, mask=masks.Causal())
    assert FA4.reasons(_problem(**mla)) == []
    assert FA4.reasons(_problem(**mla, grad=True)) == []
    assert FA4.reasons(_problem(**mla, heads=(16, 4))) == []
    grouped = FA4.reasons(_problem(**mla, heads=(16, 4), grad=True))
    assert any("value head dim equal" in r for r in grouped), grouped
    other = FA4.reasons(_problem(mask=masks.Causal(), d=256, v_dim=128))
    assert any("q/k head dim 256 with value head dim 128" in r for r in other), other
    blackwell = FA4.reasons(_problem(**mla, arch="sm100"))
    assert any("value head dim" in r for r in blackwell), blackwell
    assert plan_problem(_problem(**mla)).backend == "fa4"
    assert plan_problem(_problem(**mla, grad=True)).backend == "fa4"


@pytest.mark.parametrize("fa4", [False, True])
def test_decoding_takes_sdpa_with_or_without_fa4(fa4: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """One query over any cache: SDPA's own choice, FA4 installed or not (cuDNN once a shape
    repeats ties FA4 at one length, and FlashAttention-2 beats it while the length grows: 0.34 vs
    0.55 ms per step at B=32, 32:8 heads, 8K keys on the H200); not Triton flex, whose
    dynamic-shape kernel, which a generation loop's changing lengths compile, is slower."""
    monkeypatch.setattr(_compat, "flash_cute_available", lambda: fa4)
    for lq, lkv, batch in ((1, 8192, 32), (1, 32768, 64), (1, 4096, 32), (1, 32768, 8), (2, 8192, 32)):
        assert plan_problem(_problem(None, lq=lq, lkv=lkv, batch=batch, heads=(32, 8))).backend == "sdpa"


def test_explain_says_where_the_order_came_from() -> None:
    """``Plan.explain()`` names the arch's table and every measured rule that reordered it (with
    the benchmark its rows are in), or says none applied, or that the caller named the route."""
    decoding = plan_problem(_problem(None, lq=1, lkv=8192, batch=32, heads=(32, 8))).explain()
    assert "order: the sm90 table for fwd, then these measured rules" in decoding
    assert "flex, sdpa_split, varlen first: short forwards" in decoding
    assert "5 rows of generalization_h200.json" in decoding
    plain = plan_problem(_problem(masks.Causal())).explain()
    assert "order: the sm90 table for fwd, no measured rule applies" in plain
    named = plan_problem(_problem(masks.Causal()), "flex").explain()
    assert "order: none asked (route 'flex' named)" in named


def test_sdpa_route_leaves_cudnn_out_of_masked_training_at_lengths_64_mod_128() -> None:
    """cuDNN's SDPA backward with an attn_mask gives NaN dQ at lengths of 64 mod 128 when a row's
    logsumexp is very negative (pytorch/pytorch#196678, torch 2.11 and later): SDPA's own choice
    runs such calls without cuDNN; other lengths, forward-only calls and calls without a mask
    tensor keep the full choice."""
    from flexattn_zoo.backends.sdpa import SDPA_CHOICE, WITHOUT_CUDNN

    def padded(n: int) -> masks.KeyPadding:
        valid = torch.ones(2, n, dtype=torch.bool)
        valid[0, -5:] = False
        return masks.KeyPadding(valid=valid)

    def kernels(mask: Any, lq: int, lkv: int | None = None, grad: bool = True) -> Any:
        return SDPA_CHOICE.launch_kernels(
            _problem(mask, lq=lq, lkv=lkv, grad=grad, batch=2, heads=(4, 4), d=64)
        )

    for n in (64, 192, 704, 2112):
        assert kernels(padded(n), n) == WITHOUT_CUDNN
    assert kernels(padded(704), 512, 704) == WITHOUT_CUDNN  # the key length alone
    assert kernels(padded(512), 704, 512) == WITHOUT_CUDNN  # the query length alone
    for n in (128, 640, 768, 700):
        assert kernels(padded(n), n) is None
    assert kernels(padded(704), 704, grad=False) is None
    assert kernels(masks.Causal(), 704) is None  # is_causal, no mask tensor


def test_a_bound_flex_call_runs_its_compiled_graph_without_dynamo_after_its_first_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plan-cache hit on a flex route skips the compiled entry's signature check and Dynamo's
    frame evaluation and guards: its key pins q/k/v's shapes, strides and grad flags, so from its
    second call the bound call runs the compiled graph its first call ran as a plain function
    (``CompiledFlex.run_unguarded``), and every call stays exact, with new values each call.
    The call that plans it runs it through the bound call already."""
    calls = spy_compiled_flex(monkeypatch)
    spec = masks.SlidingWindow(left=7, right=0)
    g = torch.Generator().manual_seed(11)
    for step in range(4):
        q, k, v = (torch.randn(1, 2, 96, 32, generator=g) for _ in range(3))
        out = fz.attention(q, k, v, mask=spec, backend="flex_cpu")
        assert_matches_reference(out, q, k, v, mask=spec)
        assert counts(calls) == (1, 0, step)


def test_an_unguarded_flex_graph_runs_only_for_its_scale_and_tensors_it_reads_each_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The graph a bound flex call runs without guards was compiled for one scale: a hit with
    another scale goes through the checked call (Dynamo's guards decide what it needs) and
    memoizes that scale's graph. Spec tensors are read on each call: ids rewritten in place
    change the result as they change the reference."""
    calls = spy_compiled_flex(monkeypatch)
    ids = torch.tensor([0] * 40 + [1] * 56)
    spec = masks.Document(doc_ids=ids) & masks.Causal()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 96, 32, generator=g) for _ in range(3))
    for scale, expected in ((0.2, (1, 0, 0)), (0.2, (1, 0, 1)), (0.3, (2, 0, 1)), (0.3, (2, 0, 2))):
        out = fz.attention(q, k, v, mask=spec, scale=scale, backend="flex_cpu")
        assert_matches_reference(out, q, k, v, mask=spec, scale=scale)
        assert counts(calls) == expected
    ids[30:40] = 1  # documents of 30 and 66 tokens now
    for _ in range(2):
        out = fz.attention(q, k, v, mask=spec, scale=0.3, backend="flex_cpu")
        assert_matches_reference(out, q, k, v, mask=spec, scale=0.3)


def test_a_bound_flex_call_compiles_again_after_torch_compiler_reset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``torch.compiler.reset()`` drops Dynamo's graphs, and with them the one a bound flex call
    runs without Dynamo: its next call runs through Dynamo (which compiles again, through the
    backend in place now) and later calls run that new graph."""
    from flexattn_zoo.compile import CACHE

    calls = spy_compiled_flex(monkeypatch)
    spec = masks.SlidingWindow(left=4, right=0)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=g) for _ in range(3))
    for _ in range(2):
        fz.attention(q, k, v, mask=spec, backend="flex_cpu")
    assert counts(calls) == (1, 0, 1)
    before = CACHE.total_compiles()
    torch.compiler.reset()
    for _ in range(2):
        out = fz.attention(q, k, v, mask=spec, backend="flex_cpu")
        assert_matches_reference(out, q, k, v, mask=spec)
    assert counts(calls) == (2, 0, 2)
    assert CACHE.total_compiles() == before + 1


def test_a_bound_flex_call_runs_its_unguarded_graph_only_for_inputs_aliased_alike() -> None:
    """``fz.attention(x, x, x)`` and three distinct tensors of the same shapes share a plan-cache
    entry (the key pins shapes, not identity), but Dynamo passes one object to its graph once:
    the graph compiled for x, x, x must not run for q, k, v (nor the other way round)."""
    spec = masks.SlidingWindow(left=6, right=0)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(1, 2, 64, 32, generator=g)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=g) for _ in range(3))
    for args in ((x, x, x), (x, x, x), (q, k, v), (q, k, v), (x, x, x), (q, q, v)):
        out = fz.attention(*args, mask=spec, backend="flex_cpu")
        assert_matches_reference(out, *args, mask=spec)


def test_a_bound_flex_call_runs_its_unguarded_graph_only_under_its_global_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The unguarded graph runs only under the global state Dynamo's guards compare, as at its
    first call: a change the plan-cache key does not hold (here torch's thread count) sends the
    call through Dynamo again, as without the shortcut, with exact results (the CPU flex kernel
    compiled for one thread count corrupts memory under another)."""
    calls = spy_compiled_flex(monkeypatch)
    spec = masks.SlidingWindow(left=9, right=0)
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=g) for _ in range(3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for _ in range(2):
            fz.attention(q, k, v, mask=spec, backend="flex_cpu")
        assert counts(calls) == (1, 0, 1)
        torch.set_num_threads(2)
        for _ in range(2):
            assert_matches_reference(fz.attention(q, k, v, mask=spec, backend="flex_cpu"), q, k, v, mask=spec)
        assert counts(calls) == (2, 0, 2)
    finally:
        torch.set_num_threads(threads)


def test_a_bound_flex_call_runs_its_unguarded_graph_under_the_autocast_it_was_picked_under(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Training under ``torch.autocast`` keeps the unguarded graph (autocast's state is part of the
    global state the graph is checked against); the same inputs outside that autocast region go
    through Dynamo again, and every call is exact."""
    calls = spy_compiled_flex(monkeypatch)
    spec = masks.SlidingWindow(left=13, right=0)
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=g).to(torch.bfloat16) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(3):
            out = fz.attention(q, k, v, mask=spec, backend="flex_cpu")
            assert_matches_reference(out, q, k, v, mask=spec)
    assert counts(calls) == (1, 0, 2)
    with torch.autocast("cpu", dtype=torch.float16):  # q, k, v cast to float16: another plan
        assert_matches_reference(fz.attention(q, k, v, mask=spec, backend="flex_cpu"), q, k, v, mask=spec)
    assert counts(calls) == (2, 0, 2)
    # No autocast: the bf16 inputs' plan again, under another global state: through Dynamo once,
    # then unguarded under this state.
    for _ in range(2):
        assert_matches_reference(fz.attention(q, k, v, mask=spec, backend="flex_cpu"), q, k, v, mask=spec)
    assert counts(calls) == (3, 0, 3)


def test_a_bound_flex_call_keeps_dynamo_under_a_torch_function_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under a torch function mode (or a dispatch mode, a functorch transform) a hit
    runs its code through Dynamo (``CompiledFlex.rerun``), which sees the mode, instead of the
    unguarded graph, which would run its kernels past it."""
    calls = spy_compiled_flex(monkeypatch)
    spec = masks.SlidingWindow(left=3, right=0)
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=g) for _ in range(3))
    fz.attention(q, k, v, mask=spec, backend="flex_cpu")

    class Passthrough(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    with Passthrough():
        out = fz.attention(q, k, v, mask=spec, backend="flex_cpu")
    assert_matches_reference(out, q, k, v, mask=spec)
    assert counts(calls) == (1, 1, 0)
    out = fz.attention(q, k, v, mask=spec, backend="flex_cpu")
    assert counts(calls) == (1, 1, 1)


def test_the_plan_cache_key_holds_which_input_requires_grad() -> None:
    """Calls that differ only in which of q/k/v requires grad are planned and bound apart (a
    flex route's bound call runs code Dynamo compiled for its inputs' flags), and each call's
    gradients are exact (on the CPU: flex_cpu has no backward, so auto takes another route)."""
    from flexattn_zoo import plan_cache

    spec = masks.SlidingWindow(left=5, right=0)
    g = torch.Generator().manual_seed(12)
    base = [torch.randn(1, 2, 64, 32, generator=g) for _ in range(3)]
    keys = []
    for which in range(3):
        q, k, v = (t.clone().requires_grad_(i == which) for i, t in enumerate(base))
        keys.append(plan_cache.call_key(q, k, v, spec, None, False, False, False, "auto"))
        out = fz.attention(q, k, v, mask=spec)
        (grad,) = torch.autograd.grad(out.square().sum(), [(q, k, v)[which]])
        ref_in = [t.double().requires_grad_(i == which) for i, t in enumerate(base)]
        ref = reference_attention(*ref_in, mask=spec)
        (ref_grad,) = torch.autograd.grad(ref.square().sum(), [ref_in[which]])
        torch.testing.assert_close(grad.double(), ref_grad, atol=2e-4, rtol=2e-4)
    assert len(set(keys)) == 3


@pytest.mark.parametrize(
    ("spec", "hides_nothing"),
    [
        (masks.Causal(align="bottom_right"), True),  # binds to OffsetCausal(Lkv - 1) at Lq = 1
        ("offset_last", True),
        ("offset_before_last", False),
        ("band_inside_window", True),
        ("band_window_short", False),
    ],
)
def test_a_decode_step_mask_that_hides_no_key_runs_on_sdpa(spec: Any, hides_nothing: bool) -> None:
    """One query at the end of a cache under a causal or band mask whose offset reaches the last
    key hides nothing: SDPA without a mask is its exact form at any lengths, so the SDPA routes take
    it (a dynamic-cache decode step from transformers ran on flex before). Masks that hide a key
    keep no such form."""
    from flexattn_zoo.masks.band import Band
    from flexattn_zoo.masks.causal import OffsetCausal

    kv_len = 13
    spec = {
        "offset_last": OffsetCausal(offset=kv_len - 1),
        "offset_before_last": OffsetCausal(offset=kv_len - 2),
        "band_inside_window": Band(lo=kv_len - 1 - 20, hi=kv_len - 1),
        "band_window_short": Band(lo=kv_len - 1 - 4, hi=kv_len - 1),
    }.get(spec, spec)
    g = torch.Generator().manual_seed(13)
    q, k, v = (
        torch.randn(2, 4, 1, 16, generator=g),
        torch.randn(2, 2, kv_len, 16, generator=g),
        torch.randn(2, 2, kv_len, 16, generator=g),
    )
    with torch.no_grad():
        plan = fz.plan(q, k, v, mask=spec, enable_gqa=True)
        out = fz.attention(q, k, v, mask=spec, enable_gqa=True)
    assert plan.backend.startswith("sdpa") == hides_nothing, plan.explain()
    assert_matches_reference(out, q, k, v, mask=spec, enable_gqa=True)
