"""``fz.attention`` under ``torch.func`` transforms (eagerly): routes that run a torch.compile'd
kernel (the flex routes) or a custom ``autograd.Function`` (``sdpa_split``) cannot be called
there (pytorch/pytorch#128711), so they refuse and ``auto`` takes another exact route."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo.testing import reference_attention

B, H, L, D = 1, 2, 48, 16


def _inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(shape, generator=g) for shape in ((3, B, H, L, D), (B, H, L, D), (B, H, L, D)))


@pytest.mark.parametrize(
    "mask", [masks.SlidingWindow(left=8), masks.PrefixLM(prefix_len=20)], ids=["flex_first", "split_first"]
)
def test_auto_under_vmap_takes_a_route_the_transform_can_call(mask: Any) -> None:
    # flex_cpu's finiteness scan read a value (.item()), which vmap refuses, and the compiled flex
    # kernel ran uncompiled under it (an "unfused fallback" error); sdpa_split's autograd.Function
    # has no functorch rules. An eager sdpa_split call first (no kernel to compile): its cached
    # plan must not serve the vmapped call.
    qs, k, v = _inputs()
    if isinstance(mask, masks.PrefixLM):
        fz.attention(qs[0], k, v, mask=mask)
    out = torch.func.vmap(lambda q: fz.attention(q, k, v, mask=mask))(qs)
    want = torch.stack([reference_attention(q.double(), k.double(), v.double(), mask=mask) for q in qs])
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_a_named_flex_route_under_vmap_says_why_it_refuses() -> None:
    qs, k, v = _inputs()
    with pytest.raises(ValueError, match=r"backend 'flex_cpu' cannot run this call: .*torch\.func\.vmap"):
        torch.func.vmap(
            lambda q: fz.attention(q, k, v, mask=masks.SlidingWindow(left=8), backend="flex_cpu")
        )(qs)
