"""Pictures of masks, block masks and score biases for the CLI (``flexattn-zoo show``).

Text pictures need nothing beyond torch. ``write_png`` needs matplotlib, the optional ``viz`` extra
(``pip install 'flexattn-zoo[viz]'``); it is imported only when a PNG is asked for.

Legend of every text picture: ``#`` visible (or a full block), ``+`` partly visible (a cell that
stands for several positions, or a partial block), ``.`` masked (or an empty block).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import torch

from flexattn_zoo.spec import MaskSpec, ScoreSpec

#: Pictures wider than this many columns are downsampled.
MAX_CELLS = 64
#: Above this many mask elements the picture is sampled from ``mask_mod`` instead of built from
#: the dense oracle, so ``show`` never holds a huge ``Lq x Lkv`` tensor.
DENSE_LIMIT = 1 << 24
#: Sample points per cell side in sampled mode.
SAMPLES_PER_CELL = 8
#: Block size of the BlockMask ``show`` describes (fz.block_mask's default).
BLOCK_SIZE = 128
#: Above this many blocks ``show`` builds no BlockMask (its index tensors and the block map behind
#: them grow as n_q x n_kv blocks: 4M blocks took ~3 s and ~0.5 GB; --len 10M would be 6e9).
BLOCK_LIMIT = 1 << 22
#: Longest sequence ``show`` samples: positions are int64 (and sample offsets exact in float64).
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
    return max(1, -(-length // max_cells))


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


def mask_cells(
    spec: MaskSpec,
    q_len: int,
    kv_len: int,
    *,
    batch: int = 1,
    heads: int = 1,
    batch_index: int = 0,
    head_index: int = 0,
    max_cells: int = MAX_CELLS,
) -> CellGrid:
    """The visible fraction of each cell of a picture at most ``max_cells`` wide and tall."""
    for name, length in (("--len", q_len), ("--kv-len", kv_len)):
        if length > MAX_LENGTH:
            raise ValueError(f"{name} must be at most 2**52 ({MAX_LENGTH}) to draw a mask, got {length}")
    row_step, col_step = _step(q_len, max_cells), _step(kv_len, max_cells)
    if q_len * kv_len <= DENSE_LIMIT:
        dense = spec.dense(q_len, kv_len, batch=batch, heads=heads)
        dense = dense[min(batch_index, dense.shape[0] - 1), min(head_index, dense.shape[1] - 1)]
        dense = dense.bool()
        frac = _pooled_fraction(dense, row_step, col_step)
        return CellGrid(frac, row_step, col_step, False, int(dense.sum()))
    # Sampled mode: evaluate mask_mod at SAMPLES_PER_CELL^2 points of each cell (both cell edges
    # included), never the whole mask.
    bound = spec.bind(q_len, kv_len)
    mod = bound.mask_mod()

    def sample_points(length: int, step: int) -> torch.Tensor:
        n = -(-length // step)
        starts = torch.arange(n, dtype=torch.int64) * step
        last = torch.clamp(starts + step - 1, max=length - 1)
        # float64 offsets (float32 would round them past the cell's end at lengths beyond 2^24).
        t = torch.linspace(0.0, 1.0, SAMPLES_PER_CELL, dtype=torch.float64)
        offsets = (t[None, :] * (last - starts)[:, None].double()).round().long()
        return torch.minimum(starts[:, None] + offsets, last[:, None]).reshape(-1)

    qs, ks = sample_points(q_len, row_step), sample_points(kv_len, col_step)
    b = torch.tensor(batch_index)
    h = torch.tensor(head_index)
    try:
        vis = mod(b, h, qs.view(-1, 1), ks.view(1, -1))
        vis = torch.broadcast_to(torch.as_tensor(vis), (qs.numel(), ks.numel()))
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


def block_codes(
    block_mask: Any, q_len: int, kv_len: int, *, batch_index: int = 0, head_index: int = 0
) -> torch.Tensor:
    """``[n_q_blocks, n_kv_blocks]`` int8: 2 full block, 1 partial block, 0 empty block."""
    qb, kvb = block_mask.BLOCK_SIZE
    n_q, n_kv = -(-q_len // qb), -(-kv_len // kvb)
    kv_num = block_mask.kv_num_blocks.cpu()
    b = min(batch_index, kv_num.shape[0] - 1)
    h = min(head_index, kv_num.shape[1] - 1)
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


def score_bias(spec: ScoreSpec, q_len: int, kv_len: int, *, heads: int, head_index: int = 0) -> torch.Tensor:
    """``[q_len, kv_len]`` float64: what ``spec`` adds to a zero score, for one head."""
    zeros = torch.zeros(1, heads, q_len, kv_len, dtype=torch.float64)
    return spec.dense(zeros)[0, head_index]


def score_response(spec: ScoreSpec, inputs: list[float], *, heads: int, head_index: int = 0) -> list[float]:
    """``spec`` applied to each input score at position ``(0, 0)`` of one head."""
    scores = (
        torch.tensor(inputs, dtype=torch.float64).view(len(inputs), 1, 1, 1).expand(len(inputs), heads, 1, 1)
    )
    return spec.dense(scores.contiguous())[:, head_index, 0, 0].tolist()


def render_numbers(matrix: torch.Tensor, *, digits: int = 2) -> list[str]:
    """Right-aligned numbers, one row per line (for small matrices)."""
    cells = [[f"{x:.{digits}f}" for x in row] for row in matrix.tolist()]
    width = max((len(c) for row in cells for c in row), default=1)
    return [" ".join(c.rjust(width) for c in row) for row in cells]


def render_shades(matrix: torch.Tensor, max_cells: int = MAX_CELLS) -> tuple[list[str], int, int]:
    """Shade characters from ``' '`` (minimum) to ``'@'`` (maximum), cell-averaged.

    Returns ``(lines, row_step, col_step)``.
    """
    r_step, c_step = _step(matrix.shape[0], max_cells), _step(matrix.shape[1], max_cells)
    finite = torch.nan_to_num(matrix.double(), neginf=0.0, posinf=0.0)
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


def write_png(
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
    if not have_matplotlib():
        raise MissingDependency(
            "--png needs matplotlib, which is not installed: pip install 'flexattn-zoo[viz]'"
        )
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
