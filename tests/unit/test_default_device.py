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
from flexattn_zoo import blockmask, masks, plan_cache, registry, score_mods, segments
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
    """Copies: a DecodeMask's update rewrites the same tensors in place."""
    return [t.clone() for t in bm.as_tuple() if isinstance(t, torch.Tensor)]


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


def _assert_same(got: list, expected: list) -> None:
    """Equal values; tensors bit for bit and on the same device."""
    assert len(got) == len(expected)
    for value, want in zip(got, expected, strict=True):
        if isinstance(want, torch.Tensor):
            assert value.device == want.device
            torch.testing.assert_close(value, want, rtol=0, atol=0)
        else:
            assert value == want


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
        _assert_same(under_meta, expected)


def _paged_steps() -> list[torch.Tensor]:
    """A few paged decoding steps with a page allocator (its lengths and table written on the
    host), a freed row taking new pages and a fork: the outputs, lengths and table."""
    page, kv_heads, heads, dim = 16, 2, 4, 8
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cpu")

    k_pool, v_pool = (
        torch.zeros(12, page, kv_heads, dim, device="cpu"),
        torch.zeros(12, page, kv_heads, dim, device="cpu"),
    )
    alloc = fz.pages.PageAllocator(12, page, 4, batch=2, kv_layout="NHD", device="cpu")
    alloc.append(k_pool, v_pool, *randn(2, 1, kv_heads, 40, dim), rows=0)
    alloc.append(k_pool, v_pool, *randn(2, 1, kv_heads, 7, dim), rows=1)
    found = []
    for step in range(4):
        if step == 2:
            alloc.free(0)
            alloc.append(k_pool, v_pool, *randn(2, 1, kv_heads, 20, dim), rows=0)
        alloc.append(k_pool, v_pool, *randn(2, 2, kv_heads, 1, dim))
        q = randn(2, heads, 1, dim)
        found.append(
            decode.decode_step(
                q,
                k_pool,
                v_pool,
                alloc.cache_len,
                block_table=alloc.block_table,
                kv_layout="NHD",
                backend="dense",
            )
        )
    alloc.free(0)
    alloc.fork(1, 0)
    return [*found, alloc.cache_len.clone(), alloc.block_table.clone()]


def test_specs_from_lists_raw_callables_and_page_allocators_ignore_the_default_device() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    table = torch.arange(L) % 3

    def same_third(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (table[kv_idx] == table[q_idx])

    def work() -> list:
        documents = masks.Document.from_lengths([[30, 70, 60], [L]])
        assert documents.doc_ids.device.type == "cpu"  # no device given, no tensor: the CPU
        found: list = [
            fz.plan(q, k, v, mask=documents & masks.Causal()).explain(),
            fz.plan(q, k, v, mask=same_third).explain(),
            fz.attention(q, k, v, mask=same_third, backend="dense"),
        ]
        return found + _paged_steps()

    _clear_host_caches()
    with torch.device("meta"):
        under_meta = work()
    _clear_host_caches()
    expected = work()
    _assert_same(under_meta, expected)


def _specs_from_host_values() -> dict:
    """Specs whose constructors compute tables on the host from CPU tensors and plain ints."""
    table = torch.linspace(-1.0, 1.0, 32 * H, device="cpu").view(32, H)
    cpu = {"device": "cpu"}
    return {
        "rel_pos_bias": {"score_mod": score_mods.RelPosBias(table=table)},
        "sandwich": {"score_mod": score_mods.Sandwich(num_heads=H, dim=16, max_len=L)},
        "tree": {"mask": masks.Tree(parents=torch.tensor([-1, 0, 0, 1], **cpu), prefix_len=L - 4)},
        "global_window": {"mask": masks.GlobalWindow.from_positions(torch.tensor([0, 10], **cpu), L, left=4)},
        "flamingo": {"mask": masks.FlamingoCross.from_image_positions(torch.tensor([0, 40], **cpu), 32, L)},
        "shared_prefix": {"mask": masks.SharedPrefix.from_lengths(16, torch.tensor([72, 72], **cpu))},
    }


def test_specs_built_under_another_default_device_hold_host_tables() -> None:
    """Built under ``torch.device("meta")`` from CPU values, each spec equals the one built
    outside it, and its tables (Sandwich's, cached per size and device, too) stay on the CPU."""
    from flexattn_zoo.score_mods import sandwich  # noqa: PLC0415  (its table cache is cleared)

    sandwich._TABLES.clear()
    with torch.device("meta"):
        built = _specs_from_host_values()
    expected = _specs_from_host_values()
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    kv_len = {"flamingo": 32 * 2}
    for name, kwargs in built.items():
        assert kwargs == expected[name], name
        n = kv_len.get(name, L)
        keys, values = k[:, :, :n], v[:, :, :n]
        got = fz.attention(q, keys, values, backend="dense", **kwargs)
        want = fz.attention(q, keys, values, backend="dense", **expected[name])
        torch.testing.assert_close(got, want, rtol=0, atol=0)
