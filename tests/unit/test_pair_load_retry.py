"""Pair-loaded score mods on Triton flex: eager calls try torch's default forward pipeline first and
compile the shallower one only when the defaults fail to compile, and on CUDA the smallest
(``flex.PAIR_LOAD_SMALLEST``) only when that fails too.

On an H200 at D=64 the defaults fit Graphormer's gathered table and are faster there, while a dense
``bias[h, q, kv]`` needs two stages to compile (``flex.PAIR_LOAD_SHALLOW_HEAD_DIM``). The GPU's
failure is simulated here: the entry compiled with the default options raises Triton's message
(or another error: whatever the reason, the shallow pipeline is the route's former choice).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import plan_cache, score_mods
from flexattn_zoo.backends import flex as flex_backend
from flexattn_zoo.compile import CACHE
from flexattn_zoo.functions import FunctionMask
from flexattn_zoo.lru import LRUCache
from flexattn_zoo.testing import assert_matches_reference

SHALLOW = {"fwd_num_stages": flex_backend.PAIR_LOAD_STAGES}
SMALLEST = dict(flex_backend.PAIR_LOAD_SMALLEST)
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
    monkeypatch.setattr(flex_backend, "DEFAULTS_DO_NOT_COMPILE", LRUCache(8))


def _offer_pipelines(monkeypatch: pytest.MonkeyPatch, *, smallest: bool = False) -> None:
    """The shallow pipeline offered on this (CPU) device as on sm90, and with ``smallest`` the
    smallest one as on CUDA (off CUDA the real function offers none)."""
    real = flex_backend._pair_load_options

    def offered(p: Any, pipeline: str = "shallow") -> dict[str, Any]:
        if pipeline == "shallow":
            return dict(SHALLOW)
        return dict(SMALLEST) if smallest else real(p, pipeline)

    monkeypatch.setattr(flex_backend, "_pair_load_options", offered)


def _bias_call(
    monkeypatch: pytest.MonkeyPatch,
    error: Exception,
    shallow_error: Exception | None = None,
    smallest_error: Exception | None = None,
    smallest: bool = False,
) -> tuple[Any, _FailingEntry, list[Any]]:
    """Fresh plan and prepared-call caches, the pipelines offered (:func:`_offer_pipelines`), and
    the compile cache answering the default options' key with a failing entry (and the shallow
    and smallest keys too, with ``shallow_error`` / ``smallest_error``)."""
    _fresh_caches(monkeypatch)
    _offer_pipelines(monkeypatch, smallest=smallest)
    failing = _FailingEntry(error)
    asked: list[Any] = []
    real = CACHE.get_keyed

    def get_keyed(key: Any, options: Any, lse: bool, gqa: bool) -> Any:
        asked.append(options)
        if not options:
            return failing
        fails = shallow_error if options == SHALLOW else smallest_error
        return _FailingEntry(fails) if fails is not None else real(key, options, lse, gqa)

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


def test_any_failure_of_the_defaults_falls_back_to_the_shallow_pipeline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever the defaults' error, the shallow pipeline (the route's choice before it tried the
    defaults) runs the call: trying the defaults never makes a call fail that ran before."""
    (q, k, v, bias), failing, asked = _bias_call(monkeypatch, RuntimeError("some other Inductor failure"))
    with torch.no_grad():
        out = fz.attention(q, k, v, score_mod=bias, backend="flex_cpu")
    assert_matches_reference(out, q, k, v, score_mod=bias)
    assert failing.launches == 1 and asked == [None, SHALLOW]


def test_when_both_pipelines_fail_the_shallow_ones_error_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    (q, k, v, bias), failing, asked = _bias_call(
        monkeypatch, RuntimeError(TRITON_MESSAGE), shallow_error=ValueError("the score_mod is broken")
    )
    with torch.no_grad(), pytest.raises(ValueError, match="the score_mod is broken"):
        fz.attention(q, k, v, score_mod=bias, backend="flex_cpu")
    assert failing.launches == 1 and asked == [None, SHALLOW]
    assert not flex_backend.DEFAULTS_DO_NOT_COMPILE.get(flex_backend.CALLS.values()[0].key)


