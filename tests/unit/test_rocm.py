"""ROCm (HIP) builds: AMD GPUs are "cuda" devices to torch and report compute capabilities such as
(9, 4) (MI300); they must not be taken for Hopper and sent to CUDA-only kernels."""

from __future__ import annotations

import pytest
import torch

from flexattn_zoo import masks
from flexattn_zoo.arch import ROCM, detect_arch, generation
from flexattn_zoo.backends import BACKENDS
from flexattn_zoo.dispatch import Problem, plan_problem


def _problem(mask: object) -> Problem:
    return Problem(
        batch=2, heads=8, kv_heads=8, q_len=1024, kv_len=1024, head_dim=128, dtype=torch.bfloat16,
        device_type="cuda", arch=ROCM, requires_grad=False, mask=mask, score=None,
    )  # fmt: skip


def test_a_hip_build_is_detected_as_rocm_not_sm94(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEXATTN_ZOO_ARCH", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 4))
    monkeypatch.setattr(torch.version, "hip", None)
    assert detect_arch("cuda") == "sm94" and generation("sm94") == "sm90"
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert detect_arch("cuda") == ROCM and generation(ROCM) == ROCM
    monkeypatch.setenv("FLEXATTN_ZOO_ARCH", ROCM)
    assert detect_arch() == ROCM


def test_cuda_only_routes_refuse_on_rocm_with_a_reason() -> None:
    plan = plan_problem(_problem(masks.Causal()))
    assert plan.backend == "sdpa_flash"
    for c in plan.candidates:
        route = next(b for b in BACKENDS if b.name == c.name)
        refused = any("not available on ROCm" in r for r in c.reasons)
        assert refused == ("cuda" in route.devices and not route.rocm), (c.name, c.reasons)
    for name in ("sdpa_cudnn", "varlen", "fa4", "flex_flash", "sdpa_split"):
        with pytest.raises(ValueError, match="not available on ROCm"):
            plan_problem(_problem(masks.Causal()), name)


def test_masks_without_an_sdpa_form_take_triton_flex_on_rocm() -> None:
    assert plan_problem(_problem(masks.SlidingWindow(left=127))).backend == "flex"
