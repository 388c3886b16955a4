"""A transformers dynamic-cache generation step, one attention layer: time per step.

transformers' ``DynamicCache`` concatenates each step's key/value onto the cache (a new
contiguous tensor, one key longer, every step), and the integration hands each layer one query
whose mask is ``OffsetCausal(Lkv - 1)`` (it hides no key). Per step (a new length each time,
synchronized after each step, median over the steps), on CUDA:

* ``fz.attention(q, k, v, mask=OffsetCausal(Lkv - 1))``: what the integration called for a
  decode step (a plan per step: the plan cache keys exact shapes);
* ``fz.attention(q, k, v)`` without the mask, for comparison;
* the integration's decode step (``flexattn_zoo.hf.integration._decode_step``), where this tree
  has it;
* ``F.scaled_dot_product_attention`` without cuDNN (cuDNN builds a plan per new shape).

    PYTHONPATH=. python benchmarks/hf_decode_probe.py [--batch 1 --start 1000 --steps 60]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import flexattn_zoo as fz
from flexattn_zoo.masks.causal import OffsetCausal

try:
    from flexattn_zoo.hf.integration import _decode_step
except ImportError:  # a tree without it
    _decode_step = None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--start", type=int, default=1000)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(0)
    b, h, hkv, d = args.batch, args.heads, args.kv_heads, args.head_dim
    q = torch.randn(b, h, 1, d, generator=gen).to(device, dtype)
    scale = d**-0.5

    def no_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    calls: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]] = {
        "fz.attention(mask=OffsetCausal(Lkv - 1))": lambda q, k, v: fz.attention(
            q, k, v, mask=OffsetCausal(offset=k.shape[2] - 1), scale=scale, enable_gqa=True
        ),
        "fz.attention(no mask)": lambda q, k, v: fz.attention(q, k, v, scale=scale, enable_gqa=True),
        "SDPA without cuDNN": no_cudnn,
    }
    if _decode_step is not None:
        calls["integration decode step"] = lambda q, k, v: _decode_step(
            q, k, v, OffsetCausal(offset=k.shape[2] - 1), scale, True
        )
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}, B={b} H={h}:{hkv} D={d}")
    for name, call in calls.items():
        k = torch.randn(b, hkv, args.start, d, generator=gen).to(device, dtype)
        v = torch.randn(b, hkv, args.start, d, generator=gen).to(device, dtype)
        times = []
        with torch.no_grad():
            for step in range(args.steps + 5):
                new = torch.randn(b, hkv, 1, d, device=device, dtype=dtype)
                k, v = torch.cat([k, new], dim=2), torch.cat([v, new], dim=2)  # as DynamicCache
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = call(q, k, v)
                torch.cuda.synchronize()
                if step >= 5:
                    times.append((time.perf_counter() - t0) * 1e6)
                assert out is not None, name
        print(
            f"{name:<45} median {statistics.median(times):8.1f} us per step (p90 "
            f"{statistics.quantiles(times, n=10)[-1]:8.1f}), from {args.start} keys"
        )


if __name__ == "__main__":
    main()
