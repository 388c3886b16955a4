"""Paged KV pools: their layouts, a pool seen as one key sequence per head (:func:`pool_view`),
writes through a block table (:func:`append_kv`), and ``decode_step``'s page checks and gathers.

``block_table[b, p]`` is the physical page of row ``b``'s logical page ``p`` (-1: none). Pools are
``"NHD"`` ``[n_pages, page_size, Hkv, D]`` or ``"HND"`` ``[n_pages, Hkv, page_size, D]`` (the
serving stacks' layouts, :data:`KV_LAYOUTS`), or with no layout decode's own ``[1, Hkv, n_pages *
block_size, D]``. Page numbers are checked only in tables on the host (a CUDA one would cost a
sync); on the device they are clamped or sent out of range instead.
"""

from __future__ import annotations

from numbers import Integral
from typing import Any, overload

import torch

from flexattn_zoo.models.decode.mask import DEFAULT_BLOCK_SIZE
from flexattn_zoo.validation import check_strided

#: Page layouts ``decode_step(kv_layout=...)`` and :func:`append_kv` take: the serving stacks'
#: KV pools (vLLM, FlashInfer, FlashAttention), one per k and v.
KV_LAYOUTS = ("NHD", "HND")
KV_LAYOUT_SHAPES = {"NHD": "[n_pages, page_size, Hkv, D]", "HND": "[n_pages, Hkv, page_size, D]"}


def _check_block_table(block_table: Any, batch: int) -> None:
    if (
        not isinstance(block_table, torch.Tensor)
        or block_table.dtype == torch.bool
        or (block_table.is_floating_point() or block_table.is_complex())
    ):
        what = (
            f"a {block_table.dtype} tensor"
            if isinstance(block_table, torch.Tensor)
            else type(block_table).__name__
        )
        raise TypeError(f"block_table must be an integer tensor [B, max_pages], got {what}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must be [B={batch}, max_pages], got {tuple(block_table.shape)}")


def _check_pages(block_table: torch.Tensor, n_pages: int, block_size: int) -> None:
    """Page numbers in ``-1 .. n_pages - 1``, only for a CPU table (reading a CUDA one would
    sync with the device every step; there the gathered page numbers are clamped instead).
    -1 entries may sit anywhere, also below a row's length: those keys are invisible (a
    sliding-window cache may free the pages its window left)."""
    if block_table.device.type != "cpu" or block_table.numel() == 0:
        return
    lo, hi = int(block_table.min()), int(block_table.max())
    if lo < -1 or hi >= n_pages:
        bad = lo if lo < -1 else hi
        raise ValueError(
            f"block_table holds page {bad}, outside the pool: valid pages are 0 .. {n_pages - 1} "
            f"(k_cache holds {n_pages} pages of {block_size} tokens), or -1 for none"
        )


def _gather_pages(pool: torch.Tensor, block_table: torch.Tensor, pages: int, bs: int) -> torch.Tensor:
    """The first ``pages`` logical pages of every row, as a contiguous ``[B, H, pages * bs, D]``;
    ``pool`` ``[1 (or B, broadcast), H, n_pages * bs, D]``, any strides (a kv_layout view)."""
    _, h, _, d = pool.shape
    paged = pool[0].unflatten(1, (-1, bs))  # [H, n_pages, bs, D], a view whatever the strides
    idx = block_table[:, :pages].clamp(min=0).to(pool.device, torch.int64)
    return paged[:, idx].permute(1, 0, 2, 3, 4).reshape(idx.shape[0], h, pages * bs, d)


