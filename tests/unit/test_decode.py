"""fz.decode: decode steps vs the float64 reference, in-place mask updates, paged caches."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from flexattn_zoo import _compat, masks, score_mods
from flexattn_zoo.compile import CACHE as COMPILE_CACHE
from flexattn_zoo.compile import STATIC_SHAPES
from flexattn_zoo.models import decode
from flexattn_zoo.spec import MaskMod, MaskSpec, spec_dataclass
from flexattn_zoo.testing import assert_mask_consistent, reference_attention

B, H, HKV, D, CAP, BS = 2, 4, 2, 16, 640, 128


def reference_decode(q, k, v, lens, mask, score=None, sinks=None, scale=None):  # type: ignore[no-untyped-def]
    """Oracle: the full causal forward of each row with q placed at its last Lq positions."""
    rows = []
    for b in range(q.shape[0]):
        n, lq = int(lens[b]), q.shape[2]
        full_q = torch.zeros(1, q.shape[1], n, q.shape[3], dtype=torch.float64)
        full_q[:, :, n - lq :] = q[b : b + 1].double()
        out = reference_attention(
            full_q,
            k[b : b + 1, :, :n].double(),
            v[b : b + 1, :, :n].double(),
            mask=mask,
            score_mod=score,
            enable_gqa=True,
            sinks=sinks,
            scale=scale,
        )
        rows.append(out[0, :, n - lq :])
    return torch.stack(rows)


def _cache(seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, HKV, CAP, D, generator=g), torch.randn(B, HKV, CAP, D, generator=g)


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    # float32 kernels vs float64: unit-scale values over <= 640 keys; 2e-6 is ~30 float32 ulps.
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)


def test_steps_reuse_one_mask_and_kernel_and_read_only_live_blocks() -> None:
    mask, score = masks.SlidingWindow.from_hf(150), score_mods.Alibi(num_heads=H)
    k, v = _cache()
    lengths = [
        torch.tensor([300, 129]),
        torch.tensor([301, 130]),
        torch.tensor([520, 7]),
        torch.tensor([640, 256]),
    ]
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for step, lens in enumerate(lengths):
            q = torch.randn(B, H, 1, D, generator=g)
            out = decode.decode_step(q, k, v, lens, mask=mask, score_mod=score)
            _close(out, reference_decode(q, k, v, lens, mask, score))
            if step == 0:
                builds, compiles = decode.CACHE.inserts, COMPILE_CACHE.total_compiles()
                (dm,) = [d for d in decode.CACHE.values() if d.spec == mask]
                bm = dm.block_mask
            # The kernel visits only blocks from the window's first key to the last live key.
            for b in range(B):
                n = int(lens[b])
                first, last = max(0, n - 150) // BS, (n - 1) // BS
                assert int(dm.kv_num_blocks[b, 0, 0]) == last - first + 1
                assert dm.kv_indices[b, 0, 0, : last - first + 1].tolist() == list(range(first, last + 1))
    assert decode.CACHE.inserts == builds and COMPILE_CACHE.total_compiles() == compiles
    assert dm.block_mask is bm


def test_a_new_score_callable_every_step_keeps_the_mask_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller that builds its score_mod per step (a lambda in the loop) must not grow the
    decode mask's per-score state without bound; every step stays exact."""
    monkeypatch.setattr(decode.mask, "SCORES_PER_MASK", 2)  # read when the mask is built
    mask = masks.SlidingWindow.from_hf(149)
    k, v = _cache(2)
    lens = torch.tensor([300, 129])
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for step in range(4):
            cap = 2.0 + step

            def score(s, b, h, q_idx, kv_idx, cap=cap):  # type: ignore[no-untyped-def]
                return cap * torch.tanh(s / cap)

            q = torch.randn(B, H, 1, D, generator=g)
            out = decode.decode_step(q, k, v, lens, mask=mask, score_mod=score)
            _close(out, reference_decode(q, k, v, lens, mask, score_mods.SoftCap(cap=cap)))
    (dm,) = [d for d in decode.CACHE.values() if d.spec == mask]
    assert len(dm._scores) <= 2


def test_several_new_tokens_and_int_length() -> None:
    k, v = _cache(1)
    q = torch.randn(B, H, 3, D, generator=torch.Generator().manual_seed(6))
    mask = masks.Chunked(size=100) & masks.Causal()
    with torch.no_grad():
        out = decode.decode_step(q, k, v, 333, mask=mask, score_mod=score_mods.SoftCap(cap=2.0))
    _close(out, reference_decode(q, k, v, torch.tensor([333, 333]), mask, score_mods.SoftCap(cap=2.0)))


def test_paged_cache_matches_contiguous() -> None:
    n_pages = 8
    g = torch.Generator().manual_seed(7)
    kp, vp = (
        torch.randn(1, HKV, n_pages * BS, D, generator=g),
        torch.randn(1, HKV, n_pages * BS, D, generator=g),
    )
    table = torch.tensor([[5, 2, 7, -1], [1, 0, 3, 6]])
    lens = torch.tensor([300, 450])
    k = decode._gather_pages(kp, table, 4, BS)
    v = decode._gather_pages(vp, table, 4, BS)
    q = torch.randn(B, H, 1, D, generator=g)
    mask = masks.SlidingWindow.from_hf(200)
    with torch.no_grad():
        out = decode.decode_step(q, kp, vp, lens, block_table=table, mask=mask)
    _close(out, reference_decode(q, k, v, lens, mask))
    # With sinks (an lse is needed) the CPU runs the dense route over the gathered pages.
    sinks = torch.tensor([-1.0, 0.0, 2.0, 5.0])
    out = decode.decode_step(q, kp, vp, lens, block_table=table, mask=mask, sinks=sinks)
    _close(out, reference_decode(q, k, v, lens, mask, sinks=sinks))


def test_grads_take_the_dense_route() -> None:
    k, v = _cache(2)
    q = torch.randn(
        B, H, 2, D, generator=torch.Generator().manual_seed(8), dtype=torch.float64
    ).requires_grad_()
    k, v = k.double().requires_grad_(), v.double().requires_grad_()
    lens = torch.tensor([100, 250])
    out = decode.decode_step(q, k, v, lens, mask=masks.SlidingWindow.from_hf(64))
    ref = reference_decode(q, k, v, lens, masks.SlidingWindow.from_hf(64))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and k.grad is not None


def test_bad_arguments() -> None:
    k, v = _cache()
    q = torch.randn(B, H, 1, D)
    with pytest.raises(ValueError, match="one length per batch row"):
        decode.decode_step(q, k, v, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="backend"):
        decode.decode_step(q, k, v, 10, backend="sdpa_math")
    with pytest.raises(ValueError, match="cannot run this decode step"):
        decode.decode_step(q, k, v, 10, backend="flex_cpu", sinks=torch.zeros(H))
    with pytest.raises(ValueError, match="paged caches are pools"):
        decode.decode_step(q, k, v, 10, block_table=torch.zeros(B, 2, dtype=torch.long))


