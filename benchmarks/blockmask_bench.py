"""Time fz.block_mask's closed-form builders against torch's create_block_mask.

    python benchmarks/blockmask_bench.py --out benchmarks/results/blockmask_h200.md

Median of 10 builds after 3 warm-ups, the cache cleared before each build (so every build is
real). torch's compiled create_block_mask runs up to 128K tokens (at 1M it takes ~1 s and 4 GB).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import flexattn_zoo as fz
from flexattn_zoo import _compat, masks
from flexattn_zoo.blockmask import CACHE


def _time(fn, iters: int = 10, warmup: int = 3) -> float:  # type: ignore[no-untyped-def]
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples)


def _doc(length: int) -> masks.Document:
    g = torch.Generator().manual_seed(0)
    lengths, total = [], 0
    while total < length:
        n = int(torch.randint(256, 2049, (1,), generator=g))
        n = min(n, length - total)
        lengths.append(n)
        total += n
    return masks.Document.from_lengths(lengths, device="cuda")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for length in (32768, 131072, 1 << 20):
        cases = {
            "causal": masks.Causal(),
            "sliding_1023": masks.SlidingWindow(left=1023),
            "document": _doc(length),
            "document_causal": _doc(length) & masks.Causal(),
        }
        for name, spec in cases.items():

            def ours(spec: fz.MaskSpec = spec, length: int = length) -> None:
                CACHE.clear()
                fz.block_mask(spec, length, length, device="cuda")

            torch.cuda.reset_peak_memory_stats()
            ms = _time(ours)
            peak = torch.cuda.max_memory_allocated() / 2**20
            theirs = "-"
            if length <= 131072:
                mod = spec.to("cuda").mask_mod()
                compiled = torch.compile(_compat.create_block_mask)
                theirs = f"{_time(lambda: compiled(mod, None, None, length, length, device='cuda')):.2f}"  # noqa: B023 - timed at once
            rows.append((name, length, f"{ms:.2f}", f"{peak:.0f}", theirs))
            print(rows[-1], flush=True)
    lines = [
        "# fz.block_mask build time (H200)",
        "",
        "Command: `python benchmarks/blockmask_bench.py --out benchmarks/results/blockmask_h200.md`",
        f"torch {torch.__version__}, GPU {torch.cuda.get_device_name()}",
        "",
        "| mask | tokens | fz.block_mask ms | peak MiB | compiled create_block_mask ms |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
