"""``fz.varlen_attention``: packed ``[T, H, D]`` sequences against a float64 loop over the
sequences (``reference_attention`` on each one alone), forward and backward on the CPU routes,
FlashAttention's bottom-right alignment, and the argument checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from zoo_oracles import cu_seqlens, flash_visible

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.backends import BY_NAME, varlen
from flexattn_zoo.compose import And
from flexattn_zoo.packed import PackedSequences
from flexattn_zoo.problem import Problem
from flexattn_zoo.segments import segment_layout
from flexattn_zoo.testing import assert_mask_consistent, reference_attention
from flexattn_zoo.testing.checks import dense_block_map, varlen_dense

H, D = 4, 16
# Unequal lengths, an empty query sequence, an empty key sequence, Lq_i > Lk_i and Lq_i < Lk_i.
LENS_Q = [5, 17, 0, 9, 4, 3]
LENS_K = [5, 23, 3, 9, 2, 0]
SQUARE = [7, 1, 12, 0, 9]


def _inputs(
    lens_q: list[int], lens_k: list[int], *, kv_heads: int = H, grad: bool = False, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), H, D, generator=g)
    k = torch.randn(sum(lens_k), kv_heads, D, generator=g)
    v = torch.randn(sum(lens_k), kv_heads, D, generator=g)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _loop_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens_q: list[int],
    lens_k: list[int],
    local_mask: Any,
    **kw: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(out [Tq, H, Dv], lse [H, Tq])``: each sequence alone through the reference.

    ``local_mask(lq, lk)`` is the sequence's mask spec (or None), written from the convention's
    statement, not from the library's packed spec."""
    outs, lses = [], []
    q0 = k0 = 0
    for lq, lk in zip(lens_q, lens_k, strict=True):
        qi = q[q0 : q0 + lq].transpose(0, 1)[None]
        ki, vi = (t[k0 : k0 + lk].transpose(0, 1)[None] for t in (k, v))
        q0, k0 = q0 + lq, k0 + lk
        if lq == 0:
            continue
        if lk == 0:  # no key at all: rows give 0 and lse -inf (the library's convention)
            outs.append(torch.zeros(lq, H, v.shape[-1], dtype=torch.float64))
            lses.append(torch.full((H, lq), float("-inf"), dtype=torch.float64))
            continue
        out, lse = reference_attention(qi, ki, vi, mask=local_mask(lq, lk), return_lse=True, **kw)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def _bottom_right(left: int, right: int) -> Any:
    """FlashAttention's window in one sequence (``zoo_oracles.flash_visible``), as a mask builder
    ``(lq, lk) -> spec`` for the loop reference (None: no mask)."""

    def build(lq: int, lk: int) -> Any:
        if left < 0 and right < 0:
            return None
        return masks.Dense(mask=flash_visible(lq, lk, left, right))

    return build


CASES: list[tuple[str, list[int], list[int], dict[str, Any], Any]] = [
    ("no_mask", LENS_Q, LENS_K, {}, lambda lq, lk: None),
    ("no_mask_square", SQUARE, SQUARE, {}, lambda lq, lk: None),
    ("causal_square", SQUARE, SQUARE, {"causal": True}, _bottom_right(-1, 0)),
    ("causal_bottom_right", LENS_Q, LENS_K, {"causal": True}, _bottom_right(-1, 0)),
    ("window_square", SQUARE, SQUARE, {"window_size": (3, 0)}, _bottom_right(3, 0)),
    ("window_bottom_right", LENS_Q, LENS_K, {"window_size": (4, 2)}, _bottom_right(4, 2)),
    ("causal_window", LENS_Q, LENS_K, {"causal": True, "window_size": (3, 5)}, _bottom_right(3, 0)),
    # mask= is local and top-left, as fz.attention on the sequence alone
    ("local_sliding_window", LENS_Q, LENS_K, {"mask": masks.SlidingWindow(left=3)}, lambda lq, lk: masks.SlidingWindow(left=3)),
    ("local_causal_top_left", LENS_Q, LENS_K, {"mask": "causal"}, lambda lq, lk: masks.Causal()),
    ("local_prefix_lm", SQUARE, SQUARE, {"mask": masks.PrefixLM(prefix_len=4)}, lambda lq, lk: masks.PrefixLM(prefix_len=4)),
    ("local_callable", LENS_Q, LENS_K, {"mask": lambda b, h, q, kv: (q + kv) % 3 != 0}, lambda lq, lk: lambda b, h, q, kv: (q + kv) % 3 != 0),
    ("local_alibi", LENS_Q, LENS_K, {"causal": True, "score_mod": score_mods.Alibi(num_heads=H)}, _bottom_right(-1, 0)),
    ("softcap", SQUARE, SQUARE, {"causal": True, "score_mod": score_mods.SoftCap(cap=5.0)}, _bottom_right(-1, 0)),
]  # fmt: skip


