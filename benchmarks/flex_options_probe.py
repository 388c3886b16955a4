"""The flex route's forward kernel options against torch's defaults, per zoo problem (H200, bf16).

For each case the route's own BlockMask, score_mod and lse flag are used (``FLEX.prepared``), and
the compiled ``flex_attention`` is called with (a) the options the route passes
(``FLEX.options``: the pinned sm90 forward tiles, or 2 stages for pair-loading mods at D <= 64)
and (b) none (torch's defaults). Forward only: the options are ``fwd_*`` ones, the backward
kernel is the same either way. Per variant the best of ROUNDS (default 3) interleaved rounds, each the median of 30 timed
calls after 5 warm-up calls (CUDA events).

    PYTHONPATH=. python3 benchmarks/flex_options_probe.py   # -> results/flex_options_probe_h200.txt
    CASES=natten_2d,relu_vit ROUNDS=5 PYTHONPATH=. python3 benchmarks/flex_options_probe.py
"""

from __future__ import annotations

import functools
import os
import statistics
import time

import torch
from torch.nn.attention.flex_attention import flex_attention

import flexattn_zoo as fz
from flexattn_zoo import _compat, masks
from flexattn_zoo.backends.flex import FLEX
from flexattn_zoo.registry import MASKS, SCORES


def example(kind: str, name: str, length: int, batch: int, heads: int):  # type: ignore[no-untyped-def]
    registry = MASKS if kind == "mask" else SCORES
    return registry.find(name).factory.typical_example(length, length, batch, heads)  # type: ignore[union-attr]


CASES = [  # name, B, H, L, D, mask, score
    ("natten_2d", 2, 16, 4096, 128, ("mask", "natten"), None),
    ("sliding_tile", 2, 16, 6400, 128, ("mask", "sliding_tile"), None),
    ("tree", 8, 16, 2048, 128, ("mask", "tree"), None),
    ("sigmoid_causal", 2, 16, 8192, 128, "causal", ("score", "sigmoid")),
    ("softcap_causal", 2, 16, 8192, 128, "causal", ("score", "softcap")),
    ("relu_vit", 16, 16, 1024, 64, None, ("score", "relu")),
    ("graphormer", 16, 16, 1024, 64, None, ("score", "graphormer")),
    ("rel_pos_bias_d128", 2, 16, 4096, 128, None, ("score", "rel_pos_bias")),
    ("causal", 2, 16, 8192, 128, "causal", None),
    ("document_causal", 2, 16, 8192, 128, ("mask", "document"), None),
    ("sliding_1024", 2, 16, 8192, 128, "window", None),
    ("full_d64", 16, 16, 1024, 64, None, None),
]


def spec_of(entry, b, h, length):  # type: ignore[no-untyped-def]
    if entry is None:
        return None
    if entry == "causal":
        return masks.Causal()
    if entry == "window":
        return masks.SlidingWindow.from_hf(1024) & masks.Causal()
    kind, name = entry
    spec = example(kind, name, length, b, h)
    if kind == "mask" and name == "document":
        spec = spec & masks.Causal()
    return spec


def time_call(fn) -> float:  # type: ignore[no-untyped-def]
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(30):
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(e))
    return statistics.median(times)


#: Timed rounds per variant, interleaved (route, default, route, ...).
ROUNDS = int(os.environ.get("ROUNDS", "3"))
#: Comma-separated case names to run (default: all).
ONLY = [c for c in os.environ.get("CASES", "").split(",") if c]


def main() -> None:
    # Every (case, variant) is a new guard on the one compiled flex_attention: room for all of
    # them, so none runs unfused past Dynamo's recompile limit.
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 1024
    flex = torch.compile(flex_attention, dynamic=False)  # one static kernel per shape, as the route
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    print("# case | route options | route ms | default ms | default / route | compile s (route, default)")
    for name, b, h, length, d, mask_entry, score_entry in CASES:
        if ONLY and name not in ONLY:
            continue
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (
            torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)
        )
        mask = spec_of(mask_entry, b, h, length)
        score = spec_of(score_entry, b, h, length)
        score = score.to("cuda") if score is not None else None
        mask = mask.to("cuda") if mask is not None else None
        try:
            problem = fz.plan(q, k, v, mask=mask, score_mod=score, backend="flex").problem
            call = FLEX.prepared(problem, q.device)
            route_opts = FLEX.options(problem, call.block_mask)
            aux = _compat.flex_aux_request(call.lse)
            results: dict[str, tuple[float, str]] = {}
            fns = {}
            for variant, opts in (("route", route_opts), ("default", None)):
                fns[variant] = functools.partial(
                    flex, q, k, v, score_mod=call.score_mod, block_mask=call.block_mask,
                    kernel_options=opts, **aux,
                )  # fmt: skip
                start = time.perf_counter()
                try:
                    fns[variant]()
                    torch.cuda.synchronize()
                    results[variant] = (float("inf"), f"{time.perf_counter() - start:.1f}")
                except Exception as exc:  # noqa: BLE001
                    results[variant] = (float("nan"), f"{type(exc).__name__}: {str(exc)[:120]}")
                    fns.pop(variant)
            # Interleaved rounds, the best round's median per variant: drift between the two
            # variants' measurements (clocks, other work) would otherwise read as a difference.
            for _ in range(ROUNDS):
                for variant, fn in fns.items():
                    best, compile_s = results[variant]
                    results[variant] = (min(best, time_call(fn)), compile_s)
            (rm, rc), (dm, dc) = results["route"], results["default"]
            print(f"{name} | {route_opts} | {rm:.3f} | {dm:.3f} | {dm / rm:.2f} | {rc}, {dc}", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"{name} | failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)


if __name__ == "__main__":
    main()
