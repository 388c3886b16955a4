"""Every zoo preset x every route that claims it, forward and backward, vs the float64 reference.

Runs on a CUDA machine (`pytest -m gpu`). A (preset, route) pair whose route refuses the problem is
reported as skipped with the route's reasons; ``test_route_coverage`` asserts that each route
accepts the presets it must accept, so a route that silently refuses everything fails.
"""

from __future__ import annotations

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import _compat, masks, score_mods
from flexattn_zoo.arch import PRIORITY, ordered_routes
from flexattn_zoo.backends import BACKENDS, BY_NAME
from flexattn_zoo.backends.flex import FlexBackend
from flexattn_zoo.compile import CACHE as COMPILE_CACHE
from flexattn_zoo.compile import STATIC_SHAPES, UnfusedFallbackError
from flexattn_zoo.testing import assert_matches_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
B, H, L = 2, 4, 333  # L is not a multiple of 128 on purpose


def _doc() -> masks.Document:
    return masks.Document.from_lengths([[100, 150, 83], [20, 313]])


def _left_padded(length: int) -> masks.KeyPadding:
    valid = torch.ones(B, length, dtype=torch.bool)
    valid[1, :37] = False
    return masks.KeyPadding(valid=valid)


PRESETS = {
    "full": (lambda: None, None),
    "causal": (lambda: masks.Causal(), None),
    "causal_br_lq_lt_lkv": (lambda: masks.Causal(align="bottom_right"), (200, 333)),
    "causal_tl_lq_gt_lkv": (lambda: masks.Causal(), (333, 200)),
    "sliding": (lambda: masks.SlidingWindow(left=64, right=16), None),
    "document_causal": (lambda: _doc() & masks.Causal(), None),
    "prefix_lm": (lambda: masks.PrefixLM(prefix_len=torch.tensor([40, 300])), None),
    "prefix_lm_int": (lambda: masks.PrefixLM(prefix_len=100), None),  # split form: sdpa_split
    "chunked_causal": (lambda: masks.Chunked(size=128) & masks.Causal(), None),
    "chunked_equal_causal": (lambda: masks.Chunked(size=111) & masks.Causal(), None),  # 333 = 3 chunks
    "chunked_equal": (lambda: masks.Chunked(size=111), None),
    "alibi_causal": (lambda: masks.Causal(), "alibi"),  # flex routes drop ALiBi's abs here
    "alibi_sliding": (lambda: masks.SlidingWindow(left=64, right=16), "alibi"),  # ...and keep it here
    "softcap_causal": (lambda: masks.Causal(), "softcap"),
    "softcap_approx_causal": (lambda: masks.Causal(), "softcap_approx"),
    "fully_masked_rows": (lambda: masks.Causal(align="bottom_right"), (333, 200)),
    # A part that binds to one holding its offset in a tensor on its own device (OffsetCausal),
    # inside a composite: moving the composite to the GPU must move that tensor too.
    "causal_br_padded_lq_lt_lkv": (
        lambda: masks.Causal(align="bottom_right") & _left_padded(333),
        (200, 333),
    ),
}
#: Every registered route that auto may pick on some GPU generation, in registration order (dense,
#: never picked there, is checked against the reference on the CPU).
GPU_AUTO = frozenset().union(*(ordered_routes(gen) for gen in PRIORITY if gen != "cpu"))
ROUTES = [b.name for b in BACKENDS if b.name in GPU_AUTO]
#: Routes that evaluate a user's mask_mod callable themselves (the flex family), on CUDA.
CALLABLE_MASK_ROUTES = [r for r in ROUTES if isinstance(BY_NAME[r], FlexBackend)]
#: GQA through each kernel's own path. Left out: sdpa_split (no split form for the causal mask
#: used here; its GQA runs in test_sdpa_split_prefix), sdpa_efficient (no GQA) and sdpa_math (not
#: part of this test so far).
GQA_ROUTES = [r for r in ROUTES if BY_NAME[r].gqa and r not in ("sdpa_split", "sdpa_math")]


def _score(kind):  # type: ignore[no-untyped-def]
    if kind == "alibi":
        return score_mods.Alibi(num_heads=H)
    if kind == "softcap":
        return score_mods.SoftCap(cap=5.0)
    if kind == "softcap_approx":
        return score_mods.SoftCap(cap=5.0, approx=True)
    return None


def _inputs(lq: int, lkv: int, dtype: torch.dtype, d: int = 64, hkv: int = H, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, H, lq, d, device=DEV, dtype=dtype, generator=g).requires_grad_(True)
    k = torch.randn(B, hkv, lkv, d, device=DEV, dtype=dtype, generator=g).requires_grad_(True)
    v = torch.randn(B, hkv, lkv, d, device=DEV, dtype=dtype, generator=g).requires_grad_(True)
    return q, k, v


