"""The fa4 route's time per call with replayed FA4 launches, against FA4's own launcher (CUDA, FA4).

Side by side in one process, per shape and mode (forward; forward + backward): plain SDPA,
FA4's ``flash_attn_func`` called directly, and ``fz.attention(..., backend="fa4")`` with its
launches replayed (the default) and with ``FLEXATTN_ZOO_FA4_REPLAY=0`` (FA4's launcher every
call). Each piece is warmed up, then all four are timed together by
:func:`flexattn_zoo.bench.timing.interleaved` (rounds of back-to-back calls of each in turn, so
that the host's drift moves them alike): the median time per call (CUDA events: the GPU's time,
which is the host's when the host is slower) and the median host time to issue one call.

    python benchmarks/fa4_host.py --out benchmarks/results/fa4_host_h100.md
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import flexattn_zoo as fz
from flexattn_zoo.bench.timing import interleaved, measure

SHAPES = "1x8x512x64,8x16x512x128,4x32x1024x128,2x32x4096x128"


def _pieces(shape: str, backward: bool) -> dict[str, Callable[[], Any]]:
    from flash_attn.cute import flash_attn_func

    b, h, length, d = (int(x) for x in shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    # [B, L, H, D] projections viewed as [B, H, L, D]: FA4's layout, SDPA's view of it
    q, k, v = (
        torch.randn(b, length, h, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(
            backward
        )
        for _ in range(3)
    )
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    grad = torch.randn(b, length, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)

    def step(fn: Callable[[], torch.Tensor], layout: str) -> Callable[[], Any]:
        if not backward:
            return fn
        g = grad if layout == "bshd" else grad.transpose(1, 2)
        return lambda: torch.autograd.grad(fn(), (q, k, v), g)

    def fz_fa4(replay: str) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            os.environ["FLEXATTN_ZOO_FA4_REPLAY"] = replay  # both rows pay for setting it
            return fz.attention(qh, kh, vh, mask="causal", backend="fa4")

        return call

    return {
        "plain SDPA": step(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True), "bhsd"),
        "FA4 flash_attn_func": step(lambda: flash_attn_func(q, k, v, causal=True)[0], "bshd"),
        "fz fa4, replayed": step(fz_fa4("1"), "bhsd"),
        "fz fa4, FA4's launcher": step(fz_fa4("0"), "bhsd"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help="BxHxLxD, comma-separated (causal, bf16)")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--iters", type=int, default=400, help="timed calls per piece")
    ap.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = ap.parse_args()
    device = torch.device("cuda")
    lines = [
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}; causal, bf16; "
        "ms per call (median of back-to-back calls, CUDA events) / host ms to issue one call",
        "",
        "| shape B x H x L x D | mode | plain SDPA | FA4 flash_attn_func | fz fa4, replayed | "
        "fz fa4, FA4's launcher | replayed / launcher |",
        "|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for shape in args.shapes.split(","):
        for backward in (False, True):
            pieces = _pieces(shape, backward)
            for fn in pieces.values():  # compiles, records, warms up
                measure(fn, device, args.warmup, 10)
            timed = interleaved({name: (fn, args.iters) for name, fn in pieces.items()}, device)
            cells = {name: (t.median_ms, t.host_ms or 0.0) for name, t in timed.items()}
            ratio = cells["fz fa4, replayed"][0] / cells["fz fa4, FA4's launcher"][0]
            row = (
                f"| {shape} | {'fwd+bwd' if backward else 'fwd'} | "
                + " | ".join(f"{ms:.3f} / {host:.3f}" for ms, host in cells.values())
                + f" | {ratio:.2f} |"
            )
            lines.append(row)
            print(row, flush=True)
    os.environ.pop("FLEXATTN_ZOO_FA4_REPLAY", None)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n\n`python benchmarks/fa4_host.py` (this file's command)\n")


if __name__ == "__main__":
    main()
