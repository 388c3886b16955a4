"""A score spec with a learned tensor, shared by the tests that need one (determinism, caches)."""

from __future__ import annotations

import torch

from flexattn_zoo.spec import ScoreMod, ScoreSpec, spec_dataclass


@spec_dataclass
class LearnedHeadBias(ScoreSpec):
    """``score + bias[h]`` with a learnable ``bias`` (a captured tensor that requires grad)."""

    bias: torch.Tensor

    def _make_score_mod(self, *, fast: bool) -> ScoreMod:
        bias = self.bias

        def head_bias(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return score + bias[h]

        return head_bias

    def dense(self, scores: torch.Tensor) -> torch.Tensor:
        return scores + self.bias.detach().double().view(1, -1, 1, 1)
