"""The drop-in surfaces on CUDA, against the float64 reference, forward and backward: tensor masks
(``masks.Dense``) and biases (``score_mods.Bias``, with the bias's own gradient), ``is_causal=``,
``layout="bshd"``, ``fz.varlen_attention`` on packed sequences, value head dims other than the
query's, and paged decoding from serving-stack pools (``append_kv`` + ``decode_step(kv_layout=)``).

A (case, route) pair whose route refuses the problem is skipped with the route's reasons; the
``*_coverage`` tests assert that the routes that must run each surface do.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from zoo_oracles import cu_seqlens

import flexattn_zoo as fz
from flexattn_zoo import _compat, masks, score_mods
from flexattn_zoo.arch import PRIORITY, ordered_routes
from flexattn_zoo.backends import BACKENDS
from flexattn_zoo.models import decode
from flexattn_zoo.testing import assert_matches_reference, reference_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
B, H, L, D = 2, 4, 197, 64
GPU_AUTO = frozenset().union(*(ordered_routes(gen) for gen in PRIORITY if gen != "cpu"))
ROUTES = ["auto", *(b.name for b in BACKENDS if b.name in GPU_AUTO)]


def _qkv(lq: int = L, lkv: int = L, *, hkv: int = H, d: int = D, dv: int | None = None, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator(device=DEV).manual_seed(seed)

    def make(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_(True)

    return make(B, H, lq, d), make(B, hkv, lkv, d), make(B, hkv, lkv, d if dv is None else dv)


def _planned(q, k, v, route: str, **kw: Any) -> None:  # type: ignore[no-untyped-def]
    try:
        fz.plan(q, k, v, backend=route, **kw)
    except ValueError as exc:
        pytest.skip(f"{route} refuses: {exc}")


def _fwd_bwd_check(q, k, v, route: str, *, ref_kw: dict[str, Any] | None = None, **kw: Any):  # type: ignore[no-untyped-def]
    _planned(q, k, v, route, **kw)
    out = fz.attention(q, k, v, backend=route, **kw)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(out, q, k, v, grads=grads, grad_out=grad_out, **(ref_kw or kw))
    return out


def _bool_masks() -> dict[str, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(3)
    full = torch.rand(B, H, L, L, device=DEV, generator=g) < 0.5
    full[0, 0, 2] = False  # a row that sees nothing: output 0 by the library's convention
    keys = torch.rand(B, 1, 1, L, device=DEV, generator=g) < 0.7
    keys[:, :, :, 0] = True  # key padding as models build it: every row keeps a key
    return {
        "full": full,
        "key_padding": keys,
        "two_d": torch.rand(L, L, device=DEV, generator=g) < 0.4,
        "causal_tensor": torch.ones(L, L, device=DEV, dtype=torch.bool).tril(),
    }


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("mask", [None, "causal"])
def test_inputs_starting_off_a_16_byte_boundary(route: str, mask: str | None) -> None:
    """Contiguous q/k/v that start 2 bytes past an allocation's start (``flat[1:].view(...)``):
    the fused SDPA kernels' vector loads faulted on them ("misaligned address"); every route must
    copy or otherwise run them, forward and backward, and match float64."""
    g = torch.Generator(device=DEV).manual_seed(12)
    n = B * H * L * D

    def shifted() -> torch.Tensor:
        flat = torch.randn(n + 1, device=DEV, dtype=torch.bfloat16, generator=g)
        return flat[1:].view(B, H, L, D).detach().requires_grad_(True)

    q, k, v = shifted(), shifted(), shifted()
    assert q.is_contiguous() and q.data_ptr() % 16 != 0
    _fwd_bwd_check(q, k, v, route, mask=mask)


@pytest.mark.parametrize("route", [r for r in ROUTES if r == "auto" or r.startswith("sdpa")])
def test_a_misaligned_start_after_aligned_calls_of_the_same_strides(route: str) -> None:
    """A cache prefix (``cache[:, :, :n]``, read in place) starting on a 16-byte boundary, then
    one of the same shape and strides starting 2 bytes past it: the second call is a plan-cache
    hit whose bound SDPA call decided its layout on the first, and must still copy the
    misaligned one (the fused kernels faulted on it) and match float64."""
    g = torch.Generator(device=DEV).manual_seed(13)
    q = torch.randn(B, H, 1, D, device=DEV, dtype=torch.bfloat16, generator=g)
    for offset in (0, 1, 0):
        flat = torch.randn(B * H * 2 * L * D + 1, device=DEV, dtype=torch.bfloat16, generator=g)
        cache = flat[offset : offset + B * H * 2 * L * D].view(B, H, 2 * L, D)
        k = v = cache[:, :, :L]
        assert (k.data_ptr() % 16 != 0) is bool(offset)
        _planned(q, k, v, route)
        out = fz.attention(q, k, v, backend=route)
        assert_matches_reference(out, q, k, v)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("which", ["full", "key_padding", "two_d", "causal_tensor"])
def test_bool_tensor_masks(route: str, which: str) -> None:
    m = _bool_masks()[which]
    q, k, v = _qkv()
    out = _fwd_bwd_check(q, k, v, route, mask=m, ref_kw={"mask": masks.Dense(mask=m)})
    if which == "full":
        assert torch.equal(out[0, 0, 2].float(), torch.zeros_like(out[0, 0, 2].float()))


@pytest.mark.parametrize("route", ROUTES)
def test_float_bias_and_its_gradient(route: str) -> None:
    q, k, v = _qkv()
    g = torch.Generator(device=DEV).manual_seed(5)
    bias = torch.randn(1, H, L, L, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    spec = score_mods.Bias(bias=bias)
    _planned(q, k, v, route, mask="causal", score_mod=spec)
    out = fz.attention(q, k, v, mask="causal", score_mod=spec, backend=route)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, bias), grad_out, allow_unused=True)
    assert_matches_reference(
        out, q, k, v, mask="causal", score_mod=score_mods.Bias(bias=bias.detach()),
        grads=got[:3], grad_out=grad_out,
    )  # fmt: skip
    # Routes without a bias gradient refuse a bias that requires grad (score_mods.Bias), so a
    # route that ran must have given it.
    assert got[3] is not None, route
    ins = [t.detach().double().requires_grad_(True) for t in (q, k, v, bias)]
    ref = reference_attention(*ins[:3], mask="causal", score_mod=score_mods.Bias(bias=ins[3]))
    want = torch.autograd.grad(ref, ins[3], grad_out.double())[0]
    # bf16 bias gradient (dS summed in the kernel's precision, rounded to bf16: 2^-8 relative)
    # against float64: a few bf16 ulps of the largest entry.
    err = float((got[3].double() - want).abs().max())
    assert err <= 2e-2 * float(want.abs().max()) + 1e-3, (route, err, float(want.abs().max()))


def test_tensor_mask_coverage() -> None:
    """auto and the kernels that take SDPA's attn_mask run a key-padding mask; flex runs any; a
    learned bias runs (with its gradient) on auto and flex."""
    m = _bool_masks()
    q, k, v = _qkv()
    bias = torch.zeros(1, H, L, L, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    for route in ("auto", "flex"):
        fz.plan(q, k, v, mask="causal", score_mod=score_mods.Bias(bias=bias), backend=route)
    for route, which in (
        ("auto", "full"),
        ("flex", "full"),
        ("auto", "key_padding"),
        ("sdpa_efficient", "key_padding"),
    ):
        fz.plan(q, k, v, mask=m[which], backend=route)


@pytest.mark.parametrize("lq,lkv", [(L, L), (64, L), (L, 64)])
def test_is_causal_is_sdpas(lq: int, lkv: int) -> None:
    """``is_causal=True`` means what SDPA means (top-left), and agrees with SDPA itself."""
    q, k, v = _qkv(lq, lkv)
    out = _fwd_bwd_check(q, k, v, "auto", is_causal=True, ref_kw={"mask": masks.Causal()})
    # Top-left causal leaves no row empty (every query sees key 0). Two bf16 kernels: outputs of
    # magnitude <= ~3 agree to a few bf16 ulps (2^-8 relative).
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("mask", ["causal", None])
def test_bshd_layout_equals_bhsd(route: str, mask: str | None) -> None:
    q, k, v = _qkv(hkv=2)
    _planned(q, k, v, route, mask=mask, enable_gqa=True)
    want = fz.attention(q, k, v, mask=mask, enable_gqa=True, backend=route)
    qs, ks, vs = (t.detach().transpose(1, 2).requires_grad_(True) for t in (q, k, v))
    got = fz.attention(qs, ks, vs, mask=mask, enable_gqa=True, backend=route, layout="bshd")
    assert got.shape == (B, L, H, D)
    grad_out = torch.randn_like(got)
    grads = torch.autograd.grad(got, (qs, ks, vs), grad_out)
    assert_matches_reference(
        got.transpose(1, 2), q, k, v, mask=mask, enable_gqa=True,
        grads=[t.transpose(1, 2) for t in grads], grad_out=grad_out.transpose(1, 2),
    )  # fmt: skip
    # The same route on views of the same data; a kernel may still take another code path for the
    # other strides (a copy to its fused layout, other tiles): bf16 rounding apart, 2^-8 relative.
    torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-2, rtol=1e-2)


SDPA_ROUTES = [b.name for b in BACKENDS if b.name.startswith("sdpa") and b.name in GPU_AUTO] + ["sdpa_math"]


def _strided_views(t: torch.Tensor, which: str) -> torch.Tensor:
    """Views the fused SDPA kernels read without a copy (``backends.base.is_dense_block``)."""
    if which == "cache_prefix":  # k_cache[:, :, :n]
        return t[:, :, : t.shape[2] // 2 + 3]
    if which == "bshd_prefix":
        return t.transpose(1, 2)[:, : t.shape[2] // 2 + 3].transpose(1, 2)
    if which == "every_other_row":
        return t[:, :, ::2]
    if which == "d_slice_unaligned":  # rows of 64 inside rows of 67: not 16-byte aligned, copied
        return t[..., :64]
    assert which == "d_slice"
    return t[..., : t.shape[3] // 2]


@pytest.mark.parametrize("route", SDPA_ROUTES)
@pytest.mark.parametrize(
    "which", ["cache_prefix", "bshd_prefix", "every_other_row", "d_slice", "d_slice_unaligned"]
)
@pytest.mark.parametrize("lq", [1, 48])
def test_sdpa_kernels_on_strided_kv_views(route: str, which: str, lq: int) -> None:
    """Strided k/v views (a cache's live prefix, a slice of every other row or of D) reach the
    fused kernels as they are, forward and backward, and match float64."""
    g = torch.Generator(device=DEV).manual_seed(11)
    d = {"d_slice": 2 * D, "d_slice_unaligned": 67}.get(which, D)
    # As many k/v heads as q heads: grouped heads would be expanded (copied) by some routes.
    k_full, v_full = (
        torch.randn(B, H, 300, d, device=DEV, dtype=torch.bfloat16, generator=g, requires_grad=True)
        for _ in range(2)
    )
    k, v = _strided_views(k_full, which), _strided_views(v_full, which)
    q = torch.randn(B, H, lq, k.shape[3], device=DEV, dtype=torch.bfloat16, generator=g, requires_grad=True)
    _planned(q, k, v, route)
    out = fz.attention(q, k, v, backend=route)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(out, q, k, v, grads=grads, grad_out=grad_out)


FLEX_ROUTES = ["auto", "flex", "flex_flash", "fa4"]


@pytest.mark.parametrize("route", FLEX_ROUTES)
@pytest.mark.parametrize("hkv", [H, 1])
@pytest.mark.parametrize("lq", [1, 48])
def test_flex_routes_on_cache_prefixes(route: str, hkv: int, lq: int) -> None:
    """The flex routes read a cache's live prefix ``cache[:, :, :n]`` where it lies (no copy),
    the length changing call to call (one dynamic-length graph), forward and backward, against
    float64; with and without grouped heads."""
    g = torch.Generator(device=DEV).manual_seed(12)
    k_cache, v_cache = (
        torch.randn(B, hkv, 300, D, device=DEV, dtype=torch.bfloat16, generator=g, requires_grad=True)
        for _ in range(2)
    )
    q = torch.randn(B, H, lq, D, device=DEV, dtype=torch.bfloat16, generator=g, requires_grad=True)
    for n in (150, 151, 203):
        k, v = k_cache[:, :, :n], v_cache[:, :, :n]
        _planned(q, k, v, route, enable_gqa=hkv != H)
        out = fz.attention(q, k, v, backend=route, enable_gqa=hkv != H)
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        assert_matches_reference(out, q, k, v, grads=grads, grad_out=grad_out, enable_gqa=hkv != H)


@pytest.mark.parametrize("route", ROUTES)
def test_value_head_dim_192_128(route: str) -> None:
    """DeepSeek-style heads: q/k 192, v 128."""
    q, k, v = _qkv(d=192, dv=128)
    out = _fwd_bwd_check(q, k, v, route, mask="causal")
    assert out.shape == (B, H, L, 128)


@pytest.mark.parametrize("d", [96, 192, 256])
@pytest.mark.parametrize("case", ["causal", "window_softcap"])
def test_fa4_head_dims(d: int, case: str) -> None:
    """FA4's own kernels at the head dims the route takes on sm90, GQA, forward and backward
    (planned without a skip: the route must accept these)."""
    if not _compat.flash_cute_available():
        pytest.skip("flash_attn.cute (FA4) is not installed")
    q, k, v = _qkv(hkv=2, d=d)
    kw: dict[str, Any] = {"mask": "causal", "enable_gqa": True}
    if case == "window_softcap":
        kw = {"mask": masks.SlidingWindow(left=64) & masks.Causal(), "enable_gqa": True,
              "score_mod": score_mods.SoftCap(cap=5.0, approx=True)}  # fmt: skip
    fz.plan(q, k, v, backend="fa4", **kw)
    out = _fwd_bwd_check(q, k, v, "fa4", **kw)
    assert out.shape == (B, H, L, d)


@pytest.mark.parametrize("case", ["causal", "window_softcap"])
def test_fa4_value_head_dim(case: str) -> None:
    """FA4's own kernels at q/k 192 with v 128 (DeepSeek-style), forward and backward against
    float64 without GQA, forward with GQA (its grouped backward asserts equal dims: refused)."""
    if not _compat.flash_cute_available():
        pytest.skip("flash_attn.cute (FA4) is not installed")
    kw: dict[str, Any] = {"mask": "causal"}
    if case == "window_softcap":
        kw = {
            "mask": masks.SlidingWindow(left=64) & masks.Causal(),
            "score_mod": score_mods.SoftCap(cap=5.0, approx=True),
        }
    q, k, v = _qkv(d=192, dv=128)
    out = _fwd_bwd_check(q, k, v, "fa4", **kw)
    assert out.shape == (B, H, L, 128)
    q, k, v = _qkv(hkv=2, d=192, dv=128)
    with torch.no_grad():
        out = fz.attention(q, k, v, backend="fa4", enable_gqa=True, **kw)
    assert_matches_reference(out, q.detach(), k.detach(), v.detach(), enable_gqa=True, **kw)
    with pytest.raises(ValueError, match="value head dim equal"):
        fz.attention(q, k, v, backend="fa4", enable_gqa=True, **kw)


def test_value_head_dim_coverage() -> None:
    q, k, v = _qkv(d=192, dv=128)
    for route in ("auto", "flex", "sdpa_math", "sdpa", "sdpa_cudnn"):
        fz.plan(q, k, v, mask="causal", backend=route)


# ---- fz.varlen_attention ------------------------------------------------------------------------

LENS_Q = [5, 170, 0, 93, 40, 3]
LENS_K = [5, 230, 3, 93, 20, 0]
#: Chunked prefill: every sequence has at least as many keys (cache + new tokens) as queries.
PREFILL_Q = [5, 170, 93, 20, 3]
PREFILL_K = [5, 230, 93, 64, 40]
VARLEN_LENGTHS = {"square": (LENS_Q, LENS_Q), "mixed": (LENS_Q, LENS_K), "prefill": (PREFILL_Q, PREFILL_K)}


VARLEN_CASES = {
    "no_mask": ({}, lambda lq, lk: None),
    "causal": ({"causal": True}, lambda lq, lk: masks.Band(lo=None, hi=lk - lq)),
    "window": ({"window_size": (16, 4)}, lambda lq, lk: masks.Band(lo=lk - lq - 16, hi=lk - lq + 4)),
    "local_sliding": ({"mask": masks.SlidingWindow(left=8)}, lambda lq, lk: masks.SlidingWindow(left=8)),
    "softcap": ({"causal": True, "score_mod": score_mods.SoftCap(cap=5.0)}, lambda lq, lk: masks.Band(lo=None, hi=lk - lq)),
}  # fmt: skip
VARLEN_ROUTES = ["auto", "varlen", "flex", "fa4", "flex_flash"]


@pytest.mark.parametrize("route", VARLEN_ROUTES)
@pytest.mark.parametrize("case", list(VARLEN_CASES))
@pytest.mark.parametrize("lengths", list(VARLEN_LENGTHS))
def test_varlen_attention_per_sequence(route: str, case: str, lengths: str) -> None:
    kw, local = VARLEN_CASES[case]
    lens_q, lens_k = VARLEN_LENGTHS[lengths]
    g = torch.Generator(device=DEV).manual_seed(1)
    q, k, v = (
        torch.randn(sum(n), H, D, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_(True)
        for n in (lens_q, lens_k, lens_k)
    )
    args = (q, k, v, cu_seqlens(lens_q, device=DEV), cu_seqlens(lens_k, device=DEV), max(lens_q), max(lens_k))
    try:
        out = fz.varlen_attention(*args, backend=route, **kw)
    except ValueError as exc:
        # The varlen route runs FlashAttention's own conventions (no mask= or score_mod=) on
        # packs where every query sees a key; "mixed" has queries without keys.
        if (
            "cannot run this call" not in str(exc)
            or route in ("auto", "flex")
            or (route == "varlen" and lengths != "mixed" and not {"score_mod", "mask"} & set(kw))
        ):
            raise
        pytest.skip(f"{route} refuses: {exc}")
    assert out.shape == (sum(lens_q), H, D)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    q0 = k0 = 0
    for lq, lk in zip(lens_q, lens_k, strict=True):
        sl_q, sl_k = slice(q0, q0 + lq), slice(k0, k0 + lk)
        q0, k0 = q0 + lq, k0 + lk
        if lq == 0:
            continue
        if lk == 0:  # no key: output 0 and no gradient flows
            assert not out[sl_q].float().abs().any()
            assert not grads[0][sl_q].float().abs().any()
            continue

        def seq(t: torch.Tensor, s: slice) -> torch.Tensor:
            return t[s].transpose(0, 1)[None]

        ref_kw: dict[str, Any] = {"mask": local(lq, lk)}
        if "score_mod" in kw:
            ref_kw["score_mod"] = kw["score_mod"]
        assert_matches_reference(
            seq(out, sl_q), seq(q, sl_q), seq(k, sl_k), seq(v, sl_k),
            grads=(seq(grads[0], sl_q), seq(grads[1], sl_k), seq(grads[2], sl_k)),
            grad_out=seq(grad_out, sl_q), **ref_kw,
        )  # fmt: skip


# ---- paged decoding from serving-stack pools ---------------------------------------------------

PAGE, CAP, HKV = 16, 512, 2


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("route", ["auto", "flex", "dense"])
@pytest.mark.parametrize("lq", [1, 4])
def test_paged_decode_matches_a_dense_cache(layout: str, route: str, lq: int) -> None:
    """Pools of garbage, rows of different lengths written by ``append_kv`` through a scattered
    block table, then one step: equal to the float64 reference over a dense cache."""
    g = torch.Generator(device=DEV).manual_seed(7)
    n_pages = 2 * B * CAP // PAGE
    shape = (n_pages, PAGE, HKV, D) if layout == "NHD" else (n_pages, HKV, PAGE, D)
    pools = [torch.randn(*shape, device=DEV, generator=g) * 50 for _ in range(2)]
    width = CAP // PAGE
    perm = torch.randperm(n_pages, device=DEV, generator=g)
    table = perm[: B * width].view(B, width).to(torch.int32)
    dense = [torch.zeros(B, HKV, CAP, D, device=DEV) for _ in range(2)]
    lens = torch.zeros(B, dtype=torch.int32, device=DEV)
    for n in (300, lq):  # a prefill, then this step's tokens
        kn, vn = (torch.randn(B, HKV, n, D, device=DEV, generator=g) for _ in range(2))
        for b in range(B):
            start = int(lens[b])
            dense[0][b, :, start : start + n] = kn[b]
            dense[1][b, :, start : start + n] = vn[b]
        lens = decode.append_kv(*pools, table, lens, kn, vn, kv_layout=layout)
    q = torch.randn(B, H, lq, D, device=DEV, generator=g)
    with torch.no_grad():
        out = decode.decode_step(q, *pools, lens, block_table=table, kv_layout=layout, backend=route)
    n = int(lens[0])
    assert lens.tolist() == [300 + lq] * B
    full_q = torch.zeros(B, H, n, D, dtype=torch.float64, device=DEV)
    full_q[:, :, n - lq :] = q.double()
    ref = reference_attention(
        full_q, dense[0][:, :, :n].double(), dense[1][:, :, :n].double(), mask=masks.Causal(), enable_gqa=True
    )[:, :, n - lq :]
    # float32 kernels (TF32 off) over ~300 unit-scale keys
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=5e-5)


# ---- dropout on the CUDA kernels ----------------------------------------------------------------

DROP_ROUTES = ["auto", "sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math"]


@pytest.mark.parametrize("route", DROP_ROUTES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dropout_share_scale_and_backward(route: str, dtype: torch.dtype) -> None:
    """q = k = 0 makes every probability 1/Lkv and v = I makes the output the dropped probability
    matrix: the dropped share is p within a binomial bound, every kept entry is 1/(Lkv (1 - p)),
    the same seed redraws the same mask, and dv = A^T g for that dropped matrix A."""
    p, lq, lkv = 0.25, 128, 64
    q = torch.zeros(2, 4, lq, lkv, device=DEV, dtype=dtype, requires_grad=True)
    k = torch.zeros(2, 4, lkv, lkv, device=DEV, dtype=dtype)
    v = torch.eye(lkv, device=DEV, dtype=dtype).expand(2, 4, lkv, lkv).clone().requires_grad_(True)
    _planned(q, k, v, route, dropout_p=p)
    torch.manual_seed(3)
    out = fz.attention(q, k, v, backend=route, dropout_p=p)
    torch.manual_seed(3)
    assert torch.equal(out, fz.attention(q, k, v, backend=route, dropout_p=p))
    dropped = out == 0
    n = dropped.numel()
    share = dropped.double().mean().item()
    assert abs(share - p) < 5 * (p * (1 - p) / n) ** 0.5, f"dropped {share:.4f} of {n}, p = {p}"
    kept = out[~dropped].double()
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / (lkv * (1 - p))), rtol=1e-2, atol=0)
    g = torch.randn_like(out)
    (dv,) = torch.autograd.grad(out, (v,), g)
    want = out.detach().double().transpose(-1, -2) @ g.double()
    torch.testing.assert_close(dv.double(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dropout_coverage(dtype: torch.dtype) -> None:
    """Every route whose kernel drops accepts the problem the test above runs (no skip there)."""
    q = torch.zeros(2, 4, 128, 64, device=DEV, dtype=dtype, requires_grad=True)
    kv = torch.zeros(2, 4, 64, 64, device=DEV, dtype=dtype, requires_grad=True)
    for route in DROP_ROUTES:
        fz.plan(q, kv, kv, backend=route, dropout_p=0.25)
