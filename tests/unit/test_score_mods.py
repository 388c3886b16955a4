"""The score-mod catalogue: ALiBi slopes, soft-capping, validation, chaining, identity."""

from __future__ import annotations

import math

import pytest
import torch

from flexattn_zoo import _compat, score_mods
from flexattn_zoo.compose import Chain
from flexattn_zoo.spec import _MODS, LinearBiasForm, SoftCapForm, spec_dataclass
from flexattn_zoo.testing import assert_score_consistent

Alibi, SoftCap = score_mods.Alibi, score_mods.SoftCap

Z = torch.zeros((), dtype=torch.int32)


def head_slopes_from_mod(spec: Alibi) -> list[float]:
    """Read slope[h] back from the score_mod: score 0 at distance 1 becomes -slope[h]."""
    h = torch.arange(spec.num_heads, dtype=torch.int32)
    one = torch.ones((), dtype=torch.int32)
    out = spec.score_mod()(torch.zeros(spec.num_heads, dtype=torch.float64), Z, h, one, Z)
    return (-out).tolist()


def test_alibi_slopes_h8_by_hand() -> None:
    want = [0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625]
    assert Alibi(num_heads=8).head_slopes() == pytest.approx(want, rel=1e-15)
    assert head_slopes_from_mod(Alibi(num_heads=8)) == pytest.approx(want, rel=1e-15)


def test_alibi_slopes_h12_by_hand() -> None:
    # 8 = largest power of two <= 12: the 8-head slopes, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5
    # (every other slope of the 16-head sequence 2^(-k/2), starting with the first).
    want = [2.0**-e for e in (1, 2, 3, 4, 5, 6, 7, 8, 0.5, 1.5, 2.5, 3.5)]
    assert Alibi(num_heads=12).head_slopes() == pytest.approx(want, rel=1e-15)
    assert head_slopes_from_mod(Alibi(num_heads=12)) == pytest.approx(want, rel=1e-15)


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 6, 7, 12, 16, 20, 24, 32, 40, 64, 96])
def test_alibi_inline_slopes_equal_dense_slopes(heads: int) -> None:
    spec = Alibi(num_heads=heads)
    assert head_slopes_from_mod(spec) == pytest.approx(spec.head_slopes(), rel=1e-14)
    assert_score_consistent(spec, heads=heads, q_len=19, kv_len=31, rtol=1e-12, atol=1e-12)


def test_alibi_inline_in_float32_is_close() -> None:
    # Kernels give score_mods float32 scores; the inline exp2 must stay at float32 accuracy.
    spec = Alibi(num_heads=12)
    h = torch.arange(12, dtype=torch.int32).view(1, 12, 1, 1)
    q = torch.arange(300, dtype=torch.int32).view(1, 1, 300, 1)
    kv = torch.arange(300, dtype=torch.int32).view(1, 1, 1, 300)
    got = spec.score_mod()(torch.zeros(1, 12, 300, 300), Z, h, q, kv)
    want = spec.dense(torch.zeros(1, 12, 300, 300, dtype=torch.float64))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_alibi_given_slopes() -> None:
    spec = Alibi(num_heads=3, slopes=[0.1, 0.2, 3])
    assert spec.slopes == (0.1, 0.2, 3.0) and all(isinstance(s, float) for s in spec.slopes)
    assert head_slopes_from_mod(spec) == pytest.approx([0.1, 0.2, 3.0], rel=1e-15)
    assert Alibi(num_heads=3, slopes=torch.tensor([0.1, 0.2, 3.0], dtype=torch.float64)) == spec
    assert_score_consistent(spec, batch=2, heads=3, rtol=1e-12, atol=1e-12)
    # Given slopes capture no tensor, so the spec needs no device move.
    assert spec.tensors() == [] and spec.to("meta") is spec


