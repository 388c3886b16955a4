"""The global-tokens path's compiled dense parts alone (CUDA; no FA4 needed), under Inductor
options: a [CLS] token and a window of 512 keys each side at 2x16x8192x128 bf16, the windowed
kernel's output and lse stood in by random tensors. Per part (forward, backward): the first
call's seconds (compile), the median over 7 rounds of 20 back-to-back calls of the wall ms and
the host ms per call (issue time, before synchronizing), and the GPU kernels one call launches.

    PYTHONPATH=.:$PYTHONPATH python3 benchmarks/global_tokens_dense_probe.py [OPTION ...]

OPTION: a boolean Inductor option for the dense parts (``cpp_wrapper``, ``combo_kernels``); none:
compiled without options (the library's default).
"""

import torch
from global_tokens_probe_lib import options_in_effect, print_kernels, set_options_from_argv, timed

from flexattn_zoo.backends import global_tokens

set_options_from_argv()
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
    first, wall, host = timed(f)
    print(f"{name:9s} first {first:6.2f} s  wall {wall:.3f} ms  host {host:.3f} ms")
    print_kernels(name, f)
print("compiled with options:", options_in_effect())
