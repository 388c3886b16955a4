"""Mods that FA4's CuTe flex kernel (route ``flex_flash``) computes wrongly: a per-head (or
per-batch) value selected with ``torch.where`` from ``b`` / ``h`` alone.

Measured on an H100 (flash-attn-4 4.0.0b36, torch 2.11; benchmarks/flex_flash_mod_ops_probe.py
and flex_flash_alibi_probe.py): ``score - torch.where(h == k, slope_k, ...) * (q_idx - kv_idx)``
gave errors of order 1 on ``BACKEND="FLASH"`` while Triton flex matched float64, and so did
``Alibi`` with given slopes, spelled that way then. The route now refuses such user functions
(``functions.SELECTS_PER_HEAD``, a hazard of the ``flash`` kernel only), and no preset is spelled
so: both checked here on the CPU by tracing the functions, as the route's planning does. A user
function traced by ``torch.compile`` before any eager call could probe it is judged by its code
(``functions.MAY_SELECT_PER_HEAD``), checked inside ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from subclassed_specs import SquaredDistance

import flexattn_zoo as fz
from flexattn_zoo import _compat, functions, masks, score_mods
from flexattn_zoo.backends.flex import FLEX, FLEX_FLASH
from flexattn_zoo.coercion import as_mask_spec, as_score_spec
from flexattn_zoo.problem import Problem
from flexattn_zoo.testing import assert_matches_reference
from flexattn_zoo.testing.checks import spec_examples

SELECTS = functions.SELECTS_PER_HEAD
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


def where_slope_times_distance(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    slope = torch.where(h == 0, 0.5, torch.where(h == 1, 0.25, 0.125))
    return score - slope * (q_idx - kv_idx)


def where_on_batch(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return score + torch.where(b == 0, 1.0, -1.0)


def masked_fill_slope(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    slope = torch.full_like(score, 0.5).masked_fill(h == 1, 0.25)
    return score - slope * (q_idx - kv_idx)


def lerp_slope(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    slope = torch.lerp(torch.full_like(score, 0.5), torch.full_like(score, 0.25), (h == 1).float())
    return score - slope * (q_idx - kv_idx)


def where_with_a_constant_from_score(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    slope = torch.where(h == 1, 0.25, torch.full_like(score, 0.5))
    return score - slope * (q_idx - kv_idx)


def per_head_window(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= torch.where(h == 0, 4, 8))


def table_slope_times_distance(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return score - SLOPES[h] * (q_idx - kv_idx)


def indicator_slope_times_distance(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    slope = (h == 0).float() * 0.5 + (h == 1).float() * 0.25
    return score - slope * (q_idx - kv_idx)


def where_between_index_terms(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    distance = (q_idx - kv_idx).float()
    return score - torch.where(h == 0, 0.5 * distance, 0.25 * distance)


def where_on_indices(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return torch.where(q_idx > 3, kv_idx <= q_idx, kv_idx == 0)


def _hazards(spec: Any, kernel: str) -> tuple[str, ...]:
    return functions.kernel_hazards((spec,), kernel)


@pytest.mark.parametrize(
    ("kind", "fn"),
    [
        ("score", where_slope_times_distance),
        ("score", where_on_batch),
        ("score", masked_fill_slope),
        ("score", lerp_slope),
        ("score", where_with_a_constant_from_score),
        ("mask", per_head_window),
    ],
    ids=[
        "where_slope_times_distance",
        "where_on_batch",
        "masked_fill_slope",
        "lerp_slope",
        "where_with_a_constant_from_score",
        "per_head_window",
    ],
)
def test_a_per_head_where_is_a_hazard_of_the_flash_kernel_only(kind: str, fn: Any) -> None:
    spec = as_score_spec(fn) if kind == "score" else as_mask_spec(fn)
    assert _hazards(spec, "flash") == (SELECTS,)
    assert _hazards(spec, "cuda") == ()
    assert _hazards(spec, "cpu") == ()


@pytest.mark.parametrize(
    ("kind", "fn"),
    [
        ("score", table_slope_times_distance),
        ("score", indicator_slope_times_distance),
        ("score", where_between_index_terms),
        ("mask", where_on_indices),
    ],
    ids=["table", "indicators", "where_between_index_terms", "where_on_indices"],
)
def test_spellings_the_flash_kernel_computes_exactly_are_not_hazards(kind: str, fn: Any) -> None:
    spec = as_score_spec(fn) if kind == "score" else as_mask_spec(fn)
    assert _hazards(spec, "flash") == ()


def test_a_spec_subclass_with_a_per_head_where_is_a_flash_hazard() -> None:
    """The test suite's ``SquaredDistance`` (ALiBi's slopes on ``(i - j)^2``, its slopes picked by
    a ``torch.where`` chain on ``h``): 1.3-1.7 max error on flex_flash (H100)."""
    assert _hazards(SquaredDistance(num_heads=4), "flash") == (SELECTS,)


def _cuda_problem(mask: Any, score: Any) -> Problem:
    return Problem(
        batch=2, heads=4, kv_heads=4, q_len=256, kv_len=256, head_dim=64, dtype=torch.bfloat16,
        device_type="cuda", arch="sm90", requires_grad=False, mask=mask, score=score,
    )  # fmt: skip


def test_flex_flash_refuses_it_and_triton_flex_takes_it() -> None:
    p = _cuda_problem(masks.Causal(), as_score_spec(where_slope_times_distance))
    reasons = FLEX_FLASH.mask_reasons(p)
    assert reasons == [f"torch's compiled flex kernel cannot run a mod that {SELECTS}"]
    assert FLEX.mask_reasons(p) == []


def test_the_cpu_flex_kernel_runs_it_exactly() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, generator=g) for _ in range(3))
    out = fz.attention(q, k, v, mask=masks.Causal(), score_mod=where_slope_times_distance, backend="flex_cpu")
    assert_matches_reference(out, q, k, v, mask=masks.Causal(), score_mod=where_slope_times_distance)


def _preset_functions(spec: Any, kind: str, q_len: int, kv_len: int) -> list[Any]:
    """Every function a flex route may hand a kernel for ``spec``."""
    if kind == "score":
        return [
            spec.score_mod(fast=fast, future_keys_hidden=hidden)
            for fast in (False, True)
            for hidden in (False, True)
        ]
    bound = spec.bind(q_len, kv_len)
    return [f for f in (bound.mask_mod(), bound.starts_mask_mod(q_len, kv_len)) if f is not None]


@pytest.mark.parametrize("kind", ["mask", "score"])
@pytest.mark.parametrize("heads", [4, 6])
def test_no_preset_selects_a_per_head_value_with_where(kind: str, heads: int) -> None:
    """Every registered family's examples (at a power-of-two head count and another), traced as
    the route's planning traces user functions: ``Alibi`` with given slopes, and with 6 heads
    (a second slope series), was a ``torch.where`` chain on ``h`` before."""
    q_len = kv_len = 64
    args = [torch.zeros((), dtype=torch.int32) for _ in range(4)]
    if kind == "score":
        args.insert(0, torch.zeros(()))
    checked = 0
    for name, spec in spec_examples(kind, q_len, kv_len, batch=2, heads=heads):
        for fn in _preset_functions(spec, kind, q_len, kv_len):
            traced = functions._trace_ops(fn, tuple(args))
            assert traced.signature is not None, f"{name}: {spec!r} failed when traced"
            assert SELECTS not in traced.hazards, f"{name}: {spec!r}"
            checked += 1
    assert checked > 10


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_alibi_given_slopes_and_odd_head_counts_keep_their_values(dtype: torch.dtype) -> None:
    """The respelled ALiBi functions give the oracle's scores, everywhere and (the variant for
    masks that hide later keys) on the keys at or before each query."""
    heads, n = 6, 16
    scores = torch.zeros(1, heads, n, n, dtype=dtype)
    b, h, i, j = torch.meshgrid(
        torch.arange(1), torch.arange(heads), torch.arange(n), torch.arange(n), indexing="ij"
    )
    past = j <= i
    # float64: the oracle's own precision, so exactly; float32: the oracle rounded once, against
    # slopes and products computed in float32.
    rtol = 0.0 if dtype == torch.float64 else 1e-6
    for spec in (
        score_mods.Alibi(num_heads=heads),
        score_mods.Alibi(num_heads=heads, slopes=(0.5, 0.25, 0.2, 0.125, 0.1, 0.0625)),
        score_mods.Alibi(num_heads=heads, signed=True),
    ):
        want = spec.dense(scores.double()).to(dtype)
        got = spec.score_mod()(scores, b, h, i, j)
        torch.testing.assert_close(got, want, rtol=rtol, atol=0, msg=repr(spec))
        got_past = spec.score_mod(future_keys_hidden=True)(scores, b, h, i, j)
        torch.testing.assert_close(got_past[past], want[past], rtol=rtol, atol=0, msg=repr(spec))


MAY = functions.MAY_SELECT_PER_HEAD


def PRESET() -> Any:  # noqa: N802 - a constant's name: the preset case of the test below
    return score_mods.Alibi(num_heads=4)


def plain_distance(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return score - 0.1 * (q_idx - kv_idx)


def _traced_hazards(make_spec: Any) -> tuple[bool, bool]:
    """Whether the spec ``make_spec()`` builds, while ``torch.compile(fullgraph=True)`` traces,
    reports :data:`MAY` and :data:`SELECTS` for the flash kernel (a Python decision in the trace,
    so the compiled function's output carries it)."""

    def f(x: torch.Tensor) -> torch.Tensor:
        found = functions.kernel_hazards((make_spec(),), "flash")
        return x + (MAY in found) + 2 * (SELECTS in found)

    torch._dynamo.reset()
    got = int(torch.compile(f, backend="eager", fullgraph=True)(torch.zeros(())))
    return bool(got & 1), bool(got & 2)


@pytest.mark.parametrize(
    ("make", "want"),
    [
        pytest.param(lambda: as_score_spec(where_slope_times_distance), (True, False), id="raw_where"),
        pytest.param(lambda: as_score_spec(masked_fill_slope), (True, False), id="raw_masked_fill"),
        pytest.param(lambda: as_score_spec(plain_distance), (False, False), id="raw_plain"),
        pytest.param(lambda: as_mask_spec(per_head_window), (True, False), id="raw_mask"),
        # its where is in a module-level helper (_slope), reached through the function's globals
        pytest.param(lambda: SquaredDistance(num_heads=4), (True, False), id="spec_subclass"),
        pytest.param(PRESET, (False, False), id="preset"),
    ],
)
def test_traced_before_any_probe_flex_flash_refuses_what_may_select(
    make: Any, want: tuple[bool, bool]
) -> None:
    """Traced, a function cannot be called on real tensors: its code decides. A raw callable
    passed inside the compiled region, or a spec's function on its first (traced) call, that
    names where / masked_fill / lerp may select a per-head value, so flex_flash refuses it; one
    that does not, and the presets (not probed at all), keep flex_flash. Before torch 2.13 the
    walk cannot run at trace time (and is not traced in the graph): every such function is
    refused."""
    if _compat.TORCH_VERSION < functions.TRACE_TIME_WALK_SINCE and make is not PRESET:
        want = (True, False)
    assert _traced_hazards(make) == want


def test_a_spec_probed_eagerly_keeps_its_verdict_when_traced() -> None:
    """An eager call leaves the probe's verdict on the spec object; traced calls of that object
    read it instead of the code (here the precise hazard, not the possible one)."""
    spec = SquaredDistance(num_heads=4)
    assert _hazards(spec, "flash") == (SELECTS,)  # probes eagerly, keeps the verdict
    assert _traced_hazards(lambda: spec) == (False, True)


# ---- loads of a captured tensor of one element ------------------------------------------------
# H200 with FA4 (flash-attn-4 4.0.0b36, torch 2.11): Inductor's CuTe mods load such a tensor at a
# fixed index, which the CuTe DSL rejects while compiling ("Expected TensorSSA, but got <class
# 'int'>"); Dense([[[[True]]]]) and one-block BlockSelect examples failed so on flex_flash.

ONE_ELEMENT = functions.LOADS_ONE_ELEMENT
OFFSET = torch.tensor(3, dtype=torch.int32)
FLAG = torch.ones(1, 1, dtype=torch.bool)
KEY_TABLE = torch.arange(64, dtype=torch.int32) % 5


def causal_plus_captured_offset(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return kv_idx <= q_idx + OFFSET


def causal_and_a_captured_flag(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return FLAG[0, 0] & (kv_idx <= q_idx)


FLAG0 = torch.tensor(True)
ONES11 = torch.ones(1, 1, dtype=torch.bool)
PAIRS = torch.arange(128, dtype=torch.int32).view(64, 2)


def returns_the_captured_flag(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return FLAG0  # no op reads it: the kernel loads the result as it is


def indexes_a_table_whose_every_dim_is_one(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    # Indices that depend on q_idx / kv_idx, but the table has one element: a fixed-index load.
    return ONES11[q_idx * 0, kv_idx * 0] & (kv_idx <= q_idx)


def indexes_a_column_at_a_constant(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return (PAIRS[q_idx, 0] >= PAIRS[kv_idx, 0]) & (kv_idx <= q_idx)


def scales_by_a_tensor_it_makes(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return score * torch.tensor(0.5) + torch.where(kv_idx <= q_idx, 0.0, torch.tensor(-1.0))


def causal_plus_a_python_offset(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return kv_idx <= q_idx + 3


def same_key_class(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return KEY_TABLE[q_idx] == KEY_TABLE[kv_idx]


@pytest.mark.parametrize(
    "fn",
    [
        causal_plus_captured_offset,
        causal_and_a_captured_flag,
        returns_the_captured_flag,
        indexes_a_table_whose_every_dim_is_one,
    ],
)
def test_a_one_element_capture_is_a_hazard_of_the_flash_kernel_only(fn: Any) -> None:
    spec = as_mask_spec(fn)
    assert _hazards(spec, "flash") == (ONE_ELEMENT,)
    assert _hazards(spec, "cuda") == ()
    assert _hazards(spec, "cpu") == ()


@pytest.mark.parametrize(
    ("kind", "fn"),
    [
        ("mask", causal_plus_a_python_offset),
        ("mask", same_key_class),
        ("mask", indexes_a_column_at_a_constant),  # at 2 * q_idx: not a fixed index
        ("score", scales_by_a_tensor_it_makes),  # made by the call, not captured
    ],
    ids=["python_number", "indexed_table", "constant_column", "made_tensors"],
)
def test_python_numbers_indexed_tables_and_made_tensors_are_not_one_element_loads(kind: str, fn: Any) -> None:
    spec = as_score_spec(fn) if kind == "score" else as_mask_spec(fn)
    assert _hazards(spec, "flash") == ()


def test_a_score_closure_reaching_an_unread_one_element_tensor_keeps_flex_flash() -> None:
    """The probe decides for callables: a 0-d tensor the function can reach but never reads
    (a module's step counter) is no load."""

    class Biased(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("step", torch.zeros((), dtype=torch.long))
            self.register_buffer("bias", torch.linspace(-1.0, 1.0, 64))

        def score(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return score + self.bias[kv_idx]

    spec = as_score_spec(Biased().score)
    assert not spec.reads_scalar_tensors()
    assert FLEX_FLASH.mask_reasons(_cuda_problem(masks.Causal(), spec)) == []


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: (masks.Dense(mask=torch.ones(1, 1, 1, 1, dtype=torch.bool)), None), id="dense"),
        pytest.param(
            lambda: (masks.BlockSelect(indices=torch.tensor([[0]]), block_size=256), None), id="block_select"
        ),
        pytest.param(lambda: (masks.Causal(), score_mods.Bias(bias=torch.ones(1, 1, 1, 1))), id="bias"),
        pytest.param(lambda: (masks.Band(lo=-2, hi=0), None), id="band"),
    ],
)
def test_flex_flash_refuses_one_element_tables_and_triton_flex_takes_them(make: Any) -> None:
    mask, score = make()
    p = _cuda_problem(mask, score)
    assert any("captured tensor of one element" in r for r in FLEX_FLASH.mask_reasons(p))
    assert FLEX.mask_reasons(p) == []


def test_a_declared_and_a_traced_load_give_one_reason() -> None:
    """Presets declare the load and callables are traced for it: one hazard, named once."""
    p = _cuda_problem(masks.Band(lo=-2, hi=0) & as_mask_spec(causal_plus_captured_offset), None)
    assert FLEX_FLASH.mask_reasons(p) == [f"torch's compiled flex kernel cannot run a mod that {ONE_ELEMENT}"]


def test_wider_tables_keep_flex_flash() -> None:
    keys = torch.rand(2, 1, 1, 256) < 0.5
    p = _cuda_problem(masks.Dense(mask=keys), score_mods.Bias(bias=torch.ones(1, 4, 1, 1)))
    assert FLEX_FLASH.mask_reasons(p) == []


@pytest.mark.parametrize("kind", ["mask", "score"])
@pytest.mark.parametrize(("length", "heads"), [(64, 4), (256, 1)])
def test_presets_declare_every_one_element_load(kind: str, length: int, heads: int) -> None:
    """flex_flash refuses a preset by its ``reads_scalar_tensors`` (presets are not traced when
    planned), so each function that route hands its kernel (a bound mask's ``mask_mod``; every
    score variant), traced on 0-d indices, must load a one-element tensor only where the spec
    declares it. ``Dense`` of one element and a one-block ``BlockSelect`` did not."""
    args = [torch.zeros((), dtype=torch.int32) for _ in range(4)]
    if kind == "score":
        args.insert(0, torch.zeros(()))
    loads = 0
    for name, spec in spec_examples(kind, length, length, batch=2, heads=heads):
        declared = (spec.bind(length, length) if kind == "mask" else spec).reads_scalar_tensors()
        fns = _preset_functions(spec, kind, length, length)[: 1 if kind == "mask" else None]
        for fn in fns:
            traced = functions._trace_ops(fn, tuple(args))
            assert traced.signature is not None, f"{name}: {spec!r} failed when traced"
            if ONE_ELEMENT in traced.hazards:
                assert declared, f"{name}: {spec!r} loads a one-element tensor it does not declare"
                loads += 1
    assert kind == "score" or loads > 0  # the masks' examples include such loads (OffsetCausal, Dense)


@pytest.mark.parametrize(
    "spec",
    [
        score_mods.Bias(bias=torch.ones(1, 1, 1, 1)),
        score_mods.Bias(bias=torch.ones(1, 1, 1, 1)) >> score_mods.SoftCap(cap=30.0),
    ],
    ids=["bias", "chain"],
)
def test_a_one_element_score_table_is_traced_and_declared(spec: Any) -> None:
    args = (torch.zeros(()), *(torch.zeros((), dtype=torch.int32) for _ in range(4)))
    assert ONE_ELEMENT in functions._trace_ops(spec.score_mod(), args).hazards
    assert spec.reads_scalar_tensors()


def test_traced_before_any_probe_a_one_element_capture_loses_flex_flash() -> None:
    """Traced, a raw callable that reaches a tensor of one element is taken to load it; one that
    reaches only a larger table keeps flex_flash. Before torch 2.13 Dynamo cannot walk what they
    reach: both lose flex_flash, as functions that may select a per-head value."""

    def f(x: torch.Tensor) -> torch.Tensor:
        offset = functions.kernel_hazards((as_mask_spec(causal_plus_captured_offset),), "flash")
        table = functions.kernel_hazards((as_mask_spec(same_key_class),), "flash")
        return x + (ONE_ELEMENT in offset) + 2 * (ONE_ELEMENT in table) + 4 * bool(offset) + 8 * bool(table)

    torch._dynamo.reset()
    got = int(torch.compile(f, backend="eager", fullgraph=True)(torch.zeros(())))
    assert got == (4 + 8 if _compat.TORCH_VERSION < functions.TRACE_TIME_WALK_SINCE else 1 + 4)


def _assert_traced_equals_eager(call: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``call`` compiles under ``torch.compile(fullgraph=True)`` (no graph break) and gives what
    it gives eagerly."""
    torch._dynamo.reset()
    try:
        out = torch.compile(call, fullgraph=True, backend="eager")(q, k, v)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(out, call(q, k, v))


@pytest.mark.parametrize("route", ["dense", "flex_cpu"])
def test_a_raw_callable_over_a_closure_traces_after_its_hazard_walk(route: str) -> None:
    """Traced, a raw callable's hazards are read from what it reaches; walking its closure cells
    in the graph made Dynamo fail when it then inlined the same function ("Expected CellVariable,
    got UserDefinedObjectVariable in load_cell"): the traced call compiles, with no graph break,
    and equals the eager one."""
    ids = torch.tensor([[0] * 20 + [1] * 44, [0] * 50 + [1] * 14])

    def same_doc_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (ids[b, q_idx] == ids[b, kv_idx]) & (kv_idx <= q_idx)

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 64, 32, generator=g) for _ in range(3))

    def call(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return fz.attention(a, b, c, mask=same_doc_causal, backend=route)

    _assert_traced_equals_eager(call, q, k, v)


@pytest.mark.parametrize("chained", [False, True], ids=["alone", "chained"])
@pytest.mark.parametrize("route", ["dense", "auto"])
def test_a_raw_score_callable_over_a_closure_traces(route: str, chained: bool) -> None:
    """A score callable closing over a tensor of slopes, traced: whether it captures tensors that
    require grad is read at trace time outside the graph (walking its cells in the graph broke
    Dynamo's later inlining of it, "Expected CellVariable ... in load_cell"); the traced call
    compiles with no graph break and equals the eager one."""
    slopes = torch.tensor([0.5, 0.25])

    def sloped(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score - slopes[h] * (q_idx - kv_idx)

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=g) for _ in range(3))

    score: Any = as_score_spec(sloped) >> score_mods.SoftCap(cap=30.0) if chained else sloped

    def call(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return fz.attention(a, b, c, mask="causal", score_mod=score, backend=route)

    _assert_traced_equals_eager(call, q, k, v)


def test_traced_captures_grad_is_read_outside_the_graph() -> None:
    """Traced, whether a raw score callable captures a tensor that requires grad: read at trace
    time from torch 2.13 for a function made outside the compiled region (a learned slope: yes; a
    constant one: no), taken as yes for one made inside it and before torch 2.13."""
    learned = torch.tensor([0.5, 0.25], requires_grad=True)
    fixed = torch.tensor([0.5, 0.25])

    def with_learned(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score - learned[h] * (q_idx - kv_idx)

    def with_fixed(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score - fixed[h] * (q_idx - kv_idx)

    def f(x: torch.Tensor) -> torch.Tensor:
        made_inside = as_score_spec(lambda s, b, h, q, kv: s * 0.5).captures_grad_tensors()
        return (
            x
            + as_score_spec(with_learned).captures_grad_tensors()
            + 2 * as_score_spec(with_fixed).captures_grad_tensors()
            + 4 * made_inside
        )

    torch._dynamo.reset()
    got = int(torch.compile(f, backend="eager", fullgraph=True)(torch.zeros(())))
    assert got == (1 + 2 + 4 if _compat.TORCH_VERSION < functions.TRACE_TIME_WALK_SINCE else 1 + 4)
