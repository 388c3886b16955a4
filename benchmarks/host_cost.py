"""Eager host cost of ``fz.attention`` and ``fz.decode.decode_step`` on a plan-cache hit, side by
side with what a user would write without the library, in one process.

Host time of a call: ``time.perf_counter()`` around the call, with no device synchronization (on
CUDA the call returns once its kernels are queued; the queue is drained between chunks of calls,
outside the timed region, so it never fills). Each case is warmed up (compiles, plan and BlockMask
caches filled), then timed in rounds that visit every case in turn, so slow drift on a shared
machine hits all cases alike. Reported: median, p10 and p90 of the per-call times in us, the
difference to the case's baseline (median - median) and the ratio.

Calls are timed back to back by default, which keeps the host's caches warm for whichever call
repeats (the flatter the call, the more it gains). With ``--in-layer`` the rest of a transformer
layer runs, untimed, before each timed call, as in a model: every case, baselines included, then
starts from the state a model leaves.

Groups, each against its own baseline:

* ``sdpa``: ``F.scaled_dot_product_attention(is_causal=True)`` vs ``fz.attention(mask="causal")``
  and ``mask=masks.Causal()`` (the SDPA routes). Target: baseline + 15 us.
* ``sliding``, ``sliding+softcap``, ``causal+softcap``: ``torch.compile(flex_attention)`` with a
  prebuilt BlockMask (``create_block_mask``, the same mask_mod and score_mod) vs ``fz.attention``
  with the same specs, on the flex route by name (CPU: ``flex_cpu``; CUDA: ``flex``) and on
  ``auto`` (its route is printed). Target for the named flex route: baseline + 15 us.
* ``decode``: one new token per row against a KV cache, with a new length every step (as a
  generation loop passes it): SDPA over the live prefix of the cache vs ``fz.attention`` on the
  same slices (one query, the SDPA routes; target: baseline + 15 us) and
  ``fz.decode.decode_step`` with an int ``cache_len`` (target: 40 us per step; one query per row
  under the default causal pattern: SDPA over the cache's live prefix).
* ``decode-window``: the same steps under a sliding window of ``L / 2`` keys: SDPA over the
  window's slice of the cache vs ``decode_step(mask=SlidingWindow.from_hf(L // 2))`` (target: 40 us
  per step; SDPA over the same slice) and the same step on the flex route by name.
* ``decode-growing``: the same one-query call over a cache whose length is new at every call
  (more lengths than the plan cache holds, as a generation loop meets them): each
  ``fz.attention`` call is planned in full, next to plain SDPA on the same slices.
* ``decode-flex``: ``fz.decode.decode_step`` on the flex route by name (the DecodeMask path every
  other pattern takes), next to its floor: the same compiled flex kernel
  (``torch.compile(flex_attention)`` with the step's kernel options) called on a ``DecodeMask``'s
  BlockMask prebuilt for one length, so without the per-step mask update; ``decode-flex-len``:
  the same step next to that call after one ``fill_`` of the length tensor its mask_mod reads,
  the least per-step write a hand-written loop over a growing cache makes (target: baseline +
  15 us).

The lengths cycle over a window of 64, so every call after the warm-up is a plan-cache hit (a
generation loop's ``fz.attention`` over a growing cache meets a new ``Lkv``, and a plan-cache
miss, every step; ``decode_step`` does not).

On the CPU a call runs its kernel before returning, so the times include the kernel; the tiny
problem (``--shapes`` default adds ``1x2x64x16``) is the one where the kernel is negligible and
the difference is the library's own host time.

    PYTHONPATH=. python benchmarks/host_cost.py --device cpu --threads 1 --out benchmarks/results/host_cost_cpu.md
    PYTHONPATH=. python benchmarks/host_cost.py --device cuda --out benchmarks/results/host_cost_h200.md
    PYTHONPATH=. python benchmarks/host_cost.py --device cuda --in-layer --out benchmarks/results/host_cost_h200_layer.md
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flexattn_zoo as fz  # noqa: E402
from flexattn_zoo import masks, score_mods  # noqa: E402
from flexattn_zoo.backends import BY_NAME  # noqa: E402
from flexattn_zoo.bench.env import collect_env  # noqa: E402

SDPA_SLACK_US = 15.0
FLEX_SLACK_US = 15.0
DECODE_TARGET_US = 40.0
CAP = 30.0


@dataclass
class Case:
    group: str
    name: str
    call: Callable[[], Any]
    baseline: bool = False
    route: str = ""
    #: Target: at most this many us over the group's baseline, or at most this many us in all.
    slack_us: float | None = None
    limit_us: float | None = None
    samples: list[float] = field(default_factory=list)


def _stats(samples: list[float]) -> tuple[float, float, float]:
    deciles = statistics.quantiles(samples, n=10)
    return statistics.median(samples), deciles[0], deciles[-1]


def _parse_shape(text: str) -> tuple[int, int, int, int]:
    b, h, length, d = (int(x) for x in text.lower().split("x"))
    return b, h, length, d


def build_cases(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int, int]) -> list[Case]:
    b, h, length, d = shape
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(3))
    window = max(1, length // 4)  # keys per query, own included
    flex_route = "flex" if device.type == "cuda" else "flex_cpu"

    def sliding_mod(b_, h_, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (kv_idx >= q_idx - (window - 1)) & (kv_idx <= q_idx)

    def causal_mod(b_, h_, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return q_idx >= kv_idx

    def softcap_mod(score, b_, h_, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return CAP * torch.tanh(score / CAP)

    sliding_bm = create_block_mask(sliding_mod, None, None, length, length, device=device)
    causal_bm = create_block_mask(causal_mod, None, None, length, length, device=device)
    sliding = masks.SlidingWindow.from_hf(window)
    softcap = score_mods.SoftCap(cap=CAP)
    cases = [
        Case(
            "sdpa",
            "F.scaled_dot_product_attention(is_causal=True)",
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            baseline=True,
        ),
        Case(
            "sdpa",
            'fz.attention(mask="causal")',
            lambda: fz.attention(q, k, v, mask="causal"),
            route=fz.plan(q, k, v, mask="causal").backend,
            slack_us=SDPA_SLACK_US,
        ),
        Case(
            "sdpa",
            "fz.attention(mask=Causal()), a new spec per call",
            lambda: fz.attention(q, k, v, mask=masks.Causal()),
            route=fz.plan(q, k, v, mask=masks.Causal()).backend,
            slack_us=SDPA_SLACK_US,
        ),
    ]
    flex_groups: list[tuple[str, Any, Any, Any, Any]] = [
        ("sliding", sliding_bm, None, sliding, None),
        ("sliding+softcap", sliding_bm, softcap_mod, sliding, softcap),
        ("causal+softcap", causal_bm, softcap_mod, masks.Causal(), softcap),
    ]
    for group, bm, score_mod, mask_spec, score_spec in flex_groups:
        compiled = torch.compile(flex_attention, dynamic=False)
        cases.append(
            Case(
                group,
                "torch.compile(flex_attention), prebuilt BlockMask",
                lambda c=compiled, bm=bm, sm=score_mod: c(q, k, v, block_mask=bm, score_mod=sm),
                baseline=True,
            )
        )
        for backend in (flex_route, "auto"):
            cases.append(
                Case(
                    group,
                    f'fz.attention(backend="{backend}")',
                    lambda m=mask_spec, s=score_spec, be=backend: fz.attention(
                        q, k, v, mask=m, score_mod=s, backend=be
                    ),
                    route=fz.plan(q, k, v, mask=mask_spec, score_mod=score_spec, backend=backend).backend,
                    slack_us=FLEX_SLACK_US if backend == flex_route else None,
                )
            )
    # Decode: one new token per row against a cache of 4x the length, lengths cycling over a window
    # of 64 so each step sees a new length (as generation does).
    capacity = 4 * length
    k_cache, v_cache = (torch.randn(b, h, capacity, d, generator=gen).to(device, dtype) for _ in range(2))
    q1 = torch.randn(b, h, 1, d, generator=gen).to(device, dtype)
    step = [0]

    def next_len() -> int:
        step[0] += 1
        return 2 * length + step[0] % 64

    def decode_step() -> Any:
        return fz.decode.decode_step(q1, k_cache, v_cache, next_len())

    def decode_step_flex() -> Any:
        return fz.decode.decode_step(q1, k_cache, v_cache, next_len(), backend=flex_route)

    def fz_attention_on_slices() -> Any:
        n = next_len()
        return fz.attention(q1, k_cache[:, :, :n], v_cache[:, :, :n])

    # A generation loop as it is: a new length every step, never seen before (more lengths than
    # the plan cache holds), so every fz.attention call plans anew.
    span, live_base = 4096, 2 * length
    k_grow, v_grow = (
        torch.randn(b, h, live_base + span, d, generator=gen).to(device, dtype) for _ in range(2)
    )
    grow = [0]

    def grown_len() -> int:
        grow[0] += 1
        return live_base + grow[0] % span + 1

    live = 2 * length
    # A sliding-window layer's step (Mistral, Gemma's local layers): the window inside the live keys.
    window = max(1, length // 2)
    window_mask = masks.SlidingWindow.from_hf(window)
    cases += [
        Case(
            "decode",
            "F.scaled_dot_product_attention(cache[:, :, :n])",
            lambda: F.scaled_dot_product_attention(q1, k_cache[:, :, : (n := next_len())], v_cache[:, :, :n]),
            baseline=True,
        ),
        Case(
            "decode",
            "fz.attention(q1, cache[:, :, :n])",
            fz_attention_on_slices,
            route=fz.plan(q1, k_cache[:, :, :live], v_cache[:, :, :live]).backend,
            slack_us=SDPA_SLACK_US,
        ),
        Case(
            "decode",
            "fz.decode.decode_step(cache_len=n)",
            decode_step,
            route="SDPA over the prefix",
            limit_us=DECODE_TARGET_US,
        ),
        Case(
            "decode-growing",
            "F.scaled_dot_product_attention(cache[:, :, :n]), a new n every call",
            lambda: F.scaled_dot_product_attention(q1, k_grow[:, :, : (n := grown_len())], v_grow[:, :, :n]),
            baseline=True,
        ),
        Case(
            "decode-growing",
            "fz.attention(q1, cache[:, :, :n]), a new n every call (plan-cache miss)",
            lambda: fz.attention(q1, k_grow[:, :, : (n := grown_len())], v_grow[:, :, :n]),
            route=fz.plan(q1, k_grow[:, :, :live], v_grow[:, :, :live]).backend,
        ),
        Case(
            "decode-window",
            "F.scaled_dot_product_attention(cache[:, :, n - w:n])",
            lambda: F.scaled_dot_product_attention(
                q1, k_cache[:, :, (n := next_len()) - window : n], v_cache[:, :, n - window : n]
            ),
            baseline=True,
        ),
        Case(
            "decode-window",
            "fz.decode.decode_step(cache_len=n, mask=SlidingWindow.from_hf(w))",
            lambda: fz.decode.decode_step(q1, k_cache, v_cache, next_len(), mask=window_mask),
            route="SDPA over the window",
            limit_us=DECODE_TARGET_US,
        ),
        Case(
            "decode-window",
            f'fz.decode.decode_step(cache_len=n, mask=SlidingWindow.from_hf(w), backend="{flex_route}")',
            lambda: fz.decode.decode_step(
                q1, k_cache, v_cache, next_len(), mask=window_mask, backend=flex_route
            ),
            route=flex_route,
        ),
        *_decode_floors(q1, k_cache, v_cache, live, flex_route, decode_step_flex),
    ]
    return cases


def _decode_floors(
    q1: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    live: int,
    flex_route: str,
    decode_step_flex: Callable[[], Any],
) -> list[Case]:
    """``decode_step`` on the flex route against two floors, each its own group.

    ``decode-flex``: the compiled flex call a decode step makes, alone: ``torch.compile(
    flex_attention)`` with the step's kernel options on a ``DecodeMask``'s BlockMask, updated once
    (to ``live`` keys), so with no per-step state at all. ``decode-flex-len``: the same call after
    writing the length tensor its mask_mod reads (one ``fill_``), the least a hand-written
    generation loop over a growing cache does per step to move the mask's end."""
    dm = fz.decode.DecodeMask(masks.Causal(), q1.shape[0], 1, k_cache.shape[2], device=q1.device)
    bm = dm.update(live)
    chosen = fz.plan(q1, k_cache, v_cache, mask=bm, backend=flex_route)
    options = BY_NAME[chosen.backend].options(chosen.problem, bm)
    compiled = torch.compile(flex_attention, dynamic=False)
    lengths = dm.cache_len

    def with_length_written() -> Any:
        lengths.fill_(live)  # the same value every call: the mask stays the one built for ``live``
        return compiled(q1, k_cache, v_cache, block_mask=bm, kernel_options=options)

    step_name = f'fz.decode.decode_step(cache_len=n, backend="{flex_route}")'
    return [
        Case(
            "decode-flex",
            "torch.compile(flex_attention), prebuilt decode BlockMask",
            lambda: compiled(q1, k_cache, v_cache, block_mask=bm, kernel_options=options),
            baseline=True,
        ),
        Case("decode-flex", step_name, decode_step_flex, route=flex_route, limit_us=DECODE_TARGET_US),
        Case(
            "decode-flex-len",
            "torch.compile(flex_attention), prebuilt decode BlockMask, its length tensor written per call",
            with_length_written,
            baseline=True,
        ),
        Case("decode-flex-len", step_name, decode_step_flex, route=flex_route, slack_us=FLEX_SLACK_US),
    ]


