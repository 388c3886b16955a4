"""BlockMasks built in closed form where the spec has one, cached.

Two builders, neither ever holds an ``Lq x Lkv`` tensor:

* closed form: the spec's ``block_map`` gives block-level visibility from interval arithmetic on
  block boundaries, O(n_q_blocks * n_kv_blocks);
* generic: ``mask_mod`` is evaluated on broadcast index grids one slab of query blocks at a time
  (at most ``GENERIC_CHUNK_ELEMENTS`` elements live), for user masks and sparse document ids.

Both index sides (kv rows and q columns) are derived from the block map with an O(n) ranking
instead of a sort or ``from_kv_blocks``' dense transpose. Cache: an LRU of ``BLOCK_MASK_CACHE_SIZE``
entries keyed by (spec, lengths, block sizes, device, batch/heads when the spec depends on them).
Specs own their tensors, so a key never changes value; a spec wrapping a raw ``mask_mod`` carries
the versions of the tensors it captures (``Spec.live()``), so an in-place write to them misses.
"""

from __future__ import annotations

from typing import Any

import torch

from flexattn_zoo import _compat
from flexattn_zoo.coercion import as_mask_spec
from flexattn_zoo.lru import LRUCache
from flexattn_zoo.spec import BlockMap, MaskSpec, as_4d, block_ranges, tracing
from flexattn_zoo.validation import check_device_arg

DEFAULT_BLOCK_SIZE = 128
#: Upper bound of cached BlockMasks (least recently used dropped first).
BLOCK_MASK_CACHE_SIZE = 64
#: Elements of the mask evaluated at once by the generic builder (bool: bytes).
GENERIC_CHUNK_ELEMENTS = 1 << 24


