"""fz.presets: each model family's layer pattern, its citations, and every layer vs the reference."""

from __future__ import annotations

import math

import preset_params
import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.models import presets
from flexattn_zoo.testing import assert_matches_reference

REQUIRED = {
    "mistral_7b",
    "gemma2",
    "gemma3",
    "llama4",
    "bloom",
    "mpt",
    "grok1",
    "gpt_oss",
    "modernbert",
    "prefix_lm",
}


def test_catalogue_and_sources() -> None:
    assert REQUIRED <= set(presets.names())
    for p in presets.presets():
        # Every preset cites where its numbers come from.
        assert len(p.source) > 80 and any(
            w in p.source for w in ("arXiv", "model card", "Config", "model.py")
        ), p.name
        assert p.model and p.pattern


@pytest.mark.parametrize(
    ("name", "layer", "mask", "score", "sinks"),
    [
        ("mistral_7b", 5, masks.SlidingWindow(left=4095), None, False),
        ("gemma2", 0, masks.SlidingWindow.from_hf(4096), score_mods.SoftCap(cap=50.0), False),
        ("gemma2", 1, masks.Causal(), score_mods.SoftCap(cap=50.0), False),
        ("gemma3", 4, masks.SlidingWindow.from_hf(1024), None, False),
        ("gemma3", 5, masks.Causal(), None, False),
        ("gemma3", 11, masks.Causal(), None, False),
        ("llama4", 0, masks.Chunked(size=8192) & masks.Causal(), None, False),
        ("llama4", 3, masks.Causal(), None, False),
        ("grok1", 7, masks.Causal(), score_mods.SoftCap(cap=30.0), False),
        ("gpt_oss", 0, masks.SlidingWindow.from_hf(128), None, True),
        ("gpt_oss", 1, masks.Causal(), None, True),
        ("modernbert", 0, None, None, False),
        ("modernbert", 1, masks.SlidingWindow(left=64, right=64), None, False),
        ("modernbert", 3, None, None, False),
    ],
)
def test_layer_patterns(name: str, layer: int, mask: object, score: object, sinks: bool) -> None:
    la = presets.get(name, layer=layer)
    assert la.mask == mask
    assert la.score_mod == score
    assert la.uses_sinks is sinks


def test_alibi_presets_and_parameters() -> None:
    assert presets.get("bloom", num_heads=8).score_mod == score_mods.Alibi(num_heads=8)
    assert presets.get("mpt", layer=3, num_heads=32).mask == masks.Causal()
    assert presets.get("gemma2", layer=2).scale == pytest.approx(256**-0.5)
    assert presets.get("mistral_7b", window=16).mask == masks.SlidingWindow.from_hf(16)
    assert presets.get("prefix_lm", prefix_len=5).mask == masks.PrefixLM(prefix_len=5)


@pytest.mark.parametrize("heads", [8, 12, 24, 48, 56, 112])
def test_alibi_preset_slopes_are_the_models_own(heads: int) -> None:
    """BLOOM's ``build_alibi_tensor`` and MPT's ``gen_slopes`` (``alibi_bias_max=8``), written out
    here, agree with the presets' slopes for every head count, powers of two or not."""
    closest = 2 ** math.floor(math.log2(heads))
    bloom = [2 ** (-8 * p / closest) for p in range(1, closest + 1)]
    bloom += [2 ** (-8 * p / (2 * closest)) for p in range(1, 1 + 2 * (heads - closest), 2)]
    upper = 2 ** math.ceil(math.log2(heads))
    mpt = [2 ** (-8 * m / upper) for m in range(1, upper + 1)]
    if upper != heads:
        mpt = (mpt[1::2] + mpt[::2])[:heads]
    for name, want in (("bloom", bloom), ("mpt", mpt)):
        got = presets.get(name, num_heads=heads).score_mod.head_slopes()
        assert got == pytest.approx(want, rel=1e-12), name


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: presets.get("gemma"), "unknown preset 'gemma'.*Did you mean"),
        (lambda: presets.get("bloom"), "needs num_heads"),
        (lambda: presets.get("gemma2", windw=3), "unknown parameter.*'windw'"),
        (lambda: presets.get("gemma2", layer=-1), "layer"),
        (lambda: presets.get("prefix_lm"), "needs prefix_len"),
    ],
)
def test_errors(call, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        call()


def test_layer_index_takes_numpy_integers_and_refuses_other_types() -> None:
    """A layer index from a numpy array (``np.arange(num_layers)``) is an int, as ``num_heads``
    from numpy is (check_count). Old code: ValueError "must be an int >= 0, got np.int64(3)"."""
    np = pytest.importorskip("numpy")
    assert presets.get("llama4", layer=np.int64(3)) == presets.get("llama4", layer=3)
    assert fz.Attention("gemma2", layer=np.int32(1)).mask == masks.Causal()
    for bad in (1.0, "1", torch.tensor(1), True):
        with pytest.raises(TypeError, match=r"layer=\.\.\.\) must be an int >= 0, got"):
            presets.get("gemma2", layer=bad)


@pytest.mark.parametrize(
    ("window", "error"), [(True, TypeError), ("128", TypeError), (1.5, TypeError), (-2, ValueError)]
)
def test_modernbert_window_is_checked_and_named(window: object, error: type) -> None:
    """Old code: window=True was a window of 0 (the diagonal), "128" raised Python's "unsupported
    operand type(s) for //", and -2 said "SlidingWindow(left=...) must be an int >= 0, got -1"."""
    with pytest.raises(error, match=r"presets.get\('modernbert', window=...\) must be an int >= 1"):
        presets.get("modernbert", layer=1, window=window)
    assert presets.get("modernbert", layer=1, window=129).mask == masks.SlidingWindow(left=64, right=64)


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_every_layer_kind_matches_reference(name: str) -> None:
    # Short windows so a 70-token problem exercises the local pattern; two layers cover both kinds.
    small = preset_params.SHORT.get(name, {})
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 70, 16, generator=g) for _ in range(3))
    sinks = torch.linspace(-1, 1, 4)
    for layer in (0, 1):
        la = presets.get(name, layer=layer, num_heads=4, **small)
        kw = dict(mask=la.mask, score_mod=la.score_mod, scale=la.scale)
        if la.uses_sinks:
            ref = fz.testing.reference_attention(q, k, v, sinks=sinks, **kw)
            out = fz.layers.attention_layer(q, k, v, config=la, sinks=sinks, backend="dense")
            torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
        else:
            out = fz.layers.attention_layer(q, k, v, config=la, backend="dense")
            assert_matches_reference(out, q, k, v, **kw)
