"""Where ``fz.attention``'s host time per call goes beyond its kernel's, on CUDA.

Two parts, one process:

* ``profile``: per-function own time (cProfile, us per call) of ``fz.attention`` on a plan-cache
  hit against its bound call (what the hit runs) and the hand-written call, for the flex route's
  sliding-window problem of ``host_layers_probe.py`` and for an SDPA decoding call (one query,
  GQA, no mask), sorted by the difference: which functions the dispatcher adds. Before the
  profiles, the three calls' wall time per call, interleaved (no profiler).
* ``decode``: the kernels a one-query step over a cache prefix could launch, per shape: SDPA under
  ``decode_step``'s pin (FlashAttention-2 first), torch's FlashAttention-2 op, and the
  memory-efficient op (grouped heads folded into the query length: ``[B, Hkv, group, D]`` queries
  against ``[B, Hkv, L, D]`` keys, exact for a query that sees every key). For each: host time per
  call (issuing only) and device time per call (a CUDA graph of 20 calls replayed).

    PYTHONPATH=. python benchmarks/host_gap_probe.py [--parts profile,decode]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from host_layers_probe import plan_cache_entry, sliding_problem  # noqa: E402

import flexattn_zoo as fz  # noqa: E402
from flexattn_zoo import _compat, plan_cache  # noqa: E402

DECODE_SHAPES = (  # B, Hq, Hkv, L, D
    (1, 8, 8, 2048, 64),
    (1, 32, 8, 4096, 128),
    (4, 32, 8, 2048, 128),
    (8, 64, 8, 4096, 128),
    (16, 32, 32, 2048, 128),
    (64, 28, 4, 1024, 128),
    (128, 32, 8, 2048, 64),
    (8, 32, 32, 4096, 96),
    (1, 32, 8, 8000, 128),
    (32, 32, 8, 8000, 128),
)


def wall_per_call(calls: dict[str, Callable[[], Any]], rounds: int = 20, chunk: int = 50) -> dict[str, float]:
    """Median wall time per call (us) of each call, interleaved, synchronized after each chunk."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        for _ in range(20):
            call()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, call in calls.items():
            t0 = time.perf_counter()
            for _ in range(chunk):
                call()
            samples[name].append((time.perf_counter() - t0) / chunk * 1e6)
            torch.cuda.synchronize()
    return {name: statistics.median(s) for name, s in samples.items()}