def _check(q, k, v, route, mask, score, *, gqa=False, lse=True):  # type: ignore[no-untyped-def]
    plan = None
    try:
        plan = fz.plan(q, k, v, mask=mask, score_mod=score, backend=route, enable_gqa=gqa, return_lse=lse)
    except ValueError:
        try:  # the route may serve the call without lse (SDPA has none)
            plan = fz.plan(q, k, v, mask=mask, score_mod=score, backend=route, enable_gqa=gqa)
            lse = False
        except ValueError as exc:
            pytest.skip(f"{route} refuses: {exc}")
    assert plan is not None and plan.backend == route
    res = fz.attention(q, k, v, mask=mask, score_mod=score, backend=route, enable_gqa=gqa, return_lse=lse)
    out, out_lse = res if lse else (res, None)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(
        out, q, k, v, mask=mask, score_mod=score, enable_gqa=gqa, lse=out_lse, grads=grads, grad_out=grad_out
    )
    return out


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_preset_route_fwd_bwd(preset: str, route: str) -> None:
    make_mask, extra = PRESETS[preset]
    lq, lkv = extra if isinstance(extra, tuple) else (L, L)
    score = _score(extra) if isinstance(extra, str) else None
    q, k, v = _inputs(lq, lkv, torch.bfloat16)
    out = _check(q, k, v, route, make_mask(), score)
    if preset == "fully_masked_rows":
        assert torch.equal(out[:, :, : lq - lkv].float(), torch.zeros_like(out[:, :, : lq - lkv].float()))


