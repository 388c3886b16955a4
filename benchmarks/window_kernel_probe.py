"""CUDA: which SDPA kernel serves a one-query step over a full sliding window, and how fast each
is. One query per row over the last ``--window`` keys of a bf16 cache (GQA 32:8, D=128), SDPA
pinned to each kernel in turn and unpinned (SDPA's own choice, as a user's call makes it);
back-to-back steps timed with CUDA events (``decode_bench.time_steps``: 20 warm-up steps, median
of ``--rounds`` rounds of ``--steps`` steps).

    python benchmarks/window_kernel_probe.py --window 4096 --batch 1,8,32
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from decode_bench import time_steps  # this directory: benchmarks/
from torch.nn.attention import SDPBackend, sdpa_kernel

KERNELS = {
    "own choice": None,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--batch", default="1,8,32")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args()
    print(
        f"{torch.__version__}, {torch.cuda.get_device_name()}, window {a.window} of {a.length} keys, us per step"
    )
    print("| batch | " + " | ".join(KERNELS) + " |")
    print("|---|" + "---:|" * len(KERNELS))
    for batch in (int(b) for b in a.batch.split(",")):
        q = torch.randn(batch, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, 8, a.length, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lo = a.length - a.window
        cells = []

        def step(q=q, k=k[:, :, lo:], v=v[:, :, lo:]):  # type: ignore[no-untyped-def]
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        for kernel in KERNELS.values():
            try:
                if kernel is None:
                    seconds = time_steps(step, 20, a.rounds, a.steps)
                else:
                    with sdpa_kernel([kernel]):
                        seconds = time_steps(step, 20, a.rounds, a.steps)
                cells.append(f"{seconds * 1e6:.1f}")
            except RuntimeError as exc:
                cells.append(f"refused ({str(exc).splitlines()[0][:40]})")
        print(f"| {batch} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
