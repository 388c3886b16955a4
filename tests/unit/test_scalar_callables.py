"""Raw callables written for flex's scalar-index semantics (issue 22, item 3).

flex evaluates a ``mask_mod`` / ``score_mod`` on 0-d index tensors, one (b, h, q_idx, kv_idx) at
a time (``torch.vmap`` eagerly, a scalar per element in the compiled kernel), so callables such as
``table[q_idx][kv_idx]``, a Flamingo cross-attention mask that gathers an image's query interval
(``bounds[image[kv_idx]][0]``), a reduction over a captured row or an MLA-style
``bias[h][q_idx][kv_idx]`` are valid flex mods. Before, the library evaluated every callable by one
call on broadcast index grids, and refused these with "use elementwise ops" (or, for a reduction
whose broadcast call happened to run, silently computed something else: the latent-dot-product
score below ran on ``dense`` with an error of 3.8).

Checked here, on one shape (B=2, H=2, Lq=36, Lkv=40), against an oracle that calls the callable
once per element in a Python loop (no vmap): the probe's verdicts, the float64 reference, the
``dense`` route forward and backward (also through a learned tensor the score mod indexes), the
auto route, the generic BlockMask builder (exact block classification, so no false negatives),
``flex_cpu`` (one compile) on the forms it runs and its refusal of the ones torch's compiled CPU
kernel mishandles, and the refusal of what flex itself rejects.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask
from zoo_oracles import table

import flexattn_zoo as fz
from flexattn_zoo import functions, masks
from flexattn_zoo.coercion import as_mask_spec, as_score_spec
from flexattn_zoo.testing import assert_mask_consistent, assert_matches_reference, reference_attention
from flexattn_zoo.testing.checks import block_mask_map, dense_block_map

B, H, LQ, LKV, D = 2, 2, 36, 40, 8
TOKENS_PER_IMAGE = 8
N_IMAGES = LKV // TOKENS_PER_IMAGE

# Flamingo-style cross attention: key j belongs to image IMAGE_OF_KEY[j]; the text queries in
# [BOUNDS[i, 0], BOUNDS[i, 1]) see image i.
IMAGE_OF_KEY = torch.arange(N_IMAGES).repeat_interleave(TOKENS_PER_IMAGE)
BOUNDS = torch.tensor([[0, 9], [5, 14], [14, 22], [20, 30], [30, 36]])
STARTS = torch.tensor([0, 7, 20, 33])  # document starts; a position's document is a count
OFFSETS = torch.tensor([0, 5])  # per batch row
_g = torch.Generator().manual_seed(7)
TABLE = torch.rand(LQ, LKV, generator=_g) > 0.4
BIAS = torch.randn(H, LQ, LKV, generator=_g)
LATENT = torch.randn(max(LQ, LKV), 4, generator=_g) / 2


def flamingo(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    interval = BOUNDS[IMAGE_OF_KEY[kv_idx]]  # the image's [start, end) row, gathered
    return (q_idx >= interval[0]) & (q_idx < interval[1])


def flamingo_unpacked(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    start, end = BOUNDS[IMAGE_OF_KEY[kv_idx]]
    return (q_idx >= start) & (q_idx < end)


def flamingo_one_index(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    image = IMAGE_OF_KEY[kv_idx]
    return (q_idx >= BOUNDS[image, 0]) & (q_idx < BOUNDS[image, 1])


def chained_table(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return TABLE[q_idx][kv_idx]


def counted_documents(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    same = (STARTS <= q_idx).sum() == (STARTS <= kv_idx).sum()
    return same & (q_idx >= kv_idx)


def near_keys(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """A reduction over a value of the indices alone: at all-zero indices its broadcast call gives
    flex's answer, elsewhere one verdict for the whole grid (every row empty: a silent zero output
    on ``dense`` before)."""
    return (q_idx - kv_idx).abs().amax() <= 3


def stacked_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return torch.stack([q_idx, kv_idx]).amax() <= q_idx


def median_distance(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return (q_idx - kv_idx).abs().median() <= 3


def sorted_pair(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """Causal, spelled with a sort of the pair: its larger index is the query's."""
    return torch.sort(torch.stack([q_idx, kv_idx])).values[1] <= q_idx


