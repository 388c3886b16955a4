"""GPU fuzzing of the whole path (``pytest -m gpu``): composed zoo masks and score chains over
larger bucketed shapes, bf16, routes ``flex`` and ``auto``, forward and backward vs float64.

Bounding compiles: every distinct (mask_mod, score_mod) is one Triton compile (10-30 s), so specs
come from a fixed pool of composites (drawn once, deterministically) while shapes, data and the
pool index are fuzzed; each entry then serves all lengths from a few static graphs and one
dynamic-shape graph.
Use ``HYPOTHESIS_PROFILE=gpu`` (100 examples) for a long run.
"""

from __future__ import annotations

import functools
import operator

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.arch import PRIORITY, ordered_routes
from flexattn_zoo.backends import BACKENDS
from flexattn_zoo.compile import CACHE as COMPILE_CACHE
from flexattn_zoo.compile import STATIC_SHAPES
from flexattn_zoo.spec import MaskSpec, ScoreSpec
from flexattn_zoo.testing import assert_matches_reference, strategies
from flexattn_zoo.testing.strategies import LENGTH_BUCKETS, ProblemShape

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HEADS = 8  # fixed so ALiBi specs in the pool fit every drawn shape
#: Every registered route that auto may pick on some GPU generation, in registration order.
GPU_AUTO = frozenset().union(*(ordered_routes(gen) for gen in PRIORITY if gen != "cpu"))
#: Routes not (yet) run against the NaN contract on a GPU; sdpa_split would refuse its causal mask.
NAN_UNCHECKED = frozenset({"sdpa_split", "flex_flash", "fa4"})
NAN_ROUTES = [b.name for b in BACKENDS if b.name in GPU_AUTO - NAN_UNCHECKED]


def _pool() -> list[tuple[MaskSpec, ScoreSpec | None]]:
    """Length-independent composites up to 3 deep, each with a score chain (or none)."""
    c, w, p, k = (
        masks.Causal(),
        masks.SlidingWindow(left=300, right=17),
        masks.PrefixLM(prefix_len=129),
        masks.Chunked(size=256),
    )
    cap, alibi = score_mods.SoftCap(cap=20.0), score_mods.Alibi(num_heads=HEADS)
    return [
        (c & w, None),
        ((w | p) & c, cap),
        (~(k & ~c), alibi),
        ((k & c) | (p & ~w), alibi >> cap),
        (c & ~(w & ~p), functools.reduce(operator.rshift, [alibi, cap, cap])),
        (masks.Causal(align="bottom_right") & (w | k), None),
    ]


POOL = _pool()


# No shrinking: each shrink step is new shapes, i.e. new compiles (minutes); the first failing
# example is reported as found. Generation is slow next to the health check's threshold (tensors
# built on the host, copied to the GPU), which says nothing about the code under test.
@settings(
    max_examples=30,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    index=st.integers(0, len(POOL) - 1),
    route=st.sampled_from(["flex", "auto"]),
    q_len=st.sampled_from([n for n in LENGTH_BUCKETS if n >= 64]),
    kv_len=st.sampled_from([n for n in LENGTH_BUCKETS if n >= 64]),
    kv_heads=st.sampled_from([HEADS, 2]),
    grad=st.booleans(),
    data=st.data(),
)
def test_gpu_fuzz_matches_reference(index, route, q_len, kv_len, kv_heads, grad, data) -> None:  # type: ignore[no-untyped-def]
    mask, score = POOL[index]
    shape = ProblemShape(2, HEADS, kv_heads, q_len, kv_len, 64)
    q, k, v = data.draw(strategies.qkv(shape, torch.bfloat16, device="cuda", requires_grad=grad))
    plan = fz.plan(q, k, v, mask=mask, score_mod=score, enable_gqa=True, backend=route)
    assert plan.backend != "dense", plan.explain()  # never a materialized L x L on the GPU
    note(plan.explain())
    out = fz.attention(q, k, v, mask=mask, score_mod=score, enable_gqa=True, backend=route)
    if grad:
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        assert_matches_reference(
            out, q, k, v, mask=mask, score_mod=score, enable_gqa=True, grads=grads, grad_out=grad_out
        )
    else:
        assert_matches_reference(out, q, k, v, mask=mask, score_mod=score, enable_gqa=True)


@pytest.mark.parametrize("index", [0, 4])
@pytest.mark.parametrize("q_len", [1, 40, 64, 100])
def test_short_gqa_queries_on_flex(index: int, q_len: int) -> None:
    """The fuzz's first find (torch 2.11, no FA4): Lq=64 with 8:2 heads made torch pick its
    flex-decoding kernel with no valid config (NoValidChoicesError); the flex route now avoids it."""
    mask, score = POOL[index]
    g = torch.Generator(device="cuda").manual_seed(q_len)
    q = torch.randn(2, HEADS, q_len, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 2, 128, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    out = fz.attention(q, k, v, mask=mask, score_mod=score, enable_gqa=True, backend="flex")
    assert_matches_reference(out, q, k, v, mask=mask, score_mod=score, enable_gqa=True)


def test_gpu_fuzz_compiles_stay_bounded() -> None:
    # Per compiled entry: grad modes x (STATIC_SHAPES static graphs, then the later code object's
    # static and dynamic graph); GQA on/off are separate entries.
    assert all(e.compiles <= 2 * (STATIC_SHAPES + 2) for e in COMPILE_CACHE.entries()), [
        e.compiles for e in COMPILE_CACHE.entries()
    ]


@pytest.mark.parametrize("route", [*NAN_ROUTES, "auto"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_contract_on_cuda_routes(route: str, where: str) -> None:
    """The documented NaN contract (fz.attention's docstring) on every CUDA route: nothing checks,
    but a NaN reaches every row that sees it, and never another (batch, head)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    {"q": q, "k": k, "v": v}[where][1, 0, 100, 3] = float("nan")
    try:
        out = fz.attention(q, k, v, mask="causal", backend=route)
    except ValueError as exc:
        pytest.skip(f"{route} refuses: {exc}")
    rows_nan = torch.isnan(out[1, 0].float()).any(dim=-1).cpu()
    sees = torch.arange(256) == 100 if where == "q" else torch.arange(256) >= 100
    assert bool(rows_nan[sees].all()), f"{route}: a row that sees the NaN came out finite"
    assert bool(torch.isfinite(out[0].float()).all()) and bool(torch.isfinite(out[1, 1:].float()).all())
