"""The global-tokens form (a window plus global positions) and its composition from a windowed
kernel (``backends.global_tokens``), against the float64 reference; the kernel here is a dense
stand-in for FlashAttention-4's windowed kernel (tests/gpu runs the real one)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from dense_window_kernel import dense_window_kernels as _window_kernel

from flexattn_zoo.backends import global_tokens
from flexattn_zoo.backends.global_tokens import WindowKernels, global_tokens_attention
from flexattn_zoo.masks import GlobalWindow, SlidingWindow
from flexattn_zoo.reference import reference_attention
from flexattn_zoo.score_mods import SoftCap
from flexattn_zoo.spec import GLOBAL_FORM_MAX_TOKENS, GlobalTokensForm


def _specs(length: int) -> list[GlobalWindow]:
    return [
        GlobalWindow.from_positions([0], length, left=4, right=4),
        GlobalWindow.from_positions(sorted({0, length // 3, length - 1}), length, left=length // 6, right=0),
        GlobalWindow.from_positions(
            [min(2, length - 1), length - 1], length, left=0, right=length
        ),  # right spans the row
        GlobalWindow.from_positions(list(range(0, length, 7)), length, left=3, right=1),
        GlobalWindow.from_positions([length - 1], length, left=length, right=length),  # everything visible
        # Causal plus global tokens: the left side unbounded, global keys left of ordinary rows.
        GlobalWindow.from_positions(
            sorted({min(2, length - 1), min(7, length - 1)}), length, left=length, right=0
        ),
    ]


@pytest.mark.parametrize("length", [1, 9, 40])
def test_global_tokens_form_equals_the_mask(length: int) -> None:
    for spec in _specs(length):
        form = spec.global_tokens_form(length, length)
        assert form is not None
        i = torch.arange(length).view(-1, 1)
        j = torch.arange(length).view(1, -1)
        flags = torch.zeros(length, dtype=torch.bool)
        flags[form.positions] = True
        said = ((j >= i - spec.left) & (j <= i + spec.right)) | flags[:, None] | flags[None, :]
        assert torch.equal(said, spec.dense(length, length)[0, 0])
        assert torch.equal(form.positions, torch.nonzero(spec.is_global[:length]).flatten())


def test_global_tokens_form_is_offered_only_where_it_is_exact() -> None:
    spec = GlobalWindow.from_positions([0, 3], 16, left=2)
    assert spec.global_tokens_form(16, 12) is None  # Lq != Lkv
    per_row = GlobalWindow(
        is_global=torch.zeros(2, 16, dtype=torch.bool).index_fill_(1, torch.tensor([1]), True), left=2
    )
    assert per_row.global_tokens_form(16, 16) is None  # flags per batch row
    many = GlobalWindow.from_positions(list(range(GLOBAL_FORM_MAX_TOKENS + 1)), 200, left=2)
    assert many.global_tokens_form(200, 200) is None
    assert GlobalWindow.from_positions(list(range(GLOBAL_FORM_MAX_TOKENS)), 200, left=2).global_tokens_form(
        200, 200
    )
    # Positions at or past the call's length are not part of its form.
    tail = GlobalWindow.from_positions([3, 30], 40, left=2)
    assert tail.global_tokens_form(20, 20).positions.tolist() == [3]
    none_below = GlobalWindow.from_positions([30], 40, left=2, right=1)
    assert none_below.global_tokens_form(20, 20) is None
    # With no global position below L it is a plain window: the varlen form says so.
    form = none_below.varlen_form(20, 20, 1)
    assert form is not None and form.segments is None and form.window == (2, 1)
    assert torch.equal(none_below.dense(20, 20), SlidingWindow(left=2, right=1).dense(20, 20))
    assert tail.varlen_form(20, 20, 1) is None


def test_global_tokens_form_built_under_inference_mode_is_a_normal_tensor() -> None:
    spec = GlobalWindow.from_positions([0, 5], 16, left=2)
    with torch.inference_mode():
        form = spec.global_tokens_form(16, 16)
    assert form is not None and not form.positions.is_inference()
    assert spec.global_tokens_form(16, 16).positions is form.positions  # found once per length


@pytest.fixture(params=["dense rows", "kernel rows"])
def global_rows(request, monkeypatch) -> str:  # type: ignore[no-untyped-def]
    """Both ways the global rows run: in the dense part, and (past its size limit) as one more
    unmasked kernel call."""
    if request.param == "kernel rows":
        monkeypatch.setattr(global_tokens, "GLOBAL_ROWS_DENSE_MAX_SCORES", 0)
    return str(request.param)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2)])
@pytest.mark.parametrize("length", [1, 9, 40])
def test_composition_matches_the_reference(
    length: int, heads: tuple[int, int], dtype: torch.dtype, global_rows: str
) -> None:
    h, hkv = heads
    gen = torch.Generator().manual_seed(length * 10 + h)
    for spec in _specs(length):
        form = spec.global_tokens_form(length, length)
        q = torch.randn(2, h, length, 8, generator=gen, dtype=dtype, requires_grad=True)
        k = torch.randn(2, hkv, length, 8, generator=gen, dtype=dtype, requires_grad=True)
        v = torch.randn(2, hkv, length, 8, generator=gen, dtype=dtype, requires_grad=True)
        out, lse = global_tokens_attention(q, k, v, form, 1 / math.sqrt(8), _window_kernel())
        want, want_lse = reference_attention(q, k, v, mask=spec, enable_gqa=h != hkv, return_lse=True)
        tol = 1e-10 if dtype == torch.float64 else 2e-5
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=tol)
        g = torch.randn_like(want)
        got_grads = torch.autograd.grad(out, (q, k, v), g.to(dtype))
        want_grads = torch.autograd.grad(want, (q, k, v), g)
        for got_g, want_g in zip(got_grads, want_grads, strict=True):
            assert torch.isfinite(got_g).all()
            torch.testing.assert_close(got_g.double(), want_g.double(), atol=10 * tol, rtol=10 * tol)


def test_composition_with_soft_capping_and_lse_gradients(global_rows: str) -> None:
    length, cap = 24, 2.0
    spec = GlobalWindow.from_positions([0, 11], length, left=3, right=2)
    form = spec.global_tokens_form(length, length)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(1, 2, length, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3)
    )
    out, lse = global_tokens_attention(q, k, v, form, 1 / math.sqrt(8), _window_kernel(cap), softcap=cap)
    want, want_lse = reference_attention(q, k, v, mask=spec, score_mod=SoftCap(cap=cap), return_lse=True)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    # Gradients through the lse too (a caller's merge of its own parts reads it).
    got = torch.autograd.grad((out.sum() + lse.exp().sum()), (q, k, v))
    ref = torch.autograd.grad((want.sum() + want_lse.exp().sum()), (q, k, v))
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b)


def test_form_positions_are_not_compared() -> None:
    a = GlobalTokensForm(positions=torch.tensor([0]), window=(2, 2))
    assert a == GlobalTokensForm(positions=torch.tensor([5]), window=(2, 2))  # as SplitPart's mask


def test_consistency_checks_catch_a_wrong_form() -> None:
    from flexattn_zoo.spec import spec_dataclass
    from flexattn_zoo.testing import assert_mask_consistent

    @spec_dataclass
    class NarrowerForm(GlobalWindow):
        def global_tokens_form(self, q_len: int, kv_len: int) -> GlobalTokensForm | None:
            form = super().global_tokens_form(q_len, kv_len)
            return (
                None
                if form is None
                else GlobalTokensForm(positions=form.positions, window=(self.left - 1, self.right))
            )

    good = GlobalWindow.from_positions([0, 9], 24, left=3, right=2)
    assert_mask_consistent(good, q_len=24, kv_len=24)
    bad = NarrowerForm(is_global=good.is_global, left=3, right=2)
    with pytest.raises(AssertionError, match="global_tokens_form"):
        assert_mask_consistent(bad, q_len=24, kv_len=24)


def test_positions_are_kept_for_a_few_lengths_only() -> None:
    spec = GlobalWindow.from_positions([0], 64, left=2)
    for n in range(1, 30):
        assert spec.global_tokens_form(n, n).positions.tolist() == [0]
    assert len(spec.__dict__["_positions"]) <= 8


def test_an_unused_lse_costs_no_kernel_backward_of_its_own(global_rows: str) -> None:
    """Only ``out`` in the loss: the kernels' backwards get no lse gradient (FA4 runs one more
    backward call for one), and the gradients are still right. The global rows take a kernel
    backward of their own only past the dense part's size limit."""
    seen: list[bool] = []
    base = _window_kernel()

    def backward(*args):  # type: ignore[no-untyped-def]
        seen.append(args[-1] is None)
        return base.backward(*args)

    spec = GlobalWindow.from_positions([0, 7], 20, left=3, right=3)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(1, 2, 20, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3)
    )
    out, _ = global_tokens_attention(
        q, k, v, spec.global_tokens_form(20, 20), 1 / math.sqrt(8), WindowKernels(base.forward, backward)
    )
    got = torch.autograd.grad(out.sum(), (q, k, v))
    want = torch.autograd.grad(reference_attention(q, k, v, mask=spec).sum(), (q, k, v))
    assert seen == ([True] if global_rows == "dense rows" else [True, True])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_dense_parts_match_the_reference(global_rows: str, dtype: torch.dtype) -> None:
    """The dense parts as CUDA runs them (``torch.compile``: broadcast products summed, sums over
    the sequence as matmuls in the inputs' dtype), here on the CPU, GQA and soft-capping included,
    forward and backward with an lse gradient."""
    import torch._dynamo

    torch._dynamo.reset()
    length, cap = 40, 3.0
    spec = GlobalWindow.from_positions([0, 13, 39], length, left=5, right=2)
    form = spec.global_tokens_form(length, length)
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, length, 8, generator=gen).to(dtype).requires_grad_(True)
    k, v = (torch.randn(2, 2, length, 8, generator=gen).to(dtype).requires_grad_(True) for _ in range(2))
    out, lse = global_tokens_attention(
        q, k, v, form, 1 / math.sqrt(8), _window_kernel(cap), softcap=cap, compiled=True
    )
    want, want_lse = reference_attention(
        q, k, v, mask=spec, score_mod=SoftCap(cap=cap), enable_gqa=True, return_lse=True
    )
    # bfloat16: two units in the last place (2**-7 relative), the rounding of the output itself.
    tol = 2e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out.double(), want.double(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), want_lse.double(), atol=tol, rtol=tol)
    got = torch.autograd.grad(out.float().sum() + lse.exp().sum(), (q, k, v))
    ref = torch.autograd.grad(want.sum() + want_lse.exp().sum(), (q, k, v))
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == dtype
        # The lse's exp term makes gradients up to ~50 here: bfloat16's absolute rounding grows
        # with the largest of them, so its tolerance is relative to that.
        atol = 10 * tol if dtype == torch.float32 else tol * b.abs().max().item()
        torch.testing.assert_close(a.double(), b.double(), atol=atol, rtol=tol)


