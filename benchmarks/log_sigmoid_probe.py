"""Spellings of log(sigmoid(x)) as a flex score_mod, timed side by side (H200, bf16, causal 8K).

PYTHONPATH=. python3 benchmarks/log_sigmoid_probe.py   # -> results/log_sigmoid_probe_h200.txt
"""

import math

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

B, H, L, D = 2, 16, 8192, 128
bias = -math.log(L)


def plain(s, b, h, q, k):
    return s


def log1p_form(s, b, h, q, k):
    x = s + bias
    return torch.minimum(x, torch.zeros_like(x)) - torch.log1p(torch.exp(-torch.abs(x)))


def log_form(s, b, h, q, k):
    x = s + bias
    return torch.minimum(x, torch.zeros_like(x)) - torch.log(1.0 + torch.exp(-torch.abs(x)))


def softplus_form(s, b, h, q, k):
    return -torch.nn.functional.softplus(-(s + bias))


def logsigmoid_form(s, b, h, q, k):
    return torch.nn.functional.logsigmoid(s + bias)


def causal(b, h, q, k):
    return q >= k


bm = create_block_mask(causal, None, None, L, L, device="cuda")
flex = torch.compile(flex_attention)
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
ref = None
for name, mod in [
    ("plain", plain),
    ("log1p", log1p_form),
    ("log", log_form),
    ("softplus", softplus_form),
    ("logsigmoid", logsigmoid_form),
]:
    try:
        for _ in range(3):
            out = flex(q, k, v, score_mod=mod, block_mask=bm)
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
            a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            flex(q, k, v, score_mod=mod, block_mask=bm)
            e.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(e))
        if name == "log1p":
            ref = out.float()
        err = float((out.float() - ref).abs().max()) if ref is not None else float("nan")
        print(
            f"{name:12s} fwd median {sorted(times)[10]:.3f} ms  max|out - log1p form| {err:.2e}", flush=True
        )
    except Exception as exc:  # noqa: BLE001
        print(f"{name:12s} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
