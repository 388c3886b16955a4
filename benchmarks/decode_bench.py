"""Decode-step benchmark: time per step and fraction of HBM bandwidth (for a CUDA machine).

One decode step reads the whole live KV cache once, so its speed of light is
``bytes(K and V of the live cache) / HBM bandwidth``; the report prints that fraction
(``--hbm-tbps``, default 4.3 TB/s, about what an H200 sustains in a copy). Routes:

* ``flex``        ``fz.decode.decode_step`` on a contiguous cache with a ``[B]`` lengths tensor
  (torch's flex-decoding kernel, BlockMask updated in place);
* ``decode_int``  ``fz.decode.decode_step`` with the length as an int (every row equally long):
  the plain one-query step, SDPA over the live prefix (with ``--window``, over the window);
* ``attention``   ``fz.attention(q, k[:, :, :L], v[:, :, :L], enable_gqa=True)``: the library's
  general entry on the live prefix, as a model without ``decode_step`` calls it;
* ``flex_graph``  the same step captured once in a CUDA graph and replayed (the lengths tensor
  is read in the graph, so one capture serves every step): what a serving loop that graphs its
  step pays, without Python and launch overhead;
* ``flex_paged``  the same on a paged pool (``block_table``, page = 128 tokens, shuffled pages);
* ``varlen_paged`` ``fz.decode.decode_step_varlen`` (FlashAttention varlen, torch >= 2.13);
* ``sdpa``        ``F.scaled_dot_product_attention`` over ``cache[:, :, :L]`` with one query and no
  mask (the same result for a full, causal cache of equal lengths; with ``--window W``, over
  ``cache[:, :, L - W:L]``): the library-free baseline.

Usage (GPU session)::

    python benchmarks/decode_bench.py --md benchmarks/results/decode_h200.md --json benchmarks/results/decode_h200.json
    python benchmarks/decode_bench.py --lens 4096 --batch 1 --routes flex   # quick check

Step time: median over back-to-back loops of 10 steps (no sync between steps). Each case: GQA
``--heads 32,8``, head dim 128, bf16, one new token per row, all rows at the same length; ``--window`` adds a sliding window (then only the window is read, and the bandwidth is
computed over the window). Not run on CPU.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flexattn_zoo as fz  # noqa: E402
from flexattn_zoo import _compat, masks  # noqa: E402
from flexattn_zoo.models import decode  # noqa: E402

BS = 128


def time_steps(fn, warmup: int, repeats: int, inner: int = 10) -> float:  # type: ignore[no-untyped-def]
    """Median seconds per step over back-to-back loops of ``inner`` steps (CUDA events).

    Steps are launched without a sync in between, as a serving loop does: host work that keeps
    ahead of the GPU is hidden, host work that does not shows up.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / 1e3 / inner)
    return statistics.median(times)


