"""Specs are immutable values and every cache keyed by them is sound (docs/caches.md, "When what a
key describes changes").

Two classes of data corruption, each covered from several sides:

* a spec kept the caller's tensor: an in-place write to it changed the spec behind the back of
  its cached hash, its equality memo, its per-instance caches and every library cache keyed by
  it. Worst form: a loop that refills one ids buffer and builds a new ``Document`` each step got
  an earlier step's mask whenever two layouts' content fingerprints collided (``_values_equal``'s
  ``a is b`` short-circuit on the shared buffer). Fix: specs own a copy of their tensors.
* a raw ``mask_mod`` closure was cached by function identity alone: after an in-place write to a
  tensor it captures, its stale BlockMask (block sparsity) ran with the live ``mask_mod``. Fix:
  everything derived from a callable is keyed by the versions of the tensors it captures, and
  ``fz.invalidate(fn)`` announces any other change.

Plus ``fz.Attention``'s supported ways to change a layer's mask (per-call override, ``set_mask``).
Most checks compare BlockMasks or cache keys (no compile); a few run ``flex_cpu`` end to end.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import pickle
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from learned_bias import LearnedHeadBias

import flexattn_zoo as fz
from flexattn_zoo import blockmask, masks, score_mods, spec
from flexattn_zoo.backends import varlen
from flexattn_zoo.functions import FunctionMask, FunctionScore, capture_state
from flexattn_zoo.plan_cache import PLANS
from flexattn_zoo.registry import MASKS
from flexattn_zoo.segments import LAYOUT_CACHE, segment_layout
from flexattn_zoo.spec import Spec
from flexattn_zoo.testing import assert_matches_reference, reference_attention

L = 256  # two 128-blocks per side: a stale BlockMask skips a block the live mask needs
TWO_DOCS = [0] * 128 + [1] * 128


def _qkv(length: int = L, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 2, length, 16, generator=g) for _ in range(3))


def _blocks(bm: Any) -> tuple[torch.Tensor, ...]:
    """What a BlockMask says about block sparsity: visible blocks and full blocks, densely."""
    full = bm.full_kv_num_blocks
    return (bm.to_dense(), bm.kv_num_blocks, full if full is not None else torch.zeros(0))


def _same_blocks(a: Any, b: Any) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_blocks(a), _blocks(b), strict=True))


def _fresh_doc_blocks(ids: torch.Tensor, length: int = L) -> Any:
    """The BlockMask of a brand-new closure over a private copy of ``ids`` (nothing cached)."""
    snap = ids.clone()
    return fz.block_mask(lambda b, h, q, kv: snap[q] == snap[kv], length, length)


def _colliding_sorted_layouts(length: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs of distinct sorted document-id layouts with equal ``spec._fingerprint``."""
    seen: dict[int, torch.Tensor] = {}
    pairs = []
    for bits in range(1 << (length - 1)):
        ids = torch.tensor([0] + [(bits >> i) & 1 for i in range(length - 1)]).cumsum(0)
        fp = spec._fingerprint(ids)
        if fp in seen:
            pairs.append((seen[fp], ids))
            if len(pairs) == count:
                break
        else:
            seen[fp] = ids
    return pairs


# ---------------------------------------------------------------------------------------------
# 1. Specs own their tensors.


def _tensor_examples() -> list[Any]:
    """Every registry example that holds a tensor parameter (Document, PrefixLM, KeyPadding...)."""
    out = []
    for name in MASKS.names():
        cls = MASKS.entry(name).factory
        if not isinstance(cls, type):
            continue
        for i, ex in enumerate(cls.examples(64, 64, 2, 2)):
            if ex.tensors():
                out.append(pytest.param(ex, id=f"{name}-{i}"))
    return out


@pytest.mark.parametrize("example", _tensor_examples())
def test_writing_to_the_callers_tensor_never_changes_a_registry_spec(example: Any) -> None:
    # Rebuild the example from caller-held buffers, then scribble over every buffer.
    fields = {f.name: getattr(example, f.name) for f in dataclasses.fields(example)}
    buffers = {k: v.clone() for k, v in fields.items() if isinstance(v, torch.Tensor)}
    built = type(example)(**{**fields, **buffers})
    before = built.dense(64, 64, batch=2, heads=2).clone()
    h = hash(built)
    for buf in buffers.values():
        buf.copy_(torch.ones_like(buf) if buf.dtype == torch.bool else (buf + 3) % 5)
    assert built == example and hash(built) == h == hash(example)
    assert torch.equal(built.dense(64, 64, batch=2, heads=2), before)
    for t in built.tensors():
        assert all(t.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() for b in buffers.values())


def test_composites_own_their_parts_tensors() -> None:
    buf = torch.tensor(TWO_DOCS)
    composite = ~(masks.Document(doc_ids=buf) & masks.Causal()) | masks.PrefixLM(prefix_len=torch.tensor([3]))
    reference = ~(masks.Document(doc_ids=torch.tensor(TWO_DOCS)) & masks.Causal()) | masks.PrefixLM(
        prefix_len=torch.tensor([3])
    )
    hash(composite)
    buf.zero_()
    assert composite == reference and hash(composite) == hash(reference)
    assert torch.equal(composite.dense(L, L), reference.dense(L, L))


