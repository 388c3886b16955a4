"""Which part of a traced call fails for a raw mask_mod over captured ``[B, L]`` document ids on
CUDA: ``torch._dynamo.explain`` of ``fz.attention(mask=callable)`` on the ``dense`` and ``flex``
routes (tests/gpu/test_compile_gpu.py's ``callable_ids`` case), as the library runs it and with
``coercion._traced_verdict`` not walking the callable (``traced_hazards`` skipped), each in a fresh
Dynamo. On an H100 with torch 2.11 and without FA4 the test failed with an empty AssertionError in
Dynamo while tracing the flex-style (vmap) evaluation of the callable. The same shows on the CPU
(torch 2.11 and 2.13) for a callable whose ids are a closure variable: walking the closure in the
graph (``traced_hazards``) made Dynamo fail when it then inlined the function ("Expected
CellVariable, got UserDefinedObjectVariable in load_cell"). Since the walk runs at trace time
outside the graph (torch 2.13) or not at all (older torch), both lines give 0 graph breaks.

    PYTHONPATH=. python benchmarks/traced_callable_probe.py [--device cuda]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

import flexattn_zoo as fz
from flexattn_zoo import coercion, masks
from flexattn_zoo.functions import Probed


def _explain(route: str, mask: Any, q: torch.Tensor) -> str:
    torch._dynamo.reset()

    def call(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return fz.attention(a, b, c, backend=route, mask=mask)

    try:
        fz.plan(q, q, q, backend=route, mask=mask)  # eagerly first, as the test does
        explained = torch._dynamo.explain(call)(q, q, q)
    except Exception as exc:  # the probe reports, it does not stop
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return f"{explained.graph_break_count} graph breaks"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    dev = args.device
    ids = masks.Document.from_lengths([[100, 150, 134], [20, 364]], device=dev).doc_ids

    def same_doc_causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (ids[b, q] == ids[b, kv]) & (kv <= q)

    q = torch.randn(2, 4, 384, 64, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    flex = "flex" if dev == "cuda" else "flex_cpu"
    real = coercion._traced_verdict
    for label, verdict in (
        ("as is", real),
        ("traced_hazards skipped", lambda fn: Probed(True, ())),
    ):
        coercion._traced_verdict = verdict  # type: ignore[assignment]
        try:
            for route in ("dense", flex):
                print(f"{label:24s} {route:8s} {_explain(route, same_doc_causal, q)}", flush=True)
        finally:
            coercion._traced_verdict = real  # type: ignore[assignment]


if __name__ == "__main__":
    main()
