"""Static types of the public API: ``out = fz.attention(q, k, v)`` is a Tensor, ``return_lse=True``
gives an ``(out, lse)`` pair (the ``@overload``s on ``return_lse``), ``Spec.to`` keeps the spec's
class.

``tools/typecheck.py`` type-checks this file: ``assert_type`` wants the exact static type, so mypy
fails if an overload is removed or wrong. Run by pytest, the same lines check the runtime values.
"""

from __future__ import annotations

import sys

import torch

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.models.decode import append_kv, decode_step
from flexattn_zoo.models.layers import attention_layer
from flexattn_zoo.testing import reference_attention

if sys.version_info >= (3, 11):
    from typing import assert_type
else:  # typing_extensions: a dependency of torch
    from typing_extensions import assert_type

Pair = tuple[torch.Tensor, torch.Tensor]


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    return q, k, v


def _is_pair(x: object) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and all(isinstance(t, torch.Tensor) for t in x)


def test_attention_return_lse_overloads(flag: bool = True) -> None:
    q, k, v = _qkv()
    out = fz.attention(q, k, v, mask="causal", backend="dense")
    assert_type(out, torch.Tensor)
    assert isinstance(out, torch.Tensor)
    out_f = fz.attention(q, k, v, backend="dense", return_lse=False)
    assert_type(out_f, torch.Tensor)
    assert isinstance(out_f, torch.Tensor)
    pair = fz.attention(q, k, v, backend="dense", return_lse=True)
    assert_type(pair, Pair)
    assert _is_pair(pair)
    either = fz.attention(q, k, v, backend="dense", return_lse=flag)
    assert_type(either, torch.Tensor | Pair)
    assert _is_pair(either)
    merged = fz.merge_attention([pair[0]], [pair[1]])
    assert_type(merged, Pair)
    assert _is_pair(merged)


def test_varlen_attention_return_lse_overloads() -> None:
    q, k, v = (t[0].transpose(0, 1) for t in _qkv())  # [T, H, D]
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    out = fz.varlen_attention(q, k, v, cu, cu, 5, 5, causal=True, backend="dense")
    assert_type(out, torch.Tensor)
    assert isinstance(out, torch.Tensor)
    pair = fz.varlen_attention(q, k, v, cu, cu, 5, 5, backend="dense", return_lse=True)
    assert_type(pair, Pair)
    assert _is_pair(pair)


def test_layer_decode_reference_overloads() -> None:
    q, k, v = _qkv()
    out = attention_layer(q, k, v, mask="causal", backend="dense")
    assert_type(out, torch.Tensor)
    assert isinstance(out, torch.Tensor)
    pair = attention_layer(q, k, v, mask="causal", backend="dense", return_lse=True)
    assert_type(pair, Pair)
    assert _is_pair(pair)
    step = decode_step(q[:, :, -1:], k, v, 8, backend="dense")
    assert_type(step, torch.Tensor)
    assert isinstance(step, torch.Tensor)
    step_pair = decode_step(q[:, :, -1:], k, v, 8, backend="dense", return_lse=True)
    assert_type(step_pair, Pair)
    assert _is_pair(step_pair)
    k_pages, v_pages = torch.zeros(2, 4, 16, k.shape[1], k.shape[3])  # "NHD" pools
    table, new = torch.tensor([[0]]), k[:, :, :2]
    lengths = append_kv(k_pages, v_pages, table, torch.tensor([0]), new, new, kv_layout="NHD")
    assert_type(lengths, torch.Tensor)
    assert isinstance(lengths, torch.Tensor)
    length = append_kv(k_pages, v_pages, table, 2, new, new, kv_layout="NHD")
    assert_type(length, int)
    assert length == 4
    ref = reference_attention(q, k, v)
    assert_type(ref, torch.Tensor)
    ref_pair = reference_attention(q, k, v, return_lse=True)
    assert_type(ref_pair, Pair)
    assert isinstance(ref, torch.Tensor) and _is_pair(ref_pair)


def test_spec_to_keeps_the_class() -> None:
    window = masks.SlidingWindow(left=3).to("cpu")
    assert_type(window, masks.SlidingWindow)
    assert isinstance(window, masks.SlidingWindow)
    cap = score_mods.SoftCap(cap=2.0).to(torch.device("cpu"))
    assert_type(cap, score_mods.SoftCap)
    assert isinstance(cap, score_mods.SoftCap)
