"""Adversarial inputs at the entry points (``fz.attention`` / ``fz.plan``, spec constructors, the
registries, environment variables, the CLI), one class per reported failure. Every case here
failed on the library before these fixes (wrong result, NaN, a crash deep inside torch, an error
naming neither the argument nor the valid choices, or a refusal of a valid input).

Classes:

* score factors: ``scale``, ``SoftCap(cap)`` (and ``1/cap``) and ``Alibi`` slopes are bounded by
  one rule, ``validation.SCORE_FACTOR_MAX`` = sqrt(float32 max);
* learnable tensors captured by a score_mod (raw closures, globals, defaults, bound methods,
  partials, callable objects, registered functions) make the call need a backward, and make
  ``deterministic=True`` refuse;
* callables with extra defaulted parameters are flex callables (required positional count);
* ``FLEXATTN_ZOO_*`` numbers: one parser (``inf`` = no limit, garbage/negative/nan named);
* ``register_function`` checks like a raw callable;
* a user BlockMask under autograd on the CPU runs on ``dense`` (flex's semantics), and the
  no-route error only suggests routes that accept the problem;
* the CLI: options named, exit 2, no traceback; ``show`` at any length.
"""

from __future__ import annotations

import functools
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.cli import app as cli
from flexattn_zoo.config import load_yaml_spec
from flexattn_zoo.dispatch import Problem, plan_problem
from flexattn_zoo.testing import assert_matches_reference, reference_attention

B, H, L, D = 1, 2, 8, 16


def _t(*shape: int, seed: int = 0, grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).requires_grad_(grad)


Q, K, V = _t(B, H, L, D, seed=1), _t(B, H, L, D, seed=2), _t(B, H, L, D, seed=3)

# -- 5 / 9: one bound for every factor a kernel multiplies scores by ----------------------------

FACTOR = r"finite number with .*\|value\| <= 1\.84e\+19"

FACTOR_ERRORS = [
    pytest.param(lambda: fz.attention(Q, K, V, scale=1e39), "scale", id="scale_1e39"),
    pytest.param(lambda: fz.attention(Q, K, V, scale=-1e39), "scale", id="scale_neg_1e39"),
    pytest.param(lambda: fz.attention(Q, K, V, scale=1e20), "scale", id="scale_just_above_bound"),
    pytest.param(lambda: fz.attention(Q, K, V, scale=10**30), "scale", id="scale_big_int"),
    pytest.param(lambda: fz.plan(Q, K, V, scale=3.5e38), "scale", id="plan_scale_fp32_max"),
    pytest.param(lambda: score_mods.SoftCap(cap=1e39), r"SoftCap\(cap=...\)", id="softcap_1e39"),
    pytest.param(lambda: score_mods.SoftCap(cap=1e20), r"SoftCap\(cap=...\)", id="softcap_above_bound"),
    pytest.param(
        lambda: score_mods.SoftCap(cap=1e-25), r"SoftCap\(cap=...\)", id="softcap_reciprocal_overflows"
    ),
    pytest.param(lambda: score_mods.get("softcap", cap=1e39), r"SoftCap\(cap=...\)", id="softcap_by_name"),
    pytest.param(
        lambda: load_yaml_spec("score_mod: {name: softcap, cap: 1.0e+39}\n"), r"SoftCap", id="softcap_yaml"
    ),
    pytest.param(
        lambda: score_mods.Alibi(num_heads=2, slopes=[1e39, 1.0]), r"Alibi\(slopes=...\)", id="alibi_1e39"
    ),
    pytest.param(
        lambda: score_mods.Alibi(num_heads=2, slopes=[0.5, -1e30]),
        r"Alibi\(slopes=...\)",
        id="alibi_neg_huge",
    ),
    pytest.param(
        lambda: score_mods.Alibi(num_heads=2, slopes=torch.tensor([1e30, 1.0])),
        r"Alibi\(slopes=...\)",
        id="alibi_tensor_slopes",
    ),
]


