"""``fz.attention`` inside a caller's ``torch.compile(fullgraph=True)`` with dynamic shapes (CPU
routes): batch and lengths symbolic, no graph break, the same result as eagerly, and one graph
for every size -- ``dynamic=True`` compiles once, automatic dynamic shapes (``dynamic=None``)
once more after the first change of length.

What varies within a model -- batch, lengths -- stays symbolic; model constants (heads, head
dims) and spec parameters are specialized (Dynamo guards on them). Specs are passed to the
compiled function as arguments, the hard case: Dynamo then makes their int fields symbolic
(``spec.static_int``), and under ``dynamic=True`` every float it reads from an object is
(``SoftCap.static_cap``; a ``scale``: ``validation.check_traced_scale``).

Every registered spec's first example and the compositions run forward (no grad: the CPU flex
kernel has no backward), and one spec per family forward + backward (auto's CPU training routes:
SDPA, split SDPA, dense), through ``aot_eager``: Dynamo and AOT autograd under symbolic sizes, which is what the
library's code decides. ``aot_eager`` has no cache, so a case is exactly one frame: a float the
library read while tracing and never used would show as a second (Dynamo traces again to
specialize it). Forward results are compared with the eager ``dense`` route (eager ``flex_cpu``
compiles its own kernel per shape, ~8 s each cold; test_compile_native compares its Inductor
cases with it at one shape), forward + backward with eager auto. Inductor compiles one case per kind of route
(flex_cpu forward with symbolic spec ints, floats and scale; SDPA and dense forward + backward):
a cold Inductor compile of the CPU flex kernel with symbolic sizes takes ~15-25 s on 2 cores.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.testing import spec_examples

H, D = 4, 16
#: (batch, length) of the calls one compiled function sees. No size is 0 or 1 (Dynamo specializes
#: those) nor equal to a head count or head dim (Dynamo gives equal sizes one symbol, and
#: specializing the head count would specialize the batch with it).
SIZES = ((2, 48), (3, 64), (2, 80))

Kwargs = dict[str, Any]


def _first_example(kind: str, name: str, batch: int, length: int) -> Any:
    return next(s for n, s in spec_examples(kind, length, length, batch, H) if n == name)


def _registered(kind: str) -> list[str]:
    return list(dict.fromkeys(n for n, _ in spec_examples(kind, 48, 48, 2, H)))


def _example_case(kind: str, name: str) -> Callable[[int, int], Kwargs]:
    arg = "mask" if kind == "mask" else "score_mod"
    return lambda b, n: {arg: _first_example(kind, name, b, n)}


#: Specs bound to the size of the call (document ids, padding flags) are built anew for each.
BOUND = ("mask:document", "mask:key_padding", "document_and_causal")

#: name -> kwargs for a call of batch ``b`` and length ``n``.
CASES: dict[str, Callable[[int, int], Kwargs]] = {
    **{f"mask:{n}": _example_case("mask", n) for n in _registered("mask")},
    **{f"score:{n}": _example_case("score", n) for n in _registered("score")},
    "document_and_causal": lambda b, n: {
        "mask": masks.Document.from_lengths([[20, n - 20]] + [[n]] * (b - 1)) & masks.Causal()
    },
    "sliding_causal_softcap": lambda b, n: {
        "mask": masks.SlidingWindow(left=8) & masks.Causal(),
        "score_mod": score_mods.SoftCap(cap=20.0),
    },
    "alibi_causal": lambda b, n: {"mask": masks.Causal(), "score_mod": score_mods.Alibi(num_heads=H)},
    "chunked_16": lambda b, n: {"mask": masks.Chunked(size=16)},  # equal chunks at every length
    "prefix_lm_16": lambda b, n: {"mask": masks.PrefixLM(prefix_len=16)},  # the split SDPA route
}


def _sizes(name: str) -> tuple[tuple[int, int], ...]:
    # A bound spec keeps the batch: the first example's rows differ by batch size.
    return tuple((2, n) for _, n in SIZES) if name in BOUND else SIZES


def _qkv(batch: int, length: int, grad: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(length)
    return tuple(torch.randn(batch, H, length, D, generator=g).requires_grad_(grad) for _ in range(3))


def _call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, score_mod: Any) -> torch.Tensor:
    return fz.attention(q, k, v, mask=mask, score_mod=score_mod)


def _grads(out: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out.square().sum(), inputs))


def _run(name: str, backend: str, *, grad: bool, dynamic: bool | None = True, sizes: Any = None) -> list[int]:
    """Run case ``name`` compiled at each size against eager; the frame count after each call."""
    counter = CompileCounterWithBackend(backend)
    step = torch.compile(_call, backend=counter, fullgraph=True, dynamic=dynamic)
    frames = []
    with torch.set_grad_enabled(grad):
        for b, n in sizes or _sizes(name):
            kw = CASES[name](b, n)
            q, k, v = _qkv(b, n, grad)
            out = step(q, k, v, kw.get("mask"), kw.get("score_mod"))
            ref = fz.attention(q, k, v, **kw, backend="auto" if grad else "dense")
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            if grad:
                for got, want in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v)), strict=True):
                    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            frames.append(counter.frame_count)
    return frames


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", list(CASES))
def test_forward_one_graph_for_every_size(name: str) -> None:
    """No graph break, eager's result, and one compile for all sizes (also for specs bound to a
    size: a new Document's ids are graph inputs)."""
    assert _run(name, "aot_eager", grad=False) == [1, 1, 1]


