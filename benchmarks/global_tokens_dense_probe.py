"""The global-tokens path's compiled dense parts alone (CUDA; no FA4 needed), under Inductor
options: a [CLS] token and a window of 512 keys each side at 2x16x8192x128 bf16, the windowed
kernel's output and lse stood in by random tensors. Per part (forward, backward): the first
call's seconds (compile), the median over 7 rounds of 20 back-to-back calls of the wall ms and
the host ms per call (issue time, before synchronizing), and the GPU kernels one call launches.

    PYTHONPATH=.:$PYTHONPATH python3 benchmarks/global_tokens_dense_probe.py [OPTION ...]

OPTION: a boolean Inductor option for the dense parts (``cpp_wrapper``, ``combo_kernels``); none:
compiled without options (the library's default).
"""

import statistics
import sys
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from flexattn_zoo.backends import global_tokens

warnings.filterwarnings("ignore")
warnings.simplefilter("default", RuntimeWarning)  # a fallback to the Python wrapper shows
global_tokens._INDUCTOR_OPTIONS.clear()
for option in sys.argv[1:]:
    global_tokens._INDUCTOR_OPTIONS[option] = True
print("options:", sys.argv[1:] or "(none)")
B, H, L, D = 2, 16, 8192, 128
parts = global_tokens.compiled_dense_parts()
dev, bf = "cuda", torch.bfloat16
q, k, v, out, g_out = (torch.randn(B, H, L, D, device=dev, dtype=bf) for _ in range(5))
lse = torch.randn(B, H, L, device=dev) + 8
rows = torch.tensor([0], device=dev)
window, scale = (512, 512), D**-0.5
calls = {
    "forward": lambda: parts.forward(q, k, v, out, lse, rows, window, scale, 0.0, True),
    "backward": lambda: parts.backward(
        q, k, v, g_out, None, q, k, v, out, lse, rows, window, scale, 0.0, True
    ),
}
for name, f in calls.items():
    torch.cuda.synchronize()
    t = time.perf_counter()
    f()
    torch.cuda.synchronize()
    first = time.perf_counter() - t
    for _ in range(5):
        f()
    walls, hosts = [], []
    for _ in range(7):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            f()
        hosts.append((time.perf_counter() - t) / 20 * 1e3)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t) / 20 * 1e3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        f()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"{name}: compiled with options {getattr(parts, name)._state[1] or '(none)'}")
    print(
        f"{name:9s} first {first:6.2f} s  wall {statistics.median(walls):.3f} ms  "
        f"host {statistics.median(hosts):.3f} ms  kernels {len(kernels)}"
    )
    for e in kernels:
        print(f"   {e.device_time_total:8.1f} us  {e.name[:100]}")