def test_refilled_buffer_with_a_new_document_each_step_never_gets_an_old_mask() -> None:
    # The worst form: one ids buffer refilled in place, a new Document per step, and layouts whose
    # content fingerprints collide (common for sorted labels at L=16). The old code served the
    # first step's BlockMask and mask_mod at the second step (equality short-circuited on the
    # shared buffer), on every route that caches by spec.
    pairs = _colliding_sorted_layouts(16, 4)
    assert len(pairs) == 4
    q, k, v = _qkv(16)
    buf = torch.zeros(16, dtype=torch.int64)
    for first, second in pairs:
        for layout in (first, second):
            buf.copy_(layout)
            doc = masks.Document(doc_ids=buf)
            expected = masks.Document(doc_ids=layout.clone())
            assert doc == expected and hash(doc) == hash(expected)
            for route in ("flex_cpu", "dense"):
                out = fz.attention(q, k, v, mask=doc, backend=route)
                assert_matches_reference(out, q, k, v, mask=expected)


def test_colliding_layouts_get_their_own_block_masks_and_offsets() -> None:
    first, second = _colliding_sorted_layouts(16, 1)[0]
    buf = first.clone()
    a = masks.Document(doc_ids=buf)
    bm_a = fz.block_mask(a, 16, 16, block_size=16)
    cu_a = varlen.cu_seqlens(a, 1, 16, 16, "cpu").cu_q
    buf.copy_(second)
    b = masks.Document(doc_ids=buf)
    assert a != b and hash(a) == hash(b)  # a true fingerprint collision, told apart by value
    assert fz.block_mask(b, 16, 16, block_size=16) is not bm_a
    cu_b = varlen.cu_seqlens(b, 1, 16, 16, "cpu").cu_q
    assert torch.equal(cu_a, torch.tensor([0, *first.bincount().cumsum(0).tolist()], dtype=torch.int32))
    assert torch.equal(cu_b, torch.tensor([0, *second.bincount().cumsum(0).tolist()], dtype=torch.int32))


def test_equality_memo_never_outlives_a_value() -> None:
    buf = torch.tensor(TWO_DOCS)
    a = masks.Document(doc_ids=buf)
    b = masks.Document(doc_ids=torch.tensor(TWO_DOCS))
    assert a == b  # remembered in spec._EQ_MEMO by id pair
    buf.zero_()
    c = masks.Document(doc_ids=buf)
    assert a == b and a != c and b != c
    del a, b, c
    gc.collect()
    # New specs at possibly reused addresses: verdicts are recomputed, never inherited.
    d = masks.Document(doc_ids=buf)
    e = masks.Document(doc_ids=torch.tensor(TWO_DOCS))
    assert d != e


def test_a_long_lived_spec_compared_with_many_equal_ones_keeps_no_finalizer_each() -> None:
    """Each remembered verdict registers a finalizer on both specs; when either is collected the
    other's is dropped too (a layer's spec compared with a new equal spec per step kept one
    finalizer per step)."""
    kept = masks.Document(doc_ids=torch.tensor(TWO_DOCS))
    gc.collect()
    before = len(weakref.finalize._registry)  # type: ignore[attr-defined]
    for _ in range(50):
        assert kept == masks.Document(doc_ids=torch.tensor(TWO_DOCS))
    gc.collect()
    assert len(weakref.finalize._registry) - before <= 2  # type: ignore[attr-defined]


def test_compile_keys_of_unhashable_captures_never_match_a_collected_ones() -> None:
    """An unhashable captured value keys a mod by identity: a new value at a collected one's
    address gets a key of its own (the compile cache shares an entry only between equal keys)."""
    from flexattn_zoo.compile import mod_key

    def make(table: dict[str, int]) -> Any:
        return lambda b, h, q, kv: q >= kv + table["shift"]

    for shift in range(10):
        first = {"shift": shift}
        key = mod_key(make(first))
        del first  # freed here (no cycle): the next dict may take its address
        assert mod_key(make({"shift": shift + 1})) != key


def test_per_instance_layout_caches_follow_the_value() -> None:
    original = torch.tensor([0] * 100 + [1] * 156)
    buf = original.clone()
    doc = masks.Document(doc_ids=buf)
    LAYOUT_CACHE.clear()
    layout = segment_layout(doc, 1, L)
    form = doc.varlen_form(L, L, 1)
    buf.copy_(torch.tensor([0] * 128 + [1] * 128))
    assert segment_layout(doc, 1, L) == layout == ("packed", 0, (-1, -1))
    assert torch.equal(doc.varlen_form(L, L, 1).segments, form.segments)
    # ... and the oracle, the mask_mod and the block map agree with them (one value throughout)
    assert torch.equal(doc.dense(L, L), masks.Document(doc_ids=original).dense(L, L))
    assert _same_blocks(fz.block_mask(doc, L, L), _fresh_doc_blocks(original))
    assert segment_layout(masks.Document(doc_ids=buf), 1, L) == ("chunks", 128, (-1, -1))


def test_numpy_and_view_inputs_are_copied() -> None:
    arr = np.array(TWO_DOCS, dtype=np.int64)
    from_numpy = masks.Document(doc_ids=arr)  # torch.as_tensor shares the array's memory
    big = torch.tensor([TWO_DOCS, TWO_DOCS])
    from_view = masks.Document(doc_ids=big[1])
    arr[:] = 0
    big.zero_()
    expected = masks.Document(doc_ids=torch.tensor(TWO_DOCS))
    assert from_numpy == expected and from_view == expected


def test_ownership_copies_once_and_keeps_the_device() -> None:
    buf = torch.tensor(TWO_DOCS)
    doc = masks.Document(doc_ids=buf)
    assert doc.doc_ids is not buf and doc.doc_ids.device == buf.device
    # Re-wrapping an owned tensor (replace, to, bind, composites) copies nothing more.
    assert dataclasses.replace(doc).doc_ids is doc.doc_ids
    assert doc.to("cpu") is doc
    meta = masks.Document(doc_ids=torch.zeros(8, dtype=torch.int64, device="meta"))
    assert meta.doc_ids.device.type == "meta"
    moved = doc.to("meta")
    assert moved.doc_ids.device.type == "meta" and spec._is_owned(moved.doc_ids)


