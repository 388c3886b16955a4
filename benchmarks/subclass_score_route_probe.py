"""CUDA: a score-mod subclass of ALiBi that replaces its function (tests/subclassed_specs.py's
``SquaredDistance``) on every route that accepts it, each route's forward max error against the
float64 reference, and what the route was handed (the forms it read)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from subclassed_specs import SquaredDistance  # noqa: E402

import flexattn_zoo as fz  # noqa: E402
from flexattn_zoo import masks  # noqa: E402
from flexattn_zoo.reference import reference_attention  # noqa: E402

B, H, L, D = 2, 4, 256, 64
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, generator=g) * 0.5 for _ in range(3))
for mask in (masks.Causal(), None):
    score = SquaredDistance(num_heads=H)
    plan = fz.plan(q, k, v, mask=mask, score_mod=score)
    print(plan.explain())
    ref = reference_attention(q, k, v, mask=mask, score_mod=score)
    for route in ["auto", *(c.name for c in plan.candidates if c.accepted)]:
        out = fz.attention(q, k, v, mask=mask, score_mod=score, backend=route)
        err = (out.double() - ref).abs().max().item()
        print(f"mask={type(mask).__name__} route={route}: max abs error {err:.3e}")
