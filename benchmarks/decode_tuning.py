"""Where a flex decode step spends its time, and which flex-decoding kernel options fill HBM (CUDA).

Measures, per (cache length, batch) with GQA 32:8, D=128, bf16, one new token per row:

* ``step``: the whole ``fz.decode.decode_step`` (host work + DecodeMask.update + kernel);
* ``update``: ``DecodeMask.update`` alone;
* ``kernel[variant]``: the compiled flex call alone on an already updated BlockMask, for kernel
  option variants (``SPLIT_KV``, ``BLOCK_N``, ``num_warps``, ``num_stages``) and with / without
  the (empty) full-block tensors, which make torch's decoding kernel split the whole capacity
  instead of the live blocks;
* ``sdpa``: ``F.scaled_dot_product_attention`` over the live cache (the bandwidth baseline).

Times are per step over back-to-back loops (CUDA events around ``--inner`` calls, median of
``--repeats`` loops), so host work that outruns the GPU is hidden, as in a serving loop.
``--profile`` adds a torch.profiler table of 20 decode steps at the first case.

Command used for benchmarks/results/decode_tuning_h200.txt::

    python benchmarks/decode_tuning.py --profile
"""

# ruff: noqa: B023  (every lambda here is timed before its loop variables change)
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_bench import time_steps  # noqa: E402  (this directory: benchmarks/)

from flexattn_zoo import _compat, masks  # noqa: E402
from flexattn_zoo.models import decode  # noqa: E402


def per_call(fn, inner: int, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """Median seconds per call over back-to-back loops of ``inner`` calls (3 warm-up calls)."""
    return time_steps(fn, 3, repeats, inner)


def variants(quick: bool) -> list[tuple[str, dict]]:
    """(block-mask kind, kernel options): torch's defaults with both masks, then a sweep."""
    vs: list[tuple[str, dict]] = [("full", {}), ("nofull", {})]
    if quick:
        return vs
    for splits in (None, 4, 16, 64):
        for block_n, warps, stages in ((64, 2, 1), (64, 4, 2), (128, 4, 2), (128, 8, 3)):
            v: dict = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
            if splits is not None:
                v["SPLIT_KV"] = splits
            vs.append(("nofull", v))
    return vs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="4096x1,16384x8,16384x64,65536x8,131072x1")
    p.add_argument("--inner", type=int, default=20)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="only torch's default kernel options")
    p.add_argument("--profile", action="store_true")
    p.add_argument(
        "--time-budget", type=float, default=400.0, help="stop sweeping variants after this many s"
    )
    a = p.parse_args()
    dev, dt, hq, hkv, d = "cuda", torch.bfloat16, 32, 8, 128
    flex = _compat.flex_attention
    print(
        f"# {torch.cuda.get_device_name()} torch {torch.__version__}; GQA {hq}:{hkv} D={d} bf16; us per step"
    )
    n_cases = len(a.cases.split(","))
    for case in a.cases.split(","):
        length, batch = (int(x) for x in case.split("x"))
        q = torch.randn(batch, hq, 1, d, device=dev, dtype=dt)
        k = torch.randn(batch, hkv, length, d, device=dev, dtype=dt)
        v = torch.randn_like(k)
        lens = torch.full((batch,), length, device=dev, dtype=torch.int32)
        gb = 2 * k.numel() * 2 / 1e9
        floor_us = gb / 4.3e3 * 1e6  # GB / (4300 GB/s), in us
        res: dict[str, float] = {}
        with torch.no_grad():
            res["sdpa"] = per_call(
                lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), a.inner, a.repeats
            )
            res["step"] = per_call(
                lambda: decode.decode_step(q, k, v, lens, mask=masks.Causal()), a.inner, a.repeats
            )
            dm = decode.DecodeMask(masks.Causal(), batch, 1, length, device=dev)
            res["update"] = per_call(lambda: dm.update(lens), a.inner, a.repeats)
            dm.update(lens)
            bm_full = dm.block_mask
            bm_nofull = _compat.BlockMask.from_kv_blocks(
                dm.kv_num_blocks,
                dm.kv_indices,
                BLOCK_SIZE=(128, 128),
                mask_mod=dm.mask_mod,
                seq_lengths=(1, length),
            )
            case_start = time.perf_counter()
            for name, opts in variants(a.quick):
                if time.perf_counter() - case_start > a.time_budget / n_cases:
                    print(f"  {case}: variant sweep stopped at its time budget")
                    break
                bm = bm_full if name == "full" else bm_nofull
                torch._dynamo.reset()
                fn = torch.compile(flex, fullgraph=True)
                label = (
                    f"kernel[{name} {','.join(f'{kk}={vv}' for kk, vv in opts.items()) or 'torch default'}]"
                )
                try:
                    fn(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=dict(opts) or None)
                    res[label] = per_call(
                        lambda: fn(
                            q, k, v, block_mask=bm, enable_gqa=True, kernel_options=dict(opts) or None
                        ),
                        a.inner,
                        a.repeats,
                    )
                except Exception as exc:  # noqa: BLE001 - a variant that does not compile is reported
                    print(f"  {case} {label}: {type(exc).__name__} {str(exc)[:120]}")
        best = sorted((t, n) for n, t in res.items() if n.startswith("kernel"))[:8]
        print(f"\n## L={length} B={batch}: K+V {gb:.3f} GB, HBM floor {floor_us:.1f} us")
        for n in ("sdpa", "step", "update"):
            print(f"  {n:<60} {res[n] * 1e6:9.1f} us  {gb / res[n] / 1e3:6.2f} TB/s")
        for t, n in best:
            print(f"  {n:<60} {t * 1e6:9.1f} us  {gb / t / 1e3:6.2f} TB/s")
        default = [n for n in res if "torch default" in n]
        for n in default:
            print(f"  {n:<60} {res[n] * 1e6:9.1f} us  {gb / res[n] / 1e3:6.2f} TB/s")
        sys.stdout.flush()
    if a.profile:
        length, batch = (int(x) for x in a.cases.split(",")[0].split("x"))
        q = torch.randn(batch, hq, 1, d, device=dev, dtype=dt)
        k = torch.randn(batch, hkv, length, d, device=dev, dtype=dt)
        v = torch.randn_like(k)
        lens = torch.full((batch,), length, device=dev, dtype=torch.int32)
        torch._dynamo.reset()
        with torch.no_grad():
            for _ in range(3):
                decode.decode_step(q, k, v, lens)
            torch.cuda.synchronize()
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    decode.decode_step(q, k, v, lens)
                torch.cuda.synchronize()
        print(f"\n## profile: 20 decode steps, L={length} B={batch}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
