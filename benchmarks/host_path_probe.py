"""The pieces of ``fz.attention``'s plan-cache hit, each timed alone on one device, so host costs
that differ between machines (a CPU host against a GPU host's) can be told apart piece by piece.

Each piece is a small function called back to back; reported: the best of ``--repeat`` runs of
``--number`` calls, in us per call (the best run is the piece's cost with the host's caches warm;
what host_cost.py reports is a median in rounds). On CUDA nothing synchronizes except between
runs, so the queue never fills.

Pieces (``B=1 H=8 L=512 D=64``; on the CPU float32, on CUDA bfloat16; a causal call whose route
is bound and cached, and a one-query call over a cache prefix):

* ``sdpa``, ``sdpa prefix``: plain ``F.scaled_dot_product_attention`` (the baselines);
* ``fz causal``, ``fz Causal()``, ``fz prefix``: ``fz.attention`` as a user calls it;
* ``Causal()``: building the spec alone;
* ``call_key``, ``process_state``, ``lookup``: the plan-cache key, its process part, the lookup;
* ``bound causal``, ``bound prefix``: the cached bound call (``hit.run``) alone;
* ``tensor reads``: the tensor attributes the key reads (shape, stride, dtype, device,
  requires_grad of q, k, v), as plain Python.

    PYTHONPATH=. python benchmarks/host_path_probe.py --device cuda
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import flexattn_zoo as fz
from flexattn_zoo import masks, plan_cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--number", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b, h, length, d = 1, 8, 512, 64
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, length, d, generator=gen).to(device, dtype) for _ in range(3))
    k_cache, v_cache = (torch.randn(b, h, 4 * length, d, generator=gen).to(device, dtype) for _ in range(2))
    q1 = torch.randn(b, h, 1, d, generator=gen).to(device, dtype)
    n = 2 * length
    k1, v1 = k_cache[:, :, :n], v_cache[:, :, :n]
    for _ in range(3):  # planned, bound, then the bound call's repeated-shape kernels
        fz.attention(q, k, v, mask="causal")
        fz.attention(q1, k1, v1)
    key = plan_cache.call_key(q, k, v, "causal", None, False, False, False, "auto")
    key1 = plan_cache.call_key(q1, k1, v1, None, None, False, False, False, "auto")
    hit, hit1 = plan_cache.lookup(key, q, k, v), plan_cache.lookup(key1, q1, k1, v1)
    assert hit is not None and hit1 is not None, "the calls above were not cached"

    def tensor_reads() -> Any:
        return (
            q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, k.device, v.device, q.requires_grad, k.requires_grad, v.requires_grad,
        )  # fmt: skip

    pieces: dict[str, Callable[[], Any]] = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "fz causal": lambda: fz.attention(q, k, v, mask="causal"),
        "fz Causal()": lambda: fz.attention(q, k, v, mask=masks.Causal()),
        "sdpa prefix": lambda: F.scaled_dot_product_attention(q1, k1, v1),
        "fz prefix": lambda: fz.attention(q1, k1, v1),
        "Causal()": masks.Causal,
        "call_key": lambda: plan_cache.call_key(q, k, v, "causal", None, False, False, False, "auto"),
        "process_state": plan_cache.process_state,
        "lookup": lambda: plan_cache.lookup(key, q, k, v),
        "bound causal": lambda: hit.run(q, k, v, hit.scale),
        "bound prefix": lambda: hit1.run(q1, k1, v1, hit1.scale),
        "tensor reads": tensor_reads,
    }

    def drained(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            for _ in range(args.number):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize()

        return run

    best: dict[str, float] = {}
    for name, fn in pieces.items():
        runs = timeit.repeat(drained(fn), number=1, repeat=args.repeat)
        best[name] = min(runs) / args.number * 1e6
    card = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"{torch.__version__}, {card}, {fz.__version__}; best of {args.repeat} x {args.number} calls, us per call"
    )
    for name, us in best.items():
        print(f"{name:14s} {us:8.2f}")
    print(
        f"fz causal - sdpa {best['fz causal'] - best['sdpa']:+.2f}; fz Causal() - sdpa "
        f"{best['fz Causal()'] - best['sdpa']:+.2f}; fz prefix - sdpa prefix "
        f"{best['fz prefix'] - best['sdpa prefix']:+.2f}"
    )


if __name__ == "__main__":
    main()
