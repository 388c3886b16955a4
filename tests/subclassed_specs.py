"""User subclasses of presets that replace the parent's function (with a correct ``dense``):
shared by tests/unit/test_subclassed_specs.py and tests/gpu/test_subclassed_specs_gpu.py."""

from __future__ import annotations

import torch

from flexattn_zoo import masks, score_mods
from flexattn_zoo.spec import MaskMod, ScoreMod, spec_dataclass


@spec_dataclass
class StrictlyCausal(masks.Causal):
    """Causal without the diagonal: each query sees only the keys before it."""

    def _make_mask_mod(self) -> MaskMod:
        def strictly_causal(b, h, q_idx, kv_idx):
            return kv_idx < q_idx

        return strictly_causal

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        return torch.ones(q_len, kv_len, dtype=torch.bool).tril(-1)[None, None]


@spec_dataclass
class RecentOnly(masks.SlidingWindow):
    """The ``left`` keys before the query, the query's own key hidden."""

    def _make_mask_mod(self) -> MaskMod:
        left = self.left

        def recent_only(b, h, q_idx, kv_idx):
            return (kv_idx < q_idx) & (kv_idx >= q_idx - left)

        return recent_only

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        return torch.ones(q_len, kv_len, dtype=torch.bool).tril(-1).triu(-self.left)[None, None]


@spec_dataclass
class ShiftedChunks(masks.Chunked):
    """Chunks of ``size`` whose boundaries sit ``size // 2`` later than Chunked's."""

    def _make_mask_mod(self) -> MaskMod:
        size, shift = self.size, self.size // 2

        def shifted_chunks(b, h, q_idx, kv_idx):
            return (q_idx + shift) // size == (kv_idx + shift) // size

        return shifted_chunks

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        shift = self.size // 2
        q = (torch.arange(q_len) + shift) // self.size
        kv = (torch.arange(kv_len) + shift) // self.size
        return (q[:, None] == kv[None, :])[None, None]


@spec_dataclass
class SquaredDistance(score_mods.Alibi):
    """ALiBi's slopes on the squared distance: ``s - slope[h] * (i - j)^2``."""

    def _make_score_mod(self, *, fast: bool) -> ScoreMod:
        slopes = self.head_slopes()

        def squared_distance(score, b, h, q_idx, kv_idx):
            return score - _slope(h, slopes) * ((q_idx - kv_idx) * (q_idx - kv_idx))

        return squared_distance

    def dense(self, scores: torch.Tensor) -> torch.Tensor:
        q_len, kv_len = scores.shape[-2:]
        on = {"dtype": torch.float64, "device": scores.device}
        slopes = torch.tensor(self.head_slopes(), **on).view(-1, 1, 1)
        i = torch.arange(q_len, **on)[:, None]
        j = torch.arange(kv_len, **on)[None, :]
        return scores - slopes * (i - j) ** 2


def _slope(h: torch.Tensor, slopes: list[float]) -> torch.Tensor:
    """``slopes[h]`` with elementwise ops (flex's score_mod sees ``h`` as a tensor)."""
    out = torch.zeros_like(h, dtype=torch.float32)
    for i, s in enumerate(slopes):
        out = torch.where(h == i, torch.full_like(out, s), out)
    return out


@spec_dataclass
class EvenKeys(masks.Full):
    """Only the even keys (in the coordinates the mask sees)."""

    def _make_mask_mod(self) -> MaskMod:
        def even_keys(b, h, q_idx, kv_idx):
            return kv_idx % 2 == 0

        return even_keys

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        out = torch.zeros(q_len, kv_len, dtype=torch.bool)
        out[:, ::2] = True
        return out[None, None]


@spec_dataclass
class DocumentsCausalOnOddRows(masks.Document):
    """Documents in every batch row, causal within them in the odd rows: the function reads ``b``
    where ``Document``'s reads only ``doc_ids``."""

    def _make_mask_mod(self) -> MaskMod:
        ids = self.doc_ids

        def documents_causal_on_odd_rows(b, h, q_idx, kv_idx):
            return (ids[q_idx] == ids[kv_idx]) & ((b % 2 == 0) | (kv_idx <= q_idx))

        return documents_causal_on_odd_rows

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        ids = self.doc_ids.cpu()
        same = ids[:q_len, None] == ids[None, :kv_len]
        causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril()
        return torch.stack([same if b % 2 == 0 else same & causal for b in range(batch)])[:, None]