def _reference_kw(kw: dict[str, Any]) -> dict[str, Any]:
    return {"score_mod": kw["score_mod"]} if "score_mod" in kw else {}


#: Cases also run on flex_cpu (each compiles a CPU kernel: seconds on CI's 2 cores).
FLEX_CASES = {"causal_square", "causal_bottom_right", "local_callable", "local_alibi"}
ROUTE_CASES = [
    pytest.param(route, *case, id=f"{case[0]}-{route}")
    for case in CASES
    for route in ("dense", "flex_cpu")
    if route == "dense" or case[0] in FLEX_CASES
]


@pytest.mark.parametrize(("route", "name", "lens_q", "lens_k", "kw", "local"), ROUTE_CASES)
def test_forward_matches_a_loop_over_the_sequences(
    route: str, name: str, lens_q: list[int], lens_k: list[int], kw: dict[str, Any], local: Any
) -> None:
    q, k, v = _inputs(lens_q, lens_k)
    lse_too = route != "flex_cpu"  # the CPU flex kernel gives no lse (the route refuses it)
    with torch.no_grad():
        result = fz.varlen_attention(
            q,
            k,
            v,
            cu_seqlens(lens_q),
            cu_seqlens(lens_k),
            max(lens_q),
            max(lens_k),
            backend=route,
            return_lse=lse_too,
            **kw,
        )
    ref_out, ref_lse = _loop_reference(q, k, v, lens_q, lens_k, local, **_reference_kw(kw))
    out = result[0] if lse_too else result
    assert out.shape == (sum(lens_q), H, D)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-4)
    if lse_too:
        assert result[1].shape == (H, sum(lens_q))
        torch.testing.assert_close(result[1].double(), ref_lse, atol=2e-5, rtol=1e-4)


GRAD_CASES = [
    c
    for c in CASES
    if c[0] in ("no_mask", "causal_square", "causal_bottom_right", "window_bottom_right", "local_alibi")
]


@pytest.mark.parametrize(("name", "lens_q", "lens_k", "kw", "local"), GRAD_CASES, ids=[c[0] for c in GRAD_CASES])  # fmt: skip
def test_backward_matches_the_reference(
    name: str, lens_q: list[int], lens_k: list[int], kw: dict[str, Any], local: Any
) -> None:
    q, k, v = _inputs(lens_q, lens_k, grad=True)
    out = fz.varlen_attention(q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k), max(lens_q), max(lens_k), **kw)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref_out, _ = _loop_reference(q, k, v, lens_q, lens_k, local, **_reference_kw(kw))
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), grad_out.double())
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-4)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got.double(), want.double(), atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("grad", [False, True])
def test_gqa(grad: bool) -> None:
    q, k, v = _inputs(LENS_Q, LENS_K, kv_heads=2, grad=grad)
    out = fz.varlen_attention(
        q, k, v, cu_seqlens(LENS_Q), cu_seqlens(LENS_K, torch.int64), 17, 23, causal=True, enable_gqa=True
    )
    ref, _ = _loop_reference(q, k, v, LENS_Q, LENS_K, _bottom_right(-1, 0), enable_gqa=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    if grad:
        grad_out = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), grad_out)
        want = torch.autograd.grad(ref, (q, k, v), grad_out.double())
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a.double(), b.double(), atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("grad", [False, True])
def test_tensor_mask_and_bias_are_indexed_locally(grad: bool) -> None:
    """A bool mask and a float bias over ``max_seqlen_q x max_seqlen_k`` local positions (here
    larger than the longest sequences): sequence ``i`` reads their top-left ``Lq_i x Lk_i``."""
    max_q, max_k = 20, 25
    g = torch.Generator().manual_seed(5)
    keep = torch.rand(max_q, max_k, generator=g) > 0.3
    bias = torch.randn(1, H, max_q, max_k, generator=g)
    q, k, v = _inputs(LENS_Q, LENS_K, grad=grad)
    out = fz.varlen_attention(
        q,
        k,
        v,
        cu_seqlens(LENS_Q),
        cu_seqlens(LENS_K),
        max_q,
        max_k,
        mask=keep,
        score_mod=bias,
        backend="dense",
    )
    outs, q0, k0 = [], 0, 0
    for lq, lk in zip(LENS_Q, LENS_K, strict=True):
        qi = q[q0 : q0 + lq].transpose(0, 1)[None]
        ki, vi = (t[k0 : k0 + lk].transpose(0, 1)[None] for t in (k, v))
        q0, k0 = q0 + lq, k0 + lk
        if lq and lk:
            ref = reference_attention(
                qi, ki, vi, mask=masks.Dense(mask=keep[:lq, :lk]), score_mod=bias[..., :lq, :lk]
            )
            outs.append(ref[0].transpose(0, 1))
        elif lq:
            outs.append(torch.zeros(lq, H, D, dtype=torch.float64))
    ref_out = torch.cat(outs)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-4)
    if grad:
        grad_out = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), grad_out)
        want = torch.autograd.grad(ref_out, (q, k, v), grad_out.double())
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a.double(), b.double(), atol=5e-5, rtol=1e-4)


