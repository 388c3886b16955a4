"""``fz.attention`` inside a caller's ``torch.compile(fullgraph=True)`` on CUDA: every preset on the
route auto picks and on each route that accepts it, forward and backward, no graph break, results
against the float64 reference; plus ``mode="reduce-overhead"`` (CUDA graphs) and ``torch.export``;
and the fa4 route's torch ops (``flexattn_zoo::fa4_fwd`` / ``fa4_bwd``) compiled whole, with
gradients through both the output and the lse.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import flexattn_zoo as fz
from flexattn_zoo import _compat, masks, score_mods
from flexattn_zoo.backends import BACKENDS
from flexattn_zoo.testing import assert_matches_reference, eager_attention, reference_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
B, H, L, D = 2, 4, 384, 64


def _doc() -> masks.Document:
    return masks.Document.from_lengths([[100, 150, 134], [20, 364]], device=DEV)


def _ids_callable() -> Any:
    """A raw mask_mod over a captured [B, L] tensor (the generic block-by-block builder)."""
    ids = _doc().doc_ids

    def same_doc_causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (ids[b, q] == ids[b, kv]) & (kv <= q)

    return same_doc_causal


CASES: dict[str, Any] = {
    "full": lambda: {},
    "causal": lambda: {"mask": masks.Causal()},
    "sliding_causal": lambda: {"mask": masks.SlidingWindow(left=64) & masks.Causal()},
    "document_causal": lambda: {"mask": _doc() & masks.Causal()},
    "prefix_lm_tensor": lambda: {"mask": masks.PrefixLM(prefix_len=torch.tensor([40, 300]))},
    "key_padding": lambda: {
        "mask": masks.KeyPadding(valid=torch.arange(L, device=DEV) < torch.tensor([[200], [384]], device=DEV))
    },
    "callable_ids": lambda: {"mask": _ids_callable()},
    "chunked_causal": lambda: {"mask": masks.Chunked(size=128) & masks.Causal()},
    "alibi_causal": lambda: {"mask": masks.Causal(), "score_mod": score_mods.Alibi(num_heads=H)},
    "softcap_sliding": lambda: {
        "mask": masks.SlidingWindow(left=64) & masks.Causal(),
        "score_mod": score_mods.SoftCap(cap=30.0),
    },
}
CUDA_ROUTES = ["auto", *(b.name for b in BACKENDS if "cuda" in b.devices)]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs(grad: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=DEV).manual_seed(0)
    return tuple(
        torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_(grad)
        for _ in range(3)
    )


#: Forward on every CUDA route; forward + backward on the route auto picks (compiles are slow).
PARAMS = [(c, r, False) for c in CASES for r in CUDA_ROUTES] + [(c, "auto", True) for c in CASES]


#: Masks that read tensors (document ids, [B] prefix lengths, different in each batch row): their
#: BlockMask is built inside the graph (a wrong build shows as wrong rows after the first).
DATA_CASES = {"document_causal", "prefix_lm_tensor", "key_padding", "callable_ids"}
#: Refusals that apply only inside a compiled graph (the route runs the same call eagerly).
TRACED_ONLY = "inside a torch.compile'd graph"


@pytest.mark.parametrize(
    ("case", "route", "grad"), PARAMS, ids=[f"{c}-{r}-{'fwdbwd' if g else 'fwd'}" for c, r, g in PARAMS]
)
def test_fullgraph_per_route(case: str, route: str, grad: bool) -> None:
    kw = CASES[case]()
    q, k, v = _inputs(grad)
    try:
        plan = fz.plan(q, k, v, backend=route, **kw)
    except ValueError as err:
        pytest.skip(f"{route} refuses {case}: {err}")

    def call(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return fz.attention(a, b, c, backend=route, **kw)

    try:
        explained = torch._dynamo.explain(call)(q, k, v)
    except ValueError as err:
        if TRACED_ONLY not in str(err):
            raise
        pytest.skip(f"{route} refuses {case} while traced: {err}")
    assert explained.graph_break_count == 0, (plan.backend, explained.break_reasons)
    torch._dynamo.reset()
    out = torch.compile(call, fullgraph=True)(q, k, v)
    if not grad:
        assert_matches_reference(out, q, k, v, **kw)
        return
    # Gradients through the compiled graph against float64, by fz.testing's budget rule.
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_matches_reference(out, q, k, v, **kw, grads=grads, grad_out=grad_out)


@pytest.mark.parametrize("case", ["document_causal", "prefix_lm_tensor"])
def test_data_masks_take_new_values_without_a_recompile(case: str) -> None:
    """Document ids passed into the compiled step (as a training loop does): new ids each step,
    one compile, every batch row exact."""
    q, k, v = _inputs(False)
    counter = CompileCounterWithBackend("inductor")

    if case == "document_causal":
        rows = ([[100, 150, 134], [20, 364]], [[384], [200, 84, 100]], [[1] * 128 + [256], [383, 1]])
        values = [masks.Document.from_lengths(r, device=DEV).doc_ids for r in rows]
        make = lambda t: masks.Document(doc_ids=t) & masks.Causal()  # noqa: E731
    else:
        values = [torch.tensor(x, device=DEV) for x in ([40, 300], [384, 1], [0, 129])]
        make = lambda t: masks.PrefixLM(prefix_len=t)  # noqa: E731

    step = torch.compile(
        lambda a, b, c, t: fz.attention(a, b, c, mask=make(t)), backend=counter, fullgraph=True
    )
    for t in values:
        assert_matches_reference(step(q, k, v, t), q, k, v, mask=make(t))
    assert counter.frame_count == 1, counter.frame_count


@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwdbwd"])
def test_layers_sharing_a_spec_made_in_the_graph(grad: bool) -> None:
    """A model's forward builds one document mask from the ids passed in and hands it to each of
    its layers: the graph builds the BlockMask once for all of them (``flexattn_zoo::block_order``
    appears once per build), new ids take no new compile, and every layer, forward and backward,
    matches the float64 reference."""
    q, k, v = _inputs(grad)
    graphs: list[Any] = []

    def backend(gm: Any, example_inputs: Any) -> Any:
        graphs.append(gm)
        return torch._inductor.compile(gm, example_inputs)

    def layers(
        a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, ids: torch.Tensor, n: int = 3
    ) -> torch.Tensor:
        mask = masks.Document(doc_ids=ids) & masks.Causal()
        return torch.stack([fz.attention(a * 2.0**i, b, c, mask=mask) for i in range(n)])

    step = torch.compile(layers, backend=backend, fullgraph=True)
    for rows in ([[100, 150, 134], [20, 364]], [[384], [200, 84, 100]]):
        ids = masks.Document.from_lengths(rows, device=DEV).doc_ids
        mask = masks.Document(doc_ids=ids) & masks.Causal()
        out = step(q, k, v, ids)
        for i in range(3):
            if not grad:
                assert_matches_reference(out[i], q * 2.0**i, k, v, mask=mask)
                continue
            # Layer i's gradients, through the graph that runs all three.
            qi = (q.detach() * 2.0**i).requires_grad_(True)
            ki, vi = k.detach().requires_grad_(True), v.detach().requires_grad_(True)
            one = step(qi / 2.0**i, ki, vi, ids)[i]  # powers of two: exact in bf16
            grad_out = torch.randn_like(one)
            grads = torch.autograd.grad(one, (qi, ki, vi), grad_out)
            assert_matches_reference(one, qi, ki, vi, mask=mask, grads=grads, grad_out=grad_out)
    assert len(graphs) == 1, len(graphs)
    torch.compile(lambda a, b, c, ids: layers(a, b, c, ids, 1), backend=backend, fullgraph=True)(q, k, v, ids)

    def builds(gm: Any) -> int:
        return sum(n.target is torch.ops.flexattn_zoo.block_order.default for n in gm.graph.nodes)

    assert builds(graphs[0]) == builds(graphs[1]) > 0, [builds(g) for g in graphs]  # three layers, one build


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_a_block_mask_built_outside_the_graph(case: str) -> None:
    """The other pattern: a BlockMask built eagerly and passed into the compiled call."""
    spec = CASES[case]()["mask"]
    q, k, v = _inputs(False)
    bm = fz.block_mask(spec, L, L, batch=B, heads=H, device=DEV)
    call = lambda a, b, c: fz.attention(a, b, c, mask=bm)  # noqa: E731
    assert torch._dynamo.explain(call)(q, k, v).graph_break_count == 0
    torch._dynamo.reset()
    assert_matches_reference(torch.compile(call, fullgraph=True)(q, k, v), q, k, v, mask=spec)


#: Routes compiled with dynamic shapes: auto and the kernels it picks among on CUDA.
DYNAMIC_ROUTES = ["auto", "flex", "sdpa_cudnn", "sdpa_flash"]


@pytest.mark.parametrize("route", DYNAMIC_ROUTES)
@pytest.mark.parametrize("case", sorted(set(CASES) - DATA_CASES))
def test_dynamic_shapes_one_graph_for_every_length(case: str, route: str) -> None:
    """``torch.compile(dynamic=True, fullgraph=True)``: three (batch, length) pairs, each against
    float64, compiled at most twice (a length that changes a route decision is a guard)."""
    counter = CompileCounterWithBackend("inductor")
    kw = CASES[case]()

    def call(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return fz.attention(a, b, c, backend=route, **kw)

    step = torch.compile(call, backend=counter, dynamic=True, fullgraph=True)
    for batch, length in ((2, 384), (3, 512), (2, 640)):
        g = torch.Generator(device=DEV).manual_seed(length)
        q, k, v = (
            torch.randn(batch, H, length, D, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(3)
        )
        try:
            fz.plan(q, k, v, backend=route, **kw)
        except ValueError as err:
            pytest.skip(f"{route} refuses {case}: {err}")
        try:
            out = step(q, k, v)
        except ValueError as err:
            if TRACED_ONLY not in str(err):
                raise
            pytest.skip(f"{route} refuses {case} while traced: {err}")
        assert_matches_reference(out, q, k, v, **kw)
    assert counter.frame_count <= 2, counter.frame_count


@pytest.mark.parametrize("case", ["causal", "sliding_causal", "document_causal"])
def test_reduce_overhead_replays(case: str) -> None:
    """CUDA graphs through torch.compile: three replays give the eager result (a document mask's
    BlockMask is built inside the captured graph)."""
    kw = CASES[case]()
    q, k, v = _inputs(False)
    step = torch.compile(lambda a, b, c: fz.attention(a, b, c, **kw), mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(3):
            out = step(q, k, v).clone()
        assert_matches_reference(out, q, k, v, **kw)


class _Block(torch.nn.Module):
    def __init__(self, **kw: Any) -> None:
        super().__init__()
        self.kw = kw

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return fz.attention(q, k, v, **self.kw)


@pytest.mark.parametrize("case", ["causal", "sliding_causal", "document_causal"])
@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
def test_export(case: str, strict: bool) -> None:
    kw = CASES[case]()
    q, k, v = _inputs(False)
    exported = torch.export.export(_Block(**kw), (q, k, v), strict=strict)
    out = exported.module()(q, k, v)
    assert_matches_reference(out, q, k, v, **kw)


#: A marker of each route family's kernel call in an exported graph's code.
EXPORTED_OP = {"sdpa": "scaled_dot_product", "flex": "flex_attention", "fa4": "fa4_fwd"}


@pytest.mark.parametrize("route", [r for r in CUDA_ROUTES if r != "auto"])
@pytest.mark.parametrize("case", ["causal", "sliding_causal", "document_causal"])
def test_export_per_named_route(case: str, route: str) -> None:
    """``torch.export`` (non-strict) with each named route that runs the call eagerly: the route's
    kernel call is in the exported graph, or the export is refused by a ``ValueError`` naming
    the route and why it cannot run inside a graph."""
    kw = CASES[case]()
    q, k, v = _inputs(False)
    try:
        fz.plan(q, k, v, backend=route, **kw)
    except ValueError as err:
        pytest.skip(f"{route} refuses {case} eagerly: {err}")
    try:
        exported = torch.export.export(_Block(backend=route, **kw), (q, k, v), strict=False)
    except ValueError as err:
        assert f"backend {route!r} cannot run this call" in str(err) and TRACED_ONLY in str(err), err
        return
    op = next((marker for family, marker in EXPORTED_OP.items() if route.startswith(family)), None)
    if op is not None:
        assert op in exported.graph_module.code, exported.graph_module.code


FA4_CASES: dict[str, Any] = {
    "causal": lambda: {"mask": masks.Causal()},
    "sliding_causal": lambda: {"mask": masks.SlidingWindow(left=64) & masks.Causal()},
    "sliding_two_sided": lambda: {"mask": masks.SlidingWindow(left=50, right=7)},
    # cap 5 with these inputs bends the scores enough that a backward ignoring it would fail
    "softcap_approx_causal": lambda: {
        "mask": masks.Causal(),
        "score_mod": score_mods.SoftCap(cap=5.0, approx=True),
    },
    "chunked_causal": lambda: {"mask": masks.Chunked(size=128) & masks.Causal()},
    # each residue class mod 2 as heads of its own (a strided layout)
    "dilated_two_sided": lambda: {"mask": masks.DilatedSlidingWindow(left=90, right=20, dilation=2)},
    "full": lambda: {},
}
needs_fa4 = pytest.mark.skipif(not _compat.flash_cute_available(), reason="needs flash-attn-4")


def _assert_grads(
    grads: tuple[torch.Tensor, ...],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_out: torch.Tensor,
    g_lse: torch.Tensor,
    **kw: Any,
) -> None:
    """Gradients of ``sum(out * g_out) + sum(lse * g_lse)`` against float64, allowed 3x the error
    of the same math done eagerly in q's dtype (plus a small floor)."""

    def grads_of(dtype: torch.dtype | None) -> tuple[torch.Tensor, ...]:
        ins = [t.detach().to(dtype or t.dtype).requires_grad_(True) for t in (q, k, v)]
        run = reference_attention if dtype == torch.float64 else eager_attention
        out, lse = run(*ins, return_lse=True, **kw)
        loss = (out.double() * g_out.double()).sum() + (lse.double() * g_lse.double()).sum()
        return torch.autograd.grad(loss, ins)

    for name, got, ref, eager in zip("qkv", grads, grads_of(torch.float64), grads_of(None), strict=True):
        err = float((got.double() - ref).abs().max())
        budget = 3 * float((eager.double() - ref).abs().max()) + 1e-3 * float(ref.abs().max())
        assert err <= budget, f"d{name}: max error {err:.3e} > budget {budget:.3e}"


