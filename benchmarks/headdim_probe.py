"""Which kernels run which head dims on this GPU: FA4's own ``flash_attn_func`` (forward and
backward) at D = 64/96/128/192/256 and Dqk=192/Dv=128, with causal / window / softcap, and which
SDPA backend runs Dqk != Dv. Prints one line per probe (ok with ms, or the error's first line).

    PYTHONPATH=/tmp/fa4:/tmp/fa4/nvidia_cutlass_dsl/dsl_packages:$PWD python3 benchmarks/headdim_probe.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, n: int = 10) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def probe(name: str, fn) -> None:  # type: ignore[no-untyped-def]
    try:
        print(f"{name}: ok {timed(fn):.3f} ms", flush=True)
    except Exception as exc:  # noqa: BLE001 - a probe reports whatever fails
        print(f"{name}: FAIL {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)


def main() -> None:
    dev, dt = "cuda", torch.bfloat16
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as exc:  # noqa: BLE001
        flash_attn_func = None
        print("no FA4:", exc)
    b, h, hkv, L = 2, 16, 8, 8192
    for dqk, dv in ((64, 64), (80, 80), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256)):
        q = torch.randn(b, L, h, dqk, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(b, L, hkv, dqk, device=dev, dtype=dt, requires_grad=True)
        v = torch.randn(b, L, hkv, dv, device=dev, dtype=dt, requires_grad=True)
        if flash_attn_func is not None:
            for label, kw in (
                ("causal", {"causal": True}),
                ("window4096_softcap50", {"causal": True, "window_size": (4095, 0), "softcap": 50.0}),
            ):
                probe(
                    f"fa4 fwd D={dqk}/{dv} {label}",
                    lambda kw=kw, q=q, k=k, v=v: flash_attn_func(q, k, v, **kw),
                )
                probe(
                    f"fa4 fwdbwd D={dqk}/{dv} {label}",
                    lambda kw=kw, q=q, k=k, v=v: flash_attn_func(q, k, v, **kw)[0].sum().backward(),
                )
        qs, ks, vs = (t.detach().transpose(1, 2).requires_grad_(True) for t in (q, k, v))
        for backend in (
            SDPBackend.CUDNN_ATTENTION,
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
        ):

            def run(backend=backend, bwd=False, qs=qs, ks=ks, vs=vs):  # type: ignore[no-untyped-def]
                with sdpa_kernel([backend]):
                    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
                    if bwd:
                        o.sum().backward()

            probe(f"sdpa {backend.name} fwd D={dqk}/{dv} gqa", run)
            probe(f"sdpa {backend.name} fwdbwd D={dqk}/{dv} gqa", lambda backend=backend: run(backend, True))


if __name__ == "__main__":
    main()
