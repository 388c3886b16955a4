"""fz.attention under torch.autocast behaves like SDPA: it computes in the autocast dtype on every
route, and the plan (and its cache entry) is made for that dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flexattn_zoo as fz
from flexattn_zoo import masks


@pytest.mark.parametrize("backend", ["auto", "dense", "sdpa_math", "flex_cpu"])
def test_autocast_gives_the_autocast_dtype_on_every_route(backend: str) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=gen) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fz.attention(q, k, v, mask=masks.Causal(), backend=backend)
        plan = fz.plan(q, k, v, mask=masks.Causal(), backend=backend)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert want.dtype == torch.bfloat16
    assert out.dtype == torch.bfloat16, backend
    assert plan.problem.dtype == torch.bfloat16 and "bfloat16 on cpu" in plan.explain()
    # The project's tolerance rule, for the bf16 inputs the kernel saw.
    fz.testing.assert_matches_reference(out, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask=masks.Causal())


def test_the_same_call_outside_autocast_stays_float32() -> None:
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = fz.attention(q, k, v, mask="causal")
    outside = fz.attention(q, k, v, mask="causal")  # a cached plan for bf16 must not serve this
    assert inside.dtype == torch.bfloat16 and outside.dtype == torch.float32


def test_autocast_gradients_reach_float32_inputs() -> None:
    q, k, v = (torch.randn(1, 2, 16, 16, requires_grad=True) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fz.attention(q, k, v, mask="causal")
    out.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.float32


def test_float64_is_not_autocast() -> None:
    q = torch.randn(1, 2, 8, 16, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fz.attention(q, q, q)
    assert out.dtype == torch.float64


def test_bad_inputs_under_autocast_still_name_the_argument() -> None:
    q = torch.randn(1, 2, 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match="k"):
        fz.attention(q, "not a tensor", q)  # type: ignore[call-overload]
