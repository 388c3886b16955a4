"""SDPA routes AND their own rules with torch's ``can_use_*_attention`` checks (CUDA only).

The checks themselves need a CUDA build; here torch's verdict is faked at the one seam the route
asks (``_compat.sdpa_torch_refusal``), to prove the verdict reaches the plan and ``auto`` moves on.
``tests/gpu/test_routes_gpu.py`` checks on a GPU that every SDPA route the plan accepts runs.
"""

from __future__ import annotations

import pytest
import torch

from flexattn_zoo import _compat, masks
from flexattn_zoo.backends.sdpa import SDPA_CUDNN
from flexattn_zoo.dispatch import Problem, plan_problem


def _problem(**kw: object) -> Problem:
    base: dict[str, object] = dict(
        batch=2, heads=8, kv_heads=8, q_len=1024, kv_len=1024, head_dim=128, dtype=torch.bfloat16,
        device_type="cuda", arch="sm90", requires_grad=False, mask=masks.Causal(), score=None,
    )  # fmt: skip
    base.update(kw)
    return Problem(**base)  # type: ignore[arg-type]


def test_torch_refusal_reaches_the_plan_and_auto_moves_on(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[object, ...]] = []

    def fake(kernel: str, *args: object) -> str | None:
        asked.append((kernel, *args))
        return "torch's can_use_cudnn_attention refuses it: test" if kernel == "CUDNN_ATTENTION" else None

    monkeypatch.setattr(_compat, "sdpa_torch_refusal", fake)
    plan = plan_problem(_problem())
    cudnn = next(c for c in plan.candidates if c.name == "sdpa_cudnn")
    assert not cudnn.accepted and cudnn.reasons == ("torch's can_use_cudnn_attention refuses it: test",)
    assert plan.backend != "sdpa_cudnn"
    # The exact call the route would make: cuDNN runs GQA with k/v expanded, so torch is asked
    # about equal heads and no enable_gqa.
    asked.clear()
    SDPA_CUDNN.reasons(_problem(heads=8, kv_heads=2))
    (kernel, q_shape, kv_shape, dtype, arch, causal, gqa, grad) = asked[0]
    assert (kernel, q_shape, kv_shape, causal, gqa) == (
        "CUDNN_ATTENTION", (2, 8, 1024, 128), (2, 8, 1024, 128), True, False
    )  # fmt: skip


def test_equal_chunks_are_checked_as_the_batch_rows_sdpa_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[object, ...]] = []
    monkeypatch.setattr(_compat, "sdpa_torch_refusal", lambda *a: asked.append(a))
    SDPA_CUDNN.reasons(_problem(mask=masks.Chunked(size=256) & masks.Causal()))
    assert asked and asked[0][1] == (8, 8, 256, 128) and asked[0][5] is True


def test_not_asked_off_cuda_and_when_the_own_rules_refuse(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[object] = []
    monkeypatch.setattr(_compat, "sdpa_torch_refusal", lambda *a: asked.append(a))
    plan_problem(_problem(device_type="cpu", arch="cpu"))
    SDPA_CUDNN.reasons(_problem(mask=masks.SlidingWindow(left=4)))  # no SDPA form: refused first
    assert asked == []


def test_the_check_answers_only_for_the_current_gpu() -> None:
    # On a machine without CUDA (CI) or for another GPU's arch there is nothing to ask torch.
    if torch.cuda.is_available():
        pytest.skip("checked on the GPU by tests/gpu/test_routes_gpu.py")
    args = ((1, 2, 128, 64), (1, 2, 128, 64), torch.bfloat16, "sm90", True, False, False)
    assert _compat.sdpa_torch_refusal("FLASH_ATTENTION", *args) is None
