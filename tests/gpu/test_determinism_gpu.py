"""``deterministic=True`` on every CUDA route (``pytest -m gpu``): each route that accepts it must
give bitwise-identical output and gradients over 10 repeated forward+backward runs; routes that
refuse must say why. Set ``FLEXATTN_ZOO_DETERMINISM_SUMMARY=path.json`` to write a summary (per
route: accepted, reasons, case, bitwise, and whether it also repeated without the switch).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.arch import PRIORITY, ordered_routes
from flexattn_zoo.backends import BACKENDS, BY_NAME

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SUMMARY_ENV = "FLEXATTN_ZOO_DETERMINISM_SUMMARY"
SUMMARY: dict[str, dict[str, Any]] = {}
#: Every registered route that auto may pick on some GPU generation, in registration order.
GPU_AUTO = frozenset().union(*(ordered_routes(gen) for gen in PRIORITY if gen != "cpu"))
CUDA_ROUTES = [b.name for b in BACKENDS if b.name in GPU_AUTO]
RUNS = 10


def _doc() -> masks.Document:
    return masks.Document.from_lengths([[500, 700, 848], [48, 2000]])


# Tried in order; the first case a route accepts is the one it is checked on.
CASES: dict[str, tuple[Any, Any, int]] = {
    "causal": (masks.Causal(), None, 8),
    "causal_gqa": (masks.Causal(), None, 2),
    "document_causal": (_doc() & masks.Causal(), None, 8),
    "sliding_softcap": (masks.SlidingWindow(left=255), score_mods.SoftCap(cap=20.0), 8),
}


@pytest.fixture(scope="module", autouse=True)
def _write_summary() -> Iterator[None]:
    yield
    path = os.environ.get(SUMMARY_ENV)
    if path:
        with open(path, "w") as f:
            json.dump(
                {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "routes": SUMMARY},
                f,
                indent=2,
            )


def _inputs(hkv: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return [
        torch.randn(2, h, 2048, 128, device="cuda", dtype=torch.bfloat16, generator=g) for h in (8, hkv, hkv)
    ]


def _runs(route: str, mask: Any, score: Any, hkv: int, deterministic: bool) -> bool:
    """Whether RUNS repeated fwd+bwd are bitwise identical (the route's backward when it has one)."""
    base = _inputs(hkv)
    grad = BY_NAME[route].backward
    grad_out = torch.randn(
        2,
        8,
        2048,
        128,
        device="cuda",
        dtype=torch.bfloat16,
        generator=torch.Generator(device="cuda").manual_seed(1),
    )
    first: tuple[torch.Tensor, ...] | None = None
    for _ in range(RUNS):
        ins = [t.clone().requires_grad_(grad) for t in base]
        out = fz.attention(
            *ins, mask=mask, score_mod=score, enable_gqa=hkv != 8, backend=route, deterministic=deterministic
        )
        got = (out, *(torch.autograd.grad(out, ins, grad_out) if grad else ()))
        if first is None:
            first = got
        elif not all(torch.equal(a, b) for a, b in zip(first, got, strict=True)):
            return False
    return True


@pytest.mark.parametrize("route", CUDA_ROUTES)
def test_route_is_bitwise_reproducible_or_refuses(route: str) -> None:
    entry: dict[str, Any] = {"accepted": False, "reasons": {}}
    SUMMARY[route] = entry
    for name, (mask, score, hkv) in CASES.items():
        q, k, v = _inputs(hkv)
        try:
            fz.plan(
                q.requires_grad_(),
                k,
                v,
                mask=mask,
                score_mod=score,
                enable_gqa=hkv != 8,
                backend=route,
                deterministic=True,
            )
        except ValueError as exc:
            entry["reasons"][name] = str(exc)
            continue
        entry.update(accepted=True, case=name)
        entry["bitwise"] = _runs(route, mask, score, hkv, deterministic=True)
        # Informational: does the route also repeat without the switch (e.g. FA2's atomic dQ)?
        entry["bitwise_without_switch"] = _runs(route, mask, score, hkv, deterministic=False)
        assert entry["bitwise"], f"{route} accepted deterministic=True but {RUNS} runs of {name} differ"
        return
    if not BY_NAME[route].deterministic:
        assert all("not deterministic" in r for r in entry["reasons"].values()), entry["reasons"]
    pytest.skip(f"{route} accepts none of the cases: {entry['reasons']}")


def test_torch_mode_is_restored_after_backward() -> None:
    before = torch.are_deterministic_algorithms_enabled()
    q, k, v = (t.requires_grad_() for t in _inputs(8))
    out = fz.attention(q, k, v, mask="causal", backend="sdpa_flash", deterministic=True)
    assert "DeterministicBackward" in type(out.grad_fn).__name__
    out.sum().backward()
    assert torch.are_deterministic_algorithms_enabled() == before