def _graphed(step):  # type: ignore[no-untyped-def]
    """``step`` captured in a CUDA graph (after a warm-up on a side stream); returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def run_case(
    route: str,
    batch: int,
    length: int,
    heads: int,
    kv_heads: int,
    dim: int,
    window: int | None,
    warmup: int,
    repeats: int,
) -> dict:
    dev, dtype = "cuda", torch.bfloat16
    q = torch.randn(batch, heads, 1, dim, device=dev, dtype=dtype)
    lens = torch.full((batch,), length, device=dev, dtype=torch.int32)
    mask = masks.SlidingWindow.from_hf(window) if window else masks.Causal()
    live = min(length, window) if window else length
    pages = -(-length // BS)
    if route in ("flex_paged", "varlen_paged"):
        n_pages = batch * pages
        perm = torch.randperm(n_pages, device=dev)
        table = perm.view(batch, pages).to(torch.int32)
        if route == "flex_paged":
            kp = torch.randn(1, kv_heads, n_pages * BS, dim, device=dev, dtype=dtype)
            vp = torch.randn_like(kp)

            def step():  # type: ignore[no-untyped-def]
                return decode.decode_step(q, kp, vp, lens, block_table=table, mask=mask)
        else:
            if not _compat.varlen_supports("block_table"):
                return {"route": route, "skipped": "varlen without block_table on this torch"}
            kp = torch.randn(n_pages, BS, kv_heads, dim, device=dev, dtype=dtype)
            vp = torch.randn_like(kp)

            def step():  # type: ignore[no-untyped-def]
                return decode.decode_step_varlen(q, kp, vp, lens, table, window=window)
    else:
        k = torch.randn(batch, kv_heads, pages * BS, dim, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        if route in ("flex", "flex_graph"):

            def step():  # type: ignore[no-untyped-def]
                return decode.decode_step(q, k, v, lens, mask=mask)
        elif route == "decode_int":

            def step():  # type: ignore[no-untyped-def]
                return decode.decode_step(q, k, v, length, mask=mask)
        elif route == "attention":
            if window:
                return {"route": route, "skipped": "the prefix call is measured without a window"}

            def step():  # type: ignore[no-untyped-def]
                return fz.attention(q, k[:, :, :length], v[:, :, :length], enable_gqa=True)
        else:  # sdpa baseline: attention over the keys the query sees (with a window, its slice)
            start = length - live

            def step():  # type: ignore[no-untyped-def]
                return F.scaled_dot_product_attention(
                    q, k[:, :, start:length], v[:, :, start:length], enable_gqa=True
                )

    with torch.no_grad():
        t0 = time.perf_counter()
        if route == "flex_graph":
            step = _graphed(step)
        step()
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        seconds = time_steps(step, warmup, repeats)
    cache_bytes = 2 * batch * kv_heads * live * dim * torch.finfo(dtype).bits // 8
    return {
        "route": route,
        "batch": batch,
        "length": length,
        "window": window,
        "first_call_s": first,
        "step_us": seconds * 1e6,
        "bytes": cache_bytes,
        "tbps": cache_bytes / seconds / 1e12,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lens", default="4096,16384,65536,131072")
    p.add_argument("--batch", default="1,8,32,64")
    p.add_argument("--heads", default="32,8", help="H,HKV")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--window", type=int, default=None)
    p.add_argument("--routes", default="flex,flex_graph,flex_paged,varlen_paged,decode_int,attention,sdpa")
    p.add_argument("--hbm-tbps", type=float, default=4.3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--max-gib", type=float, default=60.0, help="skip cases whose K+V exceed this")
    p.add_argument("--json")
    p.add_argument("--md")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("decode_bench needs a CUDA GPU", file=sys.stderr)
        return 1
    heads, kv_heads = (int(x) for x in a.heads.split(","))
    command = shlex.join(["python", "benchmarks/decode_bench.py", *sys.argv[1:]])

    def save() -> None:  # after every row: a sweep stopped at a time limit keeps its rows
        meta = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "heads": a.heads,
            "dim": a.dim,
            "window": a.window,
            "hbm_tbps": a.hbm_tbps,
        }
        if a.json:
            Path(a.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        if a.md:
            lines = [
                f"# Decode step, {meta['device']}, torch {meta['torch']}, H={a.heads}, D={a.dim}, window={a.window}",
                "",
                f"Command: `{command}`",
                "",
                f"Fraction of HBM = live K+V bytes / step time / {a.hbm_tbps} TB/s.",
                "",
                "| length | batch | route | step (us) | TB/s | of HBM | first call (s) | note |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for r in rows:
                if "step_us" in r:
                    lines.append(
                        f"| {r['length']} | {r['batch']} | {r['route']} | {r['step_us']:.1f} | {r['tbps']:.2f} | "
                        f"{r['hbm_fraction']:.0%} | {r['first_call_s']:.2f} | |"
                    )
                else:
                    lines.append(
                        f"| {r['length']} | {r['batch']} | {r['route']} | | | | | {r.get('skipped', r.get('error', ''))} |"
                    )
            Path(a.md).write_text("\n".join(lines) + "\n")

    rows = []
    for length in (int(x) for x in a.lens.split(",")):
        for batch in (int(x) for x in a.batch.split(",")):
            gib = 2 * batch * kv_heads * length * a.dim * 2 / 2**30
            for route in a.routes.split(","):
                if gib > a.max_gib:
                    rows.append(
                        {
                            "route": route,
                            "batch": batch,
                            "length": length,
                            "skipped": f"{gib:.0f} GiB > --max-gib",
                        }
                    )
                    continue
                try:
                    row = run_case(
                        route, batch, length, heads, kv_heads, a.dim, a.window, a.warmup, a.repeats
                    )
                except Exception as exc:  # noqa: BLE001 - report and go on with the sweep
                    row = {"route": route, "error": repr(exc)[:200]}
                row.setdefault("batch", batch)
                row.setdefault("length", length)
                if "tbps" in row:
                    row["hbm_fraction"] = row["tbps"] / a.hbm_tbps
                rows.append(row)
                print(json.dumps(row), flush=True)
                save()
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