#: Forward + backward for one spec per family rather than every spec (each case is ~1-3 s on
#: 2 cores): the SDPA route (causal), a window with an int field made symbolic (sliding, the dense
#: route), a spec bound to the call's size with its ids as graph inputs (document), the split SDPA
#: route (prefix-LM) and a score mod with a float field made symbolic (softcap). Every spec still
#: runs forward in test_forward_one_graph_for_every_size.
BACKWARD_CASES = ("mask:causal", "mask:sliding_window", "mask:document", "prefix_lm_16", "score:softcap")


@pytest.mark.parametrize("name", BACKWARD_CASES)
def test_backward_one_graph_for_every_size(name: str) -> None:
    """Forward + backward: eager's output and gradients, one compile."""
    assert _run(name, "aot_eager", grad=True, sizes=_sizes(name)[:2]) == [1, 1]


def test_inductor_flex_with_symbolic_spec_ints_floats_and_scale() -> None:
    """The CPU flex kernel through Inductor, given what Dynamo makes symbolic: the window (an int
    field of a spec passed as an argument: Inductor's C++ flex kernel failed to compile a
    ``mask_mod`` closing over one, torch 2.13, "cur_qSplitSize7 was not declared"), the soft cap
    and a ``scale`` argument (floats), batch and lengths. Calls after the first add no frame (the
    first may count two: Inductor's pass that specializes the symbolic scale has Dynamo trace
    again, unless its cache knows the graph)."""
    mask = masks.SlidingWindow(left=8)
    score = score_mods.SoftCap(cap=20.0)
    counter = CompileCounterWithBackend("inductor")
    step = torch.compile(
        lambda q, k, v, m, s, sc: fz.attention(q, k, v, mask=m, score_mod=s, scale=sc),
        backend=counter,
        fullgraph=True,
        dynamic=True,
    )
    frames = []
    with torch.no_grad():
        for b, n in SIZES:
            q, k, v = _qkv(b, n, grad=False)
            assert fz.plan(q, k, v, mask=mask, score_mod=score, scale=0.2).backend == "flex_cpu"
            got = step(q, k, v, mask, score, 0.2)
            want = fz.attention(q, k, v, mask=mask, score_mod=score, scale=0.2, backend="dense")
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            frames.append(counter.frame_count)
    assert frames[0] in (1, 2) and frames == [frames[0]] * 3, frames


