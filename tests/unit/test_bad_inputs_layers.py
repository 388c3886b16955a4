"""Bad inputs to the layer and preset entry points (``fz.Attention``, ``fz.layers``,
``fz.presets``), to ``fz.block_mask``'s device and strided nested q/k/v: each raises a clear
``ValueError``/``TypeError`` naming the argument, never an AttributeError, ZeroDivisionError or
a torch error from inside the library."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import flexattn_zoo as fz

B, H, L, D = 1, 2, 8, 16
Q = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(0))


def _nested() -> torch.Tensor:
    # A strided (not jagged) nested tensor is a plain torch.Tensor whose .shape raises. torch warns
    # once per process that the API is a prototype.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.randn(H, L, D)] * B)


def _layer(**kw: Any) -> Callable[..., Any]:
    return lambda *qkv: fz.Attention(mask="causal", **kw)(*qkv)


ERRORS = [
    # q/k/v that are not tensors, or strided nested tensors, reach check_qkv's message
    pytest.param(lambda: _layer()([[1.0]], Q, Q), TypeError, r"q must be a torch.Tensor", id="layer_q_list"),
    pytest.param(lambda: _layer()(Q, [[1.0]], Q), TypeError, r"k must be a torch.Tensor", id="layer_k_list"),
    pytest.param(
        lambda: _layer(sinks=True, num_heads=H)([[1.0]], Q, Q),
        TypeError,
        r"q must be a torch.Tensor",
        id="layer_sinks_q_list",
    ),
    pytest.param(
        lambda: _layer(sinks=True, num_heads=H)(Q[0], Q, Q),
        ValueError,
        r"q must have 4 dims",
        id="layer_sinks_q_3d",
    ),
    pytest.param(
        lambda: fz.layers.attention_layer([[1.0]], Q, Q, mask="causal"),
        TypeError,
        r"q must be a torch.Tensor",
        id="attention_layer_q_list",
    ),
    pytest.param(
        lambda: fz.attention(_nested(), Q, Q), TypeError, r"q must be a dense", id="attention_q_nested"
    ),
    pytest.param(
        lambda: fz.attention(Q, Q, _nested()), TypeError, r"v must be a dense", id="attention_v_nested"
    ),
    pytest.param(lambda: _layer()(_nested(), Q, Q), TypeError, r"q must be a dense", id="layer_q_nested"),
    pytest.param(
        lambda: fz.layers.attention_layer(_nested(), Q, Q, mask="causal"),
        TypeError,
        r"q must be a dense",
        id="attention_layer_q_nested",
    ),
    # num_heads
    *(
        pytest.param(
            lambda heads=heads: fz.Attention(mask="causal", sinks=True, num_heads=heads),
            exc,
            r"Attention\(num_heads=...\) must be an int >= 1",
            id=f"attention_num_heads_{name}",
        )
        for name, heads, exc in (
            ("zero", 0, ValueError),
            ("negative", -1, ValueError),
            ("bool", True, TypeError),
            ("float", 2.0, TypeError),
        )
    ),
    # sinks given as a tensor: refused when the layer is built, not at its first call
    pytest.param(
        lambda: fz.Attention(mask="causal", sinks=torch.zeros(H, dtype=torch.long)),
        TypeError,
        r"sinks must be a floating tensor \[H\].*torch.int64",
        id="attention_sinks_int",
    ),
    pytest.param(
        lambda: fz.Attention(mask="causal", sinks=torch.zeros(1, H)),
        TypeError,
        r"sinks must be a floating tensor \[H\].*shape \(1, \d+\)",
        id="attention_sinks_2d",
    ),
    pytest.param(
        lambda: fz.Attention(mask="causal", sinks=torch.zeros(H + 1), num_heads=H),
        ValueError,
        r"sinks has \d+ entries but num_heads=",
        id="attention_sinks_vs_num_heads",
    ),
    pytest.param(
        lambda: fz.presets.get("gpt_oss", num_heads=0),
        ValueError,
        r"presets.get\('gpt_oss', num_heads=...\) must be an int >= 1",
        id="preset_num_heads_zero",
    ),
    # a preset's layer period and Gemma's query_pre_attn_scalar
    *(
        pytest.param(
            lambda name=name, every=every: fz.presets.get(name, layer=1, every=every),
            exc,
            rf"presets.get\('{name}', every=...\) must be an int >= 1",
            id=f"{name}_every_{label}",
        )
        for name in ("gemma3", "llama4", "modernbert")
        for label, every, exc in (
            ("zero", 0, ValueError),
            ("negative", -2, ValueError),
            ("bool", True, TypeError),
        )
    ),
    *(
        pytest.param(
            lambda name=name, value=value: fz.presets.get(name, query_pre_attn_scalar=value),
            exc,
            rf"presets.get\('{name}', query_pre_attn_scalar=...\) must be a finite number > 0",
            id=f"{name}_query_pre_attn_scalar_{label}",
        )
        for name in ("gemma2", "gemma3")
        for label, value, exc in (
            ("zero", 0, ValueError),
            ("negative", -1.0, ValueError),
            ("nan", float("nan"), ValueError),
            ("str", "256", TypeError),
        )
    ),
]


@pytest.mark.parametrize(("call", "exc", "match"), ERRORS)
def test_bad_input_raises_clear_error(call: Callable[[], Any], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0)])
def test_block_mask_on_an_absent_cuda_device_is_a_value_error(device: Any) -> None:
    # torch's own refusal is an AssertionError ("Torch not compiled with CUDA enabled")
    with pytest.raises(ValueError, match=r"device 'cuda(:\d)?' is not available .*use 'cpu'"):
        fz.block_mask("causal", 32, 32, device=device)


def test_valid_preset_parameters_still_work() -> None:
    assert fz.presets.get("gemma2", query_pre_attn_scalar=144).scale == pytest.approx(1 / 12)
    assert fz.presets.get("gemma3", layer=2, every=3).kind == "global"
    assert fz.presets.get("llama4", layer=0, every=1).kind == "global"
    layer = fz.Attention(mask="causal", sinks=True, num_heads=H)
    assert layer(Q, Q, Q).shape == Q.shape


def test_numpy_integer_counts_are_counts() -> None:
    # A config read with numpy gives numpy integers: they are counts like Python ints (bool is not).
    np = pytest.importorskip("numpy")
    layer = fz.Attention(mask="causal", sinks=True, num_heads=np.int64(H))
    assert layer(Q, Q, Q).shape == Q.shape
    assert fz.presets.get("gemma3", layer=0, every=np.int32(6)) is not None
    with pytest.raises(TypeError, match=r"num_heads=...\) must be an int >= 1"):
        fz.Attention(mask="causal", num_heads=np.bool_(True))
