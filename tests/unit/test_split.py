"""``sdpa_split`` on the CPU (torch's flash kernel per part): forward, backward and the merge vs
float64, and what it refuses. The CUDA kernel (cuDNN) is checked in tests/gpu/test_routes_gpu.py."""

from __future__ import annotations

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo.backends.split import _compiled_merge, _merge
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
