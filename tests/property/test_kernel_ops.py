"""Every registered mask's ``mask_mod`` and score's ``score_mod`` uses only operations that every
flex code generator can lower. FlashAttention-4's CuTe generator in torch 2.11 (route
``flex_flash``) raises "UNSUPPORTED CUTEDSL OPERATION" for Inductor's ``minimum`` / ``maximum``
(``clamp``, ``torch.minimum``, ``max`` of tensors) and lacks ``sigmoid``, ``rsqrt``, ``floor``,
``tan`` and the inverse trigonometric functions; a zoo mod written with them crashes that route.

Each mod is traced to ATen ops with ``make_fx`` on int32 broadcast index grids (as the dense route
evaluates it; the ops are those flex's scalar evaluation lowers).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from flexattn_zoo import masks, score_mods
from flexattn_zoo.testing import spec_examples
from flexattn_zoo.testing.checks import index_grids

#: ATen ops whose Inductor lowering needs an operation torch 2.11's CuTe generator lacks.
CUTE_MISSING = {
    "clamp", "clamp_min", "clamp_max", "minimum", "maximum", "max", "min", "sigmoid", "rsqrt",
    "floor", "tan", "atan", "asin", "acos", "logical_xor", "ceil", "round",
}  # fmt: skip

Q_LEN = KV_LEN = 96
BATCH, HEADS = 2, 4


def _ops(fn: Any, *args: torch.Tensor) -> set[str]:
    graph = make_fx(fn)(*args).graph
    return {
        str(node.target.overloadpacket.__name__)  # type: ignore[union-attr]
        for node in graph.nodes
        if node.op == "call_function" and hasattr(node.target, "overloadpacket")
    }


def _indices() -> tuple[torch.Tensor, ...]:
    return index_grids(BATCH, HEADS, Q_LEN, KV_LEN)


@pytest.mark.parametrize("name", masks.names())
def test_mask_mods_use_operations_every_flex_backend_has(name: str) -> None:
    examples = spec_examples("mask", Q_LEN, KV_LEN, BATCH, HEADS, names=[name])
    assert examples
    for label, spec in examples:
        mod = spec.bind(Q_LEN, KV_LEN).mask_mod()
        bad = _ops(mod, *_indices()) & CUTE_MISSING
        assert not bad, f"{label}: mask_mod uses {sorted(bad)}"


@pytest.mark.parametrize("name", score_mods.names())
def test_score_mods_use_operations_every_flex_backend_has(name: str) -> None:
    examples = spec_examples("score", Q_LEN, KV_LEN, BATCH, HEADS, names=[name])
    assert examples
    for label, spec in examples:
        for fast in (False, True):
            for past in (False, True):
                mod = spec.score_mod(fast=fast, future_keys_hidden=past)
                bad = _ops(mod, torch.full((1, 1, 1, 1), 0.5), *_indices()) & CUTE_MISSING
                assert not bad, (
                    f"{label} (fast={fast}, future_keys_hidden={past}): score_mod uses {sorted(bad)}"
                )
