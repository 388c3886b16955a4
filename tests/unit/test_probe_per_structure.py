"""The probe of a user function is kept per structure, so a loop that builds its function (or its
spec) anew every step over new tensors probes once; and a structure is never taken for another.

A training loop with per-step document ids, or a generation loop building its mask from the
step's lengths, makes a new closure (or a new spec value) every step. The probe (a vmap call and a
traced call, milliseconds) ran on each. A callable of a structure already probed (the function's
code, the scalars it captures, its tensors' shapes, dtypes and devices) now takes the verdict
where its own traced call at zero indices runs the same ops; one that reads a value on the host
or makes a shape from one, and what the structure walk cannot key, are probed per value.
"""

from __future__ import annotations

import collections
import functools
import gc
import math
import weakref
from typing import Any

import pytest
import torch
from zoo_oracles import table

import flexattn_zoo as fz
from flexattn_zoo import functions
from flexattn_zoo.spec import MaskMod, MaskSpec, spec_dataclass
from flexattn_zoo.testing import assert_matches_reference

B, H, L, D = 1, 2, 32, 8


def _qkv() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, L, D, generator=g, dtype=torch.float64) for _ in range(3))


class _CountProbes:
    """Counts the probe's runs (``functions._probe``) while installed."""

    def __init__(self, monkeypatch: Any) -> None:
        self.calls = 0
        real = functions._probe

        def counted(*args: Any, **kwargs: Any) -> functions.Probed:
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(functions, "_probe", counted)


def _docs(step: int) -> torch.Tensor:
    return (torch.arange(L) >= 3 + step).long()


@spec_dataclass
class StepDocs(MaskSpec):
    """A user's packed-documents spec, built anew every step from that step's ids."""

    ids: torch.Tensor

    def _make_mask_mod(self) -> MaskMod:
        ids = self.ids

        def same_doc_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (ids[q_idx] == ids[kv_idx]) & (kv_idx <= q_idx)

        return same_doc_causal


def test_a_spec_built_every_step_is_probed_once(monkeypatch: Any) -> None:
    probes = _CountProbes(monkeypatch)
    q, k, v = _qkv()
    for step in range(6):
        ids = _docs(step)
        out = fz.attention(q, k, v, mask=StepDocs(ids=ids), backend="dense")
        want = table(L, L, lambda i, j, ids=ids: bool(ids[i] == ids[j]) and j <= i)
        assert_matches_reference(out, q, k, v, mask=want)
    assert probes.calls == 1


def test_a_closure_built_every_step_is_probed_once(monkeypatch: Any) -> None:
    probes = _CountProbes(monkeypatch)
    q, k, v = _qkv()
    for step in range(6):
        ids = _docs(step)
        out = fz.attention(
            q, k, v, mask=lambda b, h, i, j, ids=ids: (ids[i] == ids[j]) & (j <= i), backend="dense"
        )
        want = table(L, L, lambda i, j, ids=ids: bool(ids[i] == ids[j]) and j <= i)
        assert_matches_reference(out, q, k, v, mask=want)
    assert probes.calls == 1


def test_a_captured_scalar_that_changes_the_ops_is_probed_again() -> None:
    """The same code with another captured scalar takes another branch: one reduces over the
    indices (only flex's per-element evaluation is exact), the other is element by element."""

    def made(reduce: bool) -> Any:
        def mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            if reduce:
                return (q_idx - kv_idx).abs().amax() <= 3
            return (q_idx - kv_idx).abs() <= 3

        return mod

    q, k, v = _qkv()
    want = table(L, L, lambda i, j: abs(i - j) <= 3)
    for reduce in (False, True, False, True):
        out = fz.attention(q, k, v, mask=made(reduce), backend="dense")
        assert_matches_reference(out, q, k, v, mask=want)


def test_a_shape_that_changes_the_ops_is_probed_again() -> None:
    """A row table and a square table read by the same code: ``t[q_idx][kv_idx]`` gathers a
    row from the square one (wrong on broadcast grids), and is element by element on a row."""

    def made(t: torch.Tensor) -> Any:
        def mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            if t.dim() == 1:
                return t[kv_idx] & (kv_idx <= q_idx)
            return t[q_idx][kv_idx]

        return mod

    g = torch.Generator().manual_seed(1)
    square = torch.rand(L, L, generator=g) > 0.5
    row = torch.rand(L, generator=g) > 0.5
    q, k, v = _qkv()
    for t in (row, square, row, square):
        if t.dim() == 1:
            want = table(L, L, lambda i, j: bool(row[j]) and j <= i)
        else:
            want = table(L, L, lambda i, j: bool(square[i, j]))
        out = fz.attention(q, k, v, mask=made(t), backend="dense")
        assert_matches_reference(out, q, k, v, mask=want)


