"""``fz.attention`` / ``fz.plan``: pick the fastest exact route and run it.

Every backend is asked for its reasons to refuse the problem; ``backend="auto"`` takes the first
route of the measured per-generation priority (``arch.priority``) that has none. A named backend
never falls back: it runs, or raises ``ValueError`` with its reasons.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch

from flexattn_zoo import _compat
from flexattn_zoo.arch import detect_arch, generation, priority
from flexattn_zoo.backends import BACKENDS, BY_NAME
from flexattn_zoo.custom import as_mask_spec, as_score_spec
from flexattn_zoo.problem import Problem
from flexattn_zoo.validation import check_qkv

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One route's verdict: accepted, or the reasons it refused; ``rank`` in the priority list."""

    name: str
    accepted: bool
    reasons: tuple[str, ...]
    rank: int | None


@dataclasses.dataclass(frozen=True)
class Plan:
    """The chosen route and every candidate's verdict. Runs nothing."""

    backend: str
    requested: str
    problem: Problem
    candidates: tuple[Candidate, ...]

    def explain(self) -> str:
        p = self.problem
        mask = type(p.mask).__name__ if p.mask is not None else ("BlockMask" if p.user_block_mask else "none")
        score = type(p.score).__name__ if p.score is not None else "none"
        lines = [
            f"route: {self.backend} (requested {self.requested!r}; arch {p.arch}, mode {p.mode})",
            f"problem: B={p.batch} H={p.heads}/{p.kv_heads} Lq={p.q_len} Lkv={p.kv_len} D={p.head_dim} "
            f"{str(p.dtype).removeprefix('torch.')} on {p.device_type}; mask={mask} score_mod={score}",
        ]
        for c in self.candidates:
            rank = f"#{c.rank + 1}" if c.rank is not None else "--"
            if c.name == self.backend:
                verdict = "CHOSEN"
            elif c.accepted:
                verdict = "ok (lower priority)" if c.rank is not None else "ok (only when requested)"
            else:
                verdict = "no: " + "; ".join(c.reasons)
            lines.append(f"  {rank:>3} {c.name:<15} {verdict}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()


def _verdicts(problem: Problem) -> list[Candidate]:
    order = priority(problem.arch, problem.mode, problem.head_dim)
    out = []
    for b in BACKENDS:
        reasons = b.reasons(problem)
        rank = order.index(b.name) if b.name in order else None
        if rank is None and not reasons:
            reasons_t: tuple[str, ...] = ()
        else:
            reasons_t = tuple(reasons)
        out.append(Candidate(b.name, not reasons, reasons_t, rank))
    return out


def plan_problem(problem: Problem, backend: str = "auto") -> Plan:
    """Choose a route for ``problem`` (see :class:`Problem`); ``ValueError`` if none can run it."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    if backend != "auto" and backend not in BY_NAME:
        raise ValueError(f"unknown backend {backend!r}; valid: auto, {', '.join(BY_NAME)}")
    cands = _verdicts(problem)
    by_name = {c.name: c for c in cands}
    if backend != "auto":
        chosen = by_name[backend]
        if not chosen.accepted:
            raise ValueError(f"backend {backend!r} cannot run this call: {'; '.join(chosen.reasons)}")
        return Plan(backend, backend, problem, tuple(cands))
    ranked = sorted((c for c in cands if c.rank is not None), key=lambda c: c.rank)  # type: ignore[arg-type, return-value]
    for c in ranked:
        if c.accepted:
            return Plan(c.name, "auto", problem, tuple(cands))
    detail = "; ".join(f"{c.name}: {', '.join(c.reasons)}" for c in ranked)
    raise ValueError(
        f"no route in the {generation(problem.arch)} priority list can run this call exactly ({detail}). "
        "Name a backend explicitly (e.g. backend='dense' for small problems) or change the inputs."
    )


def _check_user_block_mask(bm: Any, batch: int, heads: int, q_len: int, kv_len: int, device: torch.device) -> None:
    if tuple(bm.seq_lengths) != (q_len, kv_len):
        raise ValueError(f"mask BlockMask was built for lengths {tuple(bm.seq_lengths)}, but Lq, Lkv = {q_len}, {kv_len}")
    bb, bh = bm.kv_num_blocks.shape[:2]
    if bb not in (1, batch) or bh not in (1, heads):
        raise ValueError(f"mask BlockMask has batch/heads {bb}/{bh}; need 1 or {batch} and 1 or {heads}")
    if bm.kv_num_blocks.device != device:
        raise ValueError(f"mask BlockMask is on {bm.kv_num_blocks.device} but q is on {device}")


def _problem(q, k, v, mask, score_mod, enable_gqa, return_lse) -> tuple[Problem, Any]:  # type: ignore[no-untyped-def]
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    shape = check_qkv(q, k, v, enable_gqa=enable_gqa)
    user_bm = mask if isinstance(mask, _compat.BlockMask) else None
    mask_spec = None if user_bm is not None else as_mask_spec(mask)
    score_spec = as_score_spec(score_mod)
    if user_bm is not None:
        _check_user_block_mask(user_bm, shape.batch, shape.heads, shape.q_len, shape.kv_len, q.device)
    for spec in (mask_spec, score_spec):
        if spec is not None:
            spec.validate(shape.q_len, shape.kv_len, shape.batch, shape.heads)
    requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if score_spec is not None and torch.is_grad_enabled() and score_spec.captures_grad_tensors():
        requires_grad = True
    problem = Problem(
        batch=shape.batch, heads=shape.heads, kv_heads=shape.kv_heads, q_len=shape.q_len,
        kv_len=shape.kv_len, head_dim=shape.head_dim, v_dim=shape.v_dim, dtype=q.dtype,
        device_type=q.device.type, arch=detect_arch(q.device), requires_grad=requires_grad,
        mask=mask_spec, score=score_spec, return_lse=return_lse, user_block_mask=user_bm is not None,
    )  # fmt: skip
    return problem, user_bm


def plan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: Any = None, score_mod: Any = None,
    scale: float | None = None, enable_gqa: bool = False, backend: str = "auto", return_lse: bool = False,
) -> Plan:  # fmt: skip
    """Which route ``attention`` would take with these arguments, and why. Runs nothing."""
    _check_scale(scale)
    problem, _ = _problem(q, k, v, mask, score_mod, enable_gqa, return_lse)
    return plan_problem(problem, backend)


def _check_scale(scale: Any) -> None:
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
    ):
        raise ValueError(f"scale must be None or a finite number, got {scale!r}")


def _empty_result(q, k, v, p: Problem):  # type: ignore[no-untyped-def]
    """Lq == 0 or Lkv == 0: output zeros (lse -inf), still connected to the inputs' graph."""
    link = (q.narrow(2, 0, 0).sum() + k.narrow(2, 0, 0).sum() + v.narrow(2, 0, 0).sum()) * 0
    out = q.new_zeros(p.batch, p.heads, p.q_len, p.v_dim) + link
    lse = torch.full((p.batch, p.heads, p.q_len), float("-inf"), device=q.device)
    return out, lse


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: Any = None, score_mod: Any = None,
    scale: float | None = None, enable_gqa: bool = False, backend: str = "auto", return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Attention of ``q, k, v`` (layout ``[B, H, L, D]``) on the fastest exact route.

    Args:
        mask: a mask spec, registry name, ``mask_mod`` callable or a ``BlockMask``.
        score_mod: a score spec, registry name or ``score_mod`` callable (sees the scaled score).
        scale: defaults to ``1/sqrt(D)``.
        enable_gqa: allow fewer k/v heads than q heads (q head h reads kv head h // group).
        backend: ``"auto"`` or a route name (see ``fz.plan(...).explain()``); a named route never
            falls back, it raises ``ValueError`` with its reasons.
        return_lse: also return the natural-log log-sum-exp ``[B, H, Lq]`` (float32).

    Returns:
        ``out`` with q's dtype, or ``(out, lse)``. Rows that see no key give 0 and lse -inf.
    """
    _check_scale(scale)
    problem, user_bm = _problem(q, k, v, mask, score_mod, enable_gqa, return_lse)
    if problem.q_len == 0 or problem.kv_len == 0:
        if backend != "auto" and backend not in BY_NAME:
            raise ValueError(f"unknown backend {backend!r}; valid: auto, {', '.join(BY_NAME)}")
        out, lse = _empty_result(q, k, v, problem)
        return (out, lse) if return_lse else out
    chosen = plan_problem(problem, backend)
    log.debug("flexattn_zoo route %s", chosen.backend)
    scale_f = 1.0 / math.sqrt(problem.head_dim) if scale is None else float(scale)
    out, lse = BY_NAME[chosen.backend].run(q, k, v, problem, scale=scale_f, block_mask=user_bm)
    return (out, lse) if return_lse else out
