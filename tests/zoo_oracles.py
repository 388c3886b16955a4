"""Plain oracles shared by the zoo's tests: a mask from a per-pair Python predicate, a spec's
``mask_mod`` evaluated on the full index grid, and small q/k/v that require grad."""

from __future__ import annotations

from collections.abc import Callable

import torch

from flexattn_zoo.spec import MaskSpec


def table(q_len: int, kv_len: int, rule: Callable[[int, int], bool]) -> torch.Tensor:
    """``[1, 1, Lq, Lkv]`` from a per-pair Python predicate: the slowest, plainest oracle."""
    out = torch.tensor([[rule(i, j) for j in range(kv_len)] for i in range(q_len)], dtype=torch.bool)
    return out.view(1, 1, q_len, kv_len)


def mask_mod_dense(spec: MaskSpec, q_len: int, kv_len: int, batch: int = 1) -> torch.Tensor:
    """The bound spec's ``mask_mod`` on every (batch row, query, key), ``[B, 1, Lq, Lkv]``."""
    b = torch.arange(batch).view(-1, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    i = torch.arange(q_len).view(1, 1, -1, 1)
    j = torch.arange(kv_len).view(1, 1, 1, -1)
    bound = spec.bind(q_len, kv_len)
    return torch.broadcast_to(bound.mask_mod()(b, h, i, j), (batch, 1, q_len, kv_len))


def qkv(batch: int, q_len: int, kv_len: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v ``[B, 2, L, 8]`` (float32, requiring grad) from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, 2, q_len, 8, generator=g).requires_grad_(),
        torch.randn(batch, 2, kv_len, 8, generator=g).requires_grad_(),
        torch.randn(batch, 2, kv_len, 8, generator=g).requires_grad_(),
    )


def cu_seqlens(lengths: list[int], dtype: torch.dtype = torch.int32, device: str = "cpu") -> torch.Tensor:
    """FlashAttention's ``cu_seqlens``: ``[0, l0, l0 + l1, ...]``."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype, device=device)


def flash_visible(lq: int, lk: int, left: int, right: int) -> torch.Tensor:
    """``[Lq, Lkv]``: flash_attn's ``causal`` / ``window_size`` mask as its docs state it, bottom-right
    aligned: query ``i`` sees key ``j`` iff ``i + lk - lq - left <= j <= i + lk - lq + right``
    (``-1``: unbounded; causal is ``(-1, 0)``)."""
    i = torch.arange(lq).view(lq, 1) + (lk - lq)
    j = torch.arange(lk).view(1, lk)
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep
