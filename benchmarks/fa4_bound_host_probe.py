"""Host time of the ``fa4`` route's own layers, on the CPU, with FA4's kernel replaced by a stand-in
that only allocates its outputs (so what is left is this library's Python and torch's view ops).

Layers, each timed alone and interleaved round by round: the stand-in kernel, ``fa4_fwd_eager``
(the op's implementation: lock, contiguous out, float lse), ``fa4_attention`` (the eager path's
entry), and the route's bound call (what a plan-cache hit runs), for ``mask=Causal()`` at
B=1 H=8 L=512 D=64 bf16. The route itself needs CUDA and flash-attn-4; this isolates its host
code where neither exists.

    PYTHONPATH=. python benchmarks/fa4_bound_host_probe.py [--rounds 20 --chunk 300]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from flexattn_zoo import dispatch, masks
from flexattn_zoo.backends import fa4_op
from flexattn_zoo.backends.fa4 import FA4


def stand_in(q: torch.Tensor, k: Any, v: Any, cu: Any, max_seqlen: Any, scale: Any, *rest: Any) -> Any:
    """FA4's forward as far as the host sees it: a contiguous ``out`` and a float32 lse."""
    return torch.empty(q.shape, dtype=q.dtype), torch.empty(q.shape[0], q.shape[2], q.shape[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--chunk", type=int, default=300)
    args = p.parse_args()
    torch.set_num_threads(1)
    fa4_op._fwd_kernel = stand_in
    q = torch.randn(1, 8, 512, 64, dtype=torch.bfloat16)
    k, v = q.clone(), q.clone()
    problem, _ = dispatch._problem(q, k, v, masks.Causal(), None, False, False, None, None)
    bound = FA4.bind(problem, torch.device("cpu"))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    layers: dict[str, Callable[[], Any]] = {
        "stand-in kernel": lambda: stand_in(qt, kt, vt, None, 0, 0.125),
        "fa4_op.fa4_fwd_eager": lambda: fa4_op.fa4_fwd_eager(qt, kt, vt, None, 0, 0.125, 0.0, -1, 0),
        "fa4_op.fa4_attention": lambda: fa4_op.fa4_attention(qt, kt, vt, scale=0.125, window=(-1, 0)),
        "fa4 route: bound call (plan-cache hit's run)": lambda: bound(q, k, v, 0.125),
    }
    samples: dict[str, list[float]] = {name: [] for name in layers}
    for _ in range(args.rounds):
        for name, call in layers.items():
            t0 = time.perf_counter()
            for _ in range(args.chunk):
                call()
            samples[name].append((time.perf_counter() - t0) / args.chunk * 1e6)
    print(
        f"# host us per call, torch {torch.__version__}, CPU, one thread, {args.rounds} rounds x {args.chunk} calls"
    )
    for name, values in samples.items():
        print(f"{name:48s} {statistics.median(values):8.2f}")


if __name__ == "__main__":
    main()
