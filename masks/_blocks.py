"""Closed-form block visibility shared by the mask families.

Every helper works on per-block vectors (first / last valid position of each block, from
:func:`flexattn_zoo.spec.block_ranges`) and compares a ``[n_q, 1]`` column with a ``[1, n_kv]``
row, so the only ``n_q x n_kv`` temporaries are booleans: at 1M tokens with 128-wide blocks that
is 64 MiB each, against 512 MiB for an int64 difference matrix.

The classification matches ``create_block_mask``: a pair is *any* when some valid ``(i, j)`` in it
is visible, *full* when both blocks are complete and every ``(i, j)`` is visible.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from flexattn_zoo._compat import outside_inference_mode
from flexattn_zoo.spec import BlockMap, block_ranges, clamp_int, static_int, tracing


def band_block_map(
    q_len: int,
    kv_len: int,
    q_block: int,
    kv_block: int,
    device: torch.device | str,
    *,
    lo: int | None,
    hi: int | None,
) -> BlockMap:
    """Blocks of the diagonal band ``lo <= j - i <= hi`` (``None``: unbounded on that side).

    Inside a block pair ``j - i`` takes every integer of ``[k_first - q_last, k_last - q_first]``
    (both index ranges are contiguous), so the pair touches the band iff that interval meets
    ``[lo, hi]`` and lies in the band iff the interval is inside it.
    """
    q_first, q_last, q_complete = block_ranges(q_len, q_block, device)
    k_first, k_last, k_complete = block_ranges(kv_len, kv_block, device)
    any_ = torch.ones(q_first.numel(), k_first.numel(), dtype=torch.bool, device=device)
    full = q_complete[:, None] & k_complete[None, :]
    if hi is not None:
        any_ &= k_first[None, :] <= (q_last + hi)[:, None]
        full &= k_last[None, :] <= (q_first + hi)[:, None]
    if lo is not None:
        any_ &= k_last[None, :] >= (q_first + lo)[:, None]
        full &= k_first[None, :] >= (q_last + lo)[:, None]
    return BlockMap(any=any_[None, None], full=full[None, None])


def sorted_label_block_map(
    q_lo: torch.Tensor,
    q_hi: torch.Tensor,
    kv_lo: torch.Tensor,
    kv_hi: torch.Tensor,
    complete: torch.Tensor,
) -> BlockMap:
    """Blocks of ``label[i] == label[j]`` where labels never decrease along a row.

    ``q_lo``/``q_hi`` (``[R, n_q]``) and ``kv_lo``/``kv_hi`` (``[R, n_kv]``) are the labels of each
    block's first and last valid position, i.e. its min and max; ``R`` is 1 or the batch size and
    ``complete`` is ``[n_q, n_kv]``. Why overlap of label ranges is exact: both blocks are windows
    of one sorted sequence, so either they share a position, or the earlier block's max and the
    later block's min are neighbours in sorted order and overlapping ranges force them equal.
    """
    # In-place updates keep the peak at the two outputs plus one boolean temporary.
    any_ = q_lo[:, :, None] <= kv_hi[:, None, :]
    any_ &= kv_lo[:, None, :] <= q_hi[:, :, None]
    full = q_lo[:, :, None] == kv_lo[:, None, :]
    full &= complete
    full &= (q_lo == q_hi)[:, :, None]
    full &= (kv_lo == kv_hi)[:, None, :]
    return BlockMap(any=any_[:, None], full=full[:, None])


def complete_pairs(
    q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
) -> torch.Tensor:
    """``[n_q, n_kv]``: both blocks of the pair hold only valid positions."""
    _, _, q_complete = block_ranges(q_len, q_block, device)
    _, _, k_complete = block_ranges(kv_len, kv_block, device)
    return q_complete[:, None] & k_complete[None, :]


#: Flex evaluates mask_mods on int32 ``q_idx`` / ``kv_idx``, and a Python int in int32 arithmetic
#: wraps (torch's promotion keeps int32): ``SlidingWindow(left=2**40)`` would become a window of 0.
#: Mask parameters are clamped to this magnitude when a spec is built (see ``check_int``).
INDEX_LIMIT = 2**31 - 1


def check_int(name: str, value: object, *, minimum: int | None, owner: str) -> int:
    """``value`` as a plain int (``>= minimum`` unless None); TypeError/ValueError naming
    ``owner(name=...)``. ``bool`` is refused although it subclasses ``int``:
    ``SlidingWindow(left=True)`` is a bug, not a window of 1.

    Every caller is a mask's position parameter (window, prefix, chunk, offset), so the result is
    clamped to ``[-INDEX_LIMIT, INDEX_LIMIT]``: indices lie in ``[0, 2**31 - 2]`` and their
    differences within that range, so the mask is unchanged for every length a kernel can index,
    while mask_mods (int32) and block maps (int64) no longer overflow on ``2**40``-style
    "unbounded" values."""
    if (
        type(value) is int
        and not torch.compiler.is_dynamo_compiling()  # Dynamo calls a SymInt an int: no guards on it
        and -INDEX_LIMIT <= value <= INDEX_LIMIT
        and (minimum is None or value >= minimum)
    ):
        return value  # the common case, settled without the checks below (specs built per call)
    wanted = "an int" if minimum is None else f"an int >= {minimum}"
    if isinstance(value, bool) or not (isinstance(value, int) or hasattr(value, "__index__")):
        raise TypeError(f"{owner}({name}=...) must be {wanted}, got {type(value).__name__}")
    try:
        # int() keeps a SymInt symbolic while torch.compile traces with dynamic shapes (Causal
        # binds Lkv - Lq into an OffsetCausal); Dynamo can trace neither hasattr nor __index__ on
        # one. Other integer types (NumPy, 0-d tensors) go through __index__.
        as_int = int(value) if isinstance(value, int) else int(value.__index__())
    except (TypeError, ValueError, RuntimeError) as exc:  # e.g. a float or multi-element tensor
        raise TypeError(f"{owner}({name}=...) must be {wanted}, got {type(value).__name__}: {exc}") from exc
    if minimum is not None and as_int < minimum:
        raise ValueError(f"{owner}({name}=...) must be {wanted}, got {as_int}")
    # Symbolic-safe: a compiled decode step may pass a cache position read from a tensor.
    return clamp_int(as_int, -INDEX_LIMIT, INDEX_LIMIT)


def spec_cached(spec: Any, key: tuple[Any, ...], make: Any) -> Any:
    """``make()``, computed once per ``key`` for ``spec``: data-dependent facts about a spec's
    tensors (each a device sync), kept in the per-instance ``_cache`` dict the spec sets up in
    ``__post_init__``. Specs are immutable, so an entry never goes stale."""
    cache: dict[tuple[Any, ...], Any] = spec.__dict__["_cache"]
    if key not in cache:
        cache[key] = outside_inference_mode(make)  # kept for later calls, training ones too
    return cache[key]


def _canonical_device(device: torch.device | str | None) -> torch.device:
    dev = torch.device("cpu" if device is None else device)
    if dev.type == "cuda" and dev.index is None:  # "cuda" and "cuda:0" must be one key
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class CapturedOffsets:
    """Mixin for masks whose position parameters move with the cache (``OffsetCausal``, ``Band``):
    their ``mask_mod`` reads those values from captured 0-d int32 tensors, never Python constants.

    Why: a Python int captured by a ``mask_mod`` is baked into the compiled kernel (and into the
    compile cache's key, :func:`flexattn_zoo.compile.mod_key`), so a decode step's
    ``OffsetCausal(Lkv - Lq)`` compiled one kernel per generated token. A captured tensor is a
    kernel *input* (keyed by shape, dtype and device only): every offset shares one kernel.

    Why one immutable tensor per spec value rather than one shared tensor written per call: a
    shared tensor is read when the kernel *runs*, which on CUDA is after the launch returns; two
    calls with different offsets (two threads, two streams) could overwrite each other's value
    before their kernels read it. Here each spec value gets its own tensor when its ``mask_mod``
    is made (``spec.mask_mod()`` is cached per value) and never written again: nothing to order
    between calls, nothing to lock. It is filled on its device by a kernel queued on the current
    stream, like the BlockMask tensors built from the same spec at the same moment (and shared by
    later calls through the BlockMask cache in the same way). The cost is one 4-byte tensor per
    distinct value and device.

    A tensor lives on one device, so such a spec knows where its ``mask_mod`` will run:
    ``spec.to(device)`` returns a copy for that device (what the BlockMask builder and the dense
    route already call), and the device takes part in equality and hashing, so the ``mask_mod``
    cache never hands a CPU tensor to a CUDA kernel. Specs are built for the CPU.
    """

    __slots__ = ()

    def _set_device(self, device: torch.device | str | None = None) -> None:
        object.__setattr__(self, "_device", _canonical_device(device))

    def _fields(self) -> tuple[Any, ...]:
        return (*super()._fields(), self.__dict__.get("_device"))  # type: ignore[misc]

    def to(self, device: torch.device | str) -> Any:
        dev = _canonical_device(device)
        if dev == self.__dict__.get("_device"):
            return self
        moved = dataclasses.replace(self)  # type: ignore[type-var]
        moved._set_device(dev)
        return moved

    def reads_scalar_tensors(self) -> bool:
        return True

    def _offset_tensor(self, value: int) -> torch.Tensor | int:
        """``value`` (already clamped to int32 by ``check_int``) as a 0-d int32 tensor on this
        spec's device. int32 like flex's ``q_idx``/``kv_idx``: a 0-d operand does not promote
        them, and ``kv_idx - q_idx`` never leaves int32 for indices below ``2**31``.

        While ``torch.compile`` traces a caller, the int itself: the caller's graph is compiled
        for this spec value anyway (Dynamo guards on it), and Inductor's CPU flex kernel refuses
        a 0-d tensor made inside the graph (NoValidChoicesError, torch 2.13).

        Specialized (``static_int``) under dynamic shapes too: ``Causal(align="bottom_right")``
        binds ``Lkv - Lq``, symbolic there, and Inductor's CPU flex kernel lowers neither a
        symbolic closure (LoweringException: 'Add' object has no attribute 'get_name') nor a 0-d or
        1-element tensor made from one (NoValidChoicesError; torch 2.13, plain flex_attention
        too). A deliberate choice there: one compile per distinct offset for such calls
        (Lq != Lkv); Lq == Lkv binds to plain ``Causal()``, and a Band's offsets are its parameters.

        On CUDA a traced call gets a 0-d tensor made in the graph from the (possibly symbolic)
        value: a compiled decode step over a static KV cache, whose offset is the cache position,
        then serves every step with one graph instead of recompiling per token."""
        device = self.__dict__["_device"]  # set by __post_init__ (``_set_device``)
        if tracing() and device.type != "cuda":
            return static_int(value)
        return torch.full((), value, dtype=torch.int32, device=device)


def interval_block_map(
    starts: torch.Tensor,
    ends: torch.Tensor,
    q_block: int,
    kv_block: int,
    kv_len: int,
    device: torch.device | str,
) -> BlockMap:
    """Blocks of a mask where query ``i`` sees exactly the keys ``starts[i] <= j < ends[i]``, both
    bounds never decreasing along a row.

    ``starts`` / ``ends`` are int64 ``[R, Lq]`` (``R`` is 1 or the batch size); an interval may be
    empty (``ends[i] <= starts[i]``). Exact for any such rows, in O(Lq + n_q * n_kv) work:

    * all of a block pair is visible iff the largest start (the block's last query) is at or before
      its first key and the smallest end (its first query) is past its last key;
    * some of it is, iff some query of the block has a non-empty interval that meets the key block.
      The queries whose start is at or before the key block's last key form a prefix of the rows
      (``starts`` never decreases), those whose end is past its first key a suffix; a prefix count
      of the non-empty intervals says whether the overlap of the two, cut to the query block, holds
      one.
    """
    starts = starts.to(device)
    ends = torch.maximum(ends.to(device).clamp(max=kv_len), starts)
    rows, q_len = starts.shape
    q_first, q_last, q_complete = block_ranges(q_len, q_block, device)
    k_first, k_last, k_complete = block_ranges(kv_len, kv_block, device)
    full = (starts[:, q_last][:, :, None] <= k_first[None, None, :]) & (
        ends[:, q_first][:, :, None] > k_last[None, None, :]
    )
    full &= (q_complete[:, None] & k_complete[None, :])[None]
    idx = torch.int32 if q_len < 2**31 - 1 else torch.int64
    # Per key block: the last query whose start is <= its last key, the first whose end is > its
    # first key (searchsorted on each row, both bounds being sorted).
    reach = torch.searchsorted(starts.contiguous(), k_last.expand(rows, -1).contiguous(), right=True) - 1
    begin = torch.searchsorted(ends.contiguous(), k_first.expand(rows, -1).contiguous(), right=True)
    lo = torch.maximum(q_first.to(idx)[None, :, None], begin.to(idx)[:, None, :])
    hi = torch.minimum(q_last.to(idx)[None, :, None], reach.to(idx)[:, None, :])
    nonempty = torch.zeros(rows, q_len + 1, dtype=torch.int64, device=device)
    nonempty[:, 1:] = torch.cumsum(ends > starts, dim=-1)
    flat = nonempty.gather(1, (hi + 1).clamp(0, q_len).long().view(rows, -1)) - nonempty.gather(
        1, lo.clamp(0, q_len).long().view(rows, -1)
    )
    any_ = (lo <= hi) & (flat.view(lo.shape) > 0)
    return BlockMap(any=any_[:, None], full=full[:, None])


#: Mask elements evaluated at once by :func:`evaluate_blocks` (bool: bytes); as the generic builder.
CANDIDATE_CHUNK_ELEMENTS = 1 << 24


def evaluate_blocks(
    mask_mod: Any,
    candidates: torch.Tensor,
    q_len: int,
    kv_len: int,
    q_block: int,
    kv_block: int,
    device: torch.device | str,
) -> BlockMap:
    """Block visibility from ``mask_mod`` evaluated only on the candidate block pairs.

    ``candidates`` is a bool ``[R, n_q, n_kv]`` superset of the live block pairs (``R`` batch rows,
    or 1); every other pair is taken as invisible. Row ``r``'s pairs are evaluated with batch index
    ``r`` and head index 0, so the mask must not depend on the head (nor on the batch beyond what
    ``R`` rows cover). The work is that of the candidates' elements, in chunks of at most
    ``CANDIDATE_CHUNK_ELEMENTS``: a mask that is sparse by construction (documents) costs what it
    keeps, where the generic builder evaluates every ``Lq x Lkv`` element.
    """
    rows, n_q, n_kv = candidates.shape
    any_ = torch.zeros(rows, n_q, n_kv, dtype=torch.bool, device=device)
    full = torch.zeros_like(any_)
    r_idx, qi, ki = candidates.to(device).nonzero(as_tuple=True)
    q_off = torch.arange(q_block, device=device)
    k_off = torch.arange(kv_block, device=device)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.int64, device=device)
    step = max(1, CANDIDATE_CHUNK_ELEMENTS // (q_block * kv_block))
    for lo in range(0, r_idx.numel(), step):
        r, bq, bk = r_idx[lo : lo + step], qi[lo : lo + step], ki[lo : lo + step]
        q = (bq[:, None] * q_block + q_off[None, :]).view(-1, 1, q_block, 1)
        kv = (bk[:, None] * kv_block + k_off[None, :]).view(-1, 1, 1, kv_block)
        # Padding positions are clamped for evaluation (captured tensors index in range), then
        # counted as masked, as create_block_mask does.
        vis = mask_mod(r.view(-1, 1, 1, 1), h, q.clamp(max=q_len - 1), kv.clamp(max=kv_len - 1))
        vis = torch.broadcast_to(torch.as_tensor(vis, device=device), (r.numel(), 1, q_block, kv_block))
        vis = vis & (q < q_len) & (kv < kv_len)
        any_[r, bq, bk] = vis.any(dim=(1, 2, 3))
        full[r, bq, bk] = vis.all(dim=(1, 2, 3))
    return BlockMap(any=any_[:, None], full=full[:, None])