def test_tensors_that_require_grad_stay_the_callers() -> None:
    bias = torch.zeros(2, requires_grad=True)
    learned = LearnedHeadBias(bias=bias)
    assert learned.bias is bias and learned == LearnedHeadBias(bias=bias)
    assert learned != LearnedHeadBias(bias=bias.detach().clone().requires_grad_())
    q, k, v = _qkv(32)
    with torch.no_grad():
        bias.add_(torch.tensor([5.0, -5.0]))  # an optimizer step: the score mod sees it
    out = fz.attention(q, k, v, score_mod=learned, backend="dense")
    assert_matches_reference(out, q, k, v, score_mod=LearnedHeadBias(bias=bias))


def test_alibi_tensor_slopes_are_a_snapshot() -> None:
    slopes = torch.tensor([0.5, 0.25])
    alibi = score_mods.Alibi(num_heads=2, slopes=slopes)
    slopes.mul_(10)
    assert alibi.slopes == (0.5, 0.25)


def test_alibi_refuses_learned_slopes_it_could_only_snapshot() -> None:
    """ALiBi keeps its slopes as Python floats: a tensor that requires grad would be read once,
    get no gradient, and never see an optimizer's step, silently. Refused, naming the way out."""
    slopes = torch.nn.Parameter(torch.tensor([0.5, 0.25]))
    with pytest.raises(TypeError, match=r"Alibi\(slopes=\.\.\.\).*requires grad.*detach\(\)"):
        score_mods.Alibi(num_heads=2, slopes=slopes)
    assert score_mods.Alibi(num_heads=2, slopes=slopes.detach()).slopes == (0.5, 0.25)


def test_key_padding_built_from_the_tokenizer_mask_is_a_snapshot() -> None:
    attention_mask = torch.ones(1, L, dtype=torch.bool)
    pad = masks.KeyPadding(valid=attention_mask)
    bm = fz.block_mask(pad, L, L, batch=1)
    attention_mask[:, 128:] = False  # the next batch's padding, written into the same buffer
    assert fz.block_mask(pad, L, L, batch=1) is bm
    assert bool(pad.dense(L, L).all())
    new = masks.KeyPadding(valid=attention_mask)
    assert new != pad and not _same_blocks(fz.block_mask(new, L, L, batch=1), bm)


def test_attention_under_a_mutated_buffer_keeps_the_specs_layout() -> None:
    q, k, v = _qkv()
    buf = torch.tensor(TWO_DOCS)
    doc = masks.Document(doc_ids=buf)
    expected = masks.Document(doc_ids=torch.tensor(TWO_DOCS))
    fz.attention(q, k, v, mask=doc, backend="flex_cpu")
    buf.zero_()  # the spec is a snapshot: it still describes two documents, on every route
    for route in ("flex_cpu", "dense"):  # (the old code mixed them: cached flex, live dense)
        out = fz.attention(q, k, v, mask=doc, backend=route)
        assert_matches_reference(out, q, k, v, mask=expected)
    out = fz.attention(q, k, v, mask=masks.Document(doc_ids=buf), backend="flex_cpu")
    assert_matches_reference(out, q, k, v, mask=masks.Document(doc_ids=torch.zeros(L, dtype=torch.int64)))


# ---------------------------------------------------------------------------------------------
# 2. Raw callables: keyed by the versions of the tensors they capture.