def _layout_views(
    k_pool: Any, v_pool: Any, kv_layout: str, block_size: int | None
) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """``kv_layout`` pools as ``decode_step``'s own paged layout: ``(k_view, v_view, page_size,
    slot_stride, n_pages)``, the views ``[1, Hkv, n_slots * page_size, D]`` (see
    :func:`pool_view`)."""
    for name, t in (("k_cache", k_pool), ("v_cache", v_pool)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"decode_step {name} must be a torch.Tensor, got {type(t).__name__}")
        check_strided(f"decode_step {name}", t)
        if t.dim() != 4 or 0 in t.shape[:3]:
            raise ValueError(
                f"decode_step {name} with kv_layout={kv_layout!r} must be a pool {KV_LAYOUT_SHAPES[kv_layout]} "
                f"(no empty dims), got shape {tuple(t.shape)}"
            )
    if k_pool.shape[:3] != v_pool.shape[:3]:
        raise ValueError(
            f"k_cache and v_cache must agree in pages, page size and heads (dims 0-2), got "
            f"{tuple(k_pool.shape)} and {tuple(v_pool.shape)}"
        )
    page = k_pool.shape[1] if kv_layout == "NHD" else k_pool.shape[2]
    if block_size is not None and block_size != page:
        raise ValueError(
            f"decode_step block_size={block_size!r} differs from the pools' page size {page} "
            f"(kv_layout={kv_layout!r} pools {KV_LAYOUT_SHAPES[kv_layout]}): leave block_size out"
        )
    k_view, slots = _pool_view(k_pool, kv_layout)
    v_view, v_slots = _pool_view(v_pool, kv_layout)
    if v_slots != slots:  # one table for both: copied contiguous, their pages sit alike
        k_view, slots = _pool_view(k_pool.contiguous(), kv_layout)
        v_view, _ = _pool_view(v_pool.contiguous(), kv_layout)
    return k_view, v_view, page, slots, k_pool.shape[0]


def pool_view(pool: torch.Tensor, kv_layout: str) -> tuple[torch.Tensor, int]:
    """A ``kv_layout`` page pool seen as one key sequence per head, without a copy.

    ``pool``: ``[n_pages, page_size, Hkv, D]`` (``"NHD"``) or ``[n_pages, Hkv, page_size, D]``
    (``"HND"``). Returns ``(view, slot_stride)``: ``view`` ``[1, Hkv, L, D]`` (batch stride 0)
    in which token ``o`` of page ``p`` is key ``(p * slot_stride) * page_size + o`` of every
    head, ``L = ((n_pages - 1) * slot_stride + 1) * page_size``. The key stride is the pool's
    token stride, so pages are ``slot_stride`` page slots apart: 1 for a contiguous NHD pool
    (the view is the pool itself, heads interleaved), ``Hkv`` for a contiguous HND pool (the
    slots between hold the other heads' keys of the page: the view's rows overlap in memory, and
    decode_step never lists those slots). A pool whose strides fit neither (last dim not
    contiguous, page stride not a whole number of pages of its token stride) is copied
    contiguous first.
    """
    if kv_layout not in KV_LAYOUTS:  # any other string was read as "HND"
        raise ValueError(
            f"pool_view kv_layout must be {' or '.join(map(repr, KV_LAYOUTS))}; got {kv_layout!r}"
        )
    if not isinstance(pool, torch.Tensor):
        raise TypeError(f"pool_view pool must be a torch.Tensor, got {type(pool).__name__}")
    check_strided("pool_view pool", pool)
    if pool.dim() != 4 or 0 in pool.shape:
        raise ValueError(
            f"pool_view pool must be {KV_LAYOUT_SHAPES[kv_layout]} (no empty dims), got shape {tuple(pool.shape)}"
        )
    return _pool_view(pool, kv_layout)


def _pool_view(pool: torch.Tensor, kv_layout: str) -> tuple[torch.Tensor, int]:
    """:func:`pool_view` of a pool already checked (decode_step's path checks it once per step)."""
    n_pages, a, b, d = pool.shape
    page, heads = (a, b) if kv_layout == "NHD" else (b, a)
    tok_dim, head_dim = (1, 2) if kv_layout == "NHD" else (2, 1)
    s_page, s_tok, s_head = pool.stride(0), pool.stride(tok_dim), pool.stride(head_dim)
    if page == 1:
        s_tok = s_page  # one token per page: its stride is free, pages are then adjacent keys
    if not (pool.stride(3) == 1 or d == 1) or s_tok <= 0 or s_page % s_tok or (s_page // s_tok) % page:
        return _pool_view(pool.contiguous(), kv_layout)
    slot_stride = s_page // s_tok // page
    length = ((n_pages - 1) * slot_stride + 1) * page
    view = pool.as_strided((1, heads, length, d), (0, s_head, s_tok, 1), pool.storage_offset())
    return view, slot_stride


@overload
def append_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: int,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    *,
    kv_layout: str | None = ...,
    block_size: int | None = ...,
) -> int: ...
@overload
def append_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    *,
    kv_layout: str | None = ...,
    block_size: int | None = ...,
) -> torch.Tensor: ...


