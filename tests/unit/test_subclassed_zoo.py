"""Every registered preset, subclassed with a function of its own, runs exactly everywhere.

For each mask family a subclass replaces the function with the parent's thinned by a rule of its
own (every key ``kv % 3 == 1`` hidden, ``dense`` likewise): no form the parent offers (an SDPA
flag, a varlen or split form, a closed-form block map with full blocks, key bounds, one run of
keys, a per-row layout) holds for it. Each score family likewise gains a term of its own. The
subclass must match the float64 reference on every CPU route that accepts it, in one-query decode
steps, and in ``assert_mask_consistent``; before forms followed the function, presets whose forms
a route trusts ran their parent's attention.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks
from flexattn_zoo.models import decode
from flexattn_zoo.registry import MASKS, SCORES
from flexattn_zoo.spec import MaskSpec, ScoreSpec, function_mask_oracle, function_score_oracle, spec_dataclass
from flexattn_zoo.testing import assert_mask_consistent, assert_matches_reference

B, H, L, D = 2, 2, 96, 16


def _thinned_class(parent: type, *, oracle: bool = True) -> type:
    """``parent`` with every key ``kv % 3 == 1`` hidden; with ``oracle`` its ``dense`` written too
    (otherwise the class gets its function evaluated as its oracle)."""

    @spec_dataclass
    class Thinned(parent):  # type: ignore[misc, valid-type]
        def _make_mask_mod(self):
            inner = parent._make_mask_mod(self)

            def thinned(b, h, q_idx, kv_idx):
                return inner(b, h, q_idx, kv_idx) & (kv_idx % 3 != 1)

            return thinned

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        visible = parent.dense(self, q_len, kv_len, batch=batch, heads=heads)
        return visible & (torch.arange(kv_len, device=visible.device) % 3 != 1)

    if oracle:
        Thinned.dense = dense
    Thinned.__name__ = Thinned.__qualname__ = f"Thinned{parent.__name__}"
    return Thinned


def _shifted_class(parent: type, *, oracle: bool = True) -> type:
    """``parent`` with ``0.25 * ((q + 2 kv) % 5)`` added to every score; with ``oracle`` its
    ``dense`` written too."""

    @spec_dataclass
    class Shifted(parent):  # type: ignore[misc, valid-type]
        def _make_score_mod(self, *, fast: bool):
            inner = parent._make_score_mod(self, fast=fast)

            def shifted(score, b, h, q_idx, kv_idx):
                return inner(score, b, h, q_idx, kv_idx) + 0.25 * ((q_idx + 2 * kv_idx) % 5)

            return shifted

    def dense(self, scores: torch.Tensor) -> torch.Tensor:
        q_len, kv_len = scores.shape[-2:]
        q = torch.arange(q_len, dtype=scores.dtype, device=scores.device)[:, None]
        kv = torch.arange(kv_len, dtype=scores.dtype, device=scores.device)[None, :]
        return parent.dense(self, scores) + 0.25 * ((q + 2 * kv) % 5)

    if oracle:
        Shifted.dense = dense
    Shifted.__name__ = Shifted.__qualname__ = f"Shifted{parent.__name__}"
    return Shifted


def _rebuilt(spec, cls: type):
    return cls(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init})


def _example(registry, name: str):
    factory = registry.find(name).factory
    if not (isinstance(factory, type) and issubclass(factory, (MaskSpec, ScoreSpec))):
        return None, None
    for ex in factory.examples(L, L, B, H):
        if type(ex) is factory:
            return factory, ex
    return factory, None


def _cpu_routes(q, k, v, **kwargs) -> list[str]:
    return [c.name for c in fz.plan(q, k, v, **kwargs).candidates if c.accepted]


@pytest.mark.parametrize("name", MASKS.names())
def test_every_mask_family_subclassed_with_its_own_function_runs_exactly(name: str) -> None:
    parent, example = _example(MASKS, name)
    if example is None:
        pytest.skip(f"{name} is not a spec class with an example of its own class")
    spec = _rebuilt(example, _thinned_class(parent))
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    try:
        spec.validate(L, L, B, H)
        spec.bind(L, L).mask_mod()
    except (ValueError, TypeError) as exc:  # e.g. a bottom-right Causal needs its lengths bound
        pytest.skip(f"{name}: {exc}")
    assert_mask_consistent(spec, L, L, batch=B, heads=H)
    routes = _cpu_routes(q, k, v, mask=spec)
    assert "dense" in routes
    for route in ["auto", *routes]:
        out = fz.attention(q, k, v, mask=spec, backend=route)
        assert_matches_reference(out, q, k, v, mask=spec)
    if not (spec.uses_batch() or spec.uses_head()):
        q64, k64, v64 = (t.double() for t in (q, k, v))
        for n in (1, 37, L):
            with torch.no_grad():
                out = decode.decode_step(q64[:, :, n - 1 : n], k64, v64, n, mask=spec, backend="dense")
            ref = fz.testing.reference_attention(q64[:, :, :n], k64[:, :, :n], v64[:, :, :n], mask=spec)[
                :, :, -1:
            ]
            torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


def _softmax_score_families() -> list[str]:
    """The score families with an example of their own class; activation attention (unnormalised
    weights, its own tests) is left out."""
    names = []
    for name in SCORES.names():
        _, example = _example(SCORES, name)
        if example is not None and not example.is_activation():
            names.append(name)
    return names


@pytest.mark.parametrize("name", _softmax_score_families())
def test_every_score_family_subclassed_with_its_own_function_runs_exactly(name: str) -> None:
    parent, example = _example(SCORES, name)
    spec = _rebuilt(example, _shifted_class(parent))
    torch.manual_seed(1)
    q, k, v = (torch.randn(B, H, L, D) * 0.5 for _ in range(3))
    for mask in (None, masks.Causal()):
        routes = _cpu_routes(q, k, v, mask=mask, score_mod=spec)
        for route in ["auto", *routes]:
            out = fz.attention(q, k, v, mask=mask, score_mod=spec, backend=route)
            assert_matches_reference(out, q, k, v, mask=mask, score_mod=spec)


@pytest.mark.parametrize("name", MASKS.names())
def test_every_mask_family_subclassed_without_an_oracle_is_checked_against_its_own_function(
    name: str,
) -> None:
    """The oracle a subclass gets when it writes none (its function called on index grids) equals
    the independent oracle written for the same function, family by family."""
    parent, example = _example(MASKS, name)
    if example is None:
        pytest.skip(f"{name} is not a spec class with an example of its own class")
    written = _rebuilt(example, _thinned_class(parent))
    unwritten = _rebuilt(example, _thinned_class(parent, oracle=False))
    assert type(unwritten).dense is function_mask_oracle
    try:
        written.validate(L, L, B, H)
        written.bind(L, L).mask_mod()
    except (ValueError, TypeError) as exc:
        pytest.skip(f"{name}: {exc}")
    want = written.dense(L, L, batch=B, heads=H)
    got = unwritten.dense(L, L, batch=B, heads=H)
    assert got.device.type == "cpu" and got.dtype == torch.bool
    assert torch.equal(torch.broadcast_to(got, (B, H, L, L)), torch.broadcast_to(want, (B, H, L, L)))


@pytest.mark.parametrize("name", _softmax_score_families())
def test_every_score_family_subclassed_without_an_oracle_is_checked_against_its_own_function(
    name: str,
) -> None:
    parent, example = _example(SCORES, name)
    written = _rebuilt(example, _shifted_class(parent))
    unwritten = _rebuilt(example, _shifted_class(parent, oracle=False))
    assert type(unwritten).dense is function_score_oracle
    torch.manual_seed(5)
    scores = torch.randn(B, H, L, L, dtype=torch.float64)
    torch.testing.assert_close(
        unwritten.dense(scores.clone()), written.dense(scores.clone()), rtol=1e-6, atol=1e-6
    )