def measure(
    cases: list[Case],
    device: torch.device,
    warmup: int,
    rounds: int,
    chunk: int,
    between: Callable[[], Any] | None = None,
) -> None:
    """Time every case's calls; ``between`` (untimed) runs before each timed call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for case in cases:
        for _ in range(warmup):
            case.call()
        sync()
    clock = time.perf_counter
    for _ in range(rounds):
        for case in cases:
            samples = case.samples
            call = case.call
            for _ in range(chunk):
                if between is not None:
                    between()
                t0 = clock()
                call()
                samples.append((clock() - t0) * 1e6)
            sync()


def layer_ops(
    device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int, int]
) -> Callable[[], Any]:
    """The rest of a transformer layer around its attention call, as a model runs it between two
    attention calls: an output projection, a residual add, an RMS norm, a gated MLP and the next
    layer's q/k/v projections, on one token row per query (``--in-layer``)."""
    b, h, length, d = shape
    width = h * d
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(b, length, width, generator=gen).to(device, dtype)
    w_o, w_gate, w_up, w_qkv = (
        (torch.randn(width, n * width, generator=gen) / width**0.5).to(device, dtype) for n in (1, 2, 2, 3)
    )
    w_down = (torch.randn(2 * width, width, generator=gen) / width**0.5).to(device, dtype)
    norm = torch.nn.RMSNorm(width, device=device, dtype=dtype)

    def rest() -> Any:
        y = norm(x + x @ w_o)
        y = y + (torch.nn.functional.silu(y @ w_gate) * (y @ w_up)) @ w_down
        return y @ w_qkv

    return rest