@pytest.mark.parametrize("name", ["mask:causal", "document_and_causal"])
def test_inductor_backward(name: str) -> None:
    """The SDPA flash route and the dense route (with a Document's ids as graph inputs),
    forward + backward compiled by Inductor."""
    assert _run(name, "inductor", grad=True, sizes=_sizes(name)[:2]) == [1, 1]


def test_lengths_past_one_block() -> None:
    """Past the first 128-position block, one recompile (Dynamo specializes a tensor dim of size
    1: the blocks of a BlockMask) and no more: the block-by-block builder that a traced Document
    uses evaluates its mask_mod in one piece rather than looping over a symbolic block count."""
    sizes = ((2, 100), (2, 200), (2, 400))
    assert _run("document_and_causal", "aot_eager", grad=False, sizes=sizes) == [1, 2, 2]


@pytest.mark.parametrize(("name", "grad"), [("sliding_causal_softcap", False), ("chunked_16", True)])
def test_automatic_dynamic_recompiles_once(name: str, grad: bool) -> None:
    """``dynamic=None``: the first length compiles static, the second recompiles with symbolic
    lengths, and later lengths reuse that graph."""
    sizes = ((2, 48), (2, 64), (2, 80), (2, 96))
    assert _run(name, "aot_eager", grad=grad, dynamic=None, sizes=sizes) == [1, 2, 2, 2]


def test_bottom_right_causal_compiles_once_per_offset() -> None:
    """``Causal(align="bottom_right")`` with Lq != Lkv binds ``OffsetCausal(Lkv - Lq)``: Dynamo
    traced the symbolic offset through the spec's checks, and the offset is specialized on
    purpose (Inductor's CPU flex kernel lowers no symbolic closure): lengths with the same offset
    share a graph, a new offset compiles once more."""
    mask = masks.Causal(align="bottom_right")
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(_call, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    with torch.no_grad():
        for lq, lkv in ((24, 56), (40, 72), (40, 80)):  # offsets 32, 32, 40
            q = torch.randn(2, H, lq, D)
            k, v = torch.randn(2, H, lkv, D), torch.randn(2, H, lkv, D)
            want = fz.attention(q, k, v, mask=mask, backend="dense")
            torch.testing.assert_close(step(q, k, v, mask, None), want, atol=1e-5, rtol=1e-5)
            frames.append(counter.frame_count)
    assert frames == [1, 1, 2]


def test_a_module_with_a_float_scale() -> None:
    """``fz.Attention`` with a ``scale``: under ``dynamic=True`` Dynamo makes the float attribute
    symbolic (checked by comparisons while tracing, specialized for the flex kernel)."""
    layer = fz.Attention(
        mask=masks.SlidingWindow(left=8) & masks.Causal(), score_mod=score_mods.SoftCap(cap=30.0), scale=0.2
    )
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    with torch.no_grad():
        for b, n in SIZES[:2]:
            q, k, v = _qkv(b, n, grad=False)
            want = fz.attention(
                q, k, v, mask=layer.mask, score_mod=layer.score_mod, scale=0.2, backend="dense"
            )
            torch.testing.assert_close(compiled(q, k, v), want, atol=1e-5, rtol=1e-5)
            frames.append(counter.frame_count)
    assert frames[0] in (1, 2) and frames[1] == frames[0], frames


def test_grouped_query_heads() -> None:
    """GQA: head counts are specialized (SDPA takes ``enable_gqa`` as a Python bool)."""
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(
        lambda q, k, v: fz.attention(q, k, v, mask="causal", enable_gqa=True),
        backend=counter,
        fullgraph=True,
        dynamic=True,
    )
    for b, n in ((3, 48), (5, 64)):  # batch never equal to the 2 kv heads (see SIZES)
        q = torch.randn(b, H, n, D)
        k, v = torch.randn(b, H // 2, n, D), torch.randn(b, H // 2, n, D)
        want = fz.attention(q, k, v, mask="causal", enable_gqa=True)
        torch.testing.assert_close(step(q, k, v), want, atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1
