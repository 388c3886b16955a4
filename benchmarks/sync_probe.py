"""Which eager ``fz.attention`` calls synchronize the host with the GPU on a plan-cache hit.

A call that waits for the device makes its host time the kernel time of everything queued before
it (the zoo sweep's ``host ms`` then reads close to ``ms``). Each registered mask's typical
example (and ``--scores``' score mods on causal) is warmed up on the given route, then called once
more under ``torch.cuda.set_sync_debug_mode("error")``: a synchronizing CUDA call raises there,
and the innermost library frame of its traceback is printed.

    PYTHONPATH=. python benchmarks/sync_probe.py [--routes flex,auto] [--shape 2,16,4096,128] [--names natten,...]
"""

from __future__ import annotations

import argparse
import traceback

import torch

import flexattn_zoo as fz
from flexattn_zoo import masks, registry


def _where(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "flexattn_zoo" in f.filename]
    inner = frames[-3:] if frames else traceback.extract_tb(exc.__traceback__)[-2:]
    return " <- ".join(
        f"{f.filename.split('flexattn_zoo/')[-1]}:{f.lineno} {f.name}" for f in reversed(inner)
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--routes", default="flex,auto")
    p.add_argument("--shape", default="2,16,4096,128")
    p.add_argument("--names", default=None, help="comma-separated registry names (default: every mask)")
    p.add_argument("--scores", default="", help="comma-separated score mods, each run on causal")
    args = p.parse_args()
    b, h, length, d = (int(n) for n in args.shape.split(","))
    names = args.names.split(",") if args.names else registry.MASKS.names()
    cases = [
        (n, {"mask": registry.MASKS.entry(n).factory.typical_example(length, length, b, h)}) for n in names
    ]
    for n in filter(None, args.scores.split(",")):
        score = registry.SCORES.entry(n).factory.typical_example(length, length, b, h)
        cases.append((n, {"mask": masks.Causal(), "score_mod": score}))
    q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    print(f"# B={b} H={h} L={length} D={d} bf16, torch {torch.__version__}")
    for name, kw in cases:
        for route in args.routes.split(","):
            try:
                for _ in range(3):
                    fz.attention(q, k, v, backend=route, **kw)
                torch.cuda.synchronize()
            except Exception as exc:  # a refusal or a failure: not what this probe looks at
                print(
                    f"{name:24s} {route:6s} not run: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                )
                continue
            chosen = fz.plan(q, k, v, backend=route, **kw).backend
            torch.cuda.set_sync_debug_mode("error")
            try:
                fz.attention(q, k, v, backend=route, **kw)
                verdict = "no sync"
            except RuntimeError as exc:
                verdict = f"SYNC at {_where(exc)}"
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            print(f"{name:24s} {route:6s} ({chosen}): {verdict}", flush=True)


if __name__ == "__main__":
    main()
