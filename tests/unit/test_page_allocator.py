"""fz.pages.PageAllocator: a generation loop over paged pools vs a dense cache, errors, layers.

Every step appends through the allocator (pages taken as rows cross page boundaries, rows freed
and reused mid-way, pages recycled in another order) and checks
``decode_step(q, k_pool, v_pool, alloc.cache_len, block_table=alloc.block_table, kv_layout=...)``
against the float64 reference over a dense cache written with the same tokens. Layouts "NHD",
"HND" (and the library's own, None); pages of 16 and 5 keys. The loops run on the exact ``dense``
route (it gathers the rows' pages through the table); one loop runs on ``flex_cpu`` (CPU flex
compiles cost ~10 s each here: one).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo.models.pages import PageAllocator
from flexattn_zoo.testing import reference_attention

B, H, HKV, D, MAX_PAGES = 3, 4, 2, 16, 6


def _pools(layout: str | None, page: int, n_pages: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pools full of garbage, as a serving stack's pool holds before any write."""
    g = torch.Generator().manual_seed(seed)
    shape = {
        "NHD": (n_pages, page, HKV, D),
        "HND": (n_pages, HKV, page, D),
        None: (1, HKV, n_pages * page, D),
    }[layout]
    return torch.randn(*shape, generator=g) * 50, torch.randn(*shape, generator=g) * 50


