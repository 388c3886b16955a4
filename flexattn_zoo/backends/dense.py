"""``dense``: eager attention over a materialized Lq x Lkv score matrix, with autograd.

The only exact training route where flex has no backward (CPU), also for a user ``BlockMask``
(``block_mask_visible``: its full blocks, and its ``mask_mod`` in its partial blocks). It
evaluates the spec's ``mask_mod``/``score_mod`` on broadcast index grids (not the test oracle
``.dense``, so tests stay independent; a raw callable written for flex's scalar indices is
evaluated as flex does, see :mod:`flexattn_zoo.functions`) and computes in float32 (float64 for
float64 inputs). A memory guard refuses problems whose scores would exceed
``FLEXATTN_ZOO_DENSE_LIMIT_MB`` (default 1024 MiB).

Dropout (``dropout_p > 0``) zeroes attention probabilities by the keep-mask of
:func:`dropout_keep_mask` and scales the kept ones by ``1 / (1 - dropout_p)``; the lse stays that of
the undropped scores (SDPA's convention: dropout acts after the softmax).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from flexattn_zoo import _compat
from flexattn_zoo.backends.base import FLOATS, Backend, lse_in_api_dtype
from flexattn_zoo.functions import check_mask_function, evaluate_as_flex
from flexattn_zoo.problem import Problem
from flexattn_zoo.validation import env_number

DENSE_LIMIT_ENV = "FLEXATTN_ZOO_DENSE_LIMIT_MB"
DEFAULT_DENSE_LIMIT_MB = 1024


def dense_limit_bytes() -> float:
    """The memory guard in bytes (``math.inf`` for ``FLEXATTN_ZOO_DENSE_LIMIT_MB=inf``: no limit)."""
    return env_number(DENSE_LIMIT_ENV, DEFAULT_DENSE_LIMIT_MB, unit="MiB") * 2**20


def dense_bytes(p: Problem) -> int:
    """Peak bytes of the score tensors this route keeps (scores, probabilities, their grads)."""
    elem = 8 if p.dtype == torch.float64 else 4
    copies = 4 if p.requires_grad else 2
    if p.dropout_p > 0:
        copies += 1  # the uniform draw (float32) and the keep-mask, at most one score tensor more
    return p.batch * p.heads * p.q_len * p.kv_len * elem * copies


def dropout_keep_mask(shape: torch.Size, dropout_p: float, device: torch.device) -> torch.Tensor:
    """The dense route's dropout keep-mask for probabilities of ``shape`` ``[B, H, Lq, Lkv]``: bool,
    True where kept, drawn as ``torch.rand(shape, device=device) >= dropout_p`` (float32) from
    torch's default generator of ``device`` -- one draw per call, nothing else drawn.

    That draw is the route's documented convention rather than a hook: a test (or a user who
    wants the mask) seeds the generator (``torch.manual_seed``), calls the route, seeds it again
    and draws the same ``torch.rand`` itself (tests/unit/test_dropout.py), so no mask is kept or
    returned by the route. Every entry is kept with probability ``1 - dropout_p`` (up to
    float32's resolution of the uniform draw)."""
    return torch.rand(shape, device=device, dtype=torch.float32) >= dropout_p


def _grids(p: Problem, device: torch.device) -> tuple[torch.Tensor, ...]:
    b = torch.arange(p.batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(p.heads, device=device).view(1, -1, 1, 1)
    qi = torch.arange(p.q_len, device=device).view(1, 1, -1, 1)
    kj = torch.arange(p.kv_len, device=device).view(1, 1, 1, -1)
    return b, h, qi, kj


def _listed_blocks(num: torch.Tensor, idx: torch.Tensor, n_kv: int) -> torch.Tensor:
    """``[B|1, H|1, n_q, n_kv]`` bool: the kv blocks listed in ``idx[..., :num]`` per query block."""
    listed = torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1)
    cols = torch.where(listed, idx.long().clamp(0, n_kv - 1), torch.full_like(idx, n_kv, dtype=torch.long))
    out = torch.zeros(*idx.shape[:-1], n_kv + 1, dtype=torch.bool, device=idx.device)
    return out.scatter_(-1, cols, True)[..., :n_kv]


def block_mask_visible(bm: Any, p: Problem, device: torch.device) -> torch.Tensor:
    """``[B|1, H|1, Lq, Lkv]`` bool: what flex sees through a user BlockMask ``bm`` -- every position
    of its full blocks, and the positions of its partial blocks where ``bm.mask_mod`` is True
    (flex never calls ``mask_mod`` in full blocks nor looks at unlisted ones)."""
    qb, kvb = bm.BLOCK_SIZE
    n_kv = -(-p.kv_len // kvb)

    def positions(num: torch.Tensor | None, idx: torch.Tensor | None) -> torch.Tensor | None:
        if num is None or idx is None:
            return None
        blocks = _listed_blocks(num.to(device), idx.to(device), max(n_kv, idx.shape[-1]))[..., :n_kv]
        blocks = blocks.repeat_interleave(qb, dim=-2)[..., : p.q_len, :]
        return blocks.repeat_interleave(kvb, dim=-1)[..., : p.kv_len]

    partial = positions(bm.kv_num_blocks, bm.kv_indices)
    full = positions(bm.full_kv_num_blocks, bm.full_kv_indices)
    assert partial is not None
    b, h, qi, kj = _grids(p, device)
    # The probe every raw callable gets decides how to evaluate it: a mod written for flex's 0-d
    # indices may fail on broadcast grids, or run there and compute something else (a reduction
    # then sums over the whole grid).
    if _compat.is_compiling():
        # Traced: evaluate it as flex does (exact for any mask_mod flex takes); the probe walks
        # the callable's Python objects, which Dynamo cannot trace.
        scalar = True
    else:
        try:
            scalar = check_mask_function(bm.mask_mod, "the BlockMask's mask_mod").scalar
        except TypeError as exc:
            raise ValueError(str(exc)) from exc
    grids = (b, h, qi, kj)
    mod = (
        evaluate_as_flex(bm.mask_mod, grids)
        if scalar
        else torch.as_tensor(bm.mask_mod(*grids), device=device)
    )
    visible = partial & mod.bool()
    return visible if full is None else visible | full


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """kv head ``g`` serves q heads ``g * group .. (g + 1) * group - 1`` (SDPA's grouping)."""
    b, hkv, length, d = t.shape
    return t[:, :, None].expand(b, hkv, heads // hkv, length, d).reshape(b, heads, length, d)


@dataclasses.dataclass(frozen=True)
class DenseBackend(Backend):
    def mask_reasons(self, p: Problem) -> list[str]:
        # A user BlockMask is served exactly too (``block_mask_visible``), within the same guard.
        need, limit = dense_bytes(p), dense_limit_bytes()
        if need > limit:
            return [
                f"would materialize {need / 2**20:.0f} MiB of scores (> {DENSE_LIMIT_ENV}="
                f"{limit / 2**20:.0f} MiB); use a GPU route or shorter sequences"
            ]
        return []

    def run(self, q, k, v, p, *, scale, block_mask=None):
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
            # -inf scores (score_mods.Bias) hide their key like the mask: no gradient through them,
            # or a row of only -inf would get NaN gradients from logsumexp.
            scores = scores.masked_fill(torch.isneginf(scores), float("-inf"))
        if p.mask is not None:
            visible = torch.broadcast_to(p.mask.to(q.device).mask_mod()(b, h, qi, kj), scores.shape)
            scores = scores.masked_fill(~visible, float("-inf"))
        elif block_mask is not None:
            visible = torch.broadcast_to(block_mask_visible(block_mask, p, q.device), scores.shape)
            scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        empty = torch.isneginf(lse)
        probs = torch.exp(scores - lse.masked_fill(empty, 0.0)).masked_fill(empty, 0.0)
        if p.dropout_p > 0:
            # A multiply (not masked_fill), so gradients reach kept entries scaled as SDPA's do.
            keep = dropout_keep_mask(probs.shape, p.dropout_p, q.device)
            probs = probs * keep.to(probs.dtype) * (1.0 / (1.0 - p.dropout_p))
        out = torch.matmul(probs, vc).to(q.dtype)
        if not p.return_lse:
            return out, None
        return out, lse_in_api_dtype(lse.squeeze(-1), q.dtype)


DENSE = DenseBackend(
    name="dense",
    dropout_devices=frozenset({"cpu", "cuda"}),
    devices=frozenset({"cpu", "cuda"}),
    dtypes=FLOATS,
    score_mods=True,
    lse=True,
    env_vars=(DENSE_LIMIT_ENV,),
    decode=True,
    rocm=True,
    materializes=True,
    value_dims=True,
    doc="eager dense attention with autograd (materializes Lq x Lkv; memory-guarded)",
)
