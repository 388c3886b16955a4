"""Every registered spec through every CPU route that accepts it, vs the float64 reference.

Iterates the registry, so specs registered later are covered automatically. Forward and backward
where the route has a backward (dense, sdpa_*); flex_cpu is inference-only and compiles once per
distinct spec, so it runs the first example of each registered name (a bounded number of graphs).
"""

from __future__ import annotations

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.backends import BACKENDS
from flexattn_zoo.testing import assert_matches_reference, spec_examples

B, H, HKV, D = 2, 4, 2, 16
# Lengths not multiples of the block size, Lq != Lkv, and 96 = 3 x 32: Chunked(96 // 3) runs the
# SDPA routes' equal-chunks call (chunks as batch rows).
SHAPES = [(77, 77), (90, 61), (96, 96)]
#: Every registered CPU route with a backward.
GRAD_ROUTES = tuple(b.name for b in BACKENDS if "cpu" in b.devices and b.backward)


def _inputs(lq: int, lkv: int, seed: int, grad: bool):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, lq, D, generator=g).requires_grad_(grad)
    k = torch.randn(B, HKV, lkv, D, generator=g).requires_grad_(grad)
    v = torch.randn(B, HKV, lkv, D, generator=g).requires_grad_(grad)
    return q, k, v


def _run(route, q, k, v, mask, score, grad):  # type: ignore[no-untyped-def]
    try:
        fz.plan(q, k, v, mask=mask, score_mod=score, enable_gqa=True, backend=route)
    except ValueError:
        return False
    out = fz.attention(q, k, v, mask=mask, score_mod=score, enable_gqa=True, backend=route)
    if grad:
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        assert_matches_reference(
            out, q, k, v, mask=mask, score_mod=score, enable_gqa=True, grads=grads, grad_out=grad_out
        )
    else:
        assert_matches_reference(out, q, k, v, mask=mask, score_mod=score, enable_gqa=True)
    return True


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", masks.names())
def test_every_mask_example_on_grad_routes(name: str, shape: tuple[int, int]) -> None:
    lq, lkv = shape
    ran = 0
    for i, (_, spec) in enumerate(spec_examples("mask", lq, lkv, B, H, names=[name])):
        q, k, v = _inputs(lq, lkv, seed=i, grad=True)
        for route in GRAD_ROUTES:
            ran += _run(route, q, k, v, spec, None, grad=True)
    assert ran > 0, f"no CPU training route accepted any example of {name}"


@pytest.mark.parametrize("name", score_mods.names())
def test_every_score_example_on_dense(name: str) -> None:
    for i, (_, spec) in enumerate(spec_examples("score", 70, 70, B, H, names=[name])):
        q, k, v = _inputs(70, 70, seed=i, grad=True)
        assert _run("dense", q, k, v, masks.Causal(), spec, grad=True)


@pytest.mark.parametrize("name", masks.names())
def test_first_mask_example_on_flex_cpu(name: str) -> None:
    lq, lkv = SHAPES[1]
    _, spec = spec_examples("mask", lq, lkv, B, H, names=[name])[0]
    q, k, v = _inputs(lq, lkv, seed=0, grad=False)
    assert _run("flex_cpu", q, k, v, spec, None, grad=False)


@pytest.mark.parametrize("name", score_mods.names())
def test_first_score_example_on_flex_cpu(name: str) -> None:
    _, spec = spec_examples("score", 70, 70, B, H, names=[name])[0]
    q, k, v = _inputs(70, 70, seed=0, grad=False)
    if spec.is_activation():
        # Activation attention needs the lse, which torch's CPU flex kernel does not return: the
        # route refuses, and its lowering of the log-weight score_mod is checked as a softmax
        # score_mod (a raw callable) against the same function evaluated eagerly.
        with pytest.raises(ValueError, match="lse activation attention runs through"):
            fz.plan(q, k, v, mask=masks.Causal(), score_mod=spec, enable_gqa=True, backend="flex_cpu")
        assert _run("flex_cpu", q, k, v, masks.Causal(), spec.score_mod(), grad=False)
        return
    assert _run("flex_cpu", q, k, v, masks.Causal(), spec, grad=False)


# Causal and a left-only window hide every later key (kernels may run a score mod's cheaper
# future_keys_hidden variant); a two-sided window, no mask and a bottom-right causal with
# Lkv > Lq do not, and must get the exact function.
SCORE_MASKS = {
    "causal": (masks.Causal(), (70, 70)),
    "window_left": (masks.SlidingWindow(left=9), (70, 70)),
    "window_both": (masks.SlidingWindow(left=9, right=4), (70, 70)),
    "none": (None, (70, 70)),
    "causal_bottom_right": (masks.Causal(align="bottom_right"), (50, 70)),
}


def _has_past_variant(name: str) -> bool:
    _, spec = spec_examples("score", 70, 70, B, H, names=[name])[0]
    return spec.score_mod(future_keys_hidden=True) is not spec.score_mod()


#: Score mods with a cheaper variant for masks that hide later keys (today ALiBi): only these run
#: under every mask of SCORE_MASKS (one flex_cpu compile each, ~4-5 s on 2 cores). The others run
#: one function under any mask, under causal in test_first_score_example_on_flex_cpu.
PAST_VARIANT_SCORES = [n for n in score_mods.names() if _has_past_variant(n)]


def test_alibi_has_a_past_only_variant() -> None:
    assert "alibi" in PAST_VARIANT_SCORES, PAST_VARIANT_SCORES


@pytest.mark.parametrize("mask_name", SCORE_MASKS)
@pytest.mark.parametrize("name", PAST_VARIANT_SCORES)
def test_first_score_example_on_flex_cpu_under_masks(name: str, mask_name: str) -> None:
    mask, (lq, lkv) = SCORE_MASKS[mask_name]
    _, spec = spec_examples("score", lq, lkv, B, H, names=[name])[0]
    q, k, v = _inputs(lq, lkv, seed=1, grad=False)
    assert _run("flex_cpu", q, k, v, mask, spec, grad=False)


def test_flex_routes_run_the_past_only_score_mod_when_the_mask_allows() -> None:
    from flexattn_zoo.backends.flex import FLEX_CPU

    alibi = score_mods.Alibi(num_heads=H)
    q, k, v = _inputs(70, 70, seed=0, grad=False)
    for mask, past in ((masks.Causal(), True), (masks.SlidingWindow(left=9, right=4), False), (None, False)):
        problem = fz.plan(q, k, v, mask=mask, score_mod=alibi, enable_gqa=True, backend="flex_cpu").problem
        got = FLEX_CPU._prepare(problem, q.device, None).score_mod
        assert got is alibi.score_mod(future_keys_hidden=past), mask
    assert alibi.score_mod(future_keys_hidden=True) is not alibi.score_mod()
