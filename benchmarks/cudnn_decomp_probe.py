"""Can cuDNN's fused kernel run documents and prefix-LM exactly, faster than Triton flex?

Two levers, measured side by side with the route they would replace (median of timed runs,
CUDA events, bf16, the h200.yaml shapes), outputs and gradients compared first:

1. ``documents``: cuDNN's ragged (nested-tensor) mode, ``aten._cudnn_attention_forward`` with
   ``cum_seq_q/k``. It lays sequences out as ``[T, H, D]`` and offsets each by ``cum_seq * H * D``;
   a contiguous ``[B, H, L, D]`` tensor viewed as ``[B*H*L, 1, D]`` fits that with one head, every
   (batch row, head, document) its own sequence: no copy. GQA expands k/v first.
2. ``prefix``: prefix-LM (prefix P) as two cuDNN calls whose results are merged by their
   log-sum-exps: all queries against keys ``[0, P)`` without a mask, and queries ``[P, L)`` against
   keys ``[P, L)`` causal; the backward runs each part's cuDNN backward with the merged output and
   lse. This lever became the ``sdpa_split`` route, which the probe now times; the committed output
   (benchmarks/results/cudnn_decomp_probe_h200.txt) is from the probe at 5460eef, which carried
   its own copy of the split with an eager merge.

    python benchmarks/cudnn_decomp_probe.py [--only documents,prefix] [--small]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo.bench.config import document_lengths
from flexattn_zoo.bench.timing import measure, visible_pairs

Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
aten = torch.ops.aten


def ragged_offsets(lengths: list[int], rows: int, device: torch.device) -> torch.Tensor:
    """int32 prefix sums of every document of every (batch row, head), in memory order."""
    seg = torch.tensor(lengths, dtype=torch.int64).repeat(rows)
    cum = torch.zeros(seg.numel() + 1, dtype=torch.int64)
    cum[1:] = seg.cumsum(0)
    return cum.to(device=device, dtype=torch.int32)


def cudnn_documents(lengths: list[int], device: torch.device) -> Fn:
    cache: dict[Any, torch.Tensor] = {}

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, h, length, d = q.shape
        if k.shape[1] != h:
            k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
        key = (b, h)
        if key not in cache:
            cache[key] = ragged_offsets(lengths, b * h, device)
        cum = cache[key]
        fold = [t.reshape(b * h * length, 1, d) for t in (q, k, v)]
        out = aten._cudnn_attention_forward(
            *fold,
            None,
            cum,
            cum,
            max(lengths),
            max(lengths),
            torch.is_grad_enabled(),
            0.0,
            True,
            False,
            scale=d**-0.5,
        )[0]
        return out.view(b, h, length, d)

    return run


class Probe:
    def __init__(self, small: bool, iters: int) -> None:
        self.device = torch.device("cuda")
        self.small, self.iters = small, iters

    def inputs(self, b: int, h: int, hkv: int, length: int, d: int) -> Any:
        g = torch.Generator(device=self.device).manual_seed(0)
        return tuple(
            torch.randn(
                b, n, length, d, device=self.device, dtype=torch.bfloat16, generator=g
            ).requires_grad_()
            for n in (h, hkv, hkv)
        )

    def compare(self, what: str, fn: Fn, ref_fn: Fn, qkv: Any) -> None:
        try:
            out, ref = fn(*qkv), ref_fn(*qkv)
            g = torch.randn_like(out)
            grads = torch.autograd.grad(out, qkv, g)
            ref_grads = torch.autograd.grad(ref, qkv, g)
        except Exception as exc:
            print(f"  {what}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            return
        diffs = [
            float((a.float() - b.float()).abs().max())
            for a, b in zip((out, *grads), (ref, *ref_grads), strict=True)
        ]
        print(
            f"  {what}: max |diff| out {diffs[0]:.2e}, dq {diffs[1]:.2e}, dk {diffs[2]:.2e}, dv {diffs[3]:.2e}"
            f" (ref max |out| {float(ref.float().abs().max()):.2f})",
            flush=True,
        )

    def time(self, name: str, fn: Fn, qkv: Any, mode: str, flops_fwd: float) -> None:
        q = qkv[0]
        grad_out = torch.randn_like(q)

        def step() -> Any:
            if mode == "fwd":
                with torch.no_grad():
                    return fn(*qkv)
            return torch.autograd.grad(fn(*qkv), qkv, grad_out)

        try:
            t = measure(step, self.device, warmup=3, iters=self.iters)
        except Exception as exc:
            print(f"  {name:<40} {mode:<6} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            return
        flops = flops_fwd * (3.5 if mode == "fwdbwd" else 1.0)
        host = f", host {t.host_ms:.3f} ms" if t.host_ms is not None else ""
        print(
            f"  {name:<40} {mode:<6} {t.median_ms:8.3f} ms {flops / t.median_ms / 1e9:7.1f} TFLOP/s"
            f"  (first call {t.first_s:.1f} s{host})",
            flush=True,
        )

    def routes(self, spec: Any, gqa: bool, names: list[str]) -> list[tuple[str, Fn]]:
        def one(name: str) -> Fn:
            return lambda q, k, v: fz.attention(q, k, v, mask=spec, enable_gqa=gqa, backend=name)

        return [(name, one(name)) for name in names]

    def documents(self) -> None:
        b, length = (1, 512) if self.small else (4, 8192)
        lo, hi = (32, 256) if self.small else (256, 2048)
        lengths = document_lengths(length, lo, hi, seed=0)
        spec = (masks.Document.from_lengths(lengths) & masks.Causal()).to(self.device)
        for h, hkv, d in ((16, 16, 128), (16, 16, 64), (32, 8, 128)):
            print(
                f"documents {lengths[:4]}... ({len(lengths)} per row), {b}x{h}:{hkv}x{length}x{d}", flush=True
            )
            qkv = self.inputs(b, h, hkv, length, d)
            flops = 4.0 * visible_pairs(spec, length, b, h, self.device) * d
            ragged = cudnn_documents(lengths, self.device)
            self.compare(
                "cuDNN ragged vs flex route", ragged, self.routes(spec, hkv != h, ["flex"])[0][1], qkv
            )
            for mode in ("fwd", "fwdbwd"):
                self.time("cuDNN ragged, folded heads", ragged, qkv, mode, flops)
                for name, fn in self.routes(spec, hkv != h, ["flex"]):
                    self.time(f"{name} route", fn, qkv, mode, flops)

    def prefix(self) -> None:
        b, h, length, d, p = (1, 2, 512, 64, 128) if self.small else (4, 16, 8192, 128, 2048)
        spec = masks.PrefixLM(prefix_len=p)
        print(f"prefix-LM {p}, {b}x{h}x{length}x{d}", flush=True)
        qkv = self.inputs(b, h, h, length, d)
        flops = 4.0 * visible_pairs(spec, length, b, h, self.device) * d
        split, flex = self.routes(spec, False, ["sdpa_split", "flex"])
        self.compare("sdpa_split route vs flex route", split[1], flex[1], qkv)
        for mode in ("fwd", "fwdbwd"):
            for name, fn in (split, flex):
                self.time(f"{name} route", fn, qkv, mode, flops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--only", default="documents,prefix")
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    probe = Probe(args.small, args.iters)
    print(
        f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}"
    )
    for part in args.only.split(","):
        getattr(probe, part.strip())()


if __name__ == "__main__":
    main()
