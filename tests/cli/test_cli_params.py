"""Parsing of spec parameters given on the command line."""

from __future__ import annotations

import pytest
import torch

from flexattn_zoo import masks, score_mods
from flexattn_zoo.cli.params import build_specs, describe_spec, parse_value, split_options


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("3", 3),
        ("-1", -1),
        ("0.5", 0.5),
        ("1e-3", 1e-3),
        ("true", True),
        ("No", False),
        ("none", None),
        ("bottom_right", "bottom_right"),
        ("3,2,1", [3, 2, 1]),
        ("[3, 2]", [3, 2]),
        ("0,1;2,3", [[0, 1], [2, 3]]),
        ("4,", [4]),
    ],
)
def test_parse_value(text: str, value: object) -> None:
    assert parse_value(text) == value


def test_split_options_keeps_own_options_and_collects_params() -> None:
    known = {"--len": True, "--png": True, "--grad": False}
    kept, params = split_options(
        ["causal", "--left", "-3", "--len", "8", "--right=2", "--approx", "--grad", "--png", "x.png"], known
    )
    assert kept == ["causal", "--len", "8", "--grad", "--png", "x.png"]
    assert params == [("left", "-3"), ("right", "2"), ("approx", None)]


def test_build_specs_routes_params_to_the_right_part() -> None:
    mask, score = build_specs(
        "causal+sliding_window", "softcap", [("left", "4"), ("cap", "30"), ("approx", None)]
    )
    assert mask == masks.Causal() & masks.SlidingWindow(left=4)
    assert score == score_mods.SoftCap(cap=30.0, approx=True)


def test_build_specs_tensor_fields_and_context() -> None:
    mask, score = build_specs("document", "alibi", [("doc-ids", "0,0,1;0,1,1")], {"num_heads": 4})
    assert isinstance(mask, masks.Document)
    assert torch.equal(mask.doc_ids, torch.tensor([[0, 0, 1], [0, 1, 1]]))
    assert score == score_mods.get("alibi", num_heads=4)


def test_build_specs_from_constructor() -> None:
    mask, _ = build_specs("sliding_window", None, [("sliding-window", "4096")])
    assert mask == masks.SlidingWindow.from_hf(4096)


@pytest.mark.parametrize(
    ("mask", "params", "message"),
    [
        ("causal", [("size", "3")], "unknown parameter --size"),
        ("causal+chunked", [("document.size", "3")], "'document' is not part"),
        ("causal++chunked", [], "joined by"),
        ("no_such", [], "unknown mask"),
    ],
)
def test_build_specs_errors(mask: str, params: list[tuple[str, str]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_specs(mask, None, params)


def test_describe_spec() -> None:
    doc = masks.Document.from_lengths([3, 5])
    assert describe_spec(None) == "none"
    assert describe_spec(masks.Causal()) == "causal"
    assert describe_spec(masks.Causal(align="bottom_right")) == "causal(align='bottom_right')"
    assert describe_spec(doc & masks.Causal()) == "document(doc_ids=<8>) & causal"
    assert describe_spec(~(masks.Causal() | doc)) == "~(causal | document(doc_ids=<8>))"
    chain = score_mods.get("alibi", num_heads=2) >> score_mods.get("softcap", cap=5.0)
    assert describe_spec(chain) == "alibi(num_heads=2) >> softcap(cap=5.0)"