def test_patterns_without_a_lower_bound_keep_their_block_list_and_update_only_counts() -> None:
    k, v = _cache(3)
    dm = decode.DecodeMask(masks.Causal(), B, 1, CAP)
    indices = dm.kv_indices.clone()
    for lens in (torch.tensor([1, 640]), torch.tensor([129, 0]), torch.tensor([5000, 300])):
        dm.update(lens)
        want = [
            min(-(-int(n) // BS), CAP // BS) for n in lens
        ]  # past the capacity: clamped, never out of range
        assert dm.kv_num_blocks[:, 0, 0].tolist() == want
        assert dm.offset.tolist() == [int(n) - 1 for n in lens]
    assert torch.equal(dm.kv_indices, indices)
    # ... and decoding through that path is exact.
    q = torch.randn(B, H, 2, D, generator=torch.Generator().manual_seed(4))
    lens = torch.tensor([200, 640])
    with torch.no_grad():
        out = decode.decode_step(q, k, v, lens)
    _close(out, reference_decode(q, k, v, lens, masks.Causal()))


@pytest.mark.parametrize(
    "spec",
    [
        masks.Causal(),
        masks.SlidingWindow.from_hf(100),
        masks.Chunked(size=64),
        masks.Full(),
        masks.Causal() & masks.SlidingWindow.from_hf(50),
        masks.Causal() | masks.Chunked(size=64),
        masks.SlidingWindow.from_hf(30) | masks.Chunked(size=64),
        None,
    ],
    ids=repr,
)
def test_bounded_below_agrees_with_lowest_key(spec) -> None:  # type: ignore[no-untyped-def]
    q_abs = torch.arange(0, 1000, 7)
    lowest = decode.lowest_key(spec, q_abs)
    assert decode._bounded_below(spec) == bool((lowest > 0).any())


@spec_dataclass
class _Recent(MaskSpec):
    """A user's pattern: the last ``width`` keys, own included. No catalogue class, only the form."""

    width: int

    def _make_mask_mod(self) -> MaskMod:
        width = self.width

        def recent(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return (kv_idx <= q_idx) & (kv_idx > q_idx - width)

        return recent

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        return torch.ones(q_len, kv_len, dtype=torch.bool).tril().triu(-(self.width - 1))[None, None]

    def lowest_visible_key(self, q_idx: torch.Tensor) -> torch.Tensor | None:
        return q_idx - (self.width - 1)


@pytest.mark.parametrize(
    "mask",
    [masks.SlidingWindow.from_hf(150), masks.Chunked(size=200) & masks.Causal(), masks.Band(lo=-300, hi=-20)],
    ids=repr,
)
@pytest.mark.parametrize("q_len", [1, 130])
def test_int_steps_rewrite_a_bounded_block_list_only_when_it_moves(mask: MaskSpec, q_len: int) -> None:
    """An int length on a pattern bounded below (arithmetic bounds) is read on the host: the block
    list is written when it moves (once every block of keys at most) and only the lengths
    otherwise, and after every step it is what the lengths-tensor path writes. A step from a
    lengths tensor in between forgets the record."""
    dm = decode.DecodeMask(mask, B, q_len, CAP)
    writes = []
    real = dm._write_lists
    dm._write_lists = lambda *a: (writes.append(1), real(*a))[1]  # type: ignore[method-assign]
    lists = []
    for n in [*range(q_len, CAP + 1, 7), CAP, 300, 300]:
        dm.update(n)
        want = decode.DecodeMask(mask, B, q_len, CAP)
        want.update(torch.tensor([n] * B))
        for name in ("cache_len", "kv_num_blocks", "kv_indices"):
            assert torch.equal(getattr(dm, name), getattr(want, name)), (name, n)
        lists.append(dm._list_written)
    moves = sum(1 for i, now in enumerate(lists) if i == 0 or now != lists[i - 1])
    assert len(writes) == moves < len(lists) / 3
    dm.update(torch.tensor([500, 90]))
    dm.update(300)  # the same int length as before, but the tensor step wrote other lists
    want = decode.DecodeMask(mask, B, q_len, CAP)
    want.update(torch.tensor([300] * B))
    assert torch.equal(dm.kv_indices, want.kv_indices) and torch.equal(dm.kv_num_blocks, want.kv_num_blocks)


def test_decode_skips_blocks_below_any_specs_lowest_visible_key() -> None:
    mask = _Recent(width=150)
    assert_mask_consistent(mask, 40, 47)
    assert decode._bounded_below(mask) and decode._bounded_below(mask & masks.Causal())
    assert not decode._bounded_below(mask | masks.Causal())
    k, v = _cache(9)
    g = torch.Generator().manual_seed(10)
    with torch.no_grad():
        for lens in (torch.tensor([300, 129]), torch.tensor([640, 7])):
            q = torch.randn(B, H, 1, D, generator=g)
            out = decode.decode_step(q, k, v, lens, mask=mask)
            _close(out, reference_decode(q, k, v, lens, mask))
            (dm,) = [d for d in decode.CACHE.values() if d.spec == mask]
            for b in range(B):
                n = int(lens[b])
                first, last = max(0, n - 150) // BS, (n - 1) // BS
                assert dm.kv_indices[b, 0, 0, : last - first + 1].tolist() == list(range(first, last + 1))
                assert int(dm.kv_num_blocks[b, 0, 0]) == last - first + 1


def test_caches_too_large_for_one_launch_are_decoded_a_slice_of_rows_at_a_time(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    k, v = torch.randn(5, HKV, 256, D), torch.randn(5, HKV, 256, D)
    q = torch.randn(5, H, 1, D)
    lens = torch.tensor([256, 3, 100, 200, 129])
    mask = masks.SlidingWindow.from_hf(90)
    with torch.no_grad():
        whole = decode.decode_step(q, k, v, lens, mask=mask)
        monkeypatch.setattr(decode.launch, "MAX_FLEX_ELEMENTS", 2 * k[0].numel() + 1)  # two rows per launch
        decode.CACHE.clear()
        split = decode.decode_step(q, k, v, lens, mask=mask)
    # Rows 0-1 and 2-3 share one 2-row DecodeMask (updated in stream order), row 4 has its own.
    assert sorted(dm.batch for dm in decode.CACHE.values()) == [1, 2]
    torch.testing.assert_close(split, whole, rtol=0, atol=2e-6)  # other kernels (batch 2, 1): not bitwise
    _close(split, reference_decode(q, k, v, lens, mask))


def test_slices_of_rows_stay_on_flex_unless_lse_is_asked(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Each slice of rows asks for lse only when the caller did: asked always, every slice left
    flex_cpu for the dense route (which needs no asking on the CPU), and backend="flex_cpu"
    raised "needs lse on CPU" for a call that asked for none."""
    k, v = torch.randn(4, HKV, 256, D), torch.randn(4, HKV, 256, D)
    q = torch.randn(4, H, 1, D)
    lens = torch.tensor([256, 3, 100, 200])
    mask = masks.SlidingWindow.from_hf(90)
    ref = reference_decode(q, k, v, lens, mask)
    monkeypatch.setattr(decode.launch, "MAX_FLEX_ELEMENTS", 2 * k[0].numel() + 1)  # two rows per launch
    with torch.no_grad():
        for backend in ("auto", "flex_cpu"):
            decode.CACHE.clear()
            _close(decode.decode_step(q, k, v, lens, mask=mask, backend=backend), ref)
            runs = [run.backend for dm in decode.CACHE.values() for run in dm.runs.values()]
            assert runs == ["flex_cpu"]  # one 2-row DecodeMask, planned on flex
        out, lse = decode.decode_step(q, k, v, lens, mask=mask, return_lse=True)  # dense, with lse
    _close(out, ref)
    assert lse.shape == (4, H, 1) and bool(torch.isfinite(lse).all())


def test_planned_runs_are_reused_and_exact() -> None:
    """The CUDA fast path (plan once per signature, then execute) exercised on the CPU's flex route."""
    k, v = _cache(5)
    dm = decode.DecodeMask(masks.Causal(), B, 1, CAP)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for lens in (torch.tensor([10, 640]), torch.tensor([300, 1])):
            q = torch.randn(B, H, 1, D, generator=g)
            bm = dm.update(lens)
            out, lse = decode._run_planned(dm, q, k, v, bm, None, None, True, False, "auto")
            assert lse is None
            _close(out, reference_decode(q, k, v, lens, masks.Causal()))
    assert len(dm.runs) == 1 and dm.runs.inserts == 1


def test_planned_steps_run_their_graph_without_dynamo_from_the_second_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Steps of one signature launch the same prepared flex call with the DecodeMask's BlockMask
    (updated in place), so from the second step the compiled graph runs as a plain function
    (``CompiledFlex.run_unguarded``), reading each step's lengths and new queries."""
    from compiled_flex_spy import counts, spy_compiled_flex

    calls = spy_compiled_flex(monkeypatch)
    k, v = _cache(6)
    spec = masks.SlidingWindow(left=200) & masks.Causal()
    dm = decode.DecodeMask(spec, B, 1, CAP)
    g = torch.Generator().manual_seed(10)
    steps = (
        torch.tensor([10, 640]),
        torch.tensor([300, 1]),
        torch.tensor([301, 2]),
        torch.tensor([600, 130]),
    )
    with torch.no_grad():
        for lens in steps:
            q = torch.randn(B, H, 1, D, generator=g)
            bm = dm.update(lens)
            out, _ = decode._run_planned(dm, q, k, v, bm, None, None, True, False, "flex_cpu")
            _close(out, reference_decode(q, k, v, lens, spec))
    assert counts(calls)[2] == len(steps) - 1


def test_run_signature_follows_grad_mode_and_process_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan made for inference is not reused by a step that records gradients (routes differ
    by mode: flex_flash refuses some backwards), nor after the dispatcher's inputs from the
    process change (an env var, flash-attn-4 becoming importable)."""
    k, v = _cache(5)
    q = torch.randn(B, H, 1, D)
    with torch.no_grad():
        base = decode.run_signature(q, k, v, None, None, True, False, "auto")
        assert decode.run_signature(q.requires_grad_(), k, v, None, None, True, False, "auto") == base
    assert decode.run_signature(q, k, v, None, None, True, False, "auto") != base
    q = q.detach()
    assert decode.run_signature(q, k, v, None, None, True, False, "auto") == base
    monkeypatch.setenv("FLEXATTN_ZOO_ARCH", "sm80")
    assert decode.run_signature(q, k, v, None, None, True, False, "auto") != base
    monkeypatch.delenv("FLEXATTN_ZOO_ARCH")
    monkeypatch.setattr(_compat, "flash_cute_available", lambda: True)
    assert decode.run_signature(q, k, v, None, None, True, False, "auto") != base


# ---- concurrency ---------------------------------------------------------------------------------


def test_threads_decoding_equal_shapes_do_not_share_state() -> None:
    """Eight threads decode one shape with different lengths at once. A DecodeMask shared by
    equal shapes (updated in place, then read by the kernel) gave every thread wrong outputs:
    another thread's update landed between its update and its kernel. Each thread now has its
    own masks (and no new kernel: they share the compiled one)."""
    import threading

    k, v = _cache(11)
    mask = masks.SlidingWindow.from_hf(200)
    g = torch.Generator().manual_seed(12)
    n_threads, rounds = 8, 6
    qs = [torch.randn(B, H, 1, D, generator=g) for _ in range(n_threads)]
    lens = [torch.tensor([60 + 70 * i, 580 - 65 * i]) for i in range(n_threads)]
    refs = [reference_decode(qs[i], k, v, lens[i], mask) for i in range(n_threads)]
    with torch.no_grad():
        decode.decode_step(qs[0], k, v, lens[0], mask=mask)  # compile outside the race
    compiles = COMPILE_CACHE.total_compiles()
    errors: list[float] = [0.0] * n_threads
    failures: list[BaseException] = []
    start = threading.Barrier(n_threads)

    def work(i: int) -> None:
        try:
            start.wait()
            with torch.no_grad():
                for _ in range(rounds):
                    out = decode.decode_step(qs[i], k, v, lens[i], mask=mask)
                    errors[i] = max(errors[i], float((out.double() - refs[i]).abs().max()))
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    assert max(errors) <= 2e-6, errors
    assert COMPILE_CACHE.total_compiles() == compiles


# ---- argument checks -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"sinks": torch.zeros(H)}, {"mask": masks.SlidingWindow.from_hf(64)}],
    ids=["flex_cpu", "dense", "flex_cpu_window"],
)
@pytest.mark.parametrize("length", [CAP + 1, torch.tensor([10, CAP + 5])], ids=["int", "tensor"])
def test_cache_len_past_the_capacity_raises_on_every_cpu_route(kwargs, length) -> None:  # type: ignore[no-untyped-def]
    # The dense route raised; the flex_cpu route returned an answer for a cache it never saw.
    k, v = _cache()
    q = torch.randn(B, H, 1, D)
    with (
        torch.no_grad(),
        pytest.raises(
            ValueError, match=rf"cache_len {CAP + 1 if isinstance(length, int) else CAP + 5}.*capacity {CAP}"
        ),
    ):
        decode.decode_step(q, k, v, length, **kwargs)


def test_paged_cache_len_past_the_table_raises() -> None:
    kp = vp = torch.randn(1, HKV, 4 * BS, D)
    q = torch.randn(B, H, 1, D)
    table = torch.tensor([[0, 1], [2, 3]])
    with torch.no_grad(), pytest.raises(ValueError, match=rf"cache_len {2 * BS + 1}.*capacity {2 * BS}"):
        decode.decode_step(q, kp, vp, torch.tensor([5, 2 * BS + 1]), block_table=table)


def _bad_call(case: str):  # type: ignore[no-untyped-def]
    k, v = _cache()
    q = torch.randn(B, H, 2, D)
    pool = torch.randn(1, HKV, 4 * BS, D)
    table = torch.tensor([[0, 1], [2, 3]])
    calls = {
        "shorter_than_q": lambda: decode.decode_step(q, k, v, 1),
        "negative": lambda: decode.decode_step(q, k, v, torch.tensor([-3, 10])),
        "zero": lambda: decode.decode_step(q, k, v, 0),
        "float_tensor": lambda: decode.decode_step(q, k, v, torch.tensor([10.7, 20.2])),
        "float": lambda: decode.decode_step(q, k, v, 10.0),
        "cache_batch": lambda: decode.decode_step(q, k[:1], v[:1], 10),
        "k_v_shapes": lambda: decode.decode_step(q, k, v[:, :, :100], 10),
        "page_past_pool": lambda: decode.decode_step(
            q, pool, pool, 10, block_table=torch.tensor([[0, 7], [1, 2]])
        ),
        "page_below_minus_one": lambda: decode.decode_step(
            q, pool, pool, 10, block_table=torch.tensor([[0, -2], [1, 2]])
        ),
        "float_table": lambda: decode.decode_step(q, pool, pool, 10, block_table=table.float()),
        "short_doc_ids": lambda: decode.decode_step(
            q, k, v, 10, mask=masks.Document(doc_ids=torch.zeros(100, dtype=torch.long))
        ),
        "block_size_zero": lambda: decode.decode_step(q, k, v, 10, block_size=0),
        "block_size_float": lambda: decode.decode_step(q, k, v, 10, block_size=64.0),
        "q_rank_3": lambda: decode.decode_step(q[0], k, v, 10),
        "cache_rank_3": lambda: decode.decode_step(q, k[0], v[0], 10),
    }
    return calls[case]


@pytest.mark.parametrize(
    ("case", "exc", "match"),
    [
        ("shorter_than_q", ValueError, r"cache_len 1 is out of range.*>= Lq = 2"),
        ("negative", ValueError, r"cache_len -3 is out of range.*>= Lq = 2"),
        ("zero", ValueError, r"cache_len 0 is out of range"),
        ("float_tensor", TypeError, r"cache_len must be an int or an integer tensor.*float32"),
        ("float", TypeError, r"cache_len must be an int or an integer tensor.*float"),
        ("cache_batch", ValueError, r"k_cache/v_cache hold 1 rows but q has batch 2"),
        ("k_v_shapes", ValueError, r"k_cache and v_cache must agree"),
        ("page_past_pool", ValueError, r"block_table holds page 7.*valid pages are 0 \.\. 3"),
        ("page_below_minus_one", ValueError, r"block_table holds page -2.*or -1 for none"),
        ("float_table", TypeError, r"block_table must be an integer tensor"),
        ("short_doc_ids", ValueError, r"mask does not fit a cache of capacity 640.*doc_ids.*length 100"),
        ("block_size_zero", ValueError, r"block_size must be a positive int, got 0"),
        ("block_size_float", TypeError, r"block_size must be a positive int, got float"),
        ("q_rank_3", ValueError, r"q must have 4 dims \[B, H, Lq, D\]"),
        ("cache_rank_3", ValueError, r"k_cache must have 4 dims \[B, Hkv, capacity, D\]"),
    ],
)
def test_bad_decode_arguments_are_named(case: str, exc: type[Exception], match: str) -> None:
    # Before: silent zeros (lengths below Lq), truncated floats, raw RuntimeErrors from the
    # kernel (batch, pages, document ids), ZeroDivisionError, and a tuple-unpacking error.
    call = _bad_call(case)
    with torch.no_grad(), pytest.raises(exc, match=match):
        call()


def test_numpy_integer_lengths_are_ints() -> None:
    """A length read from a numpy array (``np.int64``, not an int subclass) is an int length, as
    the other integer arguments take it; it was a TypeError "must be an int ... got int64"."""
    k, v = _cache(31)
    q = torch.randn(B, H, 2, D, generator=torch.Generator().manual_seed(32))
    with torch.no_grad():
        got = decode.decode_step(q, k, v, np.int64(150), backend="dense")
        assert torch.equal(got, decode.decode_step(q, k, v, 150, backend="dense"))
    pool = torch.zeros(1, HKV, 4 * BS, D)
    new = torch.randn(B, HKV, 3, D)
    table = torch.tensor([[0, 1], [2, 3]])
    assert decode.append_kv(pool, pool.clone(), table, np.int32(7), new, new) == 10


@pytest.mark.parametrize(("window", "exc"), [(0, ValueError), (-4, ValueError), (True, TypeError)])
def test_decode_step_varlen_refuses_windows_below_one_key(window: Any, exc: type[Exception]) -> None:
    """window=0 became FlashAttention's left=-1, no window at all; checked before the CUDA check,
    so on every device."""
    q = torch.randn(1, H, 1, D)
    pages = torch.zeros(4, 16, HKV, D)
    with pytest.raises(exc, match=r"decode_step_varlen\(window=\.\.\.\) must be an int >= 1"):
        decode.decode_step_varlen(q, pages, pages, torch.tensor([5]), torch.tensor([[0]]), window=window)


def test_a_bias_score_mod_is_over_absolute_positions() -> None:
    """A Bias is read at absolute query positions, as the mask is: one of [.., capacity, capacity]
    decodes (it was refused as not [.., Lq, capacity]), one of [.., Lq, capacity] is refused by
    name (it passed the check and raised an IndexError reading rows past Lq)."""
    k, v = _cache(33)
    g = torch.Generator().manual_seed(34)
    q = torch.randn(B, H, 2, D, generator=g)
    lens = torch.tensor([150, 640])
    bias = torch.randn(1, H, CAP, CAP, generator=g)
    with torch.no_grad():
        out = decode.decode_step(q, k, v, lens, score_mod=score_mods.Bias(bias=bias), backend="dense")
    for b, n in enumerate(lens.tolist()):
        rows = score_mods.Bias(bias=bias[:, :, n - 2 : n, :n].contiguous())
        ref = reference_attention(
            q[b : b + 1].double(),
            k[b : b + 1, :, :n].double(),
            v[b : b + 1, :, :n].double(),
            mask=masks.Causal(align="bottom_right"),
            score_mod=rows,
            enable_gqa=True,
        )
        _close(out[b : b + 1], ref)
    with pytest.raises(ValueError, match=r"decode_step score_mod does not fit a cache of capacity 640: Bias"):
        decode.decode_step(q, k, v, lens, score_mod=score_mods.Bias(bias=bias[:, :, :2]), backend="dense")


def test_bad_pages_in_a_device_table_stay_inside_the_pool() -> None:
    """A CUDA block_table is not read on the host (a sync), so update() must keep whatever it holds
    inside the pool: page numbers gathered for the kernel are clamped, and pages past the pool
    are treated as unowned (their keys invisible). Exercised here by calling update() directly."""
    dm = decode.DecodeMask(masks.Causal(), B, 1, 2 * BS, n_physical=4)
    dm.update(torch.tensor([BS + 5, 2 * BS]), torch.tensor([[0, 9], [2, 3]]))
    assert int(dm.kv_indices.max()) <= 3 and int(dm.kv_indices.min()) >= 0
    assert dm.page_start[0, :4].tolist() == [0, -BS, -BS, -BS]  # row 0 owns page 0 only


# ---- one kernel for every decode step ----------------------------------------------------------------


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def test_bottom_right_causal_over_a_growing_cache_compiles_a_bounded_number_of_kernels() -> None:
    """``Causal(align="bottom_right")`` with Lq = 1 over Lkv = 8, 9, 10, ... binds to
    ``OffsetCausal(Lkv - 1)``: its offset was a Python constant in the mask_mod, so a new kernel per
    step. Now it is a captured tensor: the entry's static graphs for its first cache lengths, then
    one dynamic-shape graph for the rest, and every ``OffsetCausal(d)`` of that shape reuses them."""
    from flexattn_zoo.dispatch import attention
    from flexattn_zoo.masks.causal import OffsetCausal

    heads, dim = 3, 24  # a head shape no other test compiles
    g = torch.Generator().manual_seed(13)
    graphs, compiles = _graphs(), COMPILE_CACHE.total_compiles()
    with torch.no_grad():
        for kv_len, spec in [(8, None), (9, None), (10, None), (11, None), (12, 5), (13, -2)]:
            mask = masks.Causal(align="bottom_right") if spec is None else OffsetCausal(offset=spec)
            q = torch.randn(1, heads, 1, dim, generator=g)
            k, v = torch.randn(2, 1, heads, kv_len, dim, generator=g)
            out = attention(q, k, v, mask=mask, backend="flex_cpu")
            ref = reference_attention(q.double(), k.double(), v.double(), mask=mask)
            torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)
    bound = STATIC_SHAPES + 2  # static graphs, the later code object's first (static) one, a dynamic one
    assert _graphs() - graphs <= bound and COMPILE_CACHE.total_compiles() - compiles <= bound


def test_masks_whose_offsets_move_each_step_share_one_compile_key() -> None:
    from flexattn_zoo.compile import mod_key
    from flexattn_zoo.masks.band import Band
    from flexattn_zoo.masks.causal import OffsetCausal

    assert mod_key(OffsetCausal(offset=3).mask_mod()) == mod_key(OffsetCausal(offset=4000).mask_mod())
    assert mod_key(Band(lo=1, hi=3).mask_mod()) == mod_key(Band(lo=-70, hi=9).mask_mod())
    assert mod_key(Band(lo=1).mask_mod()) == mod_key(Band(lo=2).mask_mod())


def test_captured_offsets_live_on_the_device_the_spec_is_moved_to() -> None:
    from flexattn_zoo.masks.band import Band
    from flexattn_zoo.masks.causal import OffsetCausal

    for spec in (OffsetCausal(offset=3), Band(lo=-2, hi=3)):
        assert spec.to("cpu") is spec
        moved = spec.to("meta")
        # Equal values on other devices are other specs: the mask_mod cache (keyed by spec) must
        # never hand a kernel an offset tensor from another device.
        assert moved != spec and moved.to("meta") == moved and hash(moved) != hash(spec)
        cells = [c.cell_contents for c in moved.mask_mod().__closure__ or ()]
        tensors = [c for c in cells if isinstance(c, torch.Tensor)]
        assert tensors and all(t.device.type == "meta" and t.dim() == 0 for t in tensors)


def test_flex_flash_is_not_a_decode_route() -> None:
    # Decode BlockMasks carry no full-block tensors, which torch's FA4 lowering needs: the route
    # says so through its decode flag and decode_step refuses it by name.
    q = torch.randn(1, 2, 1, 16)
    cache = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="decode_step backend must be one of auto, flex, flex_cpu, dense"):
        decode.decode_step(q, cache, cache, 8, backend="flex_flash")


# ---- host-cost shortcuts ---------------------------------------------------------------------


@pytest.mark.parametrize("spec", [masks.Causal(), None, masks.SlidingWindow.from_hf(150)])
def test_int_lengths_update_like_tensor_lengths(spec: MaskSpec | None) -> None:
    """``DecodeMask.update`` with one int (one or two fills when the block list is fixed) leaves
    exactly the state a lengths tensor leaves."""
    by_int, by_tensor = (decode.DecodeMask(spec, B, 1, CAP) for _ in range(2))
    for n in (1, BS - 1, BS, BS + 1, 300, CAP):
        by_int.update(n)
        by_tensor.update(torch.tensor([n] * B))
        for name in ("cache_len", "offset", "kv_num_blocks", "kv_indices"):
            assert torch.equal(getattr(by_int, name), getattr(by_tensor, name)), (n, name)


def test_int_cache_len_steps_match_tensor_steps() -> None:
    k, v = _cache(3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for n in (5, 128, 129, 640):
            q = torch.randn(B, H, 1, D, generator=g)
            # The flex route by name: "auto" takes SDPA over the prefix for one query per row
            # and an int length (test_one_query_steps_take_sdpa_over_the_live_prefix).
            out = decode.decode_step(q, k, v, n, backend="flex_cpu")
            assert torch.equal(out, decode.decode_step(q, k, v, torch.tensor([n] * B)))
            _close(out, reference_decode(q, k, v, torch.tensor([n] * B), masks.Causal()))
            _close(
                decode.decode_step(q, k, v, n),
                reference_decode(q, k, v, torch.tensor([n] * B), masks.Causal()),
            )
        with pytest.raises(ValueError, match="out of range"):
            decode.decode_step(q, k, v, CAP + 1)


def test_cpu_steps_are_planned_once_and_still_route_by_nan() -> None:
    """CPU steps reuse their plan like CUDA ones; the signature holds the NaN scan, so a cache
    holding NaN is served by the dense route (flex_cpu would drop it silently), then flex again."""
    k, v = _cache(6)
    q = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(7))
    lens = torch.tensor([200, 300])
    decode.CACHE.clear()  # the routes checked below must be this test's own
    with torch.no_grad():
        first = decode.decode_step(q, k, v, lens)
        bad = k.clone()
        bad[0, 0, 5, 0] = float("nan")
        out = decode.decode_step(q, bad, v, lens)
        again = decode.decode_step(q, k, v, lens)
    # Key 5 of row 0, kv head 0: NaN in that row's two query heads of the group, nowhere else.
    assert torch.isnan(out[0, :2]).all() and not torch.isnan(out[0, 2:]).any()
    assert not torch.isnan(out[1]).any()
    assert torch.equal(again, first)
    routes = [{p.backend for p in dm.runs.values()} for dm in decode.CACHE.values()]
    assert {"flex_cpu", "dense"} in routes


def test_decode_step_under_autocast_computes_in_the_autocast_dtype() -> None:
    """As fz.attention: under torch.autocast the step computes in (and returns) the autocast
    dtype; the plan made outside autocast is not reused inside it."""
    k, v = _cache(8)
    q = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(9))
    lens = torch.tensor([100, 250])
    with torch.no_grad():
        plain = decode.decode_step(q, k, v, lens)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cast = decode.decode_step(q, k, v, lens)
        direct = decode.decode_step(q.bfloat16(), k.bfloat16(), v.bfloat16(), lens)
    assert plain.dtype == torch.float32 and cast.dtype == torch.bfloat16
    assert torch.equal(cast, direct)


def test_distinct_int_lengths_reuse_one_mask_plan_and_kernel() -> None:
    """A generation loop passes a new int length every step: after the first step nothing is
    built, planned or compiled again (the lengths reach the kernel through the mask's captured
    tensors, not as Python constants), and every step is exact. On the flex route, named: auto
    takes SDPA over the live prefix for such a step, which builds no decode mask (the test then
    found another test's cached mask, and failed when run alone)."""
    from flexattn_zoo.backends import flex as flex_backend

    k, v = _cache(12)
    g = torch.Generator().manual_seed(13)
    # Other tests leave masks equal to Causal() once bound (align="bottom_right" among them).
    decode.CACHE.clear()
    lengths = [200, 201, 255, 256, 257, 383, 384, 385, 500, 640, 7]
    with torch.no_grad():
        for step, n in enumerate(lengths):
            q = torch.randn(B, H, 1, D, generator=g)
            out = decode.decode_step(q, k, v, n, backend="flex_cpu")
            _close(out, reference_decode(q, k, v, torch.tensor([n] * B), masks.Causal()))
            if step == 0:
                (dm,) = decode.CACHE.values()  # the one mask step 0 built
                counts = (decode.CACHE.inserts, dm.runs.inserts, flex_backend.CALLS.inserts)
                compiles, graphs = COMPILE_CACHE.total_compiles(), _graphs()
    assert (decode.CACHE.inserts, dm.runs.inserts, flex_backend.CALLS.inserts) == counts
    assert COMPILE_CACHE.total_compiles() == compiles and _graphs() == graphs
    with torch.no_grad():
        run = dm.runs.get(decode.run_signature(q, k, v, None, None, True, False, "flex_cpu"))
    assert run is not None and run.backend == "flex_cpu"
    assert run.call is not None  # launched without the route's own lookups


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8])
def test_integer_length_tensors_of_any_dtype_step_alike(dtype: torch.dtype) -> None:
    """A lengths tensor keeps its dtype up to the copy into the mask (no separate cast)."""
    k, v = _cache(14)
    q = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        for lens in ([200, 131], [1, 255]):
            want = decode.decode_step(q, k, v, torch.tensor(lens))
            assert torch.equal(decode.decode_step(q, k, v, torch.tensor(lens, dtype=dtype)), want)
            single = decode.decode_step(q, k, v, torch.tensor([lens[0]], dtype=dtype))  # one for all rows
            assert torch.equal(single, decode.decode_step(q, k, v, lens[0], backend="flex_cpu"))


def test_block_counts_written_from_the_host_are_rewritten_after_any_other_writer() -> None:
    """An int step skips the block-count fill when the count it last wrote is unchanged. A tensor
    step writes the counts from device values, and a mask a CUDA graph captured is rewritten by
    every replay: after either, the next int step must write its count again."""
    dm = decode.DecodeMask(masks.Causal(), B, 1, CAP)
    dm.update(300)  # 3 blocks
    dm.update(301)  # same count: not written again
    assert dm.kv_num_blocks.flatten().tolist() == [3, 3]
    dm.update(torch.tensor([5, CAP]))  # counts 1 and 5, from the tensor path
    dm.update(300)
    assert dm.kv_num_blocks.flatten().tolist() == [3, 3]
    dm._mark_captured()  # as update() does while a CUDA graph captures it
    dm.kv_num_blocks.fill_(1)  # what a replay captured with another length would leave
    dm.update(300)
    assert dm.kv_num_blocks.flatten().tolist() == [3, 3] and dm in decode.CAPTURED
    decode.CAPTURED.discard(dm)


def test_queries_past_the_first_see_their_own_absolute_positions() -> None:
    """Lq > 1 new tokens with a position-dependent pattern and score mod: the mods place query
    ``i`` at ``cache_len - Lq + i`` (worked out in the kernel from the captured lengths)."""
    k, v = _cache(16)
    q = torch.randn(B, H, 3, D, generator=torch.Generator().manual_seed(17))
    mask, score = masks.SlidingWindow.from_hf(70), score_mods.Alibi(num_heads=H)
    with torch.no_grad():
        for lens in (torch.tensor([300, 131]), 257):
            out = decode.decode_step(q, k, v, lens, mask=mask, score_mod=score)
            rows = lens if isinstance(lens, torch.Tensor) else torch.tensor([lens] * B)
            _close(out, reference_decode(q, k, v, rows, mask, score))


def test_fz_decode_is_imported_once_then_read_as_an_attribute() -> None:
    """``fz.decode`` is lazy; once imported it is a plain module attribute (each read through the
    module ``__getattr__`` and the import machinery cost microseconds per decode step)."""
    import flexattn_zoo as fz

    assert fz.decode is decode
    assert vars(fz)["decode"] is decode


def test_cpu_decode_with_caches_that_require_grad_under_no_grad() -> None:
    """A decode step launches the flex kernel directly only on routes that do not wrap ``run``:
    flex_cpu detaches inputs that require grad (torch's CPU flex refuses them even under
    ``no_grad``), which a direct launch skipped, failing the step."""
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 2, 256, 16, generator=g).requires_grad_() for _ in range(2))
    q = torch.randn(2, 2, 1, 16, generator=g)
    lens = torch.tensor([100, 37])
    with torch.no_grad():
        for _ in range(2):  # the second step reuses what the first prepared
            out = decode.decode_step(q, k, v, lens)
            dense = decode.decode_step(q, k, v, lens, backend="dense")
            torch.testing.assert_close(out, dense, rtol=0, atol=2e-6)


@pytest.mark.parametrize("gqa", [False, True])
def test_one_query_steps_take_sdpa_over_the_live_prefix(gqa: bool) -> None:
    """One query per row, an int length, the default causal pattern, nothing else asked: the query
    sees exactly the cache's first ``n`` keys, so the step is plain SDPA over the prefix views (no
    DecodeMask, no flex launch), exact for every length."""
    k, v = _cache(21)
    if not gqa:
        k, v = k.repeat_interleave(H // HKV, dim=1), v.repeat_interleave(H // HKV, dim=1)
    g = torch.Generator().manual_seed(22)
    decode.CACHE.clear()
    with torch.no_grad():
        for n in (1, 5, 128, 129, CAP):
            q = torch.randn(B, H, 1, D, generator=g)
            out = decode.decode_step(q, k, v, n, scale=0.3)
            _close(out, reference_decode(q, k, v, torch.tensor([n] * B), masks.Causal(), scale=0.3))
        decode.decode_step(q, k, v, 9, mask=masks.Causal())  # the default pattern, given explicitly
    assert decode.CACHE.inserts == 0  # no DecodeMask was built
    # Anything beyond that takes the DecodeMask path as before.
    q = torch.randn(B, H, 1, D, generator=g)
    for kwargs in (
        {"cache_len": torch.tensor([7] * B)},
        {"cache_len": 7, "mask": masks.DilatedSlidingWindow(left=4, dilation=2)},  # keys with gaps
        {"cache_len": 7, "backend": "flex_cpu"},
        {"cache_len": 7, "return_lse": True},
        {"cache_len": 7, "block_size": 64},
        {"cache_len": 7, "mask": masks.SlidingWindow(left=3), "score_mod": score_mods.SoftCap(cap=5.0)},
    ):
        decode.CACHE.clear()
        with torch.no_grad():
            decode.decode_step(q, k, v, **kwargs)  # type: ignore[arg-type]
        assert decode.CACHE.inserts == 1, kwargs
    # Bad arguments are refused as on the DecodeMask path.
    with pytest.raises(TypeError, match="share one dtype"):
        decode.decode_step(q.double(), k, v, 7)
    with pytest.raises(ValueError, match="scale"):
        decode.decode_step(q, k, v, 7, scale=float("nan"))


ONE_RUN_MASKS = [
    masks.SlidingWindow.from_hf(5),
    masks.SlidingWindow(left=3, right=2),  # keys past the query are not in the cache yet
    masks.Chunked(size=64),
    masks.Chunked(size=64) & masks.Causal(),
    masks.PrefixLM(prefix_len=100),
    masks.Band(lo=-40, hi=3),
    masks.Causal(align="bottom_right"),
    masks.SlidingWindow.from_hf(200) | masks.Chunked(size=128),
]


@pytest.mark.parametrize("mask", ONE_RUN_MASKS, ids=repr)
def test_one_query_steps_under_masks_that_see_one_run_take_sdpa_over_it(mask: MaskSpec) -> None:
    """A one-query step whose mask shows the query one run of keys through its own
    (``sees_one_run``) is SDPA over that run of the cache: no DecodeMask, and every length
    matches the float64 reference (inside the first window or chunk, on its edges, past it)."""
    assert mask.sees_one_run()
    k, v = _cache(23)
    g = torch.Generator().manual_seed(24)
    decode.CACHE.clear()
    with torch.no_grad():
        for n in (1, 5, 6, 63, 64, 65, 100, 101, 129, 333, CAP):
            q = torch.randn(B, H, 1, D, generator=g)
            out = decode.decode_step(q, k, v, n, mask=mask, scale=0.3)
            _close(out, reference_decode(q, k, v, torch.tensor([n] * B), mask, scale=0.3))
    assert decode.CACHE.inserts == 0


def test_one_query_steps_equal_sdpa_on_the_run_of_the_cache() -> None:
    """The run is the cache keys from the mask's lowest visible key of the query's position: bit
    for bit SDPA on ``cache.narrow(2, start, n - start)``, on contiguous and [B, L, H, D] caches."""
    import torch.nn.functional as F

    from flexattn_zoo.backends.base import fused_layout

    g = torch.Generator().manual_seed(25)
    base = torch.randn(2, 4, 90, 16, generator=g)
    caches = [base, base.transpose(1, 2).contiguous().transpose(1, 2), base[:, 1:3]]
    cases = [
        (masks.SlidingWindow.from_hf(10), lambda n: max(0, n - 10)),
        (masks.Chunked(size=32), lambda n: (n - 1) // 32 * 32),
    ]
    with torch.no_grad():
        for cache in caches:
            q = torch.randn(2, 4, 1, 16, generator=g)
            gqa = cache.shape[1] != q.shape[1]
            for mask, start in cases:
                for n in (1, 9, 10, 11, 32, 33, 90):
                    out = decode.decode_step(q, cache, cache, n, mask=mask)
                    run = fused_layout(cache.narrow(2, start(n), n - start(n)))
                    want = F.scaled_dot_product_attention(q, run, run, enable_gqa=gqa)
                    assert torch.equal(out, want), (mask, cache.stride(), n)


def test_only_a_full_sliding_window_keeps_its_slice_shape_from_step_to_step() -> None:
    """On CUDA a one-query step over a run whose length is the previous step's (a full sliding
    window: one shape every step) leaves SDPA's kernel choice open, cuDNN included, whose plan per
    shape is then built once; a run that grows (the first steps of a window, a chunk, the causal
    prefix) keeps cuDNN out. Starts are read across the blocks the cache keeps them in."""
    from flexattn_zoo.models.decode.mask import LOWEST_KEY_BLOCK
    from flexattn_zoo.models.decode.one_query import run_slides, run_start

    window = masks.SlidingWindow.from_hf(5)
    chunks = masks.Chunked(size=64) & masks.Causal()
    edge = LOWEST_KEY_BLOCK
    for n in (1, 2, 5, 6, 7, edge - 1, edge, edge + 1, edge + 2, CAP):
        start = run_start(window, n, B, H, CAP)
        assert start == max(0, n - 5) and run_slides(window, n, start) == (n > 5), n
        start = run_start(chunks, n, B, H, CAP)
        assert start == (n - 1) // 64 * 64 and not run_slides(chunks, n, start), n
        assert run_start(masks.Causal(), n, B, H, CAP) == 0
    band = masks.Band(lo=-3, hi=2)  # keys past the query are not in the cache: a window of 4
    assert [run_slides(band, n, run_start(band, n, B, H, CAP)) for n in (3, 4, 5, 6)] == [
        False,
        False,
        True,
        True,
    ]


def test_one_query_steps_under_a_pattern_holding_tensors_take_the_decode_mask() -> None:
    """The slice is found on the host from arithmetic bounds: a pattern holding tensors (one
    prefix per row) takes the DecodeMask path, with the same result (the newest query sees every
    live key whatever its row's prefix)."""
    k, v = _cache(26)
    q = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(27))
    with torch.no_grad():
        for n in (3, 50, 200):
            decode.CACHE.clear()
            out = decode.decode_step(q, k, v, n, mask=masks.PrefixLM(prefix_len=torch.tensor([100, 7])))
            assert decode.CACHE.inserts == 1
            torch.testing.assert_close(out, decode.decode_step(q, k, v, n), rtol=0, atol=2e-6)


def test_one_query_steps_under_autocast_take_mixed_dtypes() -> None:
    """As fz.attention: under torch.autocast a float32 q (after float32 RoPE) over a bf16 cache
    runs in the autocast dtype, on the prefix path as on the DecodeMask path."""
    k, v = (t.bfloat16() for t in _cache(31))
    q = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(32))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = decode.decode_step(q, k, v, 10)
        other = decode.decode_step(q, k, v, torch.tensor([10] * B))
    assert out.dtype == other.dtype == torch.bfloat16
    torch.testing.assert_close(out, other, atol=2e-2, rtol=2e-2)


def test_one_query_steps_equal_sdpa_on_the_narrowed_prefix() -> None:
    """The prefix path builds its views from the cache's sizes and strides: bit for bit what SDPA
    gives on ``cache.narrow(2, 0, n)`` (copied where the fused kernels cannot read it as it is),
    for caches of every layout, with GQA and a scale."""
    import torch.nn.functional as F

    from flexattn_zoo.backends.base import fused_layout

    g = torch.Generator().manual_seed(41)
    base = torch.randn(2, 4, 40, 16, generator=g)
    caches = [
        base,
        base.transpose(1, 2).contiguous().transpose(1, 2),  # [B, L, H, D] viewed as BHSD
        base[:, :, :, :8],  # rows of D not contiguous with each other
        base[:, 1:3],  # fewer kv heads: GQA
        torch.randn(2, 4, 16, 40, generator=g).transpose(2, 3),  # D not contiguous: copied
    ]
    with torch.no_grad():
        for cache in caches:
            q = torch.randn(2, 4, 1, cache.shape[3], generator=g)
            gqa = cache.shape[1] != q.shape[1]
            for n in (1, 17, cache.shape[2]):
                for scale in (None, 0.3):
                    out = decode.decode_step(q, cache, cache, n, scale=scale)
                    prefix = fused_layout(cache.narrow(2, 0, n))
                    want = F.scaled_dot_product_attention(q, prefix, prefix, scale=scale, enable_gqa=gqa)
                    assert torch.equal(out, want), (cache.stride(), n, scale)


class _NoStridedViews(torch.Tensor):
    """A tensor subclass whose views the prefix path must not set by strides."""

    def as_strided(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("as_strided on a tensor subclass")


def test_one_query_steps_over_subclass_caches_take_narrow_views() -> None:
    """Strided prefix views are for plain tensors: a cache of a tensor subclass (a DTensor, a
    Parameter, a user's wrapper; the transformers integration hands its caches over as they are)
    is narrowed as before, with the same result."""
    g = torch.Generator().manual_seed(43)
    cache = torch.randn(2, 4, 24, 16, generator=g)
    q = torch.randn(2, 4, 1, 16, generator=g)
    step = decode.one_query_over_live_keys
    with torch.no_grad():
        want = step(q, cache, cache, 9, None, None)
        wrapped = cache.as_subclass(_NoStridedViews)
        out = step(q, wrapped, wrapped, 9, None, None)
        param = step(q, torch.nn.Parameter(cache, requires_grad=False), cache, 9, None, None)
    assert want is not None and out is not None and param is not None
    assert torch.equal(out.as_subclass(torch.Tensor), want) and torch.equal(param, want)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # SDPA under vmap
@pytest.mark.parametrize("in_dims", [0, 1])
@pytest.mark.parametrize("mapped_in_memory", ["first", "last"])
def test_one_query_steps_under_vmap_equal_the_steps_one_by_one(in_dims: int, mapped_in_memory: str) -> None:
    """The prefix views are set with ``as_strided`` from the cache's strides: under ``torch.vmap``
    those are a sample's strides, whichever dim is mapped and wherever it lies in memory."""
    g = torch.Generator().manual_seed(42)
    shape = [2, 4, 32, 16]  # one sample's cache [B, Hkv, capacity, D]
    shape.insert(in_dims, 3)  # the mapped dim
    if mapped_in_memory == "first":
        cache = torch.randn(3, *shape[:in_dims], *shape[in_dims + 1 :], generator=g).movedim(0, in_dims)
    else:
        cache = torch.randn(*shape[:in_dims], *shape[in_dims + 1 :], 3, generator=g).movedim(-1, in_dims)
    q = torch.randn(3, 2, 4, 1, 16, generator=g).movedim(0, in_dims)
    with torch.no_grad():
        out = torch.vmap(lambda a, c: decode.decode_step(a, c, c, 10), in_dims=in_dims)(q, cache)
        each = [
            decode.decode_step(a, c, c, 10)
            for a, c in zip(q.unbind(in_dims), cache.unbind(in_dims), strict=True)
        ]
    torch.testing.assert_close(out, torch.stack(each), rtol=0, atol=1e-6)


def test_prefix_layout_by_the_cache_agrees_with_is_dense_block() -> None:
    """A prefix of a contiguous cache is used as it is without the per-step layout check; where the
    shortcut says so, the full check (``is_dense_block``) must agree on every prefix, on caches
    of every layout."""
    from flexattn_zoo.backends.base import is_dense_block, slices_are_dense_blocks

    base = torch.zeros(2, 3, 40, 16)
    caches = [
        base,
        base.transpose(1, 2).contiguous().transpose(1, 2),  # a [B, L, H, D] cache viewed as BHSD
        base[:, :, :, :8],
        base[:, 1:],
        torch.zeros(1, 3, 40, 16).expand(2, 3, 40, 16),  # broadcast rows: never a dense block
        torch.zeros(2, 3, 16, 40).transpose(2, 3),  # D not contiguous
        base.as_strided((2, 3, 40, 16), (1920, 640, 8, 1)),  # rows overlap
        torch.zeros(1, 1, 40, 16),
        torch.zeros(2, 3, 40, 1),
    ]
    seen = 0
    for cache in caches:
        if slices_are_dense_blocks(cache):
            for n in (1, 2, 17, cache.shape[2]):
                seen += 1
                assert is_dense_block(cache.narrow(2, 0, n)), (cache.shape, cache.stride(), n)
    assert seen >= 8


def test_decode_step_on_the_meta_device_infers_the_shape() -> None:
    """A device that is neither CPU nor CUDA (here ``meta``, as shape inference uses it) plans
    like the CPU: the kernel hazards it checks are named per kernel, not per device type."""
    q = torch.randn(1, 2, 1, 16, device="meta")
    k = torch.randn(1, 2, 32, 16, device="meta")
    out = decode.decode_step(q, k, k, 8)
    assert out.shape == (1, 2, 1, 16) and out.device.type == "meta"