def test_compiled_forward_and_backward_keep_a_graph_each() -> None:
    """Two lengths, with and without an lse gradient, dense and kernel global rows: every case
    compiles a graph of its own and none reaches Dynamo's recompile limit (the forward and the
    backward must not share one code object, whose limit they would split)."""
    import torch._dynamo

    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as mp, torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for length in (24, 30):
            for use_lse in (False, True):
                for limit in (global_tokens.GLOBAL_ROWS_DENSE_MAX_SCORES, 0):
                    mp.setattr(global_tokens, "GLOBAL_ROWS_DENSE_MAX_SCORES", limit)
                    form = GlobalWindow.from_positions([0, 9], length, left=3, right=2).global_tokens_form(
                        length, length
                    )
                    q, k, v = (torch.randn(1, 2, length, 8, requires_grad=True) for _ in range(3))
                    out, lse = global_tokens_attention(q, k, v, form, 0.3, _window_kernel(), compiled=True)
                    (out.sum() + (lse.sum() if use_lse else 0)).backward()


def _forward_args(length: int = 20) -> tuple:
    rows = torch.tensor([0, 7])
    q, k, v = (torch.randn(1, 2, length, 8) for _ in range(3))
    out_w, lse_w = _window_kernel().forward(q, k, v, (2, 2))
    return (q, k, v, out_w, lse_w, rows, (2, 2), 0.3, 0.0, True)


