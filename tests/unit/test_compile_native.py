"""``fz.attention`` inside a caller's ``torch.compile(fullgraph=True)``: no graph break, the same
result as eagerly, no library cache touched while tracing (CPU routes; the CUDA routes run in
``tests/gpu/test_compile_gpu.py``).

Every registered spec's first example is compiled once forward (no grad: the CPU flex kernel has
no backward) and counted with ``torch._dynamo.explain``: a few cases with Inductor, compared with
the same call eagerly, the rest with ``aot_eager``, compared with the eager ``dense`` route. A few
cases also run forward + backward (what auto picks with grad on the CPU). Shapes are small and
fixed, so each case is one compile.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import preset_params
import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.plan_cache import PLANS
from flexattn_zoo.testing import assert_matches_reference, spec_examples

B, H, L, D = 2, 4, 48, 16
W_IN = torch.randn(H * D, 3 * H * D, generator=torch.Generator().manual_seed(1)) / (H * D) ** 0.5
W_OUT = torch.randn(H * D, 8, generator=torch.Generator().manual_seed(2))


def _first_examples(kind: str) -> list[tuple[str, Any]]:
    seen: dict[str, Any] = {}
    for name, spec in spec_examples(kind, L, L, B, H):
        seen.setdefault(name, spec)
    return list(seen.items())


CASES: list[tuple[str, dict[str, Any]]] = [
    *((f"mask:{n}", {"mask": s}) for n, s in _first_examples("mask")),
    *((f"score:{n}", {"score_mod": s}) for n, s in _first_examples("score")),
    ("causal_by_name", {"mask": "causal"}),
    (
        "document_and_causal",
        {"mask": masks.Document.from_lengths([[20, 28], [48]]) & masks.Causal()},
    ),
    (
        "sliding_causal_softcap",
        {"mask": masks.SlidingWindow(left=8) & masks.Causal(), "score_mod": score_mods.SoftCap(cap=20.0)},
    ),
    ("alibi_causal", {"mask": masks.Causal(), "score_mod": score_mods.Alibi(num_heads=H)}),
    ("raw_callable", {"mask": lambda b, h, q, kv: (q - kv).abs() <= 5}),
]


#: Cases compiled with Inductor in test_no_graph_break_and_same_result_as_eager.
INDUCTOR_CASES = {"mask:causal", "document_and_causal", "sliding_causal_softcap", "raw_callable", "mask:band"}


def _inputs(grad: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, L, D, generator=g).requires_grad_(grad) for _ in range(3))


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(("name", "kw"), CASES, ids=[c[0] for c in CASES])
def test_no_graph_break_and_same_result_as_eager(name: str, kw: dict[str, Any]) -> None:
    # Linear -> attention -> Linear, as in a model. (Inductor's CPU flex template, torch 2.13,
    # fails on a pointwise op fused after it and on q/k/v reinterpreted from a 2-D matmul
    # output; a model's [B, L, 3, H, D] projection, as here, compiles.)
    def block(x: torch.Tensor, **extra: Any) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (x @ W_IN).view(B, L, 3, H, D).unbind(2))
        out = fz.attention(q, k, v, **kw, **extra)
        return out.transpose(1, 2).reshape(B, L, H * D) @ W_OUT

    x = torch.randn(B, L, H * D, generator=torch.Generator().manual_seed(3))
    explained = torch._dynamo.explain(block)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    with torch.no_grad():
        # Inductor for a few cases (a CPU flex compile costs seconds on CI's 2 cores), compared
        # with the same call eagerly (auto: its own flex_cpu kernel). The rest through aot_eager,
        # which still runs the traced route's ops and the flex HOP, compared with the eager dense
        # route: an eager flex_cpu call would compile a flex kernel per case (~3-5 s each).
        inductor = name in INDUCTOR_CASES
        compiled = torch.compile(block, fullgraph=True, backend="inductor" if inductor else "aot_eager")(x)
        eager = block(x) if inductor else block(x, backend="dense")
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("name", "kw"), [c for c in CASES if c[0] in ("mask:causal", "mask:document", "alibi_causal")]
)
def test_backward_through_the_compiled_call(name: str, kw: dict[str, Any]) -> None:
    q, k, v = _inputs(grad=True)
    out = torch.compile(lambda a, b, c: fz.attention(a, b, c, **kw), fullgraph=True)(q, k, v)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(out, q, k, v, **kw, grads=grads, grad_out=grad_out)


def test_tracing_reads_and_stores_no_cache() -> None:
    q, k, v = _inputs(grad=False)
    PLANS.clear()
    with torch.no_grad():
        torch.compile(lambda a, b, c: fz.attention(a, b, c, mask="causal"), fullgraph=True)(q, k, v)
    assert len(PLANS) == 0


def test_the_module_compiles_whole() -> None:
    layer = fz.Attention(
        mask=masks.SlidingWindow(left=8) & masks.Causal(), score_mod=score_mods.SoftCap(cap=30.0)
    )
    q, k, v = _inputs(grad=False)
    explained = torch._dynamo.explain(layer)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(layer, fullgraph=True)(q, k, v), layer(q, k, v))


def test_a_new_document_each_step_reuses_the_graph() -> None:
    """Packed batches change every step: a new ``Document`` of the same shape must neither break
    the graph nor recompile (its ids are graph inputs)."""
    q, k, v = _inputs(grad=False)
    counts = {"frames": 0}

    def backend(gm: Any, example_inputs: Any) -> Any:
        counts["frames"] += 1
        return gm.forward

    step = torch.compile(lambda a, b, c, m: fz.attention(a, b, c, mask=m), backend=backend, fullgraph=True)
    with torch.no_grad():
        for lengths in ([[20, 28], [48]], [[10, 38], [24, 24]], [[48], [1, 47]]):
            doc = masks.Document.from_lengths(lengths) & masks.Causal()
            torch.testing.assert_close(step(q, k, v, doc), fz.attention(q, k, v, mask=doc))
    assert counts["frames"] == 1


def test_a_compile_in_another_thread_does_not_change_eager_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compiler.is_compiling() reads a process-wide flag that a compile in *another* thread
    sets (found by the GPU soak: Documents built meanwhile shared the caller's ids). An eager
    call must keep its eager path: owned spec tensors, caches, locks."""
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)  # as another thread's compile
    assert torch.compiler.is_compiling()
    from flexattn_zoo import _compat

    assert not _compat.is_compiling()
    ids = torch.tensor([0] * 20 + [1] * 28)
    doc = masks.Document(doc_ids=ids) & masks.Causal()
    ids.fill_(0)  # the caller reuses its buffer: the spec owns a copy
    q, k, v = _inputs(grad=False)
    PLANS.clear()
    out = fz.attention(q, k, v, mask=doc)
    assert len(PLANS) == 1  # the eager path's plan cache was used
    expected = masks.Document(doc_ids=torch.tensor([0] * 20 + [1] * 28)) & masks.Causal()
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", False)
    torch.testing.assert_close(out, fz.attention(q, k, v, mask=expected, backend="dense"))


