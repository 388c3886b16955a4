"""``fa4``: the FlashAttention-4 CuTe kernels called directly (``flash_attn.cute``), not through flex.

FA4's own kernels know causal and sliding windows (``window_size``), packed documents
(``cu_seqlens``) and soft-capping natively, so they skip the BlockMask and the compiled
``mask_mod`` / ``score_mod`` that ``flex_flash`` evaluates per element. Exact for masks whose
``varlen_form()`` exists (segments + a window inside each), like the ``varlen`` route:

* one segment per row (no mask, causal, sliding window): one batched call, no copy;
* equal segments (``Chunked``): the rows are viewed as a larger batch of chunks (no copy when the
  tensors' layout allows the view, else a reshape copy);
* unequal segments (documents): q/k/v are packed to ``[tokens, H, D]`` with ``cu_seqlens``.

Score mods: only a soft-cap form with ``approx=True`` (``SoftCap(approx=True)``). FA4's soft-capping
evaluates ``tanh`` with the hardware approximation (``tanh.approx.f32``), which is what
``approx=True`` allows and nothing else does.
FA4's lse is the natural-log log-sum-exp, ``[B, H, Lq]`` for batched calls (``[H, tokens]`` packed).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from flexattn_zoo import _compat
from flexattn_zoo.backends.base import FLASH_CUTE, LOW_PRECISION, Backend, flash_cute_lock
from flexattn_zoo.backends.varlen import cu_seqlens
from flexattn_zoo.problem import Problem
from flexattn_zoo.segments import segment_layout


def fa4_window(window: tuple[int, int]) -> tuple[int | None, int | None]:
    """A ``VarlenForm`` window (``-1`` = unbounded) as FA4's ``window_size`` (``None`` = unbounded).

    FA4 reads ``(None, 0)`` as causal and ``(None, None)`` as no mask; key ``j`` of query ``i`` is
    visible when ``i - left <= j <= i + right`` (the same diagonal as ours since Lq == Lkv).
    """
    left, right = window
    return (None if left < 0 else left, None if right < 0 else right)


def _softcap(p: Problem) -> float:
    if p.score is None:
        return 0.0
    form = p.score.softcap_form()
    assert form is not None  # mask_reasons refused score mods without one
    return form.cap


@dataclasses.dataclass(frozen=True)
class FlashAttn4Backend(Backend):
    def mask_reasons(self, p: Problem) -> list[str]:
        out = []
        if _compat.is_compiling():
            out.append(
                "FA4's kernels are not a torch op Dynamo can trace: not inside a torch.compile'd graph"
            )
        form = p.score.softcap_form() if p.score is not None else None
        if p.score is not None and not (form is not None and form.approx):
            out.append(
                f"score_mod {type(p.score).__name__}: FA4's own kernels only soft-cap, with a hardware "
                "tanh approximation (SoftCap(cap, approx=True))"
            )
        if p.user_block_mask:
            out.append("takes no BlockMask")
        elif p.mask is not None and p.q_len != p.kv_len:
            out.append("needs Lq == Lkv when a mask is given")
        elif segment_layout(p.mask, p.batch, p.q_len) is None:
            out.append(f"mask {type(p.mask).__name__} has no exact FA4 form (segments + window)")
        return out

    def run(self, q, k, v, p, *, scale, block_mask=None):
        with flash_cute_lock():
            return self._run(q, k, v, p, scale=scale)

    def _run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: Problem, *, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

        b, h, lq, d = q.shape
        layout = segment_layout(p.mask, b, lq)
        assert layout is not None  # mask_reasons refused masks without one
        kind, chunk, window = layout
        common: dict[str, Any] = dict(
            softmax_scale=scale,
            causal=False,
            window_size=fa4_window(window),
            softcap=_softcap(p),
            return_lse=p.return_lse,
        )
        # FA4 takes [batch, seq, heads, dim]; ours are [B, H, L, D] views of either layout.
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        if kind == "packed":
            cu, max_len, _ = cu_seqlens(p.mask, b, lq, str(q.device))
            packed = [t.reshape(b * lq, t.shape[2], d) for t in (qt, kt, vt)]
            res = flash_attn_varlen_func(
                *packed,
                cu_seqlens_q=cu,
                cu_seqlens_k=cu,
                max_seqlen_q=max_len,
                max_seqlen_k=max_len,
                **common,
            )
            out, lse = _split(res)
            out = out.view(b, lq, h, d).transpose(1, 2)
            lse = None if lse is None else lse.view(h, b, lq).transpose(0, 1)
            return out, lse
        n = lq // chunk if kind == "chunks" else 1
        batched = [t.reshape(b * n, lq // n, t.shape[2], d) for t in (qt, kt, vt)] if n > 1 else [qt, kt, vt]
        out, lse = _split(flash_attn_func(*batched, **common))
        out = out.reshape(b, lq, h, d).transpose(1, 2)
        if lse is not None and n > 1:  # [B*n, H, c] -> [B, H, n*c]
            lse = lse.view(b, n, h, lq // n).permute(0, 2, 1, 3).reshape(b, h, lq)
        return out, lse


def _split(res: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FA4 returns ``(out, lse)`` (lse may be None when not asked for) or just ``out``."""
    if isinstance(res, tuple):
        return res[0], (res[1] if len(res) > 1 else None)
    return res, None


FA4 = FlashAttn4Backend(
    name="fa4",
    devices=frozenset({"cuda"}),
    dtypes=LOW_PRECISION,
    head_dims=(64, 128),
    head_dim_multiple=32,
    min_cc=(9, 0),
    max_cc=(10, 9),
    score_mods=True,
    lse=True,
    requires=(FLASH_CUTE,),
    deterministic=False,
    nondeterministic_why="FA4's backward accumulates dQ with atomics (its deterministic mode is not validated here)",
    doc="FlashAttention-4 CuTe kernels called directly: causal/windows/documents/chunks, SoftCap(approx=True)",
)
