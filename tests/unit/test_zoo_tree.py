"""The shared-prompt and token-tree masks (``shared_prefix``, ``tree``): each against an oracle
written here from the rule (a per-pair predicate over ancestor sets or continuation labels,
independent of the spec's ``mask_mod`` and its ``dense``), the attention they stand for, their
forms, the decoding alignment, and parameter errors.

The registry-wide tests (``tests/property``) run every example through the consistency checks and
every CPU route; nothing here compiles (routes ``dense`` and the reference).
"""

from __future__ import annotations

import pytest
import torch
from zoo_oracles import mask_mod_dense, qkv, table

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo.masks import SharedPrefix, Tree
from flexattn_zoo.spec import SdpaForm
from flexattn_zoo.testing import assert_mask_consistent, assert_matches_reference

SMALL_BLOCKS = ((4, 4), (3, 5), (16, 32))


def _picture(spec: masks.MaskSpec) -> list[str]:
    """The ``#``/``.`` rows of a spec's docstring picture."""
    doc = type(spec).__doc__ or ""
    return [line.strip() for line in doc.splitlines() if line.strip() and set(line.strip()) <= set("#.")]


def _rows(mask: torch.Tensor) -> list[str]:
    return ["".join("#" if x else "." for x in row) for row in mask[0, 0].tolist()]


# ---- shared_prefix -----------------------------------------------------------------------------


def _shared_prefix_rule(prefix: int, ids: list[int], q_len: int, kv_len: int) -> torch.Tensor:
    label = [None] * prefix + ids  # None: the prompt

    def sees(i: int, j: int) -> bool:
        return j <= i and (label[j] is None or label[i] == label[j])

    return table(q_len, kv_len, sees)


@pytest.mark.parametrize(
    ("prefix", "ids", "q_len", "kv_len"),
    [
        (3, [0, 0, 1, 1, 1], 8, 8),
        (5, [2, 2, 2, 7, 7, 0, 0, 0, 0], 14, 11),  # unsorted labels, Lq != Lkv
        (4, [1, 0, 1, 0, 2, 2], 10, 10),  # continuations in pieces
        (0, [0, 0, 1, 1, 1, 2], 6, 6),
        (9, [], 9, 7),  # the prompt only
        (6, [3, 3, 3, 3], 8, 10),  # the row ends mid-continuation for the queries
    ],
)
def test_shared_prefix_matches_its_rule(prefix: int, ids: list[int], q_len: int, kv_len: int) -> None:
    spec, want = SharedPrefix(prefix_len=prefix, doc_ids=ids), _shared_prefix_rule(prefix, ids, q_len, kv_len)
    assert torch.equal(spec.dense(q_len, kv_len), want)
    assert torch.equal(mask_mod_dense(spec, q_len, kv_len), want)
    assert_mask_consistent(spec, q_len, kv_len, block_sizes=SMALL_BLOCKS)


def test_shared_prefix_docstring_picture_and_lengths() -> None:
    spec = SharedPrefix(prefix_len=3, doc_ids=[0, 0, 1, 1, 1])
    assert _rows(spec.dense(8, 8)) == _picture(spec)
    # Lengths in order, an empty continuation taking no position; Document's convention.
    made = SharedPrefix.from_lengths(4, [2, 0, 3])
    assert made.doc_ids.tolist() == [0, 0, 2, 2, 2] and made.prefix_len == 4
    assert made == SharedPrefix(prefix_len=4, doc_ids=torch.tensor([0, 0, 2, 2, 2]))
    assert torch.equal(made.dense(9, 9), SharedPrefix.from_lengths(4, [2, 3]).dense(9, 9))
    assert masks.get("shared_prefix", prefix_len=2, doc_ids=[0, 1]) == SharedPrefix(
        prefix_len=2, doc_ids=[0, 1]
    )


def test_shared_prefix_special_cases() -> None:
    # No prompt: Document & Causal. A prompt only, or one continuation: plain causal (SDPA's form).
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    docs = masks.Document(doc_ids=ids) & masks.Causal()
    assert torch.equal(SharedPrefix(prefix_len=0, doc_ids=ids).dense(9, 9), docs.dense(9, 9))
    causal = masks.Causal().dense(12, 12)
    for spec in (SharedPrefix(prefix_len=12, doc_ids=[]), SharedPrefix.from_lengths(5, [7])):
        assert torch.equal(spec.dense(12, 12), causal)
        assert spec.sdpa_form(12, 12) == SdpaForm(is_causal=True)
    two = SharedPrefix.from_lengths(5, [3, 4])
    assert two.sdpa_form(12, 12) is None and two.sdpa_form(8, 8) is not None  # 8: one continuation
    assert two.sdpa_form(12, 10) is None and two.hides_future_keys(12, 10)
    assert two.lowest_visible_key(torch.arange(12)) is None  # everyone sees key 0