def test_bottom_right_causal_convention_spelled_out() -> None:
    """One sequence, 2 queries over 4 keys: query 0 sees keys 0..2, query 1 all 4 (flash_attn's
    causal), whereas the top-left ``mask="causal"`` lets query 0 see only key 0."""
    q = torch.zeros(2, 1, 8)
    k = torch.zeros(4, 1, 8)
    v = torch.arange(4.0).view(4, 1, 1).expand(4, 1, 8).contiguous()
    cu_q, cu_k = torch.tensor([0, 2]), torch.tensor([0, 4])
    with torch.no_grad():
        flash = fz.varlen_attention(q, k, v, cu_q, cu_k, 2, 4, causal=True, backend="dense")
        top_left = fz.varlen_attention(q, k, v, cu_q, cu_k, 2, 4, mask="causal", backend="dense")
    # Equal scores: each output is the mean of the values it sees.
    torch.testing.assert_close(flash[:, 0, 0], torch.tensor([1.0, 1.5]))
    torch.testing.assert_close(top_left[:, 0, 0], torch.tensor([0.0, 0.5]))


def test_rows_that_see_no_key_give_zero_and_minus_inf_lse() -> None:
    # Sequence 0: 3 queries, 1 key, causal: rows 0 and 1 lie before the key. Sequence 1: no keys.
    q, k, v = _inputs([3, 2], [1, 0])
    out, lse = fz.varlen_attention(
        q, k, v, cu_seqlens([3, 2]), cu_seqlens([1, 0]), 3, 1, causal=True, return_lse=True, backend="dense"
    )
    seen = torch.tensor([False, False, True, False, False])
    assert bool((out[~seen] == 0).all()) and bool(torch.isneginf(lse[:, ~seen]).all())
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, seen]).all()


def test_square_offsets_take_a_document_mask_and_others_the_packed_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[Any] = []
    real = fz.packed.api.attention

    def spy(*args: Any, **kw: Any) -> Any:
        seen.append(kw["mask"])
        return real(*args, **kw)

    monkeypatch.setattr(fz.packed.api, "attention", spy)
    q, k, v = _inputs(SQUARE, SQUARE)
    with torch.no_grad():
        fz.varlen_attention(
            q, k, v, cu_seqlens(SQUARE), cu_seqlens(SQUARE), 12, 12, causal=True, backend="dense"
        )
        fz.varlen_attention(
            q,
            k,
            v,
            cu_seqlens(SQUARE),
            cu_seqlens(SQUARE),
            12,
            12,
            mask=masks.PrefixLM(prefix_len=2),
            backend="dense",
        )
        q, k, v = _inputs(LENS_Q, LENS_K)
        fz.varlen_attention(
            q, k, v, cu_seqlens(LENS_Q), cu_seqlens(LENS_K), 17, 23, causal=True, backend="dense"
        )
    assert masks.Document in {type(p) for p in getattr(seen[0], "parts", ())}
    assert varlen_form_of(seen[0], sum(SQUARE)) is not None  # the GPU varlen route can take it
    assert isinstance(seen[1], PackedSequences) and isinstance(seen[2], PackedSequences)


