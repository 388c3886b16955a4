"""Which part of a compiled document & causal flex call goes wrong on CUDA.

The GPU compile tests found fz.attention traced inside torch.compile(fullgraph=True) giving wrong
rows for Document & Causal on the H200 (batch row 1 query 0 came out 0). This probe compares, for
the same inputs, the max abs error against float64 of: plain torch flex (mask_mod over a [B, L]
ids tensor, eager BlockMask passed in / BlockMask built in the graph / ids as an input / ids
captured), int32 vs int64 ids, with and without the causal part, and fz.attention traced.

    python benchmarks/compile_docmask_probe.py            # CUDA
"""

from __future__ import annotations

import sys

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo.reference import reference_attention

DEV = sys.argv[1] if len(sys.argv) > 1 else "cuda"
FLEX = "flex" if DEV == "cuda" else "flex_cpu"
B, H, L, D = 2, 4, 384, 64
g = torch.Generator(device=DEV).manual_seed(0)
q, k, v = (torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(3))
lengths = [[100, 150, 134], [20, 364]]
ids64 = torch.tensor([sum(([i] * n for i, n in enumerate(row)), []) for row in lengths], device=DEV)


def err(out: torch.Tensor, spec: object) -> str:
    ref = reference_attention(q, k, v, mask=spec)
    e = (out.double() - ref).abs()
    worst = (e == e.max()).nonzero()[0].tolist()
    return f"max err {e.max().item():.3g} at {worst}"


def run(name: str, fn, spec) -> None:  # type: ignore[no-untyped-def]
    torch._dynamo.reset()
    try:
        print(f"{name:58s} {err(fn(), spec)}", flush=True)
    except Exception as exc:  # noqa: BLE001 - report and go on
        print(f"{name:58s} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:150]}", flush=True)


for dtype in (torch.int32, torch.int64):
    ids = ids64.to(dtype)
    for causal in (True, False):
        spec = masks.Document(doc_ids=ids64) & masks.Causal() if causal else masks.Document(doc_ids=ids64)

        def mod(b, h, qi, ki, ids=ids, causal=causal):  # type: ignore[no-untyped-def]
            same = ids[b, qi] == ids[b, ki]
            return same & (qi >= ki) if causal else same

        tag = f"{str(dtype)[6:]} {'doc&causal' if causal else 'doc'}"
        bm = create_block_mask(mod, B, None, L, L, device=DEV)
        run(f"{tag}: eager flex (unfused)", lambda bm=bm: flex_attention(q, k, v, block_mask=bm), spec)
        cf = torch.compile(flex_attention, fullgraph=True)
        run(
            f"{tag}: compiled flex, BlockMask passed in",
            lambda bm=bm, cf=cf: cf(q, k, v, block_mask=bm),
            spec,
        )

        def inside(a, b_, c, mod=mod):  # type: ignore[no-untyped-def]
            m = create_block_mask(mod, B, None, L, L, device=DEV)
            return flex_attention(a, b_, c, block_mask=m)

        run(
            f"{tag}: compiled, BlockMask built in graph (captured ids)",
            lambda f=inside: torch.compile(f, fullgraph=True)(q, k, v),
            spec,
        )

        def inside_arg(a, b_, c, ids_in, causal=causal):  # type: ignore[no-untyped-def]
            def m2(b, h, qi, ki):  # type: ignore[no-untyped-def]
                same = ids_in[b, qi] == ids_in[b, ki]
                return same & (qi >= ki) if causal else same

            m = create_block_mask(m2, B, None, L, L, device=DEV)
            return flex_attention(a, b_, c, block_mask=m)

        run(
            f"{tag}: compiled, BlockMask in graph, ids an input",
            lambda f=inside_arg, ids=ids: torch.compile(f, fullgraph=True)(q, k, v, ids),
            spec,
        )

spec = masks.Document(doc_ids=ids64) & masks.Causal()
run("fz eager auto", lambda: fz.attention(q, k, v, mask=spec), spec)
run("fz eager flex", lambda: fz.attention(q, k, v, mask=spec, backend=FLEX), spec)
run(
    "fz traced flex",
    lambda: torch.compile(lambda a, b, c: fz.attention(a, b, c, mask=spec, backend=FLEX), fullgraph=True)(
        q, k, v
    ),
    spec,
)
fz.dispatch._holds_data = lambda mask: False  # type: ignore[attr-defined]  # the in-graph path, as before the escape
run(
    "fz traced flex (in graph)",
    lambda: torch.compile(lambda a, b, c: fz.attention(a, b, c, mask=spec, backend=FLEX), fullgraph=True)(
        q, k, v
    ),
    spec,
)
ids32 = ids64.to(torch.int32)
spec2 = masks.Document(doc_ids=ids32) & masks.Causal()
run(
    "fz traced flex (in graph), int32 ids",
    lambda: torch.compile(lambda a, b, c: fz.attention(a, b, c, mask=spec2, backend=FLEX), fullgraph=True)(
        q, k, v
    ),
    spec2,
)
spec3 = masks.Document(doc_ids=ids64)
run(
    "fz traced flex (in graph), document only",
    lambda: torch.compile(lambda a, b, c: fz.attention(a, b, c, mask=spec3, backend=FLEX), fullgraph=True)(
        q, k, v
    ),
    spec3,
)
print("plan (eager):", fz.plan(q, k, v, mask=spec).backend)