def _graph_ops(fn: Any, *args: Any) -> set[str]:
    """The call targets in the one graph Dynamo captures for ``fn(*args)``, as strings."""
    graphs: list[Any] = []

    def backend(gm: Any, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    assert len(graphs) == 1
    return {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize(
    ("mask", "op"),
    [
        (masks.Causal(), "scaled_dot_product_attention"),
        (masks.Chunked(size=16) & masks.Causal(), "scaled_dot_product_attention"),  # as equal chunks
        (masks.SlidingWindow(left=8), "flex_attention"),
    ],
    ids=["causal", "chunked_causal", "sliding"],
)
def test_the_route_op_lands_in_the_callers_graph(mask: Any, op: str) -> None:
    """SDPA routes put the SDPA call in the caller's graph, flex routes the flex_attention
    higher-order op (no nested compiled function): the caller's compile owns the kernel."""
    q, k, v = _inputs(grad=False)
    ops = _graph_ops(lambda a, b, c: fz.attention(a, b, c, mask=mask), q, k, v)
    assert any(op in t for t in ops), ops


@pytest.mark.parametrize("force_option", [True, False])
def test_a_trace_in_another_thread_does_not_refuse_eager_compiled_calls(
    monkeypatch: pytest.MonkeyPatch, force_option: bool
) -> None:
    """torch's "an FX trace is running" flag is process-wide: while another thread's compile
    traces, Dynamo refused every compiled call as a nested FX trace (found by the GPU soak). The
    flag is set here as that thread would; without torch's force option the call waits for it."""
    from torch.fx import _symbolic_trace

    from flexattn_zoo import _compat

    q, k, v = _inputs(grad=False)
    spec = masks.SlidingWindow(left=8) & masks.Causal()
    want = fz.attention(q, k, v, mask=spec, backend="flex_cpu")  # compiled before the flag is set
    monkeypatch.setattr(_compat, "_can_force_compile_during_fx_trace", lambda: force_option)
    monkeypatch.setattr(_symbolic_trace, "_is_fx_tracing_flag", True)
    if not force_option:  # the other thread's trace ends a little later
        threading.Timer(0.2, lambda: setattr(_symbolic_trace, "_is_fx_tracing_flag", False)).start()
    torch.testing.assert_close(fz.attention(q, k, v, mask=spec, backend="flex_cpu"), want)


def test_a_prebuilt_block_mask_compiles_on_the_dense_route() -> None:
    """The dense route reads a user BlockMask's mask_mod on index grids. Eagerly it probes the
    callable first; traced it evaluates it as flex does (the probe walks Python objects Dynamo
    cannot trace: the H200 saw a graph break, torch 2.13 an internal Dynamo error)."""
    doc = masks.Document.from_lengths([[20, 28], [12, 36]]) & masks.Causal()
    bm = fz.block_mask(doc, L, L, batch=B, heads=H, device="cpu")
    q, k, v = _inputs(grad=True)

    def call(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return fz.attention(a, b, c, mask=bm, backend="dense")

    assert torch._dynamo.explain(call)(q, k, v).graph_break_count == 0
    torch._dynamo.reset()
    out = torch.compile(call, fullgraph=True, backend="aot_eager")(q, k, v)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert_matches_reference(out, q, k, v, mask=doc, grads=grads, grad_out=torch.ones_like(out))


def test_tracing_a_gqa_call_warns_nothing() -> None:
    """Choosing a route while traced reads no ``functools.cache`` d function: Dynamo traces through
    those and warns once per call site, which a compiled model's user sees as noise."""
    import warnings

    torch._dynamo.reset()
    q = torch.randn(1, 4, 32, 16)
    k, v = torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
    call = lambda a, b, c: fz.attention(a, b, c, mask=masks.Causal(), enable_gqa=True)  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # A fresh warn-once record, so a test run before this one cannot hide the warning.
        torch._dynamo.utils.warn_once_cache.clear()
        torch.compile(call, backend="eager", fullgraph=True)(q, k, v)
    assert not [w for w in caught if "lru_cache" in str(w.message)]


@pytest.mark.parametrize("kind", ["prefix_lm", "document"])
def test_data_specs_made_inside_the_graph_take_new_values_without_a_recompile(kind: str) -> None:
    """A spec built inside the compiled step from tensors passed in (a [B] prefix length, document
    ids): its constructor's checks of the values run eagerly only (traced, a check reading the
    values would break the graph), and new values reuse the compiled graph."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    q, k, v = _inputs(False)

    def make(t: torch.Tensor) -> Any:
        return (
            masks.PrefixLM(prefix_len=t)
            if kind == "prefix_lm"
            else masks.Document(doc_ids=t) & masks.Causal()
        )

    if kind == "prefix_lm":
        values = [torch.tensor(x) for x in ([5, 40], [48, 0], [1, 17])]
    else:
        values = [masks.Document.from_lengths(r).doc_ids for r in ([[20, 28], [48]], [[1, 47], [24, 24]])]
    torch._dynamo.reset()
    step = torch.compile(
        lambda a, b, c, t: fz.attention(a, b, c, mask=make(t)), backend=counter, fullgraph=True
    )
    for t in values:
        assert_matches_reference(step(q, k, v, t), q, k, v, mask=make(t))
    assert counter.frame_count == 1


#: Specs made in the graph from tensors computed there by pointwise ops (a cast, a division, a
#: scale), each with the tensor it is made from.
COMPUTED_TENSOR_SPECS: dict[str, tuple[Any, torch.Tensor]] = {
    "padding_cast": (
        lambda t: {"mask": masks.KeyPadding(valid=t.to(torch.bool)) & masks.Causal()},
        torch.ones(B, L),
    ),
    "prefix_scaled": (lambda t: {"mask": masks.PrefixLM(prefix_len=t * 3)}, torch.tensor([5, 9])),
    "document_divided": (
        lambda t: {"mask": masks.Document(doc_ids=t // 16) & masks.Causal()},
        torch.arange(L).expand(B, L).contiguous(),
    ),
    "dense_compared": (lambda t: {"mask": masks.Dense(mask=t > 0) & masks.Causal()}, torch.randn(1, 1, L, L)),
    "bias_scaled": (
        lambda t: {"mask": masks.Causal(), "score_mod": score_mods.Bias(bias=t * 0.5)},
        torch.randn(1, 1, L, L),
    ),
}


@pytest.mark.parametrize("case", list(COMPUTED_TENSOR_SPECS))
def test_specs_of_tensors_computed_in_the_graph_compile_on_the_cpu_flex_kernel(case: str) -> None:
    """Inductor's CPU flex template fused the pointwise ops that made a spec's tensor and then
    found no kernel choice (or asserted that every mask / score buffer be a kernel input): the
    traced CPU flex route hands the kernel copies of the spec's tensors made by one opaque op.
    q, k, v come from a projection, as in a model."""
    make, t = COMPUTED_TENSOR_SPECS[case]
    t = t.clone()
    if case == "padding_cast":
        t[0, :10] = 0

    def block(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        q, k, v = (x @ W_IN).view(B, L, 3, H, D).unbind(2)
        out = fz.attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), backend="flex_cpu", **make(t)
        )
        return out.transpose(1, 2).reshape(B, L, H * D)

    x = torch.randn(B, L, H * D, generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)(x, t)
    torch.testing.assert_close(compiled, block(x, t), atol=1e-5, rtol=1e-5)


def _block_order_calls(gm: torch.fx.GraphModule) -> int:
    return sum(node.target is torch.ops.flexattn_zoo.block_order.default for node in gm.graph.nodes)


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_spec_made_in_the_graph_builds_its_block_mask_once_for_every_layer(dynamic: bool) -> None:
    """A model builds its mask spec in the forward and hands it to every layer: the graph builds
    the BlockMask once, not once per layer (under dynamic shapes too: the layers' symbolic lengths
    are compared, never hashed, so no recompile), and every layer's output is the eager one."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    def layers(n: int) -> Any:
        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            mask = masks.Document(doc_ids=ids) & masks.Causal()
            for _ in range(n):
                q = fz.attention(q, k, v, mask=mask, backend="flex_cpu")
            return q

        return run

    calls = {}
    for n in (1, 4):
        graphs.clear()
        torch._dynamo.reset()
        step = torch.compile(layers(n), backend=backend, fullgraph=True, dynamic=dynamic)
        for length in (48, 40) if dynamic else (48,):
            q, k, v = (torch.randn(B, H, length, D) for _ in range(3))
            ids = masks.Document.from_lengths([[length - 30, 30], [length]]).doc_ids
            torch.testing.assert_close(step(q, k, v, ids), layers(n)(q, k, v, ids), atol=1e-5, rtol=1e-5)
        assert len(graphs) == 1
        calls[n] = _block_order_calls(graphs[0])
    assert calls[1] > 0
    assert calls[4] == calls[1]


def test_a_spec_made_outside_the_graph_is_not_written_to_by_a_trace() -> None:
    """A spec passed into the compiled function keeps nothing from the trace (a write would be a
    side effect replayed after the graph, guarded on at the next call): it is built per layer as
    before, and a second call reuses the graph."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    mask = masks.Document.from_lengths([[20, 28], [48]]) & masks.Causal()
    q, k, v = _inputs(False)

    def two_layers(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, m: Any) -> torch.Tensor:
        return fz.attention(
            fz.attention(a, b, c, mask=m, backend="flex_cpu"), b, c, mask=m, backend="flex_cpu"
        )

    torch._dynamo.reset()
    step = torch.compile(two_layers, backend=counter, fullgraph=True)
    for _ in range(2):
        torch.testing.assert_close(step(q, k, v, mask), two_layers(q, k, v, mask), atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1
    assert "_graph_memo" not in vars(mask)


def test_the_empty_rows_refusal_names_the_graph_only_while_traced() -> None:
    """The CUDA SDPA routes refuse an attn_mask that may leave a row seeing no key; traced, a data
    mask's rows are unread, and the reason must say the graph is why (a named route that runs the
    call eagerly refuses it only there; tests/gpu/test_compile_gpu.py runs the routes)."""
    from flexattn_zoo.backends import sdpa

    eager = sdpa._empty_rows_reason("kernels differ")
    traced = torch.compile(
        lambda t: (t + 1, sdpa._empty_rows_reason("kernels differ")), backend="eager", fullgraph=True
    )(torch.ones(1))[1]
    assert "inside a torch.compile'd graph" in traced
    assert "torch.compile" not in eager and "may leave a query row seeing no key" in eager


def test_a_spec_made_in_the_graph_can_leave_it() -> None:
    """What a trace keeps on a spec made in it is rebuildable by Dynamo: the spec can be returned
    from a ``fullgraph`` compile (static and dynamic shapes), and one live across a graph break
    passes its BlockMask to the graph after the break (built once, two graphs, as without it)."""
    q, k, v = _inputs(False)
    ids = masks.Document.from_lengths([[20, 28], [48]]).doc_ids

    def returns_spec(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, t: torch.Tensor) -> Any:
        mask = masks.Document(doc_ids=t) & masks.Causal()
        return fz.attention(a, b, c, mask=mask, backend="flex_cpu"), mask

    for dynamic in (False, True):
        torch._dynamo.reset()
        out, mask = torch.compile(returns_spec, fullgraph=True, backend="aot_eager", dynamic=dynamic)(
            q, k, v, ids
        )
        assert mask == masks.Document(doc_ids=ids) & masks.Causal()
        assert_matches_reference(out, q, k, v, mask=mask)

    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    def two_layers_and_a_break(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, t: torch.Tensor) -> Any:
        mask = masks.Document(doc_ids=t) & masks.Causal()
        a = fz.attention(a, b, c, mask=mask, backend="flex_cpu")
        torch._dynamo.graph_break()
        return fz.attention(a, b, c, mask=mask, backend="flex_cpu")

    torch._dynamo.reset()
    out = torch.compile(two_layers_and_a_break, backend=backend)(q, k, v, ids)
    torch.testing.assert_close(out, two_layers_and_a_break(q, k, v, ids), atol=1e-5, rtol=1e-5)
    assert len(graphs) == 2
    assert _block_order_calls(graphs[0]) > 0 and _block_order_calls(graphs[1]) == 0


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("name", fz.presets.names())
def test_every_preset_layer_compiles_whole(name: str, layer: int) -> None:
    """``fz.Attention(preset, layer=...)`` (sinks included where the layer has them) under
    ``torch.compile(fullgraph=True)``: no graph break, and the result of the same layer eagerly on the
    ``dense`` route (``aot_eager``, as for most cases above: it runs the traced route's ops
    without an Inductor compile each)."""
    module, dense = (
        fz.Attention(name, layer=layer, num_heads=H, backend=backend, **preset_params.SHORT.get(name, {}))
        for backend in ("auto", "dense")
    )
    if module.sinks is not None:
        with torch.no_grad():
            module.sinks.copy_(torch.linspace(-1, 1, H))
            dense.sinks.copy_(module.sinks)
    q, k, v = _inputs(grad=False)
    with torch.no_grad():
        # fullgraph=True: a graph break raises.
        compiled = torch.compile(module, fullgraph=True, backend="aot_eager")(q, k, v)
        torch.testing.assert_close(compiled, dense(q, k, v), atol=1e-5, rtol=1e-5)


class _Block(torch.nn.Module):
    def __init__(self, **kw: Any) -> None:
        super().__init__()
        self.kw = kw

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return fz.attention(q, k, v, **self.kw)


#: (case, call arguments, an op the exported graph must hold: the route's kernel call).
EXPORT_CASES = [
    ("causal_sdpa", {"mask": "causal"}, "scaled_dot_product"),
    (
        "sliding_flex",
        {"mask": masks.SlidingWindow(left=8) & masks.Causal(), "backend": "flex_cpu"},
        "flex_attention",
    ),
    (
        "document_flex",
        {"mask": masks.Document.from_lengths([[20, 28], [48]]) & masks.Causal()},
        "flex_attention",
    ),
]


@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
@pytest.mark.parametrize(("name", "kw", "op"), EXPORT_CASES, ids=[c[0] for c in EXPORT_CASES])
def test_export_holds_the_routes_kernel_and_matches_reference(
    name: str, kw: dict[str, Any], op: str, strict: bool
) -> None:
    """``torch.export`` of a module calling ``fz.attention``: the route's kernel call is in the
    exported graph (SDPA's op, or flex's higher-order op with its BlockMask built in the graph),
    and the exported program gives the reference's result."""
    q, k, v = _inputs(grad=False)
    exported = torch.export.export(_Block(**kw), (q, k, v), strict=strict)
    assert op in exported.graph_module.code, exported.graph_module.code
    spec = {key: value for key, value in kw.items() if key != "backend"}
    assert_matches_reference(exported.module()(q, k, v), q, k, v, **spec)


def test_export_refuses_a_route_that_cannot_be_traced_by_name() -> None:
    """A named route that cannot run inside a traced graph refuses the export with its name and
    reason, rather than a tracer error: equal documents run on SDPA eagerly (as chunks), but in
    the graph the ids are not read, so the segments are unknown there."""
    q, k, v = _inputs(grad=False)
    doc = masks.Document.from_lengths([[24, 24], [24, 24]]) & masks.Causal()
    assert fz.plan(q, k, v, mask=doc, backend="sdpa_flash").backend == "sdpa_flash"  # eagerly it runs
    with pytest.raises(
        ValueError, match=r"backend 'sdpa_flash' cannot run this call.*torch\.compile'd graph"
    ):
        torch.export.export(_Block(mask=doc, backend="sdpa_flash"), (q, k, v), strict=False)


def test_a_device_argument_is_not_looked_up_while_traced() -> None:
    # Traced flex calls build their BlockMask and mask_mod through check_device_arg on q's device;
    # the CUDA device-count lookup it makes eagerly cannot be put in a graph (Dynamo: "torch.* op
    # returned non-Tensor"), and the traced call's tensors are on that device already. So while
    # traced it is skipped: here a CPU-only build traces a "cuda:0" argument, refused eagerly.
    from flexattn_zoo.validation import check_device_arg

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x + (1 if check_device_arg("cuda:0").type == "cuda" else 0)

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            fn(torch.zeros(2))
    out = torch.compile(fn, fullgraph=True, backend="eager")(torch.zeros(2))
    assert torch.equal(out, torch.ones(2))


def test_a_score_mod_made_inside_the_compiled_region_traces_whole() -> None:
    # A lambda made in the traced function shows Dynamo no closure to walk for learned tensors
    # (an AttributeError while traced, "Observed exception" before): its captures are unknown, so
    # a backward is planned for them, and the call traces whole, reaching the parameter it reads.
    q, k, v = _inputs(grad=False)
    bias = torch.nn.Parameter(torch.randn(H, generator=torch.Generator().manual_seed(4)))

    def block(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return fz.attention(a, b, c, score_mod=lambda s, bi, h, qi, kv: s * 0.5 + bias[h] * (qi - kv))

    out = torch.compile(block, fullgraph=True, backend="aot_eager")(q, k, v)
    grad_out = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, (bias,), grad_out)
    want = torch.nn.Parameter(bias.detach().double())
    ref = fz.testing.reference_attention(
        q.double(), k.double(), v.double(), score_mod=lambda s, bi, h, qi, kv: s * 0.5 + want[h] * (qi - kv)
    )
    (want_grad,) = torch.autograd.grad(ref, (want,), grad_out.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # The bias gradient sums over every score: held to the error of the same float32 computation
    # made eagerly, as the tests hold every route.
    (eager_grad,) = torch.autograd.grad(block(q, k, v), (bias,), grad_out)
    budget = 2 * (eager_grad.double() - want_grad).abs().max() + 1e-6
    assert (grad.double() - want_grad).abs().max() <= budget


_HELPER_CAP = 4.0


def _capped_by_a_global_helper(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
    return _helper_cap(s)


def _helper_cap(s: torch.Tensor) -> torch.Tensor:
    return _HELPER_CAP * torch.tanh(s / _HELPER_CAP)


def test_a_score_mod_calling_a_global_helper_traces_without_warnings() -> None:
    # The captured-tensor walk reads the globals a function names through an lru_cache'd helper,
    # which Dynamo warns about (once per process) when it traces through it.
    q, k, v = _inputs(grad=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lru_cache")
        out = torch.compile(
            lambda a, b, c: fz.attention(a, b, c, score_mod=_capped_by_a_global_helper),
            fullgraph=True,
            backend="aot_eager",
        )(q, k, v)
    assert_matches_reference(out, q, k, v, score_mod=_capped_by_a_global_helper)


def test_a_layer_holding_a_callable_compiles_and_reads_in_place_writes() -> None:
    # A spec wrapping a raw callable, built eagerly (here by the layer), was brought up to date
    # while traced: the trace's empty capture state never matched the eager one, so the eager-only
    # probe ran in the graph and failed on its data-dependent comparison. The graph reads the
    # captured ids as an input: a write between calls is seen without a recompile.
    from torch._dynamo.testing import CompileCounter

    q, k, v = _inputs(grad=False)
    ids = masks.Document.from_lengths([[20, 28]]).doc_ids[0].clone()

    def same_document(b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return (ids[qi] == ids[kv]) & (qi >= kv)

    counter = CompileCounter()
    layer = torch.compile(fz.Attention(mask=same_document), fullgraph=True, backend=counter)
    for lengths in ([20, 28], [40, 8]):
        ids.copy_(masks.Document.from_lengths([lengths]).doc_ids[0])
        assert_matches_reference(layer(q, k, v), q, k, v, mask=same_document)
    assert counter.frame_count == 1


def test_a_named_routes_refusal_of_a_callable_made_in_the_graph_says_why() -> None:
    # The note added to a traced refusal walked the callable's closure, which a lambda made in the
    # graph does not show Dynamo: an AttributeError from the walk replaced the route's reasons.
    q, k, v = _inputs(grad=False)
    ids = torch.arange(L) // 16

    def call(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return fz.attention(a, b, c, mask=lambda bi, h, qi, kv: ids[qi] == ids[kv], backend="sdpa_flash")

    with pytest.raises(Exception, match=r"backend 'sdpa_flash' cannot run this call: mask FunctionMask"):
        torch.compile(call, fullgraph=True, backend="eager")(q, k, v)
