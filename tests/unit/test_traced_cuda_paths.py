"""What the H200 found in compiled models, checked where it can be on the CPU: pieces of the
traced CUDA path that Dynamo must trace without a break, and the choices they make."""

from __future__ import annotations

import builtins
import dataclasses
from typing import Any

import pytest
import torch

from flexattn_zoo import blockmask, masks, score_mods
from flexattn_zoo.backends import BY_NAME
from flexattn_zoo.functions import FunctionMask
from flexattn_zoo.packed.specs import PackedSequences
from flexattn_zoo.problem import Problem
from flexattn_zoo.testing import assert_matches_reference


def _problem(mask: Any, score: Any = None, head_dim: int = 128) -> Problem:
    return Problem(
        batch=2,
        heads=16,
        kv_heads=16,
        q_len=1024,
        kv_len=1024,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        device_type="cuda",
        arch="sm90",
        requires_grad=False,
        mask=mask,
        score=score,
        return_lse=False,
    )


def test_measured_flex_tiles_only_for_the_zoos_own_mods() -> None:
    """Pinned sm90 tiles overflowed shared memory with transformers' packed-sequence mask_mod
    (one Triton config, no fallback): a user's callable keeps torch's autotuned defaults."""
    flex = BY_NAME["flex"]
    ids = torch.zeros(1024, dtype=torch.int64)
    assert "fwd_num_stages" in (flex.options(_problem(masks.Causal())) or {})
    raw = FunctionMask(fn=lambda b, h, q, kv, ids=ids: ids[q] == ids[kv])
    assert "fwd_num_stages" not in (flex.options(_problem(raw)) or {})
    assert "fwd_num_stages" not in (flex.options(_problem(raw & masks.Causal())) or {})


def test_specs_say_whether_they_load_a_tensor_per_query_key_pair() -> None:
    ids = torch.tensor([0, 0, 1, 1])
    table = torch.zeros(4, 4, dtype=torch.bool)
    pairs = [
        masks.Dense(mask=table),
        score_mods.Bias(bias=torch.zeros(4, 4)),
        score_mods.RelPosBias.examples(4, 4, 1, 2)[0],
        score_mods.Sandwich(num_heads=2, max_len=8),
        FunctionMask(fn=lambda b, h, q, kv: table[q, kv]),
        masks.Document(doc_ids=ids) & masks.Dense(mask=table),
        FunctionMask(fn=lambda b, h, q, kv: q >= kv),  # what a callable reads is not looked into
        # A per-document inner mask reads its per-key flags at kv - start[q]: per pair.
        masks.PerDocument(
            inner=masks.GlobalWindow(is_global=torch.tensor([1, 0, 0, 0], dtype=torch.bool), left=1),
            documents=masks.Document(doc_ids=ids),
        ),
    ]
    rows = [
        masks.Causal(),
        masks.Document(doc_ids=ids),
        masks.Document(doc_ids=ids) & masks.Causal(),
        masks.PrefixLM(prefix_len=torch.tensor([2])),
        score_mods.SoftCap(cap=30.0),
        masks.PerDocument(inner=masks.PrefixLM(prefix_len=1), documents=masks.Document(doc_ids=ids)),
        PackedSequences(
            cu_seqlens_q=torch.tensor([0, 2, 4]),
            cu_seqlens_k=torch.tensor([0, 2, 4]),
            q_total=4,
            kv_total=4,
            max_seqlen_q=2,
            max_seqlen_k=2,
            inner=masks.Causal(),
        ),  # fmt: skip
    ]
    assert [s.loads_pairs() for s in pairs] == [True] * len(pairs)
    assert [s.loads_pairs() for s in rows] == [False] * len(rows)


def test_pair_loading_mods_get_flex_tiles_that_fit_sm90() -> None:
    """A table[kv - q] or bias[h, q, kv] score mod at D=64 failed to compile on the H200 with
    torch's default forward tiles ("out of resource: Required 245760, Hardware limit 232448"),
    and compiled with 2 pipeline stages (benchmarks/results/gathered_tile_probe_h200.txt)."""
    flex, flash = BY_NAME["flex"], BY_NAME["flex_flash"]
    bias = score_mods.Bias(bias=torch.zeros(1024, 1024))
    causal = masks.Causal()
    assert (flex.options(_problem(causal, bias, head_dim=64)) or {}).get("fwd_num_stages") == 2
    assert (
        flex.options(_problem(masks.Dense(mask=torch.ones(1024, 1024, dtype=torch.bool)), head_dim=64)) or {}
    ).get("fwd_num_stages") == 2
    # At D=128 torch's defaults fit: neither the measured tiles nor fewer stages.
    assert "fwd_num_stages" not in (flex.options(_problem(causal, bias)) or {})
    # Mods without pair loads keep what they had; FlashAttention-4's kernel takes no Triton tiles;
    # the caller's options win.
    assert "fwd_num_stages" not in (flex.options(_problem(causal, head_dim=64)) or {})
    assert "fwd_num_stages" not in (flash.options(_problem(causal, bias, head_dim=64)) or {})
    own = dataclasses.replace(_problem(causal, bias, head_dim=64), kernel_options=(("fwd_num_stages", 1),))
    assert (flex.options(own) or {})["fwd_num_stages"] == 1