def test_alibi_bias_picture() -> None:
    out = Alibi(num_heads=1, slopes=[1.0]).dense(torch.zeros(1, 1, 3, 4, dtype=torch.float64))
    assert out[0, 0].tolist() == [[0, -1, -2, -3], [-1, 0, -1, -2], [-2, -1, 0, -1]]


def test_alibi_validation() -> None:
    with pytest.raises(ValueError, match="num_heads"):
        Alibi(num_heads=0)
    with pytest.raises(TypeError, match="num_heads"):
        Alibi(num_heads=True)
    with pytest.raises(TypeError, match="num_heads"):
        Alibi(num_heads=8.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="slopes.*num_heads=4"):
        Alibi(num_heads=4, slopes=[1.0, 2.0])
    with pytest.raises(ValueError, match="slopes.*finite"):
        Alibi(num_heads=2, slopes=[1.0, math.nan])
    with pytest.raises(TypeError, match="slopes"):
        Alibi(num_heads=2, slopes="ab")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="slopes"):
        Alibi(num_heads=1, slopes=[True])
    with pytest.raises(TypeError):
        Alibi(8)  # type: ignore[misc]  # keyword-only
    with pytest.raises(ValueError, match="num_heads=8.*4 query heads"):
        Alibi(num_heads=8).validate(16, 16, 1, 4)
    Alibi(num_heads=4).validate(16, 32, 2, 4)


def test_softcap_exact() -> None:
    spec = SoftCap(cap=2.0)
    x = torch.linspace(-50, 50, 1001, dtype=torch.float64)
    got = spec.score_mod()(x, Z, Z, Z, Z)
    torch.testing.assert_close(got, 2.0 * torch.tanh(x / 2.0), rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(spec.dense(x), 2.0 * torch.tanh(x / 2.0), rtol=1e-14, atol=1e-15)
    assert float(got.abs().max()) <= 2.0
    assert_score_consistent(spec, magnitude=20.0, rtol=1e-13, atol=1e-13)
    assert float(spec.dense(torch.tensor([math.inf], dtype=torch.float64))) == 2.0


def test_softcap_validation() -> None:
    for bad in (0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="cap"):
            SoftCap(cap=bad)
    for bad_type in ("3", True, None, [1.0]):
        with pytest.raises(TypeError, match="cap"):
            SoftCap(cap=bad_type)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="approx"):
        SoftCap(cap=1.0, approx="yes")  # type: ignore[arg-type]


@pytest.fixture
def fresh_mod_cache():
    _MODS.clear()
    yield
    _MODS.clear()


def test_softcap_fast_tanh_selection(monkeypatch: pytest.MonkeyPatch, fresh_mod_cache: None) -> None:
    def marker_tanh(x: torch.Tensor) -> torch.Tensor:
        return torch.full_like(x, 0.25)

    x = torch.tensor([1.0, 5.0])
    monkeypatch.setattr(_compat, "fast_tanh_op", lambda: marker_tanh)
    assert SoftCap(cap=4.0, approx=True).score_mod(fast=True)(x, Z, Z, Z, Z).tolist() == [1.0, 1.0]
    exact = (4.0 * torch.tanh(x / 4.0)).tolist()
    assert SoftCap(cap=4.0, approx=True).score_mod(fast=False)(x, Z, Z, Z, Z).tolist() == exact
    assert SoftCap(cap=4.0).score_mod(fast=True)(x, Z, Z, Z, Z).tolist() == exact
    _MODS.clear()
    monkeypatch.setattr(_compat, "fast_tanh_op", lambda: None)  # no hardware tanh: exact
    assert SoftCap(cap=4.0, approx=True).score_mod(fast=True)(x, Z, Z, Z, Z).tolist() == exact


