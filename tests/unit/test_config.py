"""YAML mask / score-mod configs: strict keys, composition, clear errors."""

from __future__ import annotations

import pytest

from flexattn_zoo import masks, score_mods
from flexattn_zoo.config import load_yaml_spec


def test_mapping_and_list_forms() -> None:
    mask, score = load_yaml_spec(
        "mask: {name: sliding_window, left: 1023}\nscore_mod: {name: softcap, cap: 30}\n"
    )
    assert mask == masks.SlidingWindow(left=1023)
    assert score == score_mods.SoftCap(cap=30.0)
    mask, score = load_yaml_spec(
        "mask:\n  - {name: chunked, size: 8192}\n  - {name: causal}\n"
        "score_mod:\n  - {name: alibi, num_heads: 8}\n  - {name: softcap, cap: 50.0}\n"
    )
    assert mask == masks.Chunked(size=8192) & masks.Causal()
    assert score == score_mods.Alibi(num_heads=8) >> score_mods.SoftCap(cap=50.0)
    assert load_yaml_spec("{}") == (None, None)


def test_from_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "attn.yaml"
    path.write_text("mask: {name: prefix_lm, prefix_len: 16}\n")
    assert load_yaml_spec(path) == (masks.PrefixLM(prefix_len=16), None)
    assert load_yaml_spec(str(path)) == (masks.PrefixLM(prefix_len=16), None)
    with pytest.raises(ValueError, match="does not exist"):
        load_yaml_spec(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            "mask: {name: sliding_window, left: 3}\nmasks: {}\n",
            r"unknown YAML key\(s\) \['masks'\]; valid keys: mask, score_mod. Did you mean 'mask'",
        ),
        (
            "mask: {name: sliding_windw, left: 3}\n",
            "unknown mask 'sliding_windw'.*Did you mean 'sliding_window'",
        ),
        (
            "mask: {name: sliding_window, lft: 3}\n",
            r"unknown parameter\(s\) 'lft'; valid parameters: left, right",
        ),
        ("mask: {left: 3}\n", "mask needs a 'name' key"),
        ("mask: causal\n", "mask must be a mapping"),
        ("mask: []\n", "empty list"),
        ("score_mod: {name: softcap, cap: -1}\n", "cap"),
        ("mask: {name: sliding_window, left: [\n", "malformed YAML"),
        ("- just\n- a list\n", "must be a mapping"),
    ],
)
def test_errors(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_yaml_spec(text)
