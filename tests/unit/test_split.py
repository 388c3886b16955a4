"""``sdpa_split`` on the CPU (torch's flash kernel per part): forward, backward and the merge vs
float64, and what it refuses. The CUDA kernel (cuDNN) is checked in tests/gpu/test_routes_gpu.py."""

from __future__ import annotations

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo.backends.merge import compiled_merge_two as _compiled_merge
from flexattn_zoo.backends.merge import merge_two as _merge
from flexattn_zoo.testing import assert_matches_reference


def _inputs(b: int, h: int, hkv: int, length: int, d: int, dtype: torch.dtype, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, length, d, generator=g, dtype=dtype).requires_grad_(True)
    k, v = (torch.randn(b, hkv, length, d, generator=g, dtype=dtype).requires_grad_(True) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(("length", "prefix", "hkv"), [(97, 30, 4), (64, 2, 4), (64, 63, 2), (130, 65, 1)])
def test_prefix_matches_reference(dtype: torch.dtype, length: int, prefix: int, hkv: int) -> None:
    q, k, v = _inputs(2, 4, hkv, length, 16, dtype)
    mask = masks.PrefixLM(prefix_len=prefix)
    out = fz.attention(q, k, v, mask=mask, enable_gqa=hkv != 4, backend="sdpa_split", scale=0.3)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(
        out, q, k, v, mask=mask, enable_gqa=hkv != 4, scale=0.3, grads=grads, grad_out=grad_out
    )
    with torch.no_grad():
        again = fz.attention(q, k, v, mask=mask, enable_gqa=hkv != 4, backend="sdpa_split", scale=0.3)
    assert torch.equal(again, out.detach())


def test_projection_layout() -> None:
    """[B, L, H, D] projections viewed as [B, H, L, D] (strided q/k/v slices of the parts)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 50, 3, 8, generator=g).transpose(1, 2).requires_grad_(True) for _ in range(3))
    mask = masks.PrefixLM(prefix_len=17)
    out = fz.attention(q, k, v, mask=mask, backend="sdpa_split")
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(out, q, k, v, mask=mask, grads=grads, grad_out=grad_out)


def test_second_order_gradients_are_refused() -> None:
    q, k, v = _inputs(1, 2, 2, 32, 8, torch.float64)
    out = fz.attention(q, k, v, mask=masks.PrefixLM(prefix_len=9), backend="sdpa_split")
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="does not require grad"):  # not a silently wrong one
        torch.autograd.grad(dq.sum(), q)


def test_merge_of_rows_that_see_nothing() -> None:
    """A row with no key in either part keeps lse -inf and output 0 (no NaN from -inf - -inf)."""
    out_a, out_b = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    lse_a = torch.tensor([[[0.5, float("-inf"), float("-inf")]]])
    lse_b = torch.tensor([[[float("-inf"), 1.5, float("-inf")]]])
    out, lse = _merge(out_a, lse_a, out_b, lse_b)
    assert torch.equal(out[0, 0, 0], out_a[0, 0, 0]) and torch.equal(out[0, 0, 1], out_b[0, 0, 1])
    assert torch.equal(out[0, 0, 2], torch.zeros(4)) and lse.tolist() == [[[0.5, 1.5, float("-inf")]]]


def test_the_compiled_merge_equals_the_eager_one() -> None:
    """The merge CUDA calls run compiled (one graph, no graph break allowed); compiled on the
    CPU it gives what the eager merge gives, rows that see nothing included."""
    g = torch.Generator().manual_seed(0)
    out_a, out_b = (torch.randn(2, 3, 5, 4, generator=g) for _ in range(2))
    lse_a, lse_b = (torch.randn(2, 3, 5, generator=g) for _ in range(2))
    lse_a[0, 0, 0] = lse_b[0, 0, 0] = float("-inf")
    got, want = _compiled_merge()(out_a, lse_a, out_b, lse_b), _merge(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mask": masks.Causal()}, "no split form"),
        ({"mask": masks.PrefixLM(prefix_len=torch.tensor([5, 9]))}, "no split form"),
        ({"mask": masks.PrefixLM(prefix_len=9), "return_lse": True}, "cannot return lse"),
        ({"mask": masks.PrefixLM(prefix_len=9), "deterministic": True}, "not deterministic"),
    ],
)
def test_refusals_name_the_reason(kwargs: dict, match: str) -> None:  # type: ignore[type-arg]
    q, k, v = _inputs(2, 2, 2, 32, 8, torch.float32)
    with pytest.raises(ValueError, match=match):
        fz.attention(q, k, v, backend="sdpa_split", **kwargs)


def test_split_parts_refuse_what_the_kernels_cannot_run() -> None:
    """A non-square causal part is ambiguous for the kernels (top-left vs bottom-right) and an
    empty range has no kernel call: SplitPart refuses both, so no route or mask can offer one;
    the form checker flags a part beyond the lengths."""
    from flexattn_zoo.spec import SplitForm, SplitPart
    from flexattn_zoo.testing.checks import split_dense

    with pytest.raises(ValueError, match="not square"):
        SplitPart((8, 32), (8, 24), True)
    with pytest.raises(ValueError, match="non-empty"):
        SplitPart((8, 8), (0, 4), False)
    assert SplitPart((8, 32), (8, 24), False).kv == (8, 24)  # unmasked rectangles may be any shape
    form = SplitForm((SplitPart((0, 32), (0, 8), False), SplitPart((8, 32), (8, 32), True)))
    with pytest.raises(AssertionError, match="outside"):
        split_dense(form, 32, 24)


def test_user_block_mask_refused() -> None:
    q, k, v = _inputs(1, 2, 2, 32, 8, torch.float32)
    bm = fz.block_mask(masks.PrefixLM(prefix_len=9), 32, 32, device="cpu")
    with pytest.raises(ValueError, match="takes no BlockMask"):
        fz.attention(q, k, v, mask=bm, backend="sdpa_split")


def test_masked_parts_are_checked_when_built() -> None:
    from flexattn_zoo.spec import SPLIT_MASK_PAIRS, SplitPart

    ok = SplitPart((4, 8), (0, 3), False, mask=torch.ones(4, 3, dtype=torch.bool))
    assert ok.mask is not None and ok == SplitPart((4, 8), (0, 3), False)  # compared by ranges
    with pytest.raises(ValueError, match=r"shape \[4, 3\]"):
        SplitPart((4, 8), (0, 3), False, mask=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool tensor"):
        SplitPart((4, 8), (0, 3), False, mask=torch.ones(4, 3))
    with pytest.raises(ValueError, match="not both"):
        SplitPart((0, 3), (0, 3), True, mask=torch.ones(3, 3, dtype=torch.bool))
    side = int(SPLIT_MASK_PAIRS**0.5) + 1
    with pytest.raises(ValueError, match="SPLIT_MASK_PAIRS"):
        SplitPart((0, side), (0, side), False, mask=torch.ones(side, side, dtype=torch.bool))


class _Scattered(masks.Full):
    """A mask whose split form leaves rows to later parts, has a masked part in the middle of the
    keys, and leaves the last two rows to no part (they see nothing): rows 0-5 see keys 0-4
    causally; rows 6-13 see keys 0-4 and, among keys 5-9, those with (i + j) even."""

    def _make_mask_mod(self):  # type: ignore[no-untyped-def]
        def scattered(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            top = (q_idx < 5) & (kv_idx <= q_idx)
            tree = (
                (q_idx >= 6) & (q_idx < 14) & ((kv_idx < 5) | ((kv_idx < 10) & ((q_idx + kv_idx) % 2 == 0)))
            )
            return top | tree

        return scattered

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        i, j = torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :]
        top = (i < 5) & (j <= i)
        tree = (i >= 6) & (i < 14) & ((j < 5) | ((j < 10) & ((i + j) % 2 == 0)))
        return (top | tree)[None, None]

    def sdpa_form(self, q_len: int, kv_len: int):  # type: ignore[no-untyped-def]
        return None

    def split_form(self, q_len: int, kv_len: int):  # type: ignore[no-untyped-def]
        from flexattn_zoo.spec import SplitForm, SplitPart

        i, j = torch.arange(6, 14)[:, None], torch.arange(5, 10)[None, :]
        return SplitForm(
            (
                SplitPart((0, 5), (0, 5), True),
                SplitPart((6, 14), (5, 10), False, mask=(i + j) % 2 == 0),
                SplitPart((6, 14), (0, 5), False),
            )
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_parts_in_any_rows_with_masks_match_reference(dtype: torch.dtype) -> None:
    """No part covers every row, the first part to reach rows 6-13 is a masked one, row 5 and
    rows 14-15 see no key (output 0): forward and backward against float64, GQA 4:2."""
    from flexattn_zoo.testing import assert_mask_consistent

    mask = _Scattered()
    assert_mask_consistent(mask, 16, 16)
    q, k, v = _inputs(2, 4, 2, 16, 8, dtype)
    out = fz.attention(q, k, v, mask=mask, enable_gqa=True, backend="sdpa_split")
    assert torch.all(out[:, :, 14:] == 0) and torch.all(out[:, :, 5] == 0)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(out, q, k, v, mask=mask, enable_gqa=True, grads=grads, grad_out=grad_out)
