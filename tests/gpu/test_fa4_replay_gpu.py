"""The fa4 route's replayed launches (``backends.fa4_replay``) with the real FA4 kernels.

Each layout the route uses (rows, a batch of chunks, packed documents), with GQA, soft-capping,
the lse and gradients: every call of a kind after its recording is a replay, and a replay gives
what FA4's own launcher gives on the same inputs (the forward bit for bit; the backward, whose
dq accumulates with atomics, within its run-to-run noise), and the float64 reference's answer.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import _compat, masks, score_mods
from flexattn_zoo.backends import fa4_replay
from flexattn_zoo.testing import assert_matches_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _compat.flash_cute_available(), reason="needs flash-attn-4 (flash_attn.cute)"),
]

DEV = "cuda"

CASES: dict[str, tuple[Any, Any, int, int, int]] = {  # mask, score, Hkv, L, D
    "causal": ("causal", None, 4, 333, 64),
    "window_gqa": (masks.SlidingWindow(left=50, right=3), None, 2, 512, 128),
    "softcap_gqa": ("causal", score_mods.SoftCap(cap=30.0, approx=True), 1, 300, 128),
    "chunks": (masks.Chunked(size=128) & masks.Causal(), None, 4, 512, 64),
    "documents": (
        masks.Document.from_lengths([[100, 150, 83], [20, 313]]) & masks.Causal(),
        None,
        2,
        333,
        128,
    ),
}


def _call(case: str, seed: int) -> tuple[Any, ...]:
    mask, score, hkv, length, d = CASES[case]
    g = torch.Generator(device=DEV).manual_seed(seed)

    def rand(heads: int) -> torch.Tensor:
        t = torch.randn(2, heads, length, d, device=DEV, dtype=torch.bfloat16, generator=g)
        return t.requires_grad_(True)

    q, k, v = rand(4), rand(hkv), rand(hkv)
    kw = dict(mask=mask, score_mod=score, enable_gqa=hkv != 4)
    out, lse = fz.attention(q, k, v, backend="fa4", return_lse=True, **kw)
    grad_out = torch.randn(out.shape, device=DEV, dtype=out.dtype, generator=g)
    grad_lse = torch.randn(lse.shape, device=DEV, dtype=lse.dtype, generator=g)
    grads = torch.autograd.grad((out, lse), (q, k, v), (grad_out, grad_lse))
    return (q, k, v, kw, out, lse, grads, (grad_out, grad_lse))


def _kinds() -> dict[str, int]:
    counts = {"programs": 0, "refused": 0}  # kinds met once (not yet recorded) are neither
    for entry in fa4_replay.PROGRAMS.values():
        if isinstance(entry, fa4_replay.Program):
            counts["programs"] += 1
        elif isinstance(entry, fa4_replay.Refused):
            counts["refused"] += 1
    return counts


@pytest.mark.parametrize("case", list(CASES))
def test_replays_equal_fa4s_own_launcher(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fa4_replay.PROGRAMS.clear()
    for seed in range(3):  # notes the kind (and compiles), records, then replays
        _call(case, seed)
    kinds = _kinds()
    refusals = [e.reason for e in fa4_replay.PROGRAMS.values() if isinstance(e, fa4_replay.Refused)]
    assert kinds["refused"] == 0, refusals
    assert kinds["programs"] >= 2, kinds  # the forward and the backward (and the lse's backward)

    q, k, v, kw, out, lse, grads, cotangents = _call(case, 7)  # replayed
    inserts = fa4_replay.PROGRAMS.inserts
    monkeypatch.setenv("FLEXATTN_ZOO_FA4_REPLAY", "0")
    own = fz.attention(q, k, v, backend="fa4", return_lse=True, **kw)
    own_grads = torch.autograd.grad(own, (q, k, v), cotangents)
    assert fa4_replay.PROGRAMS.inserts == inserts  # FA4's own launcher ran
    assert torch.equal(out, own[0]) and torch.equal(lse, own[1])
    for mine, theirs in zip(grads, own_grads, strict=True):
        assert mine.stride() == theirs.stride()
        torch.testing.assert_close(mine, theirs, rtol=1e-2, atol=1e-2)
    assert_matches_reference(out, q, k, v, lse=lse, **kw)


@pytest.mark.parametrize("case", ["causal", "documents"])
def test_replayed_gradients_match_the_reference(case: str) -> None:
    fa4_replay.PROGRAMS.clear()
    for seed in range(2):
        _call(case, seed)
    g = torch.Generator(device=DEV).manual_seed(11)
    mask, score, hkv, length, d = CASES[case]
    q, k, v = (
        torch.randn(2, h, length, d, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_(True)
        for h in (4, hkv, hkv)
    )
    out = fz.attention(q, k, v, mask=mask, score_mod=score, enable_gqa=hkv != 4, backend="fa4")
    grad_out = torch.randn(out.shape, device=DEV, dtype=out.dtype, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert _kinds()["programs"] >= 2
    assert_matches_reference(
        out, q, k, v, mask=mask, score_mod=score, enable_gqa=hkv != 4, grads=grads, grad_out=grad_out
    )


def test_replays_inside_an_eager_cuda_graph_capture() -> None:
    """Recorded before the capture, replayed in it: the graph's replays follow new inputs."""
    fa4_replay.PROGRAMS.clear()
    g = torch.Generator(device=DEV).manual_seed(3)
    q, k, v = (torch.randn(2, 4, 256, 64, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(3))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fz.attention(q, k, v, mask="causal", backend="fa4")
    torch.cuda.current_stream().wait_stream(stream)
    assert _kinds()["programs"] == 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fz.attention(q, k, v, mask="causal", backend="fa4")
    for _ in range(3):
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, device=DEV, dtype=t.dtype, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, fz.attention(q, k, v, mask="causal", backend="fa4"))


