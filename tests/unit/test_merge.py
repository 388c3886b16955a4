"""``fz.merge_attention``: exact against attention over the concatenated keys, gradients (gradcheck
in float64 and against the concatenated attention), rows that see no key, argument errors."""

from __future__ import annotations

import math

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo.testing import reference_attention

INF = math.inf


def _qkv(lq: int, lkv: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, lq, 8, generator=g, dtype=dtype)
    k = torch.randn(2, 3, lkv, 8, generator=g, dtype=dtype)
    v = torch.randn(2, 3, lkv, 5, generator=g, dtype=dtype)
    return tuple(t.requires_grad_() for t in (q, k, v))


def _parts(q, k, v, cuts, mask=None):  # type: ignore[no-untyped-def]
    """Attention of q over each key range [cuts[p], cuts[p + 1]) (float64 reference)."""
    outs, lses = [], []
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        part_mask = None
        if mask is not None:
            # The mask restricted to keys [lo, hi): key j of the part is key lo + j of the whole.
            whole = mask.dense(q.shape[2], k.shape[2])[..., lo:hi]
            part_mask = lambda b, h, i, j, m=whole: m[0, 0, i, j]  # noqa: E731
        out, lse = reference_attention(
            q, k[:, :, lo:hi], v[:, :, lo:hi], mask=part_mask, return_lse=True, scale=0.4
        )
        outs.append(out)
        lses.append(lse)
    return outs, lses


@pytest.mark.parametrize("mask", [None, masks.Causal(), masks.SlidingWindow(left=3)])
@pytest.mark.parametrize("cuts", [[0, 7, 19], [0, 1, 5, 6, 19]])
def test_equals_attention_over_the_concatenated_keys(mask, cuts) -> None:  # type: ignore[no-untyped-def]
    q, k, v = _qkv(13, 19)
    outs, lses = _parts(q, k, v, cuts, mask)
    out, lse = fz.merge_attention(outs, lses)
    want, want_lse = reference_attention(q, k, v, mask=mask, return_lse=True, scale=0.4)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    # Gradients with respect to q, k, v flow through the merge as through the whole attention.
    g_out = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((out * g_out).sum() + lse.sum(), (q, k, v))
    ref = torch.autograd.grad((want * g_out).sum() + want_lse.sum(), (q, k, v))
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_rows_that_see_no_key_give_zero_and_finite_gradients() -> None:
    """Row 0 sees keys in both parts, row 1 only in the second, row 2 in none (its parts' outputs
    hold NaN, as SDPA's math kernel writes there): out 0, lse -inf, no NaN anywhere."""
    out_a = torch.tensor([[1.0, 2.0], [float("nan"), 0.0], [float("nan"), float("nan")]], dtype=torch.float64)
    out_b = torch.tensor([[3.0, 4.0], [5.0, 6.0], [float("nan"), 1.0]], dtype=torch.float64)
    lse_a = torch.tensor([0.0, -INF, -INF], dtype=torch.float64)
    lse_b = torch.tensor([0.0, 2.0, -INF], dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (out_a, out_b, lse_a, lse_b)]
    out, lse = fz.merge_attention(leaves[:2], leaves[2:])
    assert torch.equal(out, torch.tensor([[2.0, 3.0], [5.0, 6.0], [0.0, 0.0]], dtype=torch.float64))
    assert lse[0] == math.log(2.0) and lse[1] == 2.0 and lse[2] == -INF
    grads = torch.autograd.grad(out.sum() + torch.where(lse.isfinite(), lse, 0.0).sum(), leaves)
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    assert grads[0][2].abs().sum() == 0 and grads[2][2] == 0 and grads[3][2] == 0