def test_a_function_reading_a_captured_value_is_probed_per_value(monkeypatch: Any) -> None:
    """A branch on a captured tensor's value (read on the host) may change the ops with the
    value: such a verdict is kept for that tensor only."""
    probes = _CountProbes(monkeypatch)

    def made(flag: torch.Tensor) -> Any:
        def mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            if bool(flag):
                return (q_idx - kv_idx).abs().amax() <= 3
            return (q_idx - kv_idx).abs() <= 3

        return mod

    q, k, v = _qkv()
    want = table(L, L, lambda i, j: abs(i - j) <= 3)
    for on in (False, True, False, True):
        out = fz.attention(q, k, v, mask=made(torch.tensor(on)), backend="dense")
        assert_matches_reference(out, q, k, v, mask=want)
    assert probes.calls == 4


def test_structure_keys() -> None:
    ids = torch.zeros(L, dtype=torch.long)

    def make(t: torch.Tensor, w: int) -> Any:
        return lambda b, h, q_idx, kv_idx: (t[q_idx] == t[kv_idx]) & (q_idx - kv_idx <= w)

    same = functions._structure(make(ids, 4), ())
    assert same is not None
    assert functions._structure(make(torch.ones(L, dtype=torch.long), 4), ()) == same  # values differ
    assert functions._structure(make(ids, 5), ()) != same  # a captured scalar
    assert functions._structure(make(ids[:-1], 4), ()) != same  # a shape
    assert functions._structure(make(ids.int(), 4), ()) != same  # a dtype
    assert functions._structure(make(ids.float().requires_grad_(), 4), ()) != same
    other_code = lambda b, h, q_idx, kv_idx: (ids[q_idx] == ids[kv_idx]) & (q_idx - kv_idx < 4)  # noqa: E731
    assert functions._structure(other_code, ()) != same

    class Holder:
        def __init__(self) -> None:
            self.child = torch.nn.Linear(2, 2)

    holder = Holder()
    # An object the walk does not open (here a captured object's own attribute objects) is not keyed.
    assert functions._structure(lambda b, h, q_idx, kv_idx, m=holder: q_idx >= kv_idx, ()) is None


def _reduces_when(on: Any) -> Any:
    """A mod that reduces over its indices when the host reads ``on`` as true (only flex's
    per-element evaluation is exact then), and is element by element otherwise."""

    def mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        if on():
            return (q_idx - kv_idx).abs().amax() <= 3
        return (q_idx - kv_idx).abs() <= 3

    return mod


def test_host_reads_that_reach_no_aten_op_keep_the_probe_per_value() -> None:
    """``tolist()`` and ``numpy()`` hand values to Python without an ATen op."""
    q, k, v = _qkv()
    want = table(L, L, lambda i, j: abs(i - j) <= 3)
    for read in (lambda t: t.tolist()[0], lambda t: t.numpy()[0]):
        for on in (0, 1, 0, 1):
            flag = torch.tensor([on])
            out = fz.attention(
                q, k, v, mask=_reduces_when(lambda flag=flag, read=read: read(flag)), backend="dense"
            )
            assert_matches_reference(out, q, k, v, mask=want)


def test_a_shape_made_from_values_keeps_the_probe_per_value() -> None:
    """``row[keep]`` has as many elements as ``keep`` has True values: one element or a row, which
    is a gathered row the CPU kernel mishandles."""
    row = torch.arange(8)

    def made(keep: torch.Tensor) -> Any:
        return lambda b, h, q_idx, kv_idx: row[keep][q_idx * 0] <= kv_idx + 100

    one = torch.zeros(8, dtype=torch.bool)
    one[0] = True
    every = torch.ones(8, dtype=torch.bool)
    verdicts = [functions.check_mask_function(made(keep)) for keep in (one, every)]
    assert verdicts[0].hazards != verdicts[1].hazards
    assert verdicts[1].hazards == functions.check_mask_function(made(every)).hazards


def test_structure_keys_layouts_names_and_signed_zero() -> None:
    square = torch.arange(16).reshape(4, 4)

    def flat(t: torch.Tensor) -> Any:
        return lambda b, h, q_idx, kv_idx: t.reshape(-1)[q_idx] <= kv_idx  # a view, or a copy

    assert functions._structure(flat(square), ()) != functions._structure(flat(square.t()), ())

    def pick(b: Any, h: Any, q_idx: Any, kv_idx: Any, *, x: Any, y: Any) -> Any:
        return x[q_idx][kv_idx] & (y[q_idx] > 0)

    row = torch.ones(4, dtype=torch.bool)
    swapped = [
        functions._structure(functools.partial(pick, **kw), ())
        for kw in ({"x": square, "y": row}, {"y": square, "x": row})
    ]
    assert swapped[0] != swapped[1]

    def signed(zero: float) -> Any:
        return lambda b, h, q_idx, kv_idx: (
            q_idx >= kv_idx if math.copysign(1.0, zero) > 0 else q_idx <= kv_idx
        )

    assert functions._structure(signed(0.0), ()) != functions._structure(signed(-0.0), ())
    # Epochs (fz.invalidate) take part.
    assert functions._structure(signed(0.0), (1, ())) != functions._structure(signed(0.0), (0, ()))


