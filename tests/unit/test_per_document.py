"""``PerDocument``: any mask in each document's own coordinates, against oracles written here from
the rule itself (per-document prefix-LM first), its forms, its three block-map paths (composed
from the inner spec's maps, evaluated on the document blocks only, generic) and its arguments."""

from __future__ import annotations

import pytest
import torch
from zoo_oracles import mask_mod_dense, qkv, table

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo.functions import FunctionMask
from flexattn_zoo.masks import (
    Causal,
    Dense,
    Document,
    GlobalWindow,
    Natten,
    PerDocument,
    PrefixLM,
    SlidingWindow,
)
from flexattn_zoo.spec import MaskSpec, spec_dataclass
from flexattn_zoo.testing import assert_mask_consistent, assert_matches_reference

# ---- per_document --------------------------------------------------------------------------------


def _per_document_prefix_lm(lengths: list[int], prefix: int) -> torch.Tensor:
    """Per-document prefix-LM, from the lengths alone: within a document starting at ``s``, key
    ``j`` is visible to query ``i`` iff ``j - s < prefix`` or ``j <= i``."""
    owner = [d for d, n in enumerate(lengths) for _ in range(n)]
    start = [sum(lengths[:d]) for d in owner]
    total = sum(lengths)
    return table(total, total, lambda i, j: owner[i] == owner[j] and (j - start[j] < prefix or j <= i))


def test_per_document_prefix_lm_matches_an_independent_oracle() -> None:
    lengths = [5, 9, 3, 7]
    spec = PerDocument(inner=PrefixLM(prefix_len=4), documents=Document.from_lengths(lengths))
    want = _per_document_prefix_lm(lengths, 4)
    assert torch.equal(spec.dense(24, 24), want)
    assert torch.equal(mask_mod_dense(spec, 24, 24), want)
    assert_mask_consistent(spec, 24, 24, block_sizes=((4, 4), (16, 16), (3, 5)))
    # The attention itself, on the dense route with gradients, against the oracle as a raw mask.
    q, k, v = qkv(1, 24, 24)
    out = fz.attention(q, k, v, mask=spec, backend="dense")
    oracle = lambda b, h, i, j: want[0, 0, i, j]  # noqa: E731
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert_matches_reference(out, q, k, v, mask=oracle, grads=grads, grad_out=torch.ones_like(out))
    # Per batch row: two layouts, one spec.
    rows = [[6, 6, 12], [10, 14]]
    batched = PerDocument.from_lengths(PrefixLM(prefix_len=4), rows)
    want_rows = torch.cat([_per_document_prefix_lm(r, 4) for r in rows])
    assert torch.equal(batched.dense(24, 24, batch=2), want_rows)
    assert torch.equal(mask_mod_dense(batched, 24, 24, batch=2), want_rows)


def test_per_document_runs_are_documents_and_inner_tensors_see_local_positions() -> None:
    # Labels 0, 1, 0: three documents (Document would join the two runs of label 0).
    ids = torch.tensor([0, 0, 0, 1, 1, 0, 0, 0])
    spec = PerDocument(inner=GlobalWindow.from_positions([0], 3, left=0), documents=ids)
    # Inside each document its first token is global (the inner flags index local positions).
    starts, owner = [0, 0, 0, 3, 3, 5, 5, 5], [0, 0, 0, 1, 1, 2, 2, 2]
    want = table(8, 8, lambda i, j: owner[i] == owner[j] and (i == j or i == starts[i] or j == starts[j]))
    assert torch.equal(spec.dense(8, 8), want) and torch.equal(mask_mod_dense(spec, 8, 8), want)
    assert not torch.equal(want, (Document(doc_ids=ids) & Causal()).dense(8, 8))
    assert_mask_consistent(spec, 8, 8, block_sizes=((2, 2), (3, 4)))


def test_per_document_causal_is_document_and_causal_with_its_varlen_form() -> None:
    docs = Document.from_lengths([[40, 60, 28], [100, 28]])
    spec, plain = PerDocument(inner=Causal(), documents=docs), docs & Causal()
    assert torch.equal(spec.dense(128, 128, batch=2), plain.dense(128, 128, batch=2))
    form, want = spec.varlen_form(128, 128, 2), plain.varlen_form(128, 128, 2)
    assert form is not None and want is not None and form.window == want.window == (-1, 0)
    assert torch.equal(form.segments, want.segments)
    assert spec.hides_future_keys(128, 128) and spec.sdpa_form(128, 128) is None
    # Bottom-right causal inside a document is top-left causal (equal lengths).
    assert torch.equal(
        PerDocument(inner=Causal(align="bottom_right"), documents=docs).dense(128, 128, batch=2),
        spec.dense(128, 128, batch=2),
    )
    one = PerDocument(inner=PrefixLM(prefix_len=5), documents=torch.zeros(64, dtype=torch.long))
    assert one.split_form(64, 64) == PrefixLM(prefix_len=5).split_form(64, 64)
    assert PerDocument(inner=PrefixLM(prefix_len=5), documents=docs).varlen_form(128, 128, 2) is None


