"""Soft-capping on Triton flex: how the tanh is evaluated, side by side in one process.

``torch.compile(flex_attention)`` with a causal BlockMask and the sm90 forward tiles the flex route
pins, on the ``softcap_causal`` case of ``benchmarks/configs/h200.yaml`` (B=4, H=16, L=8K, D=128,
bf16, cap 30), with the score mod ``cap * tanh(s / cap)`` where tanh is:

* ``none``: no score mod (the ceiling: causal alone);
* ``libdevice``: ``torch.tanh`` (Triton's accurate libdevice tanh);
* ``hardware``: ``flexattn_zoo::tanh_approx`` (PTX ``tanh.approx.f32``, one MUFU op per score:
  what ``SoftCap(approx=True)`` runs on the flex route);
* ``odd-poly-9``: ``x * P(x^2)`` of degree 9 fitted to tanh on [-3, 3], the input clamped to that
  range: five FMAs and a clamp on the FMA pipe instead of the MUFU op (which the softmax's exp2
  also needs). Its error (printed) is far above the hardware tanh's; it bounds from above what
  any polynomial of that cost could gain.

Reports forward and forward+backward median ms (``tuning.timing.time_routes``: rotated rounds,
warmed up; compile time excluded) and each variant's max |out - exact softcap out|.

    PYTHONPATH=. python benchmarks/softcap_tanh_probe.py
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from flexattn_zoo import _compat
from flexattn_zoo.tuning.timing import time_routes

B, H, L, D, CAP, RANGE = 4, 16, 8192, 128, 30.0, 3.0
TILES = {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 3}


def _odd_poly() -> list[float]:
    x = np.cos(np.linspace(0, np.pi, 4000)) * RANGE
    basis = np.stack([x ** (2 * i + 1) for i in range(5)], 1)
    return [float(c) for c in np.linalg.lstsq(basis, np.tanh(x), rcond=None)[0]]


def main() -> int:
    from torch.nn.attention.flex_attention import create_block_mask

    dev = torch.device("cuda")
    fast = _compat.fast_tanh_op()
    c1, c3, c5, c7, c9 = _odd_poly()

    def poly(x: torch.Tensor) -> torch.Tensor:
        x = x.clamp(-RANGE, RANGE)
        x2 = x * x
        return x * (c1 + x2 * (c3 + x2 * (c5 + x2 * (c7 + x2 * c9))))

    tanhs: dict[str, Any] = {"libdevice": torch.tanh, "hardware": fast, "odd-poly-9": poly}
    mods: dict[str, Any] = {"none": None}
    for name, tanh in tanhs.items():
        mods[name] = lambda s, b, h, q, kv, tanh=tanh: CAP * tanh(s / CAP)
    bm = create_block_mask(lambda b, h, q, kv: kv <= q, None, None, L, L, device=dev)
    flex = torch.compile(_compat.flex_attention)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (
        (torch.randn(B, H, L, D, device=dev, generator=g) * 2).to(torch.bfloat16).requires_grad_()
        for _ in range(3)
    )
    grad = torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16, generator=g)
    with torch.no_grad():
        exact = flex(q, k, v, score_mod=mods["libdevice"], block_mask=bm, kernel_options=TILES).float()

    def fwd(mod: Any) -> Any:
        return lambda: flex(q, k, v, score_mod=mod, block_mask=bm, kernel_options=TILES)

    def fwdbwd(mod: Any) -> Any:
        return lambda: flex(q, k, v, score_mod=mod, block_mask=bm, kernel_options=TILES).backward(grad)

    print(
        f"# torch {torch.__version__}, {torch.cuda.get_device_name()}, B={B} H={H} L={L} D={D} bf16, causal, cap {CAP}"
    )
    with torch.no_grad():
        errors = {n: float((fwd(m)().float() - exact).abs().max()) for n, m in mods.items()}
        res_fwd = time_routes({n: fwd(m) for n, m in mods.items()}, dev, warmup=5, reps=30)
    res_bwd = time_routes({n: fwdbwd(m) for n, m in mods.items()}, dev, warmup=3, reps=15)
    for n in mods:
        cells = []
        for label, res in (("fwd", res_fwd), ("fwd+bwd", res_bwd)):
            r = res[n]
            cells.append(f"{label} {r!r:.50}" if isinstance(r, Exception) else f"{label} {r[0]:.3f} ms")
        print(f"{n:11s} " + " | ".join(cells) + f" | max |out - exact| {errors[n]:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