def test_invalidate_probes_again() -> None:
    """State the walk does not see (a captured object's attribute) is announced with
    ``fz.invalidate``, after which the function is probed again, not taken by its structure."""

    class Config:
        reduce = False

    def made() -> Any:
        def mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            if Config.reduce:
                return (q_idx - kv_idx).abs().amax() <= 3
            return (q_idx - kv_idx).abs() <= 3

        return mod

    q, k, v = _qkv()
    want = table(L, L, lambda i, j: abs(i - j) <= 3)
    mod = made()
    assert_matches_reference(fz.attention(q, k, v, mask=mod, backend="dense"), q, k, v, mask=want)
    Config.reduce = True
    fz.invalidate(mod)
    assert_matches_reference(fz.attention(q, k, v, mask=mod, backend="dense"), q, k, v, mask=want)
    assert_matches_reference(fz.attention(q, k, v, mask=made(), backend="dense"), q, k, v, mask=want)


def test_an_index_out_of_range_is_still_named() -> None:
    """A known structure over new values is called once at zero indices before its verdict is
    reused: an out-of-range read there is refused with the probe's TypeError, as before."""
    row = torch.arange(8)

    def made(ix: torch.Tensor) -> Any:
        return lambda b, h, q_idx, kv_idx: row[ix[q_idx]] >= kv_idx

    functions.check_mask_function(made(torch.zeros(8, dtype=torch.long)))
    with pytest.raises(TypeError, match="failed when called as flex calls it"):
        functions.check_mask_function(made(torch.full((8,), 99)))


def test_a_key_keeps_nothing_alive() -> None:
    """A captured builtin bound to a tensor (``big.__getitem__``) makes the callable unkeyed
    rather than kept alive by the cache."""
    big = torch.zeros(1000)
    ref = weakref.ref(big)
    functions.check_mask_function(lambda b, h, q_idx, kv_idx, get=big.__getitem__: get(q_idx) <= kv_idx)
    del big
    gc.collect()
    assert ref() is None


def _verdict(probe: Any) -> Any:
    """``(scalar, hazards)`` of a probe, or the TypeError's class where it refuses the callable."""
    try:
        probed = probe()
    except TypeError as exc:
        return type(exc)
    return probed.scalar, probed.hazards


def _fresh(fn: Any) -> Any:
    grids = functions._probe_grids(torch.device("cpu"))
    return _verdict(lambda: functions._probe(fn, "mask", grids, score=False))


class _Tagged(torch.Tensor):
    """A tensor subclass with state of its own."""

    gather_row = False


def _pairs() -> dict[str, tuple[Any, Any]]:
    """Two callables of one code each, whose verdicts differ through what the walk of
    ``_structure`` cannot key by value (a container subclass's factory, a function attribute, a
    tensor subclass's attribute, a shape made from values in C++, a value read through ``str``)."""
    square = torch.arange(64).reshape(8, 8) > 10
    row = torch.arange(8) > 3

    def by_factory(make: Any) -> Any:
        tables = collections.defaultdict(make)
        return lambda b, h, q_idx, kv_idx: tables["t"][q_idx] & (q_idx >= kv_idx)

    def by_attribute(t: torch.Tensor) -> Any:
        def mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return mod.t[q_idx] & (q_idx >= kv_idx)  # type: ignore[attr-defined]

        mod.t = t  # type: ignore[attr-defined]
        return mod

    def by_subclass(gather_row: bool) -> Any:
        t = torch.arange(64).reshape(8, 8).as_subclass(_Tagged)
        t.gather_row = gather_row

        def mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            if t.gather_row:
                return torch.Tensor(t)[q_idx][kv_idx] > 10
            return torch.Tensor(t)[q_idx, kv_idx] > 10

        return mod

    def by_split(cut: torch.Tensor) -> Any:
        source = torch.arange(8)
        return lambda b, h, q_idx, kv_idx: (torch.tensor_split(source, cut)[0] + 0)[q_idx * 0] <= kv_idx + 100

    def by_text(flag: torch.Tensor) -> Any:
        def mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            if "1" in str(flag):
                return (q_idx - kv_idx).abs().amax() <= 3
            return (q_idx - kv_idx).abs() <= 3

        return mod

    return {
        "defaultdict_factory": (by_factory(lambda: row), by_factory(lambda: square)),
        "function_attribute": (by_attribute(row), by_attribute(square)),
        "tensor_subclass_attribute": (by_subclass(False), by_subclass(True)),
        "shape_made_in_cpp": (by_split(torch.tensor([1])), by_split(torch.tensor([5]))),
        "value_read_through_str": (by_text(torch.tensor(0)), by_text(torch.tensor(1))),
    }


@pytest.mark.parametrize("name", list(_pairs()))
def test_a_callable_of_a_known_structure_gets_its_own_verdict(name: str) -> None:
    first, second = _pairs()[name]
    assert _fresh(first) != _fresh(second)  # the pair tells the verdicts apart
    functions.check_mask_function(first)
    assert _verdict(lambda: functions.check_mask_function(second)) == _fresh(second)


def test_a_nested_tensor_capture_is_probed() -> None:
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    assert functions._structure(lambda b, h, q_idx, kv_idx, n=nested: q_idx >= kv_idx, ()) is None