def varlen_form_of(spec: Any, length: int) -> Any:
    return spec.varlen_form(length, length, 1)


@pytest.mark.parametrize("inner", [None, masks.SlidingWindow(left=2, right=1)])
@pytest.mark.parametrize("window", [(-1, -1), (3, 0)])
def test_packed_spec_oracle_and_block_map_agree_with_its_mask_mod(
    inner: Any, window: tuple[int, int]
) -> None:
    spec = PackedSequences(
        cu_seqlens_q=cu_seqlens(LENS_Q, torch.int64), cu_seqlens_k=cu_seqlens(LENS_K, torch.int64),
        q_total=sum(LENS_Q), kv_total=sum(LENS_K), max_seqlen_q=17, max_seqlen_k=23,
        inner=inner, left=window[0], right=window[1],
    )  # fmt: skip
    tq, tk = sum(LENS_Q), sum(LENS_K)
    zero = torch.zeros((), dtype=torch.int64)
    from_mod = spec.mask_mod()(zero, zero, torch.arange(tq).view(tq, 1), torch.arange(tk).view(1, tk))
    torch.testing.assert_close(spec.dense(tq, tk)[0, 0], from_mod)
    bmap = spec.block_map(tq, tk, 8, 8, "cpu")
    assert bmap is not None
    visible, full = (t[0, 0] for t in dense_block_map(from_mod[None, None], 8, 8))  # padding: masked
    assert bool((bmap.any[0, 0] | ~visible).all())  # every visible block is listed
    assert bool((~bmap.full[0, 0] | full).all())  # a block called full is full
    if inner is None and window == (-1, -1):
        assert torch.equal(bmap.full[0, 0], full)  # and without inner parts, every full one is


def _packed(
    lens_q: list[int], lens_k: list[int], window: tuple[int, int], inner: Any = None
) -> PackedSequences:
    return PackedSequences(
        cu_seqlens_q=cu_seqlens(lens_q, torch.int64), cu_seqlens_k=cu_seqlens(lens_k, torch.int64),
        q_total=sum(lens_q), kv_total=sum(lens_k), max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
        inner=inner, left=window[0], right=window[1],
    )  # fmt: skip


PREFILL_Q, PREFILL_K = [5, 17, 9, 1, 3], [5, 23, 9, 6, 40]  # every sequence: at least as many keys


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (4, 2), (0, 0)])
@pytest.mark.parametrize(
    ("lens_q", "lens_k"), [(PREFILL_Q, PREFILL_K), ([4, 0, 6], [2, 0, 9]), (SQUARE, SQUARE)]
)
def test_packed_spec_offers_the_varlen_call_with_two_offset_lists(
    window: tuple[int, int], lens_q: list[int], lens_k: list[int]
) -> None:
    spec = _packed(lens_q, lens_k, window)
    tq, tk = sum(lens_q), sum(lens_k)
    form = spec.varlen_form(tq, tk, 1)
    if window[1] >= 0 and any(lq > lk + window[1] for lq, lk in zip(lens_q, lens_k, strict=True)):
        assert form is None  # a query row would see no key
        return
    assert form is not None and form.window == window
    kept = [(lq, lk) for lq, lk in zip(lens_q, lens_k, strict=True) if lq or lk]
    assert form.segments is not None and form.segments.tolist() == [lq for lq, _ in kept]
    if lens_q == lens_k:
        assert form.kv_segments is None  # equal sequences: the plain form
    else:
        assert form.kv_segments is not None and form.kv_segments.tolist() == [lk for _, lk in kept]
    # The form describes the spec's own oracle exactly (and the library's form check agrees).
    assert torch.equal(varlen_dense(form, tq, 1, tk)[0, 0], spec.dense(tq, tk)[0, 0])
    assert_mask_consistent(spec, q_len=tq, kv_len=tk, exact_blocks=False)  # windows: superset blocks
    seqs = varlen.cu_seqlens(spec, 1, tq, tk, "cpu")
    assert seqs.cu_q.tolist() == cu_seqlens([lq for lq, _ in kept]).tolist()
    assert seqs.cu_k.tolist() == cu_seqlens([lk for _, lk in kept]).tolist()
    assert (seqs.max_q, seqs.max_k, seqs.window) == (max(lens_q), max(lens_k), window)
    # Kernels that take one offset list for both (SDPA's chunks, FA4's own) see no layout.
    assert segment_layout(spec, 1, tq) is None or lens_q == lens_k