def append_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: int | torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    *,
    kv_layout: str | None = None,
    block_size: int | None = None,
) -> int | torch.Tensor:
    """Write ``n`` new tokens per row into paged KV pools through a block table, in place.

    Row ``b``'s new token ``i`` goes to logical position ``seq_lens[b] + i``: logical page
    ``(seq_lens[b] + i) // page_size``, physical page ``block_table[b, that page]``, slot
    ``(seq_lens[b] + i) % page_size`` in it. Then ``decode_step(q, k_pool, v_pool, <the returned
    lengths>, block_table=block_table, kv_layout=kv_layout)`` attends the new queries to them.

    Args:
        k_pool, v_pool: the pools, written in place: with ``kv_layout`` ``"NHD"``
            ``[n_pages, page_size, Hkv, D]``, ``"HND"`` ``[n_pages, Hkv, page_size, D]``; with
            None decode_step's own ``[1, Hkv, n_pages * block_size, D]``.
        block_table: ``[B, max_pages]`` integer tensor, the physical page of each logical page;
            every page written to must be in the pool (-1 elsewhere is fine).
        seq_lens: the tokens each row holds before this write, an int or an integer tensor
            ``[B]``; not modified.
        k_new, v_new: ``[B, Hkv, n, D]`` (the library's head-first layout), the pools' dtype and
            device.
        kv_layout: ``"NHD"``, ``"HND"`` or None, as for :func:`decode_step`.
        block_size: the page size of a ``kv_layout=None`` pool (default 128); with a
            ``kv_layout`` the pools' page size, which it must equal if given.

    Returns:
        ``seq_lens + n``: the new lengths (an int for an int, else a new tensor).

    Raises:
        TypeError / ValueError naming the argument: wrong types, shapes, dtypes or devices,
        an unknown ``kv_layout``; and, when ``block_table`` and ``seq_lens`` are CPU tensors or
        ints, a write past the table's width or into a page outside the pool (-1 included). On
        CUDA those values are not read (that would sync with the device): an invalid page is sent
        out of the pool's range, so the write fails with a device-side index error instead of
        landing in another row's page.
    """
    if kv_layout is not None and kv_layout not in KV_LAYOUTS:
        raise ValueError(
            f"append_kv kv_layout must be None, {' or '.join(map(repr, KV_LAYOUTS))}; got {kv_layout!r}"
        )
    shape = KV_LAYOUT_SHAPES.get(kv_layout or "", "[1, Hkv, n_pages * block_size, D]")
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool), ("k_new", k_new), ("v_new", v_new)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"append_kv {name} must be a torch.Tensor, got {type(t).__name__}")
        check_strided(f"append_kv {name}", t)
        if t.dim() != 4:
            want = shape if name.endswith("pool") else "[B, Hkv, n, D]"
            raise ValueError(f"append_kv {name} must have 4 dims {want}, got shape {tuple(t.shape)}")
    if kv_layout is None:
        page = DEFAULT_BLOCK_SIZE if block_size is None else block_size
        if isinstance(page, bool) or not isinstance(page, int) or page <= 0:
            raise ValueError(f"append_kv block_size must be a positive int, got {page!r}")
        if k_pool.shape[0] != 1 or k_pool.shape[2] % page:
            raise ValueError(
                f"append_kv pools without kv_layout are {shape} with block_size={page}; got {tuple(k_pool.shape)}"
            )
        n_pages, heads = k_pool.shape[2] // page, k_pool.shape[1]
    else:
        n_pages, a, b_, _ = k_pool.shape
        page, heads = (a, b_) if kv_layout == "NHD" else (b_, a)
        if block_size is not None and block_size != page:
            raise ValueError(
                f"append_kv block_size={block_size!r} differs from the pools' page size {page} ({shape})"
            )
    batch, new_heads, n, _ = k_new.shape
    for name, pool, new in (("k", k_pool, k_new), ("v", v_pool, v_new)):
        if pool.shape[:3] != k_pool.shape[:3]:
            raise ValueError(
                f"append_kv k_pool and v_pool must agree in dims 0-2, got {tuple(k_pool.shape)} and {tuple(pool.shape)}"
            )
        if new.shape[:3] != (batch, heads, n) or new.shape[3] != pool.shape[3]:
            # Hkv and D come from the pools as kv_layout reads them: a pool of the other layout
            # shows up here as a wrong head count, so the message says where Hkv came from.
            read = f"pools read as kv_layout={kv_layout!r} {shape}" if kv_layout else f"pools {shape}"
            raise ValueError(
                f"append_kv {name}_new must be [B, Hkv={heads}, n, D={pool.shape[3]}] with k_new's B and n "
                f"(Hkv and D from the {read}), got {tuple(new.shape)}"
            )
        if new.dtype != pool.dtype or new.device != pool.device:
            raise TypeError(
                f"append_kv {name}_new must have {name}_pool's dtype and device ({pool.dtype}, {pool.device}), "
                f"got {new.dtype} on {new.device}"
            )
    _check_block_table(block_table, batch)
    max_pages = block_table.shape[1]
    if isinstance(seq_lens, Integral) and not isinstance(seq_lens, bool):  # numpy's integers too
        seq_lens = int(seq_lens)
        start: torch.Tensor = torch.full((batch,), seq_lens, dtype=torch.int64, device="cpu")
    elif isinstance(seq_lens, torch.Tensor) and not (
        seq_lens.dtype == torch.bool or seq_lens.is_floating_point() or seq_lens.is_complex()
    ):
        start = seq_lens.reshape(-1).to(torch.int64)
        if start.numel() != batch:
            raise ValueError(
                f"append_kv seq_lens must hold one length per row of block_table ({batch}), got {start.numel()}"
            )
    else:
        what = f"a {seq_lens.dtype} tensor" if isinstance(seq_lens, torch.Tensor) else type(seq_lens).__name__
        raise TypeError(f"append_kv seq_lens must be an int or an integer tensor [B], got {what}")
    device = k_pool.device
    pos = start.to(device)[:, None] + torch.arange(n, device=device)  # [B, n] logical positions
    logical = pos // page
    table = block_table.to(device, torch.int64)
    on_host = start.device.type == "cpu" and block_table.device.type == "cpu"
    if on_host and pos.numel():
        lo, hi = int(start.min()), int(start.max()) + n
        if lo < 0 or hi > max_pages * page:
            raise ValueError(
                f"append_kv writes positions {lo} .. {hi - 1}, outside the table's capacity 0 .. "
                f"{max_pages * page - 1} ({max_pages} pages of {page}): seq_lens must be >= 0 and "
                f"seq_lens + n <= max_pages * page_size"
            )
    physical = table.gather(1, logical.clamp(0, max_pages - 1))
    if on_host and physical.numel():
        bad = (physical < 0) | (physical >= n_pages)
        if bool(bad.any()):
            b, i = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"append_kv row {b} writes position {int(pos[b, i])} to block_table[{b}, {int(logical[b, i])}] = "
                f"{int(physical[b, i])}, outside the pool: valid pages are 0 .. {n_pages - 1}"
            )
    # Invalid entries (a CUDA table, not read on the host) point past the pool: a loud index
    # error, where a -1 would wrap around to the last page.
    physical = torch.where((physical >= 0) & (physical < n_pages), physical, n_pages).flatten()
    slot = (pos % page).flatten()
    for pool, new in ((k_pool, k_new), (v_pool, v_new)):
        rows = new.transpose(1, 2).reshape(batch * n, heads, new.shape[3])  # [B * n, Hkv, D]
        if kv_layout == "NHD":
            pool[physical, slot] = rows
        elif kv_layout == "HND":
            pool[physical, :, slot] = rows
        else:
            pool[0, :, physical * page + slot] = rows.transpose(0, 1)
    return seq_lens + n
