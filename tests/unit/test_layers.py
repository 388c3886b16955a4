"""fz.Attention / fz.layers.attention_layer: configuration forms, GQA, lse, and mask reuse."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import blockmask, masks, score_mods
from flexattn_zoo.compile import CACHE as COMPILE_CACHE
from flexattn_zoo.masks.band import Band
from flexattn_zoo.masks.padding import KeyPadding
from flexattn_zoo.testing import assert_mask_consistent, assert_matches_reference

YAML = "mask: {name: sliding_window, left: 5}\nscore_mod: {name: softcap, cap: 2.0}\n"


def _qkv(hkv: int = 2, lq: int = 40, lkv: int = 40):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(3)
    return (
        torch.randn(2, 4, lq, 16, generator=g),
        torch.randn(2, hkv, lkv, 16, generator=g),
        torch.randn(2, hkv, lkv, 16, generator=g),
    )


def test_config_forms_agree(tmp_path: Path) -> None:
    path = tmp_path / "attn.yaml"
    path.write_text(YAML)
    mask, score = masks.SlidingWindow(left=5), score_mods.SoftCap(cap=2.0)
    forms = [
        fz.Attention(YAML, backend="dense"),
        fz.Attention(str(path), backend="dense"),
        fz.Attention(path, backend="dense"),
        fz.Attention(
            {"mask": {"name": "sliding_window", "left": 5}, "score_mod": {"name": "softcap", "cap": 2.0}},
            backend="dense",
        ),
        fz.Attention(mask=mask, score_mod=score, backend="dense"),
    ]
    q, k, v = _qkv()
    for layer in forms:
        assert layer.mask == mask and layer.score_mod == score
        out = layer(q, k, v)  # GQA 4:2 detected from the shapes
        assert_matches_reference(out, q, k, v, mask=mask, score_mod=score, enable_gqa=True)
    functional = fz.layers.attention_layer(q, k, v, config=YAML, backend="dense")
    torch.testing.assert_close(functional, forms[0](q, k, v), rtol=0, atol=0)


def test_preset_layer_and_lse() -> None:
    q, k, v = _qkv(hkv=4)
    layer = fz.Attention("gemma2", layer=0, return_lse=True, backend="dense")
    out, lse = layer(q, k, v)
    assert_matches_reference(
        out, q, k, v, mask=layer.mask, score_mod=layer.score_mod, scale=256**-0.5, lse=lse
    )


def test_grads_through_the_layer() -> None:
    q, k, v = (t.requires_grad_() for t in _qkv())
    out = fz.Attention(mask=masks.Causal())(q, k, v)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(
        out, q, k, v, mask=masks.Causal(), enable_gqa=True, grads=grads, grad_out=grad_out
    )


def test_second_step_builds_and_compiles_nothing() -> None:
    # No grad on CPU: a sliding window runs on flex_cpu, which needs a BlockMask and a kernel.
    layer = fz.Attention("mistral_7b", layer=0)
    layer.spec = fz.presets.LayerAttention(mask=masks.SlidingWindow.from_hf(24))
    q, k, v = _qkv(lq=300, lkv=300)
    with torch.no_grad():
        first = layer(q, k, v)
        builds, compiles = blockmask.CACHE.inserts, COMPILE_CACHE.total_compiles()
        for _ in range(3):
            again = layer(q + 0, k, v)
    assert fz.plan(q, k, v, mask=layer.mask, enable_gqa=True).backend == "flex_cpu"
    assert blockmask.CACHE.inserts == builds and COMPILE_CACHE.total_compiles() == compiles
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    assert_matches_reference(first, q, k, v, mask=layer.mask, enable_gqa=True)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(config="gemma2", mask=masks.Causal()), ValueError, "either config= or mask="),
        (dict(config="not a preset"), ValueError, "neither a preset"),
        (dict(config=3), TypeError, "config must be"),
        (dict(config="gpt_oss"), ValueError, "needs num_heads"),
        (dict(mask=masks.Causal(), sinks="yes"), TypeError, "sinks must be"),
        # checked when the layer is built, not at its first forward
        (dict(mask="causal", backend="bogus"), ValueError, "unknown backend 'bogus'; valid: auto, "),
        (dict(mask="causal", backend=None), TypeError, "backend must be a str"),
        (dict(mask="causal", scale="x"), TypeError, "scale must be None or a finite real number"),
        (dict(mask="causal", scale=float("nan")), ValueError, "scale must be None or a finite number"),
        (dict(mask="causal", enable_gqa="y"), TypeError, "enable_gqa must be a bool"),
        (dict(mask="causal", return_lse=1), TypeError, "return_lse must be a bool"),
    ],
)
def test_bad_configurations(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        fz.Attention(**kwargs)


def test_sinks_computed_from_a_parameter_are_refused_not_detached() -> None:
    """A row of a parameter holding every layer's sinks requires grad but is no leaf. Old code
    wrapped it in a new nn.Parameter, a leaf over the same storage: the layer trained that copy and
    the model's own parameter never got a gradient, silently."""
    every_layer = torch.nn.Parameter(torch.zeros(3, 4))
    with pytest.raises(TypeError, match="sinks requires grad but is computed from other tensors"):
        fz.Attention(mask="causal", sinks=every_layer[1])
    # Leaves are kept as they were: a parameter as given, a plain tensor as a buffer.
    own = torch.nn.Parameter(torch.zeros(4))
    assert fz.Attention(mask="causal", sinks=own).sinks is own
    assert [n for n, _ in fz.Attention(mask="causal", sinks=every_layer[1].detach()).named_buffers()] == [
        "sinks"
    ]


