"""Every example of every registered family (``examples()``, not only the typical one) on the
flex routes, against the float64 reference: score mods forward and backward, under a causal
mask and unmasked, at 4 and 6 heads; masks forward.

``tests/gpu/test_zoo_gpu.py`` runs one instance per family; ``Alibi`` with given slopes and at a
head count that is not a power of two took other code paths, and on ``flex_flash`` (FA4's CuTe
kernel) the given-slopes one gave errors of order 1 (H100, flash-attn-4 4.0.0b36) until it was
spelled without a per-head ``torch.where``. A route that refuses an example is skipped with its
reasons.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import functions, masks
from flexattn_zoo.testing import assert_matches_reference
from flexattn_zoo.testing.checks import spec_examples

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
B, L, D = 2, 256, 64


def _examples(kind: str, heads: int) -> list[tuple[str, Any]]:
    found = spec_examples(kind, L, L, batch=B, heads=heads)
    return [(f"{name}-{i}", spec) for i, (name, spec) in enumerate(found)]


SCORES = [(heads, *example) for heads in (4, 6) for example in _examples("score", heads)]
MASKS = _examples("mask", 4)
#: Score examples read per (query, key) pair (``Spec.loads_pairs``), at 4 heads.
PAIR_LOADED = [(name, spec) for heads, name, spec in SCORES if heads == 4 and spec.loads_pairs()]


def _inputs(heads: int, requires_grad: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=DEV).manual_seed(0)
    return tuple(
        (torch.randn(B, heads, L, D, device=DEV, dtype=torch.bfloat16, generator=g) * 0.5).requires_grad_(
            requires_grad
        )
        for _ in range(3)
    )


def _plan_or_skip(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, route: str, **kwargs: Any) -> None:
    try:
        fz.plan(q, k, v, backend=route, **kwargs)
    except ValueError as exc:
        # Presets are spelled so that no kernel hazard of theirs refuses them (unit-tested by
        # tracing): such a refusal is a failure, not a skip.
        assert functions.SELECTS_PER_HEAD not in str(exc), exc
        pytest.skip(f"{route} refuses it: {exc}")


@pytest.mark.parametrize("route", ["flex", "flex_flash"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "unmasked"])
@pytest.mark.parametrize(("heads", "name", "spec"), SCORES, ids=[f"h{h}-{n}" for h, n, _ in SCORES])
def test_every_score_example_matches_float64(
    heads: int, name: str, spec: Any, causal: bool, route: str
) -> None:
    """Under a causal mask flex routes run a score spec's variant for masks that hide later keys
    (ALiBi's ``i - j`` for ``|i - j|``); unmasked, its general function."""
    spec = spec.to(DEV)
    q, k, v = _inputs(heads, requires_grad=True)
    kwargs = {"mask": masks.Causal() if causal else None, "score_mod": spec}
    _plan_or_skip(q, k, v, route, **kwargs)
    out = fz.attention(q, k, v, backend=route, **kwargs)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(out, q, k, v, grads=grads, grad_out=grad_out, **kwargs)


@pytest.mark.parametrize(("name", "spec"), PAIR_LOADED, ids=[n for n, _ in PAIR_LOADED])
def test_pair_loaded_score_examples_compile_when_traced(name: str, spec: Any) -> None:
    """Traced, a call cannot retry another Triton pipeline after its caller's compile error, as
    an eager one does: every pair-loaded example compiles under ``torch.compile(fullgraph=True)``
    on ``flex``, forward and backward (Graphormer with an edge bias, two tiles per pair, ran out
    of an H100's shared memory at D=64 on the two-stage pipeline)."""
    spec = spec.to(DEV)
    q, k, v = _inputs(4, requires_grad=True)
    kwargs = {"mask": masks.Causal(), "score_mod": spec}
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: fz.attention(q, k, v, backend="flex", **kwargs), fullgraph=True)
    out = compiled(q, k, v)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(out, q, k, v, grads=grads, grad_out=grad_out, **kwargs)


@pytest.mark.parametrize(("name", "spec"), MASKS, ids=[n for n, _ in MASKS])
def test_every_mask_example_matches_float64_on_flex_flash(name: str, spec: Any) -> None:
    spec = spec.to(DEV)
    q, k, v = _inputs(4, requires_grad=False)
    _plan_or_skip(q, k, v, "flex_flash", mask=spec)
    out = fz.attention(q, k, v, backend="flex_flash", mask=spec)
    assert_matches_reference(out, q, k, v, mask=spec)
