"""Which flex_flash (torch flex + FA4 CuTe) calls give wrong gradients? (H200, torch 2.11, FA4 b36)

The GPU fuzz found dq off by 50x on flex_flash for: GQA 8:2, Lq=129, Lkv=513, D=64, mask
Causal & ~(SlidingWindow & ~PrefixLM), score Alibi >> SoftCap >> SoftCap. This script varies one
factor at a time (GQA, head-dependent score, Lq != Lkv, the mask) and prints, per combination,
the forward and gradient errors against the float64 reference relative to its budget.

    python benchmarks/flex_flash_grad_probe.py          # needs flash-attn-4 and a CUDA GPU
"""

from __future__ import annotations

import torch

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.testing import assert_matches_reference


def main() -> None:
    c, w, p = masks.Causal(), masks.SlidingWindow(left=300, right=17), masks.PrefixLM(prefix_len=129)
    fuzz_mask = c & ~(w & ~p)
    alibi, cap = score_mods.Alibi(num_heads=8), score_mods.SoftCap(cap=20.0)
    chain = alibi >> cap >> cap
    combos = [
        ("fuzz case", fuzz_mask, chain, 129, 513, 2),
        ("fuzz case, no GQA", fuzz_mask, chain, 129, 513, 8),
        ("fuzz case, Lq == Lkv", fuzz_mask, chain, 513, 513, 2),
        ("causal + alibi, GQA", c, alibi, 512, 512, 2),
        ("causal + alibi, no GQA", c, alibi, 512, 512, 8),
        ("causal + softcap, GQA", c, cap, 512, 512, 2),
        ("causal, no score, GQA, Lq < Lkv", c, None, 129, 513, 2),
        ("fuzz mask, no score, GQA", fuzz_mask, None, 129, 513, 2),
        ("causal + alibi, GQA, Lq < Lkv", c, alibi, 129, 513, 2),
    ]
    for name, mask, score, lq, lkv, hkv in combos:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(2, 8, lq, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
        k = torch.randn(2, hkv, lkv, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(
            True
        )
        v = torch.randn(2, hkv, lkv, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(
            True
        )
        fwd = "fwd FAIL"
        try:
            out = fz.attention(q, k, v, mask=mask, score_mod=score, enable_gqa=True, backend="flex_flash")
            grad_out = torch.randn_like(out)
            grads = torch.autograd.grad(out, (q, k, v), grad_out)
            assert_matches_reference(out, q, k, v, mask=mask, score_mod=score, enable_gqa=True)
            fwd = "fwd ok"
            assert_matches_reference(
                out, q, k, v, mask=mask, score_mod=score, enable_gqa=True, grads=grads, grad_out=grad_out
            )
            verdict = "fwd ok, grads ok"
        except AssertionError as exc:
            verdict = f"{fwd}; {str(exc).splitlines()[0][:220]}"
        except Exception as exc:  # noqa: BLE001 - report and go on
            verdict = f"error {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        print(f"{name:36s} Lq={lq} Lkv={lkv} H=8/{hkv}: {verdict}", flush=True)


if __name__ == "__main__":
    main()
