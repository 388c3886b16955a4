"""User subclasses of presets that replace the parent's function, on every CUDA route that takes
them, against the float64 reference, forward and backward.

Before forms followed the function, the SDPA routes ran ``StrictlyCausal`` as plain causal
attention (its parent's ``is_causal`` form), a window subclass decoded over its parent's run of
keys, and FA4 / SDPA could take ``SquaredDistance`` as its parent's ALiBi slopes.
"""

from __future__ import annotations

import pytest
import torch
from decode_checks import assert_decode_matches
from subclassed_specs import RecentOnly, ShiftedChunks, SquaredDistance, StrictlyCausal

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo.models import decode
from flexattn_zoo.testing import assert_matches_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
B, H, L, D = 2, 4, 256, 64
CASES = [
    (StrictlyCausal(), None),
    (RecentOnly(left=100), None),
    (ShiftedChunks(size=64), None),
    (masks.Causal(), SquaredDistance(num_heads=H)),
    (None, SquaredDistance(num_heads=H)),
]


def _inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=DEV).manual_seed(0)
    return tuple(
        (torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16, generator=g) * 0.5).requires_grad_()
        for _ in range(3)
    )


@pytest.mark.parametrize(("mask", "score"), CASES, ids=lambda x: type(x).__name__)
def test_subclasses_run_exactly_on_every_cuda_route_that_takes_them(mask, score) -> None:
    q, k, v = _inputs()
    plan = fz.plan(q, k, v, mask=mask, score_mod=score)
    routes = [c.name for c in plan.candidates if c.accepted]
    assert "flex" in routes
    for route in ["auto", *routes]:
        out = fz.attention(q, k, v, mask=mask, score_mod=score, backend=route)
        grad = torch.randn_like(out)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
        assert_matches_reference(out, q, k, v, mask=mask, score_mod=score, grads=(dq, dk, dv), grad_out=grad)


@pytest.mark.parametrize("mask", [StrictlyCausal(), RecentOnly(left=100)], ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("length", [1, 2, 100, 101, 200, 256])
def test_subclasses_decode_exactly(mask, length: int) -> None:
    g = torch.Generator(device=DEV).manual_seed(1)
    k, v = (torch.randn(B, 2, L, D, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(2))
    q = torch.randn(B, H, 1, D, device=DEV, dtype=torch.bfloat16, generator=g)
    with torch.no_grad():
        out = decode.decode_step(q, k, v, length, mask=mask, enable_gqa=True)
    assert_decode_matches(out, q, k, v, [length] * B, mask)