@needs_fa4
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("case", list(FA4_CASES))
def test_fa4_op_fullgraph_fwd_bwd_through_lse(case: str, gqa: bool) -> None:
    kw = FA4_CASES[case]()
    g = torch.Generator(device=DEV).manual_seed(4)
    hkv = 2 if gqa else H
    q = torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    k, v = (
        torch.randn(B, hkv, L, D, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_(True)
        for _ in range(2)
    )

    def call(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fz.attention(a, b, c, backend="fa4", enable_gqa=gqa, return_lse=True, **kw)

    explained = torch._dynamo.explain(call)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    graph = "\n".join(str(gm.graph) for gm in explained.graphs)
    assert "flexattn_zoo.fa4_fwd" in graph, graph
    torch._dynamo.reset()
    out, lse = torch.compile(call, fullgraph=True)(q, k, v)
    assert_matches_reference(out, q, k, v, enable_gqa=gqa, lse=lse, **kw)
    g_out, g_lse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out * g_out).sum() + (lse * g_lse).sum(), (q, k, v))
    _assert_grads(grads, q, k, v, g_out, g_lse, enable_gqa=gqa, **kw)
    # the same call eagerly: the op's eager path (out-only gradients, no lse-gradient call)
    out_e = fz.attention(q, k, v, backend="fa4", enable_gqa=gqa, **kw)
    assert_matches_reference(
        out_e,
        q,
        k,
        v,
        enable_gqa=gqa,
        grads=torch.autograd.grad(out_e, (q, k, v), g_out),
        grad_out=g_out,
        **kw,
    )


