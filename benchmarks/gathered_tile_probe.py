"""Which Triton flex configs fit shared memory when a score_mod gathers one value per score from a
captured tensor (a relative-position table, a dense bias), and what they cost.

A gathered ``[BLOCK_M, BLOCK_N]`` tile is pipelined through shared memory like K and V are, so
torch's default forward config can ask for more than an H200 has (Sandwich at D=64 with GQA:
"Required 245760, Hardware limit 232448"). For each score mod, head dim and kernel options this
compiles ``torch.compile(flex_attention)`` directly and reports whether the forward and the
backward compile, and their median time (CUDA events, warmed up; compile time excluded).

    PYTHONPATH=. python benchmarks/gathered_tile_probe.py [--lengths 256 4096]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def _time(fn, iters: int = 20) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _mods(length: int, heads: int, dev: str, batch: int, names: list[str] | None = None) -> dict[str, Any]:
    table = torch.randn(2 * length - 1, device=dev, dtype=torch.float32)
    bias = torch.randn(heads, length, length, device=dev, dtype=torch.float32)
    # Graphormer's form: an int32 shortest-path index per (batch, query, key) into a [S, H] table.
    spatial = torch.randint(0, 32, (batch, length, length), device=dev, dtype=torch.int32)
    spatial_table = torch.randn(32, heads, device=dev, dtype=torch.float32)

    def graph(s, b, h, q, kv):  # type: ignore[no-untyped-def]
        return s + spatial_table[spatial[b, q, kv], h].to(s.dtype)

    def relative(s, b, h, q, kv):  # type: ignore[no-untyped-def]
        return s + table[kv - q + length - 1] / (h + 1)

    def dense(s, b, h, q, kv):  # type: ignore[no-untyped-def]
        return s + bias[h, q, kv]

    mods = {"none": None, "table[kv - q]": relative, "bias[h, q, kv]": dense, "table[pos[b,q,kv],h]": graph}
    return {name: mods[name] for name in names} if names else mods


def _row(length: int, d: int, mod: Any, opts: dict[str, int] | None) -> str:
    dev, dt = "cuda", torch.bfloat16
    b, h, hkv = (2, 4, 2) if length <= 1024 else (1, 32, 8)
    bm = create_block_mask(lambda b_, h_, q, kv: q >= kv, None, None, length, length, device=dev)
    q = torch.randn(b, h, length, d, device=dev, dtype=dt, requires_grad=True)
    k, v = (torch.randn(b, hkv, length, d, device=dev, dtype=dt, requires_grad=True) for _ in range(2))
    grad = torch.randn(b, h, length, d, device=dev, dtype=dt)
    torch._dynamo.reset()
    fn = torch.compile(flex_attention, fullgraph=True)

    def fwd() -> torch.Tensor:
        return fn(q, k, v, score_mod=mod, block_mask=bm, enable_gqa=True, kernel_options=opts)

    try:
        with torch.no_grad():
            t_fwd = _time(fwd)
    except Exception as exc:  # noqa: BLE001 -- reported, the probe goes on
        return f"forward FAILED: {str(exc).splitlines()[0][:160]}"
    try:
        t_fb = _time(lambda: torch.autograd.grad(fwd(), (q, k, v), grad))
    except Exception as exc:  # noqa: BLE001
        return f"fwd {t_fwd:.3f} ms  backward FAILED: {str(exc).splitlines()[0][:160]}"
    return f"fwd {t_fwd:.3f} ms  fwd+bwd {t_fb:.3f} ms"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 4096])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--long-head-dims", type=int, nargs="+", default=[64], help="head dims at lengths > 1024")
    p.add_argument("--mods", nargs="+", default=None, help="score mods by name (default: all)")
    args = p.parse_args()
    configs: dict[str, dict[str, int] | None] = {
        "default": None,
        "fwd_num_stages=2": {"fwd_num_stages": 2},
        "stages=2 both": {"fwd_num_stages": 2, "bwd_num_stages": 2},
    }
    for length in args.lengths:
        for d in args.head_dims if length <= 1024 else args.long_head_dims:
            heads = 4 if length <= 1024 else 32
            batch = 2 if length <= 1024 else 1
            for mod_name, mod in _mods(length, heads, "cuda", batch, args.mods).items():
                for cfg_name, opts in configs.items():
                    if mod is None and opts is not None:
                        continue  # the reference row: torch's default config, no load
                    result = _row(length, d, mod, opts)
                    print(f"L={length} D={d} {mod_name:21s} {cfg_name:18s} {result}", flush=True)


if __name__ == "__main__":
    main()
