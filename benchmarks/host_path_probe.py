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

With ``--decode-flex``, the pieces of a repeated ``fz.decode.decode_step`` on the flex route
(``flex_cpu`` on the CPU; one query over 1024 of 2048 cached keys, the length cycling over 64
values as in host_cost.py's ``decode-flex`` group):

* ``flex floor``: ``torch.compile(flex_attention)`` on the step's DecodeMask BlockMask (what
  host_cost.py compares against), and ``floor + fill`` with the one length write a hand-written
  step needs;
* ``decode_step``: as a user calls it; ``step key`` its plan's key (``hits.step_key``),
  ``step plan`` the kept plan called alone (length check, mask update, kernel);
* ``run``: the plan's launch alone (the compiled graph with the step's BlockMask), ``update``:
  ``DecodeMask.update`` alone.

    PYTHONPATH=. python benchmarks/host_path_probe.py --device cuda
    PYTHONPATH=. python benchmarks/host_path_probe.py --device cuda --decode-flex
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

import flexattn_zoo as fz
from flexattn_zoo import masks, plan_cache
from flexattn_zoo.backends import BY_NAME
from flexattn_zoo.models import decode
from flexattn_zoo.models.decode import hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--number", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--decode-flex", action="store_true", help="the pieces of a flex decode step instead")
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
    if args.decode_flex:
        pieces = _decode_flex_pieces(q1, k_cache, v_cache, device)
        _report(args, device, pieces, [("decode_step", "flex floor"), ("run", "flex floor")])
        return
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

    _report(
        args,
        device,
        pieces,
        [("fz causal", "sdpa"), ("fz Causal()", "sdpa"), ("fz prefix", "sdpa prefix")],
    )


def _decode_flex_pieces(
    q1: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, device: torch.device
) -> dict[str, Callable[[], Any]]:
    route = "flex" if device.type == "cuda" else "flex_cpu"
    lengths = iter([])

    def length() -> int:
        nonlocal lengths
        n = next(lengths, None)
        if n is None:
            lengths = iter(range(1024, 1088))
            n = next(lengths)
        return n

    def step() -> Any:
        return decode.decode_step(q1, k_cache, v_cache, length(), backend=route)

    with torch.no_grad():  # (every piece runs under no_grad: see _report)
        for _ in range(130):  # planned, then kept
            step()
        key, _, _, _ = hits.step_key(q1, k_cache, v_cache, None, None, None, None, None, False, route, None)
    plan = decode.STEPS.get(key)
    assert plan is not None, "the steps above kept no plan"
    dm, bm = plan.dm, plan.dm.block_mask
    chosen = fz.plan(q1, k_cache, v_cache, mask=bm, backend=route)
    options = BY_NAME[chosen.backend].options(chosen.problem, bm)
    compiled = torch.compile(flex_attention, dynamic=False)
    for _ in range(3):
        compiled(q1, k_cache, v_cache, block_mask=bm, kernel_options=options)

    memo = plan.run.ran[0]  # (entry, code, graph, ...) of the plan's last launch (FlexCall.launch)
    print(
        f"decode plan: route {plan.run.backend}, launches its graph unguarded: {memo is not None and memo[2] is not None}"
    )

    def floor_fill() -> Any:
        dm.cache_len.fill_(length())
        return compiled(q1, k_cache, v_cache, block_mask=bm, kernel_options=options)

    return {
        "flex floor": lambda: compiled(q1, k_cache, v_cache, block_mask=bm, kernel_options=options),
        "floor + fill": floor_fill,
        "decode_step": step,
        "step key": lambda: hits.step_key(
            q1, k_cache, v_cache, None, None, None, None, None, False, route, None
        ),
        "step plan": lambda: plan(q1, k_cache, v_cache, length(), None, False),
        "run": lambda: plan.run(q1, k_cache, v_cache, bm),
        "update": lambda: dm.update(length()),
    }


def _report(
    args: argparse.Namespace,
    device: torch.device,
    pieces: dict[str, Callable[[], Any]],
    differences: list[tuple[str, str]],
) -> None:
    def drained(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with torch.no_grad():
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
    if differences:
        print("; ".join(f"{a} - {b} {best[a] - best[b]:+.2f}" for a, b in differences))


if __name__ == "__main__":
    main()
