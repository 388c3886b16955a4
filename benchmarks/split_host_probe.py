"""Where ``sdpa_split``'s time goes on CUDA: host time per call against device time, the first
synchronizing operation of a call (``torch.cuda.set_sync_debug_mode``), and the profiler's
host-time table, for a draft tree and prefix-LM cases; ``flex`` beside it for reference.

    python benchmarks/split_host_probe.py [--device cuda] [--cases tree,prefix512,prefix2048]

On the CPU (``--device cpu``) it only checks that every step runs (no events, no sync check).
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

import flexattn_zoo as fz
from flexattn_zoo.masks import PrefixLM, Tree

CASES: dict[str, tuple[tuple[int, int, int, int], Callable[[int], Any]]] = {
    # (B, H, L, D), the mask for length L
    "tree": ((8, 16, 2048, 128), lambda n: Tree.typical_example(n, n, 8, 16)),
    "prefix512": ((8, 16, 2048, 64), lambda n: PrefixLM(prefix_len=n // 4)),
    "prefix2048": ((4, 16, 8192, 128), lambda n: PrefixLM(prefix_len=n // 4)),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_and_device_ms(fn: Callable[[], Any], device: torch.device, calls: int) -> tuple[float, float]:
    """Median host ms to issue one call, and device ms per call over ``calls`` back-to-back calls."""
    for _ in range(5):
        fn()
    _sync(device)
    host = []
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t_all = time.perf_counter()
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
    if device.type == "cuda":
        end.record()
        _sync(device)
        return statistics.median(host), start.elapsed_time(end) / calls
    return statistics.median(host), (time.perf_counter() - t_all) * 1e3 / calls


def first_sync(fn: Callable[[], Any], device: torch.device) -> str:
    """The traceback of the first synchronizing CUDA operation ``fn`` makes, or 'none'."""
    if device.type != "cuda":
        return "not checked off CUDA"
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as exc:
        if "synchroniz" not in str(exc):
            raise
        return "".join(traceback.format_exception(exc)[-12:])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return "none"


def steps(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, route: str, grad: torch.Tensor
) -> Any:
    """``(mode, step)`` for a forward without autograd and a forward+backward of one call."""

    def fwd() -> Any:
        with torch.no_grad():
            return fz.attention(q, k, v, mask=mask, backend=route)

    def fwdbwd() -> Any:
        out = fz.attention(q, k, v, mask=mask, backend=route)
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    return (("fwd", fwd), ("fwdbwd", fwdbwd))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--routes", default="sdpa_split,flex")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--profile-rows", type=int, default=18)
    args = parser.parse_args()
    device = torch.device(args.device)
    small = device.type != "cuda"
    print(
        f"torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    )
    for name in args.cases.split(","):
        (b, h, n, d), make = CASES[name]
        if small:
            b, h, n, d = 1, 2, 256, 16
        mask = make(n).to(device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, h, n, d, device=device, dtype=dtype)
        for route in args.routes.split(","):
            route = "flex_cpu" if small and route == "flex" else route
            for mode, fn in steps(q, k, v, mask, route, grad):
                try:
                    fn()  # compiles, builds plans
                except (ValueError, RuntimeError) as exc:
                    print(f"\n## {name} {route} {mode}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                host, dev = host_and_device_ms(fn, device, args.calls)
                print(
                    f"\n## {name} {b}x{h}x{n}x{d} {route} {mode}: host {host:.3f} ms/call, "
                    f"device {dev:.3f} ms/call"
                )
                print("first synchronizing op:", first_sync(fn, device))
                if route == "sdpa_split" and not small:
                    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                    with torch.profiler.profile(activities=acts) as prof:
                        for _ in range(10):
                            fn()
                        _sync(device)
                    print(
                        prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows)
                    )


if __name__ == "__main__":
    main()