def test_when_the_shallow_pipeline_fails_too_the_smallest_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two pair-loaded tiles (Graphormer's int64 distances beside an edge bias) did not fit an
    H100's shared memory at D=64 even with two stages: on CUDA the smallest pipeline is the last
    retry, and later calls of the same entry key launch it at once."""
    (q, k, v, bias), failing, asked = _bias_call(
        monkeypatch, RuntimeError(TRITON_MESSAGE), shallow_error=RuntimeError(TRITON_MESSAGE), smallest=True
    )
    with torch.no_grad():
        out = fz.attention(q, k, v, score_mod=bias, backend="flex_cpu")
        assert_matches_reference(out, q, k, v, score_mod=bias)
        assert failing.launches == 1 and asked == [None, SHALLOW, SMALLEST], asked
        (call,) = flex_backend.CALLS.values()
        assert call.held[2] == SMALLEST
        assert flex_backend.DEFAULTS_DO_NOT_COMPILE.get(call.key) == SMALLEST
        flex_backend.CALLS.clear()
        plan_cache.PLANS.clear()
        asked.clear()
        fz.attention(q, k, v, score_mod=score_mods.Bias(bias=bias.bias * 2), backend="flex_cpu")
    assert asked == [SMALLEST], asked


def test_when_every_pipeline_fails_the_last_ones_error_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    (q, k, v, bias), failing, asked = _bias_call(
        monkeypatch,
        RuntimeError(TRITON_MESSAGE),
        shallow_error=RuntimeError(TRITON_MESSAGE),
        smallest_error=ValueError("the score_mod is broken"),
        smallest=True,
    )
    with torch.no_grad(), pytest.raises(ValueError, match="the score_mod is broken"):
        fz.attention(q, k, v, score_mod=bias, backend="flex_cpu")
    assert asked == [None, SHALLOW, SMALLEST], asked
    assert not flex_backend.DEFAULTS_DO_NOT_COMPILE.get(flex_backend.CALLS.values()[0].key)


def test_smallest_pipeline_only_on_cuda() -> None:
    """Shared memory is a GPU's limit: off CUDA no smallest pipeline is offered (a CPU call whose
    compile fails raises at once, not after compiling again)."""
    from flexattn_zoo.problem import Problem

    def problem(device_type: str) -> Problem:
        return Problem(
            batch=1, heads=2, kv_heads=2, q_len=64, kv_len=64, head_dim=64, dtype=torch.bfloat16,
            device_type=device_type, arch="sm90" if device_type == "cuda" else "cpu", requires_grad=False,
            score=score_mods.Bias(bias=torch.randn(1, 2, 64, 64)),
        )  # fmt: skip

    assert flex_backend._pair_load_options(problem("cuda"), "smallest") == SMALLEST
    assert flex_backend._pair_load_options(problem("cpu"), "smallest") == {}


def test_a_mask_without_pair_loads_has_no_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a pair-loaded tile may need the shallow pipeline: other problems keep their options."""
    _fresh_caches(monkeypatch)
    _offer_pipelines(monkeypatch, smallest=True)
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    with torch.no_grad():
        fz.attention(q, k, v, mask="causal", backend="flex_cpu")
    (call,) = flex_backend.CALLS.values()
    assert call.fallbacks == ()


