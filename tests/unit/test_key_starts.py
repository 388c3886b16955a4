"""Packed documents spelled with per-query key starts (``MaskSpec.past_key_starts``,
``MaskSpec.starts_mask_mod``: ``Document & Causal``, ``PerDocument`` with a causal inner mask,
``SharedPrefix``):
exact against the dense oracle, offered only where exact, checked by
``fz.testing.assert_mask_consistent``, and run by a flex route that asks for it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import blockmask, masks
from flexattn_zoo.backends.flex import FLEX, FLEX_CPU, FLEX_FLASH
from flexattn_zoo.compile import mod_key
from flexattn_zoo.spec import MaskSpec
from flexattn_zoo.testing import assert_mask_consistent, assert_matches_reference


def _docs() -> masks.Document:
    return masks.Document.from_lengths([5, 7, 3, 6])  # 21 positions, boundaries off any grid


@pytest.mark.parametrize(("q_len", "kv_len"), [(21, 21), (13, 21), (21, 13), (1, 21)])
def test_documents_and_causal_spelled_with_starts_match_the_oracle(q_len: int, kv_len: int) -> None:
    spec = _docs() & masks.Causal()
    assert spec.bind(q_len, kv_len).starts_mask_mod(q_len, kv_len) is not None
    assert_mask_consistent(spec, q_len, kv_len)  # checks past_key_starts and starts_mask_mod too


def test_the_starts_are_each_documents_first_position() -> None:
    starts = _docs().past_key_starts(21, 21)
    assert starts is not None and starts.dtype == torch.int32
    assert starts.tolist() == [0] * 5 + [5] * 7 + [12] * 3 + [15] * 6


def test_batched_documents_and_more_parts_keep_their_spelling_exact() -> None:
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [4, 1, 1, 1, 1, 1, 3, 3]])  # labels need not be sorted
    docs = masks.Document(doc_ids=ids)
    for spec in (docs & masks.Causal(), masks.SlidingWindow(left=2) & docs & masks.Causal()):
        assert spec.starts_mask_mod(8, 8) is not None
        assert_mask_consistent(spec, 8, 8, batch=2)


@pytest.mark.parametrize("inner", [masks.Causal(), masks.SlidingWindow(left=2)], ids=["causal", "window"])
def test_per_document_masks_that_hide_future_keys_are_spelled_with_starts(inner: MaskSpec) -> None:
    spec = masks.PerDocument.from_lengths(inner, [5, 9, 3, 7])
    assert spec.starts_mask_mod(24, 24) is not None
    assert_mask_consistent(spec, 24, 24)
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [3, 3, 3, 1, 1, 1]])
    batched = masks.PerDocument(inner=inner, documents=masks.Document(doc_ids=ids))
    assert batched.starts_mask_mod(6, 6) is not None
    assert_mask_consistent(batched, 6, 6, batch=2)


@pytest.mark.parametrize(("q_len", "kv_len"), [(12, 12), (7, 12), (12, 5), (2, 12)])
def test_shared_prefix_is_spelled_with_the_prompt_and_starts(q_len: int, kv_len: int) -> None:
    spec = masks.SharedPrefix.from_lengths(3, [2, 0, 3, 4])  # prompt | a a | b b b | c c c c
    assert spec.starts_mask_mod(q_len, kv_len) is not None
    assert_mask_consistent(spec, q_len, kv_len)


def test_no_spelling_where_it_would_not_be_exact() -> None:
    split = masks.Document(doc_ids=torch.tensor([0, 0, 1, 1, 0, 0]))  # document 0 in two runs
    assert split.past_key_starts(6, 6) is None
    assert (split & masks.Causal()).starts_mask_mod(6, 6) is None
    # No part hides future keys: the starts alone would hide nothing after the query.
    assert (_docs() & masks.SlidingWindow(left=3, right=3)).starts_mask_mod(21, 21) is None
    # Bottom-right causal with more queries than keys' offset shows future keys: not hidden.
    assert (_docs() & masks.Causal(align="bottom_right")).bind(13, 21).starts_mask_mod(13, 21) is None
    assert_mask_consistent(split & masks.Causal(), 6, 6)
    pieces = masks.SharedPrefix(
        prefix_len=2, doc_ids=torch.tensor([0, 0, 1, 1, 0])
    )  # a continuation in two pieces
    assert pieces.starts_mask_mod(7, 7) is None
    assert_mask_consistent(pieces, 7, 7)
    # A per-document prefix-LM shows later keys of the prefix.
    assert (
        masks.PerDocument.from_lengths(masks.PrefixLM(prefix_len=3), [5, 9]).starts_mask_mod(14, 14) is None
    )


def test_the_consistency_check_fails_on_wrong_starts() -> None:
    class OffByOne(masks.Document):
        def past_key_starts(self, q_len: int, kv_len: int) -> torch.Tensor | None:
            starts = super().past_key_starts(q_len, kv_len)
            return None if starts is None else starts + 1

    with pytest.raises(AssertionError, match="past_key_starts"):
        assert_mask_consistent(OffByOne(doc_ids=torch.tensor([0, 0, 0, 1, 1])), 5, 5)


def test_only_the_triton_route_asks_for_the_starts_spelling() -> None:
    assert FLEX.spells_key_starts and not FLEX_FLASH.spells_key_starts and not FLEX_CPU.spells_key_starts


def test_a_flex_route_that_asks_runs_the_starts_spelling_exactly() -> None:
    # Its own name: prepared calls are cached per route name.
    route = dataclasses.replace(FLEX_CPU, name="flex_cpu_with_starts", spells_key_starts=True)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 21, 16, generator=g) for _ in range(3))
    mask = _docs() & masks.Causal()
    problem = fz.plan(q, k, v, mask=mask, backend="flex_cpu").problem
    call = route.prepared(problem, q.device, None)
    assert call.block_mask.mask_mod.__name__ == "starts_mask"
    assert FLEX_CPU.prepared(problem, q.device, None).block_mask.mask_mod.__name__ != "starts_mask"
    out, _ = route.execute(q, k, v, problem, scale=16**-0.5)
    assert_matches_reference(out, q, k, v, mask=mask)


def test_one_compiled_kernel_serves_every_prompt_length_and_problem_length() -> None:
    """The spelled mods capture tensors of one shape per spec (the starts cover every position of
    the ids, the prompt length is a 0-d tensor), so their compiled-entry keys agree as the
    label-spelled mods' do."""
    short, longer = (
        masks.SharedPrefix.from_lengths(10, [20, 34]),
        masks.SharedPrefix.from_lengths(12, [18, 34]),
    )
    assert mod_key(short.mask_mod()) == mod_key(longer.mask_mod())
    assert mod_key(short.starts_mask_mod(64, 64)) == mod_key(longer.starts_mask_mod(64, 64))
    docs = masks.Document(doc_ids=torch.arange(128) // 10) & masks.Causal()  # ids longer than the problems
    assert mod_key(docs.starts_mask_mod(64, 64)) == mod_key(docs.starts_mask_mod(96, 96))
    for q_len, kv_len in ((64, 64), (96, 50), (50, 96)):
        assert_mask_consistent(docs, q_len, kv_len)


def test_prompts_longer_than_the_problem_and_per_document_rectangles() -> None:
    prompt_only = masks.SharedPrefix(prefix_len=20, doc_ids=torch.tensor([0, 1]))
    assert prompt_only.starts_mask_mod(10, 10) is not None
    assert_mask_consistent(prompt_only, 10, 10)
    per_doc = masks.PerDocument.from_lengths(masks.Causal(), [5, 9, 3, 7])
    for q_len, kv_len in ((13, 24), (24, 13)):
        assert per_doc.bind(q_len, kv_len).starts_mask_mod(q_len, kv_len) is not None
        assert_mask_consistent(per_doc, q_len, kv_len)


def test_the_starts_block_mask_is_cached_and_shares_the_plain_blocks() -> None:
    spelled_spec = _docs() & masks.Causal()
    first = blockmask.block_mask(spelled_spec, 21, 21, key_starts=True)
    assert blockmask.block_mask(spelled_spec, 21, 21, key_starts=True) is first
    plain = blockmask.block_mask(spelled_spec, 21, 21)
    assert first.mask_mod.__name__ == "starts_mask" and plain.mask_mod.__name__ != "starts_mask"
    assert torch.equal(first.kv_indices, plain.kv_indices)
    window = masks.SlidingWindow(left=4) & masks.Causal()  # no spelling: the plain BlockMask itself
    assert blockmask.block_mask(window, 21, 21, key_starts=True) is blockmask.block_mask(window, 21, 21)


def test_block_mask_refuses_a_key_starts_that_is_not_a_bool() -> None:
    with pytest.raises(TypeError, match="key_starts must be a bool"):
        blockmask.block_mask(_docs() & masks.Causal(), 21, 21, key_starts=1)  # type: ignore[arg-type]
