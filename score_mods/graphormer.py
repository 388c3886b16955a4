"""``graphormer``: Graphormer's spatial and edge encodings as an attention bias (Ying et al., "Do
Transformers Really Perform Badly for Graph Representation?", NeurIPS 2021)."""

from __future__ import annotations

from typing import Any

import torch

from flexattn_zoo.masks.dense import broadcast_indexer
from flexattn_zoo.registry import SCORES
from flexattn_zoo.spec import ScoreMod, ScoreSpec, Spec, spec_dataclass, tracing
from flexattn_zoo.validation import check_integer


def _spatial_pos(value: object) -> torch.Tensor:
    """``spatial_pos`` as a 3-D ``[B|1, Lq, Lkv]`` int32 tensor (values are checked by the caller;
    those beyond int32 saturate to its bounds, so they stay out of range)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"Graphormer(spatial_pos=...) must be an integer tensor [B, N, N] or [N, N], got {type(value).__name__}"
        )
    if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
        raise TypeError(
            f"Graphormer(spatial_pos=...) must be an integer tensor [B, N, N] or [N, N], got dtype {value.dtype}"
        )
    if value.dim() not in (2, 3) or value.numel() == 0:
        raise ValueError(
            "Graphormer(spatial_pos=...) must have shape [B, N, N] or [N, N] (one graph for every batch "
            f"row) with every size >= 1, got {tuple(value.shape)}"
        )
    wide, narrow = torch.iinfo(value.dtype), torch.iinfo(torch.int32)
    if wide.min < narrow.min or wide.max > narrow.max:
        # Saturated, not wrapped: a distance of 2**32 (an "unreachable" sentinel) would wrap to 0,
        # a valid row of spatial_bias, and pass the caller's range check; saturated it fails it.
        value = value.clamp(max(wide.min, narrow.min), min(wide.max, narrow.max))
    # int32: what flex's indices are; a uint8 tensor used as an index would be read as a mask.
    return (value if value.dim() == 3 else value[None]).to(torch.int32)


def _float_table(name: str, value: object, dims: int, shape: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"Graphormer({name}=...) must be a float tensor {shape}, got {type(value).__name__}")
    if not value.is_floating_point() or value.dim() != dims or value.numel() == 0:
        raise ValueError(
            f"Graphormer({name}=...) must be a non-empty float tensor {shape}, "
            f"got {value.dtype} {tuple(value.shape)}"
        )
    return value


@SCORES.register
@spec_dataclass
class Graphormer(ScoreSpec):
    """Graphormer's attention bias for graph transformers: the scaled score of node ``i``
    attending to node ``j`` (batch row ``b``, query head ``h``) becomes
    ``s + spatial_bias[spatial_pos[b, i, j], h] + edge_bias[b, h, i, j]``.

    * Spatial encoding: ``spatial_pos[b, i, j]`` is the shortest-path distance from ``i`` to ``j``
      in graph ``b``, clipped by you to ``[0, num_spatial)`` (Graphormer reserves indices for
      unreachable pairs, padding or a virtual node the same way: they are rows of the table like
      any other); ``spatial_bias`` is a ``[num_spatial, H]`` table, usually learned: one scalar per
      distance and head, what Graphormer's ``nn.Embedding(num_spatial, num_heads)`` holds.
    * Edge encoding: ``edge_bias`` (optional) is the per-pair bias you computed from the edge
      features along the shortest paths (Graphormer's mean of ``x_e . w_n`` over the path), added
      as it is: ``[B|1, H|1, N, N]``, size-1 dims broadcast.

    A graph of four nodes (``0 - 1 - 2`` and ``3`` on ``1``), ``s[d]`` for ``spatial_bias[d, h]``,
    without ``edge_bias``; rows are queries, columns keys::

        spatial_pos          bias for head h
          j: 0  1  2  3        j:  0     1     2     3
        i=0  0  1  2  2      i=0  s[0]  s[1]  s[2]  s[2]
        i=1  1  0  1  1      i=1  s[1]  s[0]  s[1]  s[1]
        i=2  2  1  0  2      i=2  s[2]  s[1]  s[0]  s[2]
        i=3  2  1  2  0      i=3  s[2]  s[1]  s[2]  s[0]

    Nodes are the sequence positions, so the problem has ``Lq = Lkv = N`` (a rectangular
    ``spatial_pos [B, Lq, Lkv]`` is accepted as well, e.g. between two node sets). Pad smaller
    graphs to ``N`` nodes and hide the padding with a mask (``masks.KeyPadding``), as Graphormer's
    ``-inf`` attention bias does; the padded entries of ``spatial_pos`` must still be valid indices.
    Graphormer's third encoding, centrality, is added to the node features, not to the scores.

    Graph token: Graphormer prepends a virtual node (position 0) whose pairs with every node, and
    with itself, get one learned scalar per head. That is one more row of ``spatial_bias``: keep
    the table as ``[num_spatial + 1, H]`` (one learned tensor) and pass
    ``spatial_pos=Graphormer.add_virtual_node(spatial_pos, num_spatial)``, which puts that index on
    row and column 0 of an ``[B, N + 1, N + 1]`` matrix; pad an ``edge_bias`` with zeros there
    (``torch.nn.functional.pad(edge_bias, (1, 0, 1, 0))``).

    ``h`` is the query head, also under grouped-query attention, so ``spatial_bias`` has one
    column per query head. Tensors that require grad (learned tables) are kept as given, not
    copied, and compared by identity; their gradients flow on the routes that differentiate score
    mods (``dense`` on the CPU, ``flex`` on CUDA), through one gather of ``spatial_bias`` per
    score. The indices are checked once, when the spec is built (a read of ``spatial_pos``; not
    while ``torch.compile`` traces, where out-of-range indices are your responsibility).

    Args:
        spatial_pos: integer tensor ``[B, N, N]`` (or ``[N, N]``: one graph for every batch row)
            with values in ``[0, num_spatial)``; held as int32.
        spatial_bias: float tensor ``[num_spatial, H]``; learned or not.
        edge_bias: ``None`` or a float tensor ``[B|1, H|1, N, N]``; learned or not.

    Forms offered: none (the bias is read from tensors per pair; ``score_mods.Bias`` with the
    whole ``[B, H, N, N]`` bias materialized is the SDPA-able equivalent).
    """

    depends_on_head = True

    spatial_pos: torch.Tensor
    spatial_bias: torch.Tensor
    edge_bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        pos = _spatial_pos(self.spatial_pos)
        object.__setattr__(self, "spatial_pos", pos)
        table: Any = self.spatial_bias
        if isinstance(table, torch.Tensor) and table.dtype != torch.bool and not table.is_floating_point():
            if not table.is_complex():
                table = table.to(torch.float32)  # integers (a table typed on the command line)
                object.__setattr__(self, "spatial_bias", table)
        table = _float_table("spatial_bias", table, 2, "[num_spatial, H]")
        num_spatial, heads = table.shape
        _, q_len, kv_len = pos.shape
        # The indices are read once here (one sync), not while torch.compile traces (a model
        # building the spec per batch inside its forward: the data is not known then) nor on the
        # meta device (no data).
        if not tracing() and pos.device.type != "meta":
            low, high = (int(v) for v in torch.aminmax(pos))
            if low < 0 or high >= num_spatial:
                raise ValueError(
                    f"Graphormer(spatial_pos=...) values must lie in [0, num_spatial) = [0, {num_spatial}) "
                    f"(spatial_bias has {num_spatial} rows), got values from {low} to {high}; clip the "
                    "distances first"
                )
        edge = self.edge_bias
        if edge is not None:
            edge = _float_table("edge_bias", edge, 4, "[B|1, H|1, N, N]")
            b, h, lq, lkv = edge.shape
            if (lq, lkv) != (q_len, kv_len) or h not in (1, heads) or (b != 1 and pos.shape[0] not in (1, b)):
                raise ValueError(
                    f"Graphormer(edge_bias=...) has shape {tuple(edge.shape)}; need [B|1, H|1, N, N] = "
                    f"[{pos.shape[0] if pos.shape[0] > 1 else 'B'}|1, {heads}|1, {q_len}, {kv_len}] "
                    "(N from spatial_pos, H from spatial_bias)"
                )
        devices = {t.device for t in (pos, table, edge) if t is not None}
        if len(devices) > 1:
            raise ValueError(
                f"Graphormer's tensors must be on one device, got {', '.join(sorted(map(str, devices)))}"
            )

    @staticmethod
    def add_virtual_node(spatial_pos: torch.Tensor, index: int) -> torch.Tensor:
        """``spatial_pos`` (``[B, N, N]`` or ``[N, N]``) with Graphormer's graph token prepended as
        node 0: an int32 ``[B|1, N + 1, N + 1]`` tensor whose row 0 and column 0 hold ``index``
        (the row of ``spatial_bias`` that learns the token's scalar per head) and whose other
        entries are ``spatial_pos``."""
        pos = _spatial_pos(spatial_pos)
        index = check_integer("Graphormer.add_virtual_node(index=...)", index)
        if index < 0:
            raise ValueError(f"Graphormer.add_virtual_node(index=...) must be >= 0, got {index}")
        b, q_len, kv_len = pos.shape
        out = torch.full((b, q_len + 1, kv_len + 1), index, dtype=torch.int32, device=pos.device)
        out[:, 1:, 1:] = pos
        return out

    @property
    def num_spatial(self) -> int:
        return int(self.spatial_bias.shape[0])

    def pair_tiles(self) -> int:
        # ``spatial_pos`` and ``edge_bias`` are read per pair; the small table is gathered at
        # ``spatial_pos``'s values, not streamed as a tile.
        return 1 if self.edge_bias is None else 2

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        rows, lq, lkv = self.spatial_pos.shape
        if (lq, lkv) != (q_len, kv_len):
            raise ValueError(
                f"Graphormer(spatial_pos=...) describes {lq} x {lkv} node pairs but the problem has "
                f"Lq={q_len}, Lkv={kv_len} (nodes are sequence positions)"
            )
        if rows not in (1, batch):
            raise ValueError(
                f"Graphormer(spatial_pos=...) holds {rows} graphs but the batch size is {batch} "
                "(give one graph per batch row, or [N, N] for all)"
            )
        if self.spatial_bias.shape[1] != heads:
            raise ValueError(
                f"Graphormer(spatial_bias=...) has {self.spatial_bias.shape[1]} head columns but the "
                f"problem has {heads} query heads"
            )
        if self.edge_bias is not None and self.edge_bias.shape[0] not in (1, batch):
            raise ValueError(
                f"Graphormer(edge_bias=...) has {self.edge_bias.shape[0]} batch rows but the batch size is {batch}"
            )

    def _make_score_mod(self, *, fast: bool) -> ScoreMod:
        # Only the non-broadcast dims are indexed (no load at a constant index: FA4's CuTe
        # generator cannot emit one), and spatial_bias is gathered once per score (compiled flex
        # differentiates one gather per captured tensor that requires grad).
        distance = broadcast_indexer(self.spatial_pos[:, None])  # [B|1, 1, Lq, Lkv]
        table = self.spatial_bias
        edge = None if self.edge_bias is None else broadcast_indexer(self.edge_bias)

        if edge is None:

            def graphormer_spatial(score, b, h, q_idx, kv_idx):
                return score + table[distance(b, h, q_idx, kv_idx), h].to(score.dtype)

            return graphormer_spatial

        def graphormer(score, b, h, q_idx, kv_idx):
            spatial = table[distance(b, h, q_idx, kv_idx), h].to(score.dtype)
            return score + spatial + edge(b, h, q_idx, kv_idx).to(score.dtype)

        return graphormer

    def dense(self, scores: torch.Tensor) -> torch.Tensor:
        # Oracle: the table gathered at every pair's distance over the full grid, then moved to
        # [B, H, Lq, Lkv]; differentiable in the tables (the float64 reference's gradients).
        batch, heads, q_len, kv_len = scores.shape
        pos = self.spatial_pos.to(scores.device, torch.int64).expand(batch, q_len, kv_len)
        table = self.spatial_bias.to(scores.device, torch.float64)
        if table.shape[1] != heads:
            raise ValueError(f"Graphormer(spatial_bias=...) has {table.shape[1]} heads, scores have {heads}")
        bias = table[pos].permute(0, 3, 1, 2)  # [B, Lq, Lkv, H] -> [B, H, Lq, Lkv]
        if self.edge_bias is not None:
            bias = bias + self.edge_bias.to(scores.device, torch.float64)
        return scores + bias.to(scores.dtype)

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        gen = torch.Generator().manual_seed(31 * q_len + 7 * kv_len + batch + heads)
        # Random indices (not symmetric: a swapped i/j shows); six distances, one graph per row.
        pos = torch.randint(0, 6, (batch, q_len, kv_len), generator=gen)
        shared = torch.randint(0, 4, (q_len, kv_len), generator=gen)
        edge = torch.randn(batch, heads, q_len, kv_len, generator=gen)
        return [
            cls(spatial_pos=pos, spatial_bias=torch.randn(6, heads, generator=gen)),
            cls(spatial_pos=shared, spatial_bias=torch.randn(4, heads, generator=gen), edge_bias=edge),
        ]
