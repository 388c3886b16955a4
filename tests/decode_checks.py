"""A decode step's output against the float64 reference under fz.testing's tolerance rule: shared
by tests/gpu/test_decode_gpu.py and tests/gpu/test_subclassed_specs_gpu.py."""

from __future__ import annotations

import torch

from flexattn_zoo.testing import FLOOR_ULPS, eager_attention, reference_attention


def _full_problem(q, k, v, lens, b):  # type: ignore[no-untyped-def]
    """Row ``b`` of a decode step as a full forward: q placed at the last Lq of ``lens[b]`` positions."""
    n, lq = int(lens[b]), q.shape[2]
    full_q = torch.zeros(1, q.shape[1], n, q.shape[3], dtype=q.dtype, device=q.device)
    full_q[:, :, n - lq :] = q[b : b + 1]
    return full_q, k[b : b + 1, :, :n], v[b : b + 1, :, :n]


def assert_decode_matches(out, q, k, v, lens, mask, score=None, sinks=None) -> None:  # type: ignore[no-untyped-def]
    lq = q.shape[2]
    for b in range(q.shape[0]):
        fq, fk, fv = _full_problem(q, k, v, lens, b)
        ref, ref_lse = reference_attention(
            fq.double(),
            fk.double(),
            fv.double(),
            mask=mask,
            score_mod=score,
            enable_gqa=True,
            sinks=None if sinks is None else sinks.double(),
            return_lse=True,
        )
        eager = eager_attention(fq, fk, fv, mask=mask, score_mod=score, enable_gqa=True)
        if sinks is not None:  # eager with sinks through the same identity, in the input dtype
            _, lse = eager_attention(fq, fk, fv, mask=mask, score_mod=score, enable_gqa=True, return_lse=True)
            eager = eager * torch.sigmoid(lse - sinks.to(lse.dtype).view(1, -1, 1)).unsqueeze(-1).to(
                eager.dtype
            )
        ref, eager, ref_lse = ref[0, :, -lq:], eager[0, :, -lq:], ref_lse[0, :, -lq:]
        err = float((out[b].double() - ref).abs().max())
        eager_err = float((eager.double() - ref).abs().max())
        finite = ref_lse[torch.isfinite(ref_lse)]
        lse_scale = 1 + (float(finite.abs().max()) if finite.numel() else 0.0)
        floor = float(ref.abs().max()) * (
            torch.finfo(q.dtype).eps + FLOOR_ULPS * torch.finfo(torch.float32).eps * lse_scale
        )
        assert err <= 2 * eager_err + floor, f"row {b}: error {err:.3e} > 2 x {eager_err:.3e} + {floor:.3e}"
