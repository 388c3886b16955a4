"""Host time of the fa4 route's global-tokens path per call (CUDA, FA4 installed): a [CLS] token
and a window of 512 keys each side at 2x16x8192x128 bf16; host ms per forward and per
forward+backward (issue time of 20 calls after 5 warm-up calls), each followed by a cProfile of 20
more calls sorted by cumulative time.

    PYTHONPATH=.:$PYTHONPATH python3 benchmarks/global_tokens_host_probe.py
"""

import cProfile
import pstats
import time
import warnings

import torch

import flexattn_zoo as fz
from flexattn_zoo.masks import GlobalWindow

warnings.filterwarnings("ignore")
B, H, L, D = 2, 16, 8192, 128
m = GlobalWindow.from_positions([0], L, left=512, right=512, device="cuda")
q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)


def fwd() -> torch.Tensor:
    return fz.attention(q, k, v, mask=m, backend="fa4")


def step() -> None:
    fwd().backward(g)


for f in (fwd, step):
    for _ in range(5):
        f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        f()
    host = (time.perf_counter() - t) / 20 * 1e3
    torch.cuda.synchronize()
    print(f.__name__, "host ms/call", round(host, 3))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        f()
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(22)
