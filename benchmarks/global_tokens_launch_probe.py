"""The fa4 route's global-tokens path under Inductor options of its compiled dense parts (CUDA, FA4
installed): a [CLS] token and a window of 512 keys each side at 2x16x8192x128 bf16, beside the same
window alone on fa4 (the path's floor), in one process. Per mode: the first call's seconds
(compile), then the median over 7 rounds of 20 back-to-back calls of the wall ms per call and of
the host ms per call (issue time, before synchronizing).

    PYTHONPATH=.:$PYTHONPATH python3 benchmarks/global_tokens_launch_probe.py [OPTION ...]

OPTION: a boolean Inductor option set for the dense parts (``cpp_wrapper``, ``combo_kernels``);
none: the dense parts compiled without options (the library's default).
"""

import statistics
import sys
import time
import warnings

import torch

import flexattn_zoo as fz
from flexattn_zoo.backends import global_tokens
from flexattn_zoo.masks import GlobalWindow, SlidingWindow

warnings.filterwarnings("ignore")
warnings.simplefilter("default", RuntimeWarning)  # a fallback to the Python wrapper shows
global_tokens._INDUCTOR_OPTIONS.clear()
for option in sys.argv[1:]:
    global_tokens._INDUCTOR_OPTIONS[option] = True
B, H, L, D = 2, 16, 8192, 128
masks = {
    "global_window": GlobalWindow.from_positions([0], L, left=512, right=512, device="cuda"),
    "window_only": SlidingWindow(left=512, right=512),
}
q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)


def timed(f, rounds: int = 7, calls: int = 20) -> tuple[float, float]:
    walls, hosts = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            f()
        hosts.append((time.perf_counter() - t) / calls * 1e3)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t) / calls * 1e3)
    return statistics.median(walls), statistics.median(hosts)


print("options:", sys.argv[1:] or "(none)")
for name, mask in masks.items():

    def fwd(mask=mask) -> torch.Tensor:
        return fz.attention(q, k, v, mask=mask, backend="fa4")

    def step(fwd=fwd) -> None:
        fwd().backward(g)

    for mode, f in (("fwd", fwd), ("fwdbwd", step)):
        torch.cuda.synchronize()
        t = time.perf_counter()
        f()
        torch.cuda.synchronize()
        first = time.perf_counter() - t
        for _ in range(5):
            f()
        wall, host = timed(f)
        print(f"{name:14s} {mode:7s} first {first:7.2f} s  wall {wall:.3f} ms  host {host:.3f} ms")

parts = global_tokens.compiled_dense_parts()
print(
    "dense parts compiled with options",
    parts.forward._state[1] or "(none)",
    parts.backward._state[1] or "(none)",
)

# The GPU kernels one call launches, by name (global window only).
from torch.profiler import ProfilerActivity, profile  # noqa: E402

for mode in ("fwd", "fwdbwd"):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fz.attention(q, k, v, mask=masks["global_window"], backend="fa4")
        if mode == "fwdbwd":
            out.backward(g)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"global_window {mode}: {len(kernels)} GPU kernels / copies")
    for e in kernels:
        print(f"   {e.device_time_total:9.1f} us  {e.name[:90]}")
