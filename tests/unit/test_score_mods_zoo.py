"""The score mods from attention-gym's and T5's catalogues: T5's relative position buckets against
its float32 formula, gradients into the learned table, and ALiBi's signed variant against
attention-gym's ``alibi_mod``."""

from __future__ import annotations

import math

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import score_mods
from flexattn_zoo.masks import Causal
from flexattn_zoo.score_mods import Alibi, RelPosBias
from flexattn_zoo.testing import reference_attention


def _qkv(batch: int, q_len: int, kv_len: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, 2, q_len, 8, generator=g).requires_grad_(),
        torch.randn(batch, 2, kv_len, 8, generator=g).requires_grad_(),
        torch.randn(batch, 2, kv_len, 8, generator=g).requires_grad_(),
    )


def _t5_bucket_float32(
    rel: torch.Tensor, num_buckets: int, max_distance: int, bidirectional: bool
) -> torch.Tensor:
    """T5's bucketing computed as its reference implementation does: a float32 logarithm."""
    side, offset = num_buckets, torch.zeros_like(rel)
    if bidirectional:
        side //= 2
        offset = (rel > 0).long() * side
        n = rel.abs()
    else:
        n = (-rel).clamp(min=0)
    exact = side // 2
    scaled = torch.log(n.float() / exact) / math.log(max_distance / exact) * (side - exact)
    far = (exact + scaled.long()).clamp(max=side - 1)
    return offset + torch.where(n < exact, n, far)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (64, 256), (16, 20), (8, 100), (6, 8)])
def test_rel_pos_buckets_agree_with_t5(num_buckets: int, max_distance: int, bidirectional: bool) -> None:
    spec = RelPosBias(
        table=torch.zeros(num_buckets, 1), bidirectional=bidirectional, max_distance=max_distance
    )
    rel = torch.arange(-3 * max_distance, 3 * max_distance + 1)
    got = spec.buckets()[rel.clamp(-max_distance, max_distance) + max_distance].long()
    assert torch.equal(got, _t5_bucket_float32(rel, num_buckets, max_distance, bidirectional))


def test_rel_pos_bias_gradient_reaches_the_table() -> None:
    table = torch.randn(32, 2, dtype=torch.float64, requires_grad=True)
    spec = RelPosBias(table=table)
    assert spec.table is table and spec.captures_grad_tensors()
    assert RelPosBias(table=table) != RelPosBias(table=table.detach().clone().requires_grad_())
    q, k, v = (t.detach().double().requires_grad_() for t in _qkv(2, 11, 13))
    out = fz.attention(q, k, v, mask=Causal(align="bottom_right"), score_mod=spec)
    assert fz.plan(q, k, v, mask=Causal(align="bottom_right"), score_mod=spec).backend == "dense"
    grad_out = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(2))
    (got,) = torch.autograd.grad(out, table, grad_out)
    # The same attention written out: scores plus the table gathered at T5's buckets, differentiated.
    buckets = _t5_bucket_float32(torch.arange(13)[None, :] - torch.arange(11)[:, None], 32, 128, True)
    scores = q @ k.transpose(-1, -2) / math.sqrt(8) + table[buckets].permute(2, 0, 1)
    scores = scores.masked_fill(~Causal(align="bottom_right").dense(11, 13), -math.inf)
    (want,) = torch.autograd.grad(torch.softmax(scores, -1) @ v, table, grad_out)
    torch.testing.assert_close(got, want)
    assert int((got != 0).sum()) > 0
    ref = reference_attention(q, k, v, mask=Causal(align="bottom_right"), score_mod=spec)
    torch.testing.assert_close(out, ref)


def test_rel_pos_bias_errors() -> None:
    with pytest.raises(ValueError, match="at least 4 buckets"):
        RelPosBias(table=torch.zeros(3, 2))
    with pytest.raises(ValueError, match="max_distance"):
        RelPosBias(table=torch.zeros(32, 2), max_distance=8)
    with pytest.raises(ValueError, match="float tensor"):
        RelPosBias(table=torch.zeros(32))
    assert RelPosBias(table=torch.ones(8, 2, dtype=torch.long)).table.dtype == torch.float32
    with pytest.raises(ValueError, match="3 query heads"):
        RelPosBias(table=torch.zeros(32, 2)).validate(4, 4, 1, 3)
    assert score_mods.get("rel_pos_bias", table=torch.zeros(8, 1)).num_buckets == 8


def test_signed_alibi_is_attention_gyms_and_agrees_with_alibi_on_past_keys() -> None:
    heads = 8
    signed, plain = Alibi(num_heads=heads, signed=True), Alibi(num_heads=heads)
    scores = torch.randn(1, heads, 9, 12, dtype=torch.float64)
    h = torch.arange(heads, dtype=torch.float64).view(1, -1, 1, 1)
    offset = (torch.arange(12)[None, :] - torch.arange(9)[:, None]).double()
    gym = scores + offset * torch.exp2(-((h + 1) * 8.0 / heads))  # attention-gym's alibi_mod
    torch.testing.assert_close(signed.dense(scores), gym, rtol=1e-14, atol=1e-14)
    past = offset <= 0
    torch.testing.assert_close(signed.dense(scores)[..., past], plain.dense(scores)[..., past])
    assert not torch.allclose(signed.dense(scores)[..., ~past], plain.dense(scores)[..., ~past])
    assert signed.linear_bias_form() is None and plain.linear_bias_form() is not None
    assert signed.score_mod(future_keys_hidden=True) is signed.score_mod()
    assert signed != plain and score_mods.get("alibi", num_heads=2, signed=True) == Alibi(
        num_heads=2, signed=True
    )
    with pytest.raises(TypeError, match="signed"):
        Alibi(num_heads=2, signed=1)  # type: ignore[arg-type]
