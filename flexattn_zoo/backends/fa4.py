"""``fa4``: the FlashAttention-4 CuTe kernels called directly (``flash_attn.cute``), not through flex.

FA4's own kernels know causal and sliding windows (``window_size``), packed documents
(``cu_seqlens``) and soft-capping natively, so they skip the BlockMask and the compiled
``mask_mod`` / ``score_mod`` that ``flex_flash`` evaluates per element. Exact for masks whose
``varlen_form()`` exists (segments + a window inside each), like the ``varlen`` route, and for
those with a ``strided_form()`` whose stride divides the length:

* one segment per row (no mask, causal, sliding window): one batched call, no copy;
* equal segments (``Chunked``): the rows are viewed as a larger batch of chunks (no copy when the
  tensors' layout allows the view, else a reshape copy);
* unequal segments (documents): q/k/v are packed to ``[tokens, H, D]`` with ``cu_seqlens``;
* a window inside residue classes of positions (``StridedForm``: dilated windows, ``L`` a multiple
  of the stride): ``[B, L, H, D]`` is viewed as ``[B, L / stride, stride * H, D]``, each class
  its own heads (no copy for that layout, else a reshape copy), and the result viewed back.
* a window plus global tokens (``GlobalTokensForm``: Longformer-style, eager calls): the windowed
  kernel over every row; the global keys outside each row's window and the global rows (which
  see every key) scored densely in one compiled function and merged in by log-sum-exp
  (:mod:`flexattn_zoo.backends.global_tokens`).

Score mods: only a soft-cap form with ``approx=True`` (``SoftCap(approx=True)``). FA4's soft-capping
evaluates ``tanh`` with the hardware approximation (``tanh.approx.f32``), which is what
``approx=True`` allows and nothing else does.
FA4's lse is the natural-log log-sum-exp, ``[B, H, Lq]`` for batched calls (``[H, tokens]`` packed).

Head dims: per GPU generation, the q/k head dims the kernels matched the float64 reference at,
and a value head dim of its own only for the pairs in :data:`VALUE_DIM_PAIRS` (DeepSeek-style q/k
192 with v 128 on sm90: forward with any heads, backward without grouped-query attention, where
FA4's backward asserts equal head dims).

The kernels are called through the torch ops of :mod:`flexattn_zoo.backends.fa4_op`
(``flexattn_zoo::fa4_fwd`` / ``fa4_bwd``), with fake implementations and an autograd formula, so
the route also runs inside a caller's ``torch.compile`` graph and in ``torch.export`` ed programs
(rows and chunks; packed documents need ``cu_seqlens`` read from the mask's data, so a traced
call refuses them). Gradients flow through both the output and the lse. Plain eager calls run
the same implementations and formula without the ops' dispatch (less host time per call). On
both paths FA4's Python launcher runs on a kind of call's first two calls (the second records
it); later calls replay the recorded launch (:mod:`flexattn_zoo.backends.fa4_replay`).
"""

from __future__ import annotations

import dataclasses

import torch

from flexattn_zoo import _compat
from flexattn_zoo.arch import generation
from flexattn_zoo.backends.base import FLASH_CUTE, IN_GRAPH, LOW_PRECISION, Backend, BoundCall
from flexattn_zoo.backends.fa4_op import (
    fa4_attention,
    fa4_bwd_eager,
    fa4_fwd_eager,
    fa4_lse_backward,
    fa4_window,
    plain_eager,
)
from flexattn_zoo.backends.global_tokens import WindowKernels, global_tokens_attention
from flexattn_zoo.backends.varlen import cu_seqlens
from flexattn_zoo.problem import Problem
from flexattn_zoo.segments import (
    fold_strided,
    fold_too_wide,
    segment_layout,
    unfold_strided,
    unfold_strided_lse,
)
from flexattn_zoo.spec import GLOBAL_FORM_MAX_TOKENS, GlobalTokensForm


def _softcap(p: Problem) -> float:
    if p.score is None:
        return 0.0
    form = p.score.softcap_form()
    assert form is not None  # mask_reasons refused score mods without one
    return form.cap


#: ``(q/k head dim, value head dim)`` pairs with ``Dv != Dqk`` the route runs, per GPU generation.
VALUE_DIM_PAIRS: dict[str, frozenset[tuple[int, int]]] = {"sm90": frozenset({(192, 128)})}


