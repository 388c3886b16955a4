"""The fa4 route's global-tokens path under Inductor options of its compiled dense parts (CUDA, FA4
installed): a [CLS] token and a window of 512 keys each side at 2x16x8192x128 bf16, beside the same
window alone on fa4 (the path's floor), in one process. Per mode: the first call's seconds
(compile), then the median over 7 rounds of 20 back-to-back calls of the wall ms per call and of
the host ms per call (issue time, before synchronizing).

    PYTHONPATH=.:$PYTHONPATH python3 benchmarks/global_tokens_launch_probe.py [OPTION ...]

OPTION: a boolean Inductor option set for the dense parts (``cpp_wrapper``, ``combo_kernels``);
none: the dense parts compiled without options (the library's default).
"""

import torch
from global_tokens_probe_lib import options_in_effect, print_kernels, set_options_from_argv, timed

import flexattn_zoo as fz
from flexattn_zoo.masks import GlobalWindow, SlidingWindow

set_options_from_argv()
B, H, L, D = 2, 16, 8192, 128
masks = {
    "global_window": GlobalWindow.from_positions([0], L, left=512, right=512, device="cuda"),
    "window_only": SlidingWindow(left=512, right=512),
}
q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)

for name, mask in masks.items():

    def fwd(mask=mask) -> torch.Tensor:
        return fz.attention(q, k, v, mask=mask, backend="fa4")

    def step(fwd=fwd) -> None:
        fwd().backward(g)

    for mode, f in (("fwd", fwd), ("fwdbwd", step)):
        first, wall, host = timed(f)
        print(f"{name:14s} {mode:7s} first {first:7.2f} s  wall {wall:.3f} ms  host {host:.3f} ms")
        if name == "global_window":
            print_kernels(f"{name} {mode}", f)
print("dense parts compiled with options:", options_in_effect())
