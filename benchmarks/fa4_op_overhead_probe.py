"""Host time the ``fa4`` route's op layer adds per call, with the kernels replaced by stubs.

FA4's kernels are replaced by functions that return preallocated tensors, so what is timed is
only the layer between ``fa4_attention`` and the kernels: the ``flexattn_zoo::fa4_fwd`` /
``fa4_bwd`` custom ops (dispatcher, autograd registration) against the eager path plain calls
take (an ``autograd.Function`` around the same implementations). Forward without grad, and
forward + backward. Then the ``fa4`` route's own layer above it, forward without grad on the
route's ``[B, H, L, D]`` views with ``mask=Causal()``: its ``run`` (what a call planned in full
runs) and its bound call (what a plan-cache hit runs: ``Backend.bind``). Median of interleaved
rounds, us per call.

    PYTHONPATH=. python benchmarks/fa4_op_overhead_probe.py [--rounds 20 --chunk 200]
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--chunk", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(1)
    q = torch.randn(1, 64, 4, 16, requires_grad=True)  # FA4's [B, L, H, D]
    out, lse = torch.zeros(1, 64, 4, 16), torch.zeros(1, 4, 64)
    grads = tuple(torch.zeros_like(q) for _ in range(3))
    fa4_op._fwd_kernel = lambda *a: (out, lse)  # the stubs: no kernel, no copy
    fa4_op._bwd_kernel = lambda *a: grads
    real = fa4_op._plain_eager

    def forward(eager: bool) -> Callable[[], Any]:
        def call() -> Any:
            fa4_op._plain_eager = real if eager else (lambda *t: False)
            with torch.no_grad():
                return fa4_op.fa4_attention(q, q, q, scale=0.25, window=(-1, 0))

        return call

    def training(eager: bool) -> Callable[[], Any]:
        def call() -> Any:
            fa4_op._plain_eager = real if eager else (lambda *t: False)
            o, _ = fa4_op.fa4_attention(q, q, q, scale=0.25, window=(-1, 0))
            return torch.autograd.grad(o, q, o)

        return call

    qh = q.detach().transpose(1, 2)  # the route's [B, H, L, D] view
    problem, _ = dispatch._problem(qh, qh, qh, masks.Causal(), None, False, False, None, None)
    bound = FA4.bind(problem, torch.device("cpu"))

    def route(call: Callable[[], Any]) -> Callable[[], Any]:
        def timed() -> Any:
            fa4_op._plain_eager = real
            return call()

        return timed

    calls = {
        "forward, op": forward(False),
        "forward, eager path": forward(True),
        "forward + backward, op": training(False),
        "forward + backward, eager path": training(True),
        "forward, fa4 route: run": route(lambda: FA4.run(qh, qh, qh, problem, scale=0.25)),
        "forward, fa4 route: bound call": route(lambda: bound(qh, qh, qh, 0.25)),
    }
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        for _ in range(100):
            call()
    for _ in range(args.rounds):
        for name, call in calls.items():
            t0 = time.perf_counter()
            for _ in range(args.chunk):
                call()
            samples[name].append((time.perf_counter() - t0) / args.chunk * 1e6)
    print(
        f"# fa4 op layer, stub kernels, torch {torch.__version__}, CPU, {args.rounds} rounds x {args.chunk} calls"
    )
    for name, values in samples.items():
        print(f"{name:34} {statistics.median(values):8.1f} us")


if __name__ == "__main__":
    main()
