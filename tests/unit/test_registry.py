"""Registries: lookup, errors that name the valid choices, user registration."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.coercion import as_mask_spec, as_score_spec
from flexattn_zoo.functions import FunctionMask, FunctionScore
from flexattn_zoo.registry import MASKS, SCORES
from flexattn_zoo.spec import MaskMod, MaskSpec, ScoreMod, ScoreSpec, spec_dataclass
from flexattn_zoo.testing import (
    assert_mask_consistent,
    assert_matches_reference,
    assert_score_consistent,
    spec_examples,
)


@pytest.fixture
def temp_names() -> Iterator[list[tuple[object, str]]]:
    """Collect (registry, name) pairs registered by a test and remove them afterwards."""
    added: list[tuple[object, str]] = []
    yield added
    for registry, name in added:
        registry.unregister(name)  # type: ignore[attr-defined]


def test_names_and_get() -> None:
    names = score_mods.names()
    assert names == sorted(names) and {"alibi", "softcap"} <= set(names)
    assert "softcap" in SCORES and "no_such" not in SCORES
    assert score_mods.get("softcap", cap=3.0) == score_mods.SoftCap(cap=3.0)
    assert all(n == n.lower() for n in masks.names())


def test_unknown_name_lists_names_and_suggests() -> None:
    with pytest.raises(
        ValueError, match=r"unknown score_mod 'sofcap'.*alibi.*softcap.*Did you mean 'softcap'"
    ):
        score_mods.get("sofcap")
    with pytest.raises(ValueError, match="unknown mask 'zzz_nothing_like_it'; valid names"):
        masks.get("zzz_nothing_like_it")
    with pytest.raises(TypeError, match="name must be a str"):
        score_mods.get(3)  # type: ignore[arg-type]


def test_unknown_and_missing_params() -> None:
    with pytest.raises(
        ValueError, match=r"unknown parameter\(s\) 'num_head'.*num_heads, slopes.*Did you mean 'num_heads'"
    ):
        score_mods.get("alibi", num_head=4)
    with pytest.raises(ValueError, match=r"needs parameter\(s\): num_heads"):
        score_mods.get("alibi")


def test_duplicate_registration_is_an_error() -> None:
    @spec_dataclass
    class Softcap(ScoreSpec):
        pass

    with pytest.raises(ValueError, match="'softcap' is already registered"):
        score_mods.register(Softcap)
    with pytest.raises(ValueError, match="'alibi' is already registered"):
        score_mods.register_function("alibi", lambda s, b, h, q, kv: s)
    assert score_mods.get("softcap", cap=1.0) == score_mods.SoftCap(cap=1.0)


def test_register_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="snake_case"):
        score_mods.register_function("BadName", lambda s, b, h, q, kv: s)
    with pytest.raises(TypeError, match="subclass of ScoreSpec"):
        score_mods.register(int)
    with pytest.raises(TypeError, match="callable"):
        score_mods.register_function("not_callable", 3)  # type: ignore[arg-type]


def test_register_user_score_class(temp_names: list) -> None:
    @score_mods.register(name="test_temperature")
    @spec_dataclass
    class Temperature(ScoreSpec):
        """Divide scores by ``t``."""

        t: float = 2.0

        def _make_score_mod(self, *, fast: bool) -> ScoreMod:
            t = self.t

            def temperature(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
                return score / t

            return temperature

        def dense(self, scores: torch.Tensor) -> torch.Tensor:
            return scores * (1.0 / self.t)

    temp_names.append((SCORES, "test_temperature"))
    assert Temperature.name == "test_temperature"
    spec = score_mods.get("test_temperature", t=4.0)
    assert spec == Temperature(t=4.0) and spec.score_mod() is Temperature(t=4.0).score_mod()
    assert_score_consistent(spec)
    assert SCORES.entry("test_temperature").params == (("t", "2.0"),)
    with pytest.raises(ValueError, match="valid parameters: t"):
        score_mods.get("test_temperature", temp=1.0)


def test_register_user_mask_class_default_name(temp_names: list) -> None:
    @masks.register
    @spec_dataclass
    class EvenKeysForTest(MaskSpec):
        """Only even keys."""

        def _make_mask_mod(self) -> MaskMod:
            def even(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
                return (kv_idx % 2 == 0) & (q_idx >= 0)

            return even

        def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
            out = torch.zeros(1, 1, q_len, kv_len, dtype=torch.bool)
            out[..., ::2] = True
            return out

    temp_names.append((MASKS, "even_keys_for_test"))
    spec = masks.get("even_keys_for_test")
    assert isinstance(spec, EvenKeysForTest)
    assert_mask_consistent(spec, 37, 50, batch=2, heads=3)


def test_register_plain_functions(temp_names: list) -> None:
    def doubled(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return score * 2

    def lower(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return kv_idx <= q_idx

    assert score_mods.register_function("test_doubled", doubled) is doubled
    temp_names.append((SCORES, "test_doubled"))
    masks.register_function("test_lower", lower)
    temp_names.append((MASKS, "test_lower"))
    s, m = score_mods.get("test_doubled"), masks.get("test_lower")
    assert isinstance(s, FunctionScore) and s.score_mod() is doubled
    assert isinstance(m, FunctionMask) and m.mask_mod() is lower and not m.uses_batch()
    assert_score_consistent(s, batch=2, heads=2)
    assert_mask_consistent(m, 40, 40)
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) 'x'.*\(none\)"):
        score_mods.get("test_doubled", x=1)


def test_unregister_unknown_name() -> None:
    with pytest.raises(ValueError, match="unknown score_mod"):
        SCORES.unregister("never_registered")


def test_callables_indexing_device_tensors_are_probed_on_that_device() -> None:
    """A mask/score callable that captures a table on another device (CUDA document ids; here the
    meta device, which CPU-only CI has) is probed with indices on that device, not refused: CUDA
    cannot index a CUDA table with CPU indices, which ``needs`` stands in for."""
    ids = torch.zeros(8, dtype=torch.int64, device="meta")

    def needs(t: torch.Tensor) -> None:
        if t.device != ids.device:
            raise RuntimeError(f"indices on {t.device}, table on {ids.device}")

    def doc_mask(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        needs(q_idx)
        return q_idx >= kv_idx

    table = ids.float()

    def doc_bias(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        if q_idx.device != table.device:
            raise RuntimeError(f"indices on {q_idx.device}, table on {table.device}")
        return score * 2.0

    assert isinstance(as_mask_spec(doc_mask), FunctionMask)
    assert isinstance(as_score_spec(doc_bias), FunctionScore)

    def cpu_only(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return q_idx >= kv_idx

    assert isinstance(as_mask_spec(cpu_only), FunctionMask)


def test_bound_method_mask_that_reads_the_head_is_per_head() -> None:
    # A bound method's code starts with ``self``: reading argument 1 (h) must not be taken for
    # reading argument 0 (b), or the BlockMask is built for head 0 and reused for every head.
    class PerHeadWidth:
        def __init__(self) -> None:
            self.width = torch.tensor([1000, 0])

        def mask(self, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return (q_idx - kv_idx).abs() <= self.width[h]

    spec = as_mask_spec(PerHeadWidth().mask)
    assert spec.uses_head() and not spec.uses_batch()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 16, generator=gen) for _ in range(3))
    out = fz.attention(q, k, v, mask=PerHeadWidth().mask)
    assert_matches_reference(out, q, k, v, mask=PerHeadWidth().mask)


@pytest.mark.parametrize(("q_len", "kv_len"), [(256, 256), (7, 7), (40, 65)])
def test_typical_examples_are_valid_specs(q_len: int, kv_len: int) -> None:
    # What the demo shows for each registered class: valid at the shape asked for, and consistent.
    for registry in (MASKS, SCORES):
        for entry in registry.entries():
            if not hasattr(entry.factory, "typical_example"):
                continue  # a registered plain function: the demo shows its one spec
            spec = entry.factory.typical_example(q_len, kv_len, 2, 4)
            assert isinstance(spec, entry.factory), entry.name  # type: ignore[arg-type]
            if isinstance(spec, MaskSpec):
                assert_mask_consistent(spec, q_len, kv_len, batch=2, heads=4, block_sizes=((16, 32),))
            else:
                assert_score_consistent(spec, batch=2, heads=4, q_len=q_len, kv_len=kv_len)


@pytest.mark.parametrize(("q_len", "kv_len"), [(0, 16), (16, 0), (0, 0)])
def test_every_registered_mask_takes_empty_problems(q_len: int, kv_len: int) -> None:
    """Lengths 0 are valid (a decode step with no cache yet, an empty pack): every family's
    oracle, forms and block map agree there and the dense route gives zeros. FlamingoCross's
    oracle, PerDocument's check and a broadcast Dense mask's SDPA form once failed or lied here."""
    q = torch.randn(2, 2, q_len, 8, dtype=torch.float64)
    kv = torch.randn(2, 2, kv_len, 8, dtype=torch.float64)
    for name, spec in spec_examples("mask", 16, 16, batch=2, heads=2):
        if isinstance(spec, masks.Dense) and spec.mask.shape[-2:] != (1, 1):
            continue  # a mask tensor built for 16 x 16 is refused at other lengths, by design
        assert_mask_consistent(spec, q_len, kv_len, batch=2, heads=2)
        out = fz.attention(q, kv, kv, mask=spec, backend="dense")
        assert out.shape == q.shape and not bool(out.any()), name


def test_typical_examples_by_family() -> None:
    assert masks.SlidingWindow.typical_example(256, 256, 1, 2) == masks.SlidingWindow(left=32)
    assert masks.Chunked.typical_example(256, 256, 1, 2) == masks.Chunked(size=64)
    assert masks.PrefixLM.typical_example(256, 256, 1, 2) == masks.PrefixLM(prefix_len=64)
    assert masks.Document.typical_example(256, 256, 1, 2) == masks.Document.from_lengths([125, 69, 62])
    assert masks.Causal.typical_example(256, 256, 1, 2) == masks.Causal()  # the default: examples()[0]
    assert score_mods.SoftCap.typical_example(256, 256, 1, 2) == score_mods.SoftCap(cap=30.0)
    assert score_mods.Alibi.typical_example(256, 256, 1, 6) == score_mods.Alibi(num_heads=6)


def test_register_refuses_a_plain_dataclass(temp_names: list) -> None:
    """A ``@dataclasses.dataclass`` spec (eq=True, so ``__hash__`` is None) once registered and
    then failed at every use with "unhashable type"; register names the fix instead. A subclass
    of a spec dataclass that adds no fields (inheriting its dataclass parameters) still registers."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class PlainDiagonal(MaskSpec):
        """Each query sees its own key."""

        def _make_mask_mod(self) -> MaskMod:
            return lambda b, h, q_idx, kv_idx: q_idx == kv_idx

        def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
            return torch.eye(q_len, kv_len, dtype=torch.bool)[None, None]

    with pytest.raises(TypeError, match=r"PlainDiagonal must be a spec dataclass, got a plain dataclass"):
        masks.register(PlainDiagonal)
    assert "plain_diagonal" not in masks.names()

    class WideCausal(masks.Causal):
        """``masks.Causal`` under another name."""

    masks.register(WideCausal)
    temp_names.append((MASKS, "wide_causal"))
    assert hash(masks.get("wide_causal")) == hash(WideCausal())
