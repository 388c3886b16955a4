"""Replays of the FA4 launches in Inductor's generated FLASH code (``backends.fa4_generated``), on
the CPU: a stand-in ``flash_attn.cute.interface`` whose launchers write into the outputs they are
given through a JIT-cached "compiled kernel" (torch code run unseen by torch modes, as FA4's CuTe
kernels are), called from code compiled under Inductor's cache directory as the generated kernel
functions are. The real launchers run on the GPU suite (tests/gpu/test_fa4_replay_gpu.py)."""

from __future__ import annotations

import inspect
import os
import sys
import types
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch.utils._python_dispatch import _disable_current_modes

from flexattn_zoo.backends import fa4_generated, fa4_op, fa4_replay


class Blocks(NamedTuple):
    """Stands in for FA4's BlockSparseTensorsTorch (a NamedTuple of tensors and a block size)."""

    count: torch.Tensor
    index: torch.Tensor
    block_size: tuple[int, int] | None = None


def _attention_kernel(q, k, v, out, lse, scale, bias, count) -> None:  # type: ignore[no-untyped-def]
    """A "compiled kernel": attention with an additive bias, written into out and lse."""
    with _disable_current_modes():
        s = q @ k.transpose(-1, -2) * scale + bias + count.sum()
        lse.copy_(torch.logsumexp(s, -1))
        out.copy_(torch.softmax(s, -1) @ v)


def _lse_kernel(q, k, lse, scale) -> None:  # type: ignore[no-untyped-def]
    with _disable_current_modes():
        lse.copy_(torch.logsumexp(q @ k.transpose(-1, -2) * scale, -1))


def _out_kernel(q, k, v, out, scale) -> None:  # type: ignore[no-untyped-def]
    with _disable_current_modes():
        out.copy_(torch.softmax(q @ k.transpose(-1, -2) * scale, -1) @ v)


def _interface(split_out: bool = False) -> types.ModuleType:
    """A stand-in for ``flash_attn.cute.interface``. ``split_out``: its launcher writes ``out``
    with a kernel it calls directly, outside its JIT cache (which a recording cannot see)."""
    mod = types.ModuleType("flash_attn.cute.interface")

    def _flash_attn_fwd(  # type: ignore[no-untyped-def]
        q, k, v, softmax_scale=None, score_mod=None, mask_mod=None, out=None, lse=None,
        block_sparse_tensors=None, aux_tensors=None,
    ):  # fmt: skip
        _flash_attn_fwd.calls += 1  # type: ignore[attr-defined]
        cache = _flash_attn_fwd.compile_cache  # type: ignore[attr-defined]
        if split_out:
            if "lse" not in cache:
                cache["lse"] = _lse_kernel
            cache["lse"](q, k, lse, softmax_scale)
            _out_kernel(q, k, v, out, softmax_scale)
            return out, lse, None, None, None
        key = (getattr(score_mod, "__cute_hash__", None), out.shape)
        if key not in cache:
            cache[key] = _attention_kernel
        bias = aux_tensors[0] if aux_tensors else torch.zeros(())
        cache[key](q, k, v, out, lse, softmax_scale, bias, block_sparse_tensors.count)
        return out, lse, None, None, None

    _flash_attn_fwd.compile_cache = {}  # type: ignore[attr-defined]
    _flash_attn_fwd.calls = 0  # type: ignore[attr-defined]
    mod._flash_attn_fwd = _flash_attn_fwd  # type: ignore[attr-defined]
    return mod


