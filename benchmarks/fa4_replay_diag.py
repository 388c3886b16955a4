"""What the fa4 route's replayed launches hold, and where a replayed call's host time goes (CUDA, FA4).

For each shape (causal, bf16, [B, L, H, D] projections viewed as [B, H, L, D]): a few forward +
backward calls of ``fz.attention(..., backend="fa4")``, then every entry of
``fa4_replay.PROGRAMS`` (a program's steps, or a refusal's reason), then cProfile of
``--calls`` replayed forward calls (no gradients) and forward + backward calls, the top
functions by own time.

    python benchmarks/fa4_replay_diag.py --shapes 1x8x512x64,8x16x512x128
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

import flexattn_zoo as fz
from flexattn_zoo.backends import fa4_replay


def _describe() -> list[str]:
    lines = []
    for entry in fa4_replay.PROGRAMS.values():
        if isinstance(entry, fa4_replay.Refused):
            lines.append(f"  refused: {entry.reason}")
        elif not isinstance(entry, fa4_replay.Program):
            lines.append(f"  not recorded yet: {entry!r}")
        else:
            names = [getattr(s.fn, "__name__", type(s.fn).__name__) for s in entry.steps]
            lines.append(f"  program, {len(entry.steps)} steps: {', '.join(names)}")
    return lines


def _profile(fn, calls: int, top: int) -> str:  # type: ignore[no-untyped-def]
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1x8x512x64,8x16x512x128")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        _shape(shape, args.calls, args.top)


def _shape(shape: str, calls: int, top: int) -> None:
    fa4_replay.PROGRAMS.clear()
    b, h, length, d = (int(x) for x in shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(b, length, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        .transpose(1, 2)
        .requires_grad_(True)
        for _ in range(3)
    )
    grad = torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16, generator=gen)

    def fwd_bwd() -> None:
        out = fz.attention(q, k, v, mask="causal", backend="fa4")
        torch.autograd.grad(out, (q, k, v), grad)

    def fwd() -> None:
        with torch.no_grad():
            fz.attention(q, k, v, mask="causal", backend="fa4")

    for _ in range(5):
        fwd_bwd()
        fwd()
    torch.cuda.synchronize()
    print(f"== {shape}: fa4_replay.PROGRAMS after 5 fwd+bwd and 5 fwd calls")
    print("\n".join(_describe()))
    print(f"-- cProfile, {calls} forward calls (no gradients)")
    print(_profile(fwd, calls, top))
    print(f"-- cProfile, {calls} forward + backward calls")
    print(_profile(fwd_bwd, calls, top))


if __name__ == "__main__":
    main()