def test_gradcheck_float64() -> None:
    g = torch.Generator().manual_seed(0)
    outs = [torch.randn(2, 4, 3, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3)]
    lses = [torch.randn(2, 4, dtype=torch.float64, generator=g) * 3 for _ in range(3)]
    lses[1][0, 1] = -INF  # a part that does not see a row
    lses[0][1, 2] = lses[1][1, 2] = lses[2][1, 2] = -INF  # a row no part sees
    lses = [t.requires_grad_() for t in lses]

    def merged(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = fz.merge_attention(list(args[:3]), list(args[3:]))
        return out, torch.where(lse.isfinite(), lse, 0.0)  # gradcheck perturbs; -inf stays -inf

    assert torch.autograd.gradcheck(merged, (*outs, *lses))
    assert torch.autograd.gradgradcheck(merged, (*outs, *lses))


def test_large_lse_gaps_do_not_overflow() -> None:
    out, lse = fz.merge_attention(
        [torch.ones(1, 2), torch.full((1, 2), 3.0)], [torch.tensor([1000.0]), torch.tensor([-1000.0])]
    )
    assert torch.equal(out, torch.ones(1, 2)) and lse.item() == 1000.0
    assert out.dtype == torch.float32 and lse.dtype == torch.float32


def test_low_precision_outputs_keep_their_dtype() -> None:
    outs = [torch.randn(2, 3, 4).to(torch.bfloat16) for _ in range(2)]
    lses = [torch.randn(2, 3) for _ in range(2)]
    out, lse = fz.merge_attention(outs, lses)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want = (outs[0].float() * torch.sigmoid(lses[0] - lses[1])[..., None]) + outs[1].float() * torch.sigmoid(
        lses[1] - lses[0]
    )[..., None]
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)


def test_mixed_lse_dtypes_merge_in_the_widest_whatever_the_order() -> None:
    """A float64 lse beside a float32 one is merged in float64 (not rounded to float32 because
    the first part's lse is float32), and the result does not depend on the order of the parts."""
    g = torch.Generator().manual_seed(3)
    outs = [torch.randn(2, 3, 4, generator=g) for _ in range(2)]  # float32
    lses = [torch.randn(2, 3, generator=g), 30 + torch.randn(2, 3, dtype=torch.float64, generator=g) / 7]
    want, want_lse = fz.merge_attention(outs, [lses[0].double(), lses[1]])
    for order in ([0, 1], [1, 0]):
        out, lse = fz.merge_attention([outs[p] for p in order], [lses[p] for p in order])
        assert out.dtype == torch.float32 and lse.dtype == torch.float64
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        torch.testing.assert_close(lse, want_lse, rtol=1e-14, atol=1e-14)


def test_split_route_uses_the_same_merge() -> None:
    from flexattn_zoo.backends import merge, split

    assert split.merge_two is merge.merge_two and split.compiled_merge_two is merge.compiled_merge_two
    out_a, out_b = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    lse_a, lse_b = torch.randn(1, 1, 3), torch.randn(1, 1, 3)
    got = merge.merge_two(out_a, lse_a, out_b, lse_b)
    want = fz.merge_attention([out_a, out_b], [lse_a, lse_b])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize(
    ("outs", "lses", "exc", "match"),
    [
        (torch.zeros(2, 3, 4), [torch.zeros(3)], TypeError, "sequences of tensors"),
        ([], [], ValueError, "at least one"),
        ([torch.zeros(3, 4)], [], ValueError, "one lse per output"),
        ([torch.zeros(3, 4)], [torch.zeros(4)], ValueError, r"lses\[0\]\) has shape"),
        ([torch.zeros(3, 4), torch.zeros(3, 5)], [torch.zeros(3)] * 2, ValueError, r"outs\[1\]\) has shape"),
        ([torch.zeros(3, 4, dtype=torch.long)], [torch.zeros(3)], TypeError, "floating"),
        (
            [torch.zeros(3, 4), torch.zeros(3, 4, dtype=torch.float64)],
            [torch.zeros(3)] * 2,
            TypeError,
            "dtype",
        ),
        ([torch.zeros(3, 4), "x"], [torch.zeros(3)] * 2, TypeError, "must be a tensor"),
        ([torch.zeros(4)], [torch.zeros(())], ValueError, r"\[\.\.\., Lq, Dv\]"),
    ],
)
def test_bad_arguments(outs, lses, exc, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(exc, match=match):
        fz.merge_attention(outs, lses)