def test_positional_gathers_start_on_the_shallow_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    """T5's bucketed table and Sandwich's table[kv - q] are gathers at indices computed from the
    positions (``Spec.pair_gathers``): on the H200 torch's defaults ran T5's about 1.9x slower
    and did not compile Sandwich's, so those problems compile the shallow pipeline first and
    have no retry. A chain that also reads a bias tile keeps the defaults-first order."""
    _fresh_caches(monkeypatch)
    _offer_pipelines(monkeypatch)
    asked: list[Any] = []
    real = CACHE.get_keyed

    def get_keyed(key: Any, options: Any, lse: bool, gqa: bool) -> Any:
        asked.append(options)
        return real(key, options, lse, gqa)

    monkeypatch.setattr(CACHE, "get_keyed", get_keyed)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=g) for _ in range(3))
    t5 = score_mods.RelPosBias(table=torch.randn(32, 2, generator=g))
    sandwich = score_mods.Sandwich(num_heads=2, max_len=64)
    bias = score_mods.Bias(bias=torch.randn(1, 2, 32, 32, generator=g))
    assert t5.gathers_pairs_only() and sandwich.gathers_pairs_only() and (t5 >> sandwich).gathers_pairs_only()
    assert not bias.gathers_pairs_only() and not (t5 >> bias).gathers_pairs_only()
    assert not score_mods.SoftCap(cap=20.0).gathers_pairs_only()  # reads nothing per pair
    ids = torch.zeros(32, dtype=torch.int64)
    raw = FunctionMask(fn=lambda b, h, q, kv: ids[q] == ids[kv])  # its own reads: no declared gather
    assert raw.loads_pairs() and not raw.gathers_pairs_only()
    with torch.no_grad():
        for score in (t5, sandwich, t5 >> sandwich):
            asked.clear()
            flex_backend.CALLS.clear()
            out = fz.attention(q, k, v, score_mod=score, mask="causal", backend="flex_cpu")
            assert_matches_reference(out, q, k, v, score_mod=score, mask="causal")
            (call,) = flex_backend.CALLS.values()
            assert call.options == SHALLOW and call.fallbacks == () and asked == [SHALLOW], asked
        flex_backend.CALLS.clear()
        fz.attention(q, k, v, score_mod=t5 >> bias, mask="causal", backend="flex_cpu")
        (call,) = flex_backend.CALLS.values()
        assert call.options is None and [f[1] for f in call.fallbacks] == [SHALLOW], call.fallbacks


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_shallow_pipeline_head_dims_on_sm90(head_dim: int) -> None:
    """On sm90 the shallow pipeline is offered to positional gathers up to D=128 (T5 ran 2.3x
    faster with it at D=128 on an H100) and to other pair loads up to D=64 (at D=128 the defaults
    fit them); never at D=256 nor off sm90."""
    from flexattn_zoo.problem import Problem

    def problem(score: Any, arch: str = "sm90") -> Problem:
        return Problem(
            batch=1, heads=2, kv_heads=2, q_len=64, kv_len=64, head_dim=head_dim, dtype=torch.bfloat16,
            device_type="cuda", arch=arch, requires_grad=False, score=score,
        )  # fmt: skip

    t5 = score_mods.RelPosBias(table=torch.randn(32, 2))
    bias = score_mods.Bias(bias=torch.randn(1, 2, 64, 64))
    gathers = flex_backend._pair_load_options(problem(t5))
    loads = flex_backend._pair_load_options(problem(bias))
    assert gathers == (SHALLOW if head_dim <= 128 else {})
    assert loads == (SHALLOW if head_dim <= 64 else {})
    assert flex_backend._pair_load_options(problem(t5, arch="sm100")) == {}


def _cuda_problem(score: Any = None, mask: Any = None, head_dim: int = 64) -> Any:
    from flexattn_zoo.problem import Problem

    return Problem(
        batch=2, heads=2, kv_heads=2, q_len=256, kv_len=256, head_dim=head_dim, dtype=torch.bfloat16,
        device_type="cuda", arch="sm90", requires_grad=False, score=score, mask=mask,
    )  # fmt: skip


def test_pair_tiles_count_what_is_read_per_pair() -> None:
    """``Spec.pair_tiles``: Graphormer reads its distances per pair, and its edge bias too when
    given (its table is gathered); a bias one tile; compositions add their parts; masks that read
    per query and per key none; a user callable one."""
    from flexattn_zoo import masks

    g = torch.Generator().manual_seed(2)
    one, two = score_mods.Graphormer.examples(32, 32, 2, 2)
    assert (one.edge_bias, two.edge_bias is not None) == (None, True)
    bias = score_mods.Bias(bias=torch.randn(1, 2, 32, 32, generator=g))
    assert (one.pair_tiles(), two.pair_tiles(), bias.pair_tiles()) == (1, 2, 1)
    assert (bias >> one).pair_tiles() == 2 and (bias >> two).pair_tiles() == 3
    assert score_mods.Sandwich(num_heads=2, max_len=64).pair_tiles() == 1  # its table is not a field
    assert score_mods.SoftCap(cap=20.0).pair_tiles() == 0
    ids = torch.tensor([0] * 16 + [1] * 16)
    assert masks.Document(doc_ids=ids).pair_tiles() == 0 and masks.Causal().pair_tiles() == 0
    assert FunctionMask(fn=lambda b, h, q, kv: ids[q] == ids[kv]).pair_tiles() == 1