@dataclasses.dataclass(frozen=True)
class FlashAttn4Backend(Backend):
    def reasons(self, p: Problem) -> list[str]:
        out = super().reasons(p)
        if p.v_dim is not None and p.v_dim != p.head_dim and p.device_type == "cuda":
            gen = generation(p.arch)
            pairs = VALUE_DIM_PAIRS.get(gen, frozenset())
            if (p.head_dim, p.v_dim) not in pairs:
                listed = ", ".join(f"{a}/{b}" for a, b in sorted(pairs)) or "none"
                out.append(
                    f"q/k head dim {p.head_dim} with value head dim {p.v_dim}: on {gen} the kernels run {listed}"
                )
            elif p.requires_grad and p.gqa:
                out.append(
                    "FA4's backward with fewer k/v heads than q heads needs the value head dim equal to q/k's"
                )
        return out

    def func_transform_blocker(self, p: Problem) -> str | None:
        if p.mask is None or segment_layout(p.mask, p.batch, p.q_len) is not None:
            return None
        if _global_tokens_form(p) is None:
            return None
        return "a window plus global tokens as an autograd.Function around FA4's kernels"

    def mask_reasons(self, p: Problem) -> list[str]:
        out = []
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
        else:
            layout = segment_layout(p.mask, p.batch, p.q_len)
            if layout is None:
                if _global_tokens_form(p) is None:  # eager calls only: its positions are data
                    out.append(
                        f"mask {type(p.mask).__name__} has no exact FA4 form (segments + window, a "
                        "window in residue classes of a stride that divides the length, or a window "
                        f"plus up to {GLOBAL_FORM_MAX_TOKENS} global tokens shared by every row)"
                    )
            elif layout[0] == "strided" and (too_wide := fold_too_wide(layout[1], p.heads, p.device_type)):
                out.append(too_wide)
            elif layout[0] == "packed" and _compat.is_compiling():
                # cu_seqlens and max_seqlen are read from the segments (data-dependent shapes).
                out.append(f"unequal segments need cu_seqlens built from the mask's data: not {IN_GRAPH}")
        return out

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        p: Problem,
        *,
        scale: float,
        block_mask: object = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return _launcher(p, q.shape[0], q.shape[2])(q, k, v, scale)

    def bound_run(self, p: Problem, device: torch.device) -> BoundCall:
        """:meth:`run` for ``p`` with its segment layout, window and soft-cap worked out once (a
        plan-cache hit runs only the views, the kernel and the result's views)."""
        return _launcher(p, p.batch, p.q_len)


#: What a launch returns: ``out`` and, when the problem asks for it, the lse.
Launched = tuple[torch.Tensor, torch.Tensor | None]


