"""The mask catalogue: constructors, validation, and every form checked against the dense oracle.

Shapes are deliberately awkward (Lq != Lkv, lengths not multiples of the block sizes). The block
maps are compared with ``create_block_mask`` (eager, CPU) block by block; nothing is compiled.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from flexattn_zoo import masks
from flexattn_zoo.compose import And, Not, Or
from flexattn_zoo.masks import Causal, Chunked, Document, Full, PrefixLM, SlidingWindow
from flexattn_zoo.masks.band import Band
from flexattn_zoo.masks.causal import OffsetCausal
from flexattn_zoo.masks.padding import KeyPadding
from flexattn_zoo.spec import MaskSpec, SdpaForm, SplitForm, SplitPart, VarlenForm
from flexattn_zoo.testing import assert_mask_consistent

FAMILIES: list[type[MaskSpec]] = [Full, Causal, SlidingWindow, Document, PrefixLM, Chunked]
SHAPES = [(200, 333, 1), (300, 300, 2), (77, 129, 3), (130, 65, 2)]  # (Lq, Lkv, B)
# Odd sizes make every residue of j - i occur at block corners, catching off-by-one rules.
BLOCKS = [(128, 128), (64, 128), (32, 16), (7, 5)]
HEADS = 2


def _cases() -> list[object]:
    out = []
    for cls in [*FAMILIES, OffsetCausal]:  # OffsetCausal: what bottom_right binds to
        for lq, lkv, b in SHAPES:
            for k, spec in enumerate(cls.examples(lq, lkv, b, HEADS)):
                out.append(pytest.param(spec, lq, lkv, b, id=f"{cls.__name__}-{lq}x{lkv}b{b}-{k}"))
    return out


CASES = _cases()


def _composites(lq: int, lkv: int, b: int) -> list[MaskSpec]:
    n = max(lq, lkv)
    docs = Document.from_lengths([n // 3, n // 3, n - 2 * (n // 3)])
    return [
        docs & Causal(),
        Chunked(size=50) & Causal(align="bottom_right"),
        SlidingWindow(left=20) | PrefixLM(prefix_len=7),
        ~Chunked(size=64),
        ~(docs | SlidingWindow(left=3, right=3)),
        Document(doc_ids=torch.arange(b * n).view(b, n) // 40) & PrefixLM(prefix_len=torch.arange(b) * 30),
    ]


COMPOSITES = [
    pytest.param(spec, lq, lkv, b, id=f"composite-{lq}x{lkv}b{b}-{k}")
    for lq, lkv, b in SHAPES
    for k, spec in enumerate(_composites(lq, lkv, b))
]


# ---- helpers ----------------------------------------------------------------------------------


def mod_dense(spec: MaskSpec, lq: int, lkv: int, b: int, h: int = HEADS) -> torch.Tensor:
    """Evaluate the (bound) mask_mod on broadcast index grids."""
    mod = spec.bind(lq, lkv).mask_mod()
    bi = torch.arange(b).view(b, 1, 1, 1)
    hi = torch.arange(h).view(1, h, 1, 1)
    qi = torch.arange(lq).view(1, 1, lq, 1)
    ki = torch.arange(lkv).view(1, 1, 1, lkv)
    return torch.broadcast_to(mod(bi, hi, qi, ki), (b, h, lq, lkv))


def oracle(spec: MaskSpec, lq: int, lkv: int, b: int, h: int = HEADS) -> torch.Tensor:
    out = spec.dense(lq, lkv, batch=b, heads=h)
    assert out.dtype == torch.bool and out.dim() == 4
    return torch.broadcast_to(out, (b, h, lq, lkv))


def torch_blocks(
    spec: MaskSpec, lq: int, lkv: int, b: int, qb: int, kvb: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(any, full) per block pair as create_block_mask classifies them, shape [B, 1, nq, nkv]."""
    bm = create_block_mask(spec.bind(lq, lkv).mask_mod(), b, 1, lq, lkv, device="cpu", BLOCK_SIZE=(qb, kvb))
    nq, nkv = -(-lq // qb), -(-lkv // kvb)
    any_ = bm.to_dense().bool()[..., :nq, :nkv]
    # Full blocks: the first full_kv_num_blocks entries of each row of full_kv_indices.
    counts, idx = bm.full_kv_num_blocks, bm.full_kv_indices.long()
    listed = torch.arange(idx.shape[-1]) < counts[..., None]
    full = torch.zeros(*idx.shape[:-1], idx.shape[-1] + 1, dtype=torch.bool)
    full.scatter_(-1, torch.where(listed, idx, idx.shape[-1]), True)  # unlisted -> spare column
    return any_, full[..., :nq, :nkv]


def varlen_dense(form: VarlenForm, length: int, b: int) -> torch.Tensor:
    """The mask a varlen kernel computes from ``form``: segment-local FA windows."""
    seg = form.segments
    rows = [torch.tensor([length])] * b if seg is None else (list(seg) if seg.dim() == 2 else [seg] * b)
    left, right = form.window
    out = []
    for lengths in rows:
        lengths = lengths[lengths > 0]
        assert int(lengths.sum()) == length
        seg_of = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        same = seg_of[:, None] == seg_of[None, :]
        d = torch.arange(length)[None, :] - torch.arange(length)[:, None]
        ok = same & ((d >= -left) | (left < 0)) & ((d <= right) | (right < 0))
        out.append(ok)
    return torch.stack(out)[:, None]


def blocks_from_dense(
    mask: torch.Tensor, lq: int, lkv: int, qb: int, kvb: int
) -> tuple[torch.Tensor, torch.Tensor]:
    nq, nkv = -(-lq // qb), -(-lkv // kvb)
    padded = torch.zeros(*mask.shape[:2], nq * qb, nkv * kvb, dtype=torch.int64)
    padded[..., :lq, :lkv] = mask.long()
    sums = padded.view(*mask.shape[:2], nq, qb, nkv, kvb).sum(dim=(3, 5))
    return sums > 0, sums == qb * kvb


# ---- oracle agreement --------------------------------------------------------------------------


def test_registry_lists_every_family() -> None:
    assert set(masks.names()) >= {"full", "causal", "sliding_window", "document", "prefix_lm", "chunked"}
    for cls in FAMILIES:
        assert masks.get(cls.name, **({} if cls in (Full, Causal) else _required(cls))).name == cls.name


def _required(cls: type[MaskSpec]) -> dict[str, object]:
    return {
        SlidingWindow: {"left": 3},
        Document: {"doc_ids": [0, 0, 1]},
        PrefixLM: {"prefix_len": 2},
        Chunked: {"size": 4},
    }[cls]


@pytest.mark.parametrize(("spec", "lq", "lkv", "b"), CASES + COMPOSITES)
def test_mask_mod_matches_dense(spec: MaskSpec, lq: int, lkv: int, b: int) -> None:
    spec.validate(lq, lkv, b, HEADS)
    assert torch.equal(mod_dense(spec, lq, lkv, b), oracle(spec, lq, lkv, b))


@pytest.mark.parametrize(("qb", "kvb"), BLOCKS)
@pytest.mark.parametrize(("spec", "lq", "lkv", "b"), CASES)
def test_block_map_matches_create_block_mask(
    spec: MaskSpec, lq: int, lkv: int, b: int, qb: int, kvb: int
) -> None:
    bmap = spec.block_map(lq, lkv, qb, kvb, "cpu")
    if bmap is None:
        # Only Document with unsorted labels may decline.
        assert isinstance(spec, Document), f"{spec!r} has no closed-form block map"

        rows = spec.doc_ids.view(-1, spec.doc_ids.shape[-1])[:, : max(lq, lkv)]
        assert not bool((rows[:, 1:] >= rows[:, :-1]).all())
        return
    want_any, want_full = torch_blocks(spec, lq, lkv, b, qb, kvb)
    assert bmap.any.dtype == torch.bool and bmap.full.dtype == torch.bool
    assert bmap.any.shape[1] == 1 and bmap.any.shape[0] in (1, b)
    assert torch.equal(torch.broadcast_to(bmap.any, want_any.shape), want_any)
    assert torch.equal(torch.broadcast_to(bmap.full, want_full.shape), want_full)


@pytest.mark.parametrize(("qb", "kvb"), [(64, 128), (32, 16)])
@pytest.mark.parametrize(("spec", "lq", "lkv", "b"), COMPOSITES)
def test_composite_block_map_is_safe(spec: MaskSpec, lq: int, lkv: int, b: int, qb: int, kvb: int) -> None:
    bmap = spec.block_map(lq, lkv, qb, kvb, "cpu")
    if bmap is None:
        return
    true_any, true_full = blocks_from_dense(oracle(spec, lq, lkv, b, 1), lq, lkv, qb, kvb)
    got_any = torch.broadcast_to(bmap.any, true_any.shape)
    got_full = torch.broadcast_to(bmap.full, true_full.shape)
    assert not bool((true_any & ~got_any).any()), "a visible block was dropped"
    assert not bool((got_full & ~true_full).any()), "a block marked full has masked elements"
    assert not bool((got_full & ~got_any).any())


@pytest.mark.parametrize(("spec", "lq", "lkv", "b"), CASES + COMPOSITES)
def test_cheap_forms_match_dense(spec: MaskSpec, lq: int, lkv: int, b: int) -> None:
    want = oracle(spec, lq, lkv, b, 1)
    sdpa = spec.sdpa_form(lq, lkv)
    if sdpa is not None:
        ref = torch.ones(lq, lkv, dtype=torch.bool)
        ref = ref.tril() if sdpa.is_causal else ref
        assert torch.equal(want, torch.broadcast_to(ref, want.shape))
    form = spec.varlen_form(lq, lkv, b)
    if lq != lkv:
        assert form is None
    elif form is not None:
        assert torch.equal(varlen_dense(form, lq, b), want)
    split = spec.split_form(lq, lkv)
    if split is not None:
        assert torch.equal(torch.broadcast_to(split_paint(split, lq, lkv), want.shape), want)


def split_paint(form: SplitForm, lq: int, lkv: int) -> torch.Tensor:
    """What a kernel per part computes: each rectangle painted (causal ones as a lower triangle
    from its top-left corner, masked ones where their mask is True); no key may be painted twice
    in a row (the merge would count it twice)."""
    count = torch.zeros(lq, lkv, dtype=torch.int64)
    for part in form.parts:
        (q0, q1), (k0, k1) = part.q, part.kv
        rect = torch.ones(q1 - q0, k1 - k0, dtype=torch.int64)
        if part.mask is not None:
            rect = part.mask.long()
        count[q0:q1, k0:k1] += rect.tril() if part.is_causal else rect
    assert int(count.max()) <= 1
    return count.bool()


def test_forms_offered_where_promised() -> None:
    assert Full().sdpa_form(3, 7) == SdpaForm(is_causal=False)
    assert Causal().sdpa_form(5, 5) == SdpaForm(is_causal=True)
    assert Causal(align="bottom_right").sdpa_form(5, 5) == SdpaForm(is_causal=True)
    assert Causal().sdpa_form(5, 6) is None and Causal().varlen_form(5, 6, 1) is None
    assert Full().varlen_form(9, 9, 2) == VarlenForm(None, (-1, -1))
    assert Causal().varlen_form(9, 9, 2) == VarlenForm(None, (-1, 0))
    assert SlidingWindow(left=4, right=2).varlen_form(9, 9, 2) == VarlenForm(None, (4, 2))
    assert PrefixLM(prefix_len=3).varlen_form(9, 9, 1) is None
    split = PrefixLM(prefix_len=3).split_form(9, 9)
    assert split == SplitForm((SplitPart((0, 9), (0, 3), False), SplitPart((3, 9), (3, 9), True)))
    assert PrefixLM(prefix_len=3).split_form(9, 10) is None  # Lq != Lkv: not offered
    assert PrefixLM(prefix_len=1).split_form(9, 9) is None  # plain causal: SDPA form instead
    assert PrefixLM(prefix_len=9).split_form(9, 9) is None  # no mask: SDPA form instead
    assert PrefixLM(prefix_len=torch.tensor([2, 3])).split_form(9, 9) is None  # per-row prefixes
    assert Causal().split_form(9, 9) is None and (PrefixLM(prefix_len=3) & Causal()).split_form(9, 9) is None
    chunks = Chunked(size=4).varlen_form(10, 10, 1)
    assert chunks is not None and chunks.segments.tolist() == [4, 4, 2]
    docs = Document(doc_ids=[[5, 5, 1, 1, 1], [0, 1, 1, 1, 1]]).varlen_form(5, 5, 2)
    assert docs is not None and docs.segments.tolist() == [[2, 3], [1, 4]]
    assert Document(doc_ids=[0, 1, 0]).varlen_form(3, 3, 1) is None  # label 0 split in two runs
    assert Document(doc_ids=[0, 1, 0]).block_map(3, 3, 2, 2, "cpu") is None  # unsorted


@pytest.mark.parametrize(("spec", "lq", "lkv", "b"), CASES + COMPOSITES)
def test_lowest_visible_key_matches_dense(spec: MaskSpec, lq: int, lkv: int, b: int) -> None:
    # Sound and never decreasing for every spec; the exact lowest key for single specs.
    assert_mask_consistent(spec, lq, lkv, batch=b, heads=HEADS, block_sizes=(), check_create_block_mask=False)


def test_lowest_visible_key_offered_where_promised() -> None:
    q = torch.arange(10)
    assert SlidingWindow(left=3, right=2).lowest_visible_key(q).tolist() == [i - 3 for i in range(10)]
    assert Band(lo=-2, hi=5).lowest_visible_key(q).tolist() == [i - 2 for i in range(10)]
    assert Band(lo=1).lowest_visible_key(q).tolist() == [i + 1 for i in range(10)]
    assert Chunked(size=4).lowest_visible_key(q).tolist() == [0, 0, 0, 0, 4, 4, 4, 4, 8, 8]
    # Every key from 0 on may be visible: no bound (decode keeps its fixed block list).
    for spec in (
        Full(),
        Causal(),
        Causal(align="bottom_right").bind(4, 9),
        Band(hi=3),
        PrefixLM(prefix_len=3),
        Document(doc_ids=[0, 0, 1, 1, 1, 2, 2, 2, 2, 2]),
        ~SlidingWindow(left=2),
    ):
        assert spec.lowest_visible_key(q) is None, spec
    # &: the largest bound, parts without one count as 0; |: the smallest, none if a part has none.
    window, chunks = SlidingWindow(left=5), Chunked(size=4)
    assert (Causal() & window).lowest_visible_key(q).tolist() == [max(0, i - 5) for i in range(10)]
    assert (window & chunks).lowest_visible_key(q).tolist() == [max(i - 5, i // 4 * 4) for i in range(10)]
    assert (window | chunks).lowest_visible_key(q).tolist() == [min(i - 5, i // 4 * 4) for i in range(10)]
    assert (Causal() | chunks).lowest_visible_key(q) is None
    assert (Causal() & Full()).lowest_visible_key(q) is None
    grid = torch.tensor([[0, 5, 9], [3, 4, 7]])  # decode asks for [B, n_q] grids of positions
    assert torch.equal((window & chunks).lowest_visible_key(grid), torch.maximum(grid - 5, grid // 4 * 4))


def test_sees_one_run_offered_where_promised() -> None:
    """KV-cache decoding runs a one-query step as SDPA over a slice of the cache exactly for the
    masks that say each query sees one run of keys through its own (the others say no, which is
    always safe); each claim is checked against the dense oracle by the consistency check."""
    window, chunks = SlidingWindow.from_hf(4), Chunked(size=3)
    runs = [Full(), Causal(), Causal(align="bottom_right"), window, SlidingWindow(left=2, right=3), chunks]
    runs += [PrefixLM(prefix_len=3), PrefixLM(prefix_len=torch.tensor([2, 5])), Band(lo=-3, hi=1), Band(hi=0)]
    runs += [window & chunks, window | chunks, chunks & Causal(), PrefixLM(prefix_len=4) | window]
    gaps = [Band(lo=1), Band(hi=-1), Document(doc_ids=[0, 0, 1, 1, 1, 2, 2, 2, 2]), ~window]
    gaps += [
        masks.DilatedSlidingWindow(left=4, dilation=2),
        window & Document(doc_ids=[0, 0, 1, 1, 1, 2, 2, 2, 2]),
    ]
    for spec in runs + gaps:
        assert spec.sees_one_run() == (spec in runs), spec
        assert_mask_consistent(
            spec, 9, 9, batch=2, heads=HEADS, block_sizes=(), check_create_block_mask=False
        )


def test_a_wrong_one_run_claim_fails_the_consistency_check() -> None:
    """The check must catch a spec that claims one run: gaps in the run (a dilated window), a run
    that misses the query (a band above the diagonal), a start that is not the lowest key."""

    class GapsClaimed(masks.DilatedSlidingWindow):
        def sees_one_run(self) -> bool:
            return True

    class MissesTheQuery(Band):
        def sees_one_run(self) -> bool:
            return True

    class LowStart(SlidingWindow):
        def sees_one_run(self) -> bool:
            return True

        def lowest_visible_key(self, q_idx: torch.Tensor) -> torch.Tensor | None:
            return q_idx - self.left - 1  # a sound bound, but not where the run starts

    for spec in (GapsClaimed(left=4, dilation=2), MissesTheQuery(lo=1, hi=3), LowStart(left=2)):
        with pytest.raises(AssertionError, match="sees_one_run"):
            assert_mask_consistent(
                spec, 9, 9, block_sizes=(), exact_lowest_key=False, check_create_block_mask=False
            )


class _TooHigh(SlidingWindow):
    def lowest_visible_key(self, q_idx: torch.Tensor) -> torch.Tensor | None:
        return q_idx - self.left + 1

    def sees_one_run(self) -> bool:
        return False  # its bound is not where the run starts (checked on its own below)


class _TooLow(SlidingWindow):
    def lowest_visible_key(self, q_idx: torch.Tensor) -> torch.Tensor | None:
        return q_idx - self.left - 1

    def sees_one_run(self) -> bool:
        return False


class _Decreasing(Causal):
    def lowest_visible_key(self, q_idx: torch.Tensor) -> torch.Tensor | None:
        return -q_idx


class _Float(Chunked):
    def lowest_visible_key(self, q_idx: torch.Tensor) -> torch.Tensor | None:
        return (q_idx // self.size * self.size).double()


def test_wrong_lowest_visible_keys_are_caught() -> None:
    with pytest.raises(AssertionError, match="query 2 sees no key below 1, but it sees key 0"):
        assert_mask_consistent(_TooHigh(left=2), 9, 9)
    with pytest.raises(AssertionError, match="is 0 for query 3, whose lowest visible key is 1"):
        assert_mask_consistent(_TooLow(left=2), 9, 9)
    # A lower bound is accepted where exactness is not asked for (as for composites).
    assert_mask_consistent(_TooLow(left=2), 9, 9, exact_lowest_key=False)
    assert_mask_consistent(_TooLow(left=2) & Causal(), 9, 9)
    with pytest.raises(AssertionError, match="decreases from query 0 to 1"):
        assert_mask_consistent(_Decreasing(), 9, 9)
    with pytest.raises(AssertionError, match="int64 tensor"):
        assert_mask_consistent(_Float(size=4), 9, 9)


@pytest.mark.parametrize("cls", FAMILIES)
def test_block_map_scales_without_quadratic_memory(cls: type[MaskSpec]) -> None:
    # 1M tokens: an element-wise evaluation would need 2^40 entries; per-block work is 1024^2.
    n = 1 << 20
    spec = cls.examples(n, n, 1, 1)[1 if cls is not Full else 0]
    bmap = spec.block_map(n, n, 1024, 1024, "cpu")
    assert bmap is not None and bmap.any.shape[-2:] == (1024, 1024)


# ---- constructors ------------------------------------------------------------------------------


def test_sliding_window_from_hf() -> None:
    assert SlidingWindow.from_hf(4096) == SlidingWindow(left=4095, right=0)
    assert SlidingWindow.from_hf(1) == SlidingWindow(left=0)
    with pytest.raises(ValueError, match="sliding_window"):
        SlidingWindow.from_hf(0)
    with pytest.raises(TypeError, match="sliding_window"):
        SlidingWindow.from_hf(True)


def test_document_from_lengths_and_cu_seqlens() -> None:
    ids = [0, 0, 0, 1, 1, 2]
    assert Document.from_lengths([3, 2, 1]).doc_ids.tolist() == ids
    assert Document.from_lengths(torch.tensor([3, 2, 1], dtype=torch.int32)).doc_ids.tolist() == ids
    assert Document.from_cu_seqlens([0, 3, 5, 6]) == Document(doc_ids=ids)
    assert Document.from_cu_seqlens(torch.tensor([0, 3, 5, 6])) == Document(doc_ids=ids)
    per_row = Document.from_lengths([[3, 2], [1, 1]])
    # The short row is padded with one extra document (id 2) up to the longest total (5).
    assert per_row.doc_ids.tolist() == [[0, 0, 0, 1, 1], [0, 1, 2, 2, 2]]
    padded = Document.from_lengths(torch.tensor([[3, 2, 0], [1, 1, 0]]))
    assert padded.doc_ids.tolist() == [[0, 0, 0, 1, 1], [0, 1, 3, 3, 3]]  # pad id = entries per row
    assert torch.equal(padded.dense(5, 5), per_row.dense(5, 5))
    assert Document.from_lengths([2, 0, 1]).doc_ids.tolist() == [0, 0, 2]
    assert per_row.uses_batch() and not Document(doc_ids=ids).uses_batch()


def _captured_tensors(spec: MaskSpec) -> list[torch.Tensor]:
    cells = spec.mask_mod().__closure__ or ()
    return [c.cell_contents for c in cells if isinstance(c.cell_contents, torch.Tensor)]


def test_document_mask_mod_looks_up_int32_labels_without_merging_documents() -> None:
    # int32 labels are the kernels' fast lookup; labels beyond int32 are renumbered, not wrapped
    # (2**32 wraps to 0, which would join two documents).
    small = Document(doc_ids=[0, 0, 1, 1, 2])
    wide = Document(doc_ids=[0, 0, 2**32, 2**32, -(2**40)])
    for spec in (small, wide):
        assert [t.dtype for t in _captured_tensors(spec)] == [torch.int32]
        assert spec.doc_ids.dtype == torch.int64  # the public field keeps the user's labels
        assert_mask_consistent(spec, 5, 5)
    assert not wide.dense(5, 5)[0, 0, 1, 2]


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: Document.from_lengths([3, -1]), ValueError, "lengths"),
        (lambda: Document.from_lengths([]), ValueError, "lengths"),
        (lambda: Document.from_lengths([0, 0]), ValueError, "lengths"),
        (lambda: Document.from_lengths([1.5, 2]), TypeError, "lengths"),
        (lambda: Document.from_lengths(3), TypeError, "lengths"),
        (lambda: Document.from_cu_seqlens([1, 3]), ValueError, "cu_seqlens"),
        (lambda: Document.from_cu_seqlens([0, 3, 2]), ValueError, "cu_seqlens"),
        (lambda: Document.from_cu_seqlens([[0, 3]]), ValueError, "cu_seqlens"),
        (
            lambda: Document.from_cu_seqlens([0, 0]),
            ValueError,
            r"from_cu_seqlens\(cu_seqlens=...\) needs a positive",
        ),
        (
            lambda: Document.from_lengths(torch.ones(2, 2, 2, dtype=torch.long)),
            ValueError,
            r"1-D \[S\] or 2-D \[B, S\]",
        ),
    ],
)
def test_document_constructor_errors(call: Callable[[], object], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        call()


# ---- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: Causal(align="bottom"), ValueError, "align.*top_left.*bottom_right"),
        (lambda: SlidingWindow(left=-1), ValueError, r"left.*>= 0"),
        (lambda: SlidingWindow(left=2, right=-2), ValueError, "right"),
        (lambda: SlidingWindow(left=True), TypeError, "left"),
        (lambda: SlidingWindow(left=1.5), TypeError, "left"),
        (lambda: Chunked(size=0), ValueError, r"size.*>= 1"),
        (lambda: Chunked(size=True), TypeError, "size"),
        (lambda: PrefixLM(prefix_len=-1), ValueError, "prefix_len"),
        (lambda: PrefixLM(prefix_len=True), TypeError, "prefix_len"),
        (lambda: PrefixLM(prefix_len=torch.tensor([1.0])), TypeError, "prefix_len"),
        (lambda: PrefixLM(prefix_len=torch.tensor([[1]])), ValueError, "prefix_len"),
        (lambda: PrefixLM(prefix_len=torch.tensor(3)), ValueError, "prefix_len"),
        (lambda: PrefixLM(prefix_len=torch.tensor([2, -1])), ValueError, "prefix_len"),
        (lambda: Document(doc_ids=torch.zeros(4)), TypeError, "doc_ids"),
        (lambda: Document(doc_ids=torch.zeros(4, dtype=torch.bool)), TypeError, "doc_ids"),
        (lambda: Document(doc_ids=torch.zeros(1, 2, 4, dtype=torch.long)), ValueError, "doc_ids"),
        (lambda: Document(doc_ids=torch.zeros(0, dtype=torch.long)), ValueError, "doc_ids"),
        (
            lambda: Document(doc_ids=torch.zeros(4, dtype=torch.long)).validate(5, 3, 1, 1),
            ValueError,
            "doc_ids",
        ),
        (
            lambda: Document(doc_ids=torch.zeros(2, 8, dtype=torch.long)).validate(8, 8, 3, 1),
            ValueError,
            "batch",
        ),
        (lambda: PrefixLM(prefix_len=torch.tensor([1, 2])).validate(8, 8, 3, 1), ValueError, "batch"),
        (lambda: Causal(align="bottom_right").mask_mod(), ValueError, "bind"),
        (lambda: masks.get("sliding_window", left=-3), ValueError, "left"),
        # __index__ that raises (float / multi-element tensors) still names the argument.
        (lambda: SlidingWindow(left=torch.tensor(3.0)), TypeError, r"SlidingWindow\(left=...\)"),
        (lambda: Chunked(size=torch.tensor([1, 2])), TypeError, r"Chunked\(size=...\)"),
        (lambda: KeyPadding(valid=torch.ones(1, 2, dtype=torch.bool)).dense(3, 3), ValueError, "valid"),
        (lambda: And(parts=()), ValueError, r"And\(parts=...\)"),
        (lambda: And(parts=(Causal(), 3)), TypeError, r"And\(parts=...\)"),
        (lambda: Or(parts=Causal()), TypeError, r"Or\(parts=...\)"),
        (lambda: Not(part=3), TypeError, r"Not\(part=...\)"),
    ],
)
def test_validation_errors(call: Callable[[], object], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize(
    "spec",
    [
        SlidingWindow(left=0, right=2**31 - 1),  # fits int32, but q_idx + right would not
        SlidingWindow(left=2**40, right=2**40),  # 2**40 wraps to 0 in int32
        SlidingWindow(left=2**31 - 1),
        PrefixLM(prefix_len=2**31),
        Chunked(size=2**31),
        Band(lo=-(2**40), hi=2**40),
        OffsetCausal(offset=2**40),
        OffsetCausal(offset=-(2**40)),
        # Beyond int64 too (the block maps compute in int64).
        SlidingWindow(left=2**63, right=2**64),
        Chunked(size=2**63),
        PrefixLM(prefix_len=2**64),
        Band(lo=-(2**64), hi=2**64),
        OffsetCausal(offset=2**64),
    ],
    ids=repr,
)
def test_huge_parameters_do_not_wrap_in_int32_index_arithmetic(spec: MaskSpec) -> None:
    # Flex passes int32 q_idx / kv_idx (so does the checker); "unbounded" windows and prefixes
    # must stay unbounded, not wrap around to small or negative values.
    for q_len, kv_len in ((4, 4), (40, 47), (47, 40)):
        assert_mask_consistent(spec, q_len, kv_len)


def test_position_parameters_beyond_any_index_are_clamped_when_built() -> None:
    # Every length a kernel can index is below 2**31 - 1, so these are the same masks.
    assert SlidingWindow(left=2**40) == SlidingWindow(left=2**31 - 1)
    assert PrefixLM(prefix_len=2**64).prefix_len == 2**31 - 1
    assert OffsetCausal(offset=-(2**64)).offset == -(2**31 - 1)


@pytest.mark.parametrize("value", [0, 1, 2**31 - 2, 2**31 - 1, 2**31, -(2**31) + 1, -(2**31), -1])
def test_int_parameters_at_the_clamp_and_minimum_edges(value: int) -> None:
    # Plain ints in range take a shortcut when a spec is built; the edges around it must give
    # what the full check gives (the value, the clamp, or the error for a negative window).
    limit = 2**31 - 1
    assert OffsetCausal(offset=value).offset == max(-limit, min(limit, value))
    if value < 0:
        with pytest.raises(ValueError, match=r"left.*>= 0"):
            SlidingWindow(left=value)
    else:
        assert SlidingWindow(left=value).left == min(limit, value)


def test_composites_built_directly_keep_their_parts_tensors() -> None:
    docs = Document(doc_ids=[0, 0, 1])
    both = And(parts=[Causal(), docs])  # a list, as a user might write it
    assert both.parts == (Causal(), docs) and both == Causal() & docs
    assert both.tensors() == [docs.doc_ids]
    assert both.to("meta").parts[1].doc_ids.device.type == "meta"


def test_moving_a_composite_moves_the_device_state_of_its_parts() -> None:
    # Band and OffsetCausal keep their offsets in tensors made on their own device, not in tensor
    # fields: moving a composite that holds one must move it too, or a CUDA kernel would be
    # handed the CPU tensors its mask_mod captures. The device is part of a spec's value.
    chunks = Chunked(size=2)
    for part in (Band(lo=-2, hi=1), OffsetCausal(offset=3)):
        on_meta = part.to("meta")
        assert on_meta != part
        assert And(parts=(part, chunks)).to("meta") == And(parts=(on_meta, chunks))
        assert Or(parts=(chunks, part)).to("meta") == Or(parts=(chunks, on_meta))
        assert Not(part=part).to("meta") == Not(part=on_meta)
        assert Not(part=part).map_tensors(lambda t: t) == Not(part=part)  # nothing to map: unchanged
    docs = Document(doc_ids=[0, 0, 1, 1, 1, 2])
    moved = (Band(lo=-2, hi=1) & docs).to("meta")
    assert [p.to("meta") is p for p in moved.parts] == [True, True]


def test_document_constructors_put_ids_on_the_device_asked_for() -> None:
    assert Document.from_lengths(torch.tensor([3, 2]), device="meta").doc_ids.device.type == "meta"
    assert Document.from_cu_seqlens(torch.tensor([0, 3, 5]), device="meta").doc_ids.device.type == "meta"
    assert Document.from_lengths(torch.tensor([3, 2])).doc_ids.device.type == "cpu"


def test_valid_shapes_pass_validation() -> None:
    Document(doc_ids=torch.zeros(2, 8, dtype=torch.long)).validate(8, 5, 2, 4)
    PrefixLM(prefix_len=torch.tensor([1, 2])).validate(8, 8, 2, 1)
    PrefixLM(prefix_len=5).validate(8, 8, 7, 1)


# ---- identity, binding, algebra ----------------------------------------------------------------


def test_equal_specs_are_equal_hash_equal_and_share_mask_mod() -> None:
    pairs = [
        (Full(), Full()),
        (Causal(), Causal(align="top_left")),
        (SlidingWindow(left=3), SlidingWindow(left=3, right=0)),
        (Chunked(size=8), masks.get("chunked", size=8)),
        (Document(doc_ids=[0, 0, 1]), Document(doc_ids=torch.tensor([0, 0, 1], dtype=torch.int32))),
        (
            PrefixLM(prefix_len=torch.tensor([1, 2])),
            PrefixLM(prefix_len=torch.tensor([1, 2], dtype=torch.int32)),
        ),
        (Document(doc_ids=[0, 1]) & Causal(), Document(doc_ids=[0, 1]) & Causal()),
    ]
    for a, b in pairs:
        assert a == b and hash(a) == hash(b)
        assert a.mask_mod() is b.mask_mod()
    different = [
        (Causal(), Causal(align="bottom_right")),
        (SlidingWindow(left=3), SlidingWindow(left=3, right=1)),
        (Document(doc_ids=[0, 0, 1]), Document(doc_ids=[0, 1, 1])),
        (PrefixLM(prefix_len=2), PrefixLM(prefix_len=torch.tensor([2]))),
    ]
    for a, b in different:
        assert a != b


def test_bind() -> None:
    br = Causal(align="bottom_right")
    assert br.bind(5, 5) == Causal()
    assert br.bind(3, 5) == OffsetCausal(offset=2)
    assert br.bind(5, 3) == OffsetCausal(offset=-2)
    top = Causal()
    assert top.bind(3, 5) is top
    plain = Document(doc_ids=[0, 0, 1]) & Causal()
    assert plain.bind(2, 3) is plain
    bound = (Document(doc_ids=[0, 0, 1, 1]) & br).bind(2, 4)
    assert isinstance(bound, And) and bound.parts[1] == OffsetCausal(offset=2)
    assert (~br).bind(2, 4) == Not(part=OffsetCausal(offset=2))
    assert isinstance((br | Full()).bind(2, 4), Or)
    with pytest.raises(ValueError, match="bind"):
        (Document(doc_ids=[0, 0, 1, 1]) & br).mask_mod()


def test_mask_mod_works_under_vmap() -> None:
    # flex evaluates mask_mod under vmap with 0-d int32 indices; check the captured tensors index.
    idx = torch.arange(6, dtype=torch.int32)
    for spec in (
        Document(doc_ids=[[0, 0, 1, 1, 2, 2]]),
        PrefixLM(prefix_len=torch.tensor([2])),
        Chunked(size=4),
    ):
        mod = spec.mask_mod()
        fn = torch.vmap(
            torch.vmap(lambda q, k, m=mod: m(torch.tensor(0), torch.tensor(0), q, k), (None, 0)), (0, None)
        )
        assert torch.equal(fn(idx, idx), oracle(spec, 6, 6, 1, 1)[0, 0])
