"""Where the host time of one ``fz.attention`` call goes, next to hand-written flex.

On short kernels (the D=64 document forward runs 0.6 ms) the host's time to issue a call decides
the speed: the bench's ``host_ms`` column showed 0.3-0.6 ms for our routes against 0.06-0.15 ms
for ``raw_flex``. This probe prepares each route exactly as the bench does (same case, inputs,
specs), then for each route

1. times the host alone: median wall time to return from one call, issued back to back without
   synchronizing (as in the bench), and the CUDA-event median of the same calls;
2. profiles ``--profile-calls`` calls with cProfile and prints the functions with the most
   cumulative and own time.

    python benchmarks/host_overhead_probe.py                     # CUDA GPU, h200.yaml cases
    python benchmarks/host_overhead_probe.py --cases document_causal_d64 --routes auto,flex
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import statistics
import time

import torch

from flexattn_zoo.bench import routes as bench_routes
from flexattn_zoo.bench.config import load_config
from flexattn_zoo.bench.timing import measure


def host_times(call, device: torch.device, iters: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        out.append((time.perf_counter() - t0) * 1e3)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out


def profile(call, calls: int, top: int) -> str:  # type: ignore[no-untyped-def]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return "\n".join(line for line in text.getvalue().splitlines() if line.strip())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="flexattn_zoo/bench/configs/h200.yaml")
    p.add_argument("--cases", default="document_causal_d64,causal")
    p.add_argument("--routes", default="auto,flex,flex_flash,fa4,sdpa_cudnn,raw_flex")
    p.add_argument("--modes", default="fwd,fwdbwd")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--profile-calls", type=int, default=100)
    p.add_argument("--profile-routes", default="auto,flex,fa4")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases = {c.name: c for c in load_config(args.config)}
    print(
        f"torch {torch.__version__}, device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}"
    )
    for name in args.cases.split(","):
        case = cases[name]
        if device.type != "cuda":  # a check that the probe runs: tiny, float32
            case = dataclasses.replace(
                case,
                device="cpu",
                dtype=torch.float32,
                batch=1,
                heads=2,
                kv_heads=2,
                seq_len=512,
                document_lengths=None,
            )
        mask, score = case.specs(device)
        for mode in args.modes.split(","):
            x = bench_routes.Inputs.make(case, mode, device)
            print(f"\n== {name} {mode} {case.shape()}", flush=True)
            for route in args.routes.split(","):
                try:
                    prep = bench_routes.prepare(route, case, mode, mask, score, x, device)
                except (bench_routes.Unsupported, bench_routes.SkippedOOM) as exc:
                    print(f"  {route:<12} n/a: {str(exc)[:120]}")
                    continue
                if mode == "fwd":

                    def step(prep=prep):  # type: ignore[no-untyped-def]
                        with torch.no_grad():
                            return prep.call()
                else:
                    inputs = (x.q, x.k, x.v)

                    def step(prep=prep, inputs=inputs, grad_out=x.grad_out):  # type: ignore[no-untyped-def]
                        out = prep.call()
                        torch.autograd.grad(out, inputs, grad_out)
                        return out

                t = measure(step, device, warmup=5, iters=30)
                host = host_times(step, device, args.iters)
                chosen = f" ({prep.chosen})" if prep.chosen else ""
                print(
                    f"  {route + chosen:<24} gpu {t.median_ms:7.3f} ms  host median {statistics.median(host):.3f} ms"
                    f"  p10 {sorted(host)[len(host) // 10]:.3f}",
                    flush=True,
                )
                if route in args.profile_routes.split(","):
                    print(profile(step, args.profile_calls, args.top))
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
