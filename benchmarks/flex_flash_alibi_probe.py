"""CUDA, FA4 installed: ``score_mods.Alibi``'s examples (computed slopes, given slopes, signed) and
the test suite's ``SquaredDistance`` subclass on ``flex`` and ``flex_flash``, each route's forward
max error against the float64 reference (bf16, B=2 H=4 L=256 D=64)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from subclassed_specs import SquaredDistance  # noqa: E402

import flexattn_zoo as fz  # noqa: E402
from flexattn_zoo import masks, score_mods  # noqa: E402
from flexattn_zoo.reference import reference_attention  # noqa: E402

B, H, L, D = 2, 4, 256, 64
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, generator=g) * 0.5 for _ in range(3))
scores = [*score_mods.Alibi.examples(L, L, B, H), SquaredDistance(num_heads=H)]
for mask in (masks.Causal(), None):
    for score in scores:
        ref = reference_attention(q, k, v, mask=mask, score_mod=score)
        for route in ("flex", "flex_flash"):
            try:
                out = fz.attention(q, k, v, mask=mask, score_mod=score, backend=route)
                err = f"{(out.double() - ref).abs().max().item():.3e}"
            except ValueError as exc:
                err = f"refused: {exc}"
            print(
                f"mask={type(mask).__name__} score={score!r} route={route}: max abs error {err}", flush=True
            )