_NO_COMPILER = {"cpp.cxx": (None, "/nonexistent/c++")}


@pytest.mark.parametrize("options", [{}, {"cpp_wrapper": True}], ids=["python wrapper", "cpp wrapper"])
def test_parts_under_inductor_options_match_the_eager_ones(
    monkeypatch: pytest.MonkeyPatch, options: dict
) -> None:
    """The dense parts compiled under each option set the probe times, forward and backward,
    against the same functions run eagerly (no fallback: it would test the Python wrapper)."""
    import torch._dynamo

    torch._dynamo.reset()
    monkeypatch.setattr(global_tokens, "_INDUCTOR_OPTIONS", options)
    forward = global_tokens._CompiledPart(global_tokens._dense_forward_one_graph)
    backward = global_tokens._CompiledPart(global_tokens._dense_backward_one_graph)
    args = _forward_args()
    q, k, v, _, _, rows, window, scale, softcap, dense = args
    out, lse = global_tokens._dense_forward(*args)
    grads = (q, k, v, torch.randn_like(out), torch.randn_like(lse))
    back = (*grads, q, k, v, out, lse, rows, window, scale, softcap, dense)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for got, want in zip(forward(*args), (out, lse), strict=True):
            torch.testing.assert_close(got, want)
        for got, want in zip(backward(*back), global_tokens._dense_backward(*back), strict=True):
            torch.testing.assert_close(got, want)


