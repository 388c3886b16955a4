"""Bad inputs across the public API, the CLI and YAML configs: each one either raises a clear
``ValueError``/``TypeError`` naming the argument (and the valid choices), or works and matches
the float64 reference. Nothing may crash deep inside torch or return a silently wrong result.

Decisions pinned here (see ``fz.attention``'s docstring and docs/routes.md):

* strides never matter: transposed, sliced and expanded (stride-0) inputs work on every route;
* NaN propagates like SDPA: a NaN in query row ``i`` or in a key/value row ``i`` sees makes output
  row ``i`` NaN (nothing is checked on CUDA; ``flex_cpu``, whose kernel drops NaN, refuses it);
* ``PrefixLM(prefix_len >= Lkv)`` is allowed and means every key is visible;
* a zero-length query or key sequence gives zeros (lse ``-inf``), but a named route must still
  be able to serve the call.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.backends import BACKENDS
from flexattn_zoo.cli import app as cli
from flexattn_zoo.compile import CACHE as COMPILE_CACHE
from flexattn_zoo.config import load_yaml_spec
from flexattn_zoo.registry import MASKS
from flexattn_zoo.spec import MaskSpec, spec_dataclass
from flexattn_zoo.testing import assert_matches_reference, reference_attention

B, H, L, D = 2, 2, 8, 16


def _t(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(
        device=device, dtype=dtype
    )


Q = _t(B, H, L, D)


def attn(**kw: Any) -> Callable[[], Any]:
    """``fz.attention`` on (Q, Q, Q) with ``q=``/``k=``/``v=`` overrides and keyword arguments."""
    q, k, v = kw.pop("q", Q), kw.pop("k", Q), kw.pop("v", Q)
    return lambda: fz.attention(q, k, v, **kw)


def _register_dup_class() -> None:
    @MASKS.register(name="causal")
    @spec_dataclass
    class AnotherCausal(MaskSpec):
        pass


def _yaml(text: str) -> Callable[[], Any]:
    return lambda: load_yaml_spec(text)


DOC8 = torch.zeros(8, dtype=torch.int64)

ERRORS = [
    # -- q/k/v: ranks, sizes, dtypes, devices ------------------------------------------------
    pytest.param(attn(q=Q[0]), ValueError, r"q must have 4 dims \[B, H, L, D\]", id="rank3_q"),
    pytest.param(attn(k=Q[None]), ValueError, r"k must have 4 dims", id="rank5_k"),
    pytest.param(attn(q=[[1.0]]), TypeError, r"q must be a torch.Tensor", id="q_not_tensor"),
    pytest.param(
        attn(k=_t(3, H, L, D)), ValueError, r"batch size \(dim 0\) differs: q=2, k=3", id="batch_mismatch"
    ),
    pytest.param(
        attn(v=_t(B, 1, L, D)),
        ValueError,
        r"k and v must have the same number of heads",
        id="kv_heads_mismatch",
    ),
    pytest.param(
        attn(k=_t(B, 1, L, D), v=_t(B, 1, L, D)),
        ValueError,
        r"pass enable_gqa=True",
        id="heads_mismatch_no_gqa",
    ),
    pytest.param(
        attn(q=_t(B, 3, L, D), enable_gqa=True),
        ValueError,
        r"q heads \(3\) to be a multiple of k/v heads \(2\)",
        id="gqa_ratio_not_dividing",
    ),
    pytest.param(
        attn(k=_t(B, H, L, 32)), ValueError, r"q and k head dims \(dim 3\) differ", id="head_dim_mismatch"
    ),
    pytest.param(
        attn(v=_t(B, H, 5, D)), ValueError, r"k and v must have the same length", id="kv_length_mismatch"
    ),
    pytest.param(
        attn(v=_t(B, H, L, 32), backend="sdpa_flash"),  # auto runs it (sdpa_math, dense, flex)
        ValueError,
        r"value head dim 32 differs from q/k head dim 16",
        id="value_dim_mismatch",
    ),
    pytest.param(
        attn(q=Q[:, :0], k=Q[:, :0], v=Q[:, :0]),
        ValueError,
        r"heads and head dim must be positive",
        id="zero_heads",
    ),
    pytest.param(
        attn(q=Q.int(), k=Q.int(), v=Q.int()),
        TypeError,
        r"dtype torch.int32; supported: float16",
        id="int_dtype",
    ),
    pytest.param(
        attn(q=Q.to(torch.complex64), k=Q.to(torch.complex64), v=Q.to(torch.complex64)),
        TypeError,
        r"dtype torch.complex64; supported",
        id="complex_dtype",
    ),
    pytest.param(
        attn(q=Q.to(torch.float8_e4m3fn), k=Q.to(torch.float8_e4m3fn), v=Q.to(torch.float8_e4m3fn)),
        TypeError,
        r"dtype torch.float8_e4m3fn; supported",
        id="float8_dtype",
    ),
    pytest.param(
        attn(k=Q.double()),
        TypeError,
        r"share one dtype, got q=torch.float32, k=torch.float64",
        id="mixed_dtypes",
    ),
    pytest.param(
        attn(k=Q.to("meta")), ValueError, r"must be on one device, got q=cpu, k=meta", id="mixed_devices"
    ),
    pytest.param(
        attn(q=Q.to("meta"), k=Q.to("meta"), v=Q.to("meta")),
        ValueError,
        r"device 'meta'; flexattn_zoo runs on: cpu, cuda",
        id="unsupported_device",
    ),
    # -- scalar arguments ---------------------------------------------------------------------
    pytest.param(
        attn(scale=float("nan")),
        ValueError,
        r"scale must be None or a finite number, got nan",
        id="scale_nan",
    ),
    pytest.param(
        attn(scale=float("inf")), ValueError, r"scale must be None or a finite number", id="scale_inf"
    ),
    pytest.param(
        attn(scale="0.5"), TypeError, r"scale must be None or a finite real number .* got str", id="scale_str"
    ),
    pytest.param(attn(scale=True), TypeError, r"scale must be .* got bool", id="scale_bool"),
    pytest.param(attn(backend=1), TypeError, r"backend must be a str, got int", id="backend_int"),
    pytest.param(
        attn(backend="flax"),
        ValueError,
        r"unknown backend 'flax'; valid: auto, sdpa, sdpa_cudnn",
        id="backend_unknown",
    ),
    pytest.param(attn(return_lse=1), TypeError, r"return_lse must be a bool", id="return_lse_int"),
    pytest.param(attn(enable_gqa="yes"), TypeError, r"enable_gqa must be a bool", id="enable_gqa_str"),
    pytest.param(
        attn(deterministic="yes"), TypeError, r"deterministic must be a bool", id="deterministic_str"
    ),
    # -- mask= / score_mod= forms -------------------------------------------------------------
    pytest.param(attn(mask=3), TypeError, r"mask must be None, a mask spec .*got int", id="mask_wrong_type"),
    pytest.param(
        attn(mask=score_mods.SoftCap(cap=2.0)), TypeError, r"pass it as score_mod=", id="mask_is_score_spec"
    ),
    pytest.param(attn(score_mod=masks.Causal()), TypeError, r"pass it as mask=", id="score_is_mask_spec"),
    pytest.param(
        attn(mask="casual"),
        ValueError,
        r"unknown mask 'casual'; valid names: .*Did you mean 'causal'",
        id="mask_unknown_name",
    ),
    pytest.param(
        attn(score_mod="softcapp"),
        ValueError,
        r"unknown score_mod 'softcapp'.*softcap",
        id="score_unknown_name",
    ),
    pytest.param(
        attn(mask="sliding_window"),
        ValueError,
        r"mask 'sliding_window' needs parameter\(s\): left",
        id="mask_name_needs_params",
    ),
    pytest.param(
        attn(mask=lambda q_idx, kv_idx: q_idx >= kv_idx),
        TypeError,
        r"mask_mod signature \(b, h, q_idx, kv_idx\)",
        id="mask_fn_wrong_signature",
    ),
    pytest.param(
        attn(mask=lambda b, h, q, kv: q - kv),
        TypeError,
        r"must return a bool tensor .* got torch.int32",
        id="mask_fn_not_bool",
    ),
    pytest.param(
        attn(mask=lambda b, h, q, kv: (q >= kv) if q > 2 else (q < kv)),
        TypeError,
        r"data-dependent Python control flow .* which flex rejects too",
        id="mask_fn_python_if",
    ),
    pytest.param(
        attn(mask=lambda b, h, q, kv: 1 / 0),
        TypeError,
        r"mask callable failed .*ZeroDivisionError",
        id="mask_fn_raises",
    ),
    pytest.param(
        attn(score_mod=lambda s: s),
        TypeError,
        r"score_mod signature \(score, b, h, q_idx, kv_idx\)",
        id="score_fn_wrong_signature",
    ),
    pytest.param(
        attn(score_mod=lambda s, b, h, q, kv: q - kv),
        TypeError,
        r"floating tensor .* got torch.int32",
        id="score_fn_not_float",
    ),
    # -- spec parameters that do not fit the problem ------------------------------------------
    pytest.param(
        attn(mask=masks.Document(doc_ids=DOC8[:4])),
        ValueError,
        r"has length 4 but .* max\(Lq, Lkv\) = 8",
        id="doc_ids_too_short",
    ),
    pytest.param(
        attn(mask=masks.Document(doc_ids=torch.zeros(3, 8, dtype=torch.int64))),
        ValueError,
        r"has 3 rows but the batch size is 2",
        id="doc_ids_rows_vs_batch",
    ),
    pytest.param(
        attn(mask=masks.PrefixLM(prefix_len=torch.tensor([1, 2, 3]))),
        ValueError,
        r"tensor has 3 entries but the batch size is 2",
        id="prefix_len_tensor_vs_batch",
    ),
    pytest.param(
        attn(score_mod=score_mods.Alibi(num_heads=4)),
        ValueError,
        r"Alibi\(num_heads=4\) used on a problem with 2 query heads",
        id="alibi_heads_mismatch",
    ),
    pytest.param(
        attn(mask=fz.block_mask("causal", 16, 16)),
        ValueError,
        r"BlockMask was built for lengths \(16, 16\)",
        id="block_mask_lengths",
    ),
    pytest.param(
        attn(mask=fz.block_mask(masks.Document(doc_ids=torch.zeros(3, 8, dtype=torch.int64)), 8, 8, batch=3)),
        ValueError,
        r"BlockMask has batch/heads 3/1; need 1 or 2",
        id="block_mask_batch",
    ),
    # -- explicit backends that cannot serve the call -----------------------------------------
    pytest.param(
        attn(mask=masks.SlidingWindow(left=2), backend="sdpa_math"),
        ValueError,
        r"backend 'sdpa_math' cannot run this call: mask SlidingWindow has no exact SDPA form",
        id="sdpa_math_window",
    ),
    pytest.param(
        attn(score_mod=score_mods.SoftCap(cap=2.0), backend="sdpa_flash"),
        ValueError,
        r"cannot apply (a )?score_mod",
        id="sdpa_flash_score",
    ),
    pytest.param(
        attn(backend="flex"),
        ValueError,
        r"backend 'flex' cannot run this call: runs on cuda, not cpu",
        id="flex_on_cpu",
    ),
    pytest.param(
        attn(backend="varlen"),
        ValueError,
        r"backend 'varlen' cannot run.*runs on cuda, not cpu",
        id="varlen_on_cpu",
    ),
    pytest.param(
        attn(backend="flex_flash"), ValueError, r"backend 'flex_flash' cannot run", id="flex_flash_on_cpu"
    ),
    pytest.param(
        attn(q=Q.clone().requires_grad_(), backend="flex_cpu"),
        ValueError,
        r"has no backward",
        id="flex_cpu_grad",
    ),
    pytest.param(
        attn(backend="flex_cpu", return_lse=True), ValueError, r"cannot return lse", id="flex_cpu_lse"
    ),
    # (backend="dense" with a BlockMask now runs it exactly: tests/unit/test_adversarial_entry.py)
    pytest.param(
        attn(q=Q.clone().index_fill_(2, torch.tensor([3]), float("nan")), backend="flex_cpu"),
        ValueError,
        r"q/k/v hold NaN or inf",
        id="flex_cpu_nan",
    ),
    pytest.param(
        attn(k=Q[:, :, :0], v=Q[:, :, :0], backend="flex"),
        ValueError,
        r"runs on cuda, not cpu",
        id="zero_length_named_route",
    ),
    # -- spec constructors --------------------------------------------------------------------
    pytest.param(
        lambda: masks.SlidingWindow(left=-1),
        ValueError,
        r"SlidingWindow\(left=...\) must be an int >= 0",
        id="window_left_negative",
    ),
    pytest.param(
        lambda: masks.SlidingWindow(left=1, right=-5),
        ValueError,
        r"SlidingWindow\(right=...\) must be an int >= 0",
        id="window_right_negative",
    ),
    pytest.param(
        lambda: masks.SlidingWindow(left=2.5),
        TypeError,
        r"SlidingWindow\(left=...\) must be an int",
        id="window_float",
    ),
    pytest.param(
        lambda: masks.SlidingWindow.from_hf(0),
        ValueError,
        r"from_hf\(sliding_window=...\) must be an int >= 1",
        id="window_hf_zero",
    ),
    pytest.param(
        lambda: masks.Chunked(size=0), ValueError, r"Chunked\(size=...\) must be an int >= 1", id="chunk_zero"
    ),
    pytest.param(
        lambda: masks.Chunked(size=-4),
        ValueError,
        r"Chunked\(size=...\) must be an int >= 1",
        id="chunk_negative",
    ),
    pytest.param(
        lambda: score_mods.SoftCap(cap=0),
        ValueError,
        r"SoftCap\(cap=...\) must be finite and > 0",
        id="cap_zero",
    ),
    pytest.param(
        lambda: score_mods.SoftCap(cap=-3.0),
        ValueError,
        r"SoftCap\(cap=...\) must be finite and > 0",
        id="cap_negative",
    ),
    pytest.param(lambda: score_mods.SoftCap(cap=float("nan")), ValueError, r"must be finite", id="cap_nan"),
    pytest.param(
        lambda: score_mods.SoftCap(cap="30"),
        TypeError,
        r"SoftCap\(cap=...\) must be a real number",
        id="cap_str",
    ),
    pytest.param(
        lambda: masks.PrefixLM(prefix_len=-1),
        ValueError,
        r"PrefixLM\(prefix_len=...\) must be an int >= 0",
        id="prefix_negative",
    ),
    pytest.param(
        lambda: masks.PrefixLM(prefix_len=1.5), TypeError, r"PrefixLM\(prefix_len=...\)", id="prefix_float"
    ),
    pytest.param(
        lambda: masks.Causal(align="middle"),
        ValueError,
        r"one of 'top_left', 'bottom_right'",
        id="causal_bad_align",
    ),
    pytest.param(
        lambda: masks.Document(doc_ids=torch.zeros(8)),
        TypeError,
        r"integer tensor .* got dtype torch.float32",
        id="doc_ids_float",
    ),
    pytest.param(
        lambda: masks.Document(doc_ids=torch.zeros(1, 2, 3, dtype=torch.int64)),
        ValueError,
        r"shape \[L\] or \[B, L\]",
        id="doc_ids_3d",
    ),
    pytest.param(
        lambda: masks.Document.from_lengths([3, -1]),
        ValueError,
        r"from_lengths\(lengths=...\) must be >= 0",
        id="doc_lengths_negative",
    ),
    pytest.param(
        lambda: score_mods.Alibi(num_heads=0),
        ValueError,
        r"Alibi\(num_heads=...\) must be >= 1",
        id="alibi_zero_heads",
    ),
    pytest.param(
        lambda: score_mods.Alibi(num_heads=2, slopes=[1.0]),
        ValueError,
        r"needs num_heads=2 values, got 1",
        id="alibi_slopes_len",
    ),
    pytest.param(
        lambda: fz.Chain(mods=()), ValueError, r"Chain\(mods=...\) needs at least one", id="chain_empty"
    ),
    pytest.param(
        lambda: masks.Causal() & score_mods.SoftCap(cap=1.0),
        TypeError,
        r"mask & expects another mask spec",
        id="mask_and_score",
    ),
    pytest.param(
        lambda: score_mods.SoftCap(cap=1.0) >> masks.Causal(),
        TypeError,
        r"score >> expects another score spec",
        id="score_chain_mask",
    ),
    # -- registry -----------------------------------------------------------------------------
    pytest.param(
        lambda: masks.get("casual"),
        ValueError,
        r"unknown mask 'casual'; valid names: .*causal",
        id="registry_unknown",
    ),
    pytest.param(
        lambda: masks.get(3), TypeError, r"mask name must be a str, got int", id="registry_name_not_str"
    ),
    pytest.param(
        lambda: masks.get("sliding_window", lefft=3),
        ValueError,
        r"unknown parameter\(s\) 'lefft'; valid parameters: left, right",
        id="registry_unknown_param",
    ),
    pytest.param(
        lambda: masks.register_function("causal", lambda b, h, q, kv: q >= kv),
        ValueError,
        r"'causal' is already registered",
        id="registry_duplicate_function",
    ),
    pytest.param(
        _register_dup_class, ValueError, r"'causal' is already registered", id="registry_duplicate_class"
    ),
    pytest.param(
        lambda: masks.register_function("BadName", lambda b, h, q, kv: q >= kv),
        ValueError,
        r"snake_case",
        id="registry_bad_name",
    ),
    pytest.param(
        lambda: masks.register(int),
        TypeError,
        r"register expects a subclass of MaskSpec",
        id="registry_not_a_spec",
    ),
    pytest.param(
        lambda: masks.register_function("not_callable", 3),
        TypeError,
        r"must be callable, got int",
        id="registry_not_callable",
    ),
    # -- fz.block_mask ------------------------------------------------------------------------
    pytest.param(
        lambda: fz.block_mask(None, 8, 8), ValueError, r"spec must be a mask spec", id="block_mask_none"
    ),
    pytest.param(
        lambda: fz.block_mask("causal", -1, 8),
        ValueError,
        r"q_len must be a positive int, got -1",
        id="block_mask_negative_len",
    ),
    pytest.param(
        lambda: fz.block_mask("causal", 8.0, 8),
        ValueError,
        r"q_len must be a positive int",
        id="block_mask_float_len",
    ),
    pytest.param(
        lambda: fz.block_mask("causal", 8, 8, block_size=17),
        ValueError,
        r"block_size must be a positive multiple of 16",
        id="block_mask_block_size",
    ),
    pytest.param(
        lambda: fz.block_mask(masks.Document(doc_ids=torch.zeros(2, 8, dtype=torch.int64)), 8, 8),
        ValueError,
        r"depends on the batch index: pass batch=",
        id="block_mask_needs_batch",
    ),
    pytest.param(
        lambda: fz.block_mask("causal", 8, 8, device="nope"),
        ValueError,
        r"device must be a torch.device or a string",
        id="block_mask_bad_device",
    ),
    pytest.param(
        lambda: fz.block_mask("causal", 8, 8, device="meta"),
        ValueError,
        r"device 'meta' has no attention route",
        id="block_mask_meta",
    ),
    pytest.param(
        lambda: fz.block_mask(score_mods.SoftCap(cap=1.0), 8, 8),
        TypeError,
        r"pass it as score_mod=",
        id="block_mask_score_spec",
    ),
    # -- the reference ------------------------------------------------------------------------
    pytest.param(
        lambda: reference_attention(Q[0], Q, Q), ValueError, r"q must have 4 dims", id="reference_rank"
    ),
    pytest.param(
        lambda: reference_attention(Q.long(), Q.long(), Q.long()),
        TypeError,
        r"supported: float16",
        id="reference_dtype",
    ),
    pytest.param(
        lambda: reference_attention(_t(B, 3, L, D), Q, Q, enable_gqa=True),
        ValueError,
        r"multiple of k/v heads",
        id="reference_gqa",
    ),
    pytest.param(
        lambda: reference_attention(Q, Q, Q, enable_gqa=1),
        TypeError,
        r"enable_gqa must be a bool",
        id="reference_gqa_type",
    ),
    pytest.param(
        lambda: reference_attention(Q, Q, Q, mask="casual"),
        ValueError,
        r"unknown mask 'casual'",
        id="reference_unknown_mask",
    ),
    pytest.param(
        lambda: reference_attention(Q, Q.to("meta"), Q),
        ValueError,
        r"must be on one device",
        id="reference_devices",
    ),
    # -- YAML ---------------------------------------------------------------------------------
    pytest.param(_yaml("mask: {name: causal\n"), ValueError, r"malformed YAML config", id="yaml_malformed"),
    pytest.param(
        _yaml("masks: {name: causal}\n"),
        ValueError,
        r"unknown YAML key\(s\) \['masks'\]; valid keys: mask, score_mod",
        id="yaml_unknown_key",
    ),
    pytest.param(
        _yaml("mask: {name: causal, foo: 1}\n"),
        ValueError,
        r"got unknown parameter\(s\) 'foo'; valid parameters: align",
        id="yaml_unknown_param",
    ),
    pytest.param(
        _yaml("mask: {name: sliding_window, left: -3}\n"),
        ValueError,
        r"mask: SlidingWindow\(left=...\) must be an int >= 0",
        id="yaml_bad_value",
    ),
    pytest.param(_yaml("mask: {left: 3}\n"), ValueError, r"needs a 'name' key", id="yaml_missing_name"),
    pytest.param(_yaml("- causal\n"), ValueError, r"must be a mapping with keys", id="yaml_not_mapping"),
    pytest.param(_yaml("mask: 3\n"), ValueError, r"mask must be a mapping like", id="yaml_entry_not_mapping"),
    pytest.param(_yaml("mask: []\n"), ValueError, r"mask: an empty list", id="yaml_empty_list"),
    pytest.param(
        _yaml("score_mod: {name: softcapp}\n"),
        ValueError,
        r"unknown score_mod 'softcapp'",
        id="yaml_unknown_name",
    ),
    pytest.param(_yaml("/nonexistent/attn.yaml"), ValueError, r"does not exist", id="yaml_missing_file"),
]


@pytest.mark.parametrize(("call", "exc", "match"), ERRORS)
def test_bad_input_raises_clear_error(call: Callable[[], Any], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        call()


def test_plan_rejects_the_same_inputs() -> None:
    with pytest.raises(ValueError, match=r"multiple of k/v heads"):
        fz.plan(_t(B, 3, L, D), Q, Q, enable_gqa=True)
    with pytest.raises(TypeError, match=r"deterministic must be a bool"):
        fz.plan(Q, Q, Q, deterministic=1)
    with pytest.raises(TypeError, match=r"scale must be"):
        fz.plan(Q, Q, Q, scale="x")


# -- CLI: exit code 2 and the message, no traceback ---------------------------------------------

PLAN = ["plan", "--len", "8", "--heads", "2", "--dim", "16", "--dtype", "fp32", "--arch", "cpu"]


def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "attn.yaml"
    path.write_text(text)
    return str(path)


CLI_CASES = [
    pytest.param(
        lambda tmp: [*PLAN, "--mask", "casual"],
        r"unknown mask 'casual'.*Did you mean 'causal'",
        id="cli_unknown_mask",
    ),
    pytest.param(
        lambda tmp: ["show", "casual", "--len", "8"],
        r"unknown mask or score_mod 'casual'",
        id="cli_show_unknown",
    ),
    pytest.param(
        lambda tmp: [*PLAN, "--mask", "causal", "--dtype", "int8"],
        r"unknown dtype 'int8'; choose from bf16, fp16",
        id="cli_bad_dtype",
    ),
    pytest.param(
        lambda tmp: [*PLAN, "--mask", "causal", "--arch", "h100"],
        r"--arch must look like 'sm80'",
        id="cli_bad_arch",
    ),
    pytest.param(
        lambda tmp: [*PLAN, "--mask", "causal", "--arch", "sm9"],
        r"--arch must look like 'sm80'.* got 'sm9'",
        id="cli_one_digit_arch",
    ),
    pytest.param(
        lambda tmp: [*PLAN, "--mask", "causal", "--len", "-8"],
        r"--len: expected a positive integer, got -8",
        id="cli_negative_len",
    ),
    pytest.param(
        lambda tmp: [*PLAN, "--mask", "causal", "--dim", "0"],
        r"--dim: expected a positive integer",
        id="cli_zero_dim",
    ),
    pytest.param(
        lambda tmp: [*PLAN, "--mask", "causal", "--heads", "5,2"],
        r"q heads \(5\) must be a multiple of k/v heads \(2\)",
        id="cli_gqa_ratio",
    ),
    pytest.param(
        lambda tmp: [*PLAN, "--mask", "sliding_window", "--left", "-2"],
        r"SlidingWindow\(left=...\) must be an int >= 0",
        id="cli_bad_value",
    ),
    pytest.param(
        lambda tmp: [*PLAN, "--mask", "sliding_window", "--lefft", "3"],
        r"unknown parameter --lefft .*Did you mean --left",
        id="cli_unknown_param",
    ),
    pytest.param(
        lambda tmp: [*PLAN, "--config", _config(tmp, "mask: {name: causal\n")],
        r"malformed YAML config",
        id="cli_config_malformed",
    ),
    pytest.param(
        lambda tmp: [*PLAN, "--config", _config(tmp, "mask: {name: causal}\nscore: 1\n")],
        r"unknown YAML key\(s\) \['score'\]",
        id="cli_config_unknown_key",
    ),
    pytest.param(
        lambda tmp: [*PLAN, "--config", "/nonexistent/attn.yaml"], r"does not exist", id="cli_config_missing"
    ),
]


@pytest.mark.parametrize(("argv", "match"), CLI_CASES)
def test_cli_bad_input_exits_2(
    argv: Callable[[Path], list[str]], match: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(argv(tmp_path))
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert re.search(match, " ".join(err.split())), err


# -- inputs that must work ----------------------------------------------------------------------

#: Every registered CPU route but sdpa_split, which needs a split-form mask (e.g. PrefixLM) where
#: these tests use causal; tests/unit/test_split.py covers its layouts and empty inputs.
CPU_ROUTES = [b.name for b in BACKENDS if "cpu" in b.devices and b.name != "sdpa_split"]


def _strided(kind: str, n: int, g: torch.Generator, grad: bool) -> torch.Tensor:
    """A ``[B, H, n, D]`` view with unusual strides of a fresh leaf (which may require grad)."""
    base_shape, view = {
        "blhd_transposed": ((B, n, H, D), lambda t: t.transpose(1, 2)),
        "last_dim_sliced": ((B, H, n, 2 * D), lambda t: t[..., ::2]),
        "expanded_batch": ((1, H, n, D), lambda t: t.expand(B, H, n, D)),
        "expanded_heads": ((B, 1, n, D), lambda t: t.expand(B, H, n, D)),
        "last_dim_transposed": ((B, H, D, n), lambda t: t.transpose(-1, -2)),
    }[kind]
    return view(torch.randn(base_shape, generator=g).requires_grad_(grad))


LAYOUTS = [
    ("blhd_transposed",) * 3,
    ("last_dim_sliced",) * 3,
    ("expanded_batch",) * 3,
    ("expanded_heads",) * 3,
    ("last_dim_transposed",) * 3,
    ("blhd_transposed", "expanded_heads", "last_dim_sliced"),  # one of each kind in a call
]


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_strided_inputs_work_on_every_cpu_route(route: str) -> None:
    g = torch.Generator().manual_seed(0)
    grad = route != "flex_cpu"  # torch has no CPU flex backward
    before = COMPILE_CACHE.total_compiles()
    for kinds in LAYOUTS:
        q, k, v = (_strided(kind, 40, g, grad) for kind in kinds)
        out = fz.attention(q, k, v, mask="causal", backend=route)
        if grad:
            grad_out = torch.randn(out.shape, generator=g)
            grads = torch.autograd.grad(out, (q, k, v), grad_out)
            assert_matches_reference(out, q, k, v, mask="causal", grads=grads, grad_out=grad_out)
        else:
            assert_matches_reference(out, q, k, v, mask="causal")
    if route == "flex_cpu":
        # Layouts are canonicalized (all contiguous, or all [B, L, H, D]-transposed) before
        # compiling: six stride patterns cost at most two graphs, not six of Dynamo's eight slots.
        assert COMPILE_CACHE.total_compiles() - before <= 2


@pytest.mark.parametrize("route", CPU_ROUTES)
@pytest.mark.parametrize(("lq", "lkv"), [(0, 8), (8, 0), (0, 0)])
def test_zero_length_sequences(route: str, lq: int, lkv: int) -> None:
    grad = route != "flex_cpu"
    q = _t(B, H, lq, D).requires_grad_(grad)
    k, v = _t(B, 1, lkv, D).requires_grad_(grad), _t(B, 1, lkv, D).requires_grad_(grad)
    mask = None if route.startswith("sdpa") else "causal"  # SDPA has no causal form for Lq != Lkv
    res = fz.attention(q, k, v, mask=mask, enable_gqa=True, backend=route, return_lse=route == "dense")
    out, lse = res if route == "dense" else (res, None)
    assert out.shape == (B, H, lq, D) and torch.equal(out, torch.zeros_like(out))
    if lse is not None:
        assert lse.shape == (B, H, lq) and bool(torch.isneginf(lse).all())
    if grad:
        dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
        assert all(g is None or not bool(g.any()) for g in (dq, dk, dv))


# NaN: routes that read q/k/v in a mask-agnostic way; flex_cpu refuses (see ERRORS above) and auto
# falls back from it to a route that propagates.
NAN_ROUTES = ["dense", "sdpa_math", "sdpa_flash", "auto"]


@pytest.mark.parametrize("route", NAN_ROUTES)
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_propagates_to_the_rows_that_see_it(route: str, where: str) -> None:
    q, k, v = _t(B, H, 24, D), _t(B, H, 24, D) * 1.5, _t(B, H, 24, D) - 0.5
    pos = 10
    {"q": q, "k": k, "v": v}[where][1, 0, pos, 3] = float("nan")
    mask = masks.SlidingWindow(left=4) if route in ("dense", "auto") else masks.Causal()
    if route == "auto":
        assert fz.plan(q, k, v, mask=mask).backend != "flex_cpu"  # flex_cpu would drop the NaN
    out = fz.attention(q, k, v, mask=mask, backend=route)
    rows_nan = torch.isnan(out[1, 0]).any(dim=-1)  # a NaN in v reaches only its own column
    if where == "q":
        sees = torch.arange(24) == pos
    else:
        sees = mask.dense(24, 24)[0, 0, :, pos]
    # Every row that sees the NaN is NaN; rows that do not may be NaN too on dense routes (0 * NaN
    # in probabilities @ values), which the contract leaves open -- except for a NaN query row.
    assert bool(rows_nan[sees].all())
    if where == "q":
        assert int(rows_nan.sum()) == 1
    # Other batch rows and heads never see it.
    assert bool(torch.isfinite(out[0]).all()) and bool(torch.isfinite(out[1, 1]).all())


def test_prefix_len_past_the_sequence_means_everything_visible() -> None:
    q, k, v = _t(B, H, L, D), _t(B, H, 12, D), _t(B, H, 12, D)
    for spec in (masks.PrefixLM(prefix_len=100), masks.PrefixLM(prefix_len=torch.tensor([100, 12]))):
        out = fz.attention(q, k, v, mask=spec)
        torch.testing.assert_close(out, fz.attention(q, k, v), rtol=1e-5, atol=1e-6)
        assert_matches_reference(out, q, k, v, mask=spec)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_nonfinite_check_is_exact(dtype: torch.dtype) -> None:
    """The CPU check flags every NaN/inf and never the largest finite values (whose sum would
    overflow in their own dtype)."""
    from flexattn_zoo.validation import inputs_nonfinite

    q = torch.randn(1, 2, 16, 8).to(dtype)
    big = torch.full_like(q, torch.finfo(dtype).max)
    assert not inputs_nonfinite(q, q, q) and not inputs_nonfinite(big, big, -big)
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = q.clone()
        x[0, 1, 3, 2] = bad
        assert inputs_nonfinite(q, q, x) and inputs_nonfinite(x, q, q)
    both = q.clone()
    both[0, 0, 0, :2] = torch.tensor([float("inf"), -float("inf")])
    assert inputs_nonfinite(both, q, q)


def _drawn_qkv(draw: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # type: ignore[type-arg]
    """q, k, v with the drawn batch sizes, head counts, lengths, head dims, dtypes and layout."""
    q = torch.zeros(draw["b"], draw["hq"], 1, draw["dq"], dtype=draw["q_dtype"])
    k = torch.zeros(draw["b"], draw["hk"], 6, draw["dk"], dtype=draw["k_dtype"])
    v = torch.zeros(draw["bv"], draw["hv"], draw["lv"], draw["dv"], dtype=draw["v_dtype"])
    if draw["rank3"]:
        q = q[0]
    if draw["sparse"]:
        k = k.to_sparse()
    return q, k, v


def test_the_quick_qkv_check_accepts_only_what_check_qkv_accepts() -> None:
    """``validation.qkv_acceptable`` (a decode step's check, a few comparisons) must never pass
    what ``check_qkv`` refuses -- else a bad call would reach a kernel unchecked -- and must pass
    the valid calls it is there for."""
    from flexattn_zoo.validation import check_qkv, qkv_acceptable

    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.int32]
    g = torch.Generator().manual_seed(0)
    passed = refused = 0
    for _ in range(800):
        pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
        dtype = pick(dtypes[:3])
        hk = pick([1, 2, 4])
        b = pick([1, 2])
        draw = {
            "b": b,
            "bv": b,
            "hq": 4,
            "hk": hk,
            "hv": hk,
            "lv": 6,
            "dq": 16,
            "dk": 16,
            "dv": pick([8, 16]),
        }
        draw.update(q_dtype=dtype, k_dtype=dtype, v_dtype=dtype, sparse=False, rank3=False)
        fields = [
            "hq",
            "hk",
            "hv",
            "bv",
            "lv",
            "dq",
            "dk",
            "q_dtype",
            "k_dtype",
            "v_dtype",
            "sparse",
            "rank3",
        ]
        field = pick([None, None, None, *fields])
        if field is not None:  # one thing off (or not: some draws land on valid values)
            options = {
                "hq": [0, 2, 6],
                "hk": [0, 3],
                "hv": [1, 3],
                "bv": [3],
                "lv": [5],
                "dq": [0, 8],
                "dk": [8, 24],
                "sparse": [True],
                "rank3": [True],
            }.get(field, dtypes)
            draw[field] = pick(options)
        gqa = pick([True, True, False, 1, None])
        q, k, v = _drawn_qkv(draw)
        if qkv_acceptable(q, k, v, gqa):
            passed += 1
            check_qkv(q, k, v, enable_gqa=gqa)  # type: ignore[arg-type]
        else:
            refused += 1
    assert passed > 50 and refused > 50  # both sides were exercised


def test_the_quick_qkv_check_refuses_tensors_on_different_devices() -> None:
    """``qkv_acceptable`` compares devices by the tensors' type flags where it can: any tensor on
    another device than the others (here ``meta``) is still refused, as ``check_qkv`` refuses it."""
    from flexattn_zoo.validation import check_qkv, qkv_acceptable

    x = torch.zeros(1, 2, 4, 8)
    m = torch.zeros(1, 2, 4, 8, device="meta")
    assert qkv_acceptable(x, x, x, False)
    for q, k, v in ((x, m, x), (x, x, m), (m, x, x), (m, m, x), (x, m, m)):
        assert not qkv_acceptable(q, k, v, False), (q.device, k.device, v.device)
        with pytest.raises(ValueError, match="one device"):
            check_qkv(q, k, v, enable_gqa=False)


def test_a_learned_tensor_on_another_device_than_q_is_refused() -> None:
    """A route would run on a copy of it on q's device, made once, which the optimizer's updates
    of the caller's tensor never reach: refused, naming the argument and both devices. A tensor
    that does not require grad (an immutable snapshot) is copied."""
    q = torch.randn(1, 2, 8, 16)
    learned = torch.nn.Parameter(torch.empty(8, 8, device="meta"))
    with pytest.raises(ValueError, match=r"score_mod: Bias holds a learned tensor .* on meta, q is on cpu"):
        fz.attention(q, q, q, score_mod=learned)
    with pytest.raises(ValueError, match="learned tensor"):
        fz.Attention(score_mod=learned)(q, q, q)
    assert fz.attention(q, q, q, score_mod=torch.nn.Parameter(torch.randn(8, 8))).shape == q.shape
