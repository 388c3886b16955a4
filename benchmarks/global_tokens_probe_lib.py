"""What benchmarks/global_tokens_dense_probe.py and global_tokens_launch_probe.py share (CUDA):
setting the dense parts' Inductor options from the command line, timing a call, and listing the
GPU kernels one call launches."""

import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from flexattn_zoo.backends import global_tokens


def set_options_from_argv() -> list[str]:
    """The dense parts' Inductor options: exactly the boolean options named on the command line
    (none: compiled without options, the library's default). A fallback to the Python wrapper
    (its RuntimeWarning) stays visible; other warnings are silenced."""
    warnings.filterwarnings("ignore")
    warnings.simplefilter("default", RuntimeWarning)
    global_tokens._INDUCTOR_OPTIONS.clear()
    for option in sys.argv[1:]:
        global_tokens._INDUCTOR_OPTIONS[option] = True
    print("options:", sys.argv[1:] or "(none)")
    return sys.argv[1:]


def options_in_effect() -> str:
    """The options the dense parts were compiled with (after a fallback: none)."""
    parts = global_tokens.compiled_dense_parts()
    return f"forward {parts.forward._state[1] or '(none)'}, backward {parts.backward._state[1] or '(none)'}"


def timed(f: Callable[[], object], rounds: int = 7, calls: int = 20) -> tuple[float, float, float]:
    """``(first s, wall ms, host ms)``: the first call's seconds (compile), then after 5 warm-up
    calls the median over ``rounds`` rounds of ``calls`` back-to-back calls of the wall ms per call
    and of the host ms per call (issue time, before synchronizing)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    f()
    torch.cuda.synchronize()
    first = time.perf_counter() - t
    for _ in range(5):
        f()
    walls, hosts = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            f()
        hosts.append((time.perf_counter() - t) / calls * 1e3)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t) / calls * 1e3)
    return first, statistics.median(walls), statistics.median(hosts)


def print_kernels(label: str, f: Callable[[], object]) -> None:
    """The GPU kernels (and copies) one call of ``f`` launches, with their device us."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        f()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"{label}: {len(kernels)} GPU kernels / copies")
    for e in kernels:
        print(f"   {e.device_time_total:9.1f} us  {e.name[:100]}")
