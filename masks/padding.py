"""``KeyPadding``: a 2-D padding mask (``attention_mask`` of tokenizers) as a mask spec."""

from __future__ import annotations

import torch

from flexattn_zoo.registry import MASKS
from flexattn_zoo.spec import (
    BlockMap,
    MaskMod,
    MaskSpec,
    SdpaForm,
    Spec,
    block_ranges,
    spec_dataclass,
    tracing,
)


@MASKS.register
@spec_dataclass
class KeyPadding(MaskSpec):
    """Key ``j`` of batch row ``b`` is visible iff ``valid[b, j]`` (True = a real token).

    This is the 2-D ``attention_mask`` a tokenizer returns for a padded batch, restricted to the
    keys: padded keys are invisible to every query. It says nothing about padded *queries*; a row
    whose keys are all padding sees nothing and outputs 0. Combine it with the model's pattern,
    e.g. ``Causal() & KeyPadding(valid=mask.bool())``.

    Picture (``valid = [[0, 1, 1, 1]]``, left padding, ``& Causal()``; ``#`` visible)::

        ....
        .#..
        .##.
        .###

    ``valid`` is a bool tensor ``[B, L]`` with ``L >= Lkv`` (keys ``0 .. Lkv - 1`` are read) and one
    row per batch element. Registered as ``key_padding`` (it takes a tensor from the data, like
    ``Document``); ``flexattn_zoo.hf`` builds it from Hugging Face padding masks. Forms offered: a closed-form
    block map (a key block is live iff it holds a real token, full iff all its keys are real), and
    SDPA's ``attn_mask`` as the broadcast view ``valid[:, None, None, :Lkv]`` (no copy, no L x L).
    """

    pair_loads = False  # lengths are read per batch row

    valid: torch.Tensor

    depends_on_batch = True

    def __post_init__(self) -> None:
        valid = self.valid
        if not isinstance(valid, torch.Tensor):
            raise TypeError(f"KeyPadding(valid=...) must be a bool tensor [B, L], got {type(valid).__name__}")
        if valid.dim() != 2 or valid.numel() == 0:
            raise ValueError(
                f"KeyPadding(valid=...) must have shape [B, L] with B, L >= 1, got {tuple(valid.shape)}"
            )
        if valid.dtype != torch.bool:
            if valid.is_floating_point() or valid.is_complex():
                raise TypeError(
                    f"KeyPadding(valid=...) must be bool or 0/1 integers, got dtype {valid.dtype}"
                )
            valid = valid != 0
        object.__setattr__(self, "valid", valid)

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        rows, length = self.valid.shape
        if rows != batch:
            raise ValueError(f"KeyPadding(valid=...) has {rows} rows but the batch size is {batch}")
        if length < kv_len:
            raise ValueError(f"KeyPadding(valid=...) covers {length} keys but Lkv = {kv_len}")

    def _make_mask_mod(self) -> MaskMod:
        valid = self.valid

        def key_padding_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return valid[b, kv_idx] & (q_idx >= 0)

        return key_padding_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        if self.valid.shape[1] < kv_len:
            raise ValueError(f"KeyPadding(valid=...) covers {self.valid.shape[1]} keys but Lkv = {kv_len}")
        # Oracle: slice the key columns and repeat them for every query row (no per-element gather).
        keys = self.valid[:, :kv_len].cpu()
        return keys[:, None, None, :].expand(keys.shape[0], 1, q_len, kv_len).clone()

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        if self.valid.shape[1] < kv_len:
            return None
        keys = self.valid[:, None, None, :kv_len]
        return SdpaForm(is_causal=False, attn_mask=keys, empty_rows=self._some_row_empty(kv_len))

    def _some_row_empty(self, kv_len: int) -> bool:
        """Whether a batch row has no real key among the first ``kv_len`` (True while traced: the
        data is not read then). Computed once per spec and length."""
        if tracing():
            return True
        cache = self.__dict__.setdefault("_empty_rows", {})
        if kv_len not in cache:
            cache[kv_len] = not bool(self.valid[:, :kv_len].any(dim=-1).all())
        return bool(cache[kv_len])

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        rows = self.valid.shape[0]
        n_kv = -(-kv_len // kv_block)
        padded = torch.zeros(rows, n_kv * kv_block, dtype=torch.bool, device=device)
        padded[:, :kv_len] = self.valid[:, :kv_len].to(device)
        tiles = padded.view(rows, n_kv, kv_block)
        _, _, q_complete = block_ranges(q_len, q_block, device)
        n_q = q_complete.numel()
        # Every query block holds at least one valid query, so "any" only depends on the keys.
        any_ = tiles.any(dim=-1)[:, None, None, :].expand(rows, 1, n_q, n_kv)
        full = tiles.all(dim=-1)[:, None, None, :] & q_complete[None, None, :, None]
        return BlockMap(any=any_.contiguous(), full=full.contiguous())

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        gen = torch.Generator().manual_seed(31 * kv_len + batch)
        left = torch.arange(kv_len)[None, :] >= torch.randint(0, kv_len + 1, (batch, 1), generator=gen)
        right = torch.arange(kv_len)[None, :] < torch.randint(0, kv_len + 1, (batch, 1), generator=gen)
        return [cls(valid=torch.ones(batch, kv_len, dtype=torch.bool)), cls(valid=left), cls(valid=right)]