def _ordered_eager(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row counts and full-width column order (True columns first, ascending) of a bool map.

    Same result as ``argsort(m, descending=True, stable=True)`` but O(n): each column's rank is
    read off a running count, then columns are scattered into place. Counts run in int16 when the
    row fits (halves the memory traffic, which dominates at 1M tokens).
    """
    m = m.contiguous()
    n = m.shape[-1]
    small = torch.int16 if n < 2**15 else torch.int32
    count = m.cumsum(-1, dtype=small)
    num = count[..., -1:]
    cols = torch.arange(n, device=m.device, dtype=small)
    rank = torch.where(m, count - 1, num + cols - count)
    order = torch.empty(m.shape, device=m.device, dtype=torch.int32)
    order.scatter_(-1, rank.long(), cols.to(torch.int32).expand(m.shape))
    return num.squeeze(-1).to(torch.int32), order


@torch.library.custom_op("flexattn_zoo::block_order", mutates_args=())
def block_order(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_ordered_eager` as one opaque op of a compiled graph: ``(counts, order)``, int32,
    ``m.shape[:-1]`` and ``m.shape``, contiguous.

    Inside a caller's ``torch.compile`` the BlockMask of a mask holding data (document ids) is
    built in the graph. Traced as plain ops, the ranking and scatter compiled together with the
    flex kernel that reads them gave wrong rows on CUDA for every batch row but the first
    (torch 2.11, H200; the same ops compiled alone, without the kernel, were right); as one op
    Inductor cannot fuse or re-lay them out, and the flex kernel reads the indices exactly.
    """
    num, order = _ordered_eager(m)
    # The counts may be a strided view of the running count (int32 already from 2**15 columns):
    # the op returns what its fake implementation promises, a fresh contiguous tensor.
    return num.clone(memory_format=torch.contiguous_format), order


@block_order.register_fake
def _block_order_fake(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return m.new_empty(m.shape[:-1], dtype=torch.int32), m.new_empty(m.shape, dtype=torch.int32)


def _ordered(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_ordered_eager`, through :func:`block_order` while ``torch.compile`` traces."""
    if tracing():
        return block_order(m.contiguous())
    return _ordered_eager(m)


def from_block_map(
    bmap: BlockMap, q_len: int, kv_len: int, block_size: tuple[int, int], mask_mod: Any
) -> _compat.BlockMask:
    """Turn a block map into a torch BlockMask (partial blocks run ``mask_mod``, full ones skip it)."""
    full = bmap.full & bmap.any
    partial = bmap.any & ~full
    kv_num, kv_idx = _ordered(partial)
    full_kv_num, full_kv_idx = _ordered(full)
    # The q side is the same ranking on the transposed maps (made contiguous inside _ordered).
    q_num, q_idx = _ordered(partial.transpose(-1, -2))
    full_q_num, full_q_idx = _ordered(full.transpose(-1, -2))
    return _compat.make_block_mask(
        (q_len, kv_len),
        kv_num,
        kv_idx,
        full_kv_num,
        full_kv_idx,
        q_num,
        q_idx,
        full_q_num,
        full_q_idx,
        block_size,
        mask_mod,
    )


def generic_block_map(
    spec: MaskSpec,
    q_len: int,
    kv_len: int,
    block_size: tuple[int, int],
    batch: int,
    heads: int,
    device: torch.device,
) -> BlockMap:
    """Evaluate ``spec.mask_mod()`` slab by slab and reduce each slab to block visibility."""
    qb, kvb = block_size
    mod = spec.mask_mod()
    n_q, n_kv = -(-q_len // qb), -(-kv_len // kvb)
    kv_pad = n_kv * kvb
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, heads, 1, 1)
    kv = torch.arange(kv_pad, device=device).view(1, 1, 1, kv_pad)
    kv_valid = kv < kv_len
    if tracing():
        # One slab: a Python loop over a symbolic number of blocks would specialize the length
        # (torch.compile with dynamic shapes: a recompile per 128 positions). The compiled graph
        # computes the block reductions from the mask_mod's values without the eager path's
        # memory bound.
        slabs = [(0, n_q)]
    else:
        rows_per_slab = max(1, GENERIC_CHUNK_ELEMENTS // max(1, batch * heads * qb * kv_pad))
        slabs = [(start, min(n_q, start + rows_per_slab)) for start in range(0, n_q, rows_per_slab)]
    any_parts, full_parts = [], []
    for start, stop in slabs:
        q = torch.arange(start * qb, stop * qb, device=device).view(1, 1, -1, 1)
        # Padding positions are clamped for evaluation (so captured tensors index in range),
        # then counted as masked, exactly as create_block_mask pads with False.
        vis = mod(b, h, q.clamp(max=q_len - 1), kv.clamp(max=kv_len - 1))
        vis = torch.broadcast_to(torch.as_tensor(vis, device=device), (batch, heads, q.shape[2], kv_pad))
        vis = vis & (q < q_len) & kv_valid
        blocks = vis.view(batch, heads, stop - start, qb, n_kv, kvb)
        any_parts.append(blocks.any(dim=5).any(dim=3))
        full_parts.append(blocks.all(dim=5).all(dim=3))
    return BlockMap(any=torch.cat(any_parts, dim=2), full=torch.cat(full_parts, dim=2))


CACHE: LRUCache[Any] = LRUCache(BLOCK_MASK_CACHE_SIZE)


def _block_size(block_size: int | tuple[int, int]) -> tuple[int, int]:
    if isinstance(block_size, int) and not isinstance(block_size, bool):
        block_size = (block_size, block_size)
    if (
        not isinstance(block_size, tuple)
        or len(block_size) != 2
        or not all(isinstance(x, int) and x > 0 and x % 16 == 0 for x in block_size)
    ):
        raise ValueError(
            f"block_size must be a positive multiple of 16 or a (q, kv) pair of them, got {block_size!r}"
        )
    return block_size


#: A BlockMask's constructor arguments (``_compat.make_block_mask``) but the ``mask_mod``.
BLOCK_MASK_PARTS = (
    "seq_lengths",
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
    "BLOCK_SIZE",
)


def block_mask(
    spec: Any,
    q_len: int,
    kv_len: int,
    *,
    batch: int | None = None,
    heads: int | None = None,
    device: torch.device | str = "cpu",
    block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
    key_starts: bool = False,
) -> _compat.BlockMask:
    """The BlockMask of ``spec`` for ``q_len`` x ``kv_len``, cached, never evaluated densely.

    Args:
        spec: a mask spec, registry name or ``mask_mod`` callable.
        q_len, kv_len: sequence lengths (any positive ints; not necessarily multiples of 128).
        batch, heads: sizes of the problem. Only used when the spec depends on them; otherwise
            the mask has size-1 batch/head dims that flex broadcasts.
        device: where the mask lives (the device of q).
        block_size: ``(q, kv)`` sparse block size; kernels need matching tile sizes.
        key_starts: give the BlockMask the spec's ``starts_mask_mod`` where it has one (packed
            documents as ``start[q] <= kv <= q``: faster on Triton flex, slower on FA4's CuTe
            kernel), else its ``mask_mod``. The blocks are the same either way.
    """
    mask_spec = as_mask_spec(spec, arg="spec")
    if mask_spec is None:
        raise ValueError("spec must be a mask spec, registry name or mask_mod callable, not None")
    if not isinstance(key_starts, bool):
        raise TypeError(f"key_starts must be a bool, got {type(key_starts).__name__}")
    for name, value in (("q_len", q_len), ("kv_len", kv_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    qb, kvb = _block_size(block_size)
    device = check_device_arg(device)
    mask_spec = _bound(mask_spec, q_len, kv_len)
    for name, size, needed in (
        ("batch", batch, mask_spec.uses_batch()),
        ("heads", heads, mask_spec.uses_head()),
    ):
        if size is None and needed:
            raise ValueError(f"this mask depends on the {name} index: pass {name}=")
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size <= 0):
            raise ValueError(f"{name} must be a positive int or None, got {size!r}")
    # None only where the spec does not use it (raised above otherwise).
    b_eff = batch if batch is not None and mask_spec.uses_batch() else 1
    h_eff = heads if heads is not None and mask_spec.uses_head() else 1
    mask_spec.validate(q_len, kv_len, batch or 1, heads or 1)
    key = (mask_spec, q_len, kv_len, qb, kvb, str(device), b_eff, h_eff)
    if key_starts:  # the same blocks under their own key, with the spelling worked out once
        starts_key = ("starts", *key)
        cached = CACHE.get(starts_key)
        if cached is not None:
            return cached
        built = block_mask(
            spec, q_len, kv_len, batch=batch, heads=heads, device=device, block_size=block_size
        )
        spelled = _compat.outside_inference_mode(lambda: mask_spec.to(device).starts_mask_mod(q_len, kv_len))
        if spelled is not None:
            parts = (getattr(built, name) for name in BLOCK_MASK_PARTS)
            built = _compat.make_block_mask(*parts, spelled)  # type: ignore[call-arg]  # the constructor's arguments, in order
        return CACHE.put(starts_key, built)
    cached = CACHE.get(key)
    if cached is not None:
        return cached
    # Cached for every later call, training ones too: never as inference tensors.
    return CACHE.put(
        key,
        _compat.outside_inference_mode(
            lambda: _build(mask_spec, q_len, kv_len, qb, kvb, device, b_eff, h_eff)
        ),
    )


def _build(
    mask_spec: MaskSpec,
    q_len: int,
    kv_len: int,
    qb: int,
    kvb: int,
    device: torch.device,
    b_eff: int,
    h_eff: int,
) -> _compat.BlockMask:
    """:func:`block_mask`'s BlockMask of a bound spec (not cached here)."""
    on_device = mask_spec.to(device)
    bmap = on_device.block_map(q_len, kv_len, qb, kvb, device)
    if bmap is None:
        bmap = generic_block_map(on_device, q_len, kv_len, (qb, kvb), b_eff, h_eff, device)
    else:
        bmap = BlockMap(
            any=as_4d(bmap.any).expand(b_eff, h_eff, -1, -1).contiguous(),
            full=as_4d(bmap.full).expand(b_eff, h_eff, -1, -1).contiguous(),
        )
    return from_block_map(bmap, q_len, kv_len, (qb, kvb), on_device.mask_mod())


def bound_mask_mod(spec: Any, q_len: int, kv_len: int, device: torch.device | str) -> Any:
    """The ``mask_mod`` that :func:`block_mask` puts in the BlockMask of ``spec`` for these sizes
    on ``device`` (to assemble that BlockMask again from its tensors)."""
    mask_spec = as_mask_spec(spec, arg="spec")
    if mask_spec is None:
        raise ValueError("spec must be a mask spec, registry name or mask_mod callable, not None")
    return _bound(mask_spec, q_len, kv_len).to(check_device_arg(device)).mask_mod()


def _bound(mask_spec: Any, q_len: int, kv_len: int) -> Any:
    """``mask_spec`` as :func:`block_mask` keys and builds it: live and bound to the sizes."""
    # live(): a raw callable's captured tensors are part of the key (see functions.capture_state),
    # so an in-place write to them rebuilds the BlockMask instead of pairing stale block sparsity
    # with the live mask_mod.
    return mask_spec.live().bind(q_len, kv_len)


__all__ = [
    "BLOCK_MASK_CACHE_SIZE",
    "BLOCK_MASK_PARTS",
    "CACHE",
    "DEFAULT_BLOCK_SIZE",
    "block_mask",
    "block_ranges",
    "bound_mask_mod",
    "from_block_map",
]
