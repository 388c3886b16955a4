"""CPU forward of a draft tree (``Tree.typical_example``: 63 tokens after the context) on
``sdpa_split`` (its split form), ``flex_cpu`` and ``dense``, side by side in one process: median
ms of timed calls after warm-up (flex_cpu's compile is in the warm-up, reported apart).

    PYTHONPATH=. python benchmarks/cpu_tree_split_probe.py [--lengths 300 600 2048] [--iters 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import flexattn_zoo as fz
from flexattn_zoo import masks


def _time(fn, iters: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()  # the first call: compiles on flex_cpu
    first = time.perf_counter() - start
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times), first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[300, 600, 2048])
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; B=1, H={args.heads}, D={args.head_dim}, float32"
    )
    print("| L | queries | route | median ms | first call s |")
    print("|---|---|---|---|---|")
    for length in args.lengths:
        tree = masks.Tree.typical_example(length, length, 1, args.heads)
        drafted = masks.Tree(parents=tree.parents, prefix_len=tree.prefix_len, q_offset=tree.prefix_len)
        for name, spec, q_len in (
            ("whole row", tree, length),
            ("drafted tokens", drafted, tree.parents.numel()),
        ):
            g = torch.Generator().manual_seed(0)
            q = torch.randn(1, args.heads, q_len, args.head_dim, generator=g)
            k, v = (torch.randn(1, args.heads, length, args.head_dim, generator=g) for _ in range(2))
            for route in ("sdpa_split", "flex_cpu", "dense"):
                if route == "dense" and length > 1024:
                    continue
                with torch.no_grad():
                    ms, first = _time(lambda: fz.attention(q, k, v, mask=spec, backend=route), args.iters)  # noqa: B023
                print(f"| {length} | {name} | {route} | {ms:.2f} | {first:.2f} |", flush=True)


if __name__ == "__main__":
    main()
