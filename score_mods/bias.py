"""``bias``: an additive float tensor (SDPA's float ``attn_mask``) as a score spec."""

from __future__ import annotations

import torch

from flexattn_zoo.masks.dense import as_4d_tensor, broadcast_indexer, check_broadcast, collapse_broadcast
from flexattn_zoo.registry import SCORES
from flexattn_zoo.spec import ScoreMod, ScoreSpec, SdpaForm, Spec, spec_dataclass, tracing


@SCORES.register
@spec_dataclass
class Bias(ScoreSpec):
    """The scaled score ``s`` of query ``i``, key ``j`` (batch row ``b``, head ``h``) becomes
    ``s + bias[b, h, i, j]``: SDPA's float ``attn_mask``.

    ``bias`` is a floating tensor ``[Lq, Lkv]`` or ``[B|1, H|1, Lq|1, Lkv|1]`` (size-1 dims
    broadcast; 3-D is refused as ambiguous). ``-inf`` entries hide their key, as in SDPA; a row
    of only ``-inf`` outputs 0 (lse ``-inf``), as every masked-out row does here. A bias that
    requires grad is kept as given (compared by identity) and gets its gradient on the routes
    with one: SDPA's math (CPU, CUDA) and memory-efficient (CUDA) kernels, the dense route, and
    flex on CUDA; the others refuse it with the reason. Its values are read live, but whether a
    row holds only ``-inf`` is read once, when the spec is first planned (it picks the CUDA
    kernels that may run it): to hide whole rows later, build a new ``Bias``.

    ``fz.attention(score_mod=t)`` with a float tensor ``t`` builds this spec, and so does
    ``mask=t`` when no ``score_mod`` is given (an additive mask, as in SDPA). Forms offered:
    SDPA's float ``attn_mask`` (``ScoreSpec.sdpa_form``). Registered as ``bias``.
    """

    bias: torch.Tensor

    depends_on_head = True

    def __post_init__(self) -> None:
        bias = self.bias
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"Bias(bias=...) must be a floating tensor, got {type(bias).__name__}")
        if not bias.is_floating_point():
            hint = " (a bool tensor is a mask: masks.Dense)" if bias.dtype == torch.bool else ""
            raise TypeError(f"Bias(bias=...) must be a floating tensor, got dtype {bias.dtype}{hint}")
        as_4d_tensor(bias, "Bias(bias=...)")  # the shape check
        # An empty bias (a batch or length of 0) is valid where it broadcasts (``validate``).
        if not bias.requires_grad:
            # A learned bias stays the caller's tensor (its identity is the spec's); others are
            # held 4-D at their own size (expanded dims collapsed) before the spec copies them.
            object.__setattr__(self, "bias", collapse_broadcast(as_4d_tensor(bias, "Bias(bias=...)")))

    def bias_4d(self) -> torch.Tensor:
        """``bias`` as a 4-D tensor (a view of a learned 2-D bias, so its gradient reaches it)."""
        return as_4d_tensor(self.bias, "Bias(bias=...)")

    def uses_head(self) -> bool:
        return self.bias_4d().shape[1] > 1

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        check_broadcast(self.bias_4d(), "Bias(bias=...)", q_len, kv_len, batch, heads)

    def _make_score_mod(self, *, fast: bool) -> ScoreMod:
        index = broadcast_indexer(self.bias_4d())

        def bias_score(
            score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return score + index(b, h, q_idx, kv_idx).to(score.dtype)

        return bias_score

    def dense(self, scores: torch.Tensor) -> torch.Tensor:
        return scores + self.bias_4d().to(scores.device, torch.float64)

    def hides_whole_rows(self) -> bool:
        """Whether some query row has only ``-inf`` entries (True while traced: the data is not read
        then). Computed once per spec."""
        if tracing():
            return True
        cached = self.__dict__.get("_empty_rows")
        if cached is None:
            cached = bool(torch.isneginf(self.bias.detach()).all(dim=-1).any())
            object.__setattr__(self, "_empty_rows", cached)
        return cached

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        return SdpaForm(is_causal=False, attn_mask=self.bias_4d(), empty_rows=self.hides_whole_rows())

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        gen = torch.Generator().manual_seed(23 * q_len + kv_len + heads)
        full = torch.randn(batch, heads, q_len, kv_len, generator=gen, dtype=torch.float64)
        keys = torch.randn(1, 1, 1, kv_len, generator=gen)
        keys[..., ::3] = float("-inf")
        rel = (torch.arange(kv_len)[None, :] - torch.arange(q_len)[:, None]).float() * 0.1
        return [cls(bias=full), cls(bias=keys), cls(bias=rel)]
