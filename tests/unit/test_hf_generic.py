"""flexattn_zoo.hf's generic path (transformers releases the structural reader was not tested
with): transformers' mask function at a cache step's offsets, as ``ShiftedFunctionMask``. No
transformers needed: a stand-in mask function over absolute positions."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo.compile import mod_key
from flexattn_zoo.hf.mask_reader import ShiftedFunctionMask
from flexattn_zoo.masks.causal import OffsetCausal
from flexattn_zoo.testing import assert_mask_consistent, assert_matches_reference


def causal_mask_function(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return kv_idx <= q_idx


@pytest.mark.parametrize(("q_offset", "kv_offset"), [(7, 0), (12, 4), (0, 3)])
def test_shifted_function_is_the_function_at_absolute_positions(q_offset: int, kv_offset: int) -> None:
    spec = ShiftedFunctionMask(fn=causal_mask_function, q_offset=q_offset, kv_offset=kv_offset)
    want = OffsetCausal(offset=q_offset - kv_offset).dense(5, 16)
    assert torch.equal(spec.dense(5, 16), want)
    assert_mask_consistent(spec, 5, 16)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 16) for n in (5, 16, 16))
    with torch.no_grad():
        assert_matches_reference(fz.attention(q, k, v, mask=spec, backend="flex_cpu"), q, k, v, mask=spec)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fz.attention(q, k, v, mask=spec)  # a route with a backward
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(out, q, k, v, mask=spec, grads=grads, grad_out=grad_out)


def test_offsets_are_kernel_inputs_not_constants() -> None:
    """Steps of a generation loop (a new offset per token) share one compile-cache key; the
    offsets still take part in the spec's equality."""
    a = ShiftedFunctionMask(fn=causal_mask_function, q_offset=9, kv_offset=0)
    b = ShiftedFunctionMask(fn=causal_mask_function, q_offset=10, kv_offset=0)
    assert a != b and a == ShiftedFunctionMask(fn=causal_mask_function, q_offset=9, kv_offset=0)
    assert mod_key(a.mask_mod()) == mod_key(b.mask_mod())
