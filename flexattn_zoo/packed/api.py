"""``fz.varlen_attention``: FlashAttention's ``flash_attn_varlen_func`` call on ``fz.attention``.

Packed ``[T, H, D]`` inputs are viewed as one ``[1, H, T, D]`` call whose mask keeps every query
inside its own sequence (:mod:`flexattn_zoo.packed.specs`), so every route of ``fz.attention``
that is exact for that mask can serve it: with equal query and key offsets and a mask that is the
same at every position (none, causal, a window), the mask is a ``masks.Document`` and keeps its
varlen form (the ``varlen`` and FA4 routes on GPUs); otherwise the flex routes and the dense one.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Any, Literal, overload

import torch

from flexattn_zoo import _compat
from flexattn_zoo.coercion import as_mask_spec, as_score_spec, tensor_args
from flexattn_zoo.dispatch import attention
from flexattn_zoo.masks import Band, Causal, Document, Full, SlidingWindow
from flexattn_zoo.packed.specs import PackedScore, PackedSequences, _rows
from flexattn_zoo.spec import MaskSpec, ScoreSpec, keeps_function_of
from flexattn_zoo.validation import check_flag, check_integer, check_strided

#: Masks that give the same answer for a pair wherever the pair sits (they read only ``j - i``):
#: in packed coordinates they mean what they mean locally when every sequence has Lq_i == Lk_i.
#: A subclass that replaces the function is not (``_shift_invariant``).
_SHIFT_INVARIANT = (Full, Causal, SlidingWindow, Band)


def _shift_invariant(mask: MaskSpec) -> bool:
    return any(keeps_function_of(mask, cls) for cls in _SHIFT_INVARIANT)


_CU_DTYPES = (torch.int32, torch.int64)


@overload
def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    mask: Any = ...,
    score_mod: Any = ...,
    causal: bool = ...,
    window_size: Sequence[int] = ...,
    scale: float | None = ...,
    enable_gqa: bool = ...,
    backend: str = ...,
    return_lse: Literal[False] = ...,
    deterministic: bool | None = ...,
    tune: bool | None = ...,
) -> torch.Tensor: ...
@overload
def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    mask: Any = ...,
    score_mod: Any = ...,
    causal: bool = ...,
    window_size: Sequence[int] = ...,
    scale: float | None = ...,
    enable_gqa: bool = ...,
    backend: str = ...,
    return_lse: Literal[True],
    deterministic: bool | None = ...,
    tune: bool | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    mask: Any = ...,
    score_mod: Any = ...,
    causal: bool = ...,
    window_size: Sequence[int] = ...,
    scale: float | None = ...,
    enable_gqa: bool = ...,
    backend: str = ...,
    return_lse: bool = ...,
    deterministic: bool | None = ...,
    tune: bool | None = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    mask: Any = None,
    score_mod: Any = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    scale: float | None = None,
    enable_gqa: bool = False,
    backend: str = "auto",
    return_lse: bool = False,
    deterministic: bool | None = None,
    tune: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed variable-length sequences, as ``flash_attn_varlen_func``.

    Conventions (FlashAttention's): sequence ``i`` is query rows ``cu_seqlens_q[i] :
    cu_seqlens_q[i + 1]`` of ``q`` and key/value rows ``cu_seqlens_k[i] : cu_seqlens_k[i + 1]``
    of ``k`` and ``v``; its queries see only its keys. ``causal`` and ``window_size`` are
    **bottom-right aligned** per sequence, as in FlashAttention: query row ``r`` of a sequence
    with ``Lq_i`` queries and ``Lk_i`` keys sits at key position ``p = r + Lk_i - Lq_i`` (the last
    query lines up with the last key) and sees local keys ``c`` with ``p - left <= c <= p + right``
    (``window_size=(left, right)``, ``-1`` unbounded; ``causal=True`` sets ``right = 0``). When
    ``Lq_i > Lk_i`` the first ``Lq_i - Lk_i`` rows of a causal sequence see no key: they give 0
    (lse ``-inf``). A sequence of length 0 is allowed (a repeated offset).

    ``mask`` and ``score_mod`` (anything ``fz.attention`` takes but a ``BlockMask``) are applied
    in each sequence's own **local coordinates**, as ``fz.attention`` would on that sequence
    alone: ``q_idx = r`` in ``[0, Lq_i)``, ``kv_idx = c`` in ``[0, Lk_i)``, ``b = 0``. So
    ``masks.Causal()`` there is top-left aligned like everywhere in the library (the same as
    ``causal=True`` when ``Lq_i == Lk_i``); ``masks.Causal(align="bottom_right")`` and other specs
    whose rule depends on the lengths are bound per sequence and must bind to one spec for all of
    them (equal ``Lk_i - Lq_i``; else ``ValueError``: use ``causal=True``). Specs are validated for
    ``max_seqlen_q x max_seqlen_k`` (a ``masks.Dense`` / bias tensor is indexed locally).

    Routes: with ``cu_seqlens_q`` equal to ``cu_seqlens_k`` and ``mask`` None / ``Full`` /
    ``Causal`` / ``SlidingWindow`` / ``Band``, the call is ``fz.attention`` with a
    ``masks.Document`` mask (the varlen and FA4 routes can take it on GPUs); otherwise with a
    mask over (query sequence, key sequence) pairs, which the flex routes run with block sparsity,
    the ``varlen`` route runs as FlashAttention's own varlen call (two offset lists; when no
    ``mask`` is given and every query row sees a key, e.g. a chunked prefill with ``Lq_i <= Lk_i``)
    and the dense route runs by materializing ``Tq x Tk`` scores (on the CPU with grad, that is
    the route). Nothing else builds anything ``T x T``.

    Args:
        q: ``[Tq, H, D]``, the query rows of every sequence, packed.
        k: ``[Tk, H_kv, D]``.
        v: ``[Tk, H_kv, Dv]``.
        cu_seqlens_q: int32/int64 1-D ``[S + 1]``: 0, then the running total of query lengths,
            ending at ``Tq`` (non-decreasing). Any device (copied to ``q``'s).
        cu_seqlens_k: the same for keys: ``[S + 1]`` (the same ``S``), ending at ``Tk``.
        max_seqlen_q: an int at least the longest query sequence (FlashAttention sizes its grid
            with it; here it bounds the local coordinates masks are validated for).
        max_seqlen_k: the same for keys.
        mask: a mask in local coordinates (see above), or None.
        score_mod: a score mod in local coordinates, or None.
        causal: bottom-right-aligned causal attention within each sequence.
        window_size: ``(left, right)``, bottom-right aligned; ``-1`` is unbounded.
        scale: as ``fz.attention`` (default ``1/sqrt(D)``).
        enable_gqa: allow ``H_kv < H`` (query head ``h`` reads kv head ``h // (H // H_kv)``).
        backend: ``"auto"`` or a route name, as ``fz.attention``.
        return_lse: also return the log-sum-exp ``[H, Tq]`` (FlashAttention's varlen
            ``softmax_lse`` layout; float32, float64 for float64 inputs, as ``fz.attention``).
        deterministic: as ``fz.attention``.
        tune: as ``fz.attention``.

    Returns:
        ``out`` ``[Tq, H, Dv]`` (a view of the route's ``[1, H, Tq, Dv]`` output), or
        ``(out, lse)``.

    Raises:
        TypeError: an argument of the wrong type (names it).
        ValueError: inconsistent offsets, lengths, shapes or window (names the argument).

    While ``torch.compile`` traces, the offsets' values are not checked (that would read tensor
    data), and the Document form is not used.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor [T, H, D], got {type(t).__name__}")
        check_strided(name, t)
        if t.dim() != 3:
            raise ValueError(f"{name} must have 3 dims [T, H, D] (packed rows), got shape {tuple(t.shape)}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(
            f"k and v must have the same number of rows (dim 0), got k={k.shape[0]}, v={v.shape[0]}"
        )
    # Checked here, in the packed layout, rather than by fz.attention on the [1, H, T, D] view,
    # whose messages would name that view's dims and shape instead of the caller's.
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k head dims (dim 2) differ: q={q.shape[2]}, k={k.shape[2]}")
    if min(q.shape[1], k.shape[1], q.shape[2]) == 0:
        raise ValueError(
            "heads (dim 1) and head dim (dim 2) must be positive, got q shape "
            f"{tuple(q.shape)}, k shape {tuple(k.shape)}"
        )
    causal = check_flag("causal", causal)
    left, right = _window(window_size)
    if causal:
        right = 0
    tracing = _compat.is_compiling()
    cu_q = _offsets("cu_seqlens_q", cu_seqlens_q, q.device)
    cu_k = _offsets("cu_seqlens_k", cu_seqlens_k, q.device)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
            f"{cu_q.numel() - 1} and {cu_k.numel() - 1}"
        )
    max_q = _max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = _max_seqlen("max_seqlen_k", max_seqlen_k)
    if isinstance(mask, _compat.BlockMask):
        raise TypeError(
            "mask got a BlockMask, which is built for one call's own coordinates; varlen_attention "
            "applies mask per sequence: pass a spec, registry name, mask_mod callable or bool tensor"
        )
    mask, score_mod = tensor_args(mask, score_mod)
    inner_mask = as_mask_spec(mask)
    inner_score = as_score_spec(score_mod)
    heads = q.shape[1]
    if tracing:
        lengths = None
        same_offsets = False
    else:
        host_q, host_k = cu_q.cpu(), cu_k.cpu()  # one sync: every check below reads these
        _check_offsets("cu_seqlens_q", host_q, q.shape[0], "q")
        _check_offsets("cu_seqlens_k", host_k, k.shape[0], "k")
        lengths = list(zip(host_q.diff().tolist(), host_k.diff().tolist(), strict=True))
        _check_max("max_seqlen_q", max_q, max((a for a, _ in lengths), default=0))
        _check_max("max_seqlen_k", max_k, max((b for _, b in lengths), default=0))
        same_offsets = bool(torch.equal(host_q, host_k))
    for arg, spec in (("mask", inner_mask), ("score_mod", inner_score)):
        if spec is not None:
            try:
                spec.validate(max_q, max_k, 1, heads)
            except ValueError as exc:
                # The spec's message speaks of a problem's Lq and Lkv: here those are the max
                # lengths, not the packed totals a caller may have sized a tensor for.
                raise ValueError(
                    f"{arg} is applied in each sequence's local coordinates, so it is checked for "
                    f"B=1, Lq=max_seqlen_q={max_q}, Lkv=max_seqlen_k={max_k}: {exc}"
                ) from exc
    if inner_mask is not None:
        inner_mask = _bind_once(inner_mask, lengths)
    totals = (q.shape[0], k.shape[0])
    if 0 in totals:
        # An empty pack: no query rows, or rows that see no key (0, lse -inf), whatever the mask,
        # as fz.attention gives for zero lengths. A packed mask of zero positions cannot be built
        # (its Document refused the empty ids with a message about a spec the caller never gave).
        packed_mask: Any = None
        packed_score: Any = None
    elif same_offsets and (inner_mask is None or _shift_invariant(inner_mask)):
        # Every sequence is square, so a shift-invariant mask and a bottom-right window mean the
        # same in packed coordinates as locally: a plain Document mask, which keeps varlen forms.
        packed_mask = _document(cu_q, totals[0], inner_mask, left, right)
    else:
        packed_mask = PackedSequences(
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, q_total=totals[0], kv_total=totals[1],
            max_seqlen_q=max_q, max_seqlen_k=max_k, inner=inner_mask, left=left, right=right,
        )  # fmt: skip
    if 0 not in totals:
        packed_score = _score(inner_score, cu_q, cu_k, totals, (max_q, max_k), same_offsets)
    result = attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        mask=packed_mask,
        score_mod=packed_score,
        scale=scale,
        enable_gqa=enable_gqa,
        backend=backend,
        return_lse=return_lse,
        deterministic=deterministic,
        tune=tune,
    )
    if isinstance(result, tuple):
        return result[0][0].transpose(0, 1), result[1][0]
    return result[0].transpose(0, 1)


def _window(window_size: Any) -> tuple[int, int]:
    # numpy's integers too (as check_integer), as flash_attn's int arguments take them.
    pair = isinstance(window_size, (tuple, list)) and len(window_size) == 2
    if not pair or any(isinstance(w, bool) or not isinstance(w, Integral) for w in window_size):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= 0, or -1 for unbounded; got {tuple(window_size)}")
    return left, right


def _offsets(name: str, cu: Any, device: torch.device) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 or int64 tensor [S + 1], got {type(cu).__name__}")
    if cu.dtype not in _CU_DTYPES:
        raise TypeError(f"{name} must have dtype int32 or int64, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(
            f"{name} must be 1-D with at least 2 entries [0, ..., T], got shape {tuple(cu.shape)}"
        )
    if cu.is_meta:  # its offsets are read below: a meta tensor has none (torch's NotImplementedError)
        raise ValueError(
            f"{name} is on the meta device (no values); give the offsets on q's device or the CPU"
        )
    return cu.to(device, torch.int64)


def _check_offsets(name: str, cu: torch.Tensor, total: int, tensor: str) -> None:
    if int(cu[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(cu[0])}")
    if bool((cu.diff() < 0).any()):
        raise ValueError(
            f"{name} must be non-decreasing (offsets of consecutive sequences), got {cu.tolist()[:16]}"
        )
    if int(cu[-1]) != total:
        raise ValueError(
            f"{name} must end at the number of packed rows of {tensor} ({total}), got {int(cu[-1])}"
        )


def _max_seqlen(name: str, value: Any) -> int:
    if type(value) is not int:
        # numpy's integers too, as flash_attn takes them (a max from numpy lengths); a plain int
        # skips the check, which is all a traced call sees.
        value = check_integer(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _check_max(name: str, value: int, longest: int) -> None:
    if value < longest:
        raise ValueError(f"{name}={value} is less than the longest sequence ({longest})")


def _bind_once(spec: MaskSpec, lengths: list[tuple[int, int]] | None) -> MaskSpec:
    """``spec`` bound to the sequences' lengths: one spec for all of them, or ValueError."""
    if lengths is None:  # traced: the lengths are data; only specs that ignore them can run
        if spec.bind(1, 1) is spec and spec.bind(1, 2) is spec:
            return spec
        raise ValueError(
            f"mask {type(spec).__name__} depends on each sequence's lengths, which are not known while "
            "torch.compile traces; use causal=True / window_size= (bottom-right aligned)"
        )
    bound = {spec.bind(lq, lk) for lq, lk in dict.fromkeys(lengths) if lq and lk}
    if len(bound) > 1:
        raise ValueError(
            f"mask {type(spec).__name__} depends on each sequence's lengths (e.g. "
            "Causal(align='bottom_right')), and the sequences' Lk_i - Lq_i differ; pass causal=True "
            "(bottom-right aligned per sequence, as flash_attn) instead"
        )
    if not bound:
        # No sequence has both queries and keys, so no pair is visible whatever the mask says;
        # but it is still evaluated (ANDed with the sequence match), and a spec left unbound may
        # have no mask_mod (Causal(align="bottom_right")): any lengths will do.
        return spec.bind(1, 1)
    return bound.pop()


def _document(cu: torch.Tensor, total: int, inner: MaskSpec | None, left: int, right: int) -> MaskSpec:
    spec: MaskSpec = Document(doc_ids=_rows(cu, total)[0])
    if left >= 0 or right >= 0:
        spec = spec & Band(lo=None if left < 0 else -left, hi=None if right < 0 else right)
    return spec if inner is None or keeps_function_of(inner, Full) else spec & inner


def _score(
    inner: ScoreSpec | None,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    totals: tuple[int, int],
    extents: tuple[int, int],
    same_offsets: bool,
) -> ScoreSpec | None:
    # A soft-cap reads only the score, and ALiBi only |i - j| (shift-invariant when every
    # sequence's query and key offsets agree): those need no translation, and keep their forms.
    if inner is None or inner.softcap_form() is not None:
        return inner
    if same_offsets and inner.linear_bias_form() is not None:
        return inner
    return PackedScore(
        inner=inner, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, q_total=totals[0], kv_total=totals[1],
        max_seqlen_q=extents[0], max_seqlen_k=extents[1],
    )  # fmt: skip


__all__ = ["varlen_attention"]
