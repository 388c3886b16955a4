"""Paged KV in the serving stacks' layouts: ``append_kv`` then ``decode_step(kv_layout=...)`` vs a
dense cache and the float64 reference; page sizes 1 / 16 / 64 / 128; the block size in the keys.

Layouts: ``"NHD"`` pools are ``[n_pages, page, Hkv, D]`` (vLLM, FlashAttention), ``"HND"``
``[n_pages, Hkv, page, D]`` (FlashInfer's other layout). The reference keeps one dense cache
``[B, Hkv, CAP, D]`` per k and v, written with the same tokens at the same logical positions.

CPU flex compiles cost seconds each: one per (page size, pool view strides); HND with one-token
pages has NHD's view strides and shares its kernel. Other checks use the dense route.
"""

from __future__ import annotations

import pytest
import torch

from flexattn_zoo import masks
from flexattn_zoo.backends import flex as flex_backend
from flexattn_zoo.compile import CACHE as COMPILE_CACHE
from flexattn_zoo.models import decode
from flexattn_zoo.testing import reference_attention

B, H, HKV, D, CAP = 3, 4, 2, 16, 256
PAGES = (1, 16, 64, 128)


def _pools(layout: str, page: int, n_pages: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pools full of garbage (what a serving stack's pool holds before a write)."""
    g = torch.Generator().manual_seed(seed)
    shape = (n_pages, page, HKV, D) if layout == "NHD" else (n_pages, HKV, page, D)
    return torch.randn(*shape, generator=g) * 50, torch.randn(*shape, generator=g) * 50


def _table(page: int, n_pages: int, seed: int) -> torch.Tensor:
    """Distinct pages for every row, scattered over the pool; int32 as the serving stacks keep it."""
    width = CAP // page
    perm = torch.randperm(n_pages, generator=torch.Generator().manual_seed(seed))
    return perm[: B * width].view(B, width).to(torch.int32)


def _reference(q: torch.Tensor, k_dense: torch.Tensor, v_dense: torch.Tensor, lens: list[int], mask=None):  # type: ignore[no-untyped-def]
    """Each row's queries (its last Lq positions) against its first ``lens[b]`` dense keys."""
    rows = []
    for b, n in enumerate(lens):
        lq = q.shape[2]
        full_q = torch.zeros(1, H, n, D, dtype=torch.float64)
        full_q[:, :, n - lq :] = q[b : b + 1].double()
        out = reference_attention(
            full_q,
            k_dense[b : b + 1, :, :n].double(),
            v_dense[b : b + 1, :, :n].double(),
            mask=masks.Causal() if mask is None else mask,
            enable_gqa=True,
        )
        rows.append(out[0, :, n - lq :])
    return torch.stack(rows)


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    # float32 kernels vs float64 over <= 256 unit-scale keys: ~30 float32 ulps.
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)


def _append_both(pools, dense, table, lens, k_new, v_new, layout, rows=None):  # type: ignore[no-untyped-def]
    """append_kv into the pools (rows ``rows`` only, with their table rows) and the same write
    into the dense caches; returns append_kv's lengths."""
    rows = list(range(B)) if rows is None else rows
    idx = torch.tensor(rows)
    lens_t = torch.tensor([lens[r] for r in rows])
    new = decode.append_kv(*pools, table[idx], lens_t, k_new, v_new, kv_layout=layout)
    for i, r in enumerate(rows):
        n = k_new.shape[2]
        dense[0][r, :, lens[r] : lens[r] + n] = k_new[i]
        dense[1][r, :, lens[r] : lens[r] + n] = v_new[i]
    return new


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_append_then_decode_matches_a_dense_cache(layout: str, page: int) -> None:
    """Rows of different lengths (one of them a single token) filled by append_kv, then two steps
    of one and of three new tokens (GQA 4:2): each step equals the float64 reference over the
    dense cache, on the flex route (no gather, no copy of the pools) and on the dense one."""
    n_pages = 2 * B * CAP // page  # twice the pages the rows use: the others hold garbage
    pools = _pools(layout, page, n_pages, seed=page)
    table = _table(page, n_pages, seed=page + 1)
    dense = (torch.zeros(B, HKV, CAP, D), torch.zeros(B, HKV, CAP, D))
    g = torch.Generator().manual_seed(page + 2)
    lens = [0] * B
    for b, n in enumerate((200, 1, 97)):  # prefill each row alone: different lengths
        new = _append_both(
            pools, dense, table, lens, *torch.randn(2, 1, HKV, n, D, generator=g), layout, rows=[b]
        )
        lens[b] = int(new[0])
    for lq in (1, 3):
        k_new, v_new = torch.randn(2, B, HKV, lq, D, generator=g)
        new_lens = _append_both(pools, dense, table, lens, k_new, v_new, layout)
        assert new_lens.tolist() == [n + lq for n in lens]
        lens = new_lens.tolist()
        q = torch.randn(B, H, lq, D, generator=g)
        ref = _reference(q, *dense, lens)
        # Flex for every single-token step; for the three-token one (another kernel) only with
        # pages of 1 and 16 keys, to bound the compiles.
        flex = lq == 1 or page in (1, 16)
        with torch.no_grad():
            if flex:
                out = decode.decode_step(q, *pools, new_lens, block_table=table, kv_layout=layout)
                _close(out, ref)
            dense_out = decode.decode_step(
                q, *pools, new_lens, block_table=table, kv_layout=layout, backend="dense"
            )
            _close(dense_out, ref)


def test_pool_views_share_the_pools_memory() -> None:
    """The flex route reads the pools in place: the views alias them, and the canonical-layout
    step in front of the kernel keeps them as they are (a copy would be batch x the pool)."""
    for layout, page, slots in (("NHD", 16, 1), ("HND", 16, HKV), ("HND", 1, 1)):
        pool, _ = _pools(layout, page, 8, seed=0)
        view, slot_stride = decode.pool_view(pool, layout)
        assert slot_stride == slots and view.data_ptr() == pool.data_ptr() and view.stride(0) == 0
        # Token o of page p is key (p * slot_stride) * page + o of every head.
        p, o, h = 5, page - 1, 1
        token = pool[p, o, h] if layout == "NHD" else pool[p, h, o]
        assert torch.equal(view[0, h, p * slot_stride * page + o], token)
        q = torch.randn(B, H, 1, D)
        expanded = view.expand(B, -1, -1, -1)
        kept = flex_backend._canonical_layout(q, expanded, expanded)
        assert kept[1] is expanded and kept[2] is expanded


def test_interleaved_k_and_v_pools_are_read_in_place() -> None:
    """FlashInfer's NHD cache ``[n_pages, 2, page, Hkv, D]`` gives k and v as strided views (page
    stride twice a page): read in place with pages two page slots apart."""
    page, n_pages = 16, 2 * B * CAP // 16
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(n_pages, 2, page, HKV, D, generator=g)
    k_pool, v_pool = kv[:, 0], kv[:, 1]
    view, slots = decode.pool_view(k_pool, "NHD")
    assert slots == 2 and view.data_ptr() == k_pool.data_ptr()
    table = _table(page, n_pages, seed=4)
    dense = (torch.zeros(B, HKV, CAP, D), torch.zeros(B, HKV, CAP, D))
    lens = _append_both(
        (k_pool, v_pool), dense, table, [0] * B, *torch.randn(2, B, HKV, 150, D, generator=g), "NHD"
    )
    q = torch.randn(B, H, 1, D, generator=g)
    with torch.no_grad():
        out = decode.decode_step(q, k_pool, v_pool, lens, block_table=table, kv_layout="NHD", backend="dense")
    _close(out, _reference(q, *dense, lens.tolist()))


def test_missing_pages_below_a_rows_length_are_invisible_on_every_route() -> None:
    """A -1 page below a row's length (a page a sliding window freed) hides its keys: on the flex
    route (physical blocks) and on the dense route over the gathered pages, which read page 0's
    garbage in its place before."""
    page, n_pages = 16, 2 * B * CAP // 16
    pools = _pools("NHD", page, n_pages, seed=5)
    table = _table(page, n_pages, seed=6)
    dense = (torch.zeros(B, HKV, CAP, D), torch.zeros(B, HKV, CAP, D))
    g = torch.Generator().manual_seed(7)
    lens = _append_both(pools, dense, table, [0] * B, *torch.randn(2, B, HKV, 100, D, generator=g), "NHD")
    table[1, 2] = -1  # row 1 freed its keys 32 .. 47
    q = torch.randn(B, H, 1, D, generator=g)
    keep = torch.ones(B, 1, 1, CAP, dtype=torch.bool)
    keep[1, :, :, 32:48] = False
    refs = []
    for b, n in enumerate(lens.tolist()):
        refs.append(
            reference_attention(
                q[b : b + 1].double(),
                dense[0][b : b + 1, :, :n].double(),
                dense[1][b : b + 1, :, :n].double(),
                mask=masks.Dense(mask=keep[b : b + 1, :, :, :n]),
                enable_gqa=True,
            )[0]
        )
    ref = torch.stack(refs)
    with torch.no_grad():
        for backend in ("auto", "dense"):
            out = decode.decode_step(q, *pools, lens, block_table=table, kv_layout="NHD", backend=backend)
            _close(out, ref)


def test_holes_list_no_page_twice_and_no_owned_page_is_dropped() -> None:
    """-1 entries among a row's pages are left out of the flex block list. Listed as page 0 (the
    clamped -1), a hole made flex read page 0 a second time in a row that owns it, counting its
    keys twice; and a row whose pages in range outnumber the pool's (a sink page and a recent
    window, StreamingLLM style, in a pool of 4 pages) lost its last pages."""
    page, n_pages = 16, 4
    g = torch.Generator().manual_seed(21)
    kp, vp = torch.randn(2, n_pages, page, HKV, D, generator=g)
    table = torch.tensor([[0, -1, 2, -1, -1, 3, 1, -1], [-1, -1, -1, 0, -1, -1, -1, -1]])
    lens = torch.tensor([7 * page - 5, 4 * page])
    q = torch.randn(2, H, 1, D, generator=g)
    refs = []
    for b, n in enumerate(lens.tolist()):  # the row's own pages in logical order, cut to its length
        owned = [(p, int(t)) for p, t in enumerate(table[b].tolist()) if t >= 0 and p * page < n]
        keep = torch.cat([torch.arange(p * page, min(n, (p + 1) * page)) for p, _ in owned])
        keys = torch.cat([kp[t] for _, t in owned])[: keep.numel()].transpose(0, 1)[None]
        values = torch.cat([vp[t] for _, t in owned])[: keep.numel()].transpose(0, 1)[None]
        refs.append(
            reference_attention(q[b : b + 1].double(), keys.double(), values.double(), enable_gqa=True)[0]
        )
    ref = torch.stack(refs)
    with torch.no_grad():
        for backend in ("auto", "dense"):
            out = decode.decode_step(q, kp, vp, lens, block_table=table, kv_layout="NHD", backend=backend)
            _close(out, ref)


def test_pages_below_the_flex_minimum_take_the_dense_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA flex needs kv blocks of >= 16 keys; smaller pages decode on the dense route over the
    gathered live pages. Exercised here by raising the CPU's minimum."""
    monkeypatch.setitem(decode.MIN_FLEX_PAGE, "cpu", 32)
    page, n_pages = 16, 2 * B * CAP // 16
    pools = _pools("HND", page, n_pages, seed=8)
    table = _table(page, n_pages, seed=9)
    dense = (torch.zeros(B, HKV, CAP, D), torch.zeros(B, HKV, CAP, D))
    g = torch.Generator().manual_seed(10)
    lens = _append_both(pools, dense, table, [0] * B, *torch.randn(2, B, HKV, 77, D, generator=g), "HND")
    q = torch.randn(B, H, 1, D, generator=g)
    compiles = COMPILE_CACHE.total_compiles()
    with torch.no_grad():
        out = decode.decode_step(q, *pools, lens, block_table=table, kv_layout="HND")
        _close(out, _reference(q, *dense, lens.tolist()))
        assert COMPILE_CACHE.total_compiles() == compiles  # no flex kernel
        with pytest.raises(ValueError, match=r"flex_cpu.*kv blocks of 16 keys are below the 32"):
            decode.decode_step(q, *pools, lens, block_table=table, kv_layout="HND", backend="flex_cpu")


# ---- the block size in the compile key -----------------------------------------------------------


def test_two_block_sizes_in_one_process_compile_apart() -> None:
    """A paged decode at block size 128, then at 64, in one process. The page size reached the
    kernel only through a bound method of the DecodeMask, which the compile key does not see, and
    the BlockMask's block size was not in it either: both steps shared one compiled entry, Dynamo
    made the page size symbolic for the second graph, and torch's CPU flex template failed to
    compile it (InductorError: C++ compile error). Now each block size has its own entry."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, H, 1, D, generator=g)
    lens = torch.tensor([200, 100])
    with torch.no_grad():
        for bs in (128, 64):
            n_pages = 512 // bs
            kp, vp = torch.randn(2, 1, HKV, n_pages * bs, D, generator=g)
            table = torch.randperm(n_pages, generator=g)[: 2 * (256 // bs)].view(2, -1)
            out = decode.decode_step(q, kp, vp, lens, block_table=table, block_size=bs)
            keys, values = (decode._gather_pages(t, table, table.shape[1], bs) for t in (kp, vp))
            _close(out, _reference(q, keys, values, lens.tolist()))
    dms = [dm for dm in decode.CACHE.values() if dm.paged and dm.batch == 2 and dm.q_len == 1]
    keys = {run.call.key for dm in dms for run in dm.runs.values() if run.call is not None}
    assert {dm.block_size for dm in dms} >= {128, 64} and len(keys) >= 2


def test_compile_keys_hold_the_block_size() -> None:
    def mask_mod(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return kv_idx <= q_idx

    shape = (H, HKV, D, torch.float32)
    key = COMPILE_CACHE.key
    assert key(mask_mod, None, None, False, True, shape, (128, 128)) != key(
        mask_mod, None, None, False, True, shape, (128, 64)
    )
    # The paged decode mask's page size is a captured constant of its mask_mod: in the key too.
    a, b = (decode.DecodeMask(None, 2, 1, 256, n_physical=4, block_size=bs) for bs in (64, 32))
    from flexattn_zoo.compile import mod_key

    assert mod_key(a.mask_mod) != mod_key(b.mask_mod)
    assert mod_key(a.mask_mod) == mod_key(
        decode.DecodeMask(None, 2, 1, 256, n_physical=4, block_size=64).mask_mod
    )


# ---- argument checks -----------------------------------------------------------------------------


def _bad(case: str):  # type: ignore[no-untyped-def]
    page, n_pages = 16, 8
    k, v = _pools("NHD", page, n_pages, seed=12)
    table = torch.tensor([[0, 1, -1], [2, 3, 4], [5, -1, -1]], dtype=torch.int32)
    q = torch.randn(B, H, 1, D)
    lens = torch.tensor([20, 40, 3])
    new = torch.randn(B, HKV, 2, D)
    calls = {
        "layout_name": lambda: decode.decode_step(q, k, v, lens, block_table=table, kv_layout="BHSD"),
        "layout_without_table": lambda: decode.decode_step(q, k, v, lens, kv_layout="NHD"),
        "layout_block_size": lambda: decode.decode_step(
            q, k, v, lens, block_table=table, kv_layout="NHD", block_size=128
        ),
        "layout_rank": lambda: decode.decode_step(q, k[0], v[0], lens, block_table=table, kv_layout="NHD"),
        "layout_k_v": lambda: decode.decode_step(q, k, v[:4], lens, block_table=table, kv_layout="NHD"),
        "layout_page_past_pool": lambda: decode.decode_step(
            q, k, v, lens, block_table=torch.tensor([[0, 9, -1], [2, 3, 4], [5, -1, -1]]), kv_layout="NHD"
        ),
        "layout_len_past_table": lambda: decode.decode_step(
            q, k, v, torch.tensor([20, 49, 3]), block_table=table, kv_layout="NHD"
        ),
        "append_layout": lambda: decode.append_kv(k, v, table, lens, new, new, kv_layout="nhd"),
        "append_dtype": lambda: decode.append_kv(k, v, table, lens, new.double(), new, kv_layout="NHD"),
        "append_heads": lambda: decode.append_kv(k, v, table, lens, new[:, :1], new, kv_layout="NHD"),
        # NHD pools read as HND: the page size is taken for Hkv, and the message says so
        "append_other_layout": lambda: decode.append_kv(k, v, table, lens, new, new, kv_layout="HND"),
        "append_batch": lambda: decode.append_kv(k, v, table, lens, new[:2], new[:2], kv_layout="NHD"),
        "append_rank": lambda: decode.append_kv(k, v, table, lens, new[0], new[0], kv_layout="NHD"),
        "append_missing_page": lambda: decode.append_kv(
            k, v, table, torch.tensor([31, 40, 3]), new, new, kv_layout="NHD"
        ),
        "append_past_table": lambda: decode.append_kv(
            k, v, table, torch.tensor([20, 47, 3]), new, new, kv_layout="NHD"
        ),
        "append_negative": lambda: decode.append_kv(
            k, v, table, torch.tensor([-1, 40, 3]), new, new, kv_layout="NHD"
        ),
        "append_float_lens": lambda: decode.append_kv(k, v, table, lens.float(), new, new, kv_layout="NHD"),
        "append_lens_count": lambda: decode.append_kv(k, v, table, lens[:2], new, new, kv_layout="NHD"),
        "append_float_table": lambda: decode.append_kv(k, v, table.float(), lens, new, new, kv_layout="NHD"),
        "append_block_size": lambda: decode.append_kv(
            k, v, table, lens, new, new, kv_layout="NHD", block_size=8
        ),
        "append_plain_pool": lambda: decode.append_kv(k, v, table, lens, new, new),
    }
    return calls[case]


@pytest.mark.parametrize(
    ("case", "exc", "match"),
    [
        ("layout_name", ValueError, r"kv_layout must be None, 'NHD' or 'HND'; got 'BHSD'"),
        (
            "layout_without_table",
            ValueError,
            r"kv_layout='NHD' names a page pool layout: it needs block_table=",
        ),
        ("layout_block_size", ValueError, r"block_size=128 differs from the pools' page size 16"),
        (
            "layout_rank",
            ValueError,
            r"k_cache with kv_layout='NHD' must be a pool \[n_pages, page_size, Hkv, D\]",
        ),
        ("layout_k_v", ValueError, r"k_cache and v_cache must agree in pages, page size and heads"),
        ("layout_page_past_pool", ValueError, r"block_table holds page 9.*valid pages are 0 \.\. 7"),
        ("layout_len_past_table", ValueError, r"cache_len 49 is out of range.*capacity 48"),
        ("append_layout", ValueError, r"append_kv kv_layout must be None, 'NHD' or 'HND'; got 'nhd'"),
        ("append_dtype", TypeError, r"k_new must have k_pool's dtype and device \(torch.float32"),
        ("append_heads", ValueError, r"k_new must be \[B, Hkv=2, n, D=16\]"),
        (
            "append_other_layout",
            ValueError,
            r"k_new must be \[B, Hkv=\d+, n, D=16\] .*\(Hkv and D from the pools read as kv_layout='HND' "
            r"\[n_pages, Hkv, page_size, D\]\)",
        ),
        ("append_batch", ValueError, r"block_table must be \[B=2, max_pages\]"),
        ("append_rank", ValueError, r"k_new must have 4 dims \[B, Hkv, n, D\]"),
        (
            "append_missing_page",
            ValueError,
            r"row 0 writes position 32 to block_table\[0, 2\] = -1, outside the pool",
        ),
        (
            "append_past_table",
            ValueError,
            r"writes positions -?\d+ \.\. 48, outside the table's capacity 0 \.\. 47",
        ),
        ("append_negative", ValueError, r"writes positions -1 \.\. "),
        (
            "append_float_lens",
            TypeError,
            r"seq_lens must be an int or an integer tensor \[B\], got a torch.float32",
        ),
        (
            "append_lens_count",
            ValueError,
            r"seq_lens must hold one length per row of block_table \(3\), got 2",
        ),
        ("append_float_table", TypeError, r"block_table must be an integer tensor"),
        ("append_block_size", ValueError, r"block_size=8 differs from the pools' page size 16"),
        (
            "append_plain_pool",
            ValueError,
            r"pools without kv_layout are \[1, Hkv, n_pages \* block_size, D\]",
        ),
    ],
)
def test_bad_paged_arguments_are_named(case: str, exc: type[Exception], match: str) -> None:
    call = _bad(case)
    with torch.no_grad(), pytest.raises(exc, match=match):
        call()


def test_a_failed_append_writes_nothing() -> None:
    """append_kv checks every page before writing any: a bad row leaves the pools as they were."""
    k, v = _pools("HND", 16, 8, seed=13)
    before = k.clone(), v.clone()
    table = torch.tensor([[0, 1], [2, -1]])
    new = torch.randn(2, HKV, 4, D)
    with pytest.raises(ValueError, match="outside the pool"):
        decode.append_kv(k, v, table, torch.tensor([3, 14]), new, new, kv_layout="HND")
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])
    assert decode.append_kv(k, v, table, 3, new, new, kv_layout="HND") == 7  # an int gives an int