def test_the_traced_builder_orders_blocks_in_one_opaque_op() -> None:
    """Compiled into one graph with the flex kernel that reads them, the block ranking's cumsum
    and scatter gave wrong rows on CUDA for batch rows after the first (torch 2.11, H200): traced,
    the builder runs them as the ``flexattn_zoo::block_order`` op, which the graph holds as one
    node, with the eager result (int32 counts and indices)."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    m = torch.rand(2, 1, 8, 8) > 0.5
    eager = blockmask._ordered(m)
    traced = torch.compile(blockmask._ordered, backend=backend, fullgraph=True, dynamic=True)(m)
    assert all(torch.equal(a, b) for a, b in zip(eager, traced, strict=True))
    assert eager[1].dtype == traced[1].dtype == torch.int32
    code = "\n".join(gm.code for gm in graphs)
    assert "flexattn_zoo.block_order" in code and "scatter" not in code and "cumsum" not in code
    # The op's fake implementation gives the shapes, dtypes and layout the real one returns, also
    # from 2**15 columns on (where the eager counts are int32 views of the running count).
    torch.library.opcheck(blockmask.block_order, (m,))
    torch.library.opcheck(blockmask.block_order, (torch.rand(1, 1, 3, 2**15) > 0.5,))
    # The same for the copy of a spec's tensors the traced CPU flex route makes.
    from flexattn_zoo.backends.flex import materialize

    torch.library.opcheck(materialize, (torch.rand(2, 5) > 0.5,))


def test_transformers_is_not_imported_again_inside_a_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo on torch 2.11 cannot trace ``import transformers`` ("Bad import result"): after the
    first eager call, the HF mask reader reads the module it kept."""
    pytest.importorskip("transformers")
    from flexattn_zoo.hf import mask_reader

    first = mask_reader.masking_utils()
    real_import = builtins.__import__

    def no_transformers(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("transformers"):
            raise AssertionError(f"imported {name} again")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    assert mask_reader.masking_utils() is first
    assert mask_reader.transformers_module().masking_utils is first


def test_a_data_dependent_cache_offset_traces_without_a_guard() -> None:
    """transformers' compiled static-cache decoding hands the mask reader a cache position read
    from a tensor (an unbacked size): choosing the spec, clamping its offsets and asking its forms
    must not guard on the value (Dynamo: "Could not guard on data-dependent expression")."""
    from flexattn_zoo.hf.mask_reader import band_spec
    from flexattn_zoo.masks.band import Band
    from flexattn_zoo.masks.causal import OffsetCausal

    torch.compiler.reset()

    seen: list[object] = []  # what the traced code decided (asserted outside the graph)

    def step(position: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        offset = (position + 0).item()  # computed in the graph: unbacked, as transformers' is
        causal = band_spec(None, 0, offset=offset)  # causal at the cache position
        window = band_spec(-3, 0, offset=offset)  # a 4-key window there
        seen.append(type(causal))
        seen.append(type(window))
        # No form is known to apply to an unknown offset; "known" only, False is the safe answer.
        seen.append(causal.sdpa_form(1, 8))
        seen.append(causal.varlen_form(1, 8, 1))
        seen.append(window.sdpa_form(1, 8))
        seen.append(window.varlen_form(1, 8, 1))
        seen.append(causal.hides_future_keys(1, 8))
        return x + torch.full((), causal.offset) * 100 + torch.full((), window.lo)

    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compiled = torch._dynamo.config.patch(capture_scalar_outputs=True)(
        torch.compile(step, fullgraph=True, backend=counter)
    )
    x = torch.zeros(())

    def run(position: int) -> float:
        seen.clear()  # Dynamo guards on the list's length
        return compiled(torch.tensor(position), x).item()

    assert run(5) == 5 * 100 + 2
    assert seen == [OffsetCausal, Band, None, None, None, None, False]
    assert run(9) == 9 * 100 + 6
    # An offset of 0 under tracing still takes the offset spec (exact for every value).
    assert run(0) == -3
    assert counter.frame_count == 1  # one graph for every position


@pytest.mark.parametrize("window", [None, 4])
def test_an_int_cache_position_makes_offset_masks_in_one_graph(window: int | None) -> None:
    """A compiled decode step given the cache position as a Python int (a dynamic size after the
    second value): building ``OffsetCausal`` / ``Band`` there clamps the offset symbolically
    (torch 2.11's Dynamo refused ``torch.sym_min`` called directly), one graph for every
    position."""
    from torch._dynamo.testing import CompileCounter

    from flexattn_zoo.masks.band import Band
    from flexattn_zoo.masks.causal import OffsetCausal

    torch.compiler.reset()
    counter = CompileCounter()

    def step(x: torch.Tensor, pos: int) -> torch.Tensor:
        spec = OffsetCausal(offset=pos) if window is None else Band(lo=pos - window, hi=pos)
        return x + (spec.offset if window is None else spec.lo)

    compiled = torch.compile(step, fullgraph=True, backend=counter)
    x = torch.zeros(())
    for pos in (5, 9, 30):
        assert compiled(x, pos).item() == (pos if window is None else pos - window)
    assert counter.frame_count <= 2  # the first position as a constant, then one dynamic graph


def test_a_decode_step_form_traced_with_symbolic_lengths_adds_no_guard() -> None:
    """The no-mask SDPA form of a decode step (one query that sees every key) is a shortcut: with
    symbolic lengths it is offered only where the trace already proves it, so a graph compiled
    with dynamic shapes neither specializes on the lengths nor recompiles when they change."""
    from torch._dynamo.testing import CompileCounter

    from flexattn_zoo.masks.band import Band
    from flexattn_zoo.masks.causal import OffsetCausal

    torch.compiler.reset()
    seen: list[object] = []

    def step(k: torch.Tensor, offset: int) -> torch.Tensor:
        kv_len = k.shape[0]
        seen.append(OffsetCausal(offset=offset).sdpa_form(1, kv_len))
        seen.append(Band(lo=None, hi=offset).sdpa_form(1, kv_len))
        return k * 2

    counter = CompileCounter()
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=counter)
    for kv_len, offset in ((8, 7), (9, 3), (12, 11)):
        seen.clear()
        compiled(torch.zeros(kv_len), offset)
        # Independent symbols: nothing proves offset >= kv_len - 1, so no shortcut is offered.
        assert seen == [None, None]
    assert counter.frame_count == 1
    # Eagerly the same plain ints decide it.
    assert OffsetCausal(offset=7).sdpa_form(1, 8) is not None
    assert Band(lo=None, hi=7).sdpa_form(1, 8) is not None
    assert OffsetCausal(offset=3).sdpa_form(1, 9) is None


def test_the_first_compiled_call_on_a_cuda_device_compiles_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-device arch memo is left alone while traced: a first trace that filled it failed
    its own guard on the next call (the H200's first compiled step with Document ids compiled
    twice)."""
    from torch._dynamo.testing import CompileCounter

    from flexattn_zoo import arch

    monkeypatch.delenv(arch.ARCH_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(arch, "_CUDA_ARCH", {})
    counter = CompileCounter()
    step = torch.compile(
        lambda x: x * len(arch.detect_arch(torch.device("cuda", 0))), backend=counter, fullgraph=True
    )
    for _ in range(3):
        assert torch.equal(step(torch.ones(2)), torch.full((2,), 4.0))
    assert counter.frame_count == 1
    assert arch.detect_arch(torch.device("cuda", 0)) == "sm90"  # eagerly, the memo still serves
    assert arch._CUDA_ARCH


def test_a_deterministic_backward_traces_under_torchs_deterministic_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Routes whose backward is replayed under torch's deterministic mode (FlashAttention-2,
    memory-efficient, varlen on CUDA) could not be traced: the replay takes a lock. Traced under
    that mode the compiled backward already runs under it, so there is no replay; traced without
    it, they refuse and say why (eagerly they replay as before)."""
    flash = BY_NAME["sdpa_flash"]
    problem = dataclasses.replace(
        _problem(masks.Causal(), head_dim=32),
        batch=1,
        heads=2,
        kv_heads=2,
        q_len=64,
        kv_len=64,
        dtype=torch.float32,
        requires_grad=True,
        deterministic=True,
    )
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=g, requires_grad=True) for _ in range(3))
    mode = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    try:
        torch.use_deterministic_algorithms(True)
        step = torch.compile(
            lambda a, b, c: flash.execute(a, b, c, problem, scale=32**-0.5)[0],
            backend="aot_eager",
            fullgraph=True,
        )
        out = step(q, k, v)
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        assert_matches_reference(out, q, k, v, mask=masks.Causal(), grads=grads, grad_out=grad_out)
        torch.use_deterministic_algorithms(False)
        assert not any("compiled graph" in r for r in flash.reasons(problem))  # eagerly: replayed
        monkeypatch.setattr("flexattn_zoo._compat.is_compiling", lambda: True)
        assert any("needs torch.use_deterministic_algorithms(True)" in r for r in flash.reasons(problem))
    finally:
        torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])
