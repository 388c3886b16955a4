"""``dropout_p`` (SDPA's attention dropout): which routes take it, what they compute, and that 0.0
changes nothing.

* ``dense`` draws its keep-mask as ``torch.rand(B, H, Lq, Lkv) >= p`` from the default generator
  (``backends.dense.dropout_keep_mask``): seeding identically and drawing that ``torch.rand`` here
  gives the very mask, which the float64 reference applies (``dropout_mask=``), forward and
  backward.
* SDPA's math kernel draws its own mask, which cannot be replayed: checked by statistics that a
  wrong implementation fails (same seed same output; mean over many seeds equals the
  no-dropout output within the standard error computed from the probabilities; the spread of
  that mean is the one dropout with rate ``p`` gives; with uniform probabilities and ``v = I`` the
  output *is* the dropped probability matrix: the dropped share is ``p`` within a binomial bound
  and every kept entry is exactly ``1 / (Lkv * (1 - p))``).
* torch 2.13's CPU flash kernel has no dropout (SDPA raises "No available kernel"), so
  ``sdpa_flash`` refuses it on the CPU; the CUDA kernels are not run here.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.backends import BACKENDS, BY_NAME
from flexattn_zoo.models.layers import attention_layer
from flexattn_zoo.plan_cache import call_key
from flexattn_zoo.problem import Problem
from flexattn_zoo.reference import reference_attention
from flexattn_zoo.testing import assert_matches_reference

#: The routes whose kernels drop, per device (the table of docs/routes.md).
DROPS = {
    "cpu": {"dense", "sdpa_math"},
    "cuda": {"dense", "sdpa_math", "sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient"},
}


def _qkv(
    lq: int = 24, lkv: int = 20, heads: int = 4, kv_heads: int = 2, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11 * lq + lkv)
    return (
        torch.randn(2, heads, lq, 16, generator=gen, dtype=dtype),
        torch.randn(2, kv_heads, lkv, 16, generator=gen, dtype=dtype),
        torch.randn(2, kv_heads, lkv, 16, generator=gen, dtype=dtype),
    )


# ---- (a) dense: the seeded keep-mask, against the float64 reference -----------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dense_is_the_reference_with_the_same_keep_mask_forward_and_backward(
    dtype: torch.dtype, p: float
) -> None:
    q, k, v = (t.requires_grad_() for t in _qkv(dtype=dtype))
    mask, score = masks.Causal(), score_mods.SoftCap(cap=5.0)
    torch.manual_seed(1234)
    out, lse = fz.attention(
        q, k, v, mask=mask, score_mod=score, enable_gqa=True, backend="dense", dropout_p=p, return_lse=True
    )
    torch.manual_seed(1234)
    keep = torch.rand(2, 4, 24, 20) >= p  # the dense route's documented draw, made independently
    assert 0 < keep.float().mean().item() < 1
    ref = reference_attention(
        q, k, v, mask=mask, score_mod=score, enable_gqa=True, dropout_p=p, dropout_mask=keep
    )
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    want = torch.autograd.grad(ref, (q, k, v), grad_out.double())
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-10}
    torch.testing.assert_close(out.double(), ref.double(), **tol)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w.double(), **tol)
    # Dropout acts after the softmax: the lse is the undropped one.
    _, ref_lse = reference_attention(q, k, v, mask=mask, score_mod=score, enable_gqa=True, return_lse=True)
    torch.testing.assert_close(lse.double(), ref_lse.double(), rtol=1e-5, atol=1e-5)
    # ... and it did drop: another mask gives another output.
    other = reference_attention(
        q, k, v, mask=mask, score_mod=score, enable_gqa=True, dropout_p=p, dropout_mask=~keep
    )
    assert (out.double() - other.double()).abs().max() > 1e-2


def test_dense_rows_that_see_no_key_stay_zero_under_dropout() -> None:
    q, k, v = _qkv()
    m = torch.ones(24, 20, dtype=torch.bool)
    m[5] = False
    torch.manual_seed(0)
    out = fz.attention(q, k, v, mask=m, enable_gqa=True, backend="dense", dropout_p=0.4)
    assert not out.isnan().any() and bool((out[:, :, 5] == 0).all())


# ---- (b) statistics of the routes that drop on the CPU ------------------------------------------

_ROUTES_CPU = sorted(DROPS["cpu"])


@pytest.mark.parametrize("route", _ROUTES_CPU)
def test_same_seed_same_output_other_seed_other_output(route: str) -> None:
    q, k, v = _qkv()

    def run(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return fz.attention(q, k, v, enable_gqa=True, backend=route, dropout_p=0.3)

    a, b, c = run(7), run(7), run(8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not torch.equal(a, fz.attention(q, k, v, enable_gqa=True, backend=route))


@pytest.mark.parametrize("route", _ROUTES_CPU)
def test_mean_over_seeds_is_the_undropped_output_within_the_standard_error(route: str) -> None:
    p, seeds, copies = 0.3, 20, 20
    n = seeds * copies  # each call draws its mask anew for every batch row: ``copies`` samples a call
    q, k, v = _qkv(lq=8, lkv=12, heads=2, kv_heads=2)
    many = [t[:1].expand(copies, -1, -1, -1) for t in (q, k, v)]
    total = torch.zeros(1, 2, 8, 16, dtype=torch.float64)
    for seed in range(seeds):
        torch.manual_seed(seed)
        total += fz.attention(*many, backend=route, dropout_p=p).double().sum(0, keepdim=True)
    q, k, v = q[:1], k[:1], v[:1]
    mean = total / n
    # out[i, d] = sum_j P_ij v_jd keep_ij / (1 - p): mean out0, variance p/(1-p) sum_j P_ij^2 v_jd^2.
    probs = torch.softmax((q.double() @ k.double().transpose(-1, -2)) / 4.0, dim=-1)
    out0 = probs @ v.double()
    var = p / (1 - p) * (probs**2) @ (v.double() ** 2)
    stderr = (var / n).sqrt()
    z = (mean - out0) / stderr
    assert z.abs().max() < 6.0, f"mean off by {z.abs().max():.1f} standard errors"
    # The spread is dropout's at rate p (a wrong rate or scale changes it): E[z^2] = 1.
    assert 0.6 < (z**2).mean() < 1.5, f"mean z^2 = {(z**2).mean():.2f}"
    # Not passable by accident: dropping without the 1/(1-p) rescale would be caught.
    unscaled = ((1 - p) * out0 - out0).abs() / stderr
    assert (unscaled > 6.0).float().mean() > 0.5


@pytest.mark.parametrize("route", _ROUTES_CPU)
def test_uniform_probabilities_show_the_dropped_share_and_the_scale(route: str) -> None:
    # q = k = 0: every probability is 1/Lkv; v = I: the output is the dropped probability matrix.
    p, lq, lkv = 0.25, 64, 48
    q = torch.zeros(2, 3, lq, 8, requires_grad=True)
    k = torch.zeros(2, 3, lkv, 8)
    v = torch.eye(lkv).expand(2, 3, lkv, lkv).clone().requires_grad_()
    torch.manual_seed(3)
    out = fz.attention(q, k, v, backend=route, dropout_p=p)
    dropped = out == 0
    n = dropped.numel()
    share = dropped.double().mean().item()
    assert abs(share - p) < 5 * math.sqrt(p * (1 - p) / n), f"dropped {share:.4f} of {n}, p = {p}"
    kept = out[~dropped]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / (lkv * (1 - p))), rtol=1e-6, atol=0)
    # The backward drops what the forward dropped: dv = A^T g for the dropped matrix A = out.
    g = torch.randn_like(out)
    (dv,) = torch.autograd.grad(out, (v,), g)
    torch.testing.assert_close(dv, out.detach().transpose(-1, -2) @ g, rtol=1e-5, atol=1e-6)


def test_torch_cpu_flash_kernel_has_no_dropout() -> None:
    # Why sdpa_flash refuses dropout on the CPU: if a torch release adds it, this says so.
    q, k, v = _qkv(heads=2, kv_heads=2, lkv=24)
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION]):
        with pytest.raises(RuntimeError, match="No available kernel"), pytest.warns(UserWarning):
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)


# ---- (c) dropout_p=0.0 changes nothing ----------------------------------------------------------


@pytest.mark.parametrize("route", ["auto", "sdpa_flash", "sdpa_math", "dense", "flex_cpu"])
def test_zero_is_bit_identical_with_the_same_plan(route: str) -> None:
    q, k, v = _qkv(lq=24, lkv=24, heads=2, kv_heads=2)
    for mask in (None, "causal"):
        plain = fz.plan(q, k, v, mask=mask, backend=route)
        zero = fz.plan(q, k, v, mask=mask, backend=route, dropout_p=0.0)
        assert zero == plain and hash(zero.problem) == hash(plain.problem)
        state = torch.get_rng_state()
        out = fz.attention(q, k, v, mask=mask, backend=route, dropout_p=0.0)
        assert torch.equal(torch.get_rng_state(), state)  # nothing drawn
        assert torch.equal(out, fz.attention(q, k, v, mask=mask, backend=route))
    key = call_key(q, k, v, None, None, False, False, False, "auto", None, None, None)
    assert call_key(q, k, v, None, None, False, False, False, "auto", None, None, None, 0.0) == key
    assert call_key(q, k, v, None, None, False, False, False, "auto", None, None, None, 0.1) != key


def test_the_plan_cache_keeps_dropout_calls_apart() -> None:
    q, k, v = _qkv(lq=24, lkv=24, heads=2, kv_heads=2)
    assert fz.plan(q, k, v).backend == "sdpa_flash"
    assert fz.plan(q, k, v, dropout_p=0.2).backend == "sdpa_math"
    for _ in range(2):  # the second round is served from the plan cache
        torch.manual_seed(0)
        dropped = fz.attention(q, k, v, dropout_p=0.2)
        torch.manual_seed(0)
        assert torch.equal(dropped, fz.attention(q, k, v, dropout_p=0.2))
        assert_matches_reference(fz.attention(q, k, v), q, k, v)
        assert not torch.equal(dropped, fz.attention(q, k, v))
    problem = fz.plan(q, k, v, dropout_p=0.2).problem
    assert problem.dropout_p == 0.2 and "dropout_p=0.2" in fz.plan(q, k, v, dropout_p=0.2).explain()


def test_tuning_is_off_with_dropout() -> None:
    q, k, v = _qkv(lq=24, lkv=24, heads=2, kv_heads=2)
    assert fz.plan(q, k, v, dropout_p=0.2, tune=True).tuning is None


def test_layer_drops_only_while_training() -> None:
    q, k, v = _qkv(lq=24, lkv=24, heads=2, kv_heads=2)
    layer = fz.Attention(mask="causal", dropout_p=0.3, backend="sdpa_math")
    assert "dropout_p=0.3" in repr(layer)
    plain = fz.Attention(mask="causal", backend="sdpa_math")
    torch.manual_seed(5)
    trained = layer(q, k, v)
    torch.manual_seed(5)
    assert torch.equal(trained, fz.attention(q, k, v, mask="causal", backend="sdpa_math", dropout_p=0.3))
    assert not torch.equal(trained, plain(q, k, v))
    layer.eval()
    assert torch.equal(layer(q, k, v), plain(q, k, v))
    assert torch.equal(
        fz.Attention(mask="causal", dropout_p=0.0)(q, k, v), fz.Attention(mask="causal")(q, k, v)
    )
    torch.manual_seed(5)
    functional = attention_layer(q, k, v, mask="causal", backend="sdpa_math", dropout_p=0.3)
    assert torch.equal(functional, trained)


@pytest.mark.parametrize("dynamic", [False, True])
def test_traced_calls_drop_as_eager_ones(dynamic: bool) -> None:
    q, k, v = _qkv(lq=24, lkv=24, heads=2, kv_heads=2)

    def f(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return fz.attention(a, b, c, mask="causal", backend="dense", dropout_p=0.3)

    torch.manual_seed(9)
    eager = f(q, k, v)
    torch.manual_seed(9)
    traced = torch.compile(f, backend="eager", fullgraph=True, dynamic=dynamic)(q, k, v)
    torch.testing.assert_close(traced, eager)
    # A layer's dropout_p is read from the module while tracing (a float Dynamo may make symbolic),
    # and its training flag is guarded on.
    layer = fz.Attention(mask="causal", dropout_p=0.3, backend="sdpa_math")
    compiled = torch.compile(layer, backend="eager", fullgraph=True, dynamic=dynamic)
    torch.manual_seed(9)
    want = layer(q, k, v)
    torch.manual_seed(9)
    assert torch.equal(compiled(q, k, v), want)
    layer.eval()
    assert torch.equal(compiled(q, k, v), layer(q, k, v))
    assert not torch.equal(compiled(q, k, v), want)


# ---- (d) refusals and bad values ----------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_only_the_routes_whose_kernels_drop_accept_it(device: str) -> None:
    arch = "cpu" if device == "cpu" else "sm90"
    problem = Problem(
        batch=1, heads=2, kv_heads=2, q_len=128, kv_len=128, head_dim=64, dtype=torch.bfloat16,
        device_type=device, arch=arch, requires_grad=True, dropout_p=0.1,
    )  # fmt: skip
    for b in BACKENDS:
        said = [r for r in b.reasons(problem) if "no dropout in this kernel" in r]
        if device in b.devices:
            assert bool(said) == (b.name not in DROPS[device]), (b.name, said)
        assert (device in b.dropout_devices) == (b.name in DROPS[device]), b.name


@pytest.mark.parametrize("route", ["flex_cpu", "sdpa_flash", "sdpa_split"])
def test_named_routes_without_dropout_refuse_with_the_reason(route: str) -> None:
    q, k, v = _qkv(lq=24, lkv=24, heads=2, kv_heads=2)
    with pytest.raises(
        ValueError, match=f"backend '{route}' cannot run this call: .*no dropout in this kernel"
    ):
        fz.attention(q, k, v, mask="causal", backend=route, dropout_p=0.1)
    assert not any("dropout" in r for c in fz.plan(q, k, v, backend="auto").candidates for r in c.reasons)


def test_auto_says_why_when_no_route_drops() -> None:
    q, k, v = _qkv(lq=24, lkv=24, heads=2, kv_heads=2)
    with pytest.raises(ValueError, match="no dropout in this kernel"):
        fz.attention(q, k, v, mask="causal", dropout_p=0.1, kernel_options={"BLOCK_M": 16})


_BAD = [1.0, 1, -0.1, float("nan"), float("inf"), True, "0.1", torch.tensor(0.1)]


def test_none_is_no_dropout() -> None:
    """None (the default, so that no float default turns symbolic under torch.compile's dynamic
    shapes) is 0.0."""
    q, k, v = _qkv(lq=24, lkv=24, heads=2, kv_heads=2)
    torch.testing.assert_close(
        fz.attention(q, k, v, mask="causal", dropout_p=None),
        fz.attention(q, k, v, mask="causal"),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("bad", _BAD, ids=repr)
def test_bad_values_raise_naming_dropout_p(bad: object) -> None:
    q, k, v = _qkv(lq=8, lkv=8, heads=2, kv_heads=2)
    for call in (
        lambda: fz.attention(q, k, v, dropout_p=bad),  # type: ignore[arg-type]
        lambda: fz.attention(q, k, v, dropout_p=bad, layout="bshd"),  # type: ignore[arg-type]
        lambda: fz.plan(q, k, v, dropout_p=bad),  # type: ignore[arg-type]
        lambda: fz.Attention(dropout_p=bad),  # type: ignore[arg-type]
        lambda: attention_layer(q, k, v, dropout_p=bad),  # type: ignore[arg-type]
    ):
        with pytest.raises(ValueError, match="dropout_p must be a float in \\[0, 1\\)"):
            call()


def test_reference_dropout_arguments() -> None:
    q, k, v = _qkv(lq=8, lkv=6, heads=2, kv_heads=2)
    keep = torch.rand(1, 2, 8, 6) >= 0.5
    with pytest.raises(ValueError, match="draws no dropout"):
        reference_attention(q, k, v, dropout_p=0.5)
    with pytest.raises(ValueError, match="dropout_mask needs dropout_p > 0"):
        reference_attention(q, k, v, dropout_mask=keep)
    with pytest.raises(ValueError, match="bool tensor"):
        reference_attention(q, k, v, dropout_p=0.5, dropout_mask=keep.float())
    with pytest.raises(ValueError, match="does not broadcast"):
        reference_attention(q, k, v, dropout_p=0.5, dropout_mask=keep[..., :5])
    with pytest.raises(ValueError, match="does not broadcast"):
        reference_attention(q, k, v, dropout_p=0.5, dropout_mask=keep.expand(3, 2, 8, 6)[None])
    with pytest.raises(ValueError, match="dropout_p must be"):
        reference_attention(q, k, v, dropout_p=1.0, dropout_mask=keep)
    # An all-kept mask is the undropped attention scaled by 1/(1-p).
    all_kept = torch.ones(8, 6, dtype=torch.bool)
    torch.testing.assert_close(
        reference_attention(q, k, v, dropout_p=0.5, dropout_mask=all_kept), 2 * reference_attention(q, k, v)
    )


def test_problem_rejects_a_bad_dropout_p() -> None:
    with pytest.raises(ValueError, match="Problem dropout_p must be in \\[0, 1\\)"):
        Problem(
            batch=1, heads=1, kv_heads=1, q_len=1, kv_len=1, head_dim=8, dtype=torch.float32,
            device_type="cpu", arch="cpu", requires_grad=False, dropout_p=1.0,
        )  # fmt: skip
    assert BY_NAME["dense"].dropout_devices == frozenset({"cpu", "cuda"})
