"""FA4's CuTe DSL compiles a kernel on first use, and two threads compiling at once aborted the
process (H200 GPU soak). Both routes that call into it hold one process-wide lock; this checks the
lock is held around the route body (the kernels themselves need a GPU and flash-attn-4)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flexattn_zoo.backends import base
from flexattn_zoo.backends.fa4 import FA4, FlashAttn4Backend
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


def test_fa4_runs_under_the_cute_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _seen_lock(monkeypatch, FlashAttn4Backend, "_run")
    FA4.run(None, None, None, None, scale=1.0)
    assert seen == [True] and not base._CUTE_LOCK.locked()