def test_packed_spec_has_no_varlen_form_with_rows_a_kernel_would_leave_empty() -> None:
    # A sequence with queries but no keys, or keys but no queries, and an inner mask.
    assert _packed(LENS_Q, LENS_K, (-1, -1)).varlen_form(sum(LENS_Q), sum(LENS_K), 1) is None
    assert _packed([3, 4], [0, 4], (-1, -1)).varlen_form(7, 4, 1) is None
    assert _packed([0, 4], [3, 4], (-1, -1)).varlen_form(4, 7, 1) is None
    causal = masks.Causal()
    assert (
        _packed(PREFILL_Q, PREFILL_K, (-1, -1), inner=causal).varlen_form(sum(PREFILL_Q), sum(PREFILL_K), 1)
        is None
    )
    # A call of other sizes than the pack it was built for.
    assert _packed(PREFILL_Q, PREFILL_K, (-1, -1)).varlen_form(sum(PREFILL_Q), sum(PREFILL_Q), 1) is None


def test_a_form_with_other_key_segments_combines_with_no_other_form() -> None:
    # Equal totals, unequal sequences: Causal's window is the global diagonal, the pack's is
    # bottom-right per sequence, so their intersection has no varlen form.
    spec = _packed([3, 5], [5, 3], (-1, -1))
    form = spec.varlen_form(8, 8, 1)
    assert form is not None and form.kv_segments is not None
    assert (spec & masks.Causal()).varlen_form(8, 8, 1) is None
    alone = And(parts=(spec,)).varlen_form(8, 8, 1)  # alone it keeps its key segments
    assert alone is not None and alone.kv_segments is not None and alone.window == form.window
    assert torch.equal(alone.kv_segments, form.kv_segments)


def test_bottom_right_mask_spec_binds_when_every_offset_agrees() -> None:
    lens_q, lens_k = [2, 3], [4, 5]  # Lk_i - Lq_i = 2 for both
    q, k, v = _inputs(lens_q, lens_k)
    with torch.no_grad():
        a = fz.varlen_attention(
            q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k), 3, 5, causal=True, backend="dense"
        )
        b = fz.varlen_attention(
            q,
            k,
            v,
            cu_seqlens(lens_q),
            cu_seqlens(lens_k),
            3,
            5,
            mask=masks.Causal(align="bottom_right"),
            backend="dense",
        )
    torch.testing.assert_close(a, b)


def test_a_length_dependent_mask_on_a_pack_where_no_sequence_has_queries_and_keys() -> None:
    # Sequence 0 has queries but no keys, sequence 1 keys but no queries: every row sees no key.
    q, k, v = _inputs([3, 0], [0, 4])
    out, lse = fz.varlen_attention(
        q, k, v, cu_seqlens([3, 0]), cu_seqlens([0, 4]), 3, 4,
        mask=masks.Causal(align="bottom_right"), return_lse=True, backend="dense",
    )  # fmt: skip
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())


def _good() -> dict[str, Any]:
    q, k, v = _inputs(LENS_Q, LENS_K)
    return {
        "q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens(LENS_Q), "cu_seqlens_k": cu_seqlens(LENS_K),
        "max_seqlen_q": 17, "max_seqlen_k": 23,
    }  # fmt: skip


