"""The eager host time of the ``fa4`` route on a plan-cache hit, layer by layer, next to
FlashAttention-4's own ``flash_attn_func`` (forward, no grad, causal), interleaved round by round
(``host_layers_probe.measure``): FA4's function as a user calls it, with the lse asked for, the
route's op implementation (``fa4_fwd_eager``: FA4 under its lock, ``out`` made contiguous, the lse
as float32), ``fa4_attention``, the plan cache's bound call and ``fz.attention(backend="fa4")``.
Prints the median and 10th percentile of per-call wall time (us, no device sync inside a call).

    PYTHONPATH=. python benchmarks/fa4_host_probe.py [--shape 1x8x512x64] [--rounds 30]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from host_layers_probe import header, measure, print_layers, probe_args

import flexattn_zoo as fz
from flexattn_zoo import _compat, plan_cache
from flexattn_zoo.backends import fa4_op


def main() -> None:
    args, device, dtype, shape = probe_args(__doc__.split("\n\n")[0], rounds=30)
    from flash_attn.cute import flash_attn_func

    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # FA4's [B, L, H, D], as the route passes them
    scale = shape[3] ** -0.5
    fz.attention(q, k, v, mask="causal", backend="fa4")
    det = _compat.strict_deterministic_mode()
    hit = plan_cache.lookup(plan_cache.call_key(q, k, v, "causal", None, False, False, det, "fa4"), q, k, v)
    assert hit is not None, "no plan-cache hit: the probe's key differs from the dispatcher's"

    calls: dict[str, Any] = {
        "sdpa: F.scaled_dot_product_attention(is_causal=True)": lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True
        ),
        "fa4: flash_attn_func(causal=True)": lambda: flash_attn_func(qt, kt, vt, causal=True),
        "fa4: flash_attn_func(causal=True, return_lse=True)": lambda: flash_attn_func(
            qt, kt, vt, causal=True, return_lse=True
        ),
        "fa4: fa4_op.fa4_fwd_eager (lock, contiguous out, float lse)": lambda: fa4_op.fa4_fwd_eager(
            qt, kt, vt, None, 0, scale, 0.0, -1, 0
        ),
        "fa4: fa4_op.fa4_attention": lambda: fa4_op.fa4_attention(qt, kt, vt, scale=scale, window=(-1, 0)),
        "fa4: bound call (plan-cache hit's run)": lambda: hit.run(q, k, v, hit.scale),
        'fa4: fz.attention(mask="causal", backend="fa4")': lambda: fz.attention(
            q, k, v, mask="causal", backend="fa4"
        ),
    }
    with torch.no_grad():
        samples = measure(calls, device, args.rounds, args.chunk)
    print(header("fa4 route host time per call", args, device, dtype) + ", interleaved")
    print_layers(samples, width=64)


if __name__ == "__main__":
    main()