def test_two_document_closure_after_in_place_update_matches_reference() -> None:
    # The example: the old code kept the first layout's block sparsity (error ~0.6).
    q, k, v = _qkv()
    ids = torch.tensor(TWO_DOCS)

    def mask_mod(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return ids[q_idx] == ids[kv_idx]

    out = fz.attention(q, k, v, mask=mask_mod, backend="flex_cpu")
    assert_matches_reference(out, q, k, v, mask=masks.Document(doc_ids=ids))
    ids[:] = torch.tensor([0] * 64 + [1] * 192)
    out = fz.attention(q, k, v, mask=mask_mod, backend="flex_cpu")
    assert_matches_reference(out, q, k, v, mask=masks.Document(doc_ids=ids))
    ids.zero_()
    out = fz.attention(q, k, v, mask=mask_mod)  # auto route, plan cache in the way
    assert_matches_reference(out, q, k, v, mask=masks.Document(doc_ids=ids))


IN_PLACE_WRITES = {
    "setitem": lambda t: t.__setitem__(slice(None), 0),
    "copy_": lambda t: t.copy_(torch.zeros_like(t)),
    "slice_view": lambda t: t[128:].fill_(0),
    "reshaped_view": lambda t: t.view(2, -1)[1].zero_(),
    "mul_": lambda t: t.mul_(0),
    "no_grad": lambda t: torch.no_grad()(t.zero_)(),
    "detach_alias": lambda t: t.detach().zero_(),
    "inference_mode": lambda t: torch.inference_mode()(t.zero_)(),
}


@pytest.mark.parametrize("write", list(IN_PLACE_WRITES), ids=list(IN_PLACE_WRITES))
def test_every_kind_of_in_place_write_rebuilds_the_block_mask(write: str) -> None:
    ids = torch.tensor(TWO_DOCS)
    fn = lambda b, h, q, kv: ids[q] == ids[kv]  # noqa: E731
    before = fz.block_mask(fn, L, L)
    assert _same_blocks(before, _fresh_doc_blocks(ids))
    IN_PLACE_WRITES[write](ids)
    after = fz.block_mask(fn, L, L)
    assert after is not before and _same_blocks(after, _fresh_doc_blocks(ids))
    assert fz.block_mask(fn, L, L) is after  # and cached again while nothing changes


_GLOBAL_IDS = torch.tensor(TWO_DOCS)


def _global_mask(b, h, q, kv):  # type: ignore[no-untyped-def]
    return _GLOBAL_IDS[q] == _GLOBAL_IDS[kv]


class _Packer:
    def __init__(self) -> None:
        self.ids = torch.tensor(TWO_DOCS)

    def mask(self, b, h, q, kv):  # type: ignore[no-untyped-def]
        return self.ids[q] == self.ids[kv]

    def __call__(self, b, h, q, kv):  # type: ignore[no-untyped-def]
        return self.ids[q] == self.ids[kv]


def _capture_forms() -> dict[str, Any]:
    """(callable, its ids tensor) for every way a callable can reach a tensor."""

    def closure() -> Any:
        ids = torch.tensor(TWO_DOCS)
        return (lambda b, h, q, kv: ids[q] == ids[kv]), ids

    def default_arg() -> Any:
        ids = torch.tensor(TWO_DOCS)

        def fn(b, h, q, kv, *, ids=ids):  # type: ignore[no-untyped-def]
            return ids[q] == ids[kv]

        return fn, ids

    def nested_helper() -> Any:
        ids = torch.tensor(TWO_DOCS)
        same = lambda a, c: ids[a] == ids[c]  # noqa: E731
        return (lambda b, h, q, kv: same(q, kv)), ids

    def in_a_list() -> Any:
        holder = [torch.tensor(TWO_DOCS)]
        return (lambda b, h, q, kv: holder[0][q] == holder[0][kv]), holder[0]

    def in_a_dict() -> Any:
        holder = {"ids": torch.tensor(TWO_DOCS)}
        return (lambda b, h, q, kv: holder["ids"][q] == holder["ids"][kv]), holder["ids"]

    def partial() -> Any:
        ids = torch.tensor(TWO_DOCS)

        def fn(ids, b, h, q, kv):  # type: ignore[no-untyped-def]
            return ids[q] == ids[kv]

        return functools.partial(fn, ids), ids

    def bound_method() -> Any:
        packer = _Packer()
        return packer.mask, packer.ids

    def callable_object() -> Any:
        packer = _Packer()
        return packer, packer.ids

    def captured_module() -> Any:
        module = torch.nn.Module()
        module.register_buffer("ids", torch.tensor(TWO_DOCS))
        return (lambda b, h, q, kv: module.ids[q] == module.ids[kv]), module.ids

    def module_global() -> Any:
        _GLOBAL_IDS.copy_(torch.tensor(TWO_DOCS))
        return _global_mask, _GLOBAL_IDS

    return {
        f.__name__: f
        for f in (
            closure,
            default_arg,
            nested_helper,
            in_a_list,
            in_a_dict,
            partial,
            bound_method,
            callable_object,
            captured_module,
            module_global,
        )
    }


@pytest.mark.parametrize("form", list(_capture_forms()))
def test_captured_tensors_are_tracked_however_they_are_reached(form: str) -> None:
    fn, ids = _capture_forms()[form]()
    # batch/heads: a partial or a callable object may read b and h as far as anyone can tell.
    before = fz.block_mask(fn, L, L, batch=1, heads=1)
    ids[:] = torch.tensor([0] * 64 + [1] * 192)
    after = fz.block_mask(fn, L, L, batch=1, heads=1)
    assert _same_blocks(after, _fresh_doc_blocks(ids)) and not _same_blocks(after, before)


def test_rebinding_a_captured_name_to_a_new_tensor_is_seen() -> None:
    global _GLOBAL_IDS
    saved = _GLOBAL_IDS
    try:
        _GLOBAL_IDS = torch.tensor(TWO_DOCS)
        before = fz.block_mask(_global_mask, L, L)
        _GLOBAL_IDS = torch.zeros(L, dtype=torch.int64)  # a new tensor, version 0 like the old one
        after = fz.block_mask(_global_mask, L, L)
        assert after is not before and _same_blocks(after, _fresh_doc_blocks(_GLOBAL_IDS))
    finally:
        _GLOBAL_IDS = saved


def test_nothing_is_rebuilt_while_nothing_changes() -> None:
    q, k, v = _qkv(64)
    ids = torch.tensor([0] * 32 + [1] * 32)
    fn = lambda b, h, qi, kv: ids[qi] == ids[kv]  # noqa: E731
    fz.attention(q, k, v, mask=fn, backend="dense")
    plans, masks_built = PLANS.inserts, blockmask.CACHE.inserts
    for _ in range(3):
        fz.attention(q, k, v, mask=fn, backend="dense")
        fz.block_mask(fn, 64, 64)
    assert PLANS.inserts == plans and blockmask.CACHE.inserts == masks_built + 1
    assert capture_state(fn) == capture_state(fn)


def test_invalidate_announces_state_no_version_counter_sees() -> None:
    layout = {"split": 128}

    def split(b, h, q, kv):  # type: ignore[no-untyped-def]
        s = layout["split"]
        return (q < s) == (kv < s)

    before = fz.block_mask(split, L, L)
    layout["split"] = 64
    assert fz.block_mask(split, L, L) is before  # untrackable: documented
    fz.invalidate(split)
    after = fz.block_mask(split, L, L)
    assert after is not before and _same_blocks(after, _fresh_doc_blocks(torch.arange(L) >= 64))
    layout["split"] = 200
    fz.invalidate()  # every callable
    assert _same_blocks(fz.block_mask(split, L, L), _fresh_doc_blocks(torch.arange(L) >= 200))


def test_invalidate_covers_writes_through_data() -> None:
    ids = torch.tensor(TWO_DOCS)
    fn = lambda b, h, q, kv: ids[q] == ids[kv]  # noqa: E731
    before = fz.block_mask(fn, L, L)
    ids.data.zero_()  # .data does not bump the version counter
    fz.invalidate(fn)
    assert _same_blocks(fz.block_mask(fn, L, L), _fresh_doc_blocks(ids))
    assert not _same_blocks(fz.block_mask(fn, L, L), before)


def test_layer_with_a_callable_mask_sees_in_place_updates() -> None:
    q, k, v = _qkv()
    ids = torch.tensor(TWO_DOCS)
    layer = fz.Attention(mask=lambda b, h, qi, kv: ids[qi] == ids[kv], backend="flex_cpu")
    layer(q, k, v)
    ids[:] = torch.tensor([0] * 200 + [1] * 56)
    assert_matches_reference(layer(q, k, v), q, k, v, mask=masks.Document(doc_ids=ids))


def test_composite_holding_a_callable_is_brought_up_to_date() -> None:
    ids = torch.tensor(TWO_DOCS)
    held = FunctionMask(fn=lambda b, h, q, kv: ids[q] == ids[kv]) & masks.Full()
    before = fz.block_mask(held, L, L)
    ids.zero_()
    live = held.live()
    assert live is not held and live != held and live.live() is live
    assert _same_blocks(fz.block_mask(held, L, L), _fresh_doc_blocks(ids))
    assert not _same_blocks(before, fz.block_mask(held, L, L))


def test_registered_function_by_name_is_tracked() -> None:
    ids = torch.tensor(TWO_DOCS)
    masks.register_function("state_test_docs", lambda b, h, q, kv: ids[q] == ids[kv])
    try:
        q, k, v = _qkv()
        fz.attention(q, k, v, mask="state_test_docs", backend="flex_cpu")
        ids[:] = torch.tensor([0] * 10 + [1] * 246)
        out = fz.attention(q, k, v, mask="state_test_docs", backend="flex_cpu")
        assert_matches_reference(out, q, k, v, mask=masks.Document(doc_ids=ids))
    finally:
        MASKS.unregister("state_test_docs")


def test_score_callable_over_an_updated_tensor_matches_reference() -> None:
    q, k, v = _qkv(64)
    bias = torch.zeros(2)
    score = lambda s, b, h, qi, kv: s + bias[h]  # noqa: E731
    fz.attention(q, k, v, mask="causal", score_mod=score, backend="dense")
    bias[:] = torch.tensor([3.0, -3.0])
    out = fz.attention(q, k, v, mask="causal", score_mod=score, backend="dense")
    ref = reference_attention(q, k, v, mask="causal", score_mod=lambda s, b, h, qi, kv: s + bias[h])
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_score_callable_over_a_parameter_reports_grad_tensors() -> None:
    bias = torch.nn.Parameter(torch.zeros(2))
    score = FunctionScore(fn=lambda s, b, h, q, kv: s + bias[h])
    assert score.captures_grad_tensors()
    state = score.state
    with torch.no_grad():
        bias.add_(1.0)  # learned tensors: identity only, so an optimizer step keeps every cache
    assert score.live() is score and score.state == state


def test_a_mask_callable_over_a_learned_tensor_rebuilds_its_block_mask_after_a_write() -> None:
    # A mask's values decide its BlockMask whether or not they require grad: an optimizer-style
    # write to a learned tensor a mask_mod reads must not keep the old block sparsity.
    cut = torch.nn.Parameter(torch.tensor([float(L)]))
    fn = lambda b, h, q, kv: kv < cut[0]  # noqa: E731
    before = fz.block_mask(fn, L, L)
    with torch.no_grad():
        cut.fill_(64.0)
    after = fz.block_mask(fn, L, L)
    assert after is not before
    assert before.to_dense().all() and after.to_dense()[..., 1].sum() == 0  # key block 1 is gone
    q, k, v = _qkv()
    out = fz.attention(q, k, v, mask=fn)
    assert_matches_reference(out, q, k, v, mask=lambda b, h, qi, kv: kv < 64)
    # flex asserts inside its trace on such a mask_mod: the flex routes refuse it by name.
    with pytest.raises(ValueError, match="flex_cpu.*mask_mod that captures tensors requiring grad"):
        fz.attention(q, k, v, mask=fn, backend="flex_cpu")


def test_untracked_library_closures_keep_their_identity() -> None:
    offsets = torch.zeros(2, dtype=torch.int32)
    fm = FunctionMask(fn=lambda b, h, q, kv: q + offsets[b] >= kv, tracked=False)
    offsets.add_(3)
    assert fm.live() is fm and fm.state == ()


def test_function_specs_pickle_without_their_state() -> None:
    fm = FunctionMask(fn=_global_mask, label="global")
    back = pickle.loads(pickle.dumps(fm))
    assert back == fm and hash(back) == hash(fm)


def test_cpu_decode_with_a_callable_mask_stays_exact_across_steps() -> None:
    # decode's own closures over offsets it rewrites every step are untracked; a user callable
    # pattern (a window over absolute positions) is tracked: both stay exact.
    window = torch.tensor(40)
    pattern = lambda b, h, q, kv: (kv <= q) & (q - kv <= window)  # noqa: E731
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = (torch.randn(1, 2, 256, 16, generator=g) for _ in range(2))
    for length in (100, 101, 102):
        q = torch.randn(1, 2, 1, 16, generator=g)
        out = fz.decode.decode_step(q, k_cache, v_cache, length, mask=pattern, return_lse=True)[0]
        keys = torch.arange(length)
        visible = (keys <= length - 1) & (length - 1 - keys <= int(window))
        ref = reference_attention(
            q, k_cache[:, :, :length], v_cache[:, :, :length], mask=masks.KeyPadding(valid=visible[None])
        )
        assert torch.allclose(out.double(), ref, atol=1e-5)
        window.add_(-10)


# ---------------------------------------------------------------------------------------------
# 3. fz.Attention: supported ways to change the mask.


def test_attention_layer_takes_a_per_call_mask() -> None:
    q, k, v = _qkv(64)
    layer = fz.Attention(mask="causal")
    for lengths in ([40, 24], [10, 30, 24], [64]):
        packed = masks.Document.from_lengths(lengths) & masks.Causal()
        assert_matches_reference(layer(q, k, v, mask=packed), q, k, v, mask=packed)
    assert layer.mask == masks.Causal()  # the override did not stick
    assert_matches_reference(layer(q, k, v), q, k, v, mask=masks.Causal())


def test_attention_layer_per_call_score_mod_keeps_the_mask() -> None:
    q, k, v = _qkv(64)
    layer = fz.Attention(mask=masks.SlidingWindow(left=7))
    cap = score_mods.SoftCap(cap=5.0)
    out = layer(q, k, v, score_mod=cap)
    assert_matches_reference(out, q, k, v, mask=masks.SlidingWindow(left=7), score_mod=cap)
    assert layer.score_mod is None


def test_attention_layer_set_mask() -> None:
    q, k, v = _qkv(64)
    layer = fz.Attention(mask="causal", score_mod=score_mods.SoftCap(cap=5.0))
    window = masks.SlidingWindow(left=15)
    layer.set_mask(window)
    assert layer.mask == window and layer.score_mod == score_mods.SoftCap(cap=5.0)
    assert_matches_reference(layer(q, k, v), q, k, v, mask=window, score_mod=score_mods.SoftCap(cap=5.0))
    layer.set_mask(score_mod=None)
    assert layer.score_mod is None and layer.mask == window
    layer.set_mask(None)
    assert_matches_reference(layer(q, k, v), q, k, v)
    # Assigning to the properties is set_mask (it raised "property 'mask' ... has no setter").
    layer.mask = "causal"
    layer.score_mod = score_mods.SoftCap(cap=5.0)
    assert layer.mask == masks.Causal() and layer.score_mod == score_mods.SoftCap(cap=5.0)
    assert_matches_reference(layer(q, k, v), q, k, v, mask="causal", score_mod=score_mods.SoftCap(cap=5.0))
    keep = torch.ones(1, 1, 64, 64, dtype=torch.bool).tril()
    layer.mask = keep  # a tensor goes through the property too, not into the module's attributes
    assert isinstance(layer.mask, masks.Dense) and "mask" not in layer._buffers


def test_attention_layer_document_spec_is_a_snapshot_of_the_buffer() -> None:
    q, k, v = _qkv()
    buf = torch.tensor(TWO_DOCS)
    layer = fz.Attention(mask=masks.Document(doc_ids=buf), backend="flex_cpu")
    layer(q, k, v)
    buf.zero_()  # not a way to change the layer: documented (pass mask= instead)
    assert_matches_reference(layer(q, k, v), q, k, v, mask=masks.Document(doc_ids=torch.tensor(TWO_DOCS)))
    new = masks.Document(doc_ids=buf)
    assert_matches_reference(layer(q, k, v, mask=new), q, k, v, mask=new)


def test_spec_live_is_identity_for_plain_specs() -> None:
    for s in (
        masks.Causal(),
        masks.Document(doc_ids=torch.tensor(TWO_DOCS)) & masks.Causal(),
        score_mods.SoftCap(cap=3.0) >> score_mods.Alibi(num_heads=2),
    ):
        assert s.live() is s
    assert isinstance(masks.Causal(), Spec)


def _new_storage(param: torch.nn.Parameter, scale: float) -> None:
    param.data = torch.randn(param.shape) * scale  # an EMA swap, a re-initialization


@pytest.mark.parametrize("route", ["dense", "flex_cpu"])
def test_a_learned_bias_given_new_storage_is_read_anew(route: str) -> None:
    """``param.data = ...`` gives a learned tensor new storage: the score_mods built from views of
    the old storage (cached per spec, learned specs comparing by identity) must not be reused.
    Checked through fz.attention, an fz.Attention layer and a Graphormer edge bias."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    bias = torch.nn.Parameter(torch.randn(1, 2, 32, 32))
    edge = torch.nn.Parameter(torch.randn(1, 2, 32, 32))
    pos, table = torch.randint(0, 4, (1, 32, 32)), torch.randn(4, 2)
    layer = fz.Attention(score_mod=bias, backend=route)
    calls = {
        "fz.attention": (lambda: fz.attention(q, k, v, score_mod=bias, backend=route), bias),
        "fz.Attention": (lambda: layer(q, k, v), bias),
        "graphormer": (
            lambda: fz.attention(
                q, k, v, score_mod=score_mods.Graphormer(spatial_pos=pos, spatial_bias=table, edge_bias=edge),
                backend=route,
            ),
            edge,
        ),
    }  # fmt: skip
    with torch.no_grad():
        for name, (call, param) in calls.items():
            call()  # builds and caches the score_mod
            _new_storage(param, 5.0)
            got = call()
            frozen = param.detach().clone()
            if param is edge:
                want = reference_attention(
                    q,
                    k,
                    v,
                    score_mod=score_mods.Graphormer(spatial_pos=pos, spatial_bias=table, edge_bias=frozen),
                )
            else:
                want = reference_attention(q, k, v, score_mod=frozen)
            torch.testing.assert_close(got, want.float(), atol=1e-4, rtol=1e-4, msg=name)


def test_a_learned_spec_is_kept_while_its_storage_stays() -> None:
    """An optimizer's in-place step keeps the storage: ``live()`` returns the spec itself (its
    mods read the storage, so every cache entry stays valid)."""
    bias = torch.nn.Parameter(torch.randn(8, 8))
    spec_ = score_mods.Bias(bias=bias)
    assert spec_.live() is spec_
    with torch.no_grad():
        bias.add_(1.0)
    assert spec_.live() is spec_
    _new_storage(bias, 1.0)
    fresh = spec_.live()
    assert fresh is not spec_ and fresh != spec_ and fresh.bias is bias and fresh.live() is fresh


@pytest.mark.parametrize("kind", ["rel_pos_bias", "bias"])
def test_learned_tensors_frozen_after_the_spec_was_built_stay_compared_by_identity(kind: str) -> None:
    """``model.requires_grad_(False)`` after two layers built their specs over equal (zero-init)
    parameters, then a checkpoint loaded in place: the layers' specs must stay unequal (each is its
    own parameter), or the second layer runs the first layer's cached score_mod / plan."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))
    shape = (32, 2) if kind == "rel_pos_bias" else (1, 2, 24, 24)
    first, second = torch.nn.Parameter(torch.zeros(shape)), torch.nn.Parameter(torch.zeros(shape))

    def make(param: torch.Tensor) -> Any:
        return score_mods.RelPosBias(table=param) if kind == "rel_pos_bias" else score_mods.Bias(bias=param)

    specs = [make(first), make(second)]
    for param in (first, second):
        param.requires_grad_(False)  # frozen before the specs' first use (their hash)
    assert specs[0] != specs[1] and specs[0] == make(first) and specs[0].live() is specs[0]
    for s in specs:
        fz.attention(q, k, v, score_mod=s)  # caches each layer's mod and plan
    with torch.no_grad():
        second.copy_(torch.randn(shape) * 3)  # load_state_dict: an in-place write
    for param, s in zip((first, second), specs, strict=True):
        want = reference_attention(q, k, v, score_mod=make(param.detach().clone()))
        torch.testing.assert_close(fz.attention(q, k, v, score_mod=s), want.float(), atol=1e-4, rtol=1e-4)


