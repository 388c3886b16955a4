"""Eager host cost and Dynamo graph breaks of ``fz.attention`` on the CPU, for comparing two trees.

Host cost: median wall time of one call of a tiny problem (B=1 H=8 L=128 D=64 float32) after
warm-up, so the kernel is small next to the library's own Python (plan-cache lookup, validation,
spec handling); plain ``F.scaled_dot_product_attention`` on the same inputs is timed beside it.
Graph breaks: ``torch._dynamo.explain`` of ``Linear -> fz.attention -> Linear`` (the library's call
is not yet traceable as one graph; this counts how far from it a tree is).

    PYTHONPATH=. python benchmarks/cpu_call_path_probe.py            # this checkout
    PYTHONPATH=/path/to/other/tree python benchmarks/cpu_call_path_probe.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods

ITERS = 2000


def host_us(call) -> float:  # type: ignore[no-untyped-def]
    for _ in range(50):
        call()
    samples = []
    for _ in range(ITERS):
        t0 = time.perf_counter()
        call()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def main() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 128, 64) for _ in range(3))
    doc = masks.Document(doc_ids=torch.arange(128) // 32)
    cases = {
        "sdpa (F.scaled_dot_product_attention, is_causal)": lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True
        ),
        "fz causal (spec)": lambda: fz.attention(q, k, v, mask=masks.Causal()),
        'fz causal (mask="causal")': lambda: fz.attention(q, k, v, mask="causal"),
        "fz causal + softcap": lambda: fz.attention(
            q, k, v, mask=masks.Causal(), score_mod=score_mods.SoftCap(cap=30.0)
        ),
        "fz document & causal": lambda: fz.attention(q, k, v, mask=doc & masks.Causal()),
    }
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}; B=1 H=8 L=128 D=64 float32, median of {ITERS}"
    )
    base = host_us(cases.pop("sdpa (F.scaled_dot_product_attention, is_causal)"))
    print(f"  {'F.scaled_dot_product_attention(is_causal=True)':<40} {base:8.1f} us")
    for name, call in cases.items():
        t = host_us(call)
        print(f"  {name:<40} {t:8.1f} us  {t / base:5.2f}x sdpa")
    w = torch.randn(64, 64)
    for name, mask in (("causal", masks.Causal()), ("document & causal", doc & masks.Causal())):
        torch._dynamo.reset()

        def block(x: torch.Tensor, m: object = mask) -> torch.Tensor:
            h = x @ w
            return fz.attention(h, h, h, mask=m) @ w

        explained = torch._dynamo.explain(block)(q)
        print(
            f"  dynamo.explain Linear->fz.attention->Linear, {name:<18} graphs={explained.graph_count} breaks={explained.graph_break_count}"
        )


if __name__ == "__main__":
    main()
