"""SDPA routes AND their own rules with torch's ``can_use_*_attention`` checks (CUDA only).

The checks themselves need a CUDA build; here torch's verdict is faked at the one seam the route
asks (``_compat.sdpa_torch_refusal``), to prove the verdict reaches the plan and ``auto`` moves on.
``tests/gpu/test_routes_gpu.py`` checks on a GPU that every SDPA route the plan accepts runs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import flexattn_zoo as fz
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


def test_residue_classes_are_checked_as_the_heads_sdpa_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[object, ...]] = []
    monkeypatch.setattr(_compat, "sdpa_torch_refusal", lambda *a: asked.append(a))
    spanning = masks.DilatedSlidingWindow(left=1024, dilation=4)  # causal inside each class
    SDPA_CUDNN.reasons(_problem(mask=spanning, heads=8, kv_heads=2))  # cuDNN expands k/v first
    assert asked and asked[0][1:3] == ((2, 32, 256, 128), (2, 32, 256, 128)) and asked[0][5] is True


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


# ---- the eager pin (``_compat.pin_sdpa_kernel``), sdpa_kernel's effect for less host time ----------

_KERNELS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


_CUDA_BACKENDS = torch.backends.cuda
_GETTERS = (
    _CUDA_BACKENDS.flash_sdp_enabled,
    _CUDA_BACKENDS.mem_efficient_sdp_enabled,
    _CUDA_BACKENDS.cudnn_sdp_enabled,
    _CUDA_BACKENDS.math_sdp_enabled,
)
_SETTERS = (
    _CUDA_BACKENDS.enable_flash_sdp,
    _CUDA_BACKENDS.enable_mem_efficient_sdp,
    _CUDA_BACKENDS.enable_cudnn_sdp,
    _CUDA_BACKENDS.enable_math_sdp,
)


def _flags() -> tuple[bool, ...]:
    """torch's SDPA enable flags, read through its public functions (any torch version)."""
    return tuple(bool(get()) for get in _GETTERS)


def _set_flags(flags: tuple[bool, ...]) -> None:
    for set_flag, flag in zip(_SETTERS, flags, strict=True):
        set_flag(flag)