def test_per_document_block_map_paths() -> None:
    aligned = Document.from_lengths([32, 64, 32])
    unaligned = Document.from_lengths([30, 50, 48])
    for docs, composed in ((aligned, True), (unaligned, False)):
        spec = PerDocument(inner=SlidingWindow(left=5, right=2), documents=docs)
        assert (spec._composed_map(128, 100, 16, 32, "cpu") is not None) is composed
        assert spec.block_map(128, 100, 16, 32, "cpu") is not None
        assert_mask_consistent(spec, 128, 100, block_sizes=((16, 32), (32, 16)))
    # An inner spec that depends on the head: neither path knows the head count, the generic
    # builder takes over (exact too).
    heads = PerDocument(inner=masks.get("causal") | _HeadMask(), documents=unaligned)
    assert heads.block_map(128, 128, 16, 16, "cpu") is None
    assert_mask_consistent(heads, 128, 128, heads=2, block_sizes=((16, 16),))


@spec_dataclass
class _HeadMask(MaskSpec):
    """Head 1 sees everything, head 0 nothing (a head-dependent inner spec for the test above)."""

    depends_on_head = True

    def _make_mask_mod(self):  # type: ignore[no-untyped-def]
        return lambda b, h, i, j: (h == 1) & (i >= 0) & (j >= 0)

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        out = torch.zeros(1, heads, q_len, kv_len, dtype=torch.bool)
        out[:, 1:] = True
        return out


def test_per_document_oracle_takes_an_inner_oracle_with_every_head() -> None:
    # A FunctionMask's oracle has the call's batch and heads although the function reads neither
    # (the [B|1, H|1] contract): PerDocument's oracle, and so the dense route and the reference,
    # once failed to paint it into its one-head result at heads > 1.
    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    spec = PerDocument(inner=FunctionMask(fn=causal), documents=Document.from_lengths([3, 5]))
    want = (Document.from_lengths([3, 5]) & Causal()).dense(8, 8)
    assert torch.equal(spec.dense(8, 8, batch=2, heads=2).expand(2, 2, 8, 8), want.expand(2, 2, 8, 8))
    assert_mask_consistent(spec, 8, 8, batch=2, heads=2)
    q, k, v = qkv(2, 8, 8)
    out = fz.attention(q, k, v, mask=spec, backend="dense")
    assert_matches_reference(out, q, k, v, mask=spec)


def test_per_document_one_document_cut_by_unequal_lengths() -> None:
    # One 8-token document with 5 queries: the inner Dense mask is its 8 x 8 square, of which the
    # problem is the corner. Its SDPA form (the 8 x 8 tensor) once reached SDPA as the 5 x 8
    # problem's attn_mask ("No available kernel" on auto's sdpa_flash), and the oracle refused.
    square = torch.ones(8, 8, dtype=torch.bool).tril() | (torch.arange(8) % 3 == 0)
    spec = PerDocument(inner=masks.Dense(mask=square), documents=Document.from_lengths([8]))
    assert spec.sdpa_form(5, 8) is None and spec.sdpa_form(8, 8) is not None
    assert torch.equal(spec.dense(5, 8), square[None, None, :5])
    assert_mask_consistent(spec, 5, 8, block_sizes=((128, 128), (2, 4)))
    q, k, v = qkv(1, 5, 8)
    out = fz.attention(q, k, v, mask=spec)
    assert_matches_reference(out, q, k, v, mask=spec)


def test_per_document_accepts_names_ids_and_refuses_the_rest() -> None:
    spec = PerDocument.from_lengths("causal", [3, 5])
    assert spec == PerDocument(inner=Causal(), documents=[0, 0, 0, 1, 1, 1, 1, 1])
    assert spec.inner == Causal() and isinstance(spec.documents, Document)
    with pytest.raises(TypeError, match="PerDocument\\(inner=...\\) must be a mask spec"):
        PerDocument(inner=3, documents=[0, 1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="has length 8 but the problem needs"):
        spec.validate(9, 9, 1, 1)
    # The inner spec is validated at every document length: a Dense inner sized for 8 tokens
    # once ran on a 5-token document's corner while its oracle refused that document.
    dense8 = Dense(mask=torch.ones(8, 8, dtype=torch.bool).tril())
    PerDocument.from_lengths(dense8, [8, 8]).validate(16, 16, 1, 1)
    with pytest.raises(ValueError, match=r"Dense\(mask=...\) has shape"):
        PerDocument.from_lengths(dense8, [8, 5]).validate(13, 13, 1, 1)
    natten = PerDocument.from_lengths(Natten(canvas=(2, 3), kernel=1), [6, 6])
    natten.validate(12, 12, 1, 1)
    with pytest.raises(ValueError, match="canvas"):
        PerDocument.from_lengths(Natten(canvas=(2, 3), kernel=1), [6, 7]).validate(13, 13, 1, 1)
