"""A subclass of a preset that replaces its function drops the forms inherited from above it.

Forms (an SDPA flag, a block map, a lower bound on the keys, one run of keys, a bias's slopes,
the score variant for masks that hide future keys...) describe one function; a subclass that
replaces the function and kept them would run its parent's attention on every route that trusts
a form. Each case below computed the wrong attention before the forms followed the function.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from subclassed_specs import (
    DocumentsCausalOnOddRows,
    EvenKeys,
    RecentOnly,
    ShiftedChunks,
    SquaredDistance,
    StrictlyCausal,
)

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.models import decode
from flexattn_zoo.reference import reference_attention
from flexattn_zoo.spec import (
    MaskMod,
    MaskSpec,
    ScoreMod,
    ScoreSpec,
    function_mask_oracle,
    function_score_oracle,
    spec_dataclass,
)
from flexattn_zoo.testing import assert_mask_consistent, assert_matches_reference, assert_score_consistent

MASKS = [StrictlyCausal(), RecentOnly(left=5), ShiftedChunks(size=16)]


def _routes_that_accept(q, k, v, **kwargs) -> list[str]:
    plan = fz.plan(q, k, v, **kwargs)
    return [c.name for c in plan.candidates if c.accepted]


@pytest.mark.parametrize("spec", MASKS, ids=lambda s: type(s).__name__)
def test_inherited_mask_forms_give_way_to_the_defaults(spec: MaskSpec) -> None:
    for name in MaskSpec.FORMS:
        assert getattr(type(spec), name) is MaskSpec.__dict__[name], name
    assert spec.sdpa_form(64, 64) is None
    assert spec.sees_one_run() is False
    assert spec.lowest_visible_key(torch.arange(8)) is None
    assert spec.block_map(64, 64, 16, 16, "cpu") is None
    assert spec.bind(64, 64) is spec
    assert_mask_consistent(spec, 70, 70)


@pytest.mark.parametrize("spec", MASKS, ids=lambda s: type(s).__name__)
def test_a_subclass_with_its_own_mask_function_runs_exactly_on_every_route_that_takes_it(
    spec: MaskSpec,
) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 70, 16) for _ in range(3))
    routes = _routes_that_accept(q, k, v, mask=spec)
    assert "flex_cpu" in routes and "dense" in routes
    for route in ["auto", *routes]:
        out = fz.attention(q, k, v, mask=spec, backend=route)
        assert_matches_reference(out, q, k, v, mask=spec)


@pytest.mark.parametrize("spec", MASKS, ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("length", [1, 6, 17, 40, 64])
def test_a_subclass_with_its_own_mask_function_decodes_exactly(spec: MaskSpec, length: int) -> None:
    torch.manual_seed(1)
    k, v = (torch.randn(1, 2, 64, 8, dtype=torch.float64) for _ in range(2))
    q_all = torch.randn(1, 2, length, 8, dtype=torch.float64)
    ref = fz.attention(q_all, k[:, :, :length], v[:, :, :length], mask=spec, backend="dense")
    with torch.no_grad():
        out = decode.decode_step(q_all[:, :, -1:], k, v, length, mask=spec)
    torch.testing.assert_close(out, ref[:, :, -1:], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("spec", [StrictlyCausal(), EvenKeys()], ids=lambda s: type(s).__name__)
def test_packed_sequences_run_a_subclass_by_its_own_function(spec: MaskSpec) -> None:
    """``fz.varlen_attention`` lays out masks that read only ``j - i`` (Full, Causal, ...) in packed
    coordinates directly; a subclass with its own function is run per sequence instead."""
    torch.manual_seed(3)
    cu = torch.tensor([0, 5, 12, 18], dtype=torch.int32)
    q, k, v = (torch.randn(18, 2, 8, dtype=torch.float64) for _ in range(3))
    out = fz.varlen_attention(q, k, v, cu, cu, 7, 7, mask=spec, backend="dense")
    bounds = cu.tolist()
    ref = torch.cat(
        [
            reference_attention(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), mask=spec)[0].transpose(
                0, 1
            )
            for a, b in zip(bounds, bounds[1:], strict=False)
        ]
    )
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


def test_a_subclass_whose_function_reads_the_batch_row_gets_a_block_mask_per_row() -> None:
    """``Document.uses_batch()`` says whether its ids differ per row; a subclass whose function
    reads ``b`` falls back to ``depends_on_batch``, so its BlockMask is built per row (shared, the
    first row's full blocks let the other rows see keys their function hides)."""
    spec = DocumentsCausalOnOddRows(doc_ids=torch.tensor([0] * 128 + [1] * 128))
    assert spec.uses_batch()
    torch.manual_seed(4)
    q, k, v = (torch.randn(2, 2, 256, 16) for _ in range(3))
    for route in ["flex_cpu", "dense"]:
        out = fz.attention(q, k, v, mask=spec, backend=route)
        assert_matches_reference(out, q, k, v, mask=spec)


@spec_dataclass
class CausalThenFullOnOddRows(masks.Causal):
    """Causal in even batch rows, everything visible in odd ones: a function that reads ``b``
    while Causal declares no batch dependence."""

    def _make_mask_mod(self) -> MaskMod:
        def causal_then_full_on_odd_rows(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) | (b % 2 == 1)

        return causal_then_full_on_odd_rows

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril()
        return torch.stack([causal if b % 2 == 0 else torch.ones_like(causal) for b in range(batch)])[:, None]


@spec_dataclass
class DiagonalHidden(masks.Causal):
    """Causal without the diagonal, declaring that its function reads neither ``b`` nor ``h``."""

    depends_on_batch = False
    depends_on_head = False

    def _make_mask_mod(self) -> MaskMod:
        def diagonal_hidden(b, h, q_idx, kv_idx):
            return kv_idx < q_idx

        return diagonal_hidden

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        return torch.ones(q_len, kv_len, dtype=torch.bool).tril(-1)[None, None]


def test_a_replaced_function_may_read_the_batch_row_and_head_unless_the_class_says_otherwise() -> None:
    """A parent that declares no batch or head dependence says nothing about a new function: the
    subclass's BlockMask is built per row and head unless it sets the flags itself."""
    spec = CausalThenFullOnOddRows()
    assert spec.uses_batch() and spec.uses_head()
    assert not DiagonalHidden().uses_batch() and not DiagonalHidden().uses_head()
    assert StrictlyCausal().uses_batch()  # declares nothing: may read the row, as far as anyone knows
    torch.manual_seed(5)
    q, k, v = (torch.randn(2, 2, 256, 16) for _ in range(3))
    for route in ["flex_cpu", "dense"]:
        out = fz.attention(q, k, v, mask=spec, backend=route)
        assert_matches_reference(out, q, k, v, mask=spec)


def test_per_document_refuses_a_document_subclass_with_its_own_function() -> None:
    with pytest.raises(TypeError, match="reads only the document ids"):
        masks.PerDocument(
            documents=DocumentsCausalOnOddRows(doc_ids=torch.tensor([0, 0, 1, 1])), inner="causal"
        )


def test_inherited_score_forms_give_way_to_the_defaults() -> None:
    spec = SquaredDistance(num_heads=4)
    for name in ScoreSpec.FORMS:
        assert getattr(type(spec), name) is ScoreSpec.__dict__[name], name
    assert spec.linear_bias_form() is None
    assert spec.sdpa_form(32, 32) is None
    assert spec.score_mod(future_keys_hidden=True) is spec.score_mod()
    assert_score_consistent(spec, heads=4)


@pytest.mark.parametrize("mask", [None, masks.Causal()], ids=["no mask", "causal"])
def test_a_score_subclass_with_its_own_function_runs_exactly_on_every_route_that_takes_it(mask) -> None:
    torch.manual_seed(2)
    spec = SquaredDistance(num_heads=4)
    q, k, v = (torch.randn(1, 4, 40, 16) * 0.5 for _ in range(3))
    routes = _routes_that_accept(q, k, v, mask=mask, score_mod=spec)
    assert "flex_cpu" in routes
    for route in ["auto", *routes]:
        out = fz.attention(q, k, v, mask=mask, score_mod=spec, backend=route)
        assert_matches_reference(out, q, k, v, mask=mask, score_mod=spec)


@spec_dataclass
class Renamed(masks.SlidingWindow):
    """SlidingWindow under another name: the same function, so the same forms."""


@spec_dataclass
class CausalSpelledAgain(masks.Causal):
    """Causal's visibility spelled anew, restating the forms that still hold."""

    sdpa_form = masks.Causal.sdpa_form
    sees_one_run = masks.Causal.sees_one_run

    def _make_mask_mod(self) -> MaskMod:
        def causal_again(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        return causal_again


class _OneRunMixin:
    """A form from a class that defines no mask function: kept by every spec that mixes it in."""

    def sees_one_run(self) -> bool:
        return True


@spec_dataclass
class MixedIn(_OneRunMixin, MaskSpec):
    """The ``left`` keys up to the query, its form from a mixin."""

    left: int = 3

    def _make_mask_mod(self) -> MaskMod:
        left = self.left

        def mixed_in(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (kv_idx >= q_idx - left)

        return mixed_in

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        return torch.ones(q_len, kv_len, dtype=torch.bool).tril().triu(-self.left)[None, None]

    def lowest_visible_key(self, q_idx: torch.Tensor) -> torch.Tensor:
        return q_idx - self.left


def test_forms_stay_where_the_function_stays_or_the_class_restates_them() -> None:
    window = Renamed(left=4)
    for name in MaskSpec.FORMS:
        assert getattr(Renamed, name) is getattr(masks.SlidingWindow, name), name
    assert window.sees_one_run() and window.sdpa_form(32, 32) == masks.SlidingWindow(left=4).sdpa_form(32, 32)
    again = CausalSpelledAgain()
    assert again.sdpa_form(8, 8) == masks.Causal().sdpa_form(8, 8)
    assert again.sees_one_run()
    assert CausalSpelledAgain.block_map is MaskSpec.block_map  # not restated: dropped
    assert MixedIn().sees_one_run()
    for spec in (window, again, MixedIn()):
        assert_mask_consistent(spec, 40, 40)


def test_no_class_the_library_ships_has_a_form_dropped() -> None:
    """Every shipped spec class that replaces a parent's function restates the forms it keeps:
    none holds a default put there in place of an inherited form."""

    # The modules that define spec classes beyond those the package imports (masks/ and
    # score_mods/ are imported whole), so the set does not depend on what other tests imported.
    for name in ("flexattn_zoo.hf.mask_reader", "flexattn_zoo.packed.specs"):
        importlib.import_module(name)

    def subclasses(cls: type) -> list[type]:
        found = []
        for sub in cls.__subclasses__():
            found += [sub, *subclasses(sub)]
        return found

    shipped = [
        (base, c)
        for base in (MaskSpec, ScoreSpec)
        for c in subclasses(base)
        if c.__module__.split(".")[0] in ("flexattn_zoo", "masks", "score_mods")
    ]
    assert len(shipped) > 30
    dropped = [
        (cls.__name__, name)
        for base, cls in shipped
        for name in base.FORMS
        if cls.__dict__.get(name) is base.__dict__[name]
    ]
    assert dropped == []
    oracles = (function_mask_oracle, function_score_oracle)
    assert [cls.__name__ for _, cls in shipped if cls.__dict__.get("dense") in oracles] == []


# An oracle describes one function too: a subclass that replaces the function and writes no
# `dense` of its own gets its own function called on the index grids, not its parent's oracle
# (which made every correct route fail the reference, and `assert_mask_consistent` fail).


@spec_dataclass
class StrictlyCausalUnwritten(masks.Causal):
    """Causal without the diagonal (StrictlyCausal's function); no oracle written."""

    _make_mask_mod = StrictlyCausal._make_mask_mod


@spec_dataclass
class OddKeysHiddenInDocuments(masks.Document):
    """Documents with their odd keys hidden, indexing the captured ids; no oracle written."""

    def _make_mask_mod(self) -> MaskMod:
        ids = self.doc_ids

        def odd_keys_hidden(b, h, q_idx, kv_idx):
            return (ids[q_idx] == ids[kv_idx]) & (kv_idx % 2 == 0)

        return odd_keys_hidden


@spec_dataclass
class LinearDistanceUnwritten(score_mods.Alibi):
    """ALiBi's slopes on ``q - kv`` signed, for every pair; no oracle written."""

    def _make_score_mod(self, *, fast: bool) -> ScoreMod:
        slopes = self.head_slopes()

        def signed_distance(score, b, h, q_idx, kv_idx):
            slope = torch.where(h == 0, slopes[0], slopes[1])
            return score - slope * (q_idx - kv_idx)

        return signed_distance


def test_a_subclass_without_an_oracle_of_its_own_is_checked_against_its_own_function() -> None:
    assert StrictlyCausalUnwritten.dense is function_mask_oracle
    assert torch.equal(
        StrictlyCausalUnwritten().dense(6, 6), torch.ones(6, 6, dtype=torch.bool).tril(-1)[None, None]
    )
    ids = torch.tensor([0] * 7 + [1] * 9)
    documents = OddKeysHiddenInDocuments(doc_ids=ids)
    expected = (ids[:, None] == ids[None, :]) & (torch.arange(16) % 2 == 0)
    assert torch.equal(documents.dense(16, 16, batch=2), expected.expand(2, 1, 16, 16))
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 2, 16, 8) for _ in range(3))
    for spec in (StrictlyCausalUnwritten(), documents):
        assert_mask_consistent(spec, 16, 16, batch=2, heads=2)
        for route in ["auto", *_routes_that_accept(q, k, v, mask=spec)]:
            out = fz.attention(q, k, v, mask=spec, backend=route)
            assert_matches_reference(out, q, k, v, mask=spec)


def test_a_score_subclass_without_an_oracle_of_its_own_is_checked_against_its_own_function() -> None:
    spec = LinearDistanceUnwritten(num_heads=2)
    assert LinearDistanceUnwritten.dense is function_score_oracle
    scores = torch.zeros(1, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    slopes = torch.tensor(spec.head_slopes(), dtype=torch.float64).view(2, 1, 1)
    distance = (torch.arange(5)[:, None] - torch.arange(5)[None, :]).double()
    biased = spec.dense(scores)
    assert biased.dtype == torch.float64
    torch.testing.assert_close(biased, (-slopes * distance)[None])
    biased.sum().backward()  # the reference's backward runs through the oracle
    assert torch.equal(scores.grad, torch.ones_like(scores))
    assert_score_consistent(spec, heads=2)
    torch.manual_seed(4)
    q, k, v = (torch.randn(1, 2, 24, 8) * 0.5 for _ in range(3))
    for mask in (None, masks.Causal()):
        for route in ["auto", *_routes_that_accept(q, k, v, mask=mask, score_mod=spec)]:
            out = fz.attention(q, k, v, mask=mask, score_mod=spec, backend=route)
            assert_matches_reference(out, q, k, v, mask=mask, score_mod=spec)


@spec_dataclass
class CausalOracleRestated(masks.Causal):
    """Causal spelled anew, restating the parent's oracle, which still describes it."""

    dense = masks.Causal.dense
    _make_mask_mod = CausalSpelledAgain._make_mask_mod


def test_an_oracle_stays_where_the_function_stays_or_the_class_restates_it() -> None:
    assert Renamed.dense is masks.SlidingWindow.dense
    assert CausalOracleRestated.dense is masks.Causal.dense
    assert StrictlyCausal.dense is not function_mask_oracle  # written in the class
    assert_mask_consistent(CausalOracleRestated(), 12, 12)


def test_explain_names_the_forms_a_subclass_does_not_use() -> None:
    q = torch.randn(1, 4, 32, 16)
    text = fz.plan(
        q, q, q, mask=StrictlyCausal() & masks.SlidingWindow(left=8), score_mod=SquaredDistance(num_heads=4)
    ).explain()
    notes = [line for line in text.splitlines() if line.startswith("note:")]
    assert len(notes) == 2, text
    assert notes[0].startswith(
        "note: StrictlyCausal replaces Causal's function, so it does not use Causal's "
    )
    assert "sdpa_form" in notes[0] and "e.g. sdpa_form = Causal.sdpa_form" in notes[0]
    assert (
        notes[1].startswith("note: SquaredDistance replaces Alibi's function")
        and "linear_bias_form" in notes[1]
    )
    # Restated forms are used, and a class keeping its parent's function has nothing to note.
    again = fz.plan(q, q, q, mask=CausalSpelledAgain()).explain()
    note = next(line for line in again.splitlines() if line.startswith("note:"))
    assert "sdpa_form" not in note and "sees_one_run" not in note and "block_map" in note
    assert "note:" not in fz.plan(q, q, q, mask=Renamed(left=4)).explain()
    assert "note:" not in fz.plan(q, q, q, mask=masks.Causal()).explain()


class _CausalOnOddRowsMixin:
    """A mask function from a plain mixin class: the spec mixing it in before ``masks.Causal``
    runs it in place of Causal's."""

    def _make_mask_mod(self) -> MaskMod:
        def causal_on_odd_rows(b, h, q_idx, kv_idx):
            return (b % 2 == 0) | (kv_idx <= q_idx)

        return causal_on_odd_rows


@spec_dataclass
class CausalOnOddRows(_CausalOnOddRowsMixin, masks.Causal):
    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril()
        return torch.stack([torch.ones_like(causal) if b % 2 == 0 else causal for b in range(batch)])[:, None]


def test_a_function_from_a_mixin_replaces_the_parents_like_one_in_the_class_body() -> None:
    spec = CausalOnOddRows()
    assert spec.uses_batch() and spec.uses_head()  # its function may read b and h
    assert spec.sdpa_form(16, 16) is None and not spec.sees_one_run()
    # 256 keys: whole 128-blocks, which a BlockMask built for row 0 alone (all visible) marks full
    torch.manual_seed(6)
    q, k, v = (torch.randn(2, 2, 256, 8) for _ in range(3))
    for route in ["auto", *_routes_that_accept(q, k, v, mask=spec)]:
        out = fz.attention(q, k, v, mask=spec, backend=route)
        assert_matches_reference(out, q, k, v, mask=spec)
    note = next(
        line for line in fz.plan(q, k, v, mask=spec).explain().splitlines() if line.startswith("note:")
    )
    assert note.startswith(
        "note: CausalOnOddRows runs _CausalOnOddRowsMixin's function in place of Causal's function"
    )


def test_explain_suggests_no_private_form_and_names_an_inherited_function() -> None:
    q = torch.randn(1, 4, 32, 16)
    note = next(
        line
        for line in fz.plan(q, q, q, score_mod=SquaredDistance(num_heads=4)).explain().splitlines()
        if line.startswith("note:")
    )
    assert "_make_past_score_mod" in note and "e.g. linear_bias_form = Alibi.linear_bias_form" in note

    class Grandchild(StrictlyCausal):
        pass

    note = next(
        line
        for line in fz.plan(q, q, q, mask=Grandchild()).explain().splitlines()
        if line.startswith("note:")
    )
    assert note.startswith("note: Grandchild runs StrictlyCausal's function in place of Causal's function")
