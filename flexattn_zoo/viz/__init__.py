"""Heatmaps of masks and score mods (``fz.viz``), and the pictures of ``flexattn-zoo show``.

Any mask or score mod works: a registry name, a spec (``masks.Causal()``, ``a & b``,
``score_mods.Alibi(num_heads=8)``), a raw flex callable (``mask_mod(b, h, q_idx, kv_idx)``,
``score_mod(score, b, h, q_idx, kv_idx)``) or a tensor (a bool mask, a float bias), as
``fz.attention`` takes them. One batch row and one head are drawn at a time:

* :func:`mask_matrix` / :func:`score_matrix`: the ``[Lq, Lkv]`` matrix itself (bool, or float64
  scores after the score mod), for that row and head. The spec's kernel function is evaluated on an
  ``Lq x Lkv`` index grid, nothing larger, and only up to :data:`DENSE_LIMIT` elements: this is the
  dense picture you ask for, for small problems. :func:`heatmap` picks the one that fits.
* :func:`text`: the same as a text picture (downsampled to at most ``max_cells`` a side; masks
  longer than :data:`DENSE_LIMIT` are sampled).
* :func:`write_png`: a heatmap image. It needs matplotlib, the optional ``viz`` extra
  (``pip install 'flexattn-zoo[viz]'``), imported only then; without it :class:`MissingDependency`.

Legend of every text picture: ``#`` visible (or a full block), ``+`` partly visible (a cell that
stands for several positions, or a partial block), ``.`` masked (or an empty block). Score
pictures print the numbers (up to 16 x 16) or shade from ``' '`` (lowest) to ``'@'`` (highest).

The lower-level pieces (cell grids, BlockMask pictures, shading) are what ``flexattn-zoo show``
prints with.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import torch

from flexattn_zoo._compat import BlockMask
from flexattn_zoo.coercion import as_mask_spec, as_score_spec
from flexattn_zoo.functions import _positional_arity
from flexattn_zoo.registry import MASKS, SCORES, did_you_mean
from flexattn_zoo.spec import MaskSpec, ScoreSpec

#: Pictures wider than this many columns are downsampled.
MAX_CELLS = 64
#: The largest ``Lq x Lkv`` matrix drawn (:func:`mask_matrix`, :func:`score_matrix`); above it
#: mask pictures are sampled from the ``mask_mod`` instead, so none holds a huge tensor.
DENSE_LIMIT = 1 << 24
#: Sample points per cell side in sampled mode.
SAMPLES_PER_CELL = 8
#: Block size of the BlockMask ``show`` describes (fz.block_mask's default).
BLOCK_SIZE = 128
#: Above this many blocks ``show`` builds no BlockMask (its index tensors and the block map behind
#: them grow as n_q x n_kv blocks: 4M blocks took ~3 s and ~0.5 GB; --len 10M would be 6e9).
BLOCK_LIMIT = 1 << 22
#: Longest sequence drawn (sampled): positions are int64 (and sample offsets exact in float64).
MAX_LENGTH = 1 << 52

FULL, PARTIAL, EMPTY = "#", "+", "."
_SHADES = " .:-=+*#%@"


class MissingDependency(RuntimeError):
    """An optional dependency (matplotlib for PNGs) is not installed."""


@dataclasses.dataclass(frozen=True)
class CellGrid:
    """Fraction of visible positions per picture cell.

    ``frac[r, c]`` covers queries ``[r * row_step, (r + 1) * row_step)`` and keys
    ``[c * col_step, (c + 1) * col_step)``. ``sampled`` means fractions come from sample points,
    so ``#``/``.`` may hide a few masked/visible positions.
    """

    frac: torch.Tensor
    row_step: int
    col_step: int
    sampled: bool
    visible: int | None = None  # exact count of visible positions (None when sampled)

    @property
    def downsampled(self) -> bool:
        return self.row_step > 1 or self.col_step > 1


def _step(length: int, max_cells: int) -> int:
    # Every picture's cell size comes through here: max_cells 0 would divide by zero.
    return max(1, -(-length // _positive("max_cells", max_cells)))


def _pooled_fraction(mask: torch.Tensor, row_step: int, col_step: int) -> torch.Tensor:
    """Mean of ``mask`` over ``row_step x col_step`` tiles; edge tiles average their real size."""
    rows, cols = mask.shape
    n_r, n_c = -(-rows // row_step), -(-cols // col_step)
    pad = (0, n_c * col_step - cols, 0, n_r * row_step - rows)
    vis = torch.nn.functional.pad(mask.to(torch.float32), pad)
    cnt = torch.nn.functional.pad(torch.ones_like(mask, dtype=torch.float32), pad)
    vis = vis.view(n_r, row_step, n_c, col_step).sum(dim=(1, 3))
    cnt = cnt.view(n_r, row_step, n_c, col_step).sum(dim=(1, 3))
    return vis / cnt


# ---------------------------------------------------------------------------------------------
# Matrices: one batch row and head, Lq x Lkv


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def _lengths(q_len: Any, kv_len: Any) -> tuple[int, int]:
    q = _positive("q_len", q_len)
    kv = q if kv_len is None else _positive("kv_len", kv_len)
    for name, length in (("q_len", q), ("kv_len", kv)):
        if length > MAX_LENGTH:
            raise ValueError(f"{name} must be at most 2**52 ({MAX_LENGTH}) to draw, got {length}")
    return q, kv


def _dense_size(q_len: int, kv_len: int) -> None:
    if q_len * kv_len > DENSE_LIMIT:
        raise ValueError(
            f"a {q_len} x {kv_len} matrix is above fz.viz.DENSE_LIMIT ({DENSE_LIMIT} elements); "
            "draw a smaller problem, or a downsampled mask picture with fz.viz.text"
        )


def _sizes(
    spec: MaskSpec | ScoreSpec,
    q_len: int,
    kv_len: int,
    batch_index: Any,
    head_index: Any,
    batch: Any,
    heads: Any,
) -> tuple[int, int, int, int]:
    """``(batch_index, head_index, batch, heads)`` checked, and the spec validated for the
    problem ``batch x heads x Lq x Lkv``. Sizes left out are the smallest holding the index (a
    score spec's ``num_heads`` for the heads)."""
    for name, value in (("batch_index", batch_index), ("head_index", head_index)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    guessed = batch is None or heads is None
    if batch is None:
        batch = batch_index + 1
    if heads is None:
        heads = max(head_index + 1, getattr(spec, "num_heads", 0) or 0)
    batch, heads = _positive("batch", batch), _positive("heads", heads)
    if not 0 <= batch_index < batch:
        raise ValueError(f"batch_index must be in [0, batch = {batch}), got {batch_index}")
    if not 0 <= head_index < heads:
        raise ValueError(f"head_index must be in [0, heads = {heads}), got {head_index}")
    try:
        spec.validate(q_len, kv_len, batch, heads)
    except ValueError as exc:
        if not guessed:
            raise
        raise ValueError(
            f"{exc} (drawn as a problem of batch={batch}, heads={heads}: pass batch= and heads=, "
            "the sizes the spec is made for)"
        ) from exc
    return batch_index, head_index, batch, heads


def _evaluation_device(spec: MaskSpec | ScoreSpec) -> torch.device:
    """Where the spec's function can run: the device of the tensors it holds or captures (a raw
    callable's tensors cannot be moved; a zoo spec's move with ``spec.to``)."""
    held = spec.tensors()
    return held[0].device if held else torch.device("cpu")


def _grids(
    batch_index: int, head_index: int, q_len: int, kv_len: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """int32 ``b``, ``h`` ``[1, 1, 1, 1]``, ``q_idx`` ``[1, 1, Lq, 1]``, ``kv_idx`` ``[1, 1, 1, Lkv]``:
    flex's index dtype, broadcasting to one ``Lq x Lkv`` plane."""
    i32 = torch.int32
    return (
        torch.full((1, 1, 1, 1), batch_index, dtype=i32, device=device),
        torch.full((1, 1, 1, 1), head_index, dtype=i32, device=device),
        torch.arange(q_len, dtype=i32, device=device).view(1, 1, q_len, 1),
        torch.arange(kv_len, dtype=i32, device=device).view(1, 1, 1, kv_len),
    )


def mask_matrix(
    mask: Any,
    q_len: int,
    kv_len: int | None = None,
    *,
    batch_index: int = 0,
    head_index: int = 0,
    batch: int | None = None,
    heads: int | None = None,
) -> torch.Tensor:
    """The mask of one batch row and head, a bool ``[Lq, Lkv]`` CPU tensor (True = visible).

    Args:
        mask: a registry name, a mask spec, a ``mask_mod(b, h, q_idx, kv_idx)`` callable, or a
            bool tensor (``masks.Dense``), as ``fz.attention``'s ``mask=`` takes them.
        q_len, kv_len: the lengths (``kv_len`` defaults to ``q_len``); ``q_len * kv_len`` at most
            :data:`DENSE_LIMIT`.
        batch_index, head_index: the batch row and head drawn.
        batch, heads: the problem's batch size and head count, which the spec is validated
            against (a per-row ``Document``, a per-head ``Dense`` or ``BlockSelect`` is made for
            some); by default the smallest that hold the indices.

    The spec's ``mask_mod`` (bound to the lengths, as kernels run it) is evaluated on an
    ``Lq x Lkv`` index grid for that row and head, on the device of the tensors the spec holds.
    """
    spec = as_mask_spec(mask, arg="mask")
    if spec is None:
        raise TypeError("mask must be a mask spec, registry name, mask_mod callable or bool tensor, not None")
    q_len, kv_len = _lengths(q_len, kv_len)
    _dense_size(q_len, kv_len)
    b, h, _, _ = _sizes(spec, q_len, kv_len, batch_index, head_index, batch, heads)
    device = _evaluation_device(spec)
    mod = spec.to(device).bind(q_len, kv_len).mask_mod()
    out = torch.as_tensor(mod(*_grids(b, h, q_len, kv_len, device)))
    return torch.broadcast_to(out, (1, 1, q_len, kv_len))[0, 0].to("cpu", torch.bool).clone()


def score_matrix(
    score_mod: Any,
    q_len: int,
    kv_len: int | None = None,
    *,
    scores: torch.Tensor | None = None,
    batch_index: int = 0,
    head_index: int = 0,
    batch: int | None = None,
    heads: int | None = None,
) -> torch.Tensor:
    """The scores of one batch row and head after the score mod, a float64 ``[Lq, Lkv]`` CPU tensor.

    Args:
        score_mod: a registry name, a score spec, a ``score_mod(score, b, h, q_idx, kv_idx)``
            callable, or a float bias tensor (``score_mods.Bias``), as ``fz.attention`` takes them.
        q_len, kv_len: the lengths (``kv_len`` defaults to ``q_len``); ``q_len * kv_len`` at most
            :data:`DENSE_LIMIT`.
        scores: the (scaled) scores the mod is applied to, a float tensor broadcastable to
            ``[Lq, Lkv]``; default zeros, so the result is the bias the mod adds (ALiBi's
            ``-slope[h] * |i - j|``).
        batch_index, head_index, batch, heads: as in :func:`mask_matrix` (``heads`` defaults to a
            spec's ``num_heads``, e.g. ALiBi's).

    The exact ``score_mod`` (no fast approximation) is evaluated in float64 on an ``Lq x Lkv``
    index grid for that row and head.
    """
    spec = as_score_spec(score_mod, arg="score_mod")
    if spec is None:
        raise TypeError(
            "score_mod must be a score spec, registry name, score_mod callable or float tensor, not None"
        )
    q_len, kv_len = _lengths(q_len, kv_len)
    _dense_size(q_len, kv_len)
    b, h, _, _ = _sizes(spec, q_len, kv_len, batch_index, head_index, batch, heads)
    device = _evaluation_device(spec)
    if scores is None:
        given = torch.zeros(1, 1, q_len, kv_len, dtype=torch.float64, device=device)
    else:
        if not isinstance(scores, torch.Tensor) or not scores.is_floating_point():
            got = scores.dtype if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise TypeError(f"scores must be a floating tensor broadcastable to [Lq, Lkv], got {got}")
        try:
            plane = torch.broadcast_to(scores.detach(), (q_len, kv_len))
        except RuntimeError as exc:
            raise ValueError(
                f"scores of shape {tuple(scores.shape)} do not broadcast to [Lq, Lkv] = [{q_len}, {kv_len}]"
            ) from exc
        given = plane.to(device, torch.float64).reshape(1, 1, q_len, kv_len).clone()
    out = spec.to(device).score_mod()(given, *_grids(b, h, q_len, kv_len, device))
    out = torch.broadcast_to(torch.as_tensor(out), (1, 1, q_len, kv_len))[0, 0]
    return out.detach().to("cpu", torch.float64).clone()


def _kind(obj: Any) -> str:
    """``"mask"`` or ``"score"``: what ``obj`` is (a name is looked up in both registries)."""
    if isinstance(obj, MaskSpec):
        return "mask"
    if isinstance(obj, ScoreSpec):
        return "score"
    if isinstance(obj, str):
        if obj in MASKS:
            return "mask"
        if obj in SCORES:
            return "score"
        known = MASKS.names() + SCORES.names()
        raise ValueError(
            f"unknown mask or score_mod {obj!r}; masks: {', '.join(MASKS.names())}; "
            f"score mods: {', '.join(SCORES.names())}.{did_you_mean(obj, known)}"
        )
    if isinstance(obj, torch.Tensor):
        return "mask" if obj.dtype == torch.bool else "score"
    if callable(obj) and not isinstance(obj, type):
        arity = _positional_arity(obj)
        if arity in (4, 5):
            return "mask" if arity == 4 else "score"
        raise TypeError(
            f"cannot tell whether {getattr(obj, '__name__', obj)!r} is a mask_mod (4 positional "
            "arguments) or a score_mod (5); call fz.viz.mask_matrix or fz.viz.score_matrix"
        )
    raise TypeError(
        "expected a mask or score spec, a registry name, a mask_mod / score_mod callable or a tensor, "
        f"got {type(obj).__name__}"
    )


def heatmap(
    spec: Any,
    q_len: int,
    kv_len: int | None = None,
    *,
    scores: torch.Tensor | None = None,
    batch_index: int = 0,
    head_index: int = 0,
    batch: int | None = None,
    heads: int | None = None,
) -> torch.Tensor:
    """:func:`mask_matrix` for a mask, :func:`score_matrix` for a score mod (a raw callable is
    told by its arity: 4 positional arguments a mask_mod, 5 a score_mod). ``scores`` only applies
    to score mods."""
    kw: dict[str, Any] = {
        "batch_index": batch_index,
        "head_index": head_index,
        "batch": batch,
        "heads": heads,
    }
    if _kind(spec) == "mask":
        if scores is not None:
            raise ValueError("scores= applies to score mods; a mask has no scores to modify")
        return mask_matrix(spec, q_len, kv_len, **kw)
    return score_matrix(spec, q_len, kv_len, scores=scores, **kw)


def text(
    spec: Any,
    q_len: int,
    kv_len: int | None = None,
    *,
    scores: torch.Tensor | None = None,
    batch_index: int = 0,
    head_index: int = 0,
    batch: int | None = None,
    heads: int | None = None,
    max_cells: int = MAX_CELLS,
) -> str:
    """A text picture of a mask or score mod for one batch row and head, one line per row.

    A mask: ``#`` visible, ``.`` masked, ``+`` partly visible where a character stands for
    several positions (at most ``max_cells`` characters a side; above :data:`DENSE_LIMIT`
    positions sampled at points of each character). A score mod (arguments as in
    :func:`score_matrix`): the numbers with 2 decimals up to 16 x 16, else shades from ``' '``
    (lowest) to ``'@'`` (highest), averaged per character.
    """
    max_cells = _positive("max_cells", max_cells)
    kw: dict[str, Any] = {
        "batch_index": batch_index,
        "head_index": head_index,
        "batch": batch,
        "heads": heads,
    }
    if _kind(spec) == "score":
        matrix = score_matrix(spec, q_len, kv_len, scores=scores, **kw)
        if matrix.shape[0] <= 16 and matrix.shape[1] <= 16:
            return "\n".join(render_numbers(matrix))
        return "\n".join(render_shades(matrix, max_cells)[0])
    if scores is not None:
        raise ValueError("scores= applies to score mods; a mask has no scores to modify")
    cells = mask_cells(spec, q_len, kv_len if kv_len is not None else q_len, max_cells=max_cells, **kw)
    return "\n".join(render_cells(cells.frac))


def mask_cells(
    mask: Any,
    q_len: int,
    kv_len: int,
    *,
    batch: int | None = None,
    heads: int | None = None,
    batch_index: int = 0,
    head_index: int = 0,
    max_cells: int = MAX_CELLS,
) -> CellGrid:
    """The visible fraction of each cell of a picture at most ``max_cells`` wide and tall (arguments
    as in :func:`mask_matrix`): exact from :func:`mask_matrix` up to :data:`DENSE_LIMIT`
    positions, sampled from the ``mask_mod`` above."""
    q_len, kv_len = _lengths(q_len, kv_len)
    row_step, col_step = _step(q_len, max_cells), _step(kv_len, max_cells)
    kw: dict[str, Any] = {
        "batch_index": batch_index,
        "head_index": head_index,
        "batch": batch,
        "heads": heads,
    }
    if q_len * kv_len <= DENSE_LIMIT:
        dense = mask_matrix(mask, q_len, kv_len, **kw)
        frac = _pooled_fraction(dense, row_step, col_step)
        return CellGrid(frac, row_step, col_step, False, int(dense.sum()))
    spec = as_mask_spec(mask, arg="mask")
    if spec is None:
        raise TypeError("mask must be a mask spec, registry name, mask_mod callable or bool tensor, not None")
    b, h, _, _ = _sizes(spec, q_len, kv_len, batch_index, head_index, batch, heads)
    # Sampled mode: evaluate mask_mod at SAMPLES_PER_CELL^2 points of each cell (both cell edges
    # included), never the whole mask.
    device = _evaluation_device(spec)
    mod = spec.to(device).bind(q_len, kv_len).mask_mod()

    def sample_points(length: int, step: int) -> torch.Tensor:
        n = -(-length // step)
        starts = torch.arange(n, dtype=torch.int64) * step
        last = torch.clamp(starts + step - 1, max=length - 1)
        # float64 offsets (float32 would round them past the cell's end at lengths beyond 2^24).
        t = torch.linspace(0.0, 1.0, SAMPLES_PER_CELL, dtype=torch.float64)
        offsets = (t[None, :] * (last - starts)[:, None].double()).round().long()
        return torch.minimum(starts[:, None] + offsets, last[:, None]).reshape(-1).to(device)

    qs, ks = sample_points(q_len, row_step), sample_points(kv_len, col_step)
    try:
        vis = mod(
            torch.tensor(b, device=device), torch.tensor(h, device=device), qs.view(-1, 1), ks.view(1, -1)
        )
        vis = torch.broadcast_to(torch.as_tensor(vis), (qs.numel(), ks.numel())).cpu()
    except Exception as exc:  # a user mask_mod written only for vmap'd scalars
        raise ValueError(
            f"cannot sample this mask at {q_len} x {kv_len} ({type(exc).__name__}: {exc}); "
            f"try a length with len * kv_len <= {DENSE_LIMIT}"
        ) from exc
    frac = _pooled_fraction(vis.bool(), SAMPLES_PER_CELL, SAMPLES_PER_CELL)
    return CellGrid(frac, row_step, col_step, True)


def render_cells(frac: torch.Tensor) -> list[str]:
    """One string per row: ``#`` all visible, ``+`` partly, ``.`` none."""
    lines = []
    for row in frac.tolist():
        lines.append("".join(FULL if f >= 1.0 else EMPTY if f <= 0.0 else PARTIAL for f in row))
    return lines


# ---------------------------------------------------------------------------------------------
# Block masks


def _scatter_blocks(num: torch.Tensor, idx: torch.Tensor, n_kv: int) -> torch.Tensor:
    """Dense ``[..., n_q, n_kv]`` bool of the blocks listed in ``idx[..., :num]``."""
    width = idx.shape[-1]
    listed = torch.arange(width) < num.unsqueeze(-1)
    cols = torch.where(listed, idx.long().clamp(0, n_kv - 1), torch.full_like(idx.long(), n_kv))
    out = torch.zeros(*idx.shape[:-1], n_kv + 1, dtype=torch.bool)
    out.scatter_(-1, cols, True)
    return out[..., :n_kv]


def _block_mask_lengths(fn: str, block_mask: Any, q_len: Any, kv_len: Any) -> tuple[int, int]:
    """The lengths of a BlockMask picture, checked with the BlockMask itself (anything else has
    none of the index tensors read here)."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"{fn}(block_mask=...) must be a BlockMask (e.g. fz.block_mask(spec, q_len, kv_len)), "
            f"got {type(block_mask).__name__}"
        )
    return _lengths(q_len, kv_len)


def _stored_index(name: str, value: Any, size: int) -> int:
    """``value`` as an index into a BlockMask dimension of ``size`` stored entries: any index >= 0
    where one entry is stored for every row or head (broadcast), else one in ``[0, size)``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0 or (size > 1 and value >= size):
        raise ValueError(f"{name} must be in [0, {size}) (the BlockMask stores {size}), got {value}")
    return 0 if size == 1 else value


def block_codes(
    block_mask: Any, q_len: int, kv_len: int, *, batch_index: int = 0, head_index: int = 0
) -> torch.Tensor:
    """``[n_q_blocks, n_kv_blocks]`` int8: 2 full block, 1 partial block, 0 empty block."""
    q_len, kv_len = _block_mask_lengths("block_codes", block_mask, q_len, kv_len)
    qb, kvb = block_mask.BLOCK_SIZE
    n_q, n_kv = -(-q_len // qb), -(-kv_len // kvb)
    kv_num = block_mask.kv_num_blocks.cpu()
    b = _stored_index("batch_index", batch_index, kv_num.shape[0])
    h = _stored_index("head_index", head_index, kv_num.shape[1])
    partial = _scatter_blocks(kv_num[b, h], block_mask.kv_indices.cpu()[b, h], n_kv)[:n_q]
    codes = partial.to(torch.int8)
    if block_mask.full_kv_num_blocks is not None:
        full = _scatter_blocks(
            block_mask.full_kv_num_blocks.cpu()[b, h], block_mask.full_kv_indices.cpu()[b, h], n_kv
        )[:n_q]
        codes = torch.where(full, torch.tensor(2, dtype=torch.int8), codes)
    return codes


def block_counts(block_mask: Any, q_len: int, kv_len: int) -> dict[str, int]:
    """Counts of full / partial / empty blocks over every (batch, head) the mask stores.

    Block sparsity is ``empty / total``. (``BlockMask.sparsity()`` divides by ``Lq * Lkv`` but
    counts whole blocks, so it goes negative when a length is not a multiple of the block size.)
    """
    q_len, kv_len = _block_mask_lengths("block_counts", block_mask, q_len, kv_len)
    qb, kvb = block_mask.BLOCK_SIZE
    n_q, n_kv = -(-q_len // qb), -(-kv_len // kvb)
    partial = int(block_mask.kv_num_blocks[..., :n_q].sum())
    full = 0 if block_mask.full_kv_num_blocks is None else int(block_mask.full_kv_num_blocks[..., :n_q].sum())
    total = n_q * n_kv * block_mask.kv_num_blocks.shape[0] * block_mask.kv_num_blocks.shape[1]
    return {"full": full, "partial": partial, "empty": total - full - partial, "total": total}


def render_block_codes(codes: torch.Tensor, max_cells: int = MAX_CELLS) -> tuple[list[str], int, int]:
    """Text picture of block codes, grouping blocks when there are more than ``max_cells``.

    A group is ``#`` if every block in it is full, ``.`` if every one is empty, ``+`` otherwise.
    Returns ``(lines, rows_per_cell, cols_per_cell)``.
    """
    r_step, c_step = _step(codes.shape[0], max_cells), _step(codes.shape[1], max_cells)
    all_full = _pooled_fraction(codes == 2, r_step, c_step)
    any_vis = _pooled_fraction(codes > 0, r_step, c_step)
    lines = []
    for full_row, any_row in zip(all_full.tolist(), any_vis.tolist(), strict=True):
        lines.append(
            "".join(
                FULL if f >= 1.0 else EMPTY if a <= 0.0 else PARTIAL
                for f, a in zip(full_row, any_row, strict=True)
            )
        )
    return lines, r_step, c_step


# ---------------------------------------------------------------------------------------------
# Score mods


def score_response(spec: ScoreSpec, inputs: list[float], *, heads: int, head_index: int = 0) -> list[float]:
    """``spec`` applied to each input score at position ``(0, 0)`` of batch row 0 and one head."""
    score = as_score_spec(spec, arg="spec")
    if score is None:
        raise TypeError(
            "score_response(spec=...) must be a score spec, a registry name or a score_mod callable"
        )
    heads = _positive("heads", heads)
    if isinstance(head_index, bool) or not isinstance(head_index, int):
        raise TypeError(f"head_index must be an int, got {type(head_index).__name__}")
    if not 0 <= head_index < heads:
        raise ValueError(f"head_index must be in [0, heads = {heads}), got {head_index}")
    # The score_mod at the indices (0, head_index, 0, 0), as score_matrix evaluates it, with the
    # inputs on a leading axis the indices broadcast over: a batch axis of the inputs would read
    # input n at batch row n of a spec that depends on the row (a per-row Bias, Graphormer).
    device = _evaluation_device(score)
    given = torch.tensor(inputs, dtype=torch.float64, device=device).view(-1, 1, 1, 1)
    out = score.to(device).score_mod()(given, *_grids(0, head_index, 1, 1, device))
    return torch.broadcast_to(torch.as_tensor(out), given.shape).reshape(-1).to("cpu", torch.float64).tolist()


def render_numbers(matrix: torch.Tensor, *, digits: int = 2) -> list[str]:
    """Right-aligned numbers, one row per line (for small matrices)."""
    cells = [[f"{x:.{digits}f}" for x in row] for row in matrix.tolist()]
    width = max((len(c) for row in cells for c in row), default=1)
    return [" ".join(c.rjust(width) for c in row) for row in cells]


def render_shades(matrix: torch.Tensor, max_cells: int = MAX_CELLS) -> tuple[list[str], int, int]:
    """Shade characters from ``' '`` (minimum) to ``'@'`` (maximum), cell-averaged.

    ``-inf`` (a hidden key, or an activation weight of 0) is drawn as the lowest shade and
    ``+inf`` as the highest: both are first clamped to the finite extremes of ``matrix``, so they
    neither take part in the scale nor turn a cell's mean infinite. NaN counts as 0.

    Returns ``(lines, row_step, col_step)``.
    """
    r_step, c_step = _step(matrix.shape[0], max_cells), _step(matrix.shape[1], max_cells)
    values = matrix.double()
    finite_values = values[torch.isfinite(values)]
    low, high = (
        (float(finite_values.min()), float(finite_values.max())) if finite_values.numel() else (0.0, 0.0)
    )
    # Not 0 for +-inf: beside negative scores (ALiBi's) a hidden key would be drawn brightest.
    finite = torch.nan_to_num(values, nan=0.0, neginf=low, posinf=high)
    rows, cols = finite.shape
    n_r, n_c = -(-rows // r_step), -(-cols // c_step)
    pad = (0, n_c * c_step - cols, 0, n_r * r_step - rows)
    total = torch.nn.functional.pad(finite, pad).view(n_r, r_step, n_c, c_step).sum(dim=(1, 3))
    count = (
        torch.nn.functional.pad(torch.ones_like(finite), pad).view(n_r, r_step, n_c, c_step).sum(dim=(1, 3))
    )
    mean = total / count
    lo, hi = float(mean.min()), float(mean.max())
    span = hi - lo
    top = len(_SHADES) - 1
    lines = []
    for row in mean.tolist():
        lines.append("".join(_SHADES[0 if span == 0 else round((x - lo) / span * top)] for x in row))
    return lines, r_step, c_step


# ---------------------------------------------------------------------------------------------
# PNG (optional matplotlib)


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _require_matplotlib() -> None:
    if not have_matplotlib():
        raise MissingDependency(
            "writing a PNG needs matplotlib, which is not installed: pip install 'flexattn-zoo[viz]'"
        )


def write_png(
    path: str,
    spec: Any,
    q_len: int,
    kv_len: int | None = None,
    *,
    title: str | None = None,
    scores: torch.Tensor | None = None,
    batch_index: int = 0,
    head_index: int = 0,
    batch: int | None = None,
    heads: int | None = None,
) -> None:
    """Write a heatmap of a mask or score mod (one batch row and head) to ``path`` as a PNG.

    Arguments as in :func:`heatmap`. A mask is drawn as the visible fraction of cells at most 512
    a side (exact up to :data:`DENSE_LIMIT` positions, sampled above), a score mod as its
    :func:`score_matrix` (``-inf``, a hidden key, left blank). ``title`` defaults to a
    description of the spec.

    Raises:
        MissingDependency: matplotlib (the ``viz`` extra) is not installed; checked first.
    """
    _require_matplotlib()
    q_len, kv_len = _lengths(q_len, kv_len)
    kw: dict[str, Any] = {
        "batch_index": batch_index,
        "head_index": head_index,
        "batch": batch,
        "heads": heads,
    }
    where = f"batch row {batch_index}, head {head_index}"
    name = spec if isinstance(spec, str) else getattr(spec, "__name__", None) or type(spec).__name__
    if _kind(spec) == "mask":
        if scores is not None:
            raise ValueError("scores= applies to score mods; a mask has no scores to modify")
        cells = mask_cells(spec, q_len, kv_len, max_cells=512, **kw)
        label = title or f"{name} (Lq={q_len}, Lkv={kv_len}; {where})"
        write_cells_png(path, label, cells.frac, cell_label="visible fraction", lengths=(q_len, kv_len))
        return
    matrix = score_matrix(spec, q_len, kv_len, scores=scores, **kw)
    label = title or f"{name} (Lq={q_len}, Lkv={kv_len}; {where})"
    shown = torch.where(torch.isinf(matrix), torch.nan, matrix)
    write_cells_png(path, label, shown, cell_label="score", cmap="viridis")


def write_cells_png(
    path: str,
    title: str,
    cells: torch.Tensor,
    *,
    blocks: torch.Tensor | None = None,
    cell_label: str = "mask",
    cmap: str = "Blues",
    lengths: tuple[int, int] | None = None,
) -> None:
    """Heatmap of ``cells`` (and, beside it, of block codes) written to ``path``.

    ``lengths`` = ``(Lq, Lkv)`` labels the axes in positions when ``cells`` is downsampled.

    Raises:
        MissingDependency: matplotlib is not installed.
    """
    _require_matplotlib()
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    n = 1 if blocks is None else 2
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 5), squeeze=False)
    ax = axes[0][0]
    extent = None if lengths is None else (0, lengths[1], lengths[0], 0)
    img = ax.imshow(cells.float().numpy(), cmap=cmap, interpolation="nearest", aspect="auto", extent=extent)
    ax.set_title(cell_label)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    fig.colorbar(img, ax=ax, fraction=0.046)
    if blocks is not None:
        ax = axes[0][1]
        n_q, n_kv = blocks.shape
        img = ax.imshow(
            blocks.float().numpy(),
            cmap="Greens",
            vmin=0,
            vmax=2,
            interpolation="nearest",
            aspect="auto",
            extent=(0, n_kv, n_q, 0),
        )
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title("blocks (0 empty, 1 partial, 2 full)")
        ax.set_xlabel("key block")
        ax.set_ylabel("query block")
        fig.colorbar(img, ax=ax, fraction=0.046, ticks=[0, 1, 2])
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


__all__ = [
    "BLOCK_LIMIT",
    "BLOCK_SIZE",
    "DENSE_LIMIT",
    "MAX_CELLS",
    "MAX_LENGTH",
    "CellGrid",
    "MissingDependency",
    "block_codes",
    "block_counts",
    "have_matplotlib",
    "heatmap",
    "mask_cells",
    "mask_matrix",
    "render_block_codes",
    "render_cells",
    "render_numbers",
    "render_shades",
    "score_matrix",
    "score_response",
    "text",
    "write_cells_png",
    "write_png",
]
