"""A spec's function written outside the package is evaluated as flex evaluates it.

flex calls a mod on 0-d index tensors, so a function written for that (``table[q_idx][kv_idx]``, a
reduction over a value of the indices) is a valid flex mod; on broadcast index grids (the
``dense`` route and the oracle of a subclass without its own, the BlockMask builder) it fails or
gives another answer. Raw callables were probed for this; a user's spec class, or a user's
subclass of a preset, was not: ``NearKeys`` (tests/flex_index_specs.py) gave a zero output on
``dense`` and a BlockMask missing its visible blocks, and ``GatheredTable`` failed on ``dense``.
Each is checked against its rule written per (query, key) pair in plain Python.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from flex_index_specs import GatheredBias, GatheredTable, NearKeys, near
from subclassed_specs import StrictlyCausal
from zoo_oracles import table

import flexattn_zoo as fz
from flexattn_zoo import functions, masks
from flexattn_zoo.spec import MaskMod, MaskSpec, ScoreMod, ScoreSpec, spec_dataclass
from flexattn_zoo.testing import assert_mask_consistent, assert_matches_reference, assert_score_consistent
from flexattn_zoo.testing.checks import block_mask_map, dense_block_map

B, H, L, D = 2, 2, 48, 8
_g = torch.Generator().manual_seed(3)
TABLE = torch.rand(L, L, generator=_g) > 0.5
BIAS = torch.randn(H, L, L, generator=_g)


def _qkv() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, L, D, generator=g, dtype=torch.float64) for _ in range(3))


@pytest.mark.parametrize(
    ("spec", "rule", "hazard"),
    [
        (NearKeys(), near, "reduces over a tensor"),
        (GatheredTable(table=TABLE), lambda i, j: bool(TABLE[i, j]), "reads from a row it gathered"),
        (
            masks.Causal() & GatheredTable(table=TABLE),
            lambda i, j: j <= i and bool(TABLE[i, j]),
            "reads from a row",
        ),
    ],
    ids=["preset_subclass_reducing", "user_spec_gathering", "composite"],
)
def test_a_function_written_for_flex_indices_runs_exactly(spec: MaskSpec, rule: Any, hazard: str) -> None:
    want = table(L, L, rule)
    q, k, v = _qkv()
    for route in ("auto", "dense"):
        out = fz.attention(q, k, v, mask=spec, backend=route)
        assert_matches_reference(out, q, k, v, mask=want)
    # The oracle (the subclass's function oracle, or the user's own) and the BlockMask builder.
    assert torch.equal(spec.dense(L, L, batch=B, heads=H).expand(B, H, L, L), want.expand(B, H, L, L))
    assert_mask_consistent(spec, L, L, batch=B, heads=H, block_sizes=((16, 16),))
    want_any, want_full = dense_block_map(want.expand(B, H, L, L), 16, 16)
    built = fz.block_mask(spec, L, L, batch=B, heads=H, block_size=16)
    got_any, got_full = block_mask_map(built, want_any.shape[-1])
    assert torch.equal(got_any.expand_as(want_any), want_any)
    assert torch.equal(got_full.expand_as(want_full), want_full)
    # What torch's compiled CPU flex kernel cannot lower or reads out of bounds is refused.
    with pytest.raises(ValueError, match=f"flex_cpu.*cannot run a mod that {hazard}"):
        fz.attention(q.float(), k.float(), v.float(), mask=spec, backend="flex_cpu")


def test_a_score_function_written_for_flex_indices_runs_exactly() -> None:
    spec = GatheredBias(bias=BIAS)
    q, k, v = (t.requires_grad_() for t in _qkv())
    out = fz.attention(q, k, v, score_mod=spec, backend="dense")
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    bias = BIAS.unsqueeze(0).expand(B, H, L, L).double()
    assert_matches_reference(out, q, k, v, score_mod=bias, grads=grads, grad_out=grad_out)
    assert_score_consistent(spec, batch=B, heads=H, q_len=L, kv_len=L)
    assert spec.flex_hazards() == (functions.READS_GATHERED_ROW,)


def test_a_function_that_runs_on_broadcast_grids_is_used_as_made() -> None:
    """No wrapper (no per-element evaluation) where one broadcast call is exact; probed once per
    spec value (the same function object on every call)."""
    spec = StrictlyCausal()
    mod = spec.mask_mod()
    assert mod.__qualname__.startswith("StrictlyCausal.")
    assert spec.mask_mod() is mod
    assert spec.flex_hazards() == ()
    assert NearKeys().mask_mod().__qualname__.startswith("_scalar_mask_mod.")


def test_a_user_function_with_python_control_flow_is_refused_naming_the_class() -> None:
    class BranchOnIndex(masks.Causal):
        def _make_mask_mod(self) -> MaskMod:
            return lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) if q_idx > 2 else (kv_idx < 0)

    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"BranchOnIndex's mask_mod callable uses data-dependent Python"):
        fz.attention(q, k, v, mask=BranchOnIndex(), backend="dense")


def _package_spec_classes() -> list[type]:
    found, todo = [], [MaskSpec, ScoreSpec]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("flexattn_zoo"):
                found.append(sub)
    return found


def test_the_packages_own_functions_are_not_probed() -> None:
    """Each is checked against its oracle on broadcast grids by the registry-wide tests; probing
    them would cost every new spec value a per-element evaluation."""
    classes = _package_spec_classes()
    assert len(classes) > 30
    assert [c.__name__ for c in classes if c._CHECKS_FUNCTION] == []
    assert NearKeys._CHECKS_FUNCTION and GatheredTable._CHECKS_FUNCTION and GatheredBias._CHECKS_FUNCTION


@spec_dataclass
class GatheredPastBias(ScoreSpec):
    """One-index reads in its function, a gathered row in the variant for masks that hide future
    keys (which the CPU flex route runs under a causal mask)."""

    bias: torch.Tensor

    def _make_score_mod(self, *, fast: bool) -> ScoreMod:
        bias = self.bias
        return lambda score, b, h, q_idx, kv_idx: score + bias[q_idx, kv_idx]

    def _make_past_score_mod(self, *, fast: bool) -> ScoreMod:
        bias = self.bias
        return lambda score, b, h, q_idx, kv_idx: score + bias[q_idx][kv_idx]

    def dense(self, scores: torch.Tensor) -> torch.Tensor:
        lq, lkv = scores.shape[-2:]
        return scores + self.bias[:lq, :lkv].to(scores)


def test_the_variant_for_masks_hiding_future_keys_is_probed_too() -> None:
    """Its hazard reaches ``flex_cpu``, which runs that variant under a causal mask (a segfault in
    torch's compiled CPU kernel before)."""
    spec = GatheredPastBias(bias=BIAS[0])
    assert spec.flex_hazards() == (functions.READS_GATHERED_ROW,)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="flex_cpu.*cannot run a mod that reads from a row it gathered"):
        fz.attention(q.float(), k.float(), v.float(), mask=masks.Causal(), score_mod=spec, backend="flex_cpu")
    out = fz.attention(q, k, v, mask=masks.Causal(), score_mod=spec)
    bias = BIAS[0].view(1, 1, L, L).expand(B, H, L, L).double()
    assert_matches_reference(out, q, k, v, mask=masks.Causal(), score_mod=bias)


