"""The docs/testing.md example ("Testing it"): a user property-tests their own mask.

Keep this file and the snippet identical in substance: the snippet is what users copy (it also runs
as written in tests/unit/test_docs_examples.py).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flexattn_zoo as fz
from flexattn_zoo import MaskSpec
from flexattn_zoo.spec import MaskMod, spec_dataclass
from flexattn_zoo.testing import assert_mask_consistent, assert_matches_reference, strategies


@spec_dataclass
class DilatedCausal(MaskSpec):
    """Causal attention to every ``stride``-th key back from the query (the query itself included).

    Picture (``stride=2``, ``Lq = Lkv = 6``; rows are queries, ``#`` visible)::

        #.....
        .#....
        #.#...
        .#.#..
        #.#.#.
        .#.#.#
    """

    stride: int = 2

    def _make_mask_mod(self) -> MaskMod:
        stride = self.stride

        def dilated_causal(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return (kv_idx <= q_idx) & ((q_idx - kv_idx) % stride == 0)

        return dilated_causal

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        # Written independently of the mask_mod: mark the visible keys of each row by slicing.
        out = torch.zeros(1, 1, q_len, kv_len, dtype=torch.bool)
        for i in range(q_len):
            out[0, 0, i, i % self.stride : i + 1 : self.stride] = True
        return out


@given(shape=strategies.shapes(max_len=300), stride=st.integers(min_value=1, max_value=5))
def test_mask_mod_matches_oracle(shape: strategies.ProblemShape, stride: int) -> None:
    # mask_mod on index grids (and through create_block_mask's vmap) == dense, at every block size.
    assert_mask_consistent(
        DilatedCausal(stride=stride), shape.q_len, shape.kv_len, batch=shape.batch, heads=shape.heads
    )


@settings(max_examples=10)
@given(shape=strategies.shapes(max_len=200), stride=st.integers(min_value=1, max_value=4), data=st.data())
def test_attention_matches_reference(
    shape: strategies.ProblemShape, stride: int, data: st.DataObject
) -> None:
    mask = DilatedCausal(stride=stride)
    q, k, v = data.draw(strategies.qkv(shape, torch.float32, requires_grad=True))
    out = fz.attention(q, k, v, mask=mask, enable_gqa=True)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    # Rows with no visible key (e.g. q_idx % stride >= Lkv) must come out as 0, never NaN.
    assert_matches_reference(out, q, k, v, mask=mask, enable_gqa=True, grads=grads, grad_out=grad_out)