def test_shared_prefix_rollouts_are_independent() -> None:
    # Three rollouts of one prompt: a rollout's outputs depend on the prompt and itself only, and
    # equal attending over the prompt + that rollout alone (what training them one by one gives).
    spec = SharedPrefix.from_lengths(6, [5, 4, 7])
    q, k, v = (t.detach() for t in qkv(1, 22, 22))
    out = fz.attention(q, k, v, mask=spec, backend="dense")
    assert_matches_reference(out, q, k, v, mask=spec)
    for lo, hi in ((6, 11), (11, 15), (15, 22)):
        keep = torch.cat([torch.arange(6), torch.arange(lo, hi)])
        alone = fz.attention(
            q[:, :, keep], k[:, :, keep], v[:, :, keep], mask=masks.Causal(), backend="dense"
        )
        torch.testing.assert_close(out[:, :, lo:hi], alone[:, :, 6:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        out[:, :, :6],
        fz.attention(q[:, :, :6], k[:, :, :6], v[:, :, :6], mask=masks.Causal(), backend="dense"),
    )


def test_shared_prefix_block_map() -> None:
    assert SharedPrefix.from_lengths(3, [4, 5]).block_map(12, 12, 4, 4, "cpu") is not None
    pieces = SharedPrefix(prefix_len=3, doc_ids=[0, 1, 0, 1])
    assert pieces.block_map(7, 7, 2, 2, "cpu") is None  # not one run per label: the generic builder
    assert_mask_consistent(pieces, 7, 7, block_sizes=((2, 2),))
    # A million tokens: a 4k prompt and 8 rollouts, blocks of 1024, never element-wise.
    big = SharedPrefix.from_lengths(4096, [(1 << 20) // 8 - 512] * 8)
    bmap = big.block_map(1 << 20, 1 << 20, 1024, 1024, "cpu")
    assert bmap is not None and bmap.any.shape[-2:] == (1024, 1024)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"prefix_len": -1, "doc_ids": [0]}, ValueError, r"prefix_len=\.\.\.\) must be an int >= 0"),
        ({"prefix_len": True, "doc_ids": [0]}, TypeError, "prefix_len"),
        ({"prefix_len": 2, "doc_ids": [0.5, 1.0]}, TypeError, "integer tensor"),
        ({"prefix_len": 2, "doc_ids": [[0, 1]]}, ValueError, "must be 1-D"),
        ({"prefix_len": 2, "doc_ids": "ab"}, TypeError, "doc_ids"),
    ],
)
def test_shared_prefix_parameter_errors(kwargs: dict[str, object], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        SharedPrefix(**kwargs)  # type: ignore[arg-type]


def test_shared_prefix_length_errors() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        SharedPrefix.from_lengths(2, [3, -1])
    with pytest.raises(ValueError, match="max\\(Lq, Lkv\\) = 9"):
        SharedPrefix.from_lengths(2, [3, 3]).validate(9, 4, 1, 1)
    with pytest.raises(ValueError, match="covers prefix_len"):
        fz.attention(*qkv(1, 10, 10), mask=SharedPrefix.from_lengths(2, [3, 3]))


# ---- tree --------------------------------------------------------------------------------------


def _tree_rule(parents: list[int], prefix: int, q_len: int, kv_len: int, q_offset: int = 0) -> torch.Tensor:
    """Ancestor sets by recursion over the parent links, then the rule pair by pair."""
    ancestors: list[set[int]] = []
    for t, p in enumerate(parents):
        ancestors.append({t} | (ancestors[p] if p >= 0 else set()))

    def sees(i: int, j: int) -> bool:
        pos = q_offset + i
        if pos < prefix:
            return j <= pos
        return j < prefix or (j - prefix) in ancestors[pos - prefix]

    return table(q_len, kv_len, sees)


TREES = {
    "picture": [-1, 0, 0, 1, 2],
    "single": [-1],
    "chain": [-1, 0, 1, 2, 3, 4, 5],
    "star": [-1, 0, 0, 0, 0, 0],
    "forest": [-1, 0, -1, 2, 1, -1, 3, 3, 0],
    "deep_branches": [-1, 0, 1, 2, 0, 4, 5, 1, 7, 3, 9, 6, 11, 11],
}


@pytest.mark.parametrize("name", TREES)
@pytest.mark.parametrize("prefix", [0, 1, 6])
def test_tree_matches_ancestor_sets(name: str, prefix: int) -> None:
    parents = TREES[name]
    n = prefix + len(parents)
    spec = Tree(parents=parents, prefix_len=prefix)
    for q_len, kv_len in ((n, n), (n, max(1, n - 3)), (max(1, n - 2), n)):
        want = _tree_rule(parents, prefix, q_len, kv_len)
        assert torch.equal(spec.dense(q_len, kv_len), want)
        assert torch.equal(mask_mod_dense(spec, q_len, kv_len), want)
        assert_mask_consistent(spec, q_len, kv_len, block_sizes=SMALL_BLOCKS)


def test_tree_special_shapes() -> None:
    pictured = Tree(parents=[-1, 0, 0, 1, 2], prefix_len=2)
    assert _rows(pictured.dense(7, 7)) == _picture(pictured)
    causal = masks.Causal().dense(11, 11)
    for spec in (Tree(parents=TREES["chain"], prefix_len=4), Tree(parents=[-1], prefix_len=10)):
        assert torch.equal(spec.dense(11, 11), causal)  # a chain (one token too) is causal
        assert spec.sdpa_form(11, 11) == SdpaForm(is_causal=True)
    star = Tree(parents=TREES["star"], prefix_len=3)
    assert star.sdpa_form(9, 9) is None and star.sdpa_form(4, 4) is not None  # ends at the root
    leaves = star.dense(9, 9)[0, 0, 4:]  # each leaf: the context, the root and itself
    assert torch.equal(
        leaves, torch.cat([torch.ones(5, 4, dtype=torch.bool), torch.eye(5, dtype=torch.bool)], 1)
    )
    # A forest without context: a root sees itself only.
    forest = Tree(parents=TREES["forest"]).dense(9, 9)[0, 0]
    assert [int(forest[r].sum()) for r in (0, 2, 5)] == [1, 1, 1]
    assert star.lowest_visible_key(torch.arange(9)) is None


def test_tree_decoding_alignment() -> None:
    # Lq < Lkv: the tree's tokens as queries (q_offset = prefix_len) against context + tree keys
    # are the tree rows of the full mask; query i is the token at position q_offset + i.
    parents, prefix = TREES["deep_branches"], 5
    n = prefix + len(parents)
    full = Tree(parents=parents, prefix_len=prefix)
    step = Tree(parents=parents, prefix_len=prefix, q_offset=prefix)
    want = _tree_rule(parents, prefix, len(parents), n, q_offset=prefix)
    assert torch.equal(step.dense(len(parents), n), want)
    assert torch.equal(step.dense(len(parents), n), full.dense(n, n)[:, :, prefix:])
    assert torch.equal(mask_mod_dense(step, len(parents), n), want)
    assert_mask_consistent(step, len(parents), n, block_sizes=SMALL_BLOCKS)
    assert not step.hides_future_keys(len(parents), n) and full.hides_future_keys(n, n)
    # Queries starting inside the context (the last 3 context tokens, then the tree).
    late = Tree(parents=parents, prefix_len=prefix, q_offset=2)
    assert torch.equal(late.dense(n - 2, n), full.dense(n, n)[:, :, 2:])
    assert_mask_consistent(late, n - 2, n - 1, block_sizes=SMALL_BLOCKS)
    # A chain decoded with q_offset is bottom-right causal.
    chain = Tree(parents=TREES["chain"], prefix_len=4, q_offset=4)
    assert torch.equal(chain.dense(7, 11), masks.Causal(align="bottom_right").dense(7, 11))
    # The attention of the decoding step: the tree rows of the full pass.
    q, k, v = (t.detach() for t in qkv(1, n, n))
    everything = fz.attention(q, k, v, mask=full, backend="dense")
    drafted = fz.attention(q[:, :, prefix:], k, v, mask=step, backend="dense")
    torch.testing.assert_close(drafted, everything[:, :, prefix:])
    assert_matches_reference(drafted, q[:, :, prefix:], k, v, mask=step)


def test_tree_token_attends_as_its_own_path() -> None:
    # Every drafted token's output is causal attention over context + its root-to-token path alone:
    # what scoring each candidate continuation separately would give.
    parents, prefix = TREES["forest"], 4
    n = prefix + len(parents)
    q, k, v = (t.detach() for t in qkv(1, n, n, seed=3))
    out = fz.attention(q, k, v, mask=Tree(parents=parents, prefix_len=prefix), backend="dense")
    for t in range(len(parents)):
        path, u = [], t
        while u >= 0:
            path.insert(0, prefix + u)
            u = parents[u]
        keep = torch.tensor(list(range(prefix)) + path)
        alone = fz.attention(
            q[:, :, keep], k[:, :, keep], v[:, :, keep], mask=masks.Causal(), backend="dense"
        )
        torch.testing.assert_close(out[:, :, prefix + t], alone[:, :, -1], rtol=1e-5, atol=1e-6)


def test_tree_position_ids_are_context_then_depth() -> None:
    spec = Tree(parents=TREES["forest"], prefix_len=3)
    # forest: roots 0, 2, 5; depths 0 1 0 1 2 0 2 2 1
    assert spec.position_ids().tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 3, 5, 5, 4]
    assert Tree(parents=TREES["chain"]).position_ids().tolist() == list(range(7))