@pytest.mark.parametrize(("call", "name"), FACTOR_ERRORS)
def test_score_factors_beyond_float32_are_refused(call: Callable[[], Any], name: str) -> None:
    with pytest.raises(ValueError, match=name + r".* must be a " + FACTOR):
        call()


def test_score_factor_bound_is_sqrt_of_float32_max() -> None:
    from flexattn_zoo.validation import SCORE_FACTOR_MAX

    assert SCORE_FACTOR_MAX == math.sqrt(torch.finfo(torch.float32).max)
    # At the bound, a score of the same magnitude still fits float32: no NaN anywhere.
    out = fz.attention(Q, K, V, score_mod=score_mods.SoftCap(cap=SCORE_FACTOR_MAX), scale=SCORE_FACTOR_MAX)
    assert bool(torch.isfinite(out).all())


# -- 6 / 16: learnable tensors captured by a score_mod -------------------------------------------

GLOBAL_BIAS = torch.zeros(H, requires_grad=True)


def global_bias_score(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
    return score + GLOBAL_BIAS[h]


class BiasModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rel = torch.nn.Parameter(torch.zeros(H))

    def score(self, score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return score + self.rel[h]


class CallableBias:
    def __init__(self) -> None:
        self.bias = torch.zeros(H, requires_grad=True)

    def __call__(self, score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return score + self.bias[h]


def _partial_score(score, b, h, q_idx, kv_idx, *, bias):  # type: ignore[no-untyped-def]
    return score + bias[h]


def _closure() -> Callable[..., Any]:
    bias = torch.linspace(-1.0, 1.0, H).requires_grad_()

    def head_bias(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return score + bias[h]

    return head_bias


def _learned_score(kind: str) -> Callable[..., Any]:
    if kind == "closure":
        return _closure()
    if kind == "global":
        return global_bias_score
    if kind == "default":
        bias = torch.zeros(H, requires_grad=True)
        return lambda score, b, h, q_idx, kv_idx, bias=bias: score + bias[h]
    if kind == "bound_method":
        return BiasModule().score
    if kind == "partial":
        return functools.partial(_partial_score, bias=torch.zeros(H, requires_grad=True))
    if kind == "callable_object":
        return CallableBias()
    raise AssertionError(kind)


LEARNED_KINDS = ["closure", "global", "default", "bound_method", "partial", "callable_object"]


@pytest.mark.parametrize("kind", LEARNED_KINDS)
def test_raw_score_mod_with_learnable_tensor_needs_a_backward(kind: str) -> None:
    """Frozen q/k/v, but the score_mod's tensor learns: flex_cpu (forward only) must not be chosen."""
    plan = fz.plan(Q, K, V, mask="causal", score_mod=_learned_score(kind))
    assert plan.problem.requires_grad and plan.backend == "dense", plan.explain()


@pytest.mark.parametrize("kind", ["closure", "global"])
def test_raw_score_mod_with_learnable_tensor_refuses_deterministic(kind: str) -> None:
    with pytest.raises(
        ValueError, match=r"not deterministic: gradients of tensors captured by the score_mod"
    ):
        fz.attention(Q, K, V, mask="causal", score_mod=_learned_score(kind), deterministic=True)


def test_raw_score_mod_learnable_tensor_named_dense_refuses_deterministic() -> None:
    with pytest.raises(ValueError, match=r"backend 'dense' cannot run this call: not deterministic"):
        fz.attention(Q, K, V, score_mod=_closure(), deterministic=True, backend="dense")


def test_raw_score_mod_learnable_tensor_gets_its_gradient() -> None:
    bias = torch.tensor([0.3, -0.7], requires_grad=True)
    out = fz.attention(Q, K, V, mask="causal", score_mod=lambda s, b, h, qi, kv: s + bias[h])
    (dbias,) = torch.autograd.grad(out.square().sum(), bias)
    # float64 reference by hand
    b64 = bias.detach().double().requires_grad_()
    scores = Q.double() @ K.double().transpose(-1, -2) / math.sqrt(D) + b64.view(1, H, 1, 1)
    scores = scores.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    ref = torch.softmax(scores, -1) @ V.double()
    (ref_dbias,) = torch.autograd.grad(ref.square().sum(), b64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dbias.double(), ref_dbias, rtol=1e-4, atol=1e-5)


def test_registered_function_with_learnable_tensor_captures_grad() -> None:
    fn = _closure()
    score_mods.register_function("adv_learned_bias", fn)
    try:
        spec = score_mods.get("adv_learned_bias")
        assert spec.captures_grad_tensors()
        chained = spec >> score_mods.SoftCap(cap=5.0)
        assert fz.plan(Q, K, V, score_mod=chained).backend == "dense"
    finally:
        score_mods.unregister("adv_learned_bias")


def test_decode_step_with_learnable_score_mod_backpropagates() -> None:
    bias = torch.zeros(H, requires_grad=True)
    q = _t(B, H, 1, D, seed=5)
    cache_k, cache_v = _t(B, H, 16, D, seed=6), _t(B, H, 16, D, seed=7)
    out = fz.decode.decode_step(q, cache_k, cache_v, 9, score_mod=lambda s, b, h, qi, kv: s + bias[h] * kv)
    (grad,) = torch.autograd.grad(out.sum(), bias)
    assert grad.shape == (H,) and bool(torch.isfinite(grad).all())


# -- 7: extra parameters with defaults are flex callables ------------------------------------------

DOC = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])


def test_mask_with_defaulted_capture_runs() -> None:
    out = fz.attention(Q, K, V, mask=lambda b, h, q, kv, doc=DOC: doc[q] == doc[kv])
    assert_matches_reference(out, Q, K, V, mask=masks.Document(doc_ids=DOC))


def test_mask_with_two_defaulted_extras_runs() -> None:
    out = fz.attention(Q, K, V, mask=lambda b, h, q, kv, doc=DOC, w=2: (doc[q] == doc[kv]) & (q - kv <= w))
    assert_matches_reference(
        out, Q, K, V, mask=masks.Document(doc_ids=DOC) & masks.SlidingWindow(left=2, right=L)
    )


def test_score_with_defaulted_parameter_runs() -> None:
    out = fz.attention(Q, K, V, score_mod=lambda s, b, h, q, kv, cap=3.0: cap * torch.tanh(s / cap))
    assert_matches_reference(out, Q, K, V, score_mod=score_mods.SoftCap(cap=3.0))


def test_block_mask_of_defaulted_callable() -> None:
    bm = fz.block_mask(lambda b, h, q, kv, doc=DOC: doc[q] == doc[kv], L, L)
    assert tuple(bm.seq_lengths) == (L, L)


def test_reference_takes_defaulted_callable() -> None:
    ref = reference_attention(Q, K, V, mask=lambda b, h, q, kv, doc=DOC: doc[q] == doc[kv])
    torch.testing.assert_close(ref, reference_attention(Q, K, V, mask=masks.Document(doc_ids=DOC)))


def test_mask_whose_default_hides_a_flex_argument_is_refused() -> None:
    # flex counts arguments without defaults: this is a 3-argument function to it.
    with pytest.raises(
        TypeError, match=r"mask callable must have the flex mask_mod signature .*requires 3 positional"
    ):
        fz.attention(Q, K, V, mask=lambda b, h, q, kv=None: q >= kv)


def test_mask_with_required_keyword_only_is_refused() -> None:
    def needs_doc(b, h, q, kv, *, doc):  # type: ignore[no-untyped-def]
        return doc[q] == doc[kv]

    with pytest.raises(TypeError, match=r"mask callable must have .*keyword-only argument\(s\) doc"):
        fz.attention(Q, K, V, mask=needs_doc)


# -- 8: one parser for numeric FLEXATTN_ZOO_* variables ------------------------------------------

WINDOW = masks.SlidingWindow(left=2)


@pytest.mark.parametrize("raw", ["inf", "Infinity", "1e400"])
def test_dense_limit_inf_means_no_limit(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from flexattn_zoo.backends.dense import dense_limit_bytes

    monkeypatch.setenv("FLEXATTN_ZOO_DENSE_LIMIT_MB", raw)
    assert dense_limit_bytes() == math.inf
    out = fz.attention(Q, K, V, mask=WINDOW, backend="dense")
    assert_matches_reference(out, Q, K, V, mask=WINDOW)


def test_dense_limit_empty_means_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXATTN_ZOO_DENSE_LIMIT_MB", "")
    assert fz.plan(Q, K, V, mask=WINDOW, backend="dense").backend == "dense"


@pytest.mark.parametrize("raw", ["-5", "nan", "lots", "1GB"])
def test_dense_limit_garbage_names_the_variable(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXATTN_ZOO_DENSE_LIMIT_MB", raw)
    with pytest.raises(
        ValueError, match=r"FLEXATTN_ZOO_DENSE_LIMIT_MB must be a number >= 0 \(MiB\) or 'inf'"
    ):
        fz.plan(Q, K, V, mask=WINDOW)


# -- 12: register_function checks what fz.attention checks ----------------------------------------

REGISTER_ERRORS = [
    pytest.param(
        masks.register_function,
        lambda q, kv: q >= kv,
        r"mask callable must have the flex mask_mod signature",
        id="mask_arity",
    ),
    pytest.param(
        masks.register_function,
        lambda b, h, q, kv: q - kv,
        r"mask callable must return a bool tensor",
        id="mask_not_bool",
    ),
    pytest.param(
        masks.register_function,
        lambda b, h, q, kv: (q >= kv) if q > 2 else (q < kv),
        r"mask callable uses data-dependent Python control flow",
        id="mask_python_if",
    ),
    pytest.param(
        masks.register_function,
        lambda b, h, q, kv: 1 / 0,
        r"mask callable failed .*ZeroDivisionError",
        id="mask_raises",
    ),
    pytest.param(
        score_mods.register_function,
        lambda s: s,
        r"score_mod callable must have the flex score_mod signature",
        id="score_arity",
    ),
    pytest.param(
        score_mods.register_function,
        lambda s, b, h, q, kv: q - kv,
        r"score_mod callable must return a floating tensor",
        id="score_not_float",
    ),
    pytest.param(
        score_mods.register_function,
        lambda s, b, h, q, kv: s.nope,
        r"score_mod callable failed",
        id="score_raises",
    ),
]


@pytest.mark.parametrize(("register", "fn", "match"), REGISTER_ERRORS)
def test_register_function_validates_at_registration(register: Any, fn: Any, match: str) -> None:
    with pytest.raises(TypeError, match=r"register_function\('adv_bad'\) " + match):
        register("adv_bad", fn)
    assert "adv_bad" not in masks.names() and "adv_bad" not in score_mods.names()


# -- 18: a user BlockMask under autograd on the CPU ------------------------------------------------


def test_block_mask_with_grad_on_cpu_runs_exactly() -> None:
    spec = masks.SlidingWindow(left=37)
    q, k, v = (_t(1, 2, 300, 16, seed=s, grad=True) for s in (1, 2, 3))
    bm = fz.block_mask(spec, 300, 300)
    assert fz.plan(q, k, v, mask=bm).backend == "dense"
    out = fz.attention(q, k, v, mask=bm)
    grad_out = _t(*out.shape, seed=9)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(out, q, k, v, mask=spec, grads=grads, grad_out=grad_out)


def test_dense_follows_flex_block_semantics() -> None:
    """Full blocks are visible whatever mask_mod says, unlisted blocks hidden: as flex_cpu does."""
    causal = fz.block_mask("causal", 256, 256, block_size=64)
    everything = _compat_block_mask(causal, lambda b, h, q, kv: q >= 0)  # mask_mod says "all"
    q, k, v = (_t(1, 2, 256, 16, seed=s) for s in (1, 2, 3))
    with torch.no_grad():
        flex = fz.attention(q, k, v, mask=everything, backend="flex_cpu")
        dense = fz.attention(q, k, v, mask=everything, backend="dense")
    torch.testing.assert_close(dense, flex, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(dense, fz.attention(q, k, v, backend="dense"), atol=1e-3)


def _compat_block_mask(bm: Any, mask_mod: Any) -> Any:
    from flexattn_zoo._compat import BlockMask

    return BlockMask.from_kv_blocks(
        bm.kv_num_blocks,
        bm.kv_indices,
        bm.full_kv_num_blocks,
        bm.full_kv_indices,
        BLOCK_SIZE=bm.BLOCK_SIZE,
        mask_mod=mask_mod,
        seq_lengths=tuple(bm.seq_lengths),
    )


def test_no_route_error_suggests_nothing_false(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXATTN_ZOO_DENSE_LIMIT_MB", "0")
    q = Q.clone().requires_grad_()
    with pytest.raises(
        ValueError, match=r"No other route can run it either; flex_cpu: has no backward"
    ) as info:
        fz.attention(q, K, V, mask=fz.block_mask("causal", L, L))
    assert "backend='dense'" not in str(info.value)


def test_no_route_error_names_the_route_that_accepts() -> None:
    p = Problem(
        batch=1,
        heads=2,
        kv_heads=2,
        q_len=64,
        kv_len=64,
        head_dim=64,
        dtype=torch.float64,
        device_type="cuda",
        arch="sm90",
        requires_grad=False,
        mask=WINDOW,
    )
    with pytest.raises(ValueError, match=r"Name one that can explicitly \(backend='dense'\)"):
        plan_problem(p)


# -- 13 / 10: the CLI --------------------------------------------------------------------------------

PLAN = ["plan", "--len", "8", "--heads", "2", "--dim", "16", "--dtype", "fp32", "--arch", "cpu"]


def _file(tmp: Path, data: bytes) -> str:
    path = tmp / "attn.yaml"
    path.write_bytes(data)
    return str(path)


CLI_ERRORS = [
    pytest.param(
        lambda tmp: ["show", "document", "--len", "3", "--doc-ids", "0,0,x"],
        r"--doc-ids takes comma-separated numbers.*'x'",
        id="doc_ids_word",
    ),
    pytest.param(
        lambda tmp: [*PLAN, "--mask", "document", "--doc-ids", "0,0,1,1,x,2,2,2"],
        r"--doc-ids takes comma-separated numbers",
        id="plan_doc_ids_word",
    ),
    pytest.param(
        lambda tmp: ["show", "document", "--len", "4", "--doc-ids", "0,0,1,99999999999999999999999"],
        r"--doc-ids takes comma-separated numbers.*int64",
        id="doc_ids_overflow",
    ),
    pytest.param(
        lambda tmp: ["show", "prefix_lm", "--len", "8", "--prefix-len", "1,x"],
        r"--prefix-len takes comma-separated numbers",
        id="prefix_len_word",
    ),
    pytest.param(
        lambda tmp: [*PLAN, "--config", _file(tmp, b"mask: {name: causal}\n\xff\xfe\n")],
        r"--config .*is not UTF-8 text \(byte 0xff",
        id="config_not_utf8",
    ),
    pytest.param(
        lambda tmp: [*PLAN, "--config", str(tmp)],
        r"--config .*is a directory, not a file",
        id="config_directory",
    ),
    pytest.param(
        lambda tmp: [*PLAN, "--config", str(tmp / "attn.txt")],
        r"--config .*attn.txt' does not exist",
        id="config_missing_txt",
    ),
    pytest.param(lambda tmp: [*PLAN, "--mask", ""], r"--mask needs a registry name", id="mask_empty"),
    pytest.param(
        lambda tmp: [*PLAN, "--mask", "causal", "--score", " "],
        r"--score needs a registry name",
        id="score_empty",
    ),
    pytest.param(
        lambda tmp: ["show", "causal", "--len", "8", "--png", str(tmp / "no" / "x.png")],
        r"--png .*folder .* does not exist",
        id="png_no_folder",
    ),
    pytest.param(
        lambda tmp: ["show", "causal", "--len", str(2**60)],
        r"--len must be at most 2\*\*52",
        id="show_len_2_60",
    ),
    pytest.param(
        lambda tmp: ["show", "softcap", "--len", "8", "--cap", "1e39"],
        r"SoftCap\(cap=...\) must be a finite number with",
        id="show_cap_huge",
    ),
    pytest.param(
        lambda tmp: [*PLAN, "--mask", "causal", "--score", "alibi", "--slopes", "1e39,1"],
        r"Alibi\(slopes=...\) values must be a finite number with",
        id="plan_slopes_huge",
    ),
    pytest.param(
        lambda tmp: ["show", "alibi", "--len", "8", "--heads", "2", "--slopes", "1e20,1"],
        r"Alibi\(slopes=...\) values must be a finite number",
        id="show_slopes_above_bound",
    ),
    pytest.param(
        lambda tmp: [*PLAN, "--mask", "causal", "--score", "softcap", "--cap", "1e-30"],
        r"SoftCap\(cap=...\) must be a finite number with 5.42e-20",
        id="plan_cap_tiny",
    ),
    pytest.param(
        lambda tmp: [*PLAN, "--config", _file(tmp, b"score_mod: {name: softcap, cap: 1.0e+39}\n")],
        r"--config .*SoftCap\(cap=...\) must be a finite number",
        id="config_cap_huge",
    ),
    pytest.param(
        lambda tmp: ["show", "document", "--len", "4", "--doc-ids", "0,0;1"],
        r"--doc-ids takes comma-separated numbers \(rows of equal length",
        id="doc_ids_ragged",
    ),
    pytest.param(
        lambda tmp: ["show", "document", "--len", "4", "--doc-ids", "0,0,1,true"],
        r"--doc-ids takes comma-separated numbers.*True",
        id="doc_ids_bool",
    ),
    pytest.param(
        lambda tmp: ["show", "document", "--len", "4", "--doc-ids", "0,0,1,none"],
        r"--doc-ids takes comma-separated numbers.*None",
        id="doc_ids_none",
    ),
    pytest.param(
        lambda tmp: [*PLAN, "--mask", "causal", "--mask", ""],
        r"--mask needs a registry name",
        id="second_mask_empty",
    ),
    pytest.param(
        lambda tmp: ["bench", str(tmp)],
        r"sweep config .* is a directory, not a file",
        id="bench_config_directory",
    ),
    pytest.param(
        lambda tmp: ["bench", _file(tmp, b"cases:\n\xff\n")],
        r"sweep config .*is not UTF-8 text",
        id="bench_config_not_utf8",
    ),
    pytest.param(
        lambda tmp: ["env-var", "-5", *PLAN, "--mask", "causal"],
        r"FLEXATTN_ZOO_DENSE_LIMIT_MB must be a number >= 0",
        id="env_dense_limit_negative",
    ),
    pytest.param(
        lambda tmp: ["env-var", "nan", *PLAN, "--mask", "sliding_window", "--left", "2"],
        r"FLEXATTN_ZOO_DENSE_LIMIT_MB must be a number >= 0 \(MiB\) or 'inf'",
        id="env_dense_limit_nan",
    ),
]


@pytest.mark.parametrize(("argv", "match"), CLI_ERRORS)
def test_cli_bad_input_names_the_option(
    argv: Callable[[Path], list[str]],
    match: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A table of bad command lines: exit 2, the option (or parameter, or variable) named, no
    traceback. ``["env-var", VALUE, ...]`` runs the rest with FLEXATTN_ZOO_DENSE_LIMIT_MB=VALUE."""
    args = argv(tmp_path)
    if args[0] == "env-var":
        monkeypatch.setenv("FLEXATTN_ZOO_DENSE_LIMIT_MB", args[1])
        args = args[2:]
    code = cli.main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert re.search(match, " ".join(err.split())), err


def test_cli_plan_with_dense_limit_inf(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FLEXATTN_ZOO_DENSE_LIMIT_MB", "inf")
    assert cli.main([*PLAN, "--mask", "sliding_window", "--left", "2", "--grad"]) == 0
    assert "route: dense" in capsys.readouterr().out


@pytest.mark.skipif(sys.platform == "win32", reason="memory accounting")
def test_show_at_ten_million_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    """Sampled picture, no BlockMask of 6e9 blocks (the old code allocated 6 GB and died)."""
    code = cli.main(["show", "causal", "--len", "10000000"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0
    assert "sampled at points of each cell" in out and "not built at this length" in out
