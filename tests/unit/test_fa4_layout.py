"""Segment layouts (fa4 and SDPA chunk and residue-class calls) and the fa4 route's refusals, on the CPU (kernels: tests/gpu)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.backends import fa4, fa4_op
from flexattn_zoo.backends.fa4 import FA4, fa4_window
from flexattn_zoo.problem import Problem
from flexattn_zoo.reference import reference_attention
from flexattn_zoo.segments import (
    as_chunks,
    fold_strided,
    from_chunks,
    segment_layout,
    unfold_strided,
    unfold_strided_lse,
)
from flexattn_zoo.spec import ScoreSpec, SoftCapForm, spec_dataclass
from flexattn_zoo.testing import assert_mask_consistent, assert_matches_reference


def test_window_conversion() -> None:
    assert fa4_window((-1, -1)) == (None, None)
    assert fa4_window((-1, 0)) == (None, 0)  # causal
    assert fa4_window((1023, 0)) == (1023, 0)
    assert fa4_window((5, 7)) == (5, 7)


@pytest.mark.parametrize(
    ("mask", "length", "batch", "expected"),
    [
        (masks.Causal(), 100, 2, ("rows", 100, (-1, 0))),
        (masks.SlidingWindow(left=9, right=2), 100, 1, ("rows", 100, (9, 2))),
        (masks.Chunked(size=25) & masks.Causal(), 100, 3, ("chunks", 25, (-1, 0))),
        (masks.Chunked(size=100), 100, 1, ("rows", 100, (-1, -1))),
        (masks.Chunked(size=30) & masks.Causal(), 100, 1, ("packed", 0, (-1, 0))),
        (masks.Document.from_lengths([40, 60]) & masks.Causal(), 100, 2, ("packed", 0, (-1, 0))),
        (masks.Document.from_lengths([50, 50]), 100, 1, ("chunks", 50, (-1, -1))),
        (masks.DilatedSlidingWindow(left=9, right=4, dilation=2), 100, 2, ("strided", 2, (4, 2))),
        (masks.DilatedSlidingWindow(left=30, dilation=3), 99, 1, ("strided", 3, (10, 0))),
        (masks.DilatedSlidingWindow(left=30, dilation=3), 100, 1, None),  # 3 does not divide 100
        (masks.DilatedSlidingWindow(left=1, right=1, dilation=2), 100, 1, ("rows", 100, (0, 0))),  # diagonal
        # reaches spanning their segments read as unbounded: a row, a chunk, a residue class
        (masks.SlidingWindow(left=99, right=120), 100, 1, ("rows", 100, (-1, -1))),
        (masks.Chunked(size=25) & masks.SlidingWindow(left=24), 100, 2, ("chunks", 25, (-1, 0))),
        (masks.DilatedSlidingWindow(left=98, dilation=2), 100, 1, ("strided", 2, (-1, 0))),
        (masks.DilatedSlidingWindow(left=96, dilation=2), 100, 1, ("strided", 2, (48, 0))),
    ],
)
def test_layouts(mask, length: int, batch: int, expected) -> None:  # type: ignore[no-untyped-def]
    assert segment_layout(mask.bind(length, length), batch, length) == expected


def test_chunks_are_views_of_projection_layouts() -> None:
    proj = torch.randn(2, 96, 4, 8)  # [B, L, H, D] as a projection writes it
    t = proj.transpose(1, 2)  # [B, H, L, D] view
    chunked = as_chunks(t, 32)
    assert chunked.shape == (6, 4, 32, 8) and chunked.data_ptr() == proj.data_ptr()
    assert chunked._base is not None  # a view, no copy
    torch.testing.assert_close(chunked[4], t[1, :, 32:64])
    torch.testing.assert_close(from_chunks(chunked, 2), t)
    contiguous = t.contiguous()  # [B, H, L, D] contiguous: one copy, same values
    torch.testing.assert_close(from_chunks(as_chunks(contiguous, 24), 2), t)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize(
    ("mask", "length"),
    [
        (masks.DilatedSlidingWindow(left=9, right=4, dilation=2), 40),
        (masks.DilatedSlidingWindow(left=13, dilation=3), 36),
        (masks.DilatedSlidingWindow(left=40, right=40, dilation=4), 40),
    ],
)
def test_strided_fold_runs_each_class_as_heads_of_its_own(mask, length: int, layout: str) -> None:  # type: ignore[no-untyped-def]
    """What the fa4 route does with a strided layout, with float64 attention in place of FA4's
    kernel: fold q/k/v (GQA 4:2) into heads per residue class, attend with the class window,
    unfold out and lse; equal to the reference of the whole mask, forward and backward."""
    kind, stride, (left, right) = segment_layout(mask.bind(length, length), 2, length)
    assert kind == "strided"
    g = torch.Generator().manual_seed(3)
    shapes = [(2, length, heads, 8) for heads in (4, 2, 2)]  # [B, L, H, D] projections
    q, k, v = (torch.randn(*s, dtype=torch.float64, generator=g) for s in shapes)
    if layout == "bhsd":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    folded = [fold_strided(t, stride) for t in (q, k, v)]
    if layout == "bshd":
        assert all(f.data_ptr() == t.data_ptr() for f, t in zip(folded, (q, k, v), strict=True))  # views
    inner = masks.SlidingWindow(left=left if left >= 0 else length, right=right if right >= 0 else length)
    fq, fk, fv = (t.transpose(1, 2) for t in folded)
    out, lse = reference_attention(fq, fk, fv, mask=inner, enable_gqa=True, return_lse=True)
    out = unfold_strided(out.transpose(1, 2), 4).transpose(1, 2)
    lse = unfold_strided_lse(lse, 4)
    bhsd = [t.transpose(1, 2) for t in (q, k, v)]
    want, want_lse = reference_attention(*bhsd, mask=mask, enable_gqa=True, return_lse=True)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    g_out = torch.randn(out.shape, dtype=torch.float64, generator=g)
    got = torch.autograd.grad(out, (q, k, v), g_out)
    expected = torch.autograd.grad(want, (q, k, v), g_out)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


_DILATED = masks.DilatedSlidingWindow(left=9, right=4, dilation=2)


@pytest.mark.parametrize(
    ("mask", "window"),
    [
        (_DILATED & masks.Causal(), (4, 0)),
        (_DILATED & masks.SlidingWindow(left=5, right=3), (2, 1)),  # absolute reaches // stride
        (masks.Causal() & _DILATED & masks.DilatedSlidingWindow(left=3, right=9, dilation=2), (1, 0)),
        (_DILATED & masks.DilatedSlidingWindow(left=9, dilation=3), None),  # two strides
        (_DILATED & masks.Chunked(size=6), None),  # segments: no plain window
        (_DILATED & masks.Document.from_lengths([[10, 14], [4, 20]]), None),
    ],
)
def test_intersections_keep_a_strided_form_where_exact(mask, window) -> None:  # type: ignore[no-untyped-def]
    """``And`` of strided forms of one stride and plain windows is a strided form (checked
    against ``dense()`` at lengths the stride divides and not); anything else has none."""
    form = mask.strided_form(24, 24)
    assert (form and form.window) == window
    for length in (24, 25) if window is not None else (24,):
        assert_mask_consistent(mask, q_len=length, kv_len=length, batch=2)


def test_fa4_takes_a_dilated_window_with_its_stride_dividing_the_length() -> None:
    dilated = masks.DilatedSlidingWindow(left=64, dilation=2)
    assert FA4.mask_reasons(_problem(mask=dilated)) == []
    reasons = " ".join(FA4.mask_reasons(_problem(mask=masks.DilatedSlidingWindow(left=64, dilation=3))))
    assert "no exact FA4 form" in reasons and "stride that divides the length" in reasons


def _problem(**kw) -> Problem:  # type: ignore[no-untyped-def]
    base = dict(
        batch=2,
        heads=8,
        kv_heads=8,
        q_len=256,
        kv_len=256,
        head_dim=128,
        dtype=torch.bfloat16,
        device_type="cuda",
        arch="sm90",
        requires_grad=True,
    )
    base.update(kw)
    return Problem(**base)  # type: ignore[arg-type]


def test_reasons_name_what_fa4_cannot_do() -> None:
    r = " ".join(FA4.mask_reasons(_problem(score=score_mods.SoftCap(cap=30.0))))
    assert "approx=True" in r  # exact tanh is not what FA4's soft-capping computes
    assert (
        FA4.mask_reasons(_problem(score=score_mods.SoftCap(cap=30.0, approx=True), mask=masks.Causal())) == []
    )
    assert "Alibi" in " ".join(FA4.mask_reasons(_problem(score=score_mods.Alibi(num_heads=8))))
    assert "no exact FA4 form" in " ".join(FA4.mask_reasons(_problem(mask=masks.PrefixLM(prefix_len=10))))
    assert "Lq == Lkv" in " ".join(FA4.mask_reasons(_problem(mask=masks.Causal(), q_len=100)))
    assert FA4.mask_reasons(_problem(q_len=100)) == []  # no mask: any lengths


def test_fa4_refuses_on_cpu_with_reasons() -> None:
    q = torch.randn(1, 2, 16, 64)
    with pytest.raises(ValueError, match="backend 'fa4' cannot run"):
        fz.attention(q, q, q, mask="causal", backend="fa4")


@spec_dataclass
class _NativeCap(ScoreSpec):
    """A user's soft-cap spec: no catalogue class, only the form."""

    cap: float
    approx: bool = True

    def softcap_form(self) -> SoftCapForm | None:
        return SoftCapForm(cap=self.cap, approx=self.approx)


