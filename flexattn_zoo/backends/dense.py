"""``dense``: eager attention over a materialized Lq x Lkv score matrix, with autograd.

The only exact training route where flex has no backward (CPU). It evaluates the spec's
``mask_mod``/``score_mod`` on broadcast index grids (not the test oracle ``.dense``, so tests stay
independent) and computes in float32 (float64 for float64 inputs). A memory guard refuses problems
whose scores would exceed ``FLEXATTN_ZOO_DENSE_LIMIT_MB`` (default 1024 MiB).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from flexattn_zoo.backends.base import FLOATS, Backend
from flexattn_zoo.problem import Problem

DENSE_LIMIT_ENV = "FLEXATTN_ZOO_DENSE_LIMIT_MB"
DEFAULT_DENSE_LIMIT_MB = 1024


def dense_limit_bytes() -> int:
    raw = os.environ.get(DENSE_LIMIT_ENV, str(DEFAULT_DENSE_LIMIT_MB))
    try:
        return int(float(raw) * 2**20)
    except ValueError as exc:
        raise ValueError(f"{DENSE_LIMIT_ENV} must be a number of MiB, got {raw!r}") from exc


def dense_bytes(p: Problem) -> int:
    """Peak bytes of the score tensors this route keeps (scores, probabilities, their grads)."""
    elem = 8 if p.dtype == torch.float64 else 4
    copies = 4 if p.requires_grad else 2
    return p.batch * p.heads * p.q_len * p.kv_len * elem * copies


def _grids(p: Problem, device: torch.device) -> tuple[torch.Tensor, ...]:
    b = torch.arange(p.batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(p.heads, device=device).view(1, -1, 1, 1)
    qi = torch.arange(p.q_len, device=device).view(1, 1, -1, 1)
    kj = torch.arange(p.kv_len, device=device).view(1, 1, 1, -1)
    return b, h, qi, kj


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """kv head ``g`` serves q heads ``g * group .. (g + 1) * group - 1`` (SDPA's grouping)."""
    b, hkv, length, d = t.shape
    return t[:, :, None].expand(b, hkv, heads // hkv, length, d).reshape(b, heads, length, d)


@dataclasses.dataclass(frozen=True)
class DenseBackend(Backend):
    def mask_reasons(self, p: Problem) -> list[str]:
        if p.user_block_mask:
            return ["takes a mask spec, not a BlockMask"]
        need, limit = dense_bytes(p), dense_limit_bytes()
        if need > limit:
            return [
                f"would materialize {need / 2**20:.0f} MiB of scores (> {DENSE_LIMIT_ENV}="
                f"{limit / 2**20:.0f} MiB); use a GPU route or shorter sequences"
            ]
        return []

    def run(self, q, k, v, p, *, scale, block_mask=None):  # type: ignore[no-untyped-def]
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        qc, kc, vc = q.to(compute), k.to(compute), v.to(compute)
        if p.gqa:
            # expand + reshape (not repeat_interleave): the backward is a plain sum over the
            # group dim, reproducible on every device.
            kc, vc = _repeat_heads(kc, p.heads), _repeat_heads(vc, p.heads)
        scores = torch.matmul(qc, kc.transpose(-1, -2)) * scale
        b, h, qi, kj = _grids(p, q.device)
        if p.score is not None:
            scores = torch.broadcast_to(p.score.to(q.device).score_mod()(scores, b, h, qi, kj), scores.shape)
        if p.mask is not None:
            visible = torch.broadcast_to(p.mask.to(q.device).mask_mod()(b, h, qi, kj), scores.shape)
            scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        empty = torch.isneginf(lse)
        probs = torch.exp(scores - lse.masked_fill(empty, 0.0)).masked_fill(empty, 0.0)
        out = torch.matmul(probs, vc).to(q.dtype)
        return out, (lse.squeeze(-1).float() if p.return_lse else None)


DENSE = DenseBackend(
    name="dense",
    devices=frozenset({"cpu", "cuda"}),
    dtypes=FLOATS,
    score_mods=True,
    lse=True,
    env_vars=(DENSE_LIMIT_ENV,),
    decode=True,
    doc="eager dense attention with autograd (materializes Lq x Lkv; memory-guarded)",
)