def _check_books(alloc: PageAllocator) -> None:
    """Host bookkeeping and device tensors agree; every page is owned once or free."""
    owned = [p for r in range(alloc.batch) for p in alloc.pages(r)]
    assert len(set(owned)) == len(owned) and len(owned) + alloc.n_free == alloc.n_pages
    assert alloc.cache_len.tolist() == alloc.lengths
    for r in range(alloc.batch):
        pages = alloc.pages(r)
        assert len(pages) == -(-alloc.lengths[r] // alloc.page_size)  # nothing reserved ahead here
        assert alloc.block_table[r].tolist() == pages + [-1] * (alloc.max_pages_per_row - len(pages))
    assert alloc.block_table.dtype == torch.int32 and alloc.cache_len.dtype == torch.int32


class _Dense:
    """The same tokens in a dense cache ``[B, Hkv, capacity, D]`` per k and v."""

    def __init__(self, capacity: int) -> None:
        self.k, self.v = torch.zeros(B, HKV, capacity, D), torch.zeros(B, HKV, capacity, D)
        self.lengths = [0] * B

    def append(self, rows: list[int], k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        n = k_new.shape[2]
        for i, r in enumerate(rows):
            start = self.lengths[r]
            self.k[r, :, start : start + n], self.v[r, :, start : start + n] = k_new[i], v_new[i]
            self.lengths[r] += n

    def free(self, row: int) -> None:
        self.lengths[row] = 0

    def reference(self, rows: list[int], q: torch.Tensor) -> torch.Tensor:
        """Each row's queries (its last Lq tokens) against its keys, causal bottom-right."""
        out = []
        for i, r in enumerate(rows):
            n = self.lengths[r]
            ref = reference_attention(
                q[i : i + 1],
                self.k[r : r + 1, :, :n],
                self.v[r : r + 1, :, :n],
                mask=masks.Causal(align="bottom_right"),
                enable_gqa=True,
            )
            out.append(ref[0])
        return torch.stack(out)


def _generate(
    layout: str | None,
    page: int,
    backend: str,
    *,
    idle: bool = True,
    max_pages: int = MAX_PAGES,
    n_pages: int = 2 * MAX_PAGES + 4,  # garbage in the pages no row holds
) -> None:
    """Prefill three rows of different lengths, then decode one token per live row per step:
    row 1 is freed and restarted at step 3, row 0 freed at step 5 and restarted on the pages it
    gave back (taken in another order) at once, or with ``idle`` two steps later (the live rows
    decode alone meanwhile), and at step 9 every row appends three tokens (Lq = 3, dense route
    only)."""
    pools = _pools(layout, page, n_pages, seed=page)
    alloc = fz.pages.PageAllocator(n_pages, page, max_pages, batch=B, kv_layout=layout)
    dense = _Dense(max_pages * page)
    g = torch.Generator().manual_seed(page + 1)

    def prefill(row: int, n: int) -> None:
        k_new, v_new = torch.randn(2, 1, HKV, n, D, generator=g)
        alloc.append(*pools, k_new, v_new, rows=[row])
        dense.append([row], k_new, v_new)

    for row, n in enumerate((2 * page + 3, 1, page)):
        prefill(row, n)
    live = [0, 1, 2]
    first_pages: list[int] = []
    for step in range(12):
        if step == 3:
            alloc.free(1)
            dense.free(1)
            prefill(1, page + 2)
        if step == 5:
            first_pages = alloc.pages(0)
            alloc.free(0)
            dense.free(0)
            live = [1, 2]
        if step == (7 if idle else 5):
            prefill(0, 3 * page - 1)
            # The freed pages come back most recently freed first: the same pages, in another order.
            reused = alloc.pages(0)
            assert set(reused) & set(first_pages) and sorted(reused) != reused
            live = [0, 1, 2]
        lq = 3 if step == 9 and backend == "dense" else 1  # flex: one kernel (Lq = 1)
        k_new, v_new = torch.randn(2, len(live), HKV, lq, D, generator=g)
        lens = alloc.append(*pools, k_new, v_new, rows=live if len(live) < B else None)
        assert lens is alloc.cache_len
        dense.append(live, k_new, v_new)
        _check_books(alloc)
        assert alloc.lengths == [dense.lengths[r] for r in range(B)]
        q = torch.randn(len(live), H, lq, D, generator=g)
        with torch.no_grad():
            if len(live) == B:
                out = fz.decode.decode_step(
                    q, *pools, alloc.cache_len, block_table=alloc.block_table, kv_layout=layout,
                    block_size=page, backend=backend,
                )  # fmt: skip
            else:  # an idle row (length 0) cannot decode: the live rows alone
                idx = torch.tensor(live)
                out = fz.decode.decode_step(
                    q, *pools, alloc.cache_len[idx], block_table=alloc.block_table[idx],
                    kv_layout=layout, block_size=page, backend=backend,
                )  # fmt: skip
        # float32 over <= 60 unit-scale keys vs float64 (the pools' garbage must stay unseen).
        torch.testing.assert_close(out.double(), dense.reference(live, q), rtol=0, atol=2e-6)


@pytest.mark.parametrize("page", [16, 5])
@pytest.mark.parametrize("layout", ["NHD", "HND", None])
def test_generation_loop_matches_a_dense_cache(layout: str | None, page: int) -> None:
    _generate(layout, page, "dense")


def test_generation_loop_on_flex() -> None:
    """The same loop on the CPU flex route (physical pages mapped back through the table), with
    no idle rows (another batch size is another compile), in test_paged_kv's shapes (B, heads, D,
    page 16, 16 of 96 pages per row) so that the two files share a kernel."""
    _generate("NHD", 16, "auto", idle=False, max_pages=16, n_pages=96)


def test_layers_share_one_allocator() -> None:
    """extend once per step, then write and decode each layer's own pools."""
    page, n_pages = 5, 12
    layers = [_pools("HND", page, n_pages, seed=s) for s in range(2)]
    dense = [_Dense(MAX_PAGES * page) for _ in layers]
    alloc = fz.pages.PageAllocator(n_pages, page, MAX_PAGES, batch=B, kv_layout="HND")
    g = torch.Generator().manual_seed(0)
    for n in (7, 1, 1, 4):
        alloc.extend(n)
        for pools, ref in zip(layers, dense, strict=True):
            k_new, v_new = torch.randn(2, B, HKV, n, D, generator=g)
            alloc.write(*pools, k_new, v_new)
            ref.append(list(range(B)), k_new, v_new)
            q = torch.randn(B, H, n, D, generator=g)
            out = fz.decode.decode_step(
                q, *pools, alloc.cache_len, block_table=alloc.block_table, kv_layout="HND", backend="dense"
            )
            torch.testing.assert_close(out.double(), ref.reference(list(range(B)), q), rtol=0, atol=2e-6)
    _check_books(alloc)


def test_reserve_takes_pages_ahead_and_extend_uses_them() -> None:
    alloc = fz.pages.PageAllocator(10, 4, 5, batch=2)
    alloc.reserve(9, rows=1)  # 3 pages for a 9-token request
    assert alloc.pages(1) == [0, 1, 2] and alloc.n_free == 7 and alloc.lengths == [0, 0]
    assert alloc.block_table[1].tolist() == [0, 1, 2, -1, -1]
    alloc.extend(9, rows=1)
    assert alloc.pages(1) == [0, 1, 2] and alloc.cache_len.tolist() == [0, 9]
    alloc.reserve(0)  # nothing more
    alloc.extend(1, rows=[1, 0])
    assert alloc.pages(1) == [0, 1, 2] and alloc.pages(0) == [3] and alloc.lengths == [1, 10]
    alloc.free([0, 1])
    assert alloc._free[-4:] == [3, 0, 1, 2]  # next taken: 2, 1, 0, 3 (the last freed first)
    alloc.extend(13, rows=0)
    assert alloc.pages(0) == [2, 1, 0, 3]
    alloc.free(0)
    assert alloc.n_free == 10 and alloc.block_table.eq(-1).all() and alloc.lengths == [0, 0]
    assert alloc.pages(0) == [] and "10 pages free" in repr(alloc)


def _state(alloc: PageAllocator) -> tuple:  # type: ignore[type-arg]
    return (
        alloc.n_free,
        [alloc.pages(r) for r in range(alloc.batch)],
        alloc.lengths,
        alloc.block_table.clone(),
        alloc.cache_len.clone(),
    )


def _same(a: tuple, b: tuple) -> bool:  # type: ignore[type-arg]
    return a[:3] == b[:3] and torch.equal(a[3], b[3]) and torch.equal(a[4], b[4])


def test_running_out_of_pages_or_table_room_raises_and_changes_nothing() -> None:
    alloc = fz.pages.PageAllocator(4, 5, 3, batch=2, kv_layout="NHD")
    pools = _pools("NHD", 5, 4, seed=0)
    alloc.append(*pools, *torch.randn(2, 1, HKV, 12, D), rows=0)  # 3 pages of 4
    before = _state(alloc)
    with pytest.raises(
        ValueError, match=r"out of pages: n_tokens=7 for rows \[1\] needs 2 new pages, 1 of n_pages=4"
    ):
        alloc.extend(7, rows=1)
    # All or nothing: row 1 fits in the last page, row 0 needs a fourth (over the table's width).
    with pytest.raises(
        ValueError, match=r"row 0 would hold 16 tokens \(12 \+ n_tokens=4\), over max_pages_per_row=3"
    ):
        alloc.extend(4)
    with pytest.raises(ValueError, match="out of pages"):
        alloc.append(*pools, *torch.randn(2, 1, HKV, 6, D), rows=1)
    with pytest.raises(ValueError, match="out of pages"):
        alloc.reserve(6, rows=1)
    assert _same(_state(alloc), before)
    alloc.free(0)
    alloc.extend(15, rows=1)  # the freed pages serve the other row
    assert alloc.n_free == 1 and alloc.pages(1) == [2, 1, 0]


@pytest.mark.parametrize(
    ("rows", "exc", "match"),
    [
        (3, ValueError, r"rows: row 3 is outside 0 \.\. 2 \(batch=3\)"),
        ([0, -1], ValueError, r"row -1 is outside"),
        ([1, 1], ValueError, r"rows must be distinct, got \[1, 1\]"),
        (1.0, TypeError, r"rows must be a row index"),
        (True, TypeError, r"rows must be a row index"),
        ([0, False], TypeError, r"rows must be a row index"),
        ("0", TypeError, r"rows must be a row index"),
        (torch.tensor([0.0]), TypeError, r"rows must be a row index"),
    ],
)
def test_bad_rows_are_named(rows, exc: type[Exception], match: str) -> None:  # type: ignore[no-untyped-def]
    alloc = fz.pages.PageAllocator(8, 4, 4, batch=3)
    for call in (lambda: alloc.extend(1, rows), lambda: alloc.free(rows), lambda: alloc.reserve(1, rows)):
        with pytest.raises(exc, match=match):
            call()
    assert alloc.n_free == 8 and alloc.lengths == [0, 0, 0]


def test_rows_take_ints_of_any_kind() -> None:
    alloc = fz.pages.PageAllocator(8, 4, 4, batch=3)
    alloc.extend(1, torch.tensor([2, 0]))
    alloc.extend(1, range(1, 2))
    alloc.extend(1, torch.tensor(2))
    assert alloc.lengths == [1, 1, 2] and alloc.pages(2) == [0] and alloc.pages(torch.tensor(1)) == [2]
    with pytest.raises(TypeError, match=r"pages takes one row index"):
        alloc.pages([0, 1])  # type: ignore[arg-type]


def test_rows_take_numpy_arrays() -> None:
    """A numpy array of rows (``np.flatnonzero(done)``) is a sequence of rows: its ``__index__``,
    which refuses arrays of more than one element, made it a TypeError."""
    alloc = fz.pages.PageAllocator(8, 4, 4, batch=3)
    alloc.extend(2, np.array([2, 0]))
    alloc.extend(1, np.flatnonzero([False, True, True]))
    alloc.extend(np.int64(1), np.int64(0))  # counts from numpy too
    alloc.free(np.array([2]))
    assert alloc.lengths == [3, 1, 0]
    with pytest.raises(TypeError, match=r"rows must be a row index"):
        alloc.extend(1, np.array([0.0]))


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"n_pages": 0}, ValueError, r"n_pages must be > 0, got 0"),
        ({"page_size": 1.5}, TypeError, r"page_size must be an int, got float"),
        ({"max_pages_per_row": -2}, ValueError, r"max_pages_per_row must be > 0"),
        ({"batch": True}, TypeError, r"batch must be an int, got bool"),
        ({"kv_layout": "NDH"}, ValueError, r"kv_layout must be 'NHD', 'HND' or None; got 'NDH'"),
    ],
)
def test_bad_constructor_arguments_are_named(kwargs: dict, exc: type[Exception], match: str) -> None:  # type: ignore[type-arg]
    args = {"n_pages": 8, "page_size": 4, "max_pages_per_row": 4, "batch": 2, **kwargs}
    with pytest.raises(exc, match=match):
        fz.pages.PageAllocator(**args)


