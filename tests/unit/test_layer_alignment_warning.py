"""fz.Attention warns (once) when its own top-left aligned mask meets fewer queries than keys."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo.masks.padding import KeyPadding

H = 2
TOP_LEFT = "top-left aligned"


def _qkv(lq: int, lkv: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return (
        torch.randn(batch, H, lq, 8, generator=g),
        torch.randn(batch, H, lkv, 8, generator=g),
        torch.randn(batch, H, lkv, 8, generator=g),
    )


def _top_left_warnings(call: Any) -> list[warnings.WarningMessage]:
    """The alignment warnings ``call()`` gives, every one recorded (no filter dedup)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [w for w in caught if issubclass(w.category, UserWarning) and TOP_LEFT in str(w.message)]


@pytest.mark.parametrize(("name", "layer"), [("gemma2", 1), ("grok1", 0), ("mistral_7b", 0), ("llama4", 0)])
def test_a_top_left_preset_warns_once_per_lengths(name: str, layer: int) -> None:
    attn = fz.Attention(name, layer=layer, num_heads=H)
    q, k, v = _qkv(3, 8)
    first = _top_left_warnings(lambda: attn(q, k, v))
    assert len(first) == 1
    message = str(first[0].message)
    assert message.startswith("fz.Attention: this layer's mask (")
    assert repr(attn.mask) in message
    assert "Lq=3 < Lkv=8" in message
    assert "sees 3 keys (0..2), where a cache step would let it see 8 keys (0..7)" in message
    assert "fz.decode.decode_step" in message and "align='bottom_right'" in message
    assert first[0].filename == __file__  # names the caller's line, not the library's
    assert _top_left_warnings(lambda: attn(q, k, v)) == []  # same shapes: said once


def test_a_window_shorter_than_the_cache_names_the_keys() -> None:
    attn = fz.Attention(mask=masks.SlidingWindow(left=2, right=0))
    (w,) = _top_left_warnings(lambda: attn(*_qkv(3, 8)))
    assert "sees 3 keys (0..2), where a cache step would let it see 3 keys (5..7)" in str(w.message)


@pytest.mark.parametrize(("lq", "lkv"), [(8, 8), (8, 3), (1, 1)])
def test_no_warning_unless_fewer_queries_than_keys(lq: int, lkv: int) -> None:
    attn = fz.Attention("mistral_7b")
    assert _top_left_warnings(lambda: attn(*_qkv(lq, lkv))) == []
    assert len(_top_left_warnings(lambda: attn(*_qkv(3, 8)))) == 1  # (the check is live)


@pytest.mark.parametrize(
    "make",
    [
        lambda: fz.Attention(mask=masks.Causal(align="bottom_right")),
        lambda: fz.Attention(),
        lambda: fz.Attention(mask=masks.Full()),
        lambda: fz.Attention("modernbert", layer=0),  # global layer: no mask
        lambda: fz.Attention("modernbert", layer=1),  # bidirectional window
        lambda: fz.Attention(mask=KeyPadding(valid=torch.tensor([[True] * 6 + [False] * 2]))),
    ],
    ids=["bottom_right", "no_mask", "full", "modernbert_global", "modernbert_window", "key_padding"],
)
def test_no_warning_where_the_alignments_agree(make: Any) -> None:
    attn = make()
    q, k, v = _qkv(3, 8)
    assert _top_left_warnings(lambda: attn(q, k, v)) == []
    attn.set_mask(masks.Causal())  # the same layer made top-left causal does warn
    assert len(_top_left_warnings(lambda: attn(q, k, v))) == 1


def test_masks_the_check_cannot_evaluate_give_no_warning_and_no_error() -> None:
    def top_left_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx <= q_idx

    doc = masks.Document(doc_ids=torch.zeros(1, 8, dtype=torch.int32)) & masks.Causal()
    q, k, v = _qkv(3, 8)
    for mask in (top_left_causal, doc):
        attn = fz.Attention(mask=mask)
        assert _top_left_warnings(lambda attn=attn: attn(q, k, v)) == []
    # Causal() alone, the same visibility with a plain spec, is checked.
    assert len(_top_left_warnings(lambda: fz.Attention(mask=masks.Causal())(q, k, v))) == 1


def test_a_per_call_mask_is_not_checked() -> None:
    attn = fz.Attention("mistral_7b")
    q, k, v = _qkv(3, 8)
    assert _top_left_warnings(lambda: attn(q, k, v, mask=masks.Causal())) == []
    # The override did not use up the check of the layer's own mask.
    assert len(_top_left_warnings(lambda: attn(q, k, v))) == 1


def test_a_new_mask_is_checked_again() -> None:
    attn = fz.Attention(mask=masks.Causal())
    q, k, v = _qkv(3, 8)
    assert len(_top_left_warnings(lambda: attn(q, k, v))) == 1
    attn.set_mask(masks.Causal(align="bottom_right"))
    assert _top_left_warnings(lambda: attn(q, k, v)) == []
    attn.spec = fz.presets.LayerAttention(mask=masks.SlidingWindow(left=4))
    assert len(_top_left_warnings(lambda: attn(q, k, v))) == 1


def test_the_output_is_still_the_top_left_result() -> None:
    attn = fz.Attention("gemma2", layer=1, num_heads=H)
    q, k, v = _qkv(3, 8)
    with pytest.warns(UserWarning, match=TOP_LEFT):
        out = attn(q, k, v)
    want = fz.attention(q, k, v, mask=attn.mask, score_mod=attn.score_mod, scale=attn.spec.scale)
    torch.testing.assert_close(out, want)


def test_bshd_layout_reads_the_lengths_after_the_transpose() -> None:
    attn = fz.Attention("mistral_7b", layout="bshd")
    q, k, v = (t.transpose(1, 2) for t in _qkv(3, 8))
    (w,) = _top_left_warnings(lambda: attn(q, k, v))
    assert "Lq=3 < Lkv=8" in str(w.message)


def test_the_functional_layer_warns_too() -> None:
    q, k, v = _qkv(5, 9)
    (w,) = _top_left_warnings(lambda: fz.layers.attention_layer(q, k, v, config="mistral_7b"))
    assert str(w.message).startswith("fz.layers.attention_layer: ")
    assert _top_left_warnings(lambda: fz.layers.attention_layer(q, k, v, config="mistral_7b")) == []


def test_pytest_warns_sees_it() -> None:
    with pytest.warns(UserWarning, match="top-left aligned"):
        fz.Attention(mask=masks.Causal())(*_qkv(2, 7))


def test_compiled_layers_neither_warn_nor_break_the_graph() -> None:
    attn = fz.Attention(mask=masks.Causal())
    q, k, v = _qkv(3, 8)
    explained = torch._dynamo.explain(attn)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
        assert _top_left_warnings(lambda: compiled(q, k, v)) == []
    assert "_top_left" not in attn.__dict__  # no state written while traced
    assert len(_top_left_warnings(lambda: attn(q, k, v))) == 1  # so eagerly it still warns, once
