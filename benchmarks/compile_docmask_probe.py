"""Which in-graph BlockMask builds of a document mask work on CUDA under torch.compile.

fz.attention traced inside ``torch.compile(fullgraph=True)`` gave wrong rows for Document & Causal
on the H200, and torch's ``create_block_mask`` compiled in the graph raised "CUDA error: operation
not supported on global/shared address space" for int32 ids. A CUDA error poisons the process, so
every variant here runs in its own process (``--variant NAME``; without it, the parent runs them
all and prints one line each): the max abs error of the output against float64, or the failure.

Variants: torch flex with the BlockMask built eagerly and passed in (the control); built in the
graph from ids captured / passed as an input / computed in the graph from position ids (what
transformers does for packed sequences), each with int32 and int64 ids; fz.attention traced with
its own builders in the graph (their block ordering the ``flexattn_zoo::block_order`` op), with
the spec built outside (int32 labels) or inside the graph (the ids' own dtype). Then the variants
that locate the fault, with the ordering traced as plain ops (as before the op): in one graph with
the kernel, the builders compiled alone (their BlockMask tensors against the eager ones: "max err"
is then the number of tensors that differ), one batch row instead of two, and the BlockMask
tensors cloned in the graph.

    python benchmarks/compile_docmask_probe.py            # CUDA
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch

B, H, L, D = 2, 4, 384, 64
LENGTHS = [[100, 150, 134], [20, 364]]


def _setup(dev: str, one_row: bool = False) -> tuple[torch.Tensor, ...]:
    global B, LENGTHS
    if one_row:
        B, LENGTHS = 1, [[20, 364]]
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
    ids = torch.tensor([sum(([i] * n for i, n in enumerate(row)), []) for row in LENGTHS], device=dev)
    pos = torch.tensor([sum((list(range(n)) for n in row), []) for row in LENGTHS], device=dev)
    return q, k, v, ids, pos


def _doc_causal(ids: torch.Tensor) -> Callable[..., torch.Tensor]:
    def mod(b: Any, h: Any, qi: Any, ki: Any) -> Any:
        return (ids[b, qi] == ids[b, ki]) & (qi >= ki)

    return mod


def _variants(dev: str) -> dict[str, Callable[[], tuple[torch.Tensor, Any]]]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import flexattn_zoo as fz
    from flexattn_zoo import masks

    q, k, v, ids64, pos = _setup(dev, one_row=B == 1)
    spec = masks.Document(doc_ids=ids64) & masks.Causal()
    out: dict[str, Callable[[], tuple[torch.Tensor, Any]]] = {}
    for dtype in (torch.int32, torch.int64):
        ids = ids64.to(dtype)
        tag = str(dtype)[6:]
        bm = create_block_mask(_doc_causal(ids), B, None, L, L, device=dev)
        out[f"{tag} control: compiled flex, BlockMask passed in"] = lambda bm=bm: (
            torch.compile(flex_attention, fullgraph=True)(q, k, v, block_mask=bm),
            spec,
        )

        def captured(a: Any, b: Any, c: Any, ids: torch.Tensor = ids) -> Any:
            m = create_block_mask(_doc_causal(ids), B, None, L, L, device=dev)
            return flex_attention(a, b, c, block_mask=m)

        out[f"{tag} create_block_mask in graph, ids captured"] = lambda f=captured: (
            torch.compile(f, fullgraph=True)(q, k, v),
            spec,
        )

        def as_input(a: Any, b: Any, c: Any, ids_in: torch.Tensor) -> Any:
            m = create_block_mask(_doc_causal(ids_in), B, None, L, L, device=dev)
            return flex_attention(a, b, c, block_mask=m)

        out[f"{tag} create_block_mask in graph, ids an input"] = lambda ids=ids: (
            torch.compile(as_input, fullgraph=True)(q, k, v, ids),
            spec,
        )

        def from_positions(a: Any, b: Any, c: Any, p: torch.Tensor, dtype: torch.dtype = dtype) -> Any:
            # transformers' packed-sequence ids: a new sequence wherever positions do not step by one
            step = torch.diff(p, prepend=p[:, :1] - 1, dim=-1)
            doc = (step != 1).cumsum(-1).to(dtype)
            m = create_block_mask(_doc_causal(doc), B, None, L, L, device=dev)
            return flex_attention(a, b, c, block_mask=m)

        out[f"{tag} create_block_mask in graph, ids from positions"] = lambda f=from_positions: (
            torch.compile(f, fullgraph=True)(q, k, v, pos),
            spec,
        )

    def fz_in_graph(outside: bool) -> tuple[torch.Tensor, Any]:

        def call(a: Any, b: Any, c: Any, ids: torch.Tensor) -> Any:
            m = spec if outside else masks.Document(doc_ids=ids) & masks.Causal()
            return fz.attention(a, b, c, mask=m, backend="flex" if dev == "cuda" else "flex_cpu")

        return torch.compile(call, fullgraph=True)(q, k, v, ids64), spec

    out["fz traced flex in graph, spec built outside (int32 labels)"] = lambda: fz_in_graph(True)
    out["fz traced flex in graph, spec built inside (int64 ids)"] = lambda: fz_in_graph(False)

    def builders_alone(torch_builder: bool) -> tuple[torch.Tensor, Any]:
        from flexattn_zoo import blockmask
        from flexattn_zoo.blockmask import block_mask

        blockmask._ordered = blockmask._ordered_eager  # the ordering traced as plain ops

        def build(ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
            if torch_builder:
                m = create_block_mask(_doc_causal(ids), B, None, L, L, device=dev)
            else:
                m = block_mask(masks.Document(doc_ids=ids) & masks.Causal(), L, L, batch=B, device=dev)
            return tuple(t for t in m.as_tuple()[2:10])

        eager = build(ids64)
        traced = torch.compile(build, fullgraph=True)(ids64)
        names = (
            "kv_num",
            "kv_idx",
            "full_kv_num",
            "full_kv_idx",
            "q_num",
            "q_idx",
            "full_q_num",
            "full_q_idx",
        )
        bad = []
        for name, a, b in zip(names, eager, traced, strict=True):
            if a is None or b is None:
                if (a is None) != (b is None):
                    bad.append(f"{name}: None in one")
                continue
            if a.shape != b.shape:
                bad.append(f"{name}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
                continue
            # indices past a row's count are unused: compare only the counted ones
            diff = (a != b).nonzero()
            if diff.numel():
                bad.append(f"{name}: {diff.shape[0]} differ, first {diff[0].tolist()} strides {b.stride()}")
        return torch.tensor(float(len(bad))), "; ".join(bad) or "all equal"

    out["torch create_block_mask compiled alone vs eager"] = lambda: builders_alone(True)
    out["fz builders compiled alone vs eager"] = lambda: builders_alone(False)

    def fz_plain_ordering(clone: bool = False) -> tuple[torch.Tensor, Any]:
        from flexattn_zoo import _compat, blockmask

        blockmask._ordered = blockmask._ordered_eager  # the ordering traced as plain ops
        if clone:
            make = _compat.make_block_mask

            def cloned(seq: Any, *tensors_and_rest: Any) -> Any:
                *tensors, bs, mod = tensors_and_rest
                return make(seq, *(t.clone() if t is not None else None for t in tensors), bs, mod)

            _compat.make_block_mask = cloned
        return fz_in_graph(False)

    out["fz in graph, ordering as plain ops"] = lambda: fz_plain_ordering()
    out["fz in graph, ordering as plain ops, BlockMask tensors cloned"] = lambda: fz_plain_ordering(True)
    out["fz in graph, ordering as plain ops, one batch row"] = lambda: fz_plain_ordering()
    out["fz builders compiled alone vs eager, one batch row"] = lambda: builders_alone(False)
    return out


ONE_ROW = (
    "fz in graph, ordering as plain ops, one batch row",
    "fz builders compiled alone vs eager, one batch row",
)


def _one(name: str, dev: str) -> None:
    from flexattn_zoo.reference import reference_attention

    q, k, v, *_ = _setup(dev, one_row=name in ONE_ROW)
    got, spec = _variants(dev)[name]()
    if isinstance(spec, str):  # a builder comparison: the number of differing tensors, and which
        print(f"max err {int(got.item())} ({spec})")
        return
    err = (got.double() - reference_attention(q, k, v, mask=spec)).abs()
    worst = (err == err.max()).nonzero()[0].tolist()
    print(f"max err {err.max().item():.3g} at {worst}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--variant", help="run one variant in this process")
    parser.add_argument("--only", default="", help="run the variants whose name contains this")
    args = parser.parse_args()
    if args.variant:
        _one(args.variant, args.device)
        return
    print(f"# torch {torch.__version__}; {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}")
    for name in [n for n in _variants(args.device) if args.only in n]:
        run = subprocess.run(
            [sys.executable, __file__, "--device", args.device, "--variant", name],
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = (run.stdout + run.stderr).strip().splitlines()
        result = next((x for x in reversed(lines) if x.startswith("max err")), None)
        if result is None:
            errors = [x for x in lines if "Error" in x]
            result = (
                "FAILED "
                + (errors[-1] if errors else (lines[-1] if lines else f"exit {run.returncode}"))[:160]
            )
        print(f"{name:62s} {result}", flush=True)


if __name__ == "__main__":
    main()
