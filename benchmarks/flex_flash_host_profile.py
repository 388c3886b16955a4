"""Where the host time of a compiled FLASH-backend flex call goes (CUDA, FA4 installed).

Runs ``torch.compile(flex_attention)`` with ``kernel_options={"BACKEND": "FLASH"}`` (causal
BlockMask, bf16) forward, then forward+backward, warmed up, under cProfile, and prints the
functions with the most cumulative and own time per call.

    python benchmarks/flex_flash_host_profile.py [--shape 1x8x512x64] [--calls 200]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from typing import Any

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1x8x512x64")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, H, L, D = (int(x) for x in args.shape.split("x"))

    def causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return q >= kv

    mask = create_block_mask(causal, None, None, L, L, device="cuda")
    flex = torch.compile(flex_attention)
    q, k, v = (
        torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    dout = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    opts = {"BACKEND": "FLASH"}

    def fwd() -> None:
        with torch.no_grad():
            flex(q, k, v, block_mask=mask, kernel_options=opts)

    def step() -> None:
        flex(q, k, v, block_mask=mask, kernel_options=opts).backward(dout)

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {args.shape}")
    for label, fn in (("forward", fwd), ("forward+backward", step)):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            fn()
        profile.disable()
        torch.cuda.synchronize()
        print(f"\n=== {label}, {args.calls} calls (times are totals over them) ===")
        stats = pstats.Stats(profile).strip_dirs()
        stats.sort_stats("cumulative").print_stats(args.top)
        stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
