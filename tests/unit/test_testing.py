"""fz.testing: the tolerance rule passes correct routes and fails wrong ones."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import flexattn_zoo as fz
import flexattn_zoo.testing as fzt
from flexattn_zoo import MaskSpec, ScoreSpec, masks, score_mods
from flexattn_zoo.spec import BlockMap, MaskMod, ScoreMod, SdpaForm, VarlenForm, spec_dataclass
from flexattn_zoo.testing import assert_matches_reference, eager_attention, reference_attention
from flexattn_zoo.testing.checks import dense_block_map

Alibi, SoftCap = score_mods.Alibi, score_mods.SoftCap


def causal(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
    return kv_idx <= q_idx


def late_causal(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
    # Queries 0..4 see nothing: rows that must come out as 0 with lse -inf.
    return (kv_idx <= q_idx) & (q_idx >= 5)


def make_qkv(
    dtype: torch.dtype, b: int = 2, hq: int = 4, hkv: int = 4, lq: int = 37, lkv: int = 37, d: int = 16
):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, lq, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, lkv, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, lkv, d, generator=gen).to(dtype)
    return q, k, v


def sdpa_route(q, k, v, mask_fn, *, enable_gqa: bool = False) -> torch.Tensor:  # type: ignore[no-untyped-def]
    lq, lkv = q.shape[-2], k.shape[-2]
    i = torch.arange(lq).view(1, 1, lq, 1)
    j = torch.arange(lkv).view(1, 1, 1, lkv)
    visible = mask_fn(None, None, i, j)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=enable_gqa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_eager_route_passes(dtype: torch.dtype) -> None:
    q, k, v = make_qkv(dtype)
    score = SoftCap(cap=2.0) >> Alibi(num_heads=4)
    out, lse = eager_attention(q, k, v, mask=causal, score_mod=score, return_lse=True)  # type: ignore[misc]
    assert out.dtype == dtype
    assert_matches_reference(out, q, k, v, mask=causal, score_mod=score, lse=lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_route_passes_with_gqa_and_ragged_lengths(dtype: torch.dtype) -> None:
    q, k, v = make_qkv(dtype, hq=4, hkv=2, lq=29, lkv=45)
    out = sdpa_route(q, k, v, causal, enable_gqa=True)
    assert_matches_reference(out, q, k, v, mask=causal, enable_gqa=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wrong_outputs_fail(dtype: torch.dtype) -> None:
    q, k, v = make_qkv(dtype)
    good = sdpa_route(q, k, v, causal)
    assert_matches_reference(good, q, k, v, mask=causal)
    no_mask = F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(AssertionError, match=r"output: max abs error .* at index \(.*exceeds the budget"):
        assert_matches_reference(no_mask, q, k, v, mask=causal)
    wrong_scale = F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True, scale=0.5)
    with pytest.raises(AssertionError, match="output"):
        assert_matches_reference(wrong_scale, q, k, v, mask=causal)
    # A perturbation of a few percent of one element is caught as well.
    nudged = good.clone()
    nudged[1, 2, 30, 3] += 0.05 * good.abs().max()
    with pytest.raises(AssertionError, match=r"index \(1, 2, 30, 3\)"):
        assert_matches_reference(nudged, q, k, v, mask=causal)
    with pytest.raises(AssertionError, match="shape"):
        assert_matches_reference(good[:, :2], q, k, v, mask=causal)


def test_fp32_budget_is_tight() -> None:
    q, k, v = make_qkv(torch.float32)
    out = eager_attention(q, k, v, mask=causal)
    with pytest.raises(AssertionError, match="float32"):
        assert_matches_reference(out + 1e-4, q, k, v, mask=causal)


def test_fully_masked_rows() -> None:
    q, k, v = make_qkv(torch.bfloat16)
    out, lse = eager_attention(q, k, v, mask=late_causal, return_lse=True)  # type: ignore[misc]
    assert torch.isneginf(lse[..., :5]).all() and (out[..., :5, :] == 0).all()
    assert_matches_reference(out, q, k, v, mask=late_causal, lse=lse)
    nan_rows = out.clone()
    nan_rows[..., :5, :] = math.nan  # what a fused kernel with a dense mask may return
    with pytest.raises(AssertionError, match="non-finite"):
        assert_matches_reference(nan_rows, q, k, v, mask=late_causal)
    finite_lse = lse.clone()
    finite_lse[..., :5] = 0.0
    with pytest.raises(AssertionError, match=r"lse: -inf pattern differs"):
        assert_matches_reference(out, q, k, v, mask=late_causal, lse=finite_lse)


def test_lse_in_the_wrong_base_fails() -> None:
    q, k, v = make_qkv(torch.bfloat16)
    out, lse = eager_attention(q, k, v, mask=causal, return_lse=True)  # type: ignore[misc]
    assert_matches_reference(out, q, k, v, mask=causal, lse=lse)
    with pytest.raises(AssertionError, match="lse: max abs error"):
        assert_matches_reference(out, q, k, v, mask=causal, lse=lse * math.log(2))  # FLASH on torch 2.11


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients(dtype: torch.dtype) -> None:
    q, k, v = (t.requires_grad_() for t in make_qkv(dtype, hq=4, hkv=2, lq=33, lkv=40))
    out = sdpa_route(q, k, v, late_causal, enable_gqa=True)  # NaN rows: zero them like a careful route
    out = torch.where(torch.isnan(out), 0.0, out).to(dtype)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(out, q, k, v, mask=late_causal, enable_gqa=True, grads=grads, grad_out=grad_out)
    bad = (grads[0] * 1.1, grads[1], grads[2])
    with pytest.raises(AssertionError, match="dq: max abs error"):
        assert_matches_reference(
            out, q, k, v, mask=late_causal, enable_gqa=True, grads=bad, grad_out=grad_out
        )
    assert_matches_reference(  # None entries are skipped
        out, q, k, v, mask=late_causal, enable_gqa=True, grads=(None, None, grads[2]), grad_out=grad_out
    )
    with pytest.raises(ValueError, match="grad_out"):
        assert_matches_reference(out, q, k, v, mask=late_causal, enable_gqa=True, grads=grads)


def test_reference_is_reexported_and_strategies_are_lazy() -> None:
    from flexattn_zoo import reference

    assert fzt.reference_attention is reference.reference_attention is reference_attention
    assert fzt.strategies.shapes is not None
    with pytest.raises(AttributeError):
        fzt.no_such_thing  # noqa: B018


def test_eager_attention_takes_sdpa_style_mask_tensors() -> None:
    """A float ``mask`` tensor is an additive bias (``score_mods.Bias``), a bool one a ``Dense``
    mask, as in ``fz.attention``: the eager yardstick evaluates both."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    for mask in (torch.randn(1, 2, 8, 8, generator=g), torch.rand(8, 8, generator=g) > 0.3):
        got = eager_attention(q, k, v, mask=mask)
        want = reference_attention(q.double(), k.double(), v.double(), mask=mask)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_score_check_takes_the_specs_own_head_count() -> None:
    """A spec built for several heads (ALiBi's slopes) is checked at its own head count unless
    ``heads=`` says otherwise (the check once defaulted to one head and blamed the spec)."""
    fzt.assert_score_consistent(score_mods.Alibi(num_heads=2))
    fzt.assert_score_consistent(score_mods.Alibi(num_heads=4), heads=4, batch=2)
    with pytest.raises(ValueError, match="num_heads"):
        fzt.assert_score_consistent(score_mods.Alibi(num_heads=2), heads=3)