def test_a_part_whose_options_do_not_build_compiles_without_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the dense parts' Inductor options cannot build (here the C++ wrapper with a compiler
    that does not exist), a part warns once and compiles without them, with the eager results."""
    import torch._dynamo

    torch._dynamo.reset()
    monkeypatch.setattr(global_tokens, "_INDUCTOR_OPTIONS", {"cpp_wrapper": True, **_NO_COMPILER})
    part = global_tokens._CompiledPart(global_tokens._dense_forward_one_graph)
    args = _forward_args()
    with pytest.warns(RuntimeWarning, match="compiled without them"):
        out, lse = part(*args)
    want, want_lse = global_tokens._dense_forward(*args)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        part(*_forward_args(26))  # a second shape: no second warning
    assert part._state[1] == {}  # a later failure raises: there is nothing left to fall back from


def test_a_part_without_options_raises_its_compile_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A part compiled without options has nothing to fall back to: its compile error is raised,
    with no fallback warning."""
    import torch._dynamo
    import torch._inductor.config

    from flexattn_zoo import _compat

    torch._dynamo.reset()
    monkeypatch.setattr(global_tokens, "_INDUCTOR_OPTIONS", {})
    part = global_tokens._CompiledPart(global_tokens._dense_forward_one_graph)
    with (
        torch._inductor.config.patch(_NO_COMPILER),
        pytest.raises(_compat.INDUCTOR_COMPILE_ERRORS),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("error", RuntimeWarning)  # no fallback tried: nothing to fall back to
        part(*_forward_args())


def test_every_position_global_an_lse_only_loss_and_projection_views(global_rows: str) -> None:
    """Every position global (the window's part is overwritten everywhere), a loss on the lse
    alone (no output gradient), and q/k/v as ``[B, L, H, D]`` projections viewed as ``[B, H, L, D]``."""
    length = 12
    gen = torch.Generator().manual_seed(8)
    for spec in (
        GlobalWindow.from_positions(list(range(length)), length, left=1, right=1),
        GlobalWindow.from_positions([2, 7], length, left=2, right=0),
    ):
        form = spec.global_tokens_form(length, length)
        q = (
            torch.randn(2, length, 4, 8, generator=gen, dtype=torch.float64)
            .transpose(1, 2)
            .requires_grad_(True)
        )
        k, v = (
            torch.randn(2, length, 2, 8, generator=gen, dtype=torch.float64)
            .transpose(1, 2)
            .requires_grad_(True)
            for _ in range(2)
        )
        out, lse = global_tokens_attention(q, k, v, form, 1 / math.sqrt(8), _window_kernel())  # its scale
        want, want_lse = reference_attention(q, k, v, mask=spec, enable_gqa=True, return_lse=True)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(lse, want_lse)
        got = torch.autograd.grad(lse.square().sum(), (q, k, v))
        ref = torch.autograd.grad(
            want_lse.square().sum(), (q, k, v), allow_unused=True, materialize_grads=True
        )
        for a, b in zip(got, ref, strict=True):  # v's: zero (the lse does not read v)
            torch.testing.assert_close(a, b)