def _near_keys(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return (q_idx - kv_idx).abs().amax() <= 3


@pytest.mark.parametrize("first_eager", [False, True], ids=["first_in_graph", "used_eagerly_first"])
@pytest.mark.parametrize("which", ["spec", "raw_callable"])
def test_compiled_dense_evaluates_a_flex_index_function_as_flex_does(which: str, first_eager: bool) -> None:
    """Inside ``torch.compile(fullgraph=True)`` the probe cannot run: the verdict an eager call
    left is used, else the function is evaluated as flex does (the traced ``dense`` route gave the
    whole-grid reduction's answer, an error of 1.9, before)."""
    mask = NearKeys() if which == "spec" else _near_keys
    q, k, v = _qkv()
    if first_eager:
        fz.attention(q, k, v, mask=mask, backend="dense")
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v: fz.attention(q, k, v, mask=mask, backend="dense"), fullgraph=True
    )
    assert_matches_reference(compiled(q, k, v), q, k, v, mask=table(L, L, near))


def test_compiled_flex_cpu_keeps_the_eager_verdicts_refusal() -> None:
    spec = NearKeys()
    q, k, v = (t.float() for t in _qkv())
    fz.attention(q, k, v, mask=spec)  # eager: probed
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v: fz.attention(q, k, v, mask=spec, backend="flex_cpu"), fullgraph=True
    )
    # Traced, the route's refusal is the ValueError Dynamo reports (fullgraph: as it was raised).
    with pytest.raises(Exception, match="flex_cpu.*cannot run a mod that reduces over a tensor"):
        compiled(q, k, v)