def test_frozen_learned_tensors_stay_compared_by_identity_in_copies_of_their_specs() -> None:
    """``copy.deepcopy(model)`` (an EMA copy) or a pickle round trip of specs over frozen
    parameters: the copies' parameters are still the caller's (the EMA update writes them in
    place), so two equal-valued ones must not make equal specs; shallow copies keep them too."""
    import copy

    first, second = torch.nn.Parameter(torch.zeros(32, 2)), torch.nn.Parameter(torch.zeros(32, 2))
    specs = [score_mods.RelPosBias(table=first), score_mods.RelPosBias(table=second)]
    for param in (first, second):
        param.requires_grad_(False)
    for made in (copy.deepcopy(specs), pickle.loads(pickle.dumps(specs)), [copy.copy(s) for s in specs]):
        assert made[0] != made[1] and hash(made[0]) != hash(made[1])
        assert made[0] == made[0] and not made[0].table.requires_grad
    assert specs[0] != specs[1]
    # A spec's own (copied) tensors still compare by value in its copies.
    docs = [masks.Document(doc_ids=torch.tensor(TWO_DOCS)) for _ in range(2)]
    assert copy.deepcopy(docs[0]) == docs[1] == pickle.loads(pickle.dumps(docs[0]))


def _inference_tensors(*values: Any) -> list[str]:
    """What among ``values`` (BlockMasks, mods, specs) is or captures an inference tensor."""
    from flexattn_zoo.functions import _reachable

    found = []
    for value in values:
        if isinstance(value, fz.MaskSpec | fz.ScoreSpec):
            tensors = value.tensors() + [t for t in value.__dict__.values() if isinstance(t, torch.Tensor)]
        elif hasattr(value, "kv_num_blocks"):
            tensors = [getattr(value, n) for n in blockmask.BLOCK_MASK_PARTS[1:-1]]
            tensors += [t for t in _reachable(value.mask_mod) if isinstance(t, torch.Tensor)]
        else:
            tensors = [t for t in _reachable(value) if isinstance(t, torch.Tensor)]
        found += [repr(value)[:60] for t in tensors if isinstance(t, torch.Tensor) and t.is_inference()]
    return found


