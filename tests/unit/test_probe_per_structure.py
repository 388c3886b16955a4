"""The probe of a user function is kept per structure, so a loop that builds its function (or its
spec) anew every step over new tensors probes once; and a structure is never taken for another.

A training loop with per-step document ids, or a generation loop building its mask from the
step's lengths, makes a new closure (or a new spec value) every step. The probe (a vmap call and a
traced call, milliseconds) ran on each. Its verdict depends on the function's code, the scalars it
captures and its tensors' shapes, dtypes and devices, not on their values, unless the function
reads a value on the host, which the probe notices.
"""

from __future__ import annotations

from typing import Any

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

    same = functions._structure(make(ids, 4))
    assert same is not None
    assert functions._structure(make(torch.ones(L, dtype=torch.long), 4)) == same  # values differ
    assert functions._structure(make(ids, 5)) != same  # a captured scalar
    assert functions._structure(make(ids[:-1], 4)) != same  # a shape
    assert functions._structure(make(ids.int(), 4)) != same  # a dtype
    assert functions._structure(make(ids.float().requires_grad_(), 4)) != same
    other_code = lambda b, h, q_idx, kv_idx: (ids[q_idx] == ids[kv_idx]) & (q_idx - kv_idx < 4)  # noqa: E731
    assert functions._structure(other_code) != same

    class Holder:
        def __init__(self) -> None:
            self.child = torch.nn.Linear(2, 2)

    holder = Holder()
    # An object the walk does not open (here a captured object's own attribute objects) is not keyed.
    assert functions._structure(lambda b, h, q_idx, kv_idx, m=holder: q_idx >= kv_idx) is None