def test_bad_writes_are_named_and_an_append_that_fails_changes_nothing() -> None:
    alloc = fz.pages.PageAllocator(8, 4, 4, batch=2, kv_layout="NHD")
    pools = _pools("NHD", 4, 8, seed=1)
    k_new, v_new = torch.randn(2, 2, HKV, 3, D)
    with pytest.raises(ValueError, match=r"n_tokens must be >= 0, got -1"):
        alloc.extend(-1)
    with pytest.raises(ValueError, match=r"last extend of row 0 counted 0: call extend"):
        alloc.write(*pools, k_new, v_new)
    alloc.extend(2)
    with pytest.raises(ValueError, match=r"holds n=3 tokens per row but the last extend of row 0 counted 2"):
        alloc.write(*pools, k_new, v_new)
    with pytest.raises(ValueError, match=r"k_new must hold one row per entry of rows \(1\), got 2"):
        alloc.write(*pools, k_new[:, :, :2], v_new[:, :, :2], rows=0)
    small = _pools("NHD", 4, 6, seed=2)
    with pytest.raises(ValueError, match=r"k_pool holds 6 pages, fewer than the allocator's n_pages=8"):
        alloc.write(*small, k_new[:, :, :2], v_new[:, :, :2])
    before = _state(alloc)
    with pytest.raises(TypeError, match=r"append_kv k_new must have k_pool's dtype"):
        alloc.append(*pools, k_new.double(), v_new.double())
    with pytest.raises(ValueError, match=r"append_kv block_size=4 differs from the pools' page size 5"):
        alloc.append(*_pools("NHD", 5, 8, seed=3), k_new, v_new)
    with pytest.raises(ValueError, match=r"k_new must be \[len\(rows\), Hkv, n, D\]"):
        alloc.append(*pools, k_new[0], v_new[0])
    assert _same(_state(alloc), before)
