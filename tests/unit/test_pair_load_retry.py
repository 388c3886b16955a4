"""Pair-loaded score mods on Triton flex: eager calls try torch's default forward pipeline first and
compile the shallower one only when the defaults run out of shared memory.

On an H200 at D=64 the defaults fit Graphormer's gathered table and are faster there, while a dense
``bias[h, q, kv]`` needs two stages to compile (``flex.PAIR_LOAD_SHALLOW_HEAD_DIM``). The GPU's
failure is simulated here: the entry compiled with the default options raises Triton's message.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import plan_cache, score_mods
from flexattn_zoo.backends import flex as flex_backend
from flexattn_zoo.compile import CACHE
from flexattn_zoo.lru import LRUCache
from flexattn_zoo.testing import assert_matches_reference

SHALLOW = {"fwd_num_stages": flex_backend.PAIR_LOAD_STAGES}
TRITON_MESSAGE = (
    "No valid triton configs. OutOfMemoryError: out of resource: triton_tem_fused_flex_attention_0 "
    "Required: 245760 Hardware limit:232448 Reducing block sizes or `num_stages` may help."
)


class _FailingEntry:
    """A compiled entry whose every launch fails as a kernel too large for shared memory does."""

    retired = False

    def __init__(self, error: Exception) -> None:
        self.error, self.launches = error, 0

    def run(self, *args: Any) -> Any:
        self.launches += 1
        raise self.error


def _fresh_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_cache, "PLANS", LRUCache(8))
    monkeypatch.setattr(flex_backend, "CALLS", LRUCache(8))
    monkeypatch.setattr(flex_backend, "DEFAULTS_OUT_OF_SHARED_MEMORY", LRUCache(8))


def _bias_call(monkeypatch: pytest.MonkeyPatch, error: Exception) -> tuple[Any, _FailingEntry, list[Any]]:
    """Fresh plan and prepared-call caches, the shallow pipeline offered on this (CPU) device as on
    sm90, and the compile cache answering the default options' key with a failing entry."""
    _fresh_caches(monkeypatch)
    monkeypatch.setattr(flex_backend, "_pair_load_options", lambda p: dict(SHALLOW))
    failing = _FailingEntry(error)
    asked: list[Any] = []
    real = CACHE.get_keyed

    def get_keyed(key: Any, options: Any, lse: bool, gqa: bool) -> Any:
        asked.append(options)
        return failing if not options else real(key, options, lse, gqa)

    monkeypatch.setattr(CACHE, "get_keyed", get_keyed)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=g) for _ in range(3))
    bias = score_mods.Bias(bias=torch.randn(1, 2, 32, 32, generator=g))
    return (q, k, v, bias), failing, asked


def test_defaults_out_of_shared_memory_retry_with_the_shallow_pipeline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (q, k, v, bias), failing, asked = _bias_call(monkeypatch, RuntimeError(TRITON_MESSAGE))
    with torch.no_grad():
        out = fz.attention(q, k, v, score_mod=bias, backend="flex_cpu")
        assert_matches_reference(out, q, k, v, score_mod=bias)
        assert failing.launches == 1 and asked == [None, SHALLOW]
        (call,) = flex_backend.CALLS.values()
        assert call.held[2] == SHALLOW and call.options is None
        # Later calls go straight to the shallow entry: a plan-cache hit, a call planned afresh,
        # and a new bias of the same shape after the prepared call is gone (a new bias each step).
        fz.attention(q, k, v, score_mod=bias, backend="flex_cpu")
        fz.attention(q, k, v, score_mod=score_mods.Bias(bias=bias.bias.clone()), backend="flex_cpu")
        flex_backend.CALLS.clear()
        plan_cache.PLANS.clear()
        fz.attention(q, k, v, score_mod=score_mods.Bias(bias=bias.bias * 2), backend="flex_cpu")
    assert failing.launches == 1 and asked[0] is None and all(o == SHALLOW for o in asked[1:]), asked


def test_other_compile_errors_are_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    (q, k, v, bias), failing, asked = _bias_call(monkeypatch, RuntimeError("some other Inductor failure"))
    with torch.no_grad(), pytest.raises(RuntimeError, match="some other Inductor failure"):
        fz.attention(q, k, v, score_mod=bias, backend="flex_cpu")
    assert failing.launches == 1 and asked == [None]


def test_a_mask_without_pair_loads_has_no_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a pair-loaded tile may need the shallow pipeline: other problems keep their options."""
    _fresh_caches(monkeypatch)
    monkeypatch.setattr(flex_backend, "_pair_load_options", lambda p: dict(SHALLOW))
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    with torch.no_grad():
        fz.attention(q, k, v, mask="causal", backend="flex_cpu")
    (call,) = flex_backend.CALLS.values()
    assert call.shallow is None


def test_out_of_shared_memory_reads_wrapped_causes() -> None:
    class OutOfResources(Exception):  # Triton's class, by name
        pass

    wrapped = RuntimeError("backend compiler failed")
    wrapped.__cause__ = OutOfResources("shared memory")
    assert flex_backend.out_of_shared_memory(wrapped)
    assert flex_backend.out_of_shared_memory(RuntimeError(TRITON_MESSAGE))
    assert not flex_backend.out_of_shared_memory(RuntimeError("index out of range"))
    looped = RuntimeError("a")
    looped.__context__ = looped
    assert not flex_backend.out_of_shared_memory(looped)
