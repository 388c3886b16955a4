"""The eager host time of ``fz.attention`` on a plan-cache hit, layer by layer.

Each layer of the call is timed on its own, interleaved round by round with the others (so a
noisy host moves them alike), on a tiny problem whose kernel is short next to the host:

* flex route (``SlidingWindow & Causal``): ``torch.compile(flex_attention)`` on the route's own
  BlockMask and kernel options (what a user would write by hand), the library's compiled entry
  called directly (``CompiledFlex._fn``), through ``CompiledFlex.__call__``, ``FlexCall.launch``,
  the plan cache's bound call, and ``fz.attention``;
* SDPA route (``mask="causal"``): ``F.scaled_dot_product_attention`` with the kernel the route
  pins, the bound call, ``fz.attention``, and ``fz.attention`` with a spec built anew per call
  (``SlidingWindow(left=L - 1)``, SDPA's causal form);
* the dispatcher alone: ``fz.attention`` whose cached bound call is replaced by a no-op (for
  ``Causal`` and, on an entry of its own, the flex route's mask kind), and the call key with its
  lookup;
* a decode step (one query against a cache, a new length each call): SDPA on the live prefix,
  ``fz.decode.decode_step`` and ``fz.attention`` on the prefix slices;
* what a decode step could launch instead (``decode-kernels``, CUDA): the two prefix slices alone,
  SDPA under the kernel pin ``decode_step`` sets, and torch's FlashAttention-2 and
  memory-efficient SDPA ops called directly on the slices.

Prints the median and the 10th percentile of per-call wall time (us) per layer, and each layer's
increment over the one below it.

    PYTHONPATH=. python benchmarks/host_layers_probe.py --device cuda [--rounds 30 --chunk 50]
    PYTHONPATH=. python benchmarks/host_layers_probe.py --device cpu --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import flexattn_zoo as fz
from flexattn_zoo import _compat, masks, plan_cache
from flexattn_zoo.backends import BY_NAME
from flexattn_zoo.compile import CACHE
from flexattn_zoo.models.decode import _PREFIX_KERNELS as PREFIX_KERNELS


def plan_cache_entry(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> tuple[Any, Any]:
    """``(key, bound plan)`` of ``fz.attention(q, k, v, mask=mask)`` in the plan cache (after one call)."""
    fz.attention(q, k, v, mask=mask)
    det = _compat.strict_deterministic_mode()
    key = plan_cache.call_key(q, k, v, mask, None, False, False, det, "auto")
    hit = plan_cache.lookup(key, q, k, v)
    assert hit is not None, "no plan-cache hit: the probe's key differs from the dispatcher's"
    return key, hit


def _hit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> Any:
    return plan_cache_entry(q, k, v, mask)[1]


def sliding_problem(device: torch.device, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[Any, ...]:
    """``q, k, v`` (seeded) and the flex route's mask the probes time: a window of L/4, causal."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(3))
    return q, k, v, masks.SlidingWindow(left=shape[2] // 4, right=0) & masks.Causal()


def probe_args(
    description: str, rounds: int
) -> tuple[argparse.Namespace, torch.device, torch.dtype, tuple[int, ...]]:
    """The host probes' command line (device, shape, threads, rounds, chunk), applied: ``(args,
    device, dtype, shape)``; bf16 on CUDA, float32 on the CPU."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", default="1x8x512x64", help="BxHxLxD")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--chunk", type=int, default=50)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return args, device, dtype, tuple(int(x) for x in args.shape.split("x"))


def layers(device: torch.device, dtype: torch.dtype, shape: tuple[int, ...]) -> dict[str, Callable[[], Any]]:
    q, k, v, sliding = sliding_problem(device, dtype, shape)
    gen = torch.Generator(device="cpu").manual_seed(1)

    hit = _hit(q, k, v, sliding)
    scale = hit.scale
    prepared = BY_NAME[hit.plan.backend].prepared(hit.plan.problem, device)
    entry = CACHE.get_keyed(prepared.key, prepared.options, prepared.lse, prepared.gqa)
    bm, sm, opts = prepared.block_mask, prepared.score_mod, prepared.options
    raw = torch.compile(_compat.flex_attention)

    sdpa_hit = _hit(q, k, v, "causal")
    kernels = BY_NAME[sdpa_hit.plan.backend].launch_kernels(sdpa_hit.plan.problem)
    pinned = [getattr(_compat.SDPBackend, name) for name in kernels] if kernels else None

    def plain_sdpa() -> Any:
        if pinned is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with torch.nn.attention.sdpa_kernel(pinned):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    noop_key = plan_cache.call_key(
        q, k, v, masks.Causal(), None, False, False, _compat.strict_deterministic_mode(), "auto"
    )
    fz.attention(q, k, v, mask=masks.Causal())
    noop = plan_cache.lookup(noop_key, q, k, v)
    noop.run = lambda q_, k_, v_, s_: (q_, None)  # the dispatcher alone: its hit runs nothing
    causal_spec = masks.Causal()
    # The same for the flex route's mask kind (``SlidingWindow & Causal``) with a window one key
    # wider: its own plan-cache entry and compiled entry at the same shapes, so the flex layers
    # above keep their real run and their static-shape graph (a second shape for the same entry
    # would switch it to Dynamo's dynamic-shape graph, which costs more host time per call).
    det = _compat.strict_deterministic_mode()
    wider = masks.SlidingWindow(left=shape[2] // 4 + 1, right=0) & masks.Causal()
    fz.attention(q, k, v, mask=wider)
    sliding_noop = plan_cache.lookup(
        plan_cache.call_key(q, k, v, wider, None, False, False, det, "auto"), q, k, v
    )
    sliding_noop.run = lambda q_, k_, v_, s_: (q_, None)

    def sliding_key_lookup() -> Any:
        return plan_cache.lookup(
            plan_cache.call_key(q, k, v, sliding, None, False, False, det, "auto"), q, k, v
        )

    capacity = 4 * shape[2]
    k_cache, v_cache = (
        torch.randn(shape[0], shape[1], capacity, shape[3], generator=gen).to(device, dtype) for _ in range(2)
    )
    q1 = q[:, :, :1].contiguous()
    step = [0]

    def next_len() -> int:  # a new length each step, cycling over 64 (plan-cache hits)
        step[0] += 1
        return 2 * shape[2] + step[0] % 64

    def decode_sdpa() -> Any:
        n = next_len()
        return F.scaled_dot_product_attention(q1, k_cache[:, :, :n], v_cache[:, :, :n])

    def decode_fz() -> Any:
        n = next_len()
        return fz.attention(q1, k_cache[:, :, :n], v_cache[:, :, :n])

    aten = torch.ops.aten

    def decode_pinned() -> Any:
        n = next_len()
        token = _compat.pin_sdpa_kernel(PREFIX_KERNELS)
        try:
            return F.scaled_dot_product_attention(q1, k_cache[:, :, :n], v_cache[:, :, :n])
        finally:
            _compat.restore_sdpa_kernels(token)

    def decode_slices() -> Any:
        n = next_len()
        return k_cache[:, :, :n], v_cache[:, :, :n]

    def decode_flash_op() -> Any:
        n = next_len()
        return aten._scaled_dot_product_flash_attention.default(q1, k_cache[:, :, :n], v_cache[:, :, :n])

    def decode_efficient_op() -> Any:
        n = next_len()
        return aten._scaled_dot_product_efficient_attention.default(
            q1, k_cache[:, :, :n], v_cache[:, :, :n], None, False
        )

    decode_kernels: dict[str, Callable[[], Any]] = {}
    if device.type == "cuda":
        decode_kernels = {
            "decode-kernels: the two prefix slices alone": decode_slices,
            "decode-kernels: F.scaled_dot_product_attention under decode_step's pin": decode_pinned,
            "decode-kernels: aten._scaled_dot_product_flash_attention on the slices": decode_flash_op,
            "decode-kernels: aten._scaled_dot_product_efficient_attention on the slices": decode_efficient_op,
        }

    return {
        f"flex: torch.compile(flex_attention) [{hit.plan.backend}'s BlockMask, options]": lambda: raw(
            q, k, v, block_mask=bm, scale=scale, kernel_options=opts
        ),
        "flex: the same without kernel options": lambda: raw(q, k, v, block_mask=bm, scale=scale),
        "flex: compiled entry (CompiledFlex._fn)": lambda: entry._fn(q, k, v, bm, scale, sm),
        "flex: CompiledFlex.__call__": lambda: entry(q, k, v, bm, scale, sm),
        "flex: FlexCall.launch": lambda: prepared.launch(q, k, v, scale),
        "flex: bound call (plan-cache hit's run)": lambda: hit.run(q, k, v, scale),
        "flex: fz.attention": lambda: fz.attention(q, k, v, mask=sliding),
        "sdpa: F.scaled_dot_product_attention(is_causal=True), SDPA's own kernel choice": lambda: (
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ),
        f"sdpa: the same under sdpa_kernel({sdpa_hit.plan.backend}'s kernel)": plain_sdpa,
        "sdpa: bound call (plan-cache hit's run)": lambda: sdpa_hit.run(q, k, v, sdpa_hit.scale),
        'sdpa: fz.attention(mask="causal")': lambda: fz.attention(q, k, v, mask="causal"),
        # A causal window over the whole length: SDPA's is_causal form, built anew per call.
        "sdpa: fz.attention(mask=SlidingWindow(left=L - 1)), a new spec per call": lambda: fz.attention(
            q, k, v, mask=masks.SlidingWindow(left=shape[2] - 1)
        ),
        "dispatcher: fz.attention, no-op route": lambda: fz.attention(q, k, v, mask=causal_spec),
        "dispatcher: call_key + lookup, SlidingWindow & Causal": sliding_key_lookup,
        "dispatcher: fz.attention(SlidingWindow & Causal), no-op route": lambda: fz.attention(
            q, k, v, mask=wider
        ),
        "decode: F.scaled_dot_product_attention(q1, cache[:, :, :n])": decode_sdpa,
        "decode: fz.decode.decode_step(q1, cache, cache, n)": lambda: fz.decode.decode_step(
            q1, k_cache, v_cache, next_len()
        ),
        "decode: fz.attention(q1, cache[:, :, :n])": decode_fz,
        **decode_kernels,
    }


def measure(
    calls: dict[str, Callable[[], Any]], device: torch.device, rounds: int, chunk: int
) -> dict[str, list[float]]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for call in calls.values():
        for _ in range(50):
            call()
    sync()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    clock = time.perf_counter
    for _ in range(rounds):
        for name, call in calls.items():
            out = samples[name]
            for _ in range(chunk):
                t0 = clock()
                call()
                out.append((clock() - t0) * 1e6)
            sync()
    return samples


def header(title: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> str:
    """The first line of a host probe's report: what was measured, on which torch and device."""
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    return (
        f"# {title}, torch {torch.__version__}, {name}, {args.shape} {dtype}, "
        f"{args.rounds} rounds x {args.chunk} calls"
    )


def median_p10(values: list[float]) -> tuple[float, float]:
    """Median and 10th percentile of a probe's samples (us)."""
    return statistics.median(values), statistics.quantiles(values, n=10)[0]


def print_layers(samples: dict[str, list[float]], width: int = 72) -> None:
    """Median and p10 per layer, and each layer's increment over the one before it in its group
    (the text before a layer name's ``:``)."""
    print(f"{'layer':<{width}} {'median':>8} {'p10':>8} {'+median':>8}")
    previous: dict[str, float] = {}
    for layer, values in samples.items():
        group = layer.split(":")[0]
        med, p10 = median_p10(values)
        step = f"{med - previous[group]:+8.1f}" if group in previous else ""
        previous[group] = med
        print(f"{layer:<{width}} {med:8.1f} {p10:8.1f} {step:>8}")


def main() -> None:
    args, device, dtype, shape = probe_args(__doc__.split("\n\n")[0], rounds=30)
    calls = layers(device, dtype, shape)
    samples = measure(calls, device, args.rounds, args.chunk)
    print(header("host time per call", args, device, dtype) + ", interleaved")
    print_layers(samples)


if __name__ == "__main__":
    main()