def test_what_an_inference_mode_call_caches_holds_no_inference_tensors() -> None:
    """Caches are keyed by value, so what an evaluation under ``torch.inference_mode()`` builds
    (specs' tensors, mods and what they capture, BlockMasks, varlen offsets) serves the training
    steps after it; flex_attention's backward saves those tensors, and an inference tensor cannot
    be saved for backward (a RuntimeError on CUDA, the first training step after validation)."""
    q, k, v = _qkv(L)
    ids = torch.tensor(TWO_DOCS)

    def specs() -> list[Any]:
        return [
            masks.Document(doc_ids=ids) & masks.Causal(),
            masks.Causal(align="bottom_right"),
            score_mods.RelPosBias(table=torch.ones(32, 2)),
            score_mods.Sandwich(num_heads=2, max_len=L),
        ]

    with torch.inference_mode():
        for s in specs():
            kw = {"mask": s} if isinstance(s, fz.MaskSpec) else {"score_mod": s}
            fz.attention(q, k[:, :, :-8], v[:, :, :-8], backend="dense", **kw)  # Lq != Lkv: an offset
            if isinstance(s, fz.MaskSpec):
                fz.block_mask(s, L, L - 8)
        varlen.cu_seqlens(masks.Document(doc_ids=ids), 1, L, L, "cpu")
    cached: list[Any] = []
    for s in specs():  # equal specs built anew for a training step: the caches hand them the above
        if isinstance(s, fz.MaskSpec):
            cached += [fz.block_mask(s, L, L - 8), s.bind(L, L - 8).mask_mod()]
        else:
            cached.append(s.score_mod())
    cached.append(varlen.cu_seqlens(masks.Document(doc_ids=ids), 1, L, L, "cpu"))
    with torch.inference_mode():
        cached.append(masks.Document(doc_ids=ids))  # a spec built under inference_mode
    assert _inference_tensors(*cached) == []


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_learned_bias_first_used_in_evaluation_still_gets_its_gradient(mode: str) -> None:
    """The score_mod of a spec is made once and cached; made during an evaluation (no grad), a
    view it took of a learned bias had no autograd history, and the training steps after it got
    no gradient for the bias at all (``bias.grad`` stayed None on the dense route)."""
    q, k, v = _qkv(24)
    evaluation = torch.no_grad if mode == "no_grad" else torch.inference_mode
    for shape in ((24, 24), (1, 2, 24, 24)):  # a 2-D bias is read through a 4-D view
        bias = torch.nn.Parameter(torch.randn(shape))
        with evaluation():
            fz.attention(q, k, v, score_mod=bias, backend="dense")
        fz.attention(q, k, v, score_mod=bias, backend="dense").square().sum().backward()
        want = torch.nn.Parameter(bias.detach().double().clone())
        reference_attention(q.double(), k.double(), v.double(), score_mod=want).square().sum().backward()
        assert bias.grad is not None and want.grad is not None
        torch.testing.assert_close(bias.grad.double(), want.grad, atol=1e-5, rtol=1e-5)