def test_tree_block_map_at_scale() -> None:
    # A 63-token binary draft tree after ~1M tokens of context, and a 4k-token tree after 8k.
    spec = Tree(parents=[(t - 1) // 2 for t in range(63)], prefix_len=(1 << 20) - 63)
    bmap = spec.block_map(1 << 20, 1 << 20, 1024, 1024, "cpu")
    assert bmap is not None and bmap.any.shape[-2:] == (1024, 1024)
    assert int(bmap.full.sum()) == 1023 * 1024 // 2  # every context block pair below the diagonal
    wide = Tree(parents=[(t - 1) // 4 for t in range(4096)], prefix_len=8192, q_offset=8192)
    assert wide.block_map(4096, 12288, 128, 128, "cpu") is not None
    assert Tree(parents=[-1, 0]) == Tree(parents=torch.tensor([-1, 0]))  # lists are converted


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"parents": [-1, 1]}, ValueError, r"parents\[1\] = 1"),
        ({"parents": [-1, 0, 5]}, ValueError, r"parents\[2\] = 5"),
        ({"parents": [0]}, ValueError, r"parents\[0\] = 0"),
        ({"parents": [-1, -2]}, ValueError, r"-1 \(a root\)"),
        ({"parents": []}, ValueError, "T >= 1"),
        ({"parents": [[-1, 0]]}, ValueError, "shape"),
        ({"parents": [-1.0, 0.0]}, TypeError, "integer tensor"),
        ({"parents": [-1], "prefix_len": -2}, ValueError, "prefix_len"),
        ({"parents": [-1, 0], "prefix_len": 3, "q_offset": 5}, ValueError, "q_offset"),
        ({"parents": [-1], "q_offset": 1.5}, TypeError, "q_offset"),
    ],
)
def test_tree_parameter_errors(kwargs: dict[str, object], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        Tree(**kwargs)  # type: ignore[arg-type]


def test_tree_problem_must_fit_the_row() -> None:
    spec = Tree(parents=[-1, 0, 0], prefix_len=4, q_offset=4)
    spec.validate(3, 7, 1, 1)
    with pytest.raises(ValueError, match="q_offset \\+ Lq = 8"):
        spec.validate(4, 7, 1, 1)
    with pytest.raises(ValueError, match="Lkv = 8"):
        fz.attention(*qkv(1, 3, 8), mask=spec)


def test_tree_split_form_where_offered() -> None:
    """Whole rows (context causal, tree rows over the context, the tree's own block as a mask) and
    the drafted tokens alone as queries; nothing without a context, for trees past 256 tokens,
    keys short of the row or other query offsets."""
    tree = Tree(parents=[-1, 0, 0, 1, 2], prefix_len=6)
    whole = tree.split_form(11, 11)
    assert whole is not None
    assert [(p.q, p.kv, p.is_causal) for p in whole.parts] == [
        ((0, 6), (0, 6), True),
        ((6, 11), (0, 6), False),
        ((6, 11), (6, 11), False),
    ]
    ancestors = whole.parts[2].mask
    assert ancestors is not None and ancestors.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [True, False, True, False, False],
        [True, True, False, True, False],
        [True, False, True, False, True],
    ]
    decoding = Tree(parents=[-1, 0, 0, 1, 2], prefix_len=6, q_offset=6).split_form(5, 11)
    assert decoding is not None and [(p.q, p.kv) for p in decoding.parts] == [
        ((0, 5), (0, 6)),
        ((0, 5), (6, 11)),
    ]
    assert Tree(parents=[-1, 0, 0, 1, 2]).split_form(5, 5) is None  # no context
    assert Tree(parents=list(range(-1, 299)), prefix_len=4).split_form(304, 304) is None  # a chain: causal
    big = Tree(parents=[-1] + [0] * 299, prefix_len=4)
    assert big.split_form(304, 304) is None  # 300 x 300 tree pairs
    assert tree.split_form(11, 10) is None  # keys short of the row
    assert Tree(parents=[-1, 0, 0, 1, 2], prefix_len=6, q_offset=3).split_form(8, 11) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decoding", [False, True])
