"""Can flex with ``BACKEND="FLASH"`` (FA4's CuTe kernels through Inductor) run in a forward-only
compiled graph, and how? (CUDA, FA4 installed.)

The ``flex_flash`` route refuses forward-only traced calls: on torch 2.11 with flash-attn-4
4.0.0b36 Inductor's CuTe flex template raised "convert FlexibleLayout to FixedLayout first" for
q/k/v computed in the graph, and freed a tensor the mask captures before the kernel read it
(training graphs, which keep both for the backward, ran). Compiled prefill (inference) therefore
runs Triton flex. This probe compiles one attention block (projections in the graph, then flex)
under ``torch.no_grad`` with ``fullgraph=True``, in variants of how q/k/v and the mask's captured
tensor reach the kernel, and reports for each: whether it compiled and ran, the max error against
the same block on Triton flex, and ms per call (``flexattn_zoo.bench.timing.measure``: CUDA
events, median of at least ``--iters`` calls).

Variants of q/k/v:

* ``plain``: as the projections compute them;
* ``as_strided``: ``t.as_strided(t.size(), t.stride())`` (Inductor freezes the layout of an
  ``as_strided`` input without a copy);
* ``materialize``: through ``flexattn_zoo.backends.flex.materialize`` (a copy by a custom op,
  whose output has a fixed layout).

Masks: ``window`` (sliding window & causal, no captured tensor) and ``documents`` (document ids
worked out in the graph from a boundary tensor, captured by the mask_mod), the latter also with
the ids through ``materialize``. Score: soft-capping (exact tanh), as Gemma 2 uses.

    python benchmarks/flex_flash_forward_graph_probe.py
"""

from __future__ import annotations

import argparse
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from flexattn_zoo.backends.flex import materialize
from flexattn_zoo.bench.timing import measure


def _layout(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name == "plain":
        return lambda t: t
    if name == "as_strided":
        return lambda t: t.as_strided(t.size(), t.stride())
    return materialize


class Block(torch.nn.Module):
    """Projections to q/k/v ([B, H, L, D]), then flex with ``backend``; ``mask``: "window" or
    "documents" (document ids from ``boundaries``, a [L] 0/1 tensor, by a cumsum in the graph)."""

    def __init__(self, dim: int, heads: int, head_dim: int, mask: str, layout: str, ids_layout: str, backend: str) -> None:  # fmt: skip
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = torch.nn.Linear(dim, 3 * heads * head_dim, bias=False)
        self.mask, self.layout, self.ids_layout = mask, _layout(layout), _layout(ids_layout)
        self.backend = backend

    def forward(self, x: torch.Tensor, boundaries: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = self.layout(q), self.layout(k), self.layout(v)
        if self.mask == "window":

            def mask_mod(bb: Any, h: Any, qi: Any, ki: Any) -> Any:
                return (qi >= ki) & (qi - ki < 256)

        else:
            ids = self.ids_layout(torch.cumsum(boundaries, 0).to(torch.int32))

            def mask_mod(bb: Any, h: Any, qi: Any, ki: Any) -> Any:
                return (qi >= ki) & (ids[qi] == ids[ki])

        block_mask = create_block_mask(mask_mod, None, None, length, length, device=x.device)

        def softcap(score: Any, bb: Any, h: Any, qi: Any, ki: Any) -> Any:
            return 30.0 * torch.tanh(score / 30.0)

        return flex_attention(
            q, k, v, score_mod=softcap, block_mask=block_mask, kernel_options={"BACKEND": self.backend}
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    dim = args.heads * args.head_dim
    x = torch.randn(args.batch, args.length, dim, device="cuda", dtype=torch.bfloat16)
    boundaries = torch.zeros(args.length, device="cuda", dtype=torch.int64)
    boundaries[torch.tensor([0, args.length // 3, args.length // 2])] = 1
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, x {tuple(x.shape)}, D={args.head_dim}")
    variants = [("window", layout, "plain") for layout in ("plain", "as_strided", "materialize")] + [
        ("documents", layout, ids)
        for layout in ("as_strided", "materialize")
        for ids in ("plain", "materialize")
    ]
    weights: dict[str, torch.Tensor] | None = None
    for mask, layout, ids in variants:
        triton = (
            Block(dim, args.heads, args.head_dim, mask, "plain", "plain", "TRITON").cuda().to(torch.bfloat16)
        )
        if weights is None:
            weights = triton.state_dict()
        triton.load_state_dict(weights)
        flash = Block(dim, args.heads, args.head_dim, mask, layout, ids, "FLASH").cuda().to(torch.bfloat16)
        flash.load_state_dict(weights)
        name = f"{mask:9s} qkv={layout:11s} ids={ids:11s}"
        try:
            with torch.no_grad():
                ref_fn = torch.compile(triton, fullgraph=True)
                ref = ref_fn(x, boundaries)
                fn = torch.compile(flash, fullgraph=True)
                out = fn(x, boundaries)
                err = (out.float() - ref.float()).abs().max().item()
                ms_flash = measure(lambda f=fn: f(x, boundaries), x.device, 3, args.iters).median_ms
                ms_triton = measure(lambda f=ref_fn: f(x, boundaries), x.device, 3, args.iters).median_ms
            print(f"{name} ran: max err vs Triton {err:.3e}; {ms_flash:.3f} ms vs Triton {ms_triton:.3f}")
        except Exception as exc:  # noqa: BLE001 - each variant's failure is a result
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            print(f"{name} FAILED: {last[:300]}")
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