def report(
    cases: list[Case], shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device
) -> list[str]:
    b, h, length, d = shape
    lines = [
        f"### B={b} H={h} L={length} D={d} {str(dtype).removeprefix('torch.')} on {device.type}"
        + (" (times include the kernel)" if device.type == "cpu" else ""),
        "",
        "| group | call | route | median us | p10 | p90 | - baseline us | / baseline | target |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    base: dict[str, float] = {}
    for case in cases:
        med, p10, p90 = _stats(case.samples)
        if case.baseline:
            base[case.group] = med
            diff = ratio = target = ""
        else:
            ref = base[case.group]
            diff, ratio = f"{med - ref:+.1f}", f"{med / ref:.2f}x"
            if case.limit_us is not None:
                target = f"<= {case.limit_us:.0f}: {'met' if med <= case.limit_us else 'missed'}"
            elif case.slack_us is not None:
                target = f"<= +{case.slack_us:.0f}: {'met' if med - ref <= case.slack_us else 'missed'}"
            else:
                target = ""
        lines.append(
            f"| {case.group} | `{case.name}` | {case.route} | {med:.1f} | {p10:.1f} | {p90:.1f} | {diff} | {ratio} | {target} |"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument(
        "--shapes", default=None, help="BxHxLxD,... (default: cuda 1x8x512x64; cpu that and 1x2x64x16)"
    )
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--chunk", type=int, default=50, help="calls per case per round")
    p.add_argument("--out", default=None, help="write the markdown report here")
    p.add_argument(
        "--in-layer",
        action="store_true",
        help="run the rest of a transformer layer (untimed) before each timed call, as a model does",
    )
    args = p.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    shapes = args.shapes or ("1x8x512x64" if device.type == "cuda" else "1x8x512x64,1x2x64x16")
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    env = collect_env(device, command)
    dirty = " (uncommitted changes)" if env.get("git_dirty") else ""
    out = [
        "# Eager host cost on a plan-cache hit",
        "",
        f"Command: `{command}`",
        "",
        f"torch {env['torch']}, {env['gpu'] or 'CPU'}, {torch.get_num_threads()} threads, "
        f"flexattn_zoo {(env['git'] or '?')[:12]}{dirty}, {env['date']}; "
        f"{args.rounds} rounds x {args.chunk} calls per case after {args.warmup} warm-up calls.",
        "",
    ]
    if args.in_layer:
        out += [
            "In a layer: before each timed call, the rest of a transformer layer ran (untimed: output",
            "projection, residual, RMS norm, gated MLP, next q/k/v projections), as between two",
            "attention calls of a model; baselines and library calls alike.",
            "",
        ]
    if device.type == "cpu":
        out += [
            "CPU: every call runs its kernel before it returns, so these times include the kernel;",
            "the tiny shape is where the kernel is negligible and the difference is host overhead.",
            "",
        ]
    for text in shapes.split(","):
        shape = _parse_shape(text)
        cases = build_cases(device, dtype, shape)
        between = layer_ops(device, dtype, shape) if args.in_layer else None
        measure(cases, device, args.warmup, args.rounds, args.chunk, between)
        out += report(cases, shape, dtype, device) + [""]
        print("\n".join(report(cases, shape, dtype, device)), flush=True)
        print()
    text = "\n".join(out).rstrip() + "\n"
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
