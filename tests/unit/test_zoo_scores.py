"""The Sandwich and Graphormer biases, each against an oracle written here from its paper's
definition (independent of the spec's ``score_mod`` and of its ``dense``): Sandwich's per-pair sum
of cosines and its convention next to attention-gym's, Graphormer's shortest-path distances found
by breadth-first search, the graph token, gradients into learned tables, the query head under
grouped-query attention, and parameter errors.

The registry-wide tests (``tests/property``) already run every example of these specs through the
consistency checks, every CPU route and ``torch.compile``; nothing here compiles (the routes are
``dense`` and the reference).
"""

from __future__ import annotations

import math
import pickle
from collections import deque

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.score_mods import Graphormer, Sandwich
from flexattn_zoo.testing import assert_matches_reference
from flexattn_zoo.testing.checks import index_grids


def _mod_bias(spec: score_mods.ScoreSpec, batch: int, heads: int, q_len: int, kv_len: int) -> torch.Tensor:
    """The spec's ``score_mod`` on zero float64 scores over the full index grid: its bias."""
    zeros = torch.zeros(batch, heads, q_len, kv_len, dtype=torch.float64)
    out = spec.score_mod()(zeros, *index_grids(batch, heads, q_len, kv_len))
    return torch.broadcast_to(out, zeros.shape)


