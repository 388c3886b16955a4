"""PageAllocator.fork: prefix sharing with reference-counted pages and copy-on-write.

Rows forked from one prompt share its pages; each row then appends its own tokens. Checked per
``kv_layout``: every row's keys and values read back through its pages equal a dense per-row cache
of the same tokens (``torch.equal``), ``decode_step`` through ``alloc.block_table`` matches the
float64 reference over that cache, full shared pages are never copied (pages counted), a partly
filled shared page is copied once per row that writes into it, pages go back to the free list
exactly once (when their last row is freed, not before), and a step that runs out of pages for
its copies changes nothing.
"""

from __future__ import annotations

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo.models.decode import append_kv
from flexattn_zoo.models.pages import PageAllocator
from flexattn_zoo.testing import reference_attention

H, HKV, D = 4, 2, 8
LAYOUTS = ["NHD", "HND", None]


def _pools(layout: str | None, page: int, n_pages: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Pools full of garbage, as a serving stack's pool holds before any write."""
    g = torch.Generator().manual_seed(seed)
    shape = {
        "NHD": (n_pages, page, HKV, D),
        "HND": (n_pages, HKV, page, D),
        None: (1, HKV, n_pages * page, D),
    }
    return torch.randn(*shape[layout], generator=g) * 50, torch.randn(*shape[layout], generator=g) * 50


def _read(alloc: PageAllocator, pool: torch.Tensor, row: int) -> torch.Tensor:
    """Row ``row``'s tokens read through its pages in logical order, ``[Hkv, length, D]``."""
    pages, n, page = alloc.pages(row), alloc.lengths[row], alloc.page_size
    if alloc.kv_layout == "NHD":
        return pool[pages].flatten(0, 1)[:n].transpose(0, 1)
    if alloc.kv_layout == "HND":
        return pool[pages].transpose(0, 1).flatten(1, 2)[:, :n]
    return pool[0].unflatten(1, (-1, page))[:, pages].flatten(1, 2)[:, :n]


def _check_books(alloc: PageAllocator) -> None:
    """Every page is free exactly once or held; the free list and the rows account for all pages."""
    held = {p for r in range(alloc.batch) for p in alloc.pages(r)}
    pinned = {pending[0] for pending in alloc._pending if pending is not None}
    free = alloc._free
    assert len(set(free)) == len(free) and not set(free) & (held | pinned)
    assert len(free) + len(held | pinned) == alloc.n_pages == alloc.n_free + len(held | pinned)
    for p in range(alloc.n_pages):
        assert alloc._refs[p] == sum(alloc.pages(r).count(p) for r in range(alloc.batch))
    assert alloc.cache_len.tolist() == alloc.lengths
    for r in range(alloc.batch):
        pages = alloc.pages(r)
        assert alloc.block_table[r].tolist() == pages + [-1] * (alloc.max_pages_per_row - len(pages))


class _Dense:
    """Each row's tokens in a Python list of ``[Hkv, n, D]`` chunks."""

    def __init__(self, batch: int) -> None:
        self.k: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        self.v: list[list[torch.Tensor]] = [[] for _ in range(batch)]

    def append(self, rows: list[int], k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        for i, r in enumerate(rows):
            self.k[r].append(k_new[i])
            self.v[r].append(v_new[i])

    def fork(self, src: int, dsts: list[int]) -> None:
        for d in dsts:
            self.k[d], self.v[d] = list(self.k[src]), list(self.v[src])

    def free(self, row: int) -> None:
        self.k[row], self.v[row] = [], []

    def keys(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.k[row], 1), torch.cat(self.v[row], 1)


def _check_rows(
    alloc: PageAllocator, pools: tuple[torch.Tensor, torch.Tensor], dense: _Dense, rows: list[int]
) -> None:
    """Every row's tokens through its pages are the dense cache's, and decode_step through the
    block table matches the reference over them."""
    for r in rows:
        k, v = dense.keys(r)
        assert torch.equal(_read(alloc, pools[0], r), k) and torch.equal(_read(alloc, pools[1], r), v)
    q = torch.randn(len(rows), H, 1, D)
    idx = torch.tensor(rows)
    with torch.no_grad():
        out = fz.decode.decode_step(
            q, *pools, alloc.cache_len[idx], block_table=alloc.block_table[idx], kv_layout=alloc.kv_layout,
            block_size=alloc.page_size, backend="dense",
        )  # fmt: skip
    for i, r in enumerate(rows):
        k, v = dense.keys(r)
        ref = reference_attention(
            q[i : i + 1], k[None], v[None], mask=masks.Causal(align="bottom_right"), enable_gqa=True
        )
        torch.testing.assert_close(out[i : i + 1].double(), ref, rtol=0, atol=2e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forked_rows_share_the_prompt_and_grow_apart(layout: str | None) -> None:
    """A prompt of two full pages and a partial one, forked into three more rows: the forks
    share its pages; each row's first token copies the partial page (but the last holder's),
    never the full ones; then the rows decode their own tokens, crossing pages."""
    page, n_pages, batch = 4, 24, 4
    pools = _pools(layout, page, n_pages)
    alloc = PageAllocator(n_pages, page, 6, batch=batch, kv_layout=layout)
    dense = _Dense(batch)
    prompt = torch.randn(2, 1, HKV, 2 * page + 2, D)
    alloc.append(*pools, *prompt, rows=0)
    dense.append([0], *prompt)
    alloc.fork(0, [1, 2, 3])
    dense.fork(0, [1, 2, 3])
    shared = alloc.pages(0)
    assert [alloc.pages(r) for r in range(batch)] == [shared] * batch and len(shared) == 3
    assert alloc.lengths == [2 * page + 2] * batch and alloc.n_free == n_pages - 3
    _check_books(alloc)
    _check_rows(alloc, pools, dense, [0, 1, 2, 3])

    rows = [0, 1, 2, 3]
    k_new, v_new = torch.randn(2, batch, HKV, 1, D)  # a different token per row
    alloc.append(*pools, k_new, v_new)
    dense.append(rows, k_new, v_new)
    # Three private copies of the partial page (row 3, its last holder, writes in it in place);
    # the two full pages are not copied.
    assert alloc.n_free == n_pages - 3 - 3
    assert all(alloc.pages(r)[:2] == shared[:2] for r in rows)
    last = [alloc.pages(r)[2] for r in rows]
    assert len(set(last)) == batch and last[3] == shared[2]
    _check_books(alloc)
    _check_rows(alloc, pools, dense, rows)

    for step in range(6):  # the rows cross into pages of their own
        live = rows if step != 2 else [1, 3]
        n = 3 if step == 4 else 1
        k_new, v_new = torch.randn(2, len(live), HKV, n, D)
        alloc.append(*pools, k_new, v_new, rows=live)
        dense.append(live, k_new, v_new)
        _check_books(alloc)
        _check_rows(alloc, pools, dense, rows)
    assert all(alloc.pages(r)[:2] == shared[:2] for r in rows)
    assert alloc._refs[shared[0]] == alloc._refs[shared[1]] == batch


@pytest.mark.parametrize("layout", LAYOUTS)
def test_partial_last_page_is_copied_and_the_prefix_page_stays_shared(layout: str | None) -> None:
    page, n_pages = 4, 8
    pools = _pools(layout, page, n_pages)
    alloc = PageAllocator(n_pages, page, 4, batch=2, kv_layout=layout)
    dense = _Dense(2)
    prompt = torch.randn(2, 1, HKV, page + 2, D)
    alloc.append(*pools, *prompt, rows=0)
    dense.append([0], *prompt)
    alloc.fork(0, 1)
    dense.fork(0, [1])
    assert alloc.pages(1) == alloc.pages(0) == [0, 1] and alloc.n_free == 6
    k_new, v_new = torch.randn(2, 2, HKV, 1, D)
    alloc.append(*pools, k_new, v_new)
    dense.append([0, 1], k_new, v_new)
    # Row 0 gets a copy of page 1 (the next free page, 2); row 1, the last holder, keeps page 1.
    assert alloc.pages(0) == [0, 2] and alloc.pages(1) == [0, 1] and alloc.n_free == 5
    assert alloc.block_table[:, :2].tolist() == [[0, 2], [0, 1]]
    _check_books(alloc)
    _check_rows(alloc, pools, dense, [0, 1])


def test_full_shared_pages_are_never_copied() -> None:
    page, n_pages = 4, 8
    pools = _pools("NHD", page, n_pages)
    alloc = PageAllocator(n_pages, page, 4, batch=2, kv_layout="NHD")
    dense = _Dense(2)
    prompt = torch.randn(2, 1, HKV, 2 * page, D)
    alloc.append(*pools, *prompt, rows=0)
    dense.append([0], *prompt)
    alloc.reserve(2 * page, rows=0)  # reserved pages are the source's alone
    assert alloc.pages(0) == [0, 1, 2, 3]
    alloc.fork(0, 1)
    dense.fork(0, [1])
    assert alloc.pages(1) == [0, 1] and alloc.n_free == 4
    k_new, v_new = torch.randn(2, 2, HKV, 1, D)
    alloc.append(*pools, k_new, v_new)
    dense.append([0, 1], k_new, v_new)
    # One new page, for row 1's third logical page; row 0 writes in the page it reserved.
    assert alloc.pages(0) == [0, 1, 2, 3] and alloc.pages(1) == [0, 1, 4] and alloc.n_free == 3
    _check_books(alloc)
    _check_rows(alloc, pools, dense, [0, 1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_freeing_the_source_first_keeps_the_forks_pages(layout: str | None) -> None:
    """The source is freed and its row restarts a new prompt at once: the pages the forks still
    hold are not reused (a free without reference counts would hand them out and the new prompt
    would overwrite the forks' tokens); each page goes back exactly once."""
    page, n_pages = 4, 12
    pools = _pools(layout, page, n_pages)
    alloc = PageAllocator(n_pages, page, 4, batch=3, kv_layout=layout)
    dense = _Dense(3)
    prompt = torch.randn(2, 1, HKV, 2 * page + 1, D)
    alloc.append(*pools, *prompt, rows=0)
    dense.append([0], *prompt)
    alloc.fork(0, [1, 2])
    dense.fork(0, [1, 2])
    k_new, v_new = torch.randn(2, 3, HKV, 4, D)
    alloc.append(*pools, k_new, v_new)
    dense.append([0, 1, 2], k_new, v_new)
    held = {p for r in range(3) for p in alloc.pages(r)}
    own = set(alloc.pages(0)) - set(alloc.pages(1)) - set(alloc.pages(2))
    free_before = alloc.n_free
    alloc.free(0)
    dense.free(0)
    assert alloc.n_free == free_before + len(own) and set(alloc._free[-len(own) :]) == own
    _check_books(alloc)
    new_prompt = torch.randn(2, 1, HKV, 2 * page + 3, D)
    alloc.append(*pools, *new_prompt, rows=0)
    dense.append([0], *new_prompt)
    _check_books(alloc)
    _check_rows(alloc, pools, dense, [0, 1, 2])
    alloc.free([0, 1])
    dense.free(0)
    _check_books(alloc)
    _check_rows(alloc, pools, dense, [2])
    alloc.free(2)
    assert alloc.n_free == n_pages and sorted(alloc._free) == list(range(n_pages))
    assert held <= set(alloc._free) and alloc.block_table.eq(-1).all() and alloc.lengths == [0, 0, 0]
    assert alloc._refs == [0] * n_pages and alloc._pins == [0] * n_pages


def test_fork_into_a_row_that_holds_pages_raises_and_changes_nothing() -> None:
    alloc = PageAllocator(8, 4, 4, batch=4)
    alloc.extend(5, rows=0)
    alloc.extend(1, rows=1)
    alloc.reserve(3, rows=2)  # pages but no tokens
    before = (alloc.n_free, [alloc.pages(r) for r in range(4)], alloc.lengths, alloc.block_table.clone())
    with pytest.raises(
        ValueError, match=r"fork: destination row 1 holds 1 pages \(length 1\): free it first"
    ):
        alloc.fork(0, [3, 1])
    with pytest.raises(ValueError, match=r"fork: destination row 2 holds 1 pages \(length 0\)"):
        alloc.fork(0, 2)
    with pytest.raises(ValueError, match=r"fork: row 0 is both the source and a destination"):
        alloc.fork(0, [3, 0])
    with pytest.raises(ValueError, match=r"rows must be distinct"):
        alloc.fork(0, [3, 3])
    with pytest.raises(ValueError, match=r"row 4 is outside"):
        alloc.fork(0, 4)
    with pytest.raises(TypeError, match=r"fork src_row must be one row index"):
        alloc.fork([0, 1], 3)  # type: ignore[arg-type]
    after = (alloc.n_free, [alloc.pages(r) for r in range(4)], alloc.lengths, alloc.block_table.clone())
    assert before[:3] == after[:3] and torch.equal(before[3], after[3])
    alloc.free(1)
    alloc.fork(0, 1)  # a freed row can be forked into
    assert alloc.pages(1) == alloc.pages(0) and alloc.lengths[1] == 5


def _state(alloc: PageAllocator) -> tuple:  # type: ignore[type-arg]
    return (
        list(alloc._free),
        [alloc.pages(r) for r in range(alloc.batch)],
        alloc.lengths,
        list(alloc._refs),
        list(alloc._pins),
        list(alloc._pending),
        list(alloc._fresh),
        alloc.block_table.tolist(),
        alloc.cache_len.tolist(),
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_out_of_pages_for_a_copy_or_a_failed_append_changes_nothing(layout: str | None) -> None:
    page, n_pages = 4, 5
    pools = _pools(layout, page, n_pages)
    alloc = PageAllocator(n_pages, page, 4, batch=3, kv_layout=layout)
    dense = _Dense(3)
    prompt = torch.randn(2, 1, HKV, page + 2, D)
    alloc.append(*pools, *prompt, rows=0)
    dense.append([0], *prompt)
    alloc.fork(0, 1)
    dense.fork(0, [1])
    other = torch.randn(2, 1, HKV, 3 * page, D)
    alloc.append(*pools, *other, rows=2)  # every page taken
    dense.append([2], *other)
    assert alloc.n_free == 0
    before, k_before = _state(alloc), pools[0].clone()
    k_new, v_new = torch.randn(2, 2, HKV, 1, D)
    # Row 0's token needs a private copy of the shared page; row 1, the last holder, does not.
    with pytest.raises(
        ValueError, match=r"out of pages: n_tokens=1 for rows \[0, 1\] needs 1 new pages \(1 of"
    ):
        alloc.extend(1, rows=[0, 1])
    with pytest.raises(ValueError, match=r"out of pages"):
        alloc.append(*pools, k_new, v_new, rows=[0, 1])
    with pytest.raises(ValueError, match=r"for rows \[1\] needs 1 new pages \(1 of them private copies"):
        alloc.append(*pools, k_new[1:], v_new[1:], rows=1)  # alone, row 1 must copy too
    assert _state(alloc) == before and torch.equal(pools[0], k_before)
    _check_rows(alloc, pools, dense, [0, 1, 2])

    alloc.free(2)  # pages for the copy
    dense.free(2)
    alloc.append(*pools, k_new, v_new, rows=[0, 1])
    dense.append([0, 1], k_new, v_new)
    assert alloc.pages(0)[0] == alloc.pages(1)[0] and alloc.pages(0)[1] != alloc.pages(1)[1]
    _check_books(alloc)
    _check_rows(alloc, pools, dense, [0, 1])


def test_a_failed_write_undoes_the_copy_on_write() -> None:
    page, n_pages = 4, 8
    pools = _pools("HND", page, n_pages)
    alloc = PageAllocator(n_pages, page, 4, batch=3, kv_layout="HND")
    dense = _Dense(3)
    prompt = torch.randn(2, 1, HKV, page + 2, D)
    alloc.append(*pools, *prompt, rows=0)
    dense.append([0], *prompt)
    alloc.fork(0, [1, 2])
    dense.fork(0, [1, 2])
    k_new, v_new = torch.randn(2, 3, HKV, 1, D)
    alloc.append(*pools, k_new[:1], v_new[:1], rows=0)  # row 0 copies page 1: a pending copy
    dense.append([0], k_new[:1], v_new[:1])
    alloc.free(2)  # the next extend of row 0 releases its pending copy (page 1 is still row 1's)
    dense.free(2)
    before = _state(alloc)
    for rows in ([1, 0], [0]):
        with pytest.raises(TypeError, match=r"append_kv k_new must have k_pool's dtype"):
            alloc.append(*pools, k_new[: len(rows)].double(), v_new[: len(rows)].double(), rows=rows)
        assert _state(alloc) == before
    # Row 1 alone holds page 1 now: it writes there in place. Then row 2 forks from row 1 again.
    alloc.append(*pools, k_new[1:2], v_new[1:2], rows=1)
    dense.append([1], k_new[1:2], v_new[1:2])
    alloc.fork(1, 2)
    dense.fork(1, [2])
    before = _state(alloc)
    with pytest.raises(TypeError, match=r"append_kv k_new must have k_pool's dtype"):
        alloc.append(*pools, k_new[:2].double(), v_new[:2].double(), rows=[2, 1])
    assert _state(alloc) == before
    alloc.append(*pools, k_new[:2], v_new[:2], rows=[2, 1])
    dense.append([2, 1], k_new[:2], v_new[:2])
    _check_books(alloc)
    _check_rows(alloc, pools, dense, [0, 1, 2])


def test_layers_copy_their_own_pools_and_the_shared_page_waits_for_them() -> None:
    """extend once, then write per layer: each layer's pools get the copy. Between the layers the
    row that shared the page is freed and a new prompt takes pages: the old page is not among
    them (it is kept until row 0's copies are done, its next extend)."""
    page, n_pages = 4, 8
    layers = [_pools(None, page, n_pages, seed=s) for s in range(2)]
    dense = [_Dense(3) for _ in layers]
    alloc = PageAllocator(n_pages, page, 4, batch=3, kv_layout=None)
    alloc.extend(page + 1, rows=0)
    for pools, ref in zip(layers, dense, strict=True):
        prompt = torch.randn(2, 1, HKV, page + 1, D)
        alloc.write(*pools, *prompt, rows=0)
        ref.append([0], *prompt)
    alloc.fork(0, 1)
    for ref in dense:
        ref.fork(0, [1])
    alloc.extend(2, rows=[0, 1])  # row 0 copies page 1 into page 2; row 1 keeps page 1
    assert alloc.pages(0) == [0, 2] and alloc.pages(1) == [0, 1]
    alloc.free(1)
    alloc.extend(3 * page, rows=2)
    assert 1 not in alloc.pages(2) and alloc.n_free == 2
    for i, (pools, ref) in enumerate(zip(layers, dense, strict=True)):
        ref.free(1)
        k0, v0 = torch.randn(2, 1, HKV, 2, D)
        k2, v2 = torch.randn(2, 1, HKV, 3 * page, D)
        order = [(0, k0, v0), (2, k2, v2)] if i == 0 else [(2, k2, v2), (0, k0, v0)]
        for r, k, v in order:
            alloc.write(*pools, k, v, rows=r)
            ref.append([r], k, v)
        _check_rows(alloc, pools, ref, [0, 2])
    # Failed steps of row 0 (whose pending copy is all that keeps page 1) change nothing.
    before = _state(alloc)
    with pytest.raises(ValueError, match=r"row 0 would hold 19 tokens"):
        alloc.extend(3 * page, rows=0)
    with pytest.raises(TypeError, match=r"append_kv k_new must have k_pool's dtype"):
        alloc.append(*layers[0], *torch.randn(2, 1, HKV, 2, D, dtype=torch.float64), rows=0)
    assert _state(alloc) == before and 1 not in alloc._free and alloc._pins[1] == 1
    alloc.extend(2, rows=0)  # row 0's copies are done: page 1 goes back, and serves this step
    assert alloc.pages(0) == [0, 2, 1] and alloc.n_free == 2
    alloc.free([0, 2])
    assert sorted(alloc._free) == list(range(n_pages))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_copy_pending_serves_a_caller_that_writes_tokens_itself(layout: str | None) -> None:
    page, n_pages = 4, 8
    pools = _pools(layout, page, n_pages)
    alloc = PageAllocator(n_pages, page, 4, batch=2, kv_layout=layout)
    dense = _Dense(2)
    prompt = torch.randn(2, 1, HKV, page + 3, D)
    alloc.append(*pools, *prompt, rows=0)
    dense.append([0], *prompt)
    alloc.fork(0, 1)
    dense.fork(0, [1])
    k_new, v_new = torch.randn(2, 2, HKV, 1, D)
    alloc.extend(1)
    append_kv(*pools, alloc.block_table, alloc.cache_len - 1, k_new, v_new, kv_layout=layout, block_size=page)
    dense.append([0, 1], k_new, v_new)
    alloc.copy_pending(*pools)
    alloc.copy_pending(*pools, rows=[1, 0])  # twice: harmless
    _check_rows(alloc, pools, dense, [0, 1])
    with pytest.raises(ValueError, match=r"k_pool must be a pool of at least n_pages=8 pages"):
        alloc.copy_pending(pools[0][:4] if layout else pools[0][:, :, : 4 * page], pools[1])
