"""flexattn_zoo.hf.factories on a stand-in ``masking_utils`` module (no transformers needed):
what the stand-ins record while Dynamo traces, and what install() leaves out."""

from __future__ import annotations

import types
from typing import Any

import torch

from flexattn_zoo.hf import factories


def _module(**functions: Any) -> types.SimpleNamespace:
    def causal_mask_function(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return kv <= q

    return types.SimpleNamespace(causal_mask_function=causal_mask_function, **functions)


def _traced_record(make: Any) -> Any:
    """What the closure ``make()`` carries when Dynamo traces the call (read inside the graph)."""
    seen: list[Any] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        seen.append(factories.recorded(make()))
        return x + 1

    torch.compile(f, backend="eager", fullgraph=True)(torch.zeros(1))
    return seen[0]


def test_stand_ins_record_arguments_and_defaults_only_while_traced() -> None:
    def sliding_window_overlay(sliding_window: int = 5) -> Any:
        def inner_mask(b: Any, h: Any, q: Any, kv: Any) -> Any:
            return kv > q - sliding_window

        return inner_mask

    def and_masks(*mask_functions: Any) -> Any:
        def and_mask(b: Any, h: Any, q: Any, kv: Any) -> Any:
            out = q.new_ones((), dtype=torch.bool)
            for m in mask_functions:
                out = out & m(b, h, q, kv)
            return out

        return and_mask

    mu = _module(sliding_window_overlay=sliding_window_overlay, and_masks=and_masks)
    assert factories.install(mu) == []
    assert factories.install(mu) == []  # again: nothing registered twice
    kind, args = _traced_record(lambda: mu.sliding_window_overlay())
    assert (kind, args) == ("sliding", {"sliding_window": 5})  # the default, recorded
    assert _traced_record(lambda: mu.sliding_window_overlay(sliding_window=9))[1] == {"sliding_window": 9}
    kind, args = _traced_record(lambda: mu.and_masks(mu.causal_mask_function))
    assert kind == "and" and args["mask_functions"] == (mu.causal_mask_function,)
    # Eagerly the originals run: closures as transformers makes them, nothing recorded.
    assert factories.recorded(mu.sliding_window_overlay(3)) is None


def test_a_factory_whose_closure_holds_other_values_is_left_out() -> None:
    """The recorded arguments stand for the closure's captured values: a factory that captures
    something else (here the window minus one) is not substituted, so the reader cannot be misled."""

    def sliding_window_overlay(sliding_window: int) -> Any:
        w = sliding_window - 1

        def inner_mask(b: Any, h: Any, q: Any, kv: Any) -> Any:
            return kv > q - w

        return inner_mask

    mu = _module(sliding_window_overlay=sliding_window_overlay)
    assert factories.install(mu) == ["sliding_window_overlay"]
    assert factories.install(mu) == []  # checked and reported once
    assert _traced_record(lambda: mu.sliding_window_overlay(4)) is None


def test_a_factory_another_library_substituted_is_left_out_without_raising() -> None:
    def padding_mask_function(padding_mask: torch.Tensor) -> Any:
        def inner_mask(b: Any, h: Any, q: Any, kv: Any) -> Any:
            return padding_mask[b, kv]

        return inner_mask

    @torch.compiler.substitute_in_graph(padding_mask_function, skip_signature_check=True)
    def theirs(padding_mask: torch.Tensor) -> Any:
        return padding_mask_function(padding_mask)

    assert factories.install(_module(padding_mask_function=padding_mask_function)) == [
        "padding_mask_function"
    ]


def test_a_new_factory_at_a_collected_one_s_address_is_checked_again() -> None:
    """install() remembers the functions it has seen, not their addresses: CPython puts a new
    function where a collected one lived, and that one must still be checked and reported."""
    reported = []
    for window in range(5):

        def sliding_window_overlay(sliding_window: int, w: int = window) -> Any:
            def inner_mask(b: Any, h: Any, q: Any, kv: Any) -> Any:
                return kv > q - w  # holds something other than its argument: left out

            return inner_mask

        reported.append(factories.install(_module(sliding_window_overlay=sliding_window_overlay)))
        del sliding_window_overlay  # freed here (no cycle): the next one may take its address
    assert reported == [["sliding_window_overlay"]] * 5