@pytest.mark.parametrize(
    ("kwargs", "meant"),
    [
        (dict(mask="causal", dropout=0.1), "dropout_p"),  # nn.MultiheadAttention's name
        (dict(config="gemma2", dropout=0.1), "dropout_p"),
        (dict(config="bloom", num_head=4), "num_heads"),
        (dict(mask="causal", causal=True), "is_causal"),
    ],
)
def test_a_misspelt_keyword_names_the_attention_argument_meant(kwargs: dict, meant: str) -> None:
    """Keywords beyond Attention's own are preset parameters. Old code took a misspelt one of its
    own for one: "preset parameters (dropout) need config= to name a preset", or "preset 'bloom'
    got unknown parameter(s) 'num_head'; valid: (none)", never naming the argument meant."""
    name = next(iter(set(kwargs) - {"mask", "config"}))
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'. Did you mean '{meant}'"):
        fz.Attention(**kwargs)


def test_functional_layer_takes_a_presets_own_parameters() -> None:
    """Old code: attention_layer(config="prefix_lm") said "needs prefix_len=", and passing it was a
    TypeError (no such keyword), so a preset with a required parameter could not be used by name;
    gemma2's window= could not be changed either."""
    q, k, v = _qkv(hkv=4)
    out = fz.layers.attention_layer(q, k, v, config="prefix_lm", prefix_len=5, backend="dense")
    assert_matches_reference(out, q, k, v, mask=masks.PrefixLM(prefix_len=5))
    la = fz.presets.get("gemma2", window=8)
    out = fz.layers.attention_layer(q, k, v, config="gemma2", window=8, backend="dense")
    assert_matches_reference(out, q, k, v, mask=la.mask, score_mod=la.score_mod, scale=la.scale)
    with pytest.raises(ValueError, match="unknown parameter.*'windw'"):
        fz.layers.attention_layer(q, k, v, config="gemma2", windw=8)
    with pytest.raises(TypeError, match="attention_layer.. got an unexpected keyword argument 'dropout'"):
        fz.layers.attention_layer(q, k, v, config="gemma2", dropout=0.1)


def test_preset_with_sinks_needs_them_in_functional_form() -> None:
    q, k, v = _qkv(hkv=4)
    with pytest.raises(ValueError, match="has learned attention sinks"):
        fz.layers.attention_layer(q, k, v, config="gpt_oss", backend="dense")