def test_chain_order() -> None:
    cap, alibi = SoftCap(cap=1.0), Alibi(num_heads=2, slopes=[1.0, 0.5])
    scores = torch.randn(1, 2, 5, 6, dtype=torch.float64) * 3
    h = torch.arange(2, dtype=torch.int32).view(1, 2, 1, 1)
    q = torch.arange(5, dtype=torch.int32).view(1, 1, 5, 1)
    kv = torch.arange(6, dtype=torch.int32).view(1, 1, 1, 6)
    chained = cap >> alibi  # soft-cap first, then the bias
    assert chained == Chain(mods=(cap, alibi)) and hash(chained) == hash(Chain(mods=(cap, alibi)))
    want = alibi.dense(cap.dense(scores))
    torch.testing.assert_close(chained.dense(scores), want)
    torch.testing.assert_close(chained.score_mod()(scores, Z, h, q, kv), want)
    assert not torch.allclose((alibi >> cap).dense(scores), want)
    assert ((cap >> alibi) >> cap) == (cap >> (alibi >> cap)) == Chain(mods=(cap, alibi, cap))
    with pytest.raises(TypeError, match="score spec"):
        cap >> 3  # type: ignore[operator]
    with pytest.raises(ValueError, match="num_heads"):
        (cap >> alibi).validate(4, 4, 1, 3)


def test_past_only_variants() -> None:
    """future_keys_hidden=True: ALiBi drops its abs (right where kv_idx <= q_idx, different after);
    specs without a cheaper variant, and chains of them, hand back the very same function."""
    h = torch.arange(2, dtype=torch.int32).view(1, 2, 1, 1)
    q = torch.arange(5, dtype=torch.int32).view(1, 1, 5, 1)
    kv = torch.arange(6, dtype=torch.int32).view(1, 1, 1, 6)
    past = (kv <= q).expand(1, 2, 5, 6)
    scores = torch.randn(1, 2, 5, 6, dtype=torch.float64)
    for spec in (
        Alibi(num_heads=2),
        Alibi(num_heads=2, slopes=[1.0, 0.5]),
        SoftCap(cap=2.0) >> Alibi(num_heads=2),
    ):
        plain, cheap = spec.score_mod(), spec.score_mod(future_keys_hidden=True)
        assert cheap is not plain and cheap is spec.score_mod(future_keys_hidden=True)
        want, got = spec.dense(scores.clone()), cheap(scores.clone(), Z, h, q, kv)
        torch.testing.assert_close(got[past], want[past])
        assert not torch.allclose(got[~past], want[~past])
        assert_score_consistent(spec, heads=2)
    for spec in (SoftCap(cap=2.0), SoftCap(cap=2.0, approx=True) >> SoftCap(cap=3.0)):
        for fast in (False, True):
            assert spec.score_mod(fast=fast, future_keys_hidden=True) is spec.score_mod(fast=fast)


def test_equality_hash_and_mod_identity() -> None:
    assert Alibi(num_heads=8) == Alibi(num_heads=8) and hash(Alibi(num_heads=8)) == hash(Alibi(num_heads=8))
    assert Alibi(num_heads=8).score_mod() is Alibi(num_heads=8).score_mod()
    assert Alibi(num_heads=8).score_mod() is not Alibi(num_heads=4).score_mod()
    assert Alibi(num_heads=2, slopes=(1, 2)) == Alibi(num_heads=2, slopes=[1.0, 2.0])
    assert Alibi(num_heads=2, slopes=(1, 2)).score_mod() is Alibi(num_heads=2, slopes=[1.0, 2.0]).score_mod()
    assert Alibi(num_heads=2) != Alibi(num_heads=2, slopes=Alibi(num_heads=2).head_slopes())
    assert SoftCap(cap=30) == SoftCap(cap=30.0) and hash(SoftCap(cap=30)) == hash(SoftCap(cap=30.0))
    assert SoftCap(cap=30).score_mod() is SoftCap(cap=30.0).score_mod()
    assert SoftCap(cap=30.0) != SoftCap(cap=30.0, approx=True)
    assert (SoftCap(cap=3.0) >> Alibi(num_heads=2)).score_mod() is (
        SoftCap(cap=3.0) >> Alibi(num_heads=2)
    ).score_mod()
    assert len({SoftCap(cap=1.0), SoftCap(cap=1), Alibi(num_heads=3), Alibi(num_heads=3)}) == 2