def test_tree_runs_on_sdpa_split(dtype: torch.dtype, decoding: bool) -> None:
    """The typical verification tree (63 tokens) on SDPA's kernels plus its own block, GQA 4:2,
    forward and backward against float64; CPU training takes this route."""
    length = 300
    tree = Tree.typical_example(length, length, 2, 4)
    assert tree.parents.numel() == 63
    q_len = 63 if decoding else length
    if decoding:
        tree = Tree(parents=tree.parents, prefix_len=tree.prefix_len, q_offset=tree.prefix_len)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, q_len, 16, generator=g, dtype=dtype).requires_grad_(True)
    k, v = (torch.randn(2, 2, length, 16, generator=g, dtype=dtype).requires_grad_(True) for _ in range(2))
    assert fz.plan(q, k, v, mask=tree, enable_gqa=True).backend == "sdpa_split"
    out = fz.attention(q, k, v, mask=tree, enable_gqa=True, backend="sdpa_split")
    grad_out = torch.randn(out.shape, generator=g, dtype=dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(out, q, k, v, mask=tree, enable_gqa=True, grads=grads, grad_out=grad_out)


def test_tree_split_form_built_under_inference_mode_is_a_normal_tensor() -> None:
    """The ancestor block is kept on the spec: built during an evaluation under inference_mode,
    it must still serve the training calls that follow."""
    tree = Tree(parents=[-1, 0, 0, 1, 2, -1, 5, 3], prefix_len=5)
    with torch.inference_mode():
        form = tree.split_form(13, 13)
    assert form is not None and form.parts[-1].mask is not None
    assert not form.parts[-1].mask.is_inference()


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize(
    ("batch", "length", "decoding"), [(8, 2048, False), (2, 8192, False), (8, 8192, True)]
)
def test_cuda_auto_keeps_draft_trees_on_flex(batch: int, length: int, decoding: bool, grad: bool) -> None:
    """On an H100 the tree's split form on sdpa_split was host-bound and 2.4x slower than Triton
    flex (benchmarks/results/zoo_tree_nofa4_h100_r58.md): auto must not put it before flex."""
    from flexattn_zoo.dispatch import _order, problem_traits
    from flexattn_zoo.problem import Problem

    tree = Tree.typical_example(length, length, batch, 16)
    q_len = length
    if decoding:
        tree = Tree(parents=tree.parents, prefix_len=tree.prefix_len, q_offset=tree.prefix_len)
        q_len = tree.parents.numel()
    p = Problem(
        batch=batch, heads=16, kv_heads=16, q_len=q_len, kv_len=length, head_dim=128, dtype=torch.bfloat16,
        device_type="cuda", arch="sm90", requires_grad=grad, mask=tree.bind(q_len, length),
    )  # fmt: skip
    assert "split_masked" in problem_traits(p)
    order = _order(p)
    assert order.index("flex") < order.index("sdpa_split")
    # Triton flex first of all: on the H200 flex_flash's host time outlasts the tree's kernel.
    assert order.index("flex") < order.index("flex_flash")