def test_a_callable_reaching_a_spec_that_wraps_a_callable_is_tracked_through_it() -> None:
    """capture_state skips the tensors a spec owns, but walks the raw callables a spec wraps: a
    user mask_mod (here a bound method) reading a composite over another callable sees an in-place
    write to that callable's tensor, and the cached BlockMask is not reused."""
    from flexattn_zoo.coercion import as_mask_spec

    ids = torch.tensor([0] * 128 + [1] * 128)

    class Packer:
        def __init__(self) -> None:
            self.spec = masks.Causal() & as_mask_spec(lambda b, h, q, kv: ids[q] == ids[kv])

        def mask(self, b: Any, h: Any, q: Any, kv: Any) -> Any:
            return self.spec.mask_mod()(b, h, q, kv)

    packer = Packer()
    before = capture_state(packer.mask)
    first = fz.block_mask(packer.mask, 256, 256, batch=1, heads=2)
    ids[:] = 0  # one document now
    assert capture_state(packer.mask) != before
    assert fz.block_mask(packer.mask, 256, 256, batch=1, heads=2) is not first
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 16) for _ in range(3))
    with torch.no_grad():
        out = fz.attention(q, k, v, mask=packer.mask, backend="flex_cpu")
    assert_matches_reference(out, q, k, v, mask=masks.Causal())