def test_fa4_reads_the_soft_cap_form() -> None:
    for score in (_NativeCap(cap=12.0), score_mods.Chain(mods=(score_mods.SoftCap(cap=12.0, approx=True),))):
        p = _problem(score=score, mask=masks.Causal())
        assert FA4.mask_reasons(p) == []
        assert fa4._softcap(p) == 12.0  # what FA4's softcap= argument receives
    assert "approx=True" in " ".join(FA4.mask_reasons(_problem(score=_NativeCap(cap=12.0, approx=False))))
    two = score_mods.SoftCap(cap=12.0, approx=True) >> score_mods.SoftCap(cap=3.0, approx=True)
    assert FA4.mask_reasons(_problem(score=two))  # capping twice is no one soft-cap
    assert fa4._softcap(_problem()) == 0.0


def test_routes_import_no_catalogue_classes() -> None:
    # Routes read forms; the mask and score catalogues stay out of their imports.
    for path in sorted(Path(fa4.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                assert not name.startswith(("flexattn_zoo.masks", "flexattn_zoo.score_mods")), (
                    path.name,
                    name,
                )
                assert name.split(".")[0] not in ("masks", "score_mods"), (path.name, name)


@pytest.mark.parametrize("route", ["sdpa_flash", "sdpa_math"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize(
    "mask",
    [
        masks.DilatedSlidingWindow(left=64, right=64, dilation=2),  # whole classes
        masks.DilatedSlidingWindow(left=62, dilation=2),  # reaches the first of its class: causal
        masks.DilatedSlidingWindow(left=100, dilation=4) & masks.Causal(),
    ],
)
def test_sdpa_runs_residue_classes_whose_window_spans_them(mask, layout: str, route: str) -> None:  # type: ignore[no-untyped-def]
    """A strided form whose class window is unbounded or causal is SDPA on the classes as
    heads of their own (GQA 4:2), forward and backward, against float64."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 64, heads, 16, generator=g) for heads in (4, 2, 2))  # [B, L, H, D]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if layout == "bhsd":
        q, k, v = (t.contiguous() for t in (q, k, v))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    assert fz.plan(q, k, v, mask=mask, enable_gqa=True).backend == "sdpa_flash"
    out = fz.attention(q, k, v, mask=mask, enable_gqa=True, backend=route)
    g_out = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), g_out)
    assert_matches_reference(out, q, k, v, mask=mask, enable_gqa=True, grads=grads, grad_out=g_out)


def test_sdpa_refuses_residue_classes_with_a_bounded_window() -> None:
    q = torch.randn(1, 2, 64, 16)
    narrow = masks.DilatedSlidingWindow(left=60, dilation=2)  # class window 30 of 32: bounded
    with pytest.raises(ValueError, match="residue classes"):
        fz.attention(q, q, q, mask=narrow, backend="sdpa_flash")


def test_folds_past_a_cuda_grid_of_heads_are_refused() -> None:
    """Each residue class becomes heads of its own: on CUDA stride x heads must fit a kernel grid."""
    from flexattn_zoo.backends.sdpa import SDPA_CUDNN

    spanning = masks.DilatedSlidingWindow(left=4096, dilation=2048)  # 2048 classes of 2 positions
    wide = _problem(mask=spanning, q_len=4096, kv_len=4096, heads=32, kv_heads=32)  # 65536 heads
    assert "65535" in " ".join(FA4.mask_reasons(wide))
    assert "65535" in " ".join(SDPA_CUDNN.mask_reasons(wide))
    narrow = _problem(mask=spanning, q_len=4096, kv_len=4096, heads=16, kv_heads=16)
    assert FA4.mask_reasons(narrow) == []


def test_sdpa_runs_chunks_whose_window_spans_them() -> None:
    """A window reaching over every chunk is no window: causal chunks on SDPA, against float64."""
    mask = masks.Chunked(size=16) & masks.SlidingWindow(left=15)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 2, 64, 16, generator=g).requires_grad_(True) for _ in range(3))
    assert fz.plan(q, k, v, mask=mask).backend == "sdpa_flash"
    out = fz.attention(q, k, v, mask=mask, backend="sdpa_flash")
    g_out = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), g_out)
    assert_matches_reference(out, q, k, v, mask=mask, grads=grads, grad_out=g_out)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_sdpa_folds_residue_classes_before_expanding_grouped_kv(layout: str) -> None:
    """cuDNN gets k/v expanded to every q head; on folded classes the expansion must still give q
    head ``r * H + h`` the k/v of head ``r * Hkv + h // group`` (the math kernel stands in for
    cuDNN on the CPU), forward and backward against float64."""
    import dataclasses

    from flexattn_zoo.backends.sdpa import SDPA_MATH

    expanding = dataclasses.replace(SDPA_MATH, expand_gqa=True)
    mask = masks.DilatedSlidingWindow(left=100, dilation=4) & masks.Causal()
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 64, heads, 16, generator=g, dtype=torch.float64) for heads in (6, 2, 2))
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, L, D] views of projection outputs
    if layout == "bhsd":
        q, k, v = (t.contiguous() for t in (q, k, v))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    p = Problem(
        batch=2, heads=6, kv_heads=2, q_len=64, kv_len=64, head_dim=16, dtype=torch.float64,
        device_type="cpu", arch="cpu", requires_grad=True, mask=mask.bind(64, 64),
    )  # fmt: skip
    assert expanding.mask_reasons(p) == []
    out, _ = expanding.bound_run(p, q.device)(q, k, v, 16**-0.5)
    g_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), g_out)
    assert_matches_reference(out, q, k, v, mask=mask, enable_gqa=True, grads=grads, grad_out=g_out)


def test_wrappers_keep_the_strided_form() -> None:
    """A shard of a call and one document spanning the problem see the same residue classes as
    the mask they wrap (and the forms stay exact against their oracles)."""
    from flexattn_zoo.compose import MaskOnShard

    dilated = masks.DilatedSlidingWindow(left=9, right=4, dilation=2)
    expected = ("strided", 2, (4, 2))
    shard = MaskOnShard(part=dilated, batch=(1, 2), heads=(0, 4), total=(2, 4))
    one_doc = masks.PerDocument(inner=dilated, documents=masks.Document.from_lengths([100]))
    two_docs = masks.PerDocument(inner=dilated, documents=masks.Document.from_lengths([50, 50]))
    assert segment_layout(shard.bind(100, 100), 1, 100) == expected
    assert segment_layout(one_doc.bind(100, 100), 1, 100) == expected
    assert segment_layout(two_docs.bind(100, 100), 1, 100) != expected  # classes restart per document
    for spec in (shard, one_doc):
        assert_mask_consistent(spec, 100, 100, batch=1, heads=4)


def test_fa4_takes_global_tokens_shared_by_every_row() -> None:
    shared = masks.GlobalWindow.from_positions([0, 100], 256, left=16, right=16)
    assert FA4.mask_reasons(_problem(mask=shared)) == []
    per_row = masks.GlobalWindow(is_global=torch.zeros(2, 256, dtype=torch.bool), left=16)
    many = masks.GlobalWindow.from_positions(list(range(0, 256, 3)), 256, left=16)  # 86 positions
    for mask in (per_row, many):
        reasons = " ".join(FA4.mask_reasons(_problem(mask=mask)))
        assert "no exact FA4 form" in reasons and "global tokens shared by every row" in reasons
    # A shard of the batch or heads sees the same positions.
    from flexattn_zoo.compose import MaskOnShard

    shard = MaskOnShard(part=shared, batch=(1, 2), heads=(0, 4), total=(2, 8))
    form = shard.global_tokens_form(256, 256)
    assert form is not None and form.positions.tolist() == [0, 100]
    assert FA4.mask_reasons(_problem(mask=shard, batch=1, heads=4, kv_heads=4)) == []
    assert_mask_consistent(shard, 256, 256, batch=1, heads=4)
    # Eager calls only: a function transform or a dispatch mode is refused with the reason.
    assert "global tokens" in (FA4.func_transform_blocker(_problem(mask=shared)) or "")
    assert FA4.func_transform_blocker(_problem(mask=masks.Causal())) is None


def test_fa4_global_tokens_refuse_calls_a_mode_intercepts() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    mask = masks.GlobalWindow.from_positions([0], 32, left=4, right=4)
    p = _problem(mask=mask, batch=1, heads=2, kv_heads=2, q_len=32, kv_len=32, head_dim=16,
                 dtype=torch.float32, device_type="cpu", arch="cpu")  # fmt: skip
    q = torch.randn(1, 2, 32, 16)
    with Passing(), pytest.raises(RuntimeError, match="only in plain eager calls"):
        fa4._launcher(p, 1, 32)(q, q, q, 0.25)


@pytest.mark.parametrize("gqa", [False, True])
def test_fa4_global_tokens_launch_matches_the_reference(monkeypatch, gqa: bool) -> None:  # type: ignore[no-untyped-def]
    from test_fa4_op import emulated_backward, emulated_forward  # FA4's kernels' contract, float64

    monkeypatch.setattr(fa4_op, "_fwd_kernel", emulated_forward)
    monkeypatch.setattr(fa4_op, "_bwd_kernel", emulated_backward)
    length, heads, kv_heads = 48, 4, (2 if gqa else 4)
    mask = masks.GlobalWindow.from_positions([0, 17, 47], length, left=5, right=3)
    p = _problem(mask=mask, batch=2, heads=heads, kv_heads=kv_heads, q_len=length, kv_len=length,
                 head_dim=16, dtype=torch.float32, device_type="cpu", arch="cpu", return_lse=True)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, length, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, length, 16, generator=gen, requires_grad=True) for _ in range(2))
    out, lse = fa4._launcher(p, 2, length)(q, k, v, 0.25)
    want, want_lse = reference_attention(q, k, v, mask=mask, scale=0.25, enable_gqa=gqa, return_lse=True)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=2e-5)
    g = torch.randn_like(want)
    for got, ref in zip(
        torch.autograd.grad(out, (q, k, v), g.float()), torch.autograd.grad(want, (q, k, v), g), strict=True
    ):
        torch.testing.assert_close(got.double(), ref.double(), atol=1e-4, rtol=1e-4)