def test_traced_calls_take_the_smallest_pipeline_for_two_tiles_per_pair() -> None:
    """A traced call cannot retry after its caller's compile error: with two or more tiles per
    pair (Graphormer with an edge bias: out of an H100's shared memory at D=64 with two stages,
    also traced) it compiles the smallest pipeline at once; one tile keeps the shallow one, as do
    head dims above 64, positional gathers and CPU problems."""
    from flexattn_zoo.backends import BY_NAME

    one, two = score_mods.Graphormer.examples(256, 256, 2, 2)
    flex = BY_NAME["flex"]
    pipeline = flex_backend._traced_pair_pipeline
    assert pipeline(_cuda_problem(two)) == "smallest"
    assert flex.options(_cuda_problem(two), pair_loads=pipeline(_cuda_problem(two))) == SMALLEST
    assert pipeline(_cuda_problem(one)) == "shallow"
    assert flex.options(_cuda_problem(one), pair_loads=pipeline(_cuda_problem(one))) == SHALLOW
    assert pipeline(_cuda_problem(two, head_dim=128)) == "shallow"
    t5 = score_mods.RelPosBias(table=torch.randn(32, 2))
    sandwich = score_mods.Sandwich(num_heads=2, max_len=64)
    assert pipeline(_cuda_problem(t5 >> sandwich)) == "shallow"  # gathers only
    cpu = dataclasses.replace(_cuda_problem(two), device_type="cpu", arch="cpu")
    assert pipeline(cpu) == "shallow"


def _composed_examples() -> list[tuple[str, Any]]:
    """Every registered example, and compositions of them: ``& Causal()``, ``PerDocument`` around
    each mask, ``>> Bias`` after each score."""
    from flexattn_zoo import masks
    from flexattn_zoo.testing.checks import spec_examples

    found: list[tuple[str, Any]] = []
    ids = torch.tensor([0] * 24 + [1] * 40)
    bias = score_mods.Bias(bias=torch.randn(1, 4, 64, 64))
    for name, spec in spec_examples("mask", 64, 64, batch=2, heads=4):
        found += [(name, spec), (f"{name} & causal", spec & masks.Causal())]
        try:
            wrapped = masks.PerDocument(inner=spec, documents=masks.Document(doc_ids=ids))
        except (TypeError, ValueError):
            continue  # an inner mask PerDocument does not take
        found.append((f"per_document({name})", wrapped))
    for name, spec in spec_examples("score", 64, 64, batch=2, heads=4):
        found += [(name, spec), (f"{name} >> bias", spec >> bias)]
    return found


@pytest.mark.parametrize(
    ("name", "spec"), _composed_examples(), ids=lambda x: x if isinstance(x, str) else ""
)
def test_pair_tiles_agree_with_loads_pairs(name: str, spec: Any) -> None:
    """A spec counts tiles per pair exactly when it loads pairs: a wrapper that loaded pairs but
    counted none would let a traced call keep a pipeline its tiles do not fit."""
    assert (spec.pair_tiles() > 0) == spec.loads_pairs(), (name, spec.pair_tiles(), spec.loads_pairs())


def test_per_document_pair_tiles_trace_with_a_callable_made_in_the_graph() -> None:
    """``PerDocument.pair_tiles`` of a raw callable's mask made inside the compiled function: the
    callable's closure is not walked (Dynamo cannot trace that), as ``loads_pairs`` does not."""
    from flexattn_zoo import masks

    table = torch.rand(16, 16) > 0.5
    ids = torch.tensor([0] * 6 + [1] * 10)

    def count(x: torch.Tensor) -> torch.Tensor:
        inner = FunctionMask(fn=lambda b, h, q, kv: table[q, kv])
        spec = masks.PerDocument(inner=inner, documents=masks.Document(doc_ids=ids))
        return x * spec.pair_tiles()

    assert torch.compile(count, fullgraph=True, backend="eager")(torch.ones(2)).tolist() == [1.0, 1.0]


def test_a_traced_call_compiles_the_pipeline_its_tiles_need(monkeypatch: pytest.MonkeyPatch) -> None:
    """``FlexBackend._run_traced`` passes flex_attention the options of ``_traced_pair_pipeline``
    (the smallest pipeline for Graphormer's two tiles on sm90), not the shallow one."""
    from flexattn_zoo.backends import BY_NAME

    seen: list[Any] = []

    class Stop(Exception):
        pass

    def recorder(*args: Any, kernel_options: Any = None, **kwargs: Any) -> Any:
        seen.append(kernel_options)
        raise Stop

    monkeypatch.setattr(flex_backend._compat, "flex_attention", recorder)
    q, k, v = (torch.randn(2, 2, 256, 64) for _ in range(3))
    for spec, expected in zip(
        score_mods.Graphormer.examples(256, 256, 2, 2), (SHALLOW, SMALLEST), strict=True
    ):
        problem = _cuda_problem(spec)
        with pytest.raises(Stop):
            BY_NAME["flex"]._run_traced(q, k, v, problem, scale=0.125, block_mask=None)
        assert seen[-1] == expected, seen