@needs_fa4
@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
def test_fa4_export(strict: bool) -> None:
    kw = {"mask": masks.SlidingWindow(left=64) & masks.Causal(), "backend": "fa4"}
    q, k, v = _inputs(False)
    exported = torch.export.export(_Block(**kw), (q, k, v), strict=strict)
    assert "flexattn_zoo.fa4_fwd" in str(exported.graph)
    out = exported.module()(q, k, v)
    assert_matches_reference(out, q, k, v, mask=kw["mask"])


@needs_fa4
def test_fa4_reduce_overhead_replays() -> None:
    """CUDA graphs around the fa4 op: three replays give the eager result."""
    step = torch.compile(
        lambda a, b, c: fz.attention(a, b, c, mask="causal", backend="fa4"),
        mode="reduce-overhead",
        fullgraph=True,
    )
    q, k, v = _inputs(False)
    with torch.no_grad():
        for _ in range(3):
            out = step(q, k, v).clone()
    assert_matches_reference(out, q, k, v, mask="causal")


@pytest.mark.parametrize("case", ["causal", "sliding_causal", "document_causal", "alibi_causal"])
def test_eager_call_replays_in_a_cuda_graph(case: str) -> None:
    """Eager ``fz.attention`` captured by ``torch.cuda.graph`` after a warm-up (which plans,
    builds the BlockMask and compiles): the captured call makes no sync and no allocation that
    breaks replay, and replays follow new values written into the static inputs."""
    kw = CASES[case]()
    q, k, v = _inputs(False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        for _ in range(3):
            fz.attention(q, k, v, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = fz.attention(q, k, v, **kw)
    for seed in (1, 2):
        g = torch.Generator(device=DEV).manual_seed(seed)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, device=DEV, dtype=t.dtype, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(out, q, k, v, **kw)


@pytest.mark.parametrize("window", [None, 64], ids=["causal", "sliding"])
def test_decode_steps_over_a_static_cache_share_one_graph(window: int | None) -> None:
    """A compiled decode step over a static cache (Lq=1, Lkv=cache size, the position as an int
    argument, as transformers passes it): every step against float64, one graph for all positions
    after the first change (the offset is a tensor made in the graph, not a guard)."""
    from flexattn_zoo.masks.band import Band
    from flexattn_zoo.masks.causal import OffsetCausal

    def mask_at(pos: int) -> Any:
        return OffsetCausal(offset=pos) if window is None else Band(lo=pos - window, hi=pos)

    counter = CompileCounterWithBackend("inductor")
    step = torch.compile(
        lambda q, k, v, pos: fz.attention(q, k, v, mask=mask_at(pos)), backend=counter, fullgraph=True
    )
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(B, H, 1, D, device=DEV, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, H, 1024, D, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(2))
    with torch.no_grad():
        for pos in (100, 101, 102, 300, 301, 700):
            out = step(q, k, v, pos)
            assert_matches_reference(out, q, k, v, mask=mask_at(pos))
    assert counter.frame_count <= 2, counter.frame_count


def test_hf_generate_with_a_static_cache_compiles_a_bounded_number_of_graphs() -> None:
    """transformers' compiled decoding (static cache, ``model.forward`` under torch.compile with
    fullgraph): the tokens of eager SDPA with the same weights, with the prefill and decode graphs
    compiled a bounded number of times for 12 tokens (not once per token)."""
    transformers = pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    import flexattn_zoo.hf as zhf
    from flexattn_zoo.hf.mask_reader import structural_reader_enabled

    if not structural_reader_enabled():
        # Another release runs transformers' own mask function, whose tensors keep the mask out
        # of a CUDA graph (a graph break, which fullgraph=True refuses).
        pytest.skip(f"transformers {transformers.__version__} is not a release the mask reader knows")

    name = zhf.register()
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = model.to(DEV, torch.bfloat16).eval()
    ids = torch.randint(1, 256, (2, 40), device=DEV, generator=torch.Generator(device=DEV).manual_seed(1))
    kw = dict(
        input_ids=ids, max_new_tokens=12, do_sample=False, cache_implementation="static", pad_token_id=0
    )
    with torch.no_grad():
        expected = model.generate(**kw)
        model.set_attn_implementation(name)
        model.forward = torch.compile(model.forward, fullgraph=True)
        graphs = counters["stats"]["unique_graphs"]
        got = model.generate(**kw)
    assert counters["stats"]["unique_graphs"] - graphs <= 3
    # bf16 logits of two exact routes can differ by rounding; greedy tokens of a random model
    # rarely flip on that, and a wrong mask changes them wholesale.
    assert (got == expected).float().mean() >= 0.9, (got, expected)


@pytest.mark.parametrize("route", ["sdpa_flash", "sdpa_efficient"])
def test_deterministic_training_step_compiles_under_torchs_deterministic_mode(route: str) -> None:
    """Under ``torch.use_deterministic_algorithms(True)`` the routes whose eager backward is
    replayed under that mode (varlen too, which never runs in a graph) trace whole (no replay in the graph): one graph, exact, and two
    backward passes bitwise equal; with ``deterministic=True`` but the mode off they refuse while
    traced, naming the mode."""
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(3))
    kw: dict[str, Any] = {"mask": masks.Causal()}
    mode = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    try:
        torch.use_deterministic_algorithms(True)
        counter = CompileCounterWithBackend("inductor")
        step = torch.compile(
            lambda a, b, c: fz.attention(a, b, c, backend=route, **kw), backend=counter, fullgraph=True
        )
        grads = []
        for _ in range(2):
            qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
            out = step(qq, kk, vv)
            grad_out = torch.ones_like(out)
            grads.append(torch.autograd.grad(out, (qq, kk, vv), grad_out))
            assert_matches_reference(out, qq, kk, vv, **kw, grads=grads[-1], grad_out=grad_out)
        assert counter.frame_count == 1
        for a, b in zip(*grads, strict=True):
            assert torch.equal(a, b)
        torch.use_deterministic_algorithms(False)
        refused = torch.compile(
            lambda a, b, c: fz.attention(a, b, c, backend=route, deterministic=True, **kw), fullgraph=True
        )
        with pytest.raises(Exception, match="use_deterministic_algorithms"):
            refused(*(t.detach().requires_grad_(True) for t in (q, k, v)))
    finally:
        torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])
