"""The library's host-side work ignores the caller's default device.

A script may run under ``torch.set_default_device("cuda")`` or a ``with torch.device(...)``
block; tensors the library builds for itself on the host (varlen segments, decode bounds, block
maps, plans) must not follow it: on a GPU they would cost a device round trip each, and under
the ``meta`` device used here (which has no data) they cannot be read back at all. Every call
below runs on CPU inputs under ``torch.device("meta")`` from empty caches and must give what it
gives outside it.
"""

from __future__ import annotations

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import blockmask, masks, plan_cache, registry, segments
from flexattn_zoo.backends import varlen
from flexattn_zoo.models import decode
from flexattn_zoo.models.decode import mask as decode_mask

B, H, L, D = 2, 2, 160, 8
LENGTHS = (1, 100, L)


def _clear_host_caches() -> None:
    for cache in (
        plan_cache.PLANS,
        blockmask.CACHE,
        segments.LAYOUT_CACHE,
        varlen.CU_SEQLENS_CACHE,
        decode_mask.LOWEST_KEYS,
        decode.CACHE,
        decode.STEPS,
    ):
        cache.clear()


def _block_tensors(bm) -> list[torch.Tensor]:
    return [t for t in bm.as_tuple() if isinstance(t, torch.Tensor)]


def _host_work(spec, q, k, v):
    """What planning and decoding build for ``spec`` on the host, as comparable values."""
    found = [fz.plan(q, k, v, mask=spec).explain()]
    found += _block_tensors(fz.block_mask(spec, L, L, batch=B, heads=H, device="cpu"))
    for n in LENGTHS:
        dm = decode.DecodeMask(spec, B, 1, L, device="cpu")
        found += _block_tensors(dm.update(n))
        if spec.sees_one_run():
            with torch.no_grad():
                found.append(decode.decode_step(q[:, :, -1:], k, v, n, mask=spec))
    return found


def _examples(name: str) -> list:
    return registry.MASKS.find(name).factory.examples(L, L, B, H)[:2]


@pytest.mark.parametrize("name", masks.names())
def test_planning_block_masks_and_decoding_ignore_the_default_device(name: str) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    for spec in _examples(name):
        try:
            spec.validate(L, L, B, H)
        except ValueError:
            continue
        _clear_host_caches()
        with torch.device("meta"):
            under_meta = _host_work(spec, q, k, v)
        _clear_host_caches()
        expected = _host_work(spec, q, k, v)
        assert len(under_meta) == len(expected)
        for got, want in zip(under_meta, expected, strict=True):
            if isinstance(want, torch.Tensor):
                assert got.device == want.device
                torch.testing.assert_close(got, want, rtol=0, atol=0)
            else:
                assert got == want
