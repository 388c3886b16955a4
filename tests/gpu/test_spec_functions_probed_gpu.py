"""Spec classes written for flex's 0-d index semantics (tests/flex_index_specs.py) on CUDA: ``auto``
and every CUDA route that accepts them, forward and backward, against the float64 reference of a
per-pair oracle. A route whose kernel cannot run such a function must refuse it with the reason
(not fail while compiling); ``dense`` evaluates it exactly as flex does."""

from __future__ import annotations

import pytest
import torch
from flex_index_specs import GatheredBias, GatheredTable, NearKeys, near
from zoo_oracles import table

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo.testing import assert_matches_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
B, H, L, D = 2, 4, 256, 64


def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.rand(L, L, generator=g) > 0.5, torch.randn(H, L, L, generator=g)


def _cases() -> list[tuple[str, object, object, torch.Tensor | None, torch.Tensor | None]]:
    """(id, mask, score_mod, the mask's per-pair oracle, the score's bias)."""
    visible, bias = _tables()
    return [
        ("near_keys", NearKeys(), None, table(L, L, near), None),
        ("gathered_table", GatheredTable(table=visible.to(DEV)), None, visible.view(1, 1, L, L), None),
        ("causal_and_gathered_bias", masks.Causal(), GatheredBias(bias=bias.to(DEV)), None, bias),
    ]


CASES = _cases() if torch.cuda.is_available() else []


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_cuda_route_runs_a_flex_index_function_exactly_or_refuses_it(case) -> None:
    _, mask, score, visible, bias = case
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (
        (torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16, generator=g) * 0.5).requires_grad_()
        for _ in range(3)
    )
    ref_mask = masks.Causal() if visible is None else visible
    ref_score = None if bias is None else bias.unsqueeze(0).expand(B, H, L, L).double()
    plan = fz.plan(q, k, v, mask=mask, score_mod=score)
    routes = ["auto", *(c.name for c in plan.candidates if c.accepted)]
    for route in routes:
        out = fz.attention(q, k, v, mask=mask, score_mod=score, backend=route)
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        assert_matches_reference(
            out, q, k, v, mask=ref_mask, score_mod=ref_score, grads=grads, grad_out=grad_out
        )


def _kept_off_the_cuda_flex_kernels(mod, want: torch.Tensor, reason: str) -> None:
    """The flex routes refuse ``mod`` with ``reason`` (no other CUDA route of auto's has a form
    for a raw callable, so auto raises, naming it), and ``dense``, named, runs it exactly."""
    g = torch.Generator(device=DEV).manual_seed(1)
    q, k, v = (
        (torch.randn(1, 2, L, D, device=DEV, dtype=torch.bfloat16, generator=g) * 0.5).requires_grad_()
        for _ in range(3)
    )
    for route in ("flex", "flex_flash"):
        with pytest.raises(ValueError, match=reason):
            fz.attention(q, k, v, mask=mod, backend=route)
    with pytest.raises(ValueError, match=reason):
        fz.attention(q, k, v, mask=mod)
    out = fz.attention(q, k, v, mask=mod, backend="dense")
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(out, q, k, v, mask=want, grads=grads, grad_out=grad_out)


def test_a_join_inside_a_mod_is_kept_off_the_cuda_flex_kernels() -> None:
    """Triton flex fails to lower ``torch.stack`` in a mod."""

    def stacked_causal(b, h, q_idx, kv_idx):
        return torch.stack([q_idx, kv_idx]).amax() <= q_idx

    _kept_off_the_cuda_flex_kernels(stacked_causal, table(L, L, lambda i, j: j <= i), "joins tensors")


@pytest.mark.parametrize("search", ["searchsorted", "bucketize"])
def test_a_search_inside_a_mod_is_kept_off_the_cuda_flex_kernels(search: str) -> None:
    """A document's number from its sorted starts (``torch.searchsorted`` / ``torch.bucketize``):
    Triton flex fails to lower either (as CPU flex does)."""
    starts = torch.tensor([0, 40, 90, 200], device=DEV)

    def doc(i):
        if search == "searchsorted":
            return torch.searchsorted(starts, i, right=True)
        return torch.bucketize(i, starts, right=True)

    def same_doc_causal(b, h, q_idx, kv_idx):
        return (doc(q_idx) == doc(kv_idx)) & (kv_idx <= q_idx)

    bounds = starts.tolist()
    which = [sum(s <= i for s in bounds) for i in range(L)]
    want = table(L, L, lambda i, j: which[i] == which[j] and j <= i)
    _kept_off_the_cuda_flex_kernels(same_doc_causal, want, "searches a sorted tensor")


def test_the_search_done_outside_the_mod_runs_on_flex() -> None:
    """What the refusal suggests: the search once outside the mod, read with one index."""
    starts = torch.tensor([0, 40, 90, 200], device=DEV)
    ids = torch.searchsorted(starts, torch.arange(L, device=DEV), right=True)

    def same_doc_causal(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (kv_idx <= q_idx)

    bounds = starts.tolist()
    which = [sum(s <= i for s in bounds) for i in range(L)]
    want = table(L, L, lambda i, j: which[i] == which[j] and j <= i)
    g = torch.Generator(device=DEV).manual_seed(2)
    q, k, v = (
        (torch.randn(1, 2, L, D, device=DEV, dtype=torch.bfloat16, generator=g) * 0.5).requires_grad_()
        for _ in range(3)
    )
    out = fz.attention(q, k, v, mask=same_doc_causal, backend="flex")
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(out, q, k, v, mask=want, grads=grads, grad_out=grad_out)
