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
* ``decode_step``: ``fz.decode.decode_step`` with an int ``cache_len``;
* ``cudnn_bucket``: cuDNN through SDPA on the prefix rounded up to a multiple of 256 keys with a
  float key-padding bias (``-inf`` past the live length): one cuDNN plan per bucket instead of one
  per length (the cache holds room for the last bucket);
* ``flex``: ``fz.attention(..., backend="flex")`` on the prefix (Triton's flex-decoding kernel);
* ``fa4`` / ``fa4_splits`` (with flash-attn-4 installed): ``flash_attn_func`` on ``[B, L, H, D]``
  views with ``pack_gqa=True``, one split / FA4's split heuristic (``num_splits=0``).

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
from torch.nn.attention import SDPBackend, sdpa_kernel

import flexattn_zoo as fz

BATCHES = (1, 8, 32)
HEADS = ((8, 8), (32, 8))
LENGTHS = (512, 2048, 8192)
HEAD_DIMS = (64, 128)
BUCKET = 256
NEG_INF = float("-inf")


def calls(b: int, hq: int, hk: int, n: int, d: int) -> dict[str, Callable[[int], Any]]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    q = make(b, hq, 1, d)
    room = -(-(n + 64) // BUCKET) * BUCKET  # the last bucket of the cycle fits
    k_cache, v_cache = make(b, hk, room, d), make(b, hk, room, d)
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

    positions = torch.arange(room, device="cuda")

    def cudnn_bucket(length: int) -> Any:
        bucket = -(-length // BUCKET) * BUCKET
        bias = torch.zeros(bucket, device="cuda", dtype=q.dtype).masked_fill_(
            positions[:bucket] >= length, NEG_INF
        )
        k, v = k_cache[:, :, :bucket], v_cache[:, :, :bucket]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias.expand(b, 1, 1, bucket), enable_gqa=group > 1
            )

    def flex(length: int) -> Any:
        return fz.attention(
            q, k_cache[:, :, :length], v_cache[:, :, :length], enable_gqa=group > 1, backend="flex"
        )

    out: dict[str, Callable[[int], Any]] = {
        "flash": flash, "efficient": efficient, "sdpa": sdpa, "decode_step": step,
        "cudnn_bucket": cudnn_bucket, "flex": flex,
    }  # fmt: skip
    if fz._compat.flash_cute_available():
        from flash_attn.cute import flash_attn_func

        qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)

        def fa4(length: int, splits: int = 1) -> Any:
            return flash_attn_func(qt, kt[:, :length], vt[:, :length], pack_gqa=True, num_splits=splits)

        out["fa4"] = fa4
        out["fa4_splits"] = lambda length: fa4(length, 0)
    return out


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
    p.add_argument("--shapes", default=None, help="B:Hq:Hkv:L:D,... (default: the full grid)")
    p.add_argument("--only", default=None, help="comma-separated calls to time (default: all)")
    args = p.parse_args()
    print(
        f"# us per decode step, torch {torch.__version__}, {torch.cuda.get_device_name()}, bf16, "
        f"median of {args.rounds} rounds x {args.steps} steps (wall, synchronized per loop; GQA: efficient "
        "on k/v expanded, which costs it a copy)"
    )
    grid = [(b, hq, hk, n, d) for b, (hq, hk), n, d in itertools.product(BATCHES, HEADS, LENGTHS, HEAD_DIMS)]
    if args.shapes:
        grid = [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")]  # type: ignore[misc]
    names = list(calls(1, 1, 1, 64, 64))
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    print(
        "| B | Hq:Hkv | L | D | "
        + " | ".join(names)
        + " | "
        + " | ".join(f"{n} / flash" for n in names)
        + " |"
    )
    print("|---|---|---|---|" + "---:|" * (2 * len(names)))
    for b, hq, hk, n, d in grid:
        fns = {name: fn for name, fn in calls(b, hq, hk, n, d).items() if name in names}
        for name, fn in list(fns.items()):
            try:
                for i in range(70):  # every length of the cycle once (cuDNN plans, decode_step's cache)
                    fn(n + i % 64)
            except Exception as exc:  # a kernel that refuses the shape: reported, not timed
                print(f"<!-- {name} at {b}:{hq}:{hk}:{n}:{d}: {type(exc).__name__}: {str(exc)[:200]} -->")
                del fns[name]
        samples: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                samples[name].append(per_step_us(fn, n, args.steps))
        med = {name: statistics.median(s) for name, s in samples.items()}
        cells = " | ".join(f"{med[name]:.1f}" if name in med else "-" for name in names)
        ratios = " | ".join(
            f"{med[name] / med['flash']:.2f}" if name in med and "flash" in med else "" for name in names
        )
        print(f"| {b} | {hq}:{hk} | {n} | {d} | {cells} | {ratios} |", flush=True)
        del fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