def _documents(lengths: list[int]) -> Any:
    return masks.Document.from_lengths([lengths]) & masks.Causal()


@pytest.mark.parametrize(
    "first",
    [
        [100, 150, 83],
        # more documents than FA4's batch-lookup threshold (256): its varlen scheduling metadata
        # is computed from cu_seqlens on the device, by compiled kernels the program re-runs
        [8 + (i * 7) % 17 for i in range(300)],
    ],
    ids=["three", "three_hundred"],
)
def test_a_replay_follows_new_document_boundaries(first: list[int]) -> None:
    """The key holds the number of documents and the longest one, not where they start: a replay
    recorded on one packing must be exact on another of the same kind (the same lengths, rotated)."""
    second = first[1:] + first[:1]
    length = sum(first)
    fa4_replay.PROGRAMS.clear()
    g = torch.Generator(device=DEV).manual_seed(5)

    def rand(heads: int) -> torch.Tensor:
        t = torch.randn(1, heads, length, 64, device=DEV, dtype=torch.bfloat16, generator=g)
        return t.requires_grad_(True)

    def call(lengths: list[int]) -> tuple[Any, ...]:
        q, k, v = rand(4), rand(2), rand(2)
        mask = _documents(lengths)
        out, lse = fz.attention(q, k, v, mask=mask, enable_gqa=True, backend="fa4", return_lse=True)
        # a cotangent laid out as every call's (its strides are part of the backward's kind)
        grad_out = torch.randn(out.shape, device=DEV, dtype=out.dtype, generator=g)
        return q, k, v, mask, out, lse, grad_out, torch.autograd.grad(out, (q, k, v), grad_out)

    for _ in range(2):  # notes the kind, then records it, on the first packing
        call(first)
    assert _kinds()["programs"] >= 2, _kinds()
    inserts = fa4_replay.PROGRAMS.inserts
    q, k, v, mask, out, lse, grad_out, grads = call(second)
    assert fa4_replay.PROGRAMS.inserts == inserts, list(fa4_replay.PROGRAMS.values())  # replays
    assert_matches_reference(
        out, q, k, v, mask=mask, enable_gqa=True, lse=lse, grads=grads, grad_out=grad_out
    )


def test_compiled_graphs_replay_the_fa4_ops() -> None:
    """Inside a compiled model the fa4 ops run their implementations at run time: the forward
    and the backward of a torch.compile'd block are replayed from the third step on."""
    fa4_replay.PROGRAMS.clear()
    g = torch.Generator(device=DEV).manual_seed(9)
    mask = masks.SlidingWindow(left=64) & masks.Causal()

    @torch.compile(fullgraph=True)
    def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return fz.attention(q, k, v, mask=mask, backend="fa4").sum(dim=1)

    def step() -> tuple[torch.Tensor, ...]:
        q, k, v = (
            torch.randn(2, 4, 256, 64, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_(True)
            for _ in range(3)
        )
        out = block(q, k, v)
        return (q, k, v, out, *torch.autograd.grad(out.float().square().sum(), (q, k, v)))

    for _ in range(2):
        step()
    kinds = _kinds()
    assert kinds["programs"] >= 2 and kinds["refused"] == 0, kinds  # forward, backward(s)
    inserts = fa4_replay.PROGRAMS.inserts
    q, k, v, out, *grads = step()
    assert fa4_replay.PROGRAMS.inserts == inserts  # replayed
    full = fz.attention(q, k, v, mask=mask, backend="fa4")
    torch.testing.assert_close(out, full.sum(dim=1))  # the sum compiled or not: bf16 tolerance
