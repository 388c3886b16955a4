"""Spec classes written for flex's 0-d index semantics (a reduction over the indices, a row
gathered then indexed), as a user writes them: the package must evaluate them as flex does
(tests/unit/test_spec_functions_probed.py, tests/gpu/test_spec_functions_probed_gpu.py)."""

from __future__ import annotations

from typing import Any

import torch

from flexattn_zoo import masks
from flexattn_zoo.spec import MaskMod, MaskSpec, ScoreMod, ScoreSpec, spec_dataclass


class NearKeys(masks.Causal):
    """Keys within 3 of the query, written with a reduction over the indices' distance."""

    def _make_mask_mod(self) -> MaskMod:
        def near_keys(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (q_idx - kv_idx).abs().amax() <= 3

        return near_keys


def near(i: int, j: int) -> bool:
    """:class:`NearKeys` for one (query, key) pair."""
    return abs(i - j) <= 3


@spec_dataclass
class GatheredTable(MaskSpec):
    """A user's spec reading a row it gathered (``table[q_idx][kv_idx]``), with its own oracle."""

    table: torch.Tensor

    def _make_mask_mod(self) -> MaskMod:
        table = self.table

        def gathered(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return table[q_idx][kv_idx]

        return gathered

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        return self.table[:q_len, :kv_len].cpu().view(1, 1, q_len, kv_len)


@spec_dataclass
class GatheredBias(ScoreSpec):
    """A per-head bias table read MLA-style, one index at a time (``bias[h][q_idx][kv_idx]``)."""

    bias: torch.Tensor
    depends_on_head = True

    def _make_score_mod(self, *, fast: bool) -> ScoreMod:
        bias = self.bias

        def biased(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return score + bias[h][q_idx][kv_idx]

        return biased

    def dense(self, scores: torch.Tensor) -> torch.Tensor:
        lq, lkv = scores.shape[-2:]
        return scores + self.bias[:, :lq, :lkv].to(scores)