def _qkv(batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = ((batch, heads, q_len, 8), (batch, kv_heads, kv_len, 8), (batch, kv_heads, kv_len, 8))
    return [torch.randn(s, generator=g, dtype=torch.float64).requires_grad_() for s in shapes]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Softmax attention with an additive ``[B, H, Lq, Lkv]`` bias, kv head ``h // (H / Hkv)`` for
    query head ``h`` (written out per head, as a model would)."""
    group = q.shape[1] // k.shape[1]
    outs = []
    for h in range(q.shape[1]):
        s = q[:, h] @ k[:, h // group].transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias[:, h]
        outs.append(torch.softmax(s, dim=-1) @ v[:, h // group])
    return torch.stack(outs, dim=1)


# ---- sandwich ----------------------------------------------------------------------------------


def _sandwich_loops(dim: int, heads: int, q_len: int, kv_len: int) -> torch.Tensor:
    """Chi et al.'s bias pair by pair: ``(sum_{k=1..d'/2} cos((i - j) / 10000^(2k/d')) - d'/2) / r_h``
    with ``r_h = 8 (h + 1) / H``."""

    def shifted(i: int, j: int) -> float:
        return sum(math.cos((i - j) / 10000 ** (2 * k / dim)) for k in range(1, dim // 2 + 1)) - dim / 2

    base = torch.tensor([[shifted(i, j) for j in range(kv_len)] for i in range(q_len)], dtype=torch.float64)
    ratios = torch.tensor([8 * (h + 1) / heads for h in range(heads)], dtype=torch.float64)
    return (base / ratios.view(-1, 1, 1))[None]


@pytest.mark.parametrize(
    ("dim", "heads", "q_len", "kv_len", "max_len"),
    [(128, 8, 13, 13, 13), (16, 3, 9, 21, 40), (2, 1, 30, 7, 30), (64, 12, 40, 40, 8192)],
)
def test_sandwich_is_the_sum_of_cosines(dim: int, heads: int, q_len: int, kv_len: int, max_len: int) -> None:
    spec = Sandwich(num_heads=heads, dim=dim, max_len=max_len)
    want = _sandwich_loops(dim, heads, q_len, kv_len)
    zeros = torch.zeros(1, heads, q_len, kv_len, dtype=torch.float64)
    torch.testing.assert_close(spec.dense(zeros), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(_mod_bias(spec, 1, heads, q_len, kv_len), want, rtol=1e-12, atol=1e-12)
    # 0 on the diagonal, negative off it (every cosine is at most 1), symmetric in i - j.
    diag = torch.arange(min(q_len, kv_len))
    assert bool((want[..., diag, diag] == 0).all())
    off = torch.arange(kv_len)[None, :] != torch.arange(q_len)[:, None]
    assert bool((want[..., off] < 0).all())
    # Float32 scores (what kernels pass) read the float32 table: one rounding of the bias.
    got32 = spec.score_mod()(torch.zeros(1, heads, q_len, kv_len), *index_grids(1, heads, q_len, kv_len))
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), want, rtol=3e-7, atol=1e-6)


def test_sandwich_picture_values() -> None:
    # The docstring's row for d' = 128, head 0 of 8 (r = 1), and its far values.
    row = Sandwich(num_heads=8, max_len=2048).distance_table()[2047:]
    assert [round(float(row[n]), 2) for n in range(5)] == [0.0, -1.45, -5.2, -9.82, -13.76]
    assert [round(float(row[n]), 1) for n in (6, 32, 1024)] == [-16.9, -28.2, -50.9]
    torch.testing.assert_close(row.flip(0), Sandwich(num_heads=8, max_len=2048).distance_table()[:2048])


def test_sandwich_convention_next_to_attention_gym() -> None:
    # attention-gym's generate_sandwich_bias, restated: sum over k = 0 .. d'/2 - 1 of
    # cos((i - j) / 10000^(2k/d')), times H / (8 (h + 1)), no shift. With the same ratios it is this
    # spec's bias plus (cos(i - j) - cos((i - j) / 10000) + d'/2) / r_h: the frequency 1 in place
    # of 1/10000, and a constant per head (which softmax ignores, the log-sum-exp does not).
    dim, heads, n = 32, 4, 24
    rel = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).double()
    gym = sum(torch.cos(rel * 10000.0 ** (-2 * k / dim)) for k in range(dim // 2))
    ratios = torch.tensor([8 * (h + 1) / heads for h in range(heads)], dtype=torch.float64).view(1, -1, 1, 1)
    gym = gym / ratios
    ours = Sandwich(num_heads=heads, dim=dim, max_len=n).dense(
        torch.zeros(1, heads, n, n, dtype=torch.float64)
    )
    extra = (torch.cos(rel) - torch.cos(rel / 10000) + dim / 2) / ratios
    torch.testing.assert_close(gym, ours + extra, rtol=1e-12, atol=1e-12)
    assert float((gym - ours - dim / 2 / ratios).abs().max()) > 0.1  # not only a shift


def test_sandwich_divides_by_the_query_heads_ratio_under_gqa() -> None:
    heads, kv_heads, n = 4, 2, 11
    spec = Sandwich(num_heads=heads, dim=8, max_len=16)
    q, k, v = _qkv(2, heads, kv_heads, n, n)
    out = fz.attention(q, k, v, mask=masks.Causal(), score_mod=spec, enable_gqa=True, backend="dense")
    bias = _sandwich_loops(8, heads, n, n).masked_fill(~masks.Causal().dense(n, n), -math.inf)
    torch.testing.assert_close(out, _attend(q, k, v, bias))
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert_matches_reference(
        out, q, k, v, mask=masks.Causal(), score_mod=spec, enable_gqa=True, grads=grads,
        grad_out=torch.ones_like(out),
    )  # fmt: skip
    # Head h's bias is head 0's divided by h + 1.
    per_head = _mod_bias(spec, 1, heads, n, n)
    for h in range(heads):
        torch.testing.assert_close(per_head[:, h] * (h + 1), per_head[:, 0])


def test_sandwich_lengths_and_device() -> None:
    spec = Sandwich(num_heads=2, dim=8, max_len=16)
    spec.validate(16, 16, 1, 2)  # the table's last entries serve distance 15
    with pytest.raises(ValueError, match="at most 16 tokens.*max_len >= 17"):
        spec.validate(17, 5, 1, 2)
    with pytest.raises(ValueError, match="build it with num_heads=3"):
        spec.validate(4, 4, 1, 3)
    q, k, v = _qkv(1, 2, 2, 17, 17)
    with pytest.raises(ValueError, match="max_len"):
        fz.attention(q, k, v, score_mod=spec)
    # Equal parameters: equal specs, one score_mod. Another device: another spec with its table.
    assert Sandwich(num_heads=2, dim=8, max_len=16) == spec
    assert Sandwich(num_heads=2, dim=8, max_len=16).score_mod() is spec.score_mod()
    assert spec.to("cpu") is spec and spec.device == torch.device("cpu")
    meta = spec.to("meta")
    assert meta.device == torch.device("meta") and meta.distance_table().device.type == "meta"
    assert meta != spec and meta.score_mod() is not spec.score_mod() and meta.to("meta") is meta
    assert meta.to("cpu") == spec
    # In a chain too: the chain moves its parts through their own `to`, tables included.
    chained = (spec >> score_mods.SoftCap(cap=30.0)).to("meta")
    assert chained.mods[0].distance_table().device.type == "meta"
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert spec.tensors() == [] and not spec.captures_grad_tensors() and spec.uses_head()
    assert score_mods.get("sandwich", num_heads=4) == Sandwich(num_heads=4, dim=128, max_len=8192)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"num_heads": 0}, ValueError, r"num_heads=...\) must be in \[1, "),
        ({"num_heads": 2.0}, TypeError, r"num_heads=...\) must be an int"),
        ({"num_heads": 2, "dim": 7}, ValueError, "must be even"),
        ({"num_heads": 2, "dim": 0}, ValueError, r"dim=...\) must be in \[2, 1024\]"),
        ({"num_heads": 2, "dim": True}, TypeError, r"dim=...\) must be an int"),
        ({"num_heads": 2, "max_len": 0}, ValueError, r"max_len=...\) must be in \[1, 1048576\]"),
        ({"num_heads": 2, "max_len": (1 << 20) + 1}, ValueError, "max_len"),
    ],
)
def test_sandwich_parameter_errors(kwargs: dict[str, object], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        Sandwich(**kwargs)  # type: ignore[arg-type]


# ---- graphormer --------------------------------------------------------------------------------


def _shortest_paths(edges: list[tuple[int, int]], n: int) -> list[list[int]]:
    """All-pairs hop counts of an undirected graph by breadth-first search (``n``: unreachable)."""
    neighbours: list[list[int]] = [[] for _ in range(n)]
    for a, b in edges:
        neighbours[a].append(b)
        neighbours[b].append(a)
    out = []
    for start in range(n):
        dist = [n] * n
        dist[start] = 0
        todo = deque([start])
        while todo:
            node = todo.popleft()
            for nxt in neighbours[node]:
                if dist[nxt] == n:
                    dist[nxt] = dist[node] + 1
                    todo.append(nxt)
        out.append(dist)
    return out


#: Two graphs of six nodes: a path with a branch, and a triangle plus a pair and a lone node.
GRAPHS = ([(0, 1), (1, 2), (2, 3), (1, 4), (4, 5)], [(0, 1), (1, 2), (2, 0), (3, 4)])


def _distances(num_spatial: int) -> torch.Tensor:
    """``[2, 6, 6]`` hop counts of ``GRAPHS`` clipped to ``num_spatial - 1`` (unreachable: the last)."""
    return torch.tensor(
        [[[min(d, num_spatial - 1) for d in row] for row in _shortest_paths(e, 6)] for e in GRAPHS]
    )


def _graphormer_loops(dist: torch.Tensor, table: torch.Tensor, edge: torch.Tensor | None) -> torch.Tensor:
    """``table[dist[b, i, j], h] + edge[b, h, i, j]`` pair by pair."""
    batch, n, _ = dist.shape
    heads = table.shape[1]
    t, d = table.detach().double().tolist(), dist.tolist()
    e = None if edge is None else edge.detach().double().expand(batch, heads, n, n).tolist()
    return torch.tensor(
        [
            [
                [
                    [t[d[b][i][j]][h] + (0.0 if e is None else e[b][h][i][j]) for j in range(n)]
                    for i in range(n)
                ]
                for h in range(heads)
            ]
            for b in range(batch)
        ],
        dtype=torch.float64,
    )


@pytest.mark.parametrize("edge_shape", [None, (2, 3, 6, 6), (1, 3, 6, 6), (2, 1, 6, 6)])
def test_graphormer_is_the_table_at_shortest_path_distances(edge_shape: tuple[int, ...] | None) -> None:
    g = torch.Generator().manual_seed(5)
    dist = _distances(4)
    assert dist[0, 0].tolist() == [0, 1, 2, 3, 2, 3] and dist[1, 0].tolist() == [0, 1, 1, 3, 3, 3]
    table = torch.randn(4, 3, generator=g)
    edge = None if edge_shape is None else torch.randn(edge_shape, generator=g)
    spec = Graphormer(spatial_pos=dist, spatial_bias=table, edge_bias=edge)
    want = _graphormer_loops(dist, table, edge)
    torch.testing.assert_close(spec.dense(torch.zeros(2, 3, 6, 6, dtype=torch.float64)), want)
    torch.testing.assert_close(_mod_bias(spec, 2, 3, 6, 6), want)
    # One graph for every batch row: [N, N].
    shared = Graphormer(spatial_pos=dist[1], spatial_bias=table)
    assert shared.spatial_pos.shape == (1, 6, 6) and shared.spatial_pos.dtype == torch.int32
    torch.testing.assert_close(_mod_bias(shared, 2, 3, 6, 6), _graphormer_loops(dist[[1, 1]], table, None))


def test_graphormer_gradients_reach_learned_tables_under_gqa() -> None:
    heads, kv_heads, n = 4, 2, 6
    g = torch.Generator().manual_seed(9)
    dist = _distances(5)
    table = torch.randn(5, heads, dtype=torch.float64, generator=g).requires_grad_()
    edge = (0.5 * torch.randn(2, heads, n, n, dtype=torch.float64, generator=g)).requires_grad_()
    spec = Graphormer(spatial_pos=dist, spatial_bias=table, edge_bias=edge)
    assert spec.spatial_bias is table and spec.edge_bias is edge and spec.captures_grad_tensors()
    assert spec != Graphormer(
        spatial_pos=dist, spatial_bias=table.detach().clone().requires_grad_(), edge_bias=edge
    )
    q, k, v = _qkv(2, heads, kv_heads, n, n, seed=1)
    assert fz.plan(q, k, v, score_mod=spec, enable_gqa=True).backend == "dense"
    out = fz.attention(q, k, v, score_mod=spec, enable_gqa=True)
    grad_out = torch.randn(out.shape, dtype=out.dtype, generator=g)
    got = torch.autograd.grad(out, (table, edge, q, k, v), grad_out)
    # The same attention written out: the table gathered at the distances (query head h reads
    # column h, its kv head is h // 2), differentiated by autograd.
    bias = table[dist.long()].permute(0, 3, 1, 2) + edge
    want = torch.autograd.grad(_attend(q, k, v, bias), (table, edge, q, k, v), grad_out)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    assert int((got[0] != 0).sum()) > 0
    # The float64 reference (the spec's dense oracle) agrees on the table's gradient too.
    ref = fz.testing.reference_attention(q, k, v, score_mod=spec, enable_gqa=True)
    torch.testing.assert_close(torch.autograd.grad(ref, table, grad_out)[0], want[0])
    assert_matches_reference(out, q, k, v, score_mod=spec, enable_gqa=True, grads=got[2:], grad_out=grad_out)


def test_graphormer_padded_graphs_match_each_graph_alone() -> None:
    # Graph 1 has six nodes, graph 2 three (the triangle): padded to six, its padding hidden by a
    # key-padding mask and given distance index 0 (any valid index).
    g = torch.Generator().manual_seed(3)
    table = torch.randn(4, 2, dtype=torch.float64, generator=g)
    dist = _distances(4)
    dist[1, 3:, :] = dist[1, :, 3:] = 0
    valid = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    q, k, v = _qkv(2, 2, 2, 6, 6, seed=4)
    mask = masks.KeyPadding(valid=valid)
    out = fz.attention(q, k, v, mask=mask, score_mod=Graphormer(spatial_pos=dist, spatial_bias=table))
    alone = Graphormer(spatial_pos=dist[1:, :3, :3], spatial_bias=table)
    small = fz.attention(q[1:, :, :3], k[1:, :, :3], v[1:, :, :3], score_mod=alone)
    torch.testing.assert_close(out[1:, :, :3], small)


def test_graphormer_graph_token_is_one_more_table_row() -> None:
    # Graphormer adds a learned per-head scalar t to every pair with the virtual node 0 (its row,
    # then its column below it: (0, 0) gets t once) and the spatial table to the node pairs.
    g = torch.Generator().manual_seed(7)
    dist, heads = _distances(5), 3
    table = torch.randn(6, heads, generator=g)  # rows 0..4: distances; row 5: the graph token's t
    pos = Graphormer.add_virtual_node(dist, 5)
    assert pos.shape == (2, 7, 7) and pos.dtype == torch.int32
    spec = Graphormer(spatial_pos=pos, spatial_bias=table)
    want = torch.zeros(2, heads, 7, 7, dtype=torch.float64)
    want[:, :, 1:, 1:] += table.double()[dist.long()].permute(0, 3, 1, 2)
    t = table.double()[5].view(1, heads, 1)
    want[:, :, 1:, 0] += t
    want[:, :, 0, :] += t
    torch.testing.assert_close(_mod_bias(spec, 2, heads, 7, 7), want)
    assert Graphormer.add_virtual_node(dist[0], 5).shape == (1, 7, 7)
    with pytest.raises(ValueError, match=r"index=...\) must be >= 0, got -1"):
        Graphormer.add_virtual_node(dist, -1)
    with pytest.raises(TypeError, match=r"index=...\) must be an int, got float"):
        Graphormer.add_virtual_node(dist, 5.0)  # type: ignore[arg-type]


def test_graphormer_built_per_batch_inside_a_compiled_forward() -> None:
    # Graphs change every batch, so a model builds the spec in its forward: no graph break (the
    # index check reads data, and is skipped while traced), one graph for both batches, eager's
    # result. The spec moves to the meta device without reading its (absent) data too.
    table = torch.randn(4, 2, generator=torch.Generator().manual_seed(2))

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return fz.attention(
            q, k, v, score_mod=Graphormer(spatial_pos=pos, spatial_bias=table), backend="dense"
        )

    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(forward, backend=counter, fullgraph=True)
    for seed in (0, 1):
        q, k, v = (t.detach().float() for t in _qkv(2, 2, 2, 6, 6, seed=seed))
        pos = _distances(4) if seed == 0 else _distances(4).flip(1, 2)
        torch.testing.assert_close(step(q, k, v, pos), forward(q, k, v, pos))
    assert counter.frame_count == 1
    moved = Graphormer(spatial_pos=_distances(4), spatial_bias=table).to("meta")
    assert moved.spatial_pos.device.type == "meta" and moved.spatial_bias.device.type == "meta"


def test_graphormer_validate_names_the_mismatch() -> None:
    spec = Graphormer(spatial_pos=_distances(4), spatial_bias=torch.zeros(4, 3))
    spec.validate(6, 6, 2, 3)
    with pytest.raises(ValueError, match="6 x 6 node pairs but the problem has Lq=7, Lkv=7"):
        spec.validate(7, 7, 2, 3)
    with pytest.raises(ValueError, match="holds 2 graphs but the batch size is 3"):
        spec.validate(6, 6, 3, 3)
    with pytest.raises(ValueError, match="3 head columns but the problem has 4 query heads"):
        spec.validate(6, 6, 2, 4)
    edged = Graphormer(
        spatial_pos=_distances(4)[0], spatial_bias=torch.zeros(4, 3), edge_bias=torch.zeros(2, 3, 6, 6)
    )
    with pytest.raises(ValueError, match="2 batch rows but the batch size is 3"):
        edged.validate(6, 6, 3, 3)
    assert score_mods.get("graphormer", spatial_pos=_distances(4), spatial_bias=torch.zeros(4, 3)) == spec
    assert spec.num_spatial == 4 and spec.uses_head()


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"spatial_pos": [[0]]}, TypeError, "integer tensor"),
        ({"spatial_pos": torch.zeros(2, 2)}, TypeError, "got dtype torch.float32"),
        ({"spatial_pos": torch.zeros(2, 2, dtype=torch.bool)}, TypeError, "got dtype torch.bool"),
        ({"spatial_pos": torch.zeros(4, dtype=torch.long)}, ValueError, r"shape \[B, N, N\] or \[N, N\]"),
        ({"spatial_pos": torch.full((2, 2), 4)}, ValueError, r"\[0, num_spatial\) = \[0, 4\).*from 4 to 4"),
        ({"spatial_pos": torch.full((2, 2), -1)}, ValueError, "from -1 to -1"),
        # Beyond int32 (an "unreachable" sentinel): refused, not wrapped to 0 or 1, valid rows.
        ({"spatial_pos": torch.full((2, 2), 2**32)}, ValueError, r"\[0, 4\).*to 2147483647"),
        ({"spatial_pos": torch.full((2, 2), 1 - 2**32)}, ValueError, r"\[0, 4\).*from -2147483648"),
        (
            {"spatial_pos": Graphormer.add_virtual_node(torch.full((1, 1), 2**32), 3)},
            ValueError,
            r"\[0, 4\).*to 2147483647",
        ),
        (
            {"spatial_bias": torch.zeros(4)},
            ValueError,
            r"spatial_bias=...\) must be a non-empty float tensor",
        ),
        ({"spatial_bias": "table"}, TypeError, r"spatial_bias=...\) must be a float tensor"),
        (
            {"edge_bias": torch.zeros(2, 2, 2)},
            ValueError,
            r"edge_bias=...\) must be a non-empty float tensor",
        ),
        (
            {"edge_bias": torch.zeros(1, 3, 2, 2)},
            ValueError,
            r"need \[B\|1, H\|1, N, N\] = \[B\|1, 2\|1, 2, 2\]",
        ),
        ({"edge_bias": torch.zeros(1, 1, 2, 3)}, ValueError, "edge_bias"),
        ({"edge_bias": torch.zeros(1, 1, 2, 2, device="meta")}, ValueError, "on one device"),
    ],
)
def test_graphormer_parameter_errors(kwargs: dict[str, object], exc: type[Exception], match: str) -> None:
    args: dict[str, object] = {
        "spatial_pos": torch.zeros(2, 2, dtype=torch.long),
        "spatial_bias": torch.zeros(4, 2),
    }
    with pytest.raises(exc, match=match):
        Graphormer(**{**args, **kwargs})  # type: ignore[arg-type]


def test_graphormer_integer_table_becomes_float() -> None:
    spec = Graphormer(
        spatial_pos=torch.zeros(2, 2, dtype=torch.long), spatial_bias=torch.ones(3, 1, dtype=torch.long)
    )
    assert spec.spatial_bias.dtype == torch.float32


@pytest.mark.parametrize(
    "make",
    [
        lambda n: score_mods.Alibi(num_heads=n(8)),
        lambda n: Sandwich(num_heads=n(2), dim=n(8), max_len=n(16)),
        lambda n: score_mods.RelPosBias(table=torch.ones(8, 2), max_distance=n(16)),
        lambda n: score_mods.Sigmoid.for_length(n(8)),
        lambda n: Graphormer.add_virtual_node(torch.zeros(2, 2, dtype=torch.long), n(3)),
    ],
    ids=["alibi", "sandwich", "rel_pos_bias", "sigmoid_for_length", "graphormer_virtual_node"],
)
def test_integer_parameters_take_numpy_integers(make) -> None:  # type: ignore[no-untyped-def]
    """Integer parameters take numpy's integers, as the masks' and layers' do (a config read with
    numpy gives them), and make the spec the Python int makes."""
    np = pytest.importorskip("numpy")
    for kind in (np.int64, np.int32):
        got, want = make(kind), make(int)
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want)
        else:
            assert got == want and hash(got) == hash(want) and repr(got) == repr(want)
    with pytest.raises(TypeError, match=r"\.\.\.\) must be an int, got bool"):
        make(bool)