@pytest.mark.parametrize("route", CALLABLE_MASK_ROUTES)
@pytest.mark.parametrize("preset", ["causal", "document_causal", "softcap_causal", "alibi_sliding"])
def test_flex_route_repeated_calls_run_their_graph_unguarded_exactly(
    preset: str, route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From its second call a flex route's plan-cache hit runs the compiled graph without Dynamo
    (``CompiledFlex.run_unguarded``): forward and backward stay exact, with new values each call,
    with and without grad. Counted from each mode's first call, which earlier tests of the same
    signature in this process may already have planned."""
    from compiled_flex_spy import counts, spy_compiled_flex

    calls = spy_compiled_flex(monkeypatch)
    make_mask, extra = PRESETS[preset]
    score = _score(extra) if isinstance(extra, str) else None
    mask = make_mask()
    if not _accepts(route, preset):
        pytest.skip(f"{route} refuses {preset}")
    for seed in range(3):
        q, k, v = _inputs(L, L, torch.bfloat16, seed=seed)
        _check(q, k, v, route, mask, score)
        if seed == 0:
            after_first = counts(calls)[2]
    assert counts(calls)[2] == after_first + 2
    with torch.no_grad():
        for seed in range(3):
            q, k, v = (t.detach() for t in _inputs(L, L, torch.bfloat16, seed=seed))
            out = fz.attention(q, k, v, mask=mask, score_mod=score, backend=route)
            assert_matches_reference(out, q, k, v, mask=mask, score_mod=score)
            if seed == 0:
                after_first = counts(calls)[2]
    assert counts(calls)[2] == after_first + 2


@pytest.mark.parametrize("route", CALLABLE_MASK_ROUTES)
def test_flex_route_repeated_calls_under_autocast_run_unguarded_exactly(
    route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Training under ``torch.autocast``: repeated hits run the unguarded graph (autocast's state
    is part of the global state it is checked against), forward and backward exact; the same
    inputs outside the region go through Dynamo once, then run unguarded again."""
    from compiled_flex_spy import counts, spy_compiled_flex

    calls = spy_compiled_flex(monkeypatch)
    mask = masks.SlidingWindow(left=100, right=0) & masks.Causal()
    if not _accepts(route, "sliding"):
        pytest.skip(f"{route} refuses sliding")
    for seed in range(3):
        q, k, v = _inputs(L, L, torch.bfloat16, seed=seed)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fz.attention(q, k, v, mask=mask, backend=route)
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        assert_matches_reference(out, q, k, v, mask=mask, grads=grads, grad_out=grad_out)
        if seed == 0:
            after_first = counts(calls)
    assert counts(calls)[2] == after_first[2] + 2
    for seed in range(2):
        q, k, v = _inputs(L, L, torch.bfloat16, seed=seed)
        out = fz.attention(q, k, v, mask=mask, backend=route)
        assert_matches_reference(out, q, k, v, mask=mask)
    assert counts(calls)[0] == after_first[0] + 1
    assert counts(calls)[2] == after_first[2] + 3


@pytest.mark.parametrize("route", CALLABLE_MASK_ROUTES)
def test_flex_route_self_attention_then_distinct_inputs_of_one_signature(route: str) -> None:
    """``fz.attention(x, x, x)`` and then three distinct tensors of the same shapes share a plan
    (the key pins shapes, not identity), but not the graph: Dynamo passes one object to its
    graph once, so the graph compiled for x, x, x must not run for q, k, v."""
    mask = masks.SlidingWindow(left=64, right=0)
    if not _accepts(route, "sliding"):
        pytest.skip(f"{route} refuses sliding")
    with torch.no_grad():
        x = _inputs(L, L, torch.bfloat16, seed=3)[0].detach()
        for _ in range(2):
            assert_matches_reference(fz.attention(x, x, x, mask=mask, backend=route), x, x, x, mask=mask)
        for seed in range(2):
            q, k, v = (t.detach() for t in _inputs(L, L, torch.bfloat16, seed=seed))
            out = fz.attention(q, k, v, mask=mask, backend=route)
            assert_matches_reference(out, q, k, v, mask=mask)


def _accepts(route: str, preset: str) -> bool:
    make_mask, extra = PRESETS[preset]
    lq, lkv = extra if isinstance(extra, tuple) else (L, L)
    score = _score(extra) if isinstance(extra, str) else None
    q = torch.empty(B, H, lq, 64, device=DEV, dtype=torch.bfloat16)
    kv = torch.empty(B, H, lkv, 64, device=DEV, dtype=torch.bfloat16)
    try:
        fz.plan(q, kv, kv, mask=make_mask(), score_mod=score, backend=route)
    except ValueError:
        return False
    return True


def test_route_coverage() -> None:
    """Routes must accept what they claim (so a route that refuses everything cannot hide behind
    skipped cases above); checked by planning only, independent of which tests were selected."""
    accepted = {r: {p for p in PRESETS if _accepts(r, p)} for r in ROUTES}
    assert set(PRESETS) == accepted["flex"], accepted["flex"]
    for r in ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math"):
        assert {"full", "causal", "chunked_equal_causal", "chunked_equal"} <= accepted[r], (r, accepted[r])
    assert accepted["sdpa_split"] == {"prefix_lm_int"}, accepted["sdpa_split"]
    chunks = {"chunked_causal", "chunked_equal_causal", "chunked_equal"}
    assert {"full", "causal", "sliding", "document_causal"} | chunks <= accepted["varlen"], accepted["varlen"]
    if _compat.flash_cute_available():
        # Every preset but those whose mask reads captured 0-d offsets (bottom-right causal with
        # Lq != Lkv binds to OffsetCausal): FA4's CuTe mask codegen cannot load them on torch 2.11.
        offsets = {"causal_br_lq_lt_lkv", "fully_masked_rows", "causal_br_padded_lq_lt_lkv"}
        assert set(PRESETS) - offsets == accepted["flex_flash"], accepted["flex_flash"]
        fa4 = {"full", "causal", "sliding", "document_causal", "softcap_approx_causal"} | chunks
        assert fa4 == accepted["fa4"], accepted["fa4"]


@pytest.mark.parametrize("route", CALLABLE_MASK_ROUTES)
def test_callable_mask_indexing_cuda_document_ids(route: str) -> None:
    """A hand-written document mask indexing CUDA ids (the usual way to write one) is accepted and
    exact: the callable is probed with indices on the ids' device."""
    ids = torch.repeat_interleave(torch.arange(3, device=DEV), torch.tensor([100, 150, 83], device=DEV))

    def doc_causal(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (ids[q_idx] == ids[kv_idx]) & (kv_idx <= q_idx)

    q, k, v = _inputs(L, L, torch.bfloat16)
    _check(q, k, v, route, doc_causal, None)


@pytest.mark.parametrize(
    "make",
    [
        lambda: _doc() & masks.Causal(),
        lambda: masks.SlidingWindow(left=40) & _doc() & masks.Causal(),
        lambda: masks.PerDocument(inner=masks.Causal(), documents=_doc()),
        lambda: masks.SharedPrefix.from_lengths(40, [100, 120, 73]),
    ],
    ids=["document_causal", "window_document_causal", "per_document_causal", "shared_prefix"],
)
@pytest.mark.parametrize(("lq", "lkv"), [(L, L), (L, 200), (200, L)])
def test_flex_runs_packed_documents_spelled_with_starts_exactly(make, lq: int, lkv: int) -> None:  # type: ignore[no-untyped-def]
    """Triton flex runs these masks with ``start[q] <= kv`` (per-query document starts) where
    flex_flash keeps the label spelling; forward and backward against float64."""
    mask = make()
    q, k, v = _inputs(lq, lkv, torch.bfloat16)
    problem = fz.plan(q, k, v, mask=mask, backend="flex").problem
    mod = BY_NAME["flex"].prepared(problem, q.device, None).block_mask.mask_mod  # type: ignore[attr-defined]
    assert "starts" in mod.__name__, mod.__name__
    _check(q, k, v, "flex", mask, None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_flex_other_dtypes(dtype: torch.dtype) -> None:
    q, k, v = _inputs(L, L, dtype)
    _check(q, k, v, "flex", masks.SlidingWindow(left=64, right=16), None)


@pytest.mark.parametrize("d", [16, 128, 256])
def test_flex_head_dims(d: int) -> None:
    q, k, v = _inputs(L, L, torch.bfloat16, d=d)
    _check(q, k, v, "flex", masks.Causal(), None)


@pytest.mark.parametrize("route", [*GQA_ROUTES, "auto"])
def test_gqa(route: str) -> None:
    q, k, v = _inputs(L, L, torch.bfloat16, hkv=2)
    if route == "auto":
        out = fz.attention(q, k, v, mask=_doc() & masks.Causal(), enable_gqa=True)
        assert_matches_reference(out, q, k, v, mask=_doc() & masks.Causal(), enable_gqa=True)
        return
    _check(q, k, v, route, masks.Causal(), None, gqa=True)


def _bf16_qkv(batch: int, hkv: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded bf16 q ``[batch, 4, 384, 64]`` and k, v with ``hkv`` heads, requiring grad."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(batch, 4, 384, 64, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    k, v = (
        torch.randn(batch, hkv, 384, 64, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_(True)
        for _ in range(2)
    )
    return q, k, v


@pytest.mark.parametrize("route", ["sdpa_cudnn", "sdpa_flash"])
@pytest.mark.parametrize("hkv", [4, 2])
@pytest.mark.parametrize("mask", [masks.Chunked(size=128) & masks.Causal(), masks.Chunked(size=96)])
def test_sdpa_chunks_batch1(route: str, hkv: int, mask) -> None:  # type: ignore[no-untyped-def]
    """Batch 1, contiguous: cuDNN gets the strided chunk view itself (no copy); with GQA (k/v
    expanded for cuDNN first), lse-free, forward and backward vs float64."""
    _check(*_bf16_qkv(1, hkv, seed=3), route, mask, None, gqa=hkv != 4, lse=False)


@pytest.mark.parametrize("route", ["sdpa", "sdpa_cudnn", "sdpa_flash"])
@pytest.mark.parametrize("hkv", [4, 2])
@pytest.mark.parametrize(
    "mask",
    [
        masks.DilatedSlidingWindow(left=384, dilation=3),  # causal inside each residue class
        masks.DilatedSlidingWindow(left=384, right=384, dilation=2),  # whole classes
    ],
)
def test_sdpa_residue_classes_as_heads(route: str, hkv: int, mask) -> None:  # type: ignore[no-untyped-def]
    """A dilated window spanning the sequence: each residue class its own heads (GQA with k/v
    expanded for cuDNN first), forward and backward vs float64. The route must take it (no skip)."""
    q, k, v = _bf16_qkv(2, hkv, seed=6)
    assert fz.plan(q, k, v, mask=mask, backend=route, enable_gqa=hkv != 4).backend == route
    _check(q, k, v, route, mask, None, gqa=hkv != 4, lse=False)


@pytest.mark.parametrize("hkv", [4, 2])
@pytest.mark.parametrize("layout", ["contiguous", "projection"])
def test_sdpa_split_prefix(hkv: int, layout: str) -> None:
    """cuDNN per part, merged by lse: GQA (k/v expanded), [B, L, H, D] projections viewed as
    [B, H, L, D], D=128, a prefix off the 128 grid; forward+backward, then the no-grad forward
    (its own compiled merge) vs float64."""
    g = torch.Generator(device=DEV).manual_seed(5)

    def make(heads: int) -> torch.Tensor:
        if layout == "projection":
            return torch.randn(B, 700, heads, 128, device=DEV, dtype=torch.bfloat16, generator=g).transpose(
                1, 2
            )
        return torch.randn(B, heads, 700, 128, device=DEV, dtype=torch.bfloat16, generator=g)

    q, k, v = (t.requires_grad_(True) for t in (make(H), make(hkv), make(hkv)))
    mask = masks.PrefixLM(prefix_len=257)
    _check(q, k, v, "sdpa_split", mask, None, gqa=hkv != H, lse=False)
    with torch.no_grad():
        out = fz.attention(q, k, v, mask=mask, enable_gqa=hkv != H, backend="sdpa_split")
    assert_matches_reference(out, q, k, v, mask=mask, enable_gqa=hkv != H)


@pytest.mark.parametrize("hkv", [4, 2])
@pytest.mark.parametrize("decoding", [False, True])
def test_sdpa_split_tree(hkv: int, decoding: bool) -> None:
    """A 63-token draft tree after its context: cuDNN for the context parts, the tree's own block
    as dense scores, merged by lse; rows of the whole sequence and the drafted tokens alone
    (decoding), GQA, D=128, forward+backward then the no-grad forward vs float64."""
    length = 700
    tree = masks.Tree.typical_example(length, length, B, H).to(DEV)
    q_len = length
    if decoding:
        q_len = tree.parents.numel()
        tree = masks.Tree(parents=tree.parents, prefix_len=tree.prefix_len, q_offset=tree.prefix_len)
    g = torch.Generator(device=DEV).manual_seed(8)
    q = torch.randn(B, H, q_len, 128, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    k, v = (
        torch.randn(B, hkv, length, 128, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_(True)
        for _ in range(2)
    )
    _check(q, k, v, "sdpa_split", tree, None, gqa=hkv != H, lse=False)
    with torch.no_grad():
        out = fz.attention(q, k, v, mask=tree, enable_gqa=hkv != H, backend="sdpa_split")
    assert_matches_reference(out, q, k, v, mask=tree, enable_gqa=hkv != H)


def test_sdpa_cudnn_gqa_needs_equal_lengths() -> None:
    q = torch.empty(2, 8, 16, 64, device=DEV, dtype=torch.bfloat16)
    kv = torch.empty(2, 2, 300, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="expanding k/v"):
        fz.plan(q, kv, kv, enable_gqa=True, backend="sdpa_cudnn")


@pytest.mark.parametrize("hkv", [H, 2])
@pytest.mark.parametrize("lq", [1, 16])
def test_sdpa_route_decoding_a_repeated_shape(hkv: int, lq: int) -> None:
    """The ``sdpa`` route decoding one exact shape again and again: FA2 / memory-efficient at
    first, SDPA's full choice (cuDNN where it takes the call) from the shape's third call; every
    call against float64, forward and backward, then captured in a CUDA graph and replayed."""
    g = torch.Generator(device=DEV).manual_seed(3)
    q = torch.randn(B, H, lq, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, hkv, 777, 128, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(2))
    gqa = hkv != H
    for _ in range(4):
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = fz.attention(qg, kg, vg, enable_gqa=gqa, backend="sdpa")
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, (qg, kg, vg), grad_out)
        assert_matches_reference(out, qg, kg, vg, grads=grads, grad_out=grad_out, enable_gqa=gqa)
    with torch.no_grad():
        for _ in range(3):
            eager = fz.attention(q, k, v, enable_gqa=gqa, backend="sdpa")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fz.attention(q, k, v, enable_gqa=gqa, backend="sdpa")
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(captured, q, k, v, enable_gqa=gqa)
        assert not torch.equal(captured, eager)


@pytest.mark.parametrize("length", [704, 640])
def test_sdpa_route_masked_training_with_very_negative_scores(length: int) -> None:
    """pytorch/pytorch#196678's inputs (every score about -120, so every row's logsumexp is below
    -88.7) with a mask tensor: SDPA's own choice picks cuDNN on sm90, whose backward gave NaN dQ
    at lengths of 64 mod 128. Through the ``sdpa`` route every gradient is finite and exact."""
    d = 64
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(1, 1, length, d, device=DEV, dtype=torch.bfloat16, generator=g) * 0.1
    k = torch.randn(1, 1, length, d, device=DEV, dtype=torch.bfloat16, generator=g) * 0.1
    v = torch.randn(1, 1, length, d, device=DEV, dtype=torch.bfloat16, generator=g)
    q[..., 0], k[..., 0] = 1.0, -120 * d**0.5
    mask = masks.Dense(mask=torch.ones(length, length, dtype=torch.bool, device=DEV).tril()[None, None])
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = fz.attention(qg, kg, vg, mask=mask, backend="sdpa")
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (qg, kg, vg), grad_out)
    assert all(bool(torch.isfinite(t).all()) for t in grads)
    assert_matches_reference(out, qg, kg, vg, mask=mask, grads=grads, grad_out=grad_out)


SDPA_ROUTES = ["sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient"]


@pytest.mark.parametrize("route", SDPA_ROUTES)
@pytest.mark.parametrize("d", [20, 72, 96, 192, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("grad", [False, True])
def test_sdpa_routes_run_whatever_their_plan_accepts(
    route: str, d: int, dtype: torch.dtype, grad: bool
) -> None:
    """Our rules ANDed with torch's ``can_use_*_attention``: an accepted SDPA route must run (no
    "no available kernel" error) and be exact, forward and backward; a refusal names its reason."""
    g = torch.Generator(device=DEV).manual_seed(11)
    q, k, v = (
        torch.randn(2, 4, 257, d, device=DEV, dtype=dtype, generator=g).requires_grad_(grad) for _ in range(3)
    )
    try:
        fz.plan(q, k, v, mask="causal", backend=route)
    except ValueError as err:
        assert route in str(err) and "cannot run" in str(err)
        pytest.skip(f"refused: {err}")
    out = fz.attention(q, k, v, mask="causal", backend=route)
    if not grad:
        assert_matches_reference(out, q, k, v, mask="causal")
        return
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(out, q, k, v, mask="causal", grads=grads, grad_out=grad_out)


def test_auto_follows_requires_grad() -> None:
    """Mode matters: inference and training may pick different routes, both exact."""
    q, k, v = _inputs(L, L, torch.bfloat16)
    with torch.no_grad():
        fwd_plan = fz.plan(q, k, v, mask="causal")
        out = fz.attention(q, k, v, mask="causal")
    assert fwd_plan.problem.mode == "fwd"
    assert fz.plan(q, k, v, mask="causal").problem.mode == "fwdbwd"
    assert_matches_reference(out, q, k, v, mask="causal")


def test_no_recompiles_for_equal_specs_grad_toggles_and_length_sweep() -> None:
    spec = masks.SlidingWindow(left=100)
    q, k, v = _inputs(512, 512, torch.bfloat16)
    fz.attention(q, k, v, mask=spec, backend="flex")
    with torch.no_grad():
        fz.attention(q, k, v, mask=spec, backend="flex")
    base = COMPILE_CACHE.total_compiles()
    for _ in range(2):  # value-equal spec objects, both grad modes: nothing new to compile
        fz.attention(q, k, v, mask=masks.SlidingWindow(left=100), backend="flex")
        with torch.no_grad():
            fz.attention(q, k, v, mask=masks.SlidingWindow(left=100), backend="flex")
    assert COMPILE_CACHE.total_compiles() == base
    with torch.no_grad():
        for length in (640, 1000, 1500, 2048, 3000, 4096, 5000, 8192, 9000, 12000):
            q2, k2, v2 = (t.detach()[:, :, :1].expand(-1, -1, length, -1).contiguous() for t in (q, k, v))
            fz.attention(q2, k2, v2, mask=spec, backend="flex")
    # Ten lengths (more than Dynamo's recompile limit of 8): the entry's second static shape, the
    # later code object's first (static) graph, then one dynamic-shape graph for the rest.
    assert COMPILE_CACHE.total_compiles() - base <= STATIC_SHAPES + 1, COMPILE_CACHE.total_compiles() - base


def test_unfused_fallback_guard_on_gpu() -> None:
    q, k, v = _inputs(1024, 1024, torch.bfloat16)
    with torch.compiler.set_stance("force_eager"), pytest.raises(UnfusedFallbackError):
        fz.attention(q, k, v, mask=masks.SlidingWindow(left=33), backend="flex")


@pytest.mark.parametrize(
    "spec",
    [
        masks.Causal(),
        masks.SlidingWindow(left=300, right=7),
        masks.Chunked(size=200) & masks.Causal(),
        masks.PrefixLM(prefix_len=700),
        masks.Document.from_lengths([257, 600, 1000, 143]),
    ],
)
@pytest.mark.parametrize("lens", [(2000, 2000), (1500, 2000), (2000, 1300)])
def test_closed_form_block_mask_equals_create_block_mask(spec, lens) -> None:  # type: ignore[no-untyped-def]
    lq, lkv = lens
    bound = spec.bind(lq, lkv)
    ours = fz.block_mask(spec, lq, lkv, device=DEV)
    theirs = _compat.create_block_mask(bound.to(DEV).mask_mod(), None, None, lq, lkv, device=DEV)
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    assert torch.equal(ours.full_kv_num_blocks, theirs.full_kv_num_blocks)
    assert torch.equal(ours.kv_num_blocks, theirs.kv_num_blocks)
    assert torch.equal(ours.q_num_blocks, theirs.q_num_blocks)
    assert torch.equal(ours.full_q_num_blocks, theirs.full_q_num_blocks)


def test_backends_declared() -> None:
    assert set(ROUTES) <= set(BY_NAME)


@pytest.mark.skipif(not _compat.flash_cute_available(), reason="needs flash-attn-4 (flash_attn.cute)")
@pytest.mark.parametrize(
    ("mask", "length", "layout"),
    [
        (masks.Chunked(size=128) & masks.Causal(), 384, "chunks"),  # equal chunks: a batch of chunks
        (masks.Chunked(size=128), 384, "chunks"),
        (masks.Chunked(size=128) & masks.Causal(), 333, "packed"),  # a short last chunk: cu_seqlens
        (masks.SlidingWindow(left=50, right=3), 333, "rows"),
        ("documents", 333, "packed"),  # per-row documents, built below for the batch size
        (masks.DilatedSlidingWindow(left=100, dilation=2), 384, "strided"),  # classes as heads
        (masks.DilatedSlidingWindow(left=60, right=31, dilation=3), 333, "strided"),
        (masks.DilatedSlidingWindow(left=100, right=50, dilation=2) & masks.Causal(), 384, "strided"),
    ],
)
@pytest.mark.parametrize("batch", [1, 2])
def test_fa4_layouts_with_lse_and_gqa(mask, length: int, layout: str, batch: int) -> None:  # type: ignore[no-untyped-def]
    """Each way the fa4 route lays a call out (rows, a batch of chunks, packed cu_seqlens, residue
    classes as heads), with GQA, lse and gradients, against float64; batch 1 keeps the chunk view
    copy-free."""
    from flexattn_zoo.segments import segment_layout

    if mask == "documents":
        mask = masks.Document.from_lengths([[100, 150, 83], [20, 313]][:batch]) & masks.Causal()
    bound = mask.bind(length, length)
    assert segment_layout(bound, batch, length)[0] == layout
    g = torch.Generator(device=DEV).manual_seed(1)
    q = torch.randn(batch, 8, length, 128, device=DEV, dtype=torch.float16, generator=g).requires_grad_(True)
    k = torch.randn(batch, 2, length, 128, device=DEV, dtype=torch.float16, generator=g).requires_grad_(True)
    v = torch.randn(batch, 2, length, 128, device=DEV, dtype=torch.float16, generator=g).requires_grad_(True)
    out, lse = fz.attention(q, k, v, mask=mask, backend="fa4", enable_gqa=True, return_lse=True)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(
        out, q, k, v, mask=mask, enable_gqa=True, lse=lse, grads=grads, grad_out=grad_out
    )


@pytest.mark.skipif(not _compat.flash_cute_available(), reason="needs flash-attn-4 (flash_attn.cute)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("positions", "left", "right", "length"),
    [
        ([0], 64, 64, 700),  # a [CLS] token
        ([0, 5, 333, 699], 100, 0, 700),  # causal-side window, global rows at both ends
        (list(range(0, 640, 10)), 31, 17, 640),  # the most global positions the form takes
        ([3], 1000, 1000, 640),  # the window spans the row
    ],
)
@pytest.mark.parametrize("global_rows", ["dense", "kernel"])
def test_fa4_global_tokens(
    positions: list[int],
    left: int,
    right: int,
    length: int,
    dtype: torch.dtype,
    global_rows: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A window plus global tokens on fa4 (the windowed kernel, the global keys merged in, the
    global rows apart: in the compiled dense part, or past its size limit as one more kernel
    call) with GQA, soft-capping, lse and gradients against float64."""
    if global_rows == "kernel":
        from flexattn_zoo.backends import global_tokens

        monkeypatch.setattr(global_tokens, "GLOBAL_ROWS_DENSE_MAX_SCORES", 0)
    # The [CLS] case keeps its flags on the CPU: the route moves the positions to q's device.
    flags_on = "cpu" if positions == [0] else DEV
    mask = masks.GlobalWindow.from_positions(positions, length, left=left, right=right, device=flags_on)
    assert mask.global_tokens_form(length, length) is not None
    g = torch.Generator(device=DEV).manual_seed(4)
    q = torch.randn(2, 8, length, 128, device=DEV, dtype=dtype, generator=g).requires_grad_(True)
    k = torch.randn(2, 2, length, 128, device=DEV, dtype=dtype, generator=g).requires_grad_(True)
    v = torch.randn(2, 2, length, 128, device=DEV, dtype=dtype, generator=g).requires_grad_(True)
    for score in (None, score_mods.SoftCap(cap=20.0, approx=True)):
        out, lse = fz.attention(
            q, k, v, mask=mask, score_mod=score, backend="fa4", enable_gqa=True, return_lse=True
        )
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        assert_matches_reference(
            out, q, k, v, mask=mask, score_mod=score, enable_gqa=True, lse=lse, grads=grads, grad_out=grad_out
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("global_rows", ["dense", "kernel"])
def test_global_tokens_compiled_dense_parts(
    dtype: torch.dtype, global_rows: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The global-tokens composition's compiled dense parts as Inductor builds them for CUDA (no
    FA4 needed: a dense float64 windowed kernel stands in for FA4's), GQA 8:2 and soft-capping,
    output, lse and gradients against float64."""
    import math

    from dense_window_kernel import dense_window_kernels

    from flexattn_zoo.backends import global_tokens

    if global_rows == "kernel":
        monkeypatch.setattr(global_tokens, "GLOBAL_ROWS_DENSE_MAX_SCORES", 0)
    length, cap = 700, 20.0
    mask = masks.GlobalWindow.from_positions([0, 5, 333, 699], length, left=100, right=30, device=DEV)
    form = mask.global_tokens_form(length, length)
    g = torch.Generator(device=DEV).manual_seed(6)
    q = torch.randn(2, 8, length, 128, device=DEV, dtype=dtype, generator=g).requires_grad_(True)
    k = torch.randn(2, 2, length, 128, device=DEV, dtype=dtype, generator=g).requires_grad_(True)
    v = torch.randn(2, 2, length, 128, device=DEV, dtype=dtype, generator=g).requires_grad_(True)
    scale = 1 / math.sqrt(128)
    out, lse = global_tokens.global_tokens_attention(
        q, k, v, form, scale, dense_window_kernels(cap), softcap=cap, compiled=True
    )
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(
        out, q, k, v, mask=mask, score_mod=score_mods.SoftCap(cap=cap), enable_gqa=True, lse=lse,
        grads=grads, grad_out=grad_out,
    )  # fmt: skip


@pytest.mark.skipif(not _compat.flash_cute_available(), reason="needs flash-attn-4 (flash_attn.cute)")
def test_fa4_takes_projection_layout_and_scale() -> None:
    """[B, L, H, D] projections viewed as [B, H, L, D] (no copy needed) and a non-default scale."""
    g = torch.Generator(device=DEV).manual_seed(2)
    q, k, v = (
        torch.randn(2, 300, 4, 64, device=DEV, dtype=torch.bfloat16, generator=g)
        .transpose(1, 2)
        .requires_grad_(True)
        for _ in range(3)
    )
    spec = score_mods.SoftCap(cap=20.0, approx=True)
    out = fz.attention(q, k, v, mask="causal", score_mod=spec, scale=0.3, backend="fa4")
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(
        out, q, k, v, mask="causal", score_mod=spec, scale=0.3, grads=grads, grad_out=grad_out
    )


@pytest.mark.skipif(not _compat.flash_cute_available(), reason="needs flash-attn-4 (flash_attn.cute)")
@pytest.mark.parametrize(
    "preset", ["full", "causal", "sliding", "document_causal", "prefix_lm", "softcap_causal", "alibi_sliding"]
)
def test_flex_flash_at_head_dim_256(preset: str) -> None:
    """Head dim 256 (Gemma-2/3) on FA4's kernels through flex, whose BlockMasks the route builds
    with 64-key blocks there; L=333 leaves partial blocks of both sizes. Forward, lse and
    backward against float64."""
    make_mask, extra = PRESETS[preset]
    score = _score(extra) if isinstance(extra, str) else None
    q, k, v = _inputs(L, L, torch.bfloat16, d=256)
    plan = fz.plan(q, k, v, mask=make_mask(), score_mod=score, backend="flex_flash")
    built = BY_NAME["flex_flash"].prepared(plan.problem, q.device).block_mask  # type: ignore[attr-defined]
    assert built is None or tuple(built.BLOCK_SIZE) == (128, 64)
    _check(q, k, v, "flex_flash", make_mask(), score)


@pytest.mark.skipif(not _compat.flash_cute_available(), reason="needs flash-attn-4 (flash_attn.cute)")
def test_gemma2_local_attention_at_head_dim_256_with_gqa() -> None:
    """Gemma-2's local layers: a sliding window with causal, exact soft-capping, GQA 4:2, D=256;
    named flex_flash and auto (whichever route it takes at this size), against float64."""
    mask = masks.SlidingWindow(left=100) & masks.Causal()
    score = score_mods.SoftCap(cap=5.0)
    q, k, v = _inputs(L, L, torch.bfloat16, d=256, hkv=2)
    _check(q, k, v, "flex_flash", mask, score, gqa=True)
    out = fz.attention(q, k, v, mask=mask, score_mod=score, enable_gqa=True)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(
        out, q, k, v, mask=mask, score_mod=score, enable_gqa=True, grads=grads, grad_out=grad_out
    )