def test_sinks_false_runs_a_preset_layer_without_its_sinks() -> None:
    """``Attention("gpt_oss", sinks=False)`` was built and then refused every call for want of
    sinks; an explicit False is the preset's layer without them (and None still learns them)."""
    q, k, v = _qkv(hkv=4)
    plain = fz.Attention("gpt_oss", layer=1, sinks=False, num_heads=q.shape[1], backend="dense")
    assert plain.sinks is None and not plain.spec.uses_sinks
    out = plain(q, k, v)
    assert_matches_reference(out, q, k, v, mask=masks.Causal(), enable_gqa=True)
    learned = fz.Attention("gpt_oss", layer=1, num_heads=q.shape[1], backend="dense")
    assert isinstance(learned.sinks, torch.nn.Parameter) and learned.spec.uses_sinks


@pytest.mark.parametrize(("q_len", "kv_len"), [(37, 37), (5, 140), (140, 33)])
def test_band_and_key_padding_specs_match_their_oracles(q_len: int, kv_len: int) -> None:
    for spec in Band.examples(q_len, kv_len, 2, 1) + KeyPadding.examples(q_len, kv_len, 2, 1):
        assert_mask_consistent(spec, q_len, kv_len, batch=2, heads=1)
    # Band generalises the zoo's causal and window masks exactly.
    assert torch.equal(Band(hi=0).dense(9, 12), masks.Causal().dense(9, 12))
    assert torch.equal(Band(lo=-3, hi=0).dense(9, 12), masks.SlidingWindow.from_hf(4).dense(9, 12))


def test_attention_module_takes_a_presets_own_parameters() -> None:
    # The error for a missing preset parameter tells the user to pass prefix_len=; that must work.
    with pytest.raises(ValueError, match="prefix_len="):
        fz.Attention("prefix_lm")
    layer = fz.Attention("prefix_lm", prefix_len=3)
    assert layer.mask == masks.PrefixLM(prefix_len=3)
    with pytest.raises(TypeError, match="need config= to name a preset"):
        fz.Attention(mask="causal", prefix_len=3)


@pytest.mark.parametrize(("arg", "cls"), [("mask", masks.Causal), ("score_mod", score_mods.SoftCap)])
def test_a_spec_class_instead_of_an_instance_is_named(arg: str, cls: type) -> None:
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(TypeError, match=f"{arg} got the class {cls.__name__}, not a spec; pass an instance"):
        fz.attention(q, q, q, **{arg: cls})


def test_num_heads_reaches_a_registry_name_that_takes_it() -> None:
    """``Attention(score_mod="alibi", num_heads=H)`` builds ALiBi for H heads (the name alone needs
    ``num_heads``); a name without that parameter is built as it is."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 16, 8, generator=g) for _ in range(3))
    layer = fz.Attention(score_mod="alibi", mask="causal", num_heads=4)
    assert layer.score_mod == score_mods.Alibi(num_heads=4)
    out = layer(q, k, v)
    expected = fz.attention(q, k, v, mask="causal", score_mod=score_mods.Alibi(num_heads=4))
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="num_heads"):
        fz.Attention(score_mod="alibi")


def test_learned_spec_tensors_are_module_parameters() -> None:
    """A spec's ``nn.Parameter`` (a learned T5 table) is a parameter of the layer: the optimizer
    over ``layer.parameters()`` trains it, ``state_dict`` holds it, and replacing the score mod
    replaces it."""
    table = torch.nn.Parameter(torch.zeros(32, 2))
    layer = fz.Attention(score_mod=score_mods.RelPosBias(table=table), mask="causal")
    assert [p is table for p in layer.parameters()] == [True]
    assert set(layer.state_dict()) == {"score_mod_param0"}
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    layer(q, k, v).square().sum().backward()
    opt.step()
    assert table.abs().sum() > 0  # trained through the optimizer
    layer.score_mod = None
    assert list(layer.parameters()) == [] and layer.state_dict() == {}
    shared = fz.Attention(
        mask=masks.Causal(),
        score_mod=score_mods.RelPosBias(table=table) >> score_mods.RelPosBias(table=table),
    )
    assert len(list(shared.parameters())) == 1