def _launcher(p: Problem, batch: int, length: int) -> BoundCall:
    """The call of ``p`` (``batch`` rows of ``length`` queries) as a function of ``(q, k, v, scale)``;
    sizes are read from the tensors at each call (symbolic ones too, while traced)."""
    layout = segment_layout(p.mask, batch, length)
    if layout is None:
        return _global_tokens_launcher(p, length)
    kind, chunk, window = layout
    softcap = _softcap(p)
    return_lse = p.return_lse

    def packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Launched:
        b, h, lq = q.shape[0], q.shape[1], q.shape[2]
        seqs = cu_seqlens(p.mask, b, lq, lq, str(q.device))
        # FA4 takes [tokens, heads, dim]; ours are [B, H, L, D] views of either layout.
        qt, kt, vt = (t.transpose(1, 2).reshape(b * lq, t.shape[1], t.shape[3]) for t in (q, k, v))
        out, lse = fa4_attention(
            qt, kt, vt, scale=scale, softcap=softcap, window=window, cu_seqlens=seqs.cu_q,
            max_seqlen=seqs.max_q,
        )  # fmt: skip
        out = out.view(b, lq, h, out.shape[-1]).transpose(1, 2)
        return out, (lse.view(h, b, lq).transpose(0, 1) if return_lse else None)

    def batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Launched:
        b, h, lq = q.shape[0], q.shape[1], q.shape[2]
        # FA4 takes [batch, seq, heads, dim]; ours are [B, H, L, D] views of either layout.
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        n = lq // chunk if kind == "chunks" else 1
        if n > 1:  # each chunk its own batch row
            qt, kt, vt = (t.reshape(b * n, lq // n, t.shape[2], t.shape[3]) for t in (qt, kt, vt))
        out, lse = fa4_attention(qt, kt, vt, scale=scale, softcap=softcap, window=window)
        if n > 1:
            out = out.reshape(b, lq, h, out.shape[-1])
        out = out.transpose(1, 2)
        if not return_lse:
            return out, None
        if n > 1:  # [B*n, H, c] -> [B, H, n*c]
            lse = lse.view(b, n, h, lq // n).permute(0, 2, 1, 3).reshape(b, h, lq)
        return out, lse

    def strided(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Launched:
        h = q.shape[1]
        # [B, H, L, D] views -> FA4's [B, L, H, D] -> each residue class mod the stride its own heads.
        qt, kt, vt = (fold_strided(t.transpose(1, 2), chunk) for t in (q, k, v))
        out, lse = fa4_attention(qt, kt, vt, scale=scale, softcap=softcap, window=window)
        out = unfold_strided(out, h).transpose(1, 2)
        return out, (unfold_strided_lse(lse, h) if return_lse else None)

    return {"packed": packed, "strided": strided}.get(kind, batched)


def _global_tokens_form(p: Problem) -> GlobalTokensForm | None:
    """The mask's global-tokens form for ``p`` (None while traced: the positions are data)."""
    if p.mask is None or p.q_len != p.kv_len or _compat.is_compiling():
        return None
    return p.mask.global_tokens_form(p.q_len, p.kv_len)


def _global_tokens_launcher(p: Problem, length: int) -> BoundCall:
    """A window plus global tokens: FA4's windowed kernel over every row; the global keys outside
    each row's window and the global rows (past a size limit, FA4 unmasked on those rows) in one
    compiled function, merged in by lse
    (:func:`~flexattn_zoo.backends.global_tokens.global_tokens_attention`)."""
    form = p.mask.global_tokens_form(length, length) if p.mask is not None else None
    assert form is not None  # mask_reasons refused masks without a form
    softcap = _softcap(p)
    return_lse = p.return_lse
    on_device: dict[torch.device, GlobalTokensForm] = {}  # the positions where q lives

    def global_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Launched:
        if not plain_eager(q, k, v):
            # It calls FA4's kernels directly, beside a Function of its own: no op for a graph,
            # a mode or a tensor subclass to see.
            raise RuntimeError(
                "fa4 runs a window plus global tokens only in plain eager calls (no tensor "
                "subclass, torch function or dispatch mode, functorch transform or tracing); "
                "flex and flex_flash run it there"
            )
        here = on_device.get(q.device)
        if here is None:
            here = on_device[q.device] = dataclasses.replace(form, positions=form.positions.to(q.device))
        kernels = _window_kernels(scale, softcap)
        out, lse = global_tokens_attention(q, k, v, here, scale, kernels, softcap=softcap, compiled=q.is_cuda)
        return out, (lse if return_lse else None)

    return global_tokens


def _window_kernels(scale: float, softcap: float) -> WindowKernels:
    """FA4's forward and backward on ``[B, H, L, D]`` views (FA4 takes ``[B, L, H, D]``)."""

    def forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: tuple[int, int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = fa4_fwd_eager(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, 0, scale, softcap, *window
        )
        return out.transpose(1, 2), lse

    def backward(
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        window: tuple[int, int],
        g_lse: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qt, kt, vt, ot, gt = (t.transpose(1, 2) for t in (q, k, v, out, dout))
        rest = (None, 0, scale, softcap, *window)
        dq, dk, dv = fa4_bwd_eager(gt, qt, kt, vt, ot, lse.contiguous(), *rest)
        if g_lse is not None:  # one more backward call: the gradient of sum(g_lse * lse)
            lq, lk = fa4_lse_backward(g_lse, qt, kt, vt, ot, lse.contiguous(), rest, fa4_bwd_eager)
            dq, dk = dq + lq, dk + lk
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    return WindowKernels(forward, backward)


__all__ = ["FA4", "VALUE_DIM_PAIRS", "FlashAttn4Backend", "fa4_window"]


FA4 = FlashAttn4Backend(
    name="fa4",
    devices=frozenset({"cuda"}),
    dtypes=LOW_PRECISION,
    head_dims=(64, 256),
    # Where this route matched the float64 reference forward and backward, GQA included (sm90:
    # flash-attn-4 4.0.0b36, causal and window + soft-cap; 80 runs in FA4 but failed that check);
    # on sm100 the head dims it has run so far.
    head_dims_by_generation=(
        ("sm90", frozenset({64, 96, 128, 192, 256})),
        ("sm100", frozenset({64, 96, 128})),
    ),
    min_cc=(9, 0),
    max_cc=(10, 9),
    value_dims=True,  # only the pairs of VALUE_DIM_PAIRS (FlashAttn4Backend.reasons)
    score_mods=True,
    lse=True,
    requires=(FLASH_CUTE,),
    deterministic=False,
    nondeterministic_why="FA4's backward accumulates dQ with atomics (its deterministic mode is not validated here)",
    doc="FlashAttention-4 CuTe kernels called directly: causal/windows/documents/chunks/dilated windows, "
    "SoftCap(approx=True)",
)