def test_a_layers_callable_is_probed_again_when_its_state_changes() -> None:
    """``live()`` of a spec over a callable whose state changed (``fz.invalidate``) probes it again:
    a layer built while it evaluated elementwise keeps up when it starts reducing over a captured
    tensor (then evaluated as flex does, per index), as a callable passed anew would."""
    mode = {"parity": False}
    marks_ = torch.tensor([0])

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        if mode["parity"]:
            return (q_idx >= kv_idx) & ((marks_ <= q_idx).sum() % 2 == 0)
        return q_idx >= kv_idx

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    layer = fz.Attention(mask=mask_mod, backend="dense")
    layer(q, k, v)
    mode["parity"] = True
    fz.invalidate(mask_mod)
    want = reference_attention(q, k, v, mask=mask_mod)
    torch.testing.assert_close(layer(q, k, v), want.float(), atol=1e-5, rtol=1e-5)


def test_a_decode_step_after_an_inference_mode_step_of_the_same_shapes_runs() -> None:
    """decode_step caches its decode mask per shape and updates its tensors in place each step;
    built by a step under ``torch.inference_mode()`` they were inference tensors, and the next
    step of the same shapes outside it failed ("Inplace update to inference tensor outside
    InferenceMode")."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 1, 16, generator=g)
    k, v = (torch.randn(2, 2, 96, 16, generator=g) for _ in range(2))
    lens = torch.tensor([40, 77])
    with torch.inference_mode():
        fz.decode.decode_step(q, k, v, lens, backend="flex_cpu")
    with torch.no_grad():
        out = fz.decode.decode_step(q, k, v, lens, backend="flex_cpu")
    for row, n in enumerate(lens.tolist()):
        assert_matches_reference(
            out[row : row + 1], q[row : row + 1], k[row : row + 1, :, :n], v[row : row + 1, :, :n]
        )
