"""One-query decoding over a KV cache that grows by one token per step, as generation runs it:
every step meets a cache length it has never seen. Times each step (wall, device synchronized)
for plain SDPA on the live prefix with torch's own kernel choice, the same with cuDNN disabled,
``fz.decode.decode_step`` with an int ``cache_len`` and ``fz.attention`` on the same slices;
median over the steps after a warm-up.

    PYTHONPATH=. python benchmarks/decode_growing_probe.py [--steps 200] [--batch 8] [--start 4000] [--routes sdpa,fa4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flexattn_zoo as fz


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--start", type=int, default=4000)
    p.add_argument("--routes", default="", help="also fz.attention(backend=ROUTE) for each, e.g. sdpa,fa4")
    args = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    b, h, hkv, d = args.batch, 32, 8, 128
    cap = args.start + 4 * args.steps + 16
    k, v = (torch.randn(b, hkv, cap, d, device=dev, dtype=dt) for _ in range(2))
    q = torch.randn(b, h, 1, d, device=dev, dtype=dt)
    no_cudnn = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    calls = {
        "F.scaled_dot_product_attention (torch's choice)": lambda n: F.scaled_dot_product_attention(
            q, k[:, :, :n], v[:, :, :n], enable_gqa=True
        ),
        "F.scaled_dot_product_attention without cuDNN": lambda n: _without(no_cudnn, q, k, v, n),
        "fz.decode.decode_step(cache_len=n)": lambda n: fz.decode.decode_step(q, k, v, n),
        "fz.attention(q, cache[:, :, :n]) (a plan-cache miss per step)": lambda n: fz.attention(
            q, k[:, :, :n], v[:, :, :n], enable_gqa=True
        ),
    }
    for route in args.routes.split(",") if args.routes else ():
        calls[f"fz.attention(backend={route!r})"] = lambda n, r=route: fz.attention(
            q, k[:, :, :n], v[:, :, :n], enable_gqa=True, backend=r
        )
    length = args.start
    with torch.no_grad():
        for name, call in calls.items():
            times = []
            try:
                call(length)
            except Exception as exc:  # a route this machine lacks (fa4 without FA4)
                print(f"{name}: unavailable ({type(exc).__name__}: {str(exc)[:120]})")
                continue
            for step in range(args.steps):
                length += 1  # a length no call has seen
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                call(length)
                torch.cuda.synchronize()
                if step >= 10:
                    times.append((time.perf_counter() - t0) * 1e3)
            print(
                f"{name}: median {statistics.median(times):.3f} ms per step (p90 {sorted(times)[len(times) * 9 // 10]:.3f})"
            )


def _without(kernels, q, k, v, n):  # type: ignore[no-untyped-def]
    with sdpa_kernel(kernels):
        return F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], enable_gqa=True)


if __name__ == "__main__":
    main()
