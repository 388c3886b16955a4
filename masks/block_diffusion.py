"""``block_diffusion``: the training mask of block diffusion language models (BD3-LM)."""

from __future__ import annotations

import torch

from flexattn_zoo.registry import MASKS
from flexattn_zoo.spec import BlockMap, MaskMod, MaskSpec, Spec, block_ranges, spec_dataclass, static_int

from ._blocks import check_int


@MASKS.register
@spec_dataclass
class BlockDiffusion(MaskSpec):
    """Block diffusion: a noisy copy of the sequence denoised block by block, conditioned on the
    clean blocks before it.

    The input is two copies of one sequence laid end to end: positions ``[0, noisy_len)`` hold the
    noisy copy ``x_t``, positions ``[noisy_len, ...)`` the clean copy ``x_0``. Each copy is cut into
    blocks of ``block_size`` from its own start: a noisy position ``p`` is in block ``p // block_size``,
    a clean one in block ``(p - noisy_len) // block_size``. With ``bq`` / ``bk`` the blocks of query
    ``i`` / key ``j``, the key is visible iff

    * both are noisy and ``bk == bq`` (a noisy block attends to itself, bidirectionally);
    * the query is noisy, the key clean and ``bk < bq`` (the clean blocks strictly before it: the
      context a block is denoised from);
    * both are clean and ``bk <= bq`` (block-causal attention over the clean copy);

    and never when the query is clean and the key noisy. This is BD3-LM's training mask
    (Arriola et al., 2025): the union of its block-diagonal, offset block-causal and block-causal
    parts, with ``noisy_len`` its ``n``. ``Lq`` and ``Lkv`` are free (usually both
    ``2 * noisy_len``); positions past the clean copy's end continue its blocks.

    Convention next to attention-gym's: ``generate_block_diffusion_mask(seq_len, block_size)``
    (``2 * seq_len`` positions) is ``BlockDiffusion(block_size=block_size, noisy_len=seq_len)``.

    Picture (``block_size=2, noisy_len=4``, ``Lq = Lkv = 8``: ``x_t`` | ``x_0``)::

        ##.. ....
        ##.. ....
        ..## ##..
        ..## ##..

        .... ##..
        .... ##..
        .... ####
        .... ####

    Forms offered: a closed-form block map for any lengths (each block splits at ``noisy_len`` into
    a noisy and a clean run, whose block numbers are consecutive); lowest visible key: the start of
    the query's own block for noisy queries, ``noisy_len`` for clean ones.

    Args:
        block_size: tokens per diffusion block (``>= 1``).
        noisy_len: length of the noisy copy, where the clean copy starts (``>= 0``).
    """

    block_size: int
    noisy_len: int

    def __post_init__(self) -> None:
        owner = "BlockDiffusion"
        object.__setattr__(
            self, "block_size", check_int("block_size", self.block_size, minimum=1, owner=owner)
        )
        object.__setattr__(self, "noisy_len", check_int("noisy_len", self.noisy_len, minimum=0, owner=owner))

    def _make_mask_mod(self) -> MaskMod:
        size, n = static_int(self.block_size), static_int(self.noisy_len)

        def block_diffusion_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            q_clean, kv_clean = q_idx >= n, kv_idx >= n
            bq = torch.where(q_clean, q_idx - n, q_idx) // size
            bk = torch.where(kv_clean, kv_idx - n, kv_idx) // size
            noisy_self = ~q_clean & ~kv_clean & (bk == bq)
            context = ~q_clean & kv_clean & (bk < bq)
            clean = q_clean & kv_clean & (bk <= bq)
            return noisy_self | context | clean

        return block_diffusion_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        # Oracle: paint the rectangles block by block (noisy squares on the diagonal, then for every
        # block its clean context), instead of comparing block numbers like the mask_mod does.
        size, n = self.block_size, self.noisy_len
        span = max(q_len, kv_len, n)
        out = torch.zeros(span, span, dtype=torch.bool)
        for start in range(0, n, size):  # noisy block [start, stop)
            stop = min(start + size, n)
            out[start:stop, start:stop] = True
            out[start:stop, n : n + start] = True  # clean blocks before it
        for start in range(n, span, size):  # clean block: itself and every clean block before it
            out[start : start + size, n : start + size] = True
        return out[:q_len, :kv_len][None, None]

    def lowest_visible_key(self, q_idx: torch.Tensor) -> torch.Tensor | None:
        # A noisy query sees its own block from its start (and clean keys, all >= noisy_len, above
        # it); a clean query sees the clean copy from its first key. Exact, and never decreasing.
        size, n = self.block_size, self.noisy_len
        own = torch.div(q_idx, size, rounding_mode="floor") * size
        return torch.where(q_idx < n, own, torch.full_like(q_idx, n))

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        # Split each kernel block at noisy_len into a noisy run and a clean run (either may be
        # empty). Within a run, diffusion block numbers take every value between those of its
        # first and last position, so each of the four run pairs is decided from two intervals.
        n, size = self.noisy_len, self.block_size
        q_first, q_last, q_complete = block_ranges(q_len, q_block, device)
        k_first, k_last, k_complete = block_ranges(kv_len, kv_block, device)

        def runs(
            first: torch.Tensor, last: torch.Tensor
        ) -> list[tuple[bool, torch.Tensor, torch.Tensor, torch.Tensor]]:
            # (clean?, run exists, first and last diffusion block of the run) per kernel block.
            noisy = (False, first < n, first // size, torch.clamp(last, max=n - 1) // size)
            clean = (
                True,
                last >= n,
                (torch.clamp(first, min=n) - n) // size,
                (last - n).clamp(min=0) // size,
            )
            return [noisy, clean]

        any_ = torch.zeros(q_first.numel(), k_first.numel(), dtype=torch.bool, device=device)
        full = q_complete[:, None] & k_complete[None, :]
        for q_clean, q_has, q_lo, q_hi in runs(q_first, q_last):
            for k_clean, k_has, k_lo, k_hi in runs(k_first, k_last):
                both = q_has[:, None] & k_has[None, :]
                qa, qb = q_lo[:, None], q_hi[:, None]
                ka, kb = k_lo[None, :], k_hi[None, :]
                if not q_clean and not k_clean:  # noisy -> noisy: the same block
                    some, every = (qa <= kb) & (ka <= qb), (qa == qb) & (ka == kb) & (qa == ka)
                elif not q_clean:  # noisy -> clean: strictly earlier blocks
                    some, every = ka < qb, kb < qa
                elif k_clean:  # clean -> clean: this block and earlier ones
                    some, every = ka <= qb, kb <= qa
                else:  # clean -> noisy: never
                    some = every = torch.zeros_like(both)
                any_ |= both & some
                full &= every | ~both
        return BlockMap(any=any_[None, None], full=full[None, None])

    @classmethod
    def typical_example(cls, q_len: int, kv_len: int, batch: int, heads: int) -> Spec:
        # Half noisy, half clean, 16 blocks per copy.
        n = max(q_len, kv_len) // 2
        return cls(block_size=max(1, n // 16), noisy_len=n)

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        n = max(q_len, kv_len)
        return [
            cls(block_size=4, noisy_len=16),  # the same spec at every length (compiled tests)
            cls(block_size=max(1, n // 10), noisy_len=n // 2),
            cls(block_size=7, noisy_len=(n + 1) // 2),
            cls(block_size=n + 1, noisy_len=n // 3),
        ]
