"""Every registered zoo family on CUDA, against the float64 reference, forward and backward.

One realistic instance per family (``typical_example`` at L=256, B=2, 4 q / 2 kv heads, D=64,
bf16; score mods under a causal mask) on ``auto`` and on the flex routes, which run any spec:
``flex`` (Triton) and ``flex_flash`` (FlashAttention-4's CuTe code generator, where a mod's ops
must all have CuTe lowerings). A route that refuses the problem is skipped with its reasons;
``test_every_family_runs_somewhere`` asserts that the universal route took every family. Each
family also runs inside a caller's ``torch.compile(fullgraph=True)`` on ``auto``, forward and
backward.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo.registry import MASKS, SCORES
from flexattn_zoo.spec import Spec
from flexattn_zoo.testing import assert_matches_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
B, H, HKV, L, D = 2, 4, 2, 256, 64
ROUTES = ["auto", "flex", "flex_flash"]


def _family(kind: str, name: str) -> Spec:
    registry = MASKS if kind == "mask" else SCORES
    factory = registry.find(name).factory  # type: ignore[union-attr]
    if isinstance(factory, type) and issubclass(factory, Spec):
        return factory.typical_example(L, L, B, H).to(DEV)
    return factory().to(DEV)


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded bf16 q ``[B, H, L, D]`` and k, v ``[B, HKV, L, D]`` that require grad."""
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16, generator=g, requires_grad=True)
    k, v = (
        torch.randn(B, HKV, L, D, device=DEV, dtype=torch.bfloat16, generator=g, requires_grad=True)
        for _ in range(2)
    )
    return q, k, v


FAMILIES = [("mask", n) for n in MASKS.names()] + [("score", n) for n in SCORES.names()]
RAN: set[tuple[str, str]] = set()
ATTEMPTED: set[str] = set()


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(("kind", "name"), FAMILIES, ids=[f"{k}-{n}" for k, n in FAMILIES])
def test_family_matches_float64(kind: str, name: str, route: str) -> None:
    if route == "flex":
        ATTEMPTED.add(name)
    spec = _family(kind, name)
    kwargs: dict[str, Any] = {"mask": spec} if kind == "mask" else {"mask": masks.Causal(), "score_mod": spec}
    q, k, v = _inputs()
    try:
        fz.plan(q, k, v, enable_gqa=True, backend=route, **kwargs)
    except ValueError as exc:
        pytest.skip(f"{route} refuses {name}: {exc}")
    out = fz.attention(q, k, v, enable_gqa=True, backend=route, **kwargs)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(out, q, k, v, enable_gqa=True, grads=grads, grad_out=grad_out, **kwargs)
    RAN.add((name, route))


@pytest.mark.parametrize(("kind", "name"), FAMILIES, ids=[f"{k}-{n}" for k, n in FAMILIES])
def test_family_compiles_whole_on_auto(kind: str, name: str) -> None:
    """The same instance inside a caller's ``torch.compile(fullgraph=True)`` (a graph break
    raises) on the route auto picks while traced, forward and backward, against float64."""
    torch._dynamo.reset()
    spec = _family(kind, name)
    kwargs: dict[str, Any] = {"mask": spec} if kind == "mask" else {"mask": masks.Causal(), "score_mod": spec}
    q, k, v = _inputs()

    def call(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return fz.attention(a, b, c, enable_gqa=True, **kwargs)

    out = torch.compile(call, fullgraph=True)(q, k, v)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(out, q, k, v, enable_gqa=True, grads=grads, grad_out=grad_out, **kwargs)
    torch._dynamo.reset()


def test_every_family_runs_somewhere() -> None:
    """Run after the tests above (same module): the Triton flex route runs every family."""
    if not ATTEMPTED:
        pytest.skip("the per-family flex tests were deselected")
    ran = {name for name, route in RAN if route == "flex"}
    missing = sorted(ATTEMPTED - ran)
    assert not missing, f"flex did not run: {missing}"
