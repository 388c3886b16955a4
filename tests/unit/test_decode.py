"""fz.decode: decode steps vs the float64 reference, in-place mask updates, paged caches."""

from __future__ import annotations

import pytest
import torch

from flexattn_zoo import _compat, masks, score_mods
from flexattn_zoo.compile import CACHE as COMPILE_CACHE
from flexattn_zoo.models import decode
from flexattn_zoo.spec import MaskMod, MaskSpec, spec_dataclass
from flexattn_zoo.testing import assert_mask_consistent, reference_attention

B, H, HKV, D, CAP, BS = 2, 4, 2, 16, 640, 128


def reference_decode(q, k, v, lens, mask, score=None, sinks=None):  # type: ignore[no-untyped-def]
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
        monkeypatch.setattr(decode, "MAX_FLEX_ELEMENTS", 2 * k[0].numel() + 1)  # two rows per launch
        decode.CACHE.clear()
        split = decode.decode_step(q, k, v, lens, mask=mask)
    # Rows 0-1 and 2-3 share one 2-row DecodeMask (updated in stream order), row 4 has its own.
    assert sorted(dm.batch for dm in decode.CACHE.values()) == [1, 2]
    torch.testing.assert_close(split, whole, rtol=0, atol=2e-6)  # other kernels (batch 2, 1): not bitwise
    _close(split, reference_decode(q, k, v, lens, mask))


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
