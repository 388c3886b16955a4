"""How much of FA4's forward host time a launch memo would save (CUDA, FA4 installed).

The ``fa4`` route calls FlashAttention-4's ``_flash_attn_fwd`` per call: about a thousand lines
of Python (checks, tile and scheduler choice, the compile-cache key) before it calls the
compiled CuTe kernel (a TVM-FFI function taking torch tensors). For a repeated signature all of
that gives the same kernel and the same non-tensor arguments. This probe records the compiled
call of one ``_flash_attn_fwd`` (by wrapping the function's JIT cache while it runs), then
replays it for new q/k/v: fresh ``out`` / ``lse`` allocated as FA4 allocates them, the other
arguments as recorded. It reports whether the replay matches FA4's own call bit for bit, and the
host time per call (``perf_counter`` around back-to-back calls, drained between runs; best of
``--repeat``) of plain SDPA, FA4's ``flash_attn_func``, ``_flash_attn_fwd`` and the replay.

Only calls that made exactly one compiled call with q, k, v, out and lse as its first five
arguments are replayed (no split-KV combine, no scheduler metadata); the probe says when a shape
does not qualify.

    python benchmarks/fa4_replay_probe.py
    python benchmarks/fa4_replay_probe.py --shapes 1x8x512x64,8x32x2048x128 --causal
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


class _Recorder:
    """Stands in for a FA4 JIT cache while one call runs: lookups go to the real cache, and each
    compiled function looked up is wrapped to record ``(key, function, args)`` when called."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[Any, Any, tuple[Any, ...]]] = []

    def __contains__(self, key: Any) -> bool:
        return key in self.inner

    def __setitem__(self, key: Any, value: Any) -> None:
        self.inner[key] = value

    def __getitem__(self, key: Any) -> Callable[..., Any]:
        fn = self.inner[key]

        def call(*args: Any) -> Any:
            self.calls.append((key, fn, args))
            return fn(*args)

        return call


def _record(fwd: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Any:
    real = fwd.compile_cache
    recorder = _Recorder(real)
    fwd.compile_cache = recorder
    try:
        out, lse, *_ = fwd(q, k, v, causal=causal, return_lse=True)
    finally:
        fwd.compile_cache = real
    return out, lse, recorder.calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--shapes", default="1x8x512x64,4x16x1024x128,2x32x4096x128", help="BxHxLxD, comma-separated"
    )
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--number", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args()
    from flash_attn.cute import flash_attn_func
    from flash_attn.cute import interface as fa4

    fwd = fa4._flash_attn_fwd
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}; causal={args.causal}; "
        f"host us per call, best of {args.repeat} x {args.number}"
    )
    for shape in args.shapes.split(","):
        print(_probe_shape(shape, args, fwd, flash_attn_func))


def _probe_shape(shape: str, args: argparse.Namespace, fwd: Any, flash_attn_func: Any) -> str:
    b, h, length, d = (int(x) for x in shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)

    def bshd() -> torch.Tensor:
        return torch.randn(b, length, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)

    q, k, v = bshd(), bshd(), bshd()
    fwd(q, k, v, causal=args.causal, return_lse=True)  # compiles
    out_ref, lse_ref, calls = _record(fwd, q, k, v, args.causal)
    ptrs = [t.data_ptr() for t in (q, k, v, out_ref, lse_ref)]
    first = calls[0][2] if len(calls) == 1 else ()
    if len(calls) != 1 or [getattr(a, "data_ptr", lambda: None)() for a in first[:5]] != ptrs:
        return f"{shape}: not replayable ({len(calls)} compiled calls)"
    _, kernel, recorded = calls[0]
    rest = recorded[5:]
    out_shape, out_dtype, lse_shape = out_ref.shape, out_ref.dtype, lse_ref.shape

    def replay(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(out_shape, dtype=out_dtype, device=q.device)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        kernel(q, k, v, out, lse, *rest)
        return out, lse

    q2, k2, v2 = bshd(), bshd(), bshd()
    want_out, want_lse, *_ = fwd(q2, k2, v2, causal=args.causal, return_lse=True)
    got_out, got_lse = replay(q2, k2, v2)
    torch.cuda.synchronize()
    same = torch.equal(got_out, want_out) and torch.equal(got_lse, want_lse)
    qh, kh, vh = (t.transpose(1, 2) for t in (q2, k2, v2))
    pieces: dict[str, Callable[[], Any]] = {
        "sdpa": lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=args.causal),
        "flash_attn_func": lambda: flash_attn_func(q2, k2, v2, causal=args.causal),
        "_flash_attn_fwd": lambda: fwd(q2, k2, v2, causal=args.causal, return_lse=True),
        "replay": lambda: replay(q2, k2, v2),
    }
    best = {}
    for name, fn in pieces.items():

        def drained(fn: Callable[[], Any] = fn) -> None:
            for _ in range(args.number):
                fn()
            torch.cuda.synchronize()

        drained()
        best[name] = min(timeit.repeat(drained, number=1, repeat=args.repeat)) / args.number * 1e6
    times = ", ".join(f"{name} {us:.1f}" for name, us in best.items())
    return f"{shape}: replay equal to FA4's own call: {same}; {times}"


if __name__ == "__main__":
    main()