@pytest.mark.parametrize("kernel", [*_KERNELS, ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")])
def test_pin_has_sdpa_kernels_effect_and_restores_any_prior_state(kernel: str | tuple[str, ...]) -> None:
    kernels = (kernel,) if isinstance(kernel, str) else kernel
    original = _flags()
    n = len(original)
    try:
        for prior in (
            (True,) * n,
            (False,) * n,
            tuple(i % 2 == 0 for i in range(n)),
            tuple(i == 3 for i in range(n)),
        ):
            _set_flags(prior)
            with _compat.sdpa_kernel([getattr(_compat.SDPBackend, name) for name in kernels]):
                expected = _flags()
            assert _flags() == prior
            token = _compat.pin_sdpa_kernel(kernel)
            assert _flags() == expected
            _compat.restore_sdpa_kernels(token)
            assert _flags() == prior
    finally:
        _set_flags(original)


def test_sdpa_route_restores_the_flags_when_the_kernel_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.nn.functional as F

    from flexattn_zoo.backends.sdpa import SDPA_MATH

    q = torch.randn(1, 2, 8, 4)
    p = plan_problem(
        Problem(
            batch=1,
            heads=2,
            kv_heads=2,
            q_len=8,
            kv_len=8,
            head_dim=4,
            dtype=torch.float32,
            device_type="cpu",
            arch="cpu",
            requires_grad=False,
            mask=masks.Causal(),
        ),  # fmt: skip
        "sdpa_math",
    ).problem
    before = _flags()

    def boom(*args: object, **kwargs: object) -> None:
        assert _flags() != before  # pinned to MATH
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(F, "scaled_dot_product_attention", boom)
    with pytest.raises(RuntimeError, match="kernel failed"):
        SDPA_MATH.run(q, q, q, p, scale=0.5)
    assert _flags() == before


def test_this_torch_takes_the_fast_pin() -> None:
    """torch 2.13 names its flags in ``torch.nn.attention._backend_names``: the pin reads and sets
    them directly (a torch without it falls back to entering ``sdpa_kernel``)."""
    if _compat.TORCH_VERSION < (2, 13):
        pytest.skip("checked on torch 2.13; other versions may take the sdpa_kernel fallback")
    before = _flags()
    token = _compat.pin_sdpa_kernel("MATH")
    try:
        assert isinstance(token, tuple)  # not sdpa_kernel's context manager
    finally:
        _compat.restore_sdpa_kernels(token)
    assert _flags() == before


def test_length_blind_kernels_are_asked_once_per_length_class(monkeypatch: pytest.MonkeyPatch) -> None:
    # Generation meets a new key length every step: FlashAttention-2 / memory-efficient verdicts
    # must not be recomputed (fake tensors, ~1 ms) for each; cuDNN's checks read the lengths.
    asked: list[tuple[object, ...]] = []
    monkeypatch.setattr(_compat, "_sdpa_torch_refusal_exact", lambda *a: asked.append(a))
    rest = (torch.bfloat16, "sm90", False, True, False)
    for kernel in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        asked.clear()
        for n in range(4000, 4100):
            _compat.sdpa_torch_refusal(kernel, (8, 32, 1, 128), (8, 8, n, 128), *rest)
        assert len({a[2] for a in asked}) == 8  # one class per residue mod 8
        assert all(a[1][2] == 1 and a[2][2] >= 128 for a in asked)
    asked.clear()
    for n in range(4000, 4010):
        _compat.sdpa_torch_refusal("CUDNN_ATTENTION", (8, 32, 1, 128), (8, 8, n, 128), *rest)
    assert [a[2][2] for a in asked] == list(range(4000, 4010))


@pytest.mark.parametrize(
    ("q_len", "kv_len"), [(4096, 4096), (200, 208), (208, 200), (1, 129), (64, 64), (0, 300)]
)
def test_length_classes_keep_what_torch_checks(
    monkeypatch: pytest.MonkeyPatch, q_len: int, kv_len: int
) -> None:
    # torch's FlashAttention-2 check wants Lq == Lkv with is_causal; both kernels refuse length 0.
    asked: list[tuple[object, ...]] = []
    monkeypatch.setattr(_compat, "_sdpa_torch_refusal_exact", lambda *a: asked.append(a))
    _compat.sdpa_torch_refusal(
        "FLASH_ATTENTION", (1, 2, q_len, 64), (1, 2, kv_len, 64), torch.bfloat16, "sm90", True, False, False
    )
    q_class, kv_class = asked[0][1][2], asked[0][2][2]
    assert (q_class == kv_class) == (q_len == kv_len)
    assert (q_class == 0, kv_class == 0) == (q_len == 0, kv_len == 0)
    assert (q_class, kv_class) == (q_len, kv_len) or max(q_len, kv_len) > 128


def test_eager_bound_sdpa_call_restores_the_flags_when_sdpa_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan cache's eager bound call of a plain problem (pin, SDPA, restore) leaves torch's
    SDPA flags as it found them when SDPA itself raises, and gives the pinned kernel's result
    otherwise."""
    from flexattn_zoo.backends import sdpa as sdpa_module

    q = torch.randn(1, 2, 16, 8)
    p = fz.plan(q, q, q, mask="causal", backend="sdpa_math").problem
    run = sdpa_module.SDPA_MATH.eager_bound_run(p, q.device)
    flags = tuple(
        getattr(torch.backends.cuda, f"{n}_sdp_enabled")() for n in ("flash", "math", "mem_efficient")
    )
    out, lse = run(q, q, q, 8**-0.5)
    assert lse is None
    with _compat.sdpa_kernel([_compat.SDPBackend.MATH]):
        expected = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(sdpa_module.F, "scaled_dot_product_attention", failing)
    with pytest.raises(RuntimeError, match="kernel failed"):
        run(q, q, q, 8**-0.5)
    assert (
        tuple(getattr(torch.backends.cuda, f"{n}_sdp_enabled")() for n in ("flash", "math", "mem_efficient"))
        == flags
    )
