"""Whether a pair-loaded score mod that needs the smallest Triton pipeline eagerly (Graphormer with
an edge bias beside its int64 distances, two pair-loaded tiles, D=64) compiles when traced:
``torch.compile(fullgraph=True)`` of a function calling ``fz.attention`` on the flex route, forward
and backward, against the float64 reference; the eager call beside it.

    PYTHONPATH=. python benchmarks/pair_load_traced_probe.py
"""

from __future__ import annotations

import torch

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.testing import assert_matches_reference


def main() -> None:
    dev, b, h, length, d = "cuda", 2, 4, 256, 64
    (spec,) = [s for s in score_mods.Graphormer.examples(length, length, b, h) if s.edge_bias is not None]
    spec = spec.to(dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (
        torch.randn(b, h, length, d, generator=g).to(dev, torch.bfloat16).requires_grad_() for _ in range(3)
    )
    for label, fn in (
        ("eager", lambda q, k, v: fz.attention(q, k, v, mask=masks.Causal(), score_mod=spec, backend="flex")),
        (
            "traced",
            torch.compile(
                lambda q, k, v: fz.attention(q, k, v, mask=masks.Causal(), score_mod=spec, backend="flex"),
                fullgraph=True,
            ),
        ),
    ):
        try:
            out = fn(q, k, v)
            out.float().square().sum().backward()
            assert_matches_reference(out, q, k, v, mask=masks.Causal(), score_mod=spec)
            print(f"{label}: ran, forward matches float64", flush=True)
        except Exception as exc:  # the probe reports, it does not stop
            print(f"{label}: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
        q.grad = k.grad = v.grad = None


if __name__ == "__main__":
    main()