@pytest.fixture
def interface(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The stand-in, importable as ``flash_attn.cute.interface`` (with a ``fa_logging``)."""
    mod = _interface()
    _install(monkeypatch, mod)
    yield mod


def _install(monkeypatch: pytest.MonkeyPatch, mod: types.ModuleType) -> None:
    logging = types.ModuleType("flash_attn.cute.fa_logging")
    logging.get_fa_log_level = lambda: 0  # type: ignore[attr-defined]
    cute = types.ModuleType("flash_attn.cute")
    cute.interface = mod  # type: ignore[attr-defined]
    cute.fa_logging = logging  # type: ignore[attr-defined]
    package = types.ModuleType("flash_attn")
    package.cute = cute  # type: ignore[attr-defined]
    for name, module in [
        ("flash_attn", package),
        ("flash_attn.cute", cute),
        ("flash_attn.cute.interface", mod),
        ("flash_attn.cute.fa_logging", logging),
    ]:
        monkeypatch.setitem(sys.modules, name, module)
    fa4_op._fa4_log_level.cache_clear()
    fa4_replay.PROGRAMS.clear()


@pytest.fixture(autouse=True)
def _forget() -> Iterator[None]:
    yield
    fa4_op._fa4_log_level.cache_clear()  # it may hold the stand-in's getter
    fa4_replay.PROGRAMS.clear()


_GENERATED = """
def kernel(q, k, v, out, lse, bias, count, index):
    from flash_attn.cute.interface import _flash_attn_fwd

    def score_mod(score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return score

    {hash_line}
    _flash_attn_fwd(
        q, k, v, softmax_scale=0.5, score_mod=score_mod, mask_mod=None, out=out, lse=lse,
        block_sparse_tensors=Blocks(count, index, block_size=(128, 128)), aux_tensors=[bias],
    )
"""


def _generated(cute_hash: str | None = "kernel_abc_score", where: str | None = None) -> Any:
    """A kernel function as Inductor generates one (compiled from a file of its cache directory,
    ``where`` to put it elsewhere), calling the launcher with a fresh score function per call."""
    hash_line = f"score_mod.__cute_hash__ = {cute_hash!r}" if cute_hash else "pass"
    filename = os.path.join(where or cache_dir(), "zz", "czzgenerated.py")
    namespace: dict[str, Any] = {"Blocks": Blocks}
    exec(compile(_GENERATED.format(hash_line=hash_line), filename, "exec"), namespace)
    return namespace["kernel"]


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied to memory 256-byte aligned (the key reads ``data_ptr() % 256``; the CUDA
    allocator aligns every block so, the CPU one to 64 bytes)."""
    buffer = torch.empty(t.numel() + 256, dtype=t.dtype)
    start = (-buffer.data_ptr() % 256) // t.element_size()
    return buffer[start : start + t.numel()].view(t.shape).copy_(t)


def _inputs(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 6, 4, generator=g) for _ in range(3))
    bias = torch.randn(2, 6, 6, generator=g)
    count, index = torch.tensor([seed, 1]), torch.zeros(2, 3, dtype=torch.int32)
    return tuple(_aligned(t) for t in (q, k, v, bias, count, index))


def _reference(q, k, v, bias, count, index):  # type: ignore[no-untyped-def]
    s = q @ k.transpose(-1, -2) * 0.5 + bias + count.sum()
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _run(kernel: Any, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v, bias, count, index = _inputs(seed)
    out, lse = _aligned(torch.empty(2, 6, 4)), _aligned(torch.empty(2, 6))
    kernel(q, k, v, out, lse, bias, count, index)
    return out, lse


def _kinds() -> list[str]:
    return [type(entry).__name__ for entry in fa4_replay.PROGRAMS.values()]


def test_generated_calls_are_replayed_from_the_third_and_exact(interface: Any) -> None:
    assert fa4_generated.install()
    kernel = _generated()
    for seed in range(5):
        out, lse = _run(kernel, seed)
        want_out, want_lse = _reference(*_inputs(seed))
        torch.testing.assert_close(out, want_out, rtol=0, atol=0)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    # noted, recorded; the other three calls ran no launcher Python
    assert interface._flash_attn_fwd.__wrapped__.calls == 2
    assert _kinds() == ["Program"]


def test_other_callers_and_unhashed_functions_run_the_launcher(interface: Any) -> None:
    fa4_generated.install()
    launcher = interface._flash_attn_fwd
    elsewhere = _generated(where=os.path.join(os.path.dirname(cache_dir()), "not_inductor"))
    unhashed = _generated(cute_hash=None)
    for seed in range(3):
        for kernel in (elsewhere, unhashed):
            out, _ = _run(kernel, seed)
            torch.testing.assert_close(out, _reference(*_inputs(seed))[0], rtol=0, atol=0)
    assert launcher.__wrapped__.calls == 6 and not _kinds()


def test_each_generated_kernel_is_its_own_kind(interface: Any) -> None:
    fa4_generated.install()
    first, second = _generated("kernel_one_score"), _generated("kernel_two_score")
    for seed in range(3):
        _run(first, seed)
        _run(second, seed)
    assert _kinds() == ["Program", "Program"]
    assert interface._flash_attn_fwd.__wrapped__.calls == 4


def test_replays_are_off_with_the_switch(interface: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXATTN_ZOO_FA4_REPLAY", "0")
    fa4_generated.install()
    kernel = _generated()
    for seed in range(3):
        _run(kernel, seed)
    assert interface._flash_attn_fwd.__wrapped__.calls == 3 and not _kinds()


def test_a_check_run_must_write_the_outputs_it_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher writes ``out`` with a kernel the recording cannot see. Its check run must
    not pass on the values FA4's own call left in ``out``: the kind is refused, and every call
    (the recording's included) returns FA4's values."""
    mod = _interface(split_out=True)
    _install(monkeypatch, mod)
    fa4_generated.install()
    kernel = _generated()
    for seed in range(4):
        out, lse = _run(kernel, seed)
        q, k, v, *_ = _inputs(seed)
        s = q @ k.transpose(-1, -2) * 0.5
        torch.testing.assert_close(out, torch.softmax(s, -1) @ v, rtol=0, atol=0)
        torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=0, atol=0)
    assert _kinds() == ["Refused"], _kinds()
    assert "differed" in next(iter(fa4_replay.PROGRAMS.values())).reason


def test_the_wrapper_is_installed_once_and_keeps_fa4s_cache_and_signature(interface: Any) -> None:
    original = interface._flash_attn_fwd
    assert fa4_generated.install() and fa4_generated.install()
    wrapped = interface._flash_attn_fwd
    assert isinstance(wrapped, fa4_generated.Replayed) and wrapped.__wrapped__ is original
    assert wrapped.compile_cache is original.compile_cache
    replacement: dict[Any, Any] = {}
    wrapped.compile_cache = replacement  # FA4 and fa4_replay's recorder swap it through the module
    assert original.compile_cache is replacement
    assert inspect.signature(wrapped) == inspect.signature(original)


def test_install_without_fa4_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails
    assert fa4_generated.install() is False