BAD: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("q_2d", {"q": torch.randn(10, 16)}, ValueError, "q must have 3 dims"),
    ("q_not_tensor", {"q": [1.0]}, TypeError, "q must be a torch.Tensor"),
    ("k_v_rows", {"v": torch.randn(5, H, D)}, ValueError, "k and v must have the same number of rows"),
    # Named in the packed [T, H, D] layout, not in that of the [1, H, T, D] call it becomes.
    ("head_dims", {"k": torch.randn(42, H, 8), "v": torch.randn(42, H, 8)}, ValueError, "q and k head dims (dim 2) differ: q=16, k=8"),
    ("head_dim_0", {"q": torch.randn(38, H, 0), "k": torch.randn(42, H, 0)}, ValueError, "head dim (dim 2) must be positive, got q shape (38, 4, 0)"),
    ("cu_float", {"cu_seqlens_q": cu_seqlens(LENS_Q).float()}, TypeError, "cu_seqlens_q must have dtype int32 or int64"),
    ("cu_list", {"cu_seqlens_k": [0, 5]}, TypeError, "cu_seqlens_k must be an int32 or int64 tensor"),
    ("cu_2d", {"cu_seqlens_q": cu_seqlens(LENS_Q)[None]}, ValueError, "cu_seqlens_q must be 1-D"),
    ("cu_short", {"cu_seqlens_q": torch.tensor([0])}, ValueError, "at least 2 entries"),
    ("cu_start", {"cu_seqlens_q": cu_seqlens(LENS_Q) + 1}, ValueError, "cu_seqlens_q must start at 0"),
    ("cu_decreasing", {"cu_seqlens_k": torch.tensor([0, 30, 20, 25, 30, 42, 42])}, ValueError, "non-decreasing"),
    ("cu_end", {"cu_seqlens_k": cu_seqlens([5, 23, 3, 9, 2, 1])}, ValueError, "must end at the number of packed rows of k (42)"),
    ("cu_count", {"cu_seqlens_k": torch.tensor([0, 42])}, ValueError, "the same number of sequences"),
    ("max_small", {"max_seqlen_q": 16}, ValueError, "max_seqlen_q=16 is less than the longest sequence (17)"),
    ("max_type", {"max_seqlen_k": 23.0}, TypeError, "max_seqlen_k must be an int"),
    ("window_type", {"window_size": 3}, TypeError, "window_size must be a pair of ints"),
    ("window_value", {"window_size": (-2, 0)}, ValueError, "window_size entries must be >= 0, or -1"),
    ("causal_type", {"causal": 1}, TypeError, "causal must be a bool"),
    ("bottom_right_unbindable", {"mask": masks.Causal(align="bottom_right")}, ValueError, "pass causal=True"),
    ("mask_type", {"mask": 3}, TypeError, "mask must be None, a mask spec"),
    # A tensor sized for the packed rows rather than for one sequence's local positions.
    ("mask_packed_shape", {"mask": torch.ones(38, 42, dtype=torch.bool)}, ValueError, "mask is applied in each sequence's local coordinates, so it is checked for B=1, Lq=max_seqlen_q=17, Lkv=max_seqlen_k=23: Dense"),
    ("score_packed_shape", {"score_mod": torch.zeros(38, 42)}, ValueError, "score_mod is applied in each sequence's local coordinates"),
    ("backend", {"backend": "nope"}, ValueError, "unknown backend"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "change", "exc", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_are_named(
    name: str, change: dict[str, Any], exc: type[Exception], message: str
) -> None:
    args = {**_good(), **change}
    positional = [
        args.pop(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    ]
    with pytest.raises(exc, match=message.replace("(", r"\(").replace(")", r"\)")):
        fz.varlen_attention(*positional, **args)


def test_numpy_integers_are_taken_for_lengths_and_window() -> None:
    """As flash_attn takes them (a max computed from numpy lengths); a bool is still refused."""
    np = pytest.importorskip("numpy")
    args = _good()
    args["max_seqlen_q"], args["max_seqlen_k"] = np.int64(17), np.int32(23)
    with torch.no_grad():
        got = fz.varlen_attention(*args.values(), window_size=(np.int64(3), -1), backend="dense")
        want = fz.varlen_attention(*_good().values(), window_size=(3, -1), backend="dense")
    torch.testing.assert_close(got, want)
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        fz.varlen_attention(*_good().values(), window_size=(True, -1))
    with pytest.raises(TypeError, match="max_seqlen_q must be an int, got bool"):
        fz.varlen_attention(*list(_good().values())[:5], True, 23)


def test_a_block_mask_is_refused() -> None:
    bm = fz.block_mask(masks.Causal(), sum(LENS_Q), sum(LENS_K))
    args = _good()
    with pytest.raises(TypeError, match="mask got a BlockMask"):
        fz.varlen_attention(*args.values(), mask=bm)


# ---- inside torch.compile(fullgraph=True) -----------------------------------------------------
# The packed mask's tables are built in the graph from the offsets (no data read), so new offsets
# of the same shapes reuse the graph. Inductor's CPU flex template (torch 2.13) fails to lower a
# mask whose tables are computed inside the graph (NoValidChoicesError), so the no-grad flex_cpu
# case compiles with aot_eager here; with grad (the dense route) Inductor compiles it.


@pytest.fixture
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled_case() -> tuple[Any, tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
    lens_q, lens_k = [3, 5, 4], [6, 5, 4]

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor) -> Any:
        return fz.varlen_attention(q, k, v, cu_q, cu_k, 5, 6, causal=True, mask=masks.SlidingWindow(left=2))

    return fn, _inputs(lens_q, lens_k), cu_seqlens(lens_q), cu_seqlens(lens_k)


@pytest.mark.usefixtures("_fresh_dynamo")
def test_compiles_without_graph_breaks_and_reuses_the_graph_for_new_offsets() -> None:
    fn, (q, k, v), cu_q, cu_k = _compiled_case()
    explained = torch._dynamo.explain(fn)(q, k, v, cu_q, cu_k)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    frames = {"count": 0}

    def backend(gm: Any, example_inputs: Any) -> Any:
        frames["count"] += 1
        return gm.forward

    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    with torch.no_grad():
        for cu in (cu_q, cu_seqlens([5, 2, 5])):
            torch.testing.assert_close(compiled(q, k, v, cu, cu_k), fn(q, k, v, cu, cu_k))
    assert frames["count"] == 1


@pytest.mark.usefixtures("_fresh_dynamo")
def test_backward_through_an_inductor_compile() -> None:
    fn, inputs, cu_q, cu_k = _compiled_case()
    q, k, v = (t.clone().requires_grad_() for t in inputs)
    out = torch.compile(fn, fullgraph=True)(q, k, v, cu_q, cu_k)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    q, k, v = (t.clone().requires_grad_() for t in inputs)
    eager = fn(q, k, v, cu_q, cu_k)
    torch.testing.assert_close(out, eager)
    for got, want in zip(grads, torch.autograd.grad(eager, (q, k, v), grad_out), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("_fresh_dynamo")
def test_a_length_dependent_mask_is_refused_while_traced() -> None:
    q, k, v = _inputs([2, 3], [4, 5])
    fn = torch.compile(
        lambda *a: fz.varlen_attention(*a, 3, 5, mask=masks.Causal(align="bottom_right")),
        fullgraph=True,
        backend="aot_eager",
    )
    with pytest.raises(Exception, match="not known while torch.compile traces"):
        fn(q, k, v, cu_seqlens([2, 3]), cu_seqlens([4, 5]))


def test_the_varlen_route_takes_packs_of_other_key_lengths() -> None:
    """The route's own checks (the kernel is CUDA-only: the GPU suite runs it)."""
    spec = _packed(PREFILL_Q, PREFILL_K, (-1, 0))

    def problem(mask: Any, q_len: int, kv_len: int) -> Problem:
        return Problem(
            batch=1, heads=H, kv_heads=H, q_len=q_len, kv_len=kv_len, head_dim=64, dtype=torch.bfloat16,
            device_type="cuda", arch="sm90", requires_grad=True, mask=mask, score=None, return_lse=False,
        )  # fmt: skip

    tq, tk = sum(PREFILL_Q), sum(PREFILL_K)
    assert BY_NAME["varlen"].mask_reasons(problem(spec, tq, tk)) == []
    assert "needs Lq == Lkv when a mask is given" in BY_NAME["fa4"].mask_reasons(problem(spec, tq, tk))
    assert any("Lq == Lkv" in r for r in BY_NAME["varlen"].mask_reasons(problem(None, tq, tk)))
    mixed = _packed(LENS_Q, LENS_K, (-1, -1))
    (reason,) = BY_NAME["varlen"].mask_reasons(problem(mixed, sum(LENS_Q), sum(LENS_K)))
    assert "no exact varlen form" in reason and "fz.varlen_attention" in reason