def own_times(call: Callable[[], Any], n: int) -> dict[str, tuple[float, float]]:
    """``{function: (calls per call, own us per call)}`` under cProfile over ``n`` calls."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        call()
    prof.disable()
    torch.cuda.synchronize()
    out = {}
    for (path, line, name), (_, ncalls, own, _, _) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        out[f"{name} ({Path(path).name}:{line})"] = (ncalls / n, own / n * 1e6)
    return out


def profile_part(title: str, calls: dict[str, Callable[[], Any]], n: int = 2000, top: int = 25) -> None:
    print(f"## {title}")
    for name, us in wall_per_call(calls).items():
        print(f"  wall {us:8.1f} us/call  {name}")
    names = list(calls)
    tables = {name: own_times(calls[name], n) for name in names}
    base = tables[names[1]]  # the bound call
    fz_table = tables[names[0]]
    total = {name: sum(v[1] for v in t.values()) for name, t in tables.items()}
    print("  profiled own time per call: " + ", ".join(f"{name} {us:.1f}" for name, us in total.items()))
    rows = sorted(
        ((fz_table.get(f, (0, 0))[1] - base.get(f, (0, 0))[1], f) for f in set(fz_table) | set(base)),
        reverse=True,
    )
    print(f"  {'fz - bound':>10} {'fz calls':>8} {'fz us':>8} {'bound us':>8}  function")
    for diff, f in rows[:top]:
        a, b = fz_table.get(f, (0, 0)), base.get(f, (0, 0))
        print(f"  {diff:10.2f} {a[0]:8.1f} {a[1]:8.2f} {b[1]:8.2f}  {f}")


def profile(device: torch.device) -> None:
    q, k, v, sliding = sliding_problem(device, torch.bfloat16, (1, 8, 512, 64))
    _, hit = plan_cache_entry(q, k, v, sliding)
    scale = hit.scale
    profile_part(
        f"flex route ({hit.plan.backend}), SlidingWindow & Causal, 1x8x512x64",
        {
            "fz.attention": lambda: fz.attention(q, k, v, mask=sliding),
            "bound call": lambda: hit.run(q, k, v, scale),
        },
    )
    gen = torch.Generator(device="cpu").manual_seed(0)
    qd = torch.randn(8, 64, 1, 128, generator=gen).to(device, torch.bfloat16)
    kd, vd = (torch.randn(8, 8, 4096, 128, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        fz.attention(qd, kd, vd, enable_gqa=True)
        det = _compat.strict_deterministic_mode()
        dhit = plan_cache.lookup(
            plan_cache.call_key(qd, kd, vd, None, None, True, False, det, "auto"), qd, kd, vd
        )
        assert dhit is not None
        print(f"decode route: {dhit.plan.backend}")

        def fz_call() -> Any:
            with torch.no_grad():
                return fz.attention(qd, kd, vd, enable_gqa=True)

        def bound() -> Any:
            with torch.no_grad():
                return dhit.run(qd, kd, vd, dhit.scale)

        def plain() -> Any:
            with torch.no_grad():
                return F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)

        profile_part(
            f"SDPA decode ({dhit.plan.backend}), 8x64:8x1/4096x128, no mask",
            {"fz.attention": fz_call, "bound call": bound, "plain SDPA": plain},
        )


def device_us(call: Callable[[], Any], reps: int = 20, replays: int = 10) -> float:
    """Device time per call (us): ``reps`` calls captured in one CUDA graph, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def host_us(call: Callable[[], Any], n: int = 200) -> float:
    """Host time to issue one call (us), median over chunks of 20 (each chunk synchronized after)."""
    chunks = []
    for _ in range(n // 20):
        t0 = time.perf_counter()
        for _ in range(20):
            call()
        chunks.append((time.perf_counter() - t0) / 20 * 1e6)
        torch.cuda.synchronize()
    return statistics.median(chunks)


def decode_row(shape: tuple[int, ...], device: torch.device) -> str:
    """One shape's line of the ``decode`` part."""
    aten = torch.ops.aten
    b, hq, hkv, length, d = shape
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(b, hq, 1, d, generator=gen).to(device, torch.bfloat16)
    cache = [torch.randn(b, hkv, length + 64, d, generator=gen).to(device, torch.bfloat16) for _ in range(2)]
    k, v = cache[0][:, :, :length], cache[1][:, :, :length]
    group = hq // hkv
    qf = q.view(b, hkv, group, d)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)

    def pinned() -> Any:
        token = _compat.pin_sdpa_kernel(("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"))
        try:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=group > 1)
        finally:
            _compat.restore_sdpa_kernels(token)

    def flash_op() -> Any:
        return aten._scaled_dot_product_flash_attention.default(q, k, v)[0]

    def efficient_folded() -> Any:
        out = aten._scaled_dot_product_efficient_attention.default(qf, k, v, None, False)[0]
        return out.view(b, hq, 1, d)

    row = []
    with torch.no_grad():
        for name, call in (
            ("sdpa pinned", pinned),
            ("flash op", flash_op),
            ("efficient folded", efficient_folded),
        ):
            try:
                err = float((call().float() - ref).abs().max())
                row.append(f"{name} {host_us(call):6.1f} / {device_us(call):7.1f} (err {err:.1e})")
            except Exception as exc:  # a kernel that refuses the shape: say so
                row.append(f"{name} refused: {type(exc).__name__}: {str(exc)[:80]}")
    return f"B={b} H={hq}:{hkv} L={length} D={d}: " + " | ".join(row)


def decode(device: torch.device) -> None:
    print("## decode kernels: host us / device us per call")
    for shape in DECODE_SHAPES:
        print(decode_row(shape, device), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="profile,decode")
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}")
    parts = args.parts.split(",")
    if "decode" in parts:
        decode(device)
    if "profile" in parts:
        profile(device)


if __name__ == "__main__":
    main()
