"""Does compiled flex_attention (Triton) run on inputs of 2**31 or more elements? (CUDA)

The decode benchmark failed to compile the flex template at 64K tokens x batch 32 (K of exactly
2**31 elements). This probe compiles flex on such inputs, one kernel family at a time, and prints
one line per case: ``ok`` with the max error against SDPA on a slice, or the error.

    python benchmarks/large_index_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexattn_zoo import _compat  # noqa: E402


def probe(name: str, batch: int, hq: int, hkv: int, lq: int, lkv: int, backend: str | None) -> None:
    dev, dt, d = "cuda", torch.bfloat16, 128
    torch._dynamo.reset()
    try:
        q = torch.randn(batch, hq, lq, d, device=dev, dtype=dt)
        k = torch.randn(batch, hkv, lkv, d, device=dev, dtype=dt)
        v = torch.randn_like(k)
        fn = torch.compile(_compat.flex_attention, fullgraph=True)
        opts = {"BACKEND": backend} if backend else None
        with torch.no_grad():
            out = fn(q, k, v, enable_gqa=hq != hkv, kernel_options=opts)
            last = slice(batch - 1, batch)  # the rows at the far end of the index range
            ref = F.scaled_dot_product_attention(q[last], k[last], v[last], enable_gqa=hq != hkv)
            err = (out[last].float() - ref.float()).abs().max().item()
        print(
            f"{name}: ok, K elements {k.numel()} (2**31 = {2**31}), max err vs SDPA on the last row {err:.3e}",
            flush=True,
        )
    except Exception as exc:  # noqa: BLE001 - the probe reports what torch does
        print(f"{name}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:300]}", flush=True)
    finally:
        torch.cuda.empty_cache()


def main() -> int:
    probe("decode kernel, K just under 2**31", 31, 32, 8, 1, 65536 + 2048, None)
    probe("decode kernel, K = 2**31", 32, 32, 8, 1, 65536, None)
    probe("main kernel (BACKEND=TRITON) Lq=1, K = 2**31", 32, 32, 8, 1, 65536, "TRITON")
    probe("main kernel, Lq=Lkv=8192, q/k/v = 2**31", 64, 32, 32, 8192, 8192, None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
