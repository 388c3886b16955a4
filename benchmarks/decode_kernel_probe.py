"""Which SDPA kernel a one-query decode step should launch: time per step of generation-like loops.

For each shape (batch, q heads, kv heads, cache length, head dim; bf16) a loop of steps, each one
query per row against the live prefix of a KV cache whose length cycles over 64 values (as a
generation loop meets them), issued back to back; the time per step is the loop's wall time over
its steps with the device synchronized at the end, so it is whichever is longer of the host's
time to issue a step and the device's time to run it. Calls, interleaved round by round:

* ``flash``: ``aten._scaled_dot_product_flash_attention`` (FlashAttention-2, split-KV for decode,
  GQA as it is);
* ``efficient``: ``aten._scaled_dot_product_efficient_attention`` (k/v expanded for GQA, which it lacks);
* ``sdpa``: ``F.scaled_dot_product_attention`` with torch's own kernel choice (cuDNN first);
* ``decode_step``: ``fz.decode.decode_step`` with an int ``cache_len``.

Prints a table of median us per step over rounds, and each kernel's ratio to ``flash``.

    PYTHONPATH=. python benchmarks/decode_kernel_probe.py [--rounds 5 --steps 200]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import flexattn_zoo as fz

BATCHES = (1, 8, 32)
HEADS = ((8, 8), (32, 8))
LENGTHS = (512, 2048, 8192)
HEAD_DIMS = (64, 128)


def calls(b: int, hq: int, hk: int, n: int, d: int) -> dict[str, Callable[[int], Any]]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    q = make(b, hq, 1, d)
    k_cache, v_cache = make(b, hk, n + 64, d), make(b, hk, n + 64, d)
    group = hq // hk
    aten = torch.ops.aten

    def flash(length: int) -> Any:  # FA2 takes fewer k/v heads as they are
        return aten._scaled_dot_product_flash_attention.default(
            q, k_cache[:, :, :length], v_cache[:, :, :length]
        )

    def efficient(length: int) -> Any:
        k, v = k_cache[:, :, :length], v_cache[:, :, :length]
        if group > 1:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return aten._scaled_dot_product_efficient_attention.default(q, k, v, None, False)

    def sdpa(length: int) -> Any:
        return F.scaled_dot_product_attention(
            q, k_cache[:, :, :length], v_cache[:, :, :length], enable_gqa=group > 1
        )

    def step(length: int) -> Any:
        return fz.decode.decode_step(q, k_cache, v_cache, length)

    return {"flash": flash, "efficient": efficient, "sdpa": sdpa, "decode_step": step}


def per_step_us(call: Callable[[int], Any], n: int, steps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        call(n + i % 64)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    print(
        f"# us per decode step, torch {torch.__version__}, {torch.cuda.get_device_name()}, bf16, "
        f"median of {args.rounds} rounds x {args.steps} steps (wall, synchronized per loop; GQA: efficient "
        "on k/v expanded, which costs it a copy)"
    )
    names = ["flash", "efficient", "sdpa", "decode_step"]
    print("| B | Hq:Hkv | L | D | " + " | ".join(names) + " | efficient / flash | decode_step / flash |")
    print("|---|---|---|---|" + "---:|" * (len(names) + 2))
    for b, (hq, hk), n, d in itertools.product(BATCHES, HEADS, LENGTHS, HEAD_DIMS):
        fns = calls(b, hq, hk, n, d)
        for fn in fns.values():
            for i in range(70):  # every length of the cycle once (cuDNN plans, decode_step's cache)
                fn(n + i % 64)
        samples: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                samples[name].append(per_step_us(fn, n, args.steps))
        med = {name: statistics.median(s) for name, s in samples.items()}
        cells = " | ".join(f"{med[name]:.1f}" for name in names)
        print(
            f"| {b} | {hq}:{hk} | {n} | {d} | {cells} | {med['efficient'] / med['flash']:.2f} "
            f"| {med['decode_step'] / med['flash']:.2f} |",
            flush=True,
        )
        del fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