@pytest.mark.parametrize(("q_len", "kv_len"), [(0, 5), (5, 0), (0, 0)])
def test_mask_check_accepts_empty_problems(q_len: int, kv_len: int) -> None:
    """``assert_mask_consistent`` documents ``q_len, kv_len >= 0``: an empty problem has nothing
    to disagree on, so correct specs pass (it once crashed in create_block_mask's vmap, in the
    past_key_starts and varlen checks' reshapes and in the lowest-key check's amin)."""
    for spec in (
        masks.Full(),
        masks.SlidingWindow(left=2, right=1),
        masks.Band(lo=-1, hi=2),
        masks.Document(doc_ids=torch.zeros(5, dtype=torch.long)),
    ):
        fzt.assert_mask_consistent(spec, q_len, kv_len, batch=2, heads=2)


def _diagonal_hiding_score(*, hides: bool, oracle_nan: bool = False) -> ScoreSpec:
    """A user score spec whose oracle hides the diagonal with ``-inf``; its score_mod does the
    same when ``hides``, else leaves the diagonal visible (a bug). ``oracle_nan``: a broken oracle
    that returns NaN everywhere."""

    @spec_dataclass
    class HideDiagonal(ScoreSpec):
        """``-inf`` on the diagonal ``q_idx == kv_idx``."""

        hides: bool = True
        oracle_nan: bool = False

        def _make_score_mod(self, *, fast: bool) -> ScoreMod:
            hides = self.hides

            def hide_diagonal(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
                return torch.where(q_idx == kv_idx, float("-inf"), score) if hides else score

            return hide_diagonal

        def dense(self, scores: torch.Tensor) -> torch.Tensor:
            if self.oracle_nan:
                return torch.full_like(scores, float("nan"))
            q_len, kv_len = scores.shape[-2:]
            diagonal = torch.arange(q_len)[:, None] == torch.arange(kv_len)[None, :]
            return scores.masked_fill(diagonal, float("-inf"))

    return HideDiagonal(hides=hides, oracle_nan=oracle_nan)


def test_score_check_catches_infinite_and_nan_disagreements() -> None:
    """A finite score where the oracle has ``-inf`` (a key left visible) and a NaN oracle are
    disagreements: the relative tolerance ``rtol * |inf|`` is infinite and NaN fails every
    comparison, so both once passed."""
    fzt.assert_score_consistent(_diagonal_hiding_score(hides=True))
    with pytest.raises(AssertionError, match=r"at index \(0, 0, 0, 0\): got [-\d.]+, oracle -inf"):
        fzt.assert_score_consistent(_diagonal_hiding_score(hides=False))
    with pytest.raises(AssertionError, match="oracle nan"):
        fzt.assert_score_consistent(_diagonal_hiding_score(hides=True, oracle_nan=True))


def test_a_nan_reference_fails_instead_of_passing_everything() -> None:
    """A score spec whose oracle gives NaN makes the float64 reference NaN; every error is then
    NaN, which once passed the budget comparison (``nan > budget`` is False) for any output."""
    q, k, v = make_qkv(torch.float32, b=1, hq=1, hkv=1, lq=8, lkv=8)
    broken = _diagonal_hiding_score(hides=True, oracle_nan=True)
    with pytest.raises(
        AssertionError, match=r"output: the float64 reference itself is nan at index \(0, 0, 0, 0\)"
    ):
        assert_matches_reference(torch.zeros_like(q), q, k, v, score_mod=broken)


@spec_dataclass
class _Shifted(MaskSpec):
    """Bound form of :class:`_BottomRightCausal`: key ``j`` visible to query ``i`` iff
    ``j <= i + shift``. ``wrong_forms``: its block map ignores ``shift`` and its SDPA form claims
    plain top-left ``is_causal`` (bugs that only the bound spec has)."""

    shift: int
    wrong_forms: bool = False

    def _make_mask_mod(self) -> MaskMod:
        shift = self.shift

        def shifted(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return kv_idx <= q_idx + shift

        return shifted

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        return torch.ones(q_len, kv_len, dtype=torch.bool).tril(self.shift)[None, None]

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        return SdpaForm(is_causal=True) if self.wrong_forms or self.shift == 0 else None

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap:
        shift = 0 if self.wrong_forms else self.shift
        dense = torch.ones(q_len, kv_len, dtype=torch.bool).tril(shift)[None, None]
        visible, full = dense_block_map(dense, q_block, kv_block)
        return BlockMap(any=visible, full=full)


@spec_dataclass
class _BottomRightCausal(MaskSpec):
    """Causal aligned to the last key; ``bind`` makes the shift ``Lkv - Lq`` explicit, as
    ``masks.Causal(align="bottom_right")`` does."""

    wrong_forms: bool = False

    def bind(self, q_len: int, kv_len: int) -> MaskSpec:
        return _Shifted(shift=kv_len - q_len, wrong_forms=self.wrong_forms)

    def _make_mask_mod(self) -> MaskMod:
        raise NotImplementedError("needs the lengths: the routes and checks bind the spec first")

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        return torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)[None, None]


def test_mask_check_checks_the_bound_specs_forms_and_block_map() -> None:
    """The routes read the forms and block map of ``spec.bind(Lq, Lkv)``: a wrong one there
    computes wrong attention, so the check must see it (it once checked the unbound spec's only)."""
    fzt.assert_mask_consistent(_BottomRightCausal(), 37, 53)
    with pytest.raises(AssertionError, match=r"_Shifted\(shift=16, wrong_forms=True\): block_map"):
        fzt.assert_mask_consistent(_BottomRightCausal(wrong_forms=True), 37, 53)
    with pytest.raises(AssertionError, match=r"_Shifted\(shift=16, wrong_forms=True\): sdpa_form"):
        fzt.assert_mask_consistent(_BottomRightCausal(wrong_forms=True), 37, 53, block_sizes=())


@spec_dataclass
class _RowPrefix(MaskSpec):
    """Batch row ``b`` sees keys ``j < visible[b]``; its block map is 3-d ``[B, n_q, n_kv]``
    (``as_4d``'s convention, which ``fz.block_mask`` reads). ``swap_rows``: the map of each row
    is the other row's (a bug)."""

    visible: tuple[int, ...]
    swap_rows: bool = False
    depends_on_batch = True

    def _make_mask_mod(self) -> MaskMod:
        visible = torch.tensor(self.visible)

        def row_prefix(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return kv_idx < visible[b]

        return row_prefix

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        out = torch.zeros(len(self.visible), 1, q_len, kv_len, dtype=torch.bool)
        for b, n in enumerate(self.visible):
            out[b, :, :, :n] = True
        return out

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap:
        dense = self.dense(q_len, kv_len)
        if self.swap_rows:
            dense = dense.flip(0)
        visible, full = dense_block_map(dense, q_block, kv_block)
        return BlockMap(any=visible[:, 0], full=full[:, 0])  # [B, n_q, n_kv]


def test_mask_check_reads_3d_block_maps_as_block_mask_does() -> None:
    """A ``[B, n_q, n_kv]`` block map is per batch row (``as_4d``); the check once broadcast it
    as ``[H, n_q, n_kv]``, failing a correct map (or crashing on the shapes)."""
    fzt.assert_mask_consistent(_RowPrefix(visible=(5, 40)), 37, 53, batch=2, heads=2)
    fzt.assert_mask_consistent(_RowPrefix(visible=(5, 40)), 37, 53, batch=2, heads=1)
    with pytest.raises(
        AssertionError, match=r"block_map misses a visible block at \(1, 0, 0, 1\) \(blocks 16x32\)"
    ):
        fzt.assert_mask_consistent(_RowPrefix(visible=(5, 40), swap_rows=True), 37, 53, batch=2, heads=2)


@spec_dataclass
class _CausalWithMisshapedForms(MaskSpec):
    """Top-left causal whose ``form`` (one of ``sdpa``, ``varlen``, ``starts``) has the wrong
    shape: one key too many, or three batch rows for a two-row problem."""

    form: str

    def _make_mask_mod(self) -> MaskMod:
        return causal

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        return torch.ones(q_len, kv_len, dtype=torch.bool).tril()[None, None]

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        if self.form != "sdpa":
            return None
        return SdpaForm(is_causal=False, attn_mask=self.dense(q_len, kv_len + 1))

    def varlen_form(self, q_len: int, kv_len: int, batch: int) -> VarlenForm | None:
        if self.form != "varlen":
            return None
        return VarlenForm(segments=torch.tensor([[q_len]] * 3), window=(-1, 0))

    def past_key_starts(self, q_len: int, kv_len: int) -> torch.Tensor | None:
        if self.form != "starts":
            return None
        return torch.zeros(3, max(q_len, kv_len), dtype=torch.int32)


@pytest.mark.parametrize("form", ["sdpa", "varlen", "starts"])
def test_misshapen_forms_fail_naming_the_form(form: str) -> None:
    """A form whose shape does not broadcast to the mask's fails as an AssertionError naming the
    form (it once raised torch's expand RuntimeError, which names neither the form nor the spec)."""
    with pytest.raises(
        AssertionError, match=r"which does not broadcast to the mask's \[B, H, Lq, Lkv\] = \[2, 2, 8, 8\]"
    ):
        fzt.assert_mask_consistent(_CausalWithMisshapedForms(form=form), 8, 8, batch=2, heads=2)


@pytest.mark.parametrize("block_sizes", [(16, 32), ((0, 32),), ((16, 32, 8),), "16x32"])
def test_mask_check_rejects_malformed_block_sizes(block_sizes: object) -> None:
    """A flat pair (a natural slip for one block size) once failed with "cannot unpack
    non-iterable int", a 0 with ZeroDivisionError; both now name the argument."""
    with pytest.raises(
        ValueError, match=r"block_sizes=\.\.\.\) must be a tuple of \(q_block, kv_block\) pairs"
    ):
        fzt.assert_mask_consistent(masks.Causal(), 8, 8, block_sizes=block_sizes)  # type: ignore[arg-type]


def test_gradient_floor_covers_rounding_of_a_cancelling_dot_product() -> None:
    """A row that sees one key has ``dq = 0`` exactly (``dp - delta`` cancels); a correct kernel
    leaves rounding of ``dO . v``, which scales with ``|dO| . |v|``. The floor once used
    ``|dO . v|``, which itself can nearly cancel, and failed ``sdpa_flash`` on such rows."""
    failures = 0
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, 1, 1, 8, generator=g).requires_grad_() for _ in range(3))
        out = fz.attention(q, k, v, backend="sdpa_flash")
        grad_out = torch.randn(out.shape, generator=g)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        assert not bool(grads[0].any()) or float(grads[0].abs().max()) < 1e-6  # rounding only
        try:
            fzt.assert_matches_reference(out, q, k, v, grads=grads, grad_out=grad_out)
        except AssertionError:
            failures += 1
    assert failures == 0
    # Still a check: a dq off by far more than rounding fails.
    q, k, v = (torch.randn(1, 1, 1, 8, generator=torch.Generator().manual_seed(s)) for s in range(3))
    grad_out = torch.randn(1, 1, 1, 8)
    dq = torch.full_like(q, 1e-4)
    with pytest.raises(AssertionError, match="dq"):
        fzt.assert_matches_reference(v.clone(), q, k, v, grads=(dq, None, None), grad_out=grad_out)
