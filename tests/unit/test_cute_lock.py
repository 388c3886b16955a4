"""FA4's CuTe DSL compiles a kernel on first use, and two threads compiling at once aborted the
process (H200 GPU soak). Both routes that call into it hold one process-wide lock; this checks the
lock is held around the route body (flex_flash) and around the kernel calls of the fa4 ops (the
kernels themselves need a GPU and flash-attn-4)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flexattn_zoo.backends import base, fa4_op
from flexattn_zoo.backends.flex import FLEX_FLASH, FlexBackend


def _seen_lock(monkeypatch: pytest.MonkeyPatch, owner: type, name: str) -> list[bool]:
    seen: list[bool] = []

    def body(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        seen.append(base._CUTE_LOCK.locked())
        return torch.zeros(1), None

    monkeypatch.setattr(owner, name, body)
    return seen


def test_flex_flash_runs_under_the_cute_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _seen_lock(monkeypatch, FlexBackend, "run")
    FLEX_FLASH.run(None, None, None, None, scale=1.0)
    assert seen == [True] and not base._CUTE_LOCK.locked()


def test_fa4_ops_call_the_kernels_under_the_cute_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []

    def fwd(q: torch.Tensor, *rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(base._CUTE_LOCK.locked())
        return q.clone(), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: Any) -> Any:
        seen.append(base._CUTE_LOCK.locked())
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(fa4_op, "_fwd_kernel", fwd)
    monkeypatch.setattr(fa4_op, "_bwd_kernel", bwd)
    q = torch.randn(1, 8, 2, 16, requires_grad=True)
    out, _ = fa4_op.fa4_attention(q, q, q, scale=0.25)
    out.sum().backward()
    assert seen == [True, True] and not base._CUTE_LOCK.locked()