def searched_documents(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """A position's document found by a search of the sorted starts (element by element)."""
    same = torch.searchsorted(STARTS, q_idx, right=True) == torch.searchsorted(STARTS, kv_idx, right=True)
    return same & (q_idx >= kv_idx)


def bucketed_documents(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return torch.bucketize(q_idx, STARTS, right=True) == torch.bucketize(kv_idx, STARTS, right=True)


def row_offset(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return torch.where(q_idx > 10, q_idx + OFFSETS[b] >= kv_idx, kv_idx <= 10)


def mla_bias(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return score + BIAS[h][q_idx][kv_idx]


def latent_dot(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return score + (LATENT[q_idx] * LATENT[kv_idx]).sum()


def head_bias_one_index(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return score + BIAS[h, q_idx, kv_idx]


ROW = functions.READS_GATHERED_ROW
REDUCES = functions.REDUCES
JOINS = functions.CONCATENATES
SCANS = functions.SCANS
SEARCHES = functions.SEARCHES
#: (callable, needs the scalar evaluation, hazards for torch's compiled CPU flex).
MASK_CASES = {
    "flamingo": (flamingo, True, (ROW,)),
    "flamingo_unpacked": (flamingo_unpacked, True, (ROW,)),
    "flamingo_one_index": (flamingo_one_index, False, ()),
    "chained_table": (chained_table, True, (ROW,)),
    "counted_documents": (counted_documents, True, (REDUCES,)),
    "near_keys": (near_keys, True, (REDUCES,)),
    "stacked_causal": (stacked_causal, True, (JOINS, REDUCES)),
    "median_distance": (median_distance, True, (SCANS,)),
    "sorted_pair": (sorted_pair, True, (JOINS, SCANS, ROW)),
    "searched_documents": (searched_documents, False, (SEARCHES,)),
    "bucketed_documents": (bucketed_documents, False, (SEARCHES,)),
    "row_offset": (row_offset, False, ()),
}
SCORE_CASES = {
    "mla_bias": (mla_bias, True, (ROW,)),
    "latent_dot": (latent_dot, True, (ROW, REDUCES)),
    "head_bias_one_index": (head_bias_one_index, False, ()),
}


def _scalars(*values: int) -> tuple[torch.Tensor, ...]:
    return tuple(torch.tensor(v, dtype=torch.int32) for v in values)


def loop_mask(fn: Callable[..., Any]) -> torch.Tensor:
    """``[B, H, Lq, Lkv]``: ``fn`` called once per element on 0-d tensors (the plainest oracle)."""
    out = torch.empty(B, H, LQ, LKV, dtype=torch.bool)
    for b, h, i, j in itertools.product(range(B), range(H), range(LQ), range(LKV)):
        out[b, h, i, j] = bool(fn(*_scalars(b, h, i, j)))
    return out


def loop_score(fn: Callable[..., Any], scores: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(scores)
    for b, h, i, j in itertools.product(range(B), range(H), range(LQ), range(LKV)):
        out[b, h, i, j] = fn(scores[b, h, i, j], *_scalars(b, h, i, j))
    return out


def qkv(requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    shapes = ((B, H, LQ, D), (B, H, LKV, D), (B, H, LKV, D))
    return tuple(torch.randn(s, generator=g).requires_grad_(requires_grad) for s in shapes)


@pytest.mark.parametrize("name", MASK_CASES)
def test_mask_probe(name: str) -> None:
    fn, scalar, hazards = MASK_CASES[name]
    spec = as_mask_spec(fn)
    assert (spec.scalar, spec.hazards) == (scalar, hazards)  # type: ignore[union-attr]


@pytest.mark.parametrize("name", SCORE_CASES)
def test_score_probe(name: str) -> None:
    fn, scalar, hazards = SCORE_CASES[name]
    spec = as_score_spec(fn)
    assert (spec.scalar, spec.hazards) == (scalar, hazards)  # type: ignore[union-attr]


@pytest.mark.parametrize("name", MASK_CASES)
def test_mask_oracle_is_flex_semantics(name: str) -> None:
    fn = MASK_CASES[name][0]
    want = loop_mask(fn)
    assert torch.equal(create_mask(fn, B, H, LQ, LKV, device="cpu"), want)  # torch's own evaluation
    spec = as_mask_spec(fn)
    assert spec is not None
    assert torch.equal(spec.dense(LQ, LKV, batch=B, heads=H), want)


@pytest.mark.parametrize("name", SCORE_CASES)
def test_score_oracle_is_flex_semantics(name: str) -> None:
    fn = SCORE_CASES[name][0]
    scores = torch.randn(B, H, LQ, LKV, dtype=torch.float64)
    spec = as_score_spec(fn)
    assert spec is not None
    torch.testing.assert_close(spec.dense(scores), loop_score(fn, scores), rtol=0, atol=1e-12)


def _check_dense(mask: Any, score_mod: Any, want_mask: torch.Tensor | None) -> None:
    q, k, v = qkv(requires_grad=True)
    out = fz.attention(q, k, v, mask=mask, score_mod=score_mod, backend="dense")
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    # Against the reference of the plain oracle's values (not the callable).
    ref_mask = want_mask
    ref_score = None if score_mod is None else loop_score(score_mod, torch.zeros(B, H, LQ, LKV))
    assert_matches_reference(out, q, k, v, mask=ref_mask, score_mod=ref_score, grads=grads, grad_out=grad_out)
    # And against the reference given the callables themselves.
    assert_matches_reference(out, q, k, v, mask=mask, score_mod=score_mod, grads=grads, grad_out=grad_out)


@pytest.mark.parametrize("name", MASK_CASES)
def test_dense_mask_forward_backward(name: str) -> None:
    fn = MASK_CASES[name][0]
    _check_dense(fn, None, loop_mask(fn))


@pytest.mark.parametrize("name", SCORE_CASES)
def test_dense_score_forward_backward(name: str) -> None:
    # Additive score mods: the oracle's values at score 0 are the bias (a Bias tensor).
    _check_dense(None, SCORE_CASES[name][0], None)


def test_dense_composite_and_learned_tensor() -> None:
    """A scalar-style mask inside a composite, and a score mod indexing a learned tensor row by row:
    its gradient reaches the tensor (through the indexing flex's eager path uses)."""
    learned = BIAS.clone().requires_grad_()

    def learned_mla(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + learned[h][q_idx][kv_idx]

    q, k, v = qkv(requires_grad=True)
    mask = fz.masks.Causal() & as_mask_spec(flamingo)
    out = fz.attention(q, k, v, mask=mask, score_mod=learned_mla, backend="dense")
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, learned), grad_out)
    causal = torch.ones(LQ, LKV, dtype=torch.bool).tril()
    want_mask = loop_mask(flamingo) & causal
    ref_bias = learned.unsqueeze(0).expand(B, H, LQ, LKV)
    ref = reference_attention(q, k, v, mask=want_mask, score_mod=ref_bias)
    want = torch.autograd.grad(ref, (q, k, v, learned), grad_out.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w.double(), rtol=1e-4, atol=1e-5)


def test_chunked_evaluation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks smaller than one row of the grid (and a ragged last chunk) give the same values and
    gradients."""
    monkeypatch.setattr(functions, "SCALAR_CHUNK_ELEMENTS", 97)
    _check_dense(chained_table, mla_bias, loop_mask(chained_table))


@pytest.mark.parametrize(
    "name",
    [
        "flamingo",
        "counted_documents",
        "near_keys",
        "stacked_causal",
        "median_distance",
        "sorted_pair",
        "searched_documents",
        "bucketed_documents",
    ],
)
def test_auto_route(name: str) -> None:
    fn = MASK_CASES[name][0]
    q, k, v = qkv()
    plan = fz.plan(q, k, v, mask=fn)
    assert plan.backend == "dense", plan.explain()
    refused = next(c for c in plan.candidates if c.name == "flex_cpu")
    assert any("torch's compiled CPU flex kernel cannot run a mod that" in r for r in refused.reasons)
    out = fz.attention(q, k, v, mask=fn)
    assert_matches_reference(out, q, k, v, mask=loop_mask(fn))


@pytest.mark.parametrize("name", MASK_CASES)
def test_block_map_exact(name: str) -> None:
    """The generic builder's block classification equals the oracle's (so it has no false
    negatives), with blocks smaller than the grid; and fz.testing's consistency checks pass
    (including torch's create_block_mask, which evaluates the mod through vmap)."""
    fn = MASK_CASES[name][0]
    want_any, want_full = dense_block_map(loop_mask(fn), 16, 16)
    bm = fz.block_mask(fn, LQ, LKV, batch=B, heads=H, block_size=16)
    got_any, got_full = block_mask_map(bm, want_any.shape[-1])
    got_any, got_full = got_any.expand_as(want_any), got_full.expand_as(want_full)
    assert not bool((want_any & ~got_any).any()), "a visible block is missing"
    assert torch.equal(got_any, want_any)
    assert torch.equal(got_full, want_full)
    spec = as_mask_spec(fn)
    assert spec is not None
    assert_mask_consistent(spec, LQ, LKV, batch=B, heads=H, block_sizes=((16, 16),))


def test_flex_cpu_runs_one_index_forms() -> None:
    """flex_cpu (one compile): the forms torch's compiled CPU kernel runs, exactly."""
    q, k, v = qkv()
    out = fz.attention(q, k, v, mask=flamingo_one_index, score_mod=head_bias_one_index, backend="flex_cpu")
    want_score = loop_score(head_bias_one_index, torch.zeros(B, H, LQ, LKV))
    assert_matches_reference(out, q, k, v, mask=loop_mask(flamingo_one_index), score_mod=want_score)


@pytest.mark.parametrize(
    ("mask", "score_mod", "hazard"),
    [
        pytest.param(flamingo, None, "reads from a row it gathered", id="flamingo"),
        pytest.param(chained_table, None, "reads from a row it gathered", id="chained_table"),
        pytest.param(counted_documents, None, "reduces over a tensor", id="counted_documents"),
        pytest.param(None, latent_dot, "reduces over a tensor", id="latent_dot"),
        pytest.param(near_keys, None, "reduces over a tensor", id="near_keys"),
        pytest.param(stacked_causal, None, r"joins tensors \(torch.stack", id="stacked_causal"),
        pytest.param(median_distance, None, "sorts or scans a tensor", id="median_distance"),
        pytest.param(searched_documents, None, "searches a sorted tensor", id="searched_documents"),
        pytest.param(bucketed_documents, None, "searches a sorted tensor", id="bucketed_documents"),
        pytest.param(
            masks.Causal() & as_mask_spec(flamingo_unpacked),
            None,
            "reads from a row it gathered",
            id="composite",
        ),
    ],
)
def test_flex_cpu_refuses_what_its_kernel_mishandles(mask: Any, score_mod: Any, hazard: str) -> None:
    """Refused before compiling (torch 2.13's compiled CPU flex fails to lower these, reads out of
    bounds, or corrupts the heap: measured without the library)."""
    q, k, v = qkv()
    with pytest.raises(
        ValueError, match=rf"flex_cpu.*compiled CPU flex kernel cannot run a mod that {hazard}"
    ):
        fz.attention(q, k, v, mask=mask, score_mod=score_mod, backend="flex_cpu")


#: STARTS padded to Lkv entries with starts past every position: on broadcast grids the
#: reduction then runs without a shape error and sums over the whole grid (a silently wrong mask).
PADDED_STARTS = torch.cat([STARTS, torch.full((LKV - len(STARTS),), 10_000)])


def counted_documents_padded(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    same = (PADDED_STARTS <= q_idx).sum() == (PADDED_STARTS <= kv_idx).sum()
    return same & (q_idx >= kv_idx)


@pytest.mark.parametrize(
    "mod",
    [chained_table, counted_documents, counted_documents_padded],
    ids=["fails_on_grids", "reduces", "reduces_silently_on_grids"],
)
def test_user_block_mask_with_scalar_mod_on_dense(mod: Callable[..., Any]) -> None:
    """A BlockMask torch built for a scalar-style mod (its mask_mod runs inside partial blocks).
    A reduction runs on broadcast grids without an error but reduces over the whole grid: the
    probe, not an exception, must decide how dense evaluates it."""
    from torch.nn.attention.flex_attention import create_block_mask

    bm = create_block_mask(mod, None, None, LQ, LKV, device="cpu", BLOCK_SIZE=16)
    q, k, v = qkv()
    out = fz.attention(q, k, v, mask=bm, backend="dense")
    assert_matches_reference(out, q, k, v, mask=loop_mask(mod))


def _python_if(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return (q_idx >= kv_idx) if q_idx > 2 else (q_idx < kv_idx)


def _item(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return q_idx + int(OFFSETS[b].item()) >= kv_idx


def _python_and(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return (q_idx >= kv_idx) and (kv_idx > 0)


@pytest.mark.parametrize("fn", [_python_if, _item, _python_and], ids=["if", "item", "and"])
def test_refuses_what_flex_rejects(fn: Callable[..., Any]) -> None:
    with pytest.raises(RuntimeError, match="vmap"):  # torch's own evaluation rejects it too
        create_mask(fn, B, H, LQ, LKV, device="cpu")
    q, k, v = qkv()
    with pytest.raises(
        TypeError, match=r"mask callable uses data-dependent Python control flow .* flex rejects"
    ):
        fz.attention(q, k, v, mask=fn)
    with pytest.raises(TypeError, match="data-dependent Python control flow"):
        fz.attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s if fn(b, h, q_idx, kv_idx) else -s)


def test_one_value_per_element() -> None:
    """A mod returning a row per element (flex needs one value) is refused, naming that."""
    q, k, v = qkv()
    with pytest.raises(TypeError, match="one value per"):
        fz.attention(q, k, v, mask=lambda b, h, q_idx, kv_idx: TABLE[q_idx] > 0)


def test_decode_on_the_cpu_keeps_hazardous_callables_off_flex(monkeypatch: pytest.MonkeyPatch) -> None:
    """``decode_step`` wraps the user's mask in its own untracked callables, which hid the
    hazards ``flex_cpu`` refuses: a counting mask must decode on the dense route (the compiled
    CPU flex kernel is never asked), with the reference's answer, and a named flex route says why."""
    from flexattn_zoo.backends import flex as flex_backend
    from flexattn_zoo.models import decode

    def no_flex(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the compiled CPU flex kernel was asked to run a hazardous mod")

    monkeypatch.setattr(flex_backend.FlexBackend, "run", no_flex)
    monkeypatch.setattr(flex_backend.FlexBackend, "caller_mask_call", lambda *a, **k: None)
    g = torch.Generator().manual_seed(0)
    cap, lens = LKV, [LKV - 3, 9]
    k, v = (torch.randn(2, H, cap, D, generator=g) for _ in range(2))
    q = torch.randn(2, H, 1, D, generator=g)
    with torch.no_grad():
        out = decode.decode_step(q, k, v, torch.tensor(lens), mask=counted_documents)
        dense = decode.decode_step(q, k, v, torch.tensor(lens), mask=counted_documents, backend="dense")
        with pytest.raises(ValueError, match="cannot run a mod that reduces over a tensor"):
            decode.decode_step(q, k, v, torch.tensor(lens), mask=counted_documents, backend="flex_cpu")
    assert torch.equal(out, dense)
    for b, n in enumerate(lens):
        full_q = torch.zeros(1, H, n, D, dtype=torch.float64)
        full_q[:, :, -1:] = q[b : b + 1].double()
        visible = table(n, n, lambda i, j: bool(counted_documents(*_scalars(0, 0, i, j))))
        ref = reference_attention(
            full_q, k[b : b + 1, :, :n].double(), v[b : b + 1, :, :n].double(), mask=visible
        )
        torch.testing.assert_close(out[b].double(), ref[0, :, -1:], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "refused"),
    [("stacked_causal", True), ("sorted_pair", True), ("counted_documents", False), ("chained_table", False)],
)
def test_the_cuda_flex_routes_refuse_only_what_their_kernel_cannot_lower(name: str, refused: bool) -> None:
    """torch's compiled CUDA (Triton) flex kernel fails to lower a join and runs reductions and
    gathered rows (H100, torch 2.11: benchmarks/flex_mod_hazards_probe.py). A route's mask
    reasons read only the specs, so a CPU problem shows them."""
    from flexattn_zoo.backends import BY_NAME

    q, k, v = qkv()
    problem = fz.plan(q, k, v, mask=MASK_CASES[name][0]).problem
    for route in ("flex", "flex_flash"):
        reasons = BY_NAME[route].mask_reasons(problem)
        assert (
            any("compiled flex kernel cannot run a mod that joins tensors" in r for r in reasons) == refused
        )
