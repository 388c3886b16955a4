"""Consistency checks of a spec against its own dense oracle (exposed through ``fz.testing``).

Each check evaluates the spec's kernel-facing function (``mask_mod`` / ``score_mod``) the way
flex would see it -- on int32 index grids that broadcast against each other -- and compares it
with the independently written ``dense`` oracle. Block maps and the SDPA / varlen forms are
checked against the same oracle, since a wrong cheap form silently computes the wrong attention;
so are the lowest visible keys KV-cache decoding skips by, and the score specs' soft-cap and
linear-bias forms.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from flexattn_zoo._compat import BlockMask, create_block_mask
from flexattn_zoo.compose import And, Not, Or
from flexattn_zoo.registry import MASKS, SCORES, Registry, did_you_mean
from flexattn_zoo.spec import (
    GLOBAL_FORM_MAX_TOKENS,
    GlobalTokensForm,
    MaskSpec,
    ScoreSpec,
    Spec,
    SplitForm,
    StridedForm,
    VarlenForm,
    as_4d,
)
from flexattn_zoo.spec import index_grids as spec_index_grids
from flexattn_zoo.validation import check_tolerance

#: Block sizes checked by default: the kernels' 128, and small uneven blocks so short test
#: sequences still span many blocks, with trailing incomplete ones.
DEFAULT_BLOCK_SIZES: tuple[tuple[int, int], ...] = ((128, 128), (16, 32))


def spec_examples(
    kind: str, q_len: int, kv_len: int, batch: int = 1, heads: int = 1, *, names: list[str] | None = None
) -> list[tuple[str, Spec]]:
    """``(name, spec)`` for every registered ``kind`` (``"mask"`` or ``"score"``) spec's examples.

    Spec classes contribute their ``examples(q_len, kv_len, batch, heads)``; plain functions
    registered with ``register_function`` contribute their single spec.
    """
    registries: dict[str, Registry] = {"mask": MASKS, "score": SCORES}
    if kind not in registries:
        raise ValueError(f"spec_examples(kind=...) must be 'mask' or 'score', got {kind!r}")
    registry = registries[kind]
    if names is not None:
        # A str would be matched by substring ("causal" in "causal_x") and an unknown name would
        # select nothing: both silently shrink the examples a test runs over.
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"spec_examples(names=...) must be a list of registry names, got {names!r}")
        unknown = [n for n in names if n not in registry.names()]
        if unknown:
            valid = registry.names()
            raise ValueError(
                f"spec_examples(names=...): unknown {kind} {unknown[0]!r}; valid: {', '.join(valid)}."
                f"{did_you_mean(unknown[0], valid)}"
            )
    found: list[tuple[str, Spec]] = []
    for entry in registry.entries():
        if names is not None and entry.name not in names:
            continue
        factory = entry.factory
        if isinstance(factory, type) and issubclass(factory, Spec):
            found.extend((entry.name, s) for s in factory.examples(q_len, kv_len, batch, heads))
        else:
            found.append((entry.name, entry.factory()))  # unnarrowed: a Callable[..., Spec]
    return found


def index_grids(batch: int, heads: int, q_len: int, kv_len: int) -> tuple[torch.Tensor, ...]:
    """int32 ``(b, h, q_idx, kv_idx)`` of shapes ``[B,1,1,1]``, ``[1,H,1,1]``, ``[1,1,Lq,1]``, ``[1,1,1,Lkv]``."""
    return spec_index_grids(batch, heads, q_len, kv_len, torch.int32)  # what the flex kernels pass


def _first(diff: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(x) for x in torch.nonzero(diff)[0])


def _require_equal(what: str, got: torch.Tensor, want: torch.Tensor, spec: Spec) -> None:
    got, want = torch.broadcast_tensors(got, want)
    if not torch.equal(got, want):
        where = _first(got != want)
        raise AssertionError(
            f"{spec!r}: {what} differs from the dense oracle at index {where} "
            f"(got {got[where].item()}, oracle {want[where].item()}; {int((got != want).sum())} "
            "elements differ)"
        )


def _broadcast_to_mask(what: str, said: torch.Tensor, dense: torch.Tensor, spec: Spec) -> torch.Tensor:
    """``said`` (what a form describes) broadcast to the mask's ``[B, H, Lq, Lkv]``, or an
    AssertionError naming the form and both shapes (not torch's expand error, which names neither;
    e.g. a form with more batch rows than the problem, or one key too many)."""
    try:
        return said.expand_as(dense)
    except RuntimeError:
        raise AssertionError(
            f"{spec!r}: {what} describes a mask of shape {tuple(said.shape)}, which does not broadcast to the mask's "
            f"[B, H, Lq, Lkv] = {list(dense.shape)}"
        ) from None


def dense_block_map(dense: torch.Tensor, q_block: int, kv_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(any, full)`` of a dense ``[B, H, Lq, Lkv]`` mask; padding counts as masked."""
    b, h, lq, lkv = dense.shape
    nq, nkv = -(-lq // q_block), -(-lkv // kv_block)
    padded = torch.zeros(b, h, nq * q_block, nkv * kv_block, dtype=torch.bool)
    padded[..., :lq, :lkv] = dense
    tiles = padded.view(b, h, nq, q_block, nkv, kv_block)
    return tiles.any(dim=5).any(dim=3), tiles.all(dim=5).all(dim=3)


def _indices_to_dense(num: torch.Tensor | None, idx: torch.Tensor | None, n_kv: int) -> torch.Tensor | None:
    if num is None or idx is None:
        return None
    valid = torch.arange(idx.shape[-1]) < num.unsqueeze(-1).long()
    out = torch.zeros(*idx.shape[:-1], n_kv + 1, dtype=torch.bool)
    out.scatter_(-1, torch.where(valid, idx.long(), n_kv), True)
    return out[..., :n_kv]


def block_mask_map(block_mask: BlockMask, n_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(any, full)`` of a flex ``BlockMask`` (partial and full kv blocks, on the CPU)."""
    partial = _indices_to_dense(block_mask.kv_num_blocks.cpu(), block_mask.kv_indices.cpu(), n_kv)
    full_num = block_mask.full_kv_num_blocks
    full_idx = block_mask.full_kv_indices
    full = _indices_to_dense(
        None if full_num is None else full_num.cpu(), None if full_idx is None else full_idx.cpu(), n_kv
    )
    assert partial is not None
    if full is None:
        full = torch.zeros_like(partial)
    return partial | full, full


def varlen_dense(form: VarlenForm, length: int, batch: int, kv_len: int | None = None) -> torch.Tensor:
    """The ``[B|1, 1, L, Lkv]`` mask a :class:`VarlenForm` describes (``Lkv = kv_len``, default
    ``L``; only a form with ``kv_segments`` describes ``Lkv != L``)."""
    if form.kv_segments is not None:
        return _cross_varlen_dense(form, length, length if kv_len is None else kv_len)
    segs = form.segments
    if segs is None:
        ids = torch.zeros(1, length, dtype=torch.long)
    else:
        # [n] -> [1, n]; not reshape(-1, n), which cannot infer the leading size when n == 0.
        rows = segs.cpu().long()
        rows = rows.unsqueeze(0) if rows.dim() == 1 else rows.flatten(0, -2)
        if bool((rows.sum(dim=-1) != length).any()):
            raise AssertionError(f"VarlenForm segments {rows.tolist()} do not tile length {length}")
        ids = torch.stack([torch.repeat_interleave(torch.arange(r.numel()), r) for r in rows])
    i = torch.arange(length).view(length, 1)
    j = torch.arange(length).view(1, length)
    visible = ids[:, :, None] == ids[:, None, :]
    left, right = form.window
    if left >= 0:
        visible = visible & (j >= i - left)
    if right >= 0:
        visible = visible & (j <= i + right)
    return visible[:, None]


def _cross_varlen_dense(form: VarlenForm, q_len: int, kv_len: int) -> torch.Tensor:
    """``[1, 1, Lq, Lkv]``: segment ``i`` pairs ``segments[i]`` queries with ``kv_segments[i]``
    keys, the window bottom-right aligned inside it."""
    assert form.segments is not None and form.kv_segments is not None
    lengths_q, lengths_k = form.segments.cpu().long(), form.kv_segments.cpu().long()
    if lengths_q.dim() != 1 or lengths_q.shape != lengths_k.shape:
        raise AssertionError(
            f"VarlenForm kv_segments {lengths_k.tolist()} do not pair with segments {lengths_q.tolist()}"
        )
    if (
        int(lengths_q.sum()) != q_len
        or int(lengths_k.sum()) != kv_len
        or bool((lengths_q <= 0).any() | (lengths_k <= 0).any())
    ):
        raise AssertionError(
            f"VarlenForm segments {lengths_q.tolist()} / kv_segments {lengths_k.tolist()} do not tile "
            f"{q_len} x {kv_len} with positive lengths"
        )
    seq_q = torch.repeat_interleave(torch.arange(lengths_q.numel()), lengths_q)
    seq_k = torch.repeat_interleave(torch.arange(lengths_k.numel()), lengths_k)
    start_q, start_k = lengths_q.cumsum(0) - lengths_q, lengths_k.cumsum(0) - lengths_k
    pos = torch.arange(q_len) - start_q[seq_q] + (lengths_k - lengths_q)[seq_q]  # bottom-right position
    col = torch.arange(kv_len) - start_k[seq_k]
    visible = seq_q[:, None] == seq_k[None, :]
    left, right = form.window
    if left >= 0:
        visible = visible & (col[None, :] >= pos[:, None] - left)
    if right >= 0:
        visible = visible & (col[None, :] <= pos[:, None] + right)
    return visible[None, None]


def strided_dense(form: StridedForm, length: int) -> torch.Tensor:
    """The ``[1, 1, L, L]`` mask a :class:`StridedForm` describes: positions agree mod the
    stride, and the window holds in the class's own positions (``position // stride``)."""
    if form.stride < 1:
        raise AssertionError(f"StridedForm {form}: the stride must be at least 1")
    pos = torch.arange(length)
    i, j = pos.view(length, 1), pos.view(1, length)
    t, u = i // form.stride, j // form.stride
    visible = (i % form.stride) == (j % form.stride)
    left, right = form.window
    if left >= 0:
        visible = visible & (u >= t - left)
    if right >= 0:
        visible = visible & (u <= t + right)
    return visible[None, None]


def global_tokens_dense(form: GlobalTokensForm, length: int) -> torch.Tensor:
    """The ``[1, 1, L, L]`` mask a :class:`GlobalTokensForm` describes: the window, or'ed with the
    rows and columns of its positions; ``AssertionError`` when the positions break the contract
    (not ascending and distinct, outside ``[0, L)``, none, or more than ``GLOBAL_FORM_MAX_TOKENS``)."""
    positions = form.positions.cpu()
    count = positions.numel()
    if positions.dim() != 1 or positions.dtype != torch.int64 or not 1 <= count <= GLOBAL_FORM_MAX_TOKENS:
        raise AssertionError(
            f"GlobalTokensForm: positions must be int64 [G] with 1 <= G <= {GLOBAL_FORM_MAX_TOKENS}, "
            f"got {positions.dtype} {tuple(positions.shape)}"
        )
    if bool((positions < 0).any() | (positions >= length).any()) or bool((positions.diff() <= 0).any()):
        raise AssertionError(
            f"GlobalTokensForm: positions must be ascending, distinct and in [0, {length}), got {positions.tolist()[:8]}"
        )
    window = strided_dense(StridedForm(stride=1, window=form.window), length)  # one class: a window
    flags = torch.zeros(length, dtype=torch.bool)
    flags[positions] = True
    return window | flags.view(length, 1) | flags.view(1, length)


def split_dense(form: SplitForm, q_len: int, kv_len: int) -> torch.Tensor:
    """The ``[1, 1, Lq, Lkv]`` mask a :class:`SplitForm` describes; ``AssertionError`` when it
    breaks the contract parts cannot check alone (ranges beyond Lq / Lkv, keys shared by two parts
    in one row; ``SplitPart`` itself refuses empty ranges, causal parts that are not square and
    masks of the wrong shape)."""
    i = torch.arange(q_len).view(q_len, 1)
    j = torch.arange(kv_len).view(1, kv_len)
    union = torch.zeros(q_len, kv_len, dtype=torch.bool)
    for part in form.parts:
        (q0, q1), (k0, k1) = part.q, part.kv
        if q1 > q_len or k1 > kv_len:
            raise AssertionError(f"SplitForm part {part} is outside Lq, Lkv = {q_len}, {kv_len}")
        rect = (i >= q0) & (i < q1) & (j >= k0) & (j < k1)
        if part.is_causal:
            rect &= (j - k0) <= (i - q0)
        if part.mask is not None:
            rect[q0:q1, k0:k1] &= part.mask.cpu()
        if bool((rect & union).any()):
            raise AssertionError(f"SplitForm part {part} shares keys with an earlier part")
        union |= rect
    return union[None, None]


def _check_call(
    fn: str, spec: object, kind: type, what: str, q_len: object, kv_len: object, batch: object, heads: object
) -> None:
    """The spec's kind and the problem's sizes of a consistency check, as TypeError/ValueError
    naming the argument: a registry name or a spec of the other kind has none of the methods the
    check calls, and a negative length fails deep inside torch."""
    if not isinstance(spec, kind):
        factory = "masks.get" if kind is MaskSpec else "score_mods.get"
        hint = f" (build it first: {factory}(name, ...))" if isinstance(spec, str) else ""
        raise TypeError(f"{fn}(spec=...) must be {what}, got {type(spec).__name__}{hint}")
    for name, value, minimum in (
        ("q_len", q_len, 0),
        ("kv_len", kv_len, 0),
        ("batch", batch, 1),
        ("heads", heads, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{fn}({name}=...) must be an int >= {minimum}, got {type(value).__name__}")
        if value < minimum:
            raise ValueError(f"{fn}({name}=...) must be an int >= {minimum}, got {value}")


def _check_block_sizes(block_sizes: object) -> None:
    """``block_sizes`` must be ``(q_block, kv_block)`` pairs of positive ints: a flat pair
    ``(16, 32)`` failed with "cannot unpack non-iterable int" and a 0 with ZeroDivisionError."""
    valid = isinstance(block_sizes, (tuple, list)) and all(
        isinstance(pair, (tuple, list))
        and len(pair) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in pair)
        for pair in block_sizes
    )
    if not valid:
        raise ValueError(
            "assert_mask_consistent(block_sizes=...) must be a tuple of (q_block, kv_block) pairs of "
            f"positive ints, e.g. ((128, 128), (16, 32)); got {block_sizes!r}"
        )


def assert_mask_consistent(
    spec: MaskSpec,
    q_len: int,
    kv_len: int,
    *,
    batch: int = 1,
    heads: int = 1,
    block_sizes: tuple[tuple[int, int], ...] = DEFAULT_BLOCK_SIZES,
    exact_blocks: bool | None = None,
    exact_lowest_key: bool | None = None,
    check_create_block_mask: bool = True,
) -> None:
    """Check a mask spec's ``mask_mod``, block map, cheap forms and lowest visible keys against
    ``spec.dense``; the block map and forms of ``spec.bind(q_len, kv_len)`` too, which the routes
    read. ``q_len`` or ``kv_len`` may be 0 (nothing to disagree on; create_block_mask is skipped).

    Args:
        spec: The mask spec (must be valid for this shape).
        q_len, kv_len, batch, heads: The problem shape.
        block_sizes: ``(q_block, kv_block)`` pairs for the block-map checks.
        exact_blocks: Require the block map to equal the dense block classification exactly
            (the :class:`~flexattn_zoo.spec.BlockMap` contract). ``None``: exact except for ``&``,
            ``|``, ``~`` composites, whose maps are documented safe approximations; those must
            still have no false negatives in ``any`` and no false positives in ``full``.
        exact_lowest_key: Require ``lowest_visible_key`` (where offered) to be each row's lowest
            visible key, not only a lower bound. ``None``: exact except for ``&``, ``|``, ``~``
            composites, whose bounds may be lower.
        check_create_block_mask: Also compare with ``create_block_mask`` (which evaluates the
            ``mask_mod`` through ``vmap``, as flex does).
    """
    _check_call(
        "assert_mask_consistent",
        spec,
        MaskSpec,
        "a mask spec (e.g. masks.Causal())",
        q_len,
        kv_len,
        batch,
        heads,
    )
    _check_block_sizes(block_sizes)
    spec.validate(q_len, kv_len, batch, heads)
    dense = spec.dense(q_len, kv_len, batch=batch, heads=heads)
    if dense.dtype != torch.bool or dense.dim() != 4:
        raise AssertionError(
            f"{spec!r}: dense() must be a 4-d bool tensor, got {dense.dtype} {tuple(dense.shape)}"
        )
    b0, h0, lq, lkv = dense.shape
    if (lq, lkv) != (q_len, kv_len) or b0 not in (1, batch) or h0 not in (1, heads):
        raise AssertionError(
            f"{spec!r}: dense() shape {tuple(dense.shape)} is not [B|1, H|1, {q_len}, {kv_len}]"
        )
    dense = dense.cpu().expand(batch, heads, q_len, kv_len)
    # Kernels get the mask_mod of the spec bound to the lengths (e.g. bottom-right causal).
    bound = spec.bind(q_len, kv_len)
    if bound is not spec:
        _require_equal(
            "bind(q_len, kv_len).dense", bound.dense(q_len, kv_len, batch=batch, heads=heads), dense, spec
        )
    got = torch.as_tensor(bound.mask_mod()(*index_grids(batch, heads, q_len, kv_len)))
    if got.dtype != torch.bool:
        raise AssertionError(f"{spec!r}: mask_mod returned {got.dtype}, expected torch.bool")
    _require_equal("mask_mod", got, dense, spec)
    if not spec.uses_batch() and not bool((dense == dense[:1]).all()):
        raise AssertionError(f"{spec!r}: uses_batch() is False but the mask differs across batch rows")
    if not spec.uses_head() and not bool((dense == dense[:, :1]).all()):
        raise AssertionError(f"{spec!r}: uses_head() is False but the mask differs across heads")
    if exact_blocks is None:
        exact_blocks = not isinstance(spec, (And, Or, Not))
    # The routes read the forms and block map of the bound spec (Problem binds the mask), and
    # callers may ask the spec itself: both must describe the mask.
    checked = dict.fromkeys((spec, bound))  # one entry when bind() returns the spec itself
    for q_block, kv_block in block_sizes:
        _check_block_map(spec, bound, dense, q_block, kv_block, exact_blocks, check_create_block_mask)
    for s in checked:
        _check_forms(s, dense, batch)
    if exact_lowest_key is None:
        exact_lowest_key = not isinstance(spec, (And, Or, Not))
    for s in {spec, bound}:
        _check_future_keys(s, dense)
        _check_lowest_key(s, dense, exact_lowest_key)
        _check_one_run(s, dense)
    _check_key_starts(bound, dense)


def _check_key_starts(bound: MaskSpec, dense: torch.Tensor) -> None:
    """``past_key_starts`` (where offered) decides every pair with ``kv_idx <= q_idx`` as the
    mask does, and ``starts_mask_mod`` (where offered) equals the mask on every pair."""
    batch, heads, q_len, kv_len = dense.shape
    starts = bound.past_key_starts(q_len, kv_len)
    if starts is not None:
        what = f"past_key_starts({q_len}, {kv_len})"
        if starts.dtype != torch.int32 or starts.dim() not in (1, 2) or starts.shape[-1] < max(q_len, kv_len):
            raise AssertionError(
                f"{bound!r}: {what} must be int32 [L] or [B, L] with L >= {max(q_len, kv_len)}, "
                f"got {starts.dtype} {tuple(starts.shape)}"
            )
        # [L] -> [1, L]; not view(-1, L), which cannot infer the leading size when L == 0.
        rows = (starts.unsqueeze(0) if starts.dim() == 1 else starts).cpu()[:, :q_len]
        said = rows[:, None, :, None] <= torch.arange(kv_len).view(1, 1, 1, kv_len)
        past = torch.arange(kv_len).view(1, kv_len) <= torch.arange(q_len).view(q_len, 1)
        said = _broadcast_to_mask(what, said, dense, bound)
        wrong = (said != dense) & past
        if bool(wrong.any()):
            where = _first(wrong)
            verdict = "visible" if bool(said[where]) else "hidden"
            raise AssertionError(
                f"{bound!r}: {what} says query {where[2]}'s earlier key {where[3]} is {verdict} "
                f"(batch {where[0]}, head {where[1]}), unlike the mask"
            )
    spelled = bound.starts_mask_mod(q_len, kv_len)
    if spelled is not None:
        got = torch.as_tensor(spelled(*index_grids(batch, heads, q_len, kv_len)))
        _require_equal(f"starts_mask_mod({q_len}, {kv_len})", got, dense, bound)


def _check_future_keys(spec: MaskSpec, dense: torch.Tensor) -> None:
    """``hides_future_keys`` may only say True when no visible pair has ``kv_idx > q_idx``."""
    _, _, q_len, kv_len = dense.shape
    if not spec.hides_future_keys(q_len, kv_len):
        return
    future = torch.arange(kv_len).view(1, kv_len) > torch.arange(q_len).view(q_len, 1)
    seen = dense & future
    if bool(seen.any()):
        where = _first(seen)
        raise AssertionError(
            f"{spec!r}: hides_future_keys({q_len}, {kv_len}) is True but query {where[2]} sees the "
            f"later key {where[3]} (batch {where[0]}, head {where[1]})"
        )


def _check_lowest_key(spec: MaskSpec, dense: torch.Tensor, exact: bool) -> None:
    """``lowest_visible_key``: same shape and dtype as the queries, never decreasing, no visible
    key below it, and (``exact``) equal to each row's lowest visible key where the row sees one."""
    _, _, q_len, kv_len = dense.shape
    q_idx = torch.arange(q_len, dtype=torch.int64)
    lo = spec.lowest_visible_key(q_idx)
    if lo is None:
        return
    what = f"lowest_visible_key(arange({q_len}))"
    if not isinstance(lo, torch.Tensor) or lo.shape != q_idx.shape or lo.dtype != q_idx.dtype:
        got = f"{lo.dtype} {tuple(lo.shape)}" if isinstance(lo, torch.Tensor) else type(lo).__name__
        raise AssertionError(f"{spec!r}: {what} must be an int64 tensor of shape ({q_len},), got {got}")
    lo = lo.cpu()
    # Decoding passes [B, n_q] grids of positions: the bound must not depend on the layout.
    grid = spec.lowest_visible_key(q_idx.view(1, q_len).expand(2, q_len))
    if not (
        isinstance(grid, torch.Tensor)
        and grid.shape == (2, q_len)
        and torch.equal(grid.cpu(), lo.expand(2, q_len))
    ):
        raise AssertionError(
            f"{spec!r}: lowest_visible_key of a [2, {q_len}] grid of positions differs from {what}, row by row"
        )
    drops = lo[1:] < lo[:-1]
    if bool(drops.any()):
        i = int(torch.nonzero(drops)[0]) + 1
        raise AssertionError(
            f"{spec!r}: {what} decreases from query {i - 1} to {i} ({int(lo[i - 1])} -> {int(lo[i])}); "
            "the bound of a block's first query must hold for the whole block"
        )
    j = torch.arange(kv_len).view(1, kv_len)
    below = dense & (j < lo.view(q_len, 1))
    if bool(below.any()):
        where = _first(below)
        raise AssertionError(
            f"{spec!r}: {what} says query {where[2]} sees no key below {int(lo[where[2]])}, but it sees "
            f"key {where[3]} (batch {where[0]}, head {where[1]})"
        )
    if not exact:
        return
    seen = dense.any(dim=-1)
    # Each row's lowest visible key (kv_len where it sees none; the min over no keys at all,
    # kv_len == 0, is kv_len too rather than amin's error on an empty dimension).
    lowest = (
        torch.where(dense, j, kv_len).amin(dim=-1)
        if kv_len > 0
        else torch.zeros(seen.shape, dtype=torch.long)
    )
    loose = seen & (lowest != lo.clamp(min=0))
    if bool(loose.any()):
        where = _first(loose)
        raise AssertionError(
            f"{spec!r}: {what} is {int(lo[where[2]])} for query {where[2]}, whose lowest visible key is "
            f"{int(lowest[where])} (batch {where[0]}, head {where[1]}); pass exact_lowest_key=False to "
            "accept a lower bound"
        )


def _check_one_run(spec: MaskSpec, dense: torch.Tensor) -> None:
    """``sees_one_run`` (where True; checked at equal lengths, where it promises something): each
    row's visible keys are one run that holds the query and starts at ``lowest_visible_key``
    clamped to 0 (0 where that is None)."""
    _, _, q_len, kv_len = dense.shape
    if q_len != kv_len or q_len == 0 or not spec.sees_one_run():
        return
    q_idx = torch.arange(q_len, dtype=torch.int64)
    lo = spec.lowest_visible_key(q_idx)
    start = torch.zeros(q_len, dtype=torch.int64) if lo is None else lo.cpu().clamp(min=0)
    j = torch.arange(kv_len)
    visible = dense.sum(dim=-1)
    # One run from start through the query's own key: the run's length covers every visible key.
    stop = torch.where(dense, j, -1).amax(dim=-1)  # the highest visible key of each row
    run = (j >= start.view(q_len, 1)) & (j <= stop.unsqueeze(-1)) & (stop.unsqueeze(-1) >= 0)
    holds = dense[..., q_idx, q_idx]
    wrong = (run != dense) | ~holds.unsqueeze(-1)
    if bool(wrong.any()):
        b, h, i, key = _first(wrong)
        raise AssertionError(
            f"{spec!r}: sees_one_run() is True, but at Lq = Lkv = {q_len} query {i} (batch {b}, head "
            f"{h}) does not see exactly one run of keys from {int(start[i])} that holds it: key {key} is "
            f"{'visible' if bool(dense[b, h, i, key]) else 'hidden'} ({int(visible[b, h, i])} visible)"
        )


def _check_block_map(
    spec: MaskSpec,
    bound: MaskSpec,
    dense: torch.Tensor,
    q_block: int,
    kv_block: int,
    exact: bool,
    vs_create: bool,
) -> None:
    batch, heads, q_len, kv_len = dense.shape
    want_any, want_full = dense_block_map(dense, q_block, kv_block)
    # An empty problem has no elements to evaluate: create_block_mask would vmap the mask_mod
    # over an empty index range, which fails inside torch (IndexError from select()) for most
    # mask_mods, although the spec is fine. There is no block to compare either way.
    if vs_create and q_len > 0 and kv_len > 0:
        bm = create_block_mask(
            bound.mask_mod(),
            batch if bound.uses_batch() else None,
            heads if bound.uses_head() else None,
            q_len,
            kv_len,
            device="cpu",
            BLOCK_SIZE=(q_block, kv_block),
        )
        c_any, c_full = block_mask_map(bm, want_any.shape[-1])
        tag = f"create_block_mask any (blocks {q_block}x{kv_block})"
        _require_equal(tag, c_any, want_any, spec)
        _require_equal(tag.replace("any", "full"), c_full, want_full, spec)
    for s in dict.fromkeys((spec, bound)):  # both: see assert_mask_consistent
        _check_closed_form_blocks(s, q_len, kv_len, want_any, want_full, q_block, kv_block, exact)


def _check_closed_form_blocks(
    spec: MaskSpec,
    q_len: int,
    kv_len: int,
    want_any: torch.Tensor,
    want_full: torch.Tensor,
    q_block: int,
    kv_block: int,
    exact: bool,
) -> None:
    """``spec.block_map`` (where offered) against the dense block classification ``want_*``."""
    bmap = spec.block_map(q_len, kv_len, q_block, kv_block, "cpu")
    if bmap is None:
        return
    # Read with fz.block_mask's convention (as_4d: a 3-d map is [B, n_q, n_kv], not numpy's
    # right-aligned [H, n_q, n_kv]), so the check judges what the routes will use.
    got_any, got_full = as_4d(bmap.any.cpu()), as_4d(bmap.full.cpu())
    batch, heads, n_q, n_kv = want_any.shape
    if (
        got_any.dim() != 4
        or got_any.shape[-2:] != (n_q, n_kv)
        or got_any.shape[0] not in (1, batch)
        or got_any.shape[1] not in (1, heads)
        or got_full.shape != got_any.shape
    ):
        raise AssertionError(
            f"{spec!r}: block_map shapes any={tuple(bmap.any.shape)} full={tuple(bmap.full.shape)}, "
            f"expected [B|1, H|1, {n_q}, {n_kv}] with B, H = {batch}, {heads} (or [B|1, {n_q}, {n_kv}] "
            f"or [{n_q}, {n_kv}]) for blocks {q_block}x{kv_block}"
        )
    got_any, got_full = got_any.expand_as(want_any), got_full.expand_as(want_full)
    where = f"(blocks {q_block}x{kv_block})"
    if bool((want_any & ~got_any).any()):
        raise AssertionError(
            f"{spec!r}: block_map misses a visible block at {_first(want_any & ~got_any)} {where}"
        )
    if bool((got_full & ~want_full).any()):
        raise AssertionError(
            f"{spec!r}: block_map marks block {_first(got_full & ~want_full)} full but it has masked "
            f"elements {where}"
        )
    if bool((got_full & ~got_any).any()):
        raise AssertionError(f"{spec!r}: block_map full is not a subset of any {where}")
    if exact:
        hint = " (pass exact_blocks=False to accept a safe approximation)"
        _require_equal(f"block_map any {where}{hint}", got_any, want_any, spec)
        _require_equal(f"block_map full {where}{hint}", got_full, want_full, spec)


def _check_forms(spec: MaskSpec, dense: torch.Tensor, batch: int) -> None:
    _, _, q_len, kv_len = dense.shape
    sdpa = spec.sdpa_form(q_len, kv_len)
    if sdpa is not None:
        i = torch.arange(q_len).view(q_len, 1)
        j = torch.arange(kv_len).view(1, kv_len)
        # SDPA's is_causal is top-left aligned: key j visible to query i iff j <= i.
        want = (j <= i) if sdpa.is_causal else torch.ones(q_len, kv_len, dtype=torch.bool)
        if sdpa.attn_mask is not None:
            if sdpa.is_causal or sdpa.attn_mask.dtype != torch.bool:
                raise AssertionError(
                    f"{spec!r}: a mask's sdpa_form() attn_mask must be bool, without is_causal"
                )
            if sdpa.attn_mask.dim() != 4:
                raise AssertionError(
                    f"{spec!r}: a mask's sdpa_form() attn_mask must be 4-d [B|1, H|1, Lq|1, Lkv|1], "
                    f"got shape {tuple(sdpa.attn_mask.shape)}"
                )
            want = sdpa.attn_mask.cpu()
            if sdpa.empty_rows is False and not bool(dense.any(-1).all()):
                raise AssertionError(f"{spec!r}: sdpa_form() says no row is empty, but one is")
        what = f"sdpa_form {sdpa}"
        _require_equal(what, _broadcast_to_mask(what, want, dense, spec), dense, spec)
    varlen = spec.varlen_form(q_len, kv_len, batch)
    if varlen is not None:
        if q_len != kv_len and varlen.kv_segments is None:
            raise AssertionError(
                f"{spec!r}: varlen_form without kv_segments offered for q_len {q_len} != kv_len {kv_len}"
            )
        what = f"varlen_form {varlen}"
        said = varlen_dense(varlen, q_len, batch, kv_len)
        _require_equal(what, _broadcast_to_mask(what, said, dense, spec), dense, spec)
    split = spec.split_form(q_len, kv_len)
    if split is not None:
        what = f"split_form {split}"
        said = split_dense(split, q_len, kv_len)
        _require_equal(what, _broadcast_to_mask(what, said, dense, spec), dense, spec)
    # Forms offered only for Lq == Lkv, each with the [1, 1, L, L] mask it describes.
    square: tuple[tuple[str, Any, Callable[[Any, int], torch.Tensor]], ...] = (
        ("strided_form", spec.strided_form(q_len, kv_len), strided_dense),
        ("global_tokens_form", spec.global_tokens_form(q_len, kv_len), global_tokens_dense),
    )
    for name, form, paint in square:
        if form is None:
            continue
        if q_len != kv_len:
            raise AssertionError(f"{spec!r}: {name} offered for q_len {q_len} != kv_len {kv_len}")
        what = f"{name} {form}"
        _require_equal(what, _broadcast_to_mask(what, paint(form, q_len), dense, spec), dense, spec)


def assert_score_consistent(
    spec: ScoreSpec,
    *,
    batch: int = 1,
    heads: int | None = None,
    q_len: int = 33,
    kv_len: int = 47,
    seed: int = 0,
    magnitude: float = 4.0,
    rtol: float = 1e-6,
    atol: float = 1e-6,
) -> None:
    """Check a score spec's ``score_mod`` (exact variant) against ``spec.dense`` in float64, its
    ``future_keys_hidden=True`` variant on the pairs with ``kv_idx <= q_idx``, and the scores its
    soft-cap and linear-bias forms (where offered) describe.

    ``heads`` defaults to the spec's own ``num_heads`` where it has one (ALiBi's slopes, a
    per-head table), else 1. The default tolerances admit score mods that compute in float32, as
    kernels do; specs that compute in the score's dtype agree to float64 precision.
    """
    what = "a score spec (e.g. score_mods.SoftCap(cap=30.0))"
    if heads is None and isinstance(spec, ScoreSpec):
        heads = getattr(spec, "num_heads", None) or 1
    _check_call("assert_score_consistent", spec, ScoreSpec, what, q_len, kv_len, batch, heads)
    magnitude = check_tolerance("assert_score_consistent(magnitude=...)", magnitude, positive=True)
    rtol = check_tolerance("assert_score_consistent(rtol=...)", rtol)
    atol = check_tolerance("assert_score_consistent(atol=...)", atol)
    spec.validate(q_len, kv_len, batch, heads)
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, heads, q_len, kv_len, dtype=torch.float64, generator=gen) * magnitude
    want = spec.dense(scores.clone())
    past = torch.arange(kv_len).view(1, kv_len) <= torch.arange(q_len).view(q_len, 1)
    for hidden, counted in ((False, torch.ones_like(past)), (True, past)):
        fn = spec.score_mod(fast=False, future_keys_hidden=hidden)
        got = fn(scores.clone(), *index_grids(batch, heads, q_len, kv_len))
        what = "score_mod(future_keys_hidden=True)" if hidden else "score_mod"
        if not isinstance(got, torch.Tensor) or not got.dtype.is_floating_point:
            raise AssertionError(f"{spec!r}: {what} must return a floating tensor, got {type(got).__name__}")
        got = torch.broadcast_to(got, want.shape).double()
        # Pairs the variant need not get right count as agreeing.
        bad, err = _mismatch(got, want, rtol, atol)
        bad, err = bad & counted, torch.where(counted, err, 0.0)
        if bool(bad.any()):
            where = _first(bad)
            raise AssertionError(
                f"{spec!r}: {what} differs from the dense oracle at index {where}: got "
                f"{got[where].item():.10g}, oracle {want[where].item():.10g} (max abs error {float(err.max()):.3e})"
            )
    _check_score_forms(spec, scores, want, heads, rtol, atol)


def _check_score_forms(
    spec: ScoreSpec, scores: torch.Tensor, want: torch.Tensor, heads: int, rtol: float, atol: float
) -> None:
    """The soft-cap and linear-bias forms against the dense oracle ``want`` of ``scores``."""
    cap = spec.softcap_form()
    if cap is not None:
        if not (math.isfinite(cap.cap) and cap.cap > 0):
            raise AssertionError(f"{spec!r}: softcap_form() cap must be finite and > 0, got {cap.cap}")
        if cap.approx and not spec.has_fast_variant():
            # A kernel reading the form would approximate tanh where the spec asked for exactness.
            raise AssertionError(f"{spec!r}: softcap_form() allows approx but has_fast_variant() is False")
        _require_close(f"softcap_form {cap}", cap.cap * torch.tanh(scores / cap.cap), want, spec, rtol, atol)
    linear = spec.linear_bias_form()
    if linear is not None:
        if len(linear.slopes) != heads:
            raise AssertionError(
                f"{spec!r}: linear_bias_form() has {len(linear.slopes)} slopes for {heads} query heads"
            )
        _, _, q_len, kv_len = scores.shape
        slopes = torch.tensor(linear.slopes, dtype=torch.float64).view(1, heads, 1, 1)
        dist = (torch.arange(q_len).view(q_len, 1) - torch.arange(kv_len).view(1, kv_len)).abs()
        _require_close(f"linear_bias_form {linear}", scores - slopes * dist, want, spec, rtol, atol)
    _, _, q_len, kv_len = scores.shape
    sdpa = spec.sdpa_form(q_len, kv_len)
    if sdpa is not None:
        if sdpa.is_causal or sdpa.attn_mask is None or not sdpa.attn_mask.is_floating_point():
            raise AssertionError(f"{spec!r}: a score spec's sdpa_form() must be a float attn_mask alone")
        bias = sdpa.attn_mask.detach().to(scores.device, torch.float64)
        _require_close("sdpa_form attn_mask", scores + bias, want, spec, rtol, atol)


def _mismatch(
    got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bad, err)``: where ``got`` disagrees with the oracle ``want``, and the absolute errors.

    Equal values agree, equal infinities included (a Bias's ``-inf`` hides a key). Otherwise a
    non-finite value on either side is a disagreement: ``|x - (-inf)|`` is ``inf`` and so is the
    relative tolerance ``rtol * inf``, so the tolerance test alone would let a score_mod leave
    visible a key the oracle hides, and NaN fails every comparison, so it would let a NaN oracle
    (or a NaN against it) pass.
    """
    same = got == want
    err = torch.where(same, 0.0, (got - want).abs())
    finite = torch.isfinite(got) & torch.isfinite(want)
    bad = ~same & (~finite | (err > atol + rtol * want.abs()))
    return bad, err


def _require_close(
    what: str, got: torch.Tensor, want: torch.Tensor, spec: Spec, rtol: float, atol: float
) -> None:
    bad, err = _mismatch(got, want, rtol, atol)
    if bool(bad.any()):
        where = _first(bad)
        raise AssertionError(
            f"{spec!r}: {what} differs from the dense oracle at index {where}: it gives "
            f"{got[where].item():.10g}, oracle {want[where].item():.10g} (max abs error {float(err.max()):.3e})"
        )