def test_registry_names_build_the_classes() -> None:
    assert {"alibi", "softcap"} <= set(score_mods.names())
    assert score_mods.get("alibi", num_heads=4) == Alibi(num_heads=4)
    assert score_mods.get("softcap", cap=20.0, approx=True) == SoftCap(cap=20.0, approx=True)


# ---- forms ---------------------------------------------------------------------------------------


def test_forms_offered_where_promised() -> None:
    assert SoftCap(cap=30).softcap_form() == SoftCapForm(cap=30.0, approx=False)
    assert SoftCap(cap=2.5, approx=True).softcap_form() == SoftCapForm(cap=2.5, approx=True)
    assert Alibi(num_heads=8).linear_bias_form() == LinearBiasForm(
        slopes=tuple(Alibi(num_heads=8).head_slopes())
    )
    assert Alibi(num_heads=2, slopes=[1.0, -0.5]).linear_bias_form() == LinearBiasForm(slopes=(1.0, -0.5))
    assert SoftCap(cap=3.0).linear_bias_form() is None and Alibi(num_heads=2).softcap_form() is None
    # Chains: one part keeps its form; linear biases add up; anything mixed has neither form.
    cap, a, b = SoftCap(cap=3.0, approx=True), Alibi(num_heads=2, slopes=[1.0, 0.25]), Alibi(num_heads=2)
    assert Chain(mods=(cap,)).softcap_form() == cap.softcap_form()
    assert Chain(mods=(a,)).linear_bias_form() == a.linear_bias_form()
    assert (a >> b).linear_bias_form() == LinearBiasForm(slopes=(1.0 + 2.0**-4, 0.25 + 2.0**-8))
    assert (cap >> cap).softcap_form() is None and (a >> cap).softcap_form() is None
    assert (a >> cap).linear_bias_form() is None and (cap >> a).linear_bias_form() is None
    assert (a >> Alibi(num_heads=3)).linear_bias_form() is None  # no per-head sum of 2 and 3 slopes
    for spec in (Chain(mods=(cap,)), a >> b, a >> b >> a):
        assert_score_consistent(spec, heads=2, magnitude=5.0, rtol=1e-12, atol=1e-12)


@spec_dataclass
class _CapOff(score_mods.SoftCap):
    def softcap_form(self) -> SoftCapForm | None:
        return SoftCapForm(cap=self.cap * 1.01, approx=self.approx)


@spec_dataclass
class _ClaimsApprox(score_mods.SoftCap):
    def softcap_form(self) -> SoftCapForm | None:
        return SoftCapForm(cap=self.cap, approx=True)


@spec_dataclass
class _SlopesReversed(score_mods.Alibi):
    def linear_bias_form(self) -> LinearBiasForm | None:
        return LinearBiasForm(slopes=tuple(reversed(self.head_slopes())))


@spec_dataclass
class _OneSlopeShort(score_mods.Alibi):
    def linear_bias_form(self) -> LinearBiasForm | None:
        return LinearBiasForm(slopes=tuple(self.head_slopes()[:-1]))


def test_wrong_score_forms_are_caught() -> None:
    with pytest.raises(AssertionError, match="softcap_form"):
        assert_score_consistent(_CapOff(cap=2.0))
    with pytest.raises(AssertionError, match="allows approx but has_fast_variant"):
        assert_score_consistent(_ClaimsApprox(cap=2.0))
    assert_score_consistent(_ClaimsApprox(cap=2.0, approx=True))
    with pytest.raises(AssertionError, match="linear_bias_form"):
        assert_score_consistent(_SlopesReversed(num_heads=4), heads=4)
    with pytest.raises(AssertionError, match="3 slopes for 4 query heads"):
        assert_score_consistent(_OneSlopeShort(num_heads=4), heads=4)
