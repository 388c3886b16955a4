"""The ``flexattn_zoo::fa4_fwd`` / ``fa4_bwd`` torch ops on the CPU: schemas, fake implementations
(on fake CUDA tensors), the autograd formula (out and lse gradients) and the fa4 route's layouts,
with FA4's kernels replaced by a float64 emulation of their contract (the kernels need a GPU:
tests/gpu). The emulated backward works as FA's does (from ``lse`` and ``rowsum(dout * out)``,
not by autograd), so the lse-gradient call is checked against the reference for real.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from flexattn_zoo import _compat, masks, score_mods
from flexattn_zoo.backends import fa4_op
from flexattn_zoo.backends.fa4 import FA4
from flexattn_zoo.backends.fa4_op import BWD_SCHEMA, FWD_SCHEMA, fa4_attention
from flexattn_zoo.problem import Problem
from flexattn_zoo.reference import reference_attention

# -- an emulation of FA4's kernels (their contract, float64) ----------------------------------


def _segments(q: torch.Tensor, cu: torch.Tensor | None) -> list[tuple[Any, ...]]:
    """``(index, length)`` per segment: a batch row ``(b,)`` or a packed slice."""
    if cu is None:
        return [((b,), q.shape[1]) for b in range(q.shape[0])]
    offsets = cu.tolist()
    return [((slice(s, e),), e - s) for s, e in zip(offsets[:-1], offsets[1:], strict=True)]


def _scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float, wl: int, wr: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One segment: ``(x, s, visible)`` with ``x = scale q.k``, ``s`` capped and masked, ``[H, i, j]``."""
    group = q.shape[1] // k.shape[1]
    x = torch.einsum("ihd,jhd->hij", q, k.repeat_interleave(group, dim=1)) * scale
    s = softcap * torch.tanh(x / softcap) if softcap > 0 else x
    i = torch.arange(q.shape[0])[:, None]
    j = torch.arange(k.shape[0])[None, :]
    visible = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool)
    if wl >= 0:
        visible &= j >= i - wl
    if wr >= 0:
        visible &= j <= i + wr
    return x, s.masked_fill(~visible, float("-inf")), visible


def emulated_forward(q, k, v, cu, max_seqlen, scale, softcap, wl, wr):  # type: ignore[no-untyped-def]
    qd, kd, vd = (t.double() for t in (q, k, v))
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float64)
    lse = torch.zeros((q.shape[1], q.shape[0]) if cu is not None else (q.shape[0], q.shape[2], q.shape[1]))
    lse = lse.double()
    for idx, _ in _segments(q, cu):
        _, s, _ = _scores(qd[idx], kd[idx], scale, softcap, wl, wr)
        group = q.shape[-2] // k.shape[-2]
        out[idx] = torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), vd[idx].repeat_interleave(group, dim=1))
        row_lse = torch.logsumexp(s, -1)  # [H, i]
        if cu is None:
            lse[idx] = row_lse
        else:
            lse[:, idx[0]] = row_lse
    # Strided results on purpose: the op must lay them out as its fake implementation says.
    return out.to(q.dtype).transpose(0, 1).contiguous().transpose(0, 1), lse.float()


def emulated_backward(dout, q, k, v, out, lse, cu, max_seqlen, scale, softcap, wl, wr):  # type: ignore[no-untyped-def]
    qd, kd, vd, od, dod = (t.double() for t in (q, k, v, out, dout))
    group = q.shape[-2] // k.shape[-2]
    dq, dk, dv = torch.zeros_like(qd), torch.zeros_like(kd), torch.zeros_like(vd)
    big_d = (dod * od).sum(-1)  # [..., H]: FA's rowsum(dout * out)
    for idx, _ in _segments(q, cu):
        x, s, visible = _scores(qd[idx], kd[idx], scale, softcap, wl, wr)
        row_lse = lse.double()[idx] if cu is None else lse.double()[:, idx[0]]
        p = torch.exp(s - row_lse[..., None]).masked_fill(~visible, 0.0)  # from the lse, as FA
        ke, ve = kd[idx].repeat_interleave(group, dim=1), vd[idx].repeat_interleave(group, dim=1)
        dp = torch.einsum("ihd,jhd->hij", dod[idx], ve)
        ds = p * (dp - big_d[idx].transpose(0, 1)[..., None])
        if softcap > 0:
            ds = ds * (1 - torch.tanh(x / softcap) ** 2)
        dq[idx] = torch.einsum("hij,jhd->ihd", ds, ke) * scale
        dke = torch.einsum("hij,ihd->jhd", ds, qd[idx]) * scale
        dve = torch.einsum("hij,ihd->jhd", p, dod[idx])
        dk[idx] = dke.unflatten(1, (k.shape[-2], group)).sum(2)
        dv[idx] = dve.unflatten(1, (k.shape[-2], group)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fa4_op, "_fwd_kernel", emulated_forward)
    monkeypatch.setattr(fa4_op, "_bwd_kernel", emulated_backward)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# -- registration and fake implementations -------------------------------------------------


def test_ops_are_registered_with_their_schemas() -> None:
    assert str(torch.ops.flexattn_zoo.fa4_fwd.default._schema) == f"flexattn_zoo::fa4_fwd{FWD_SCHEMA}"
    assert str(torch.ops.flexattn_zoo.fa4_bwd.default._schema) == f"flexattn_zoo::fa4_bwd{BWD_SCHEMA}"
    assert "flash_attn" not in sys.modules  # registering them imported no FA4


def _fake_inputs(packed: bool) -> tuple[torch.Tensor, ...]:
    """FA4-layout views of [B, H, L, D] tensors, as the route passes them (B=2, L=96)."""
    if packed:
        q = torch.empty(2, 8, 96, 64, dtype=torch.bfloat16, device="cuda").transpose(1, 2).reshape(192, 8, 64)
        kv = (
            torch.empty(2, 2, 96, 64, dtype=torch.bfloat16, device="cuda").transpose(1, 2).reshape(192, 2, 64)
        )
        return q, kv, kv.clone(), torch.tensor([0, 40, 96, 192], dtype=torch.int32, device="cuda")
    q = torch.empty(2, 8, 96, 64, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    kv = torch.empty(2, 2, 96, 64, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    return q, kv, kv.clone()


def test_fake_forward_batched() -> None:
    with FakeTensorMode():
        q, k, v = _fake_inputs(packed=False)
        out, lse = fa4_attention(q, k, v, scale=0.125, window=(-1, 0))
        assert (out.shape, out.dtype, out.device.type) == ((2, 96, 8, 64), torch.bfloat16, "cuda")
        assert out.is_contiguous()
        assert (lse.shape, lse.dtype, lse.device.type) == ((2, 8, 96), torch.float32, "cuda")
        assert lse.is_contiguous()


def test_fake_forward_packed() -> None:
    with FakeTensorMode():
        q, k, v, cu = _fake_inputs(packed=True)
        out, lse = fa4_attention(q, k, v, scale=0.125, cu_seqlens=cu, max_seqlen=96)
        assert (out.shape, out.dtype) == ((192, 8, 64), torch.bfloat16) and out.is_contiguous()
        assert (lse.shape, lse.dtype) == ((8, 192), torch.float32) and lse.is_contiguous()


def test_fake_backward_keeps_the_input_layouts() -> None:
    with FakeTensorMode():
        q, k, v = _fake_inputs(packed=False)
        out = torch.empty(2, 96, 8, 64, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(2, 8, 96, device="cuda")
        grads = torch.ops.flexattn_zoo.fa4_bwd(out, q, k, v, out, lse, None, 0, 0.125, 0.0, -1, 0)
        for g, t in zip(grads, (q, k, v), strict=True):
            assert (g.shape, g.dtype, g.device.type, g.stride()) == (t.shape, t.dtype, "cuda", t.stride())
        odd = torch.empty_strided((2, 96, 8, 64), (98304, 1024, 128, 2), dtype=torch.bfloat16, device="cuda")
        dq, _, _ = torch.ops.flexattn_zoo.fa4_bwd(out, odd, k, v, out, lse, None, 0, 0.125, 0.0, -1, 0)
        assert dq.is_contiguous()  # FA4 makes such an input contiguous first


@pytest.mark.parametrize("packed", [False, True])
def test_opcheck_with_the_emulated_kernels(emulated: None, packed: bool) -> None:
    """torch's own consistency checks (schema, fake vs real, autograd registration, AOT dispatch)."""
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 7, 20, 32], dtype=torch.int32) if packed else None
    shape = (32,) if packed else (2, 16)
    q = torch.randn(*shape, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(*shape, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(*shape, 2, 8, generator=g, requires_grad=True)
    args = (q, k, v, cu, 13 if packed else 0, 0.3, 0.0, 3, 0)
    torch.library.opcheck(torch.ops.flexattn_zoo.fa4_fwd.default, args)
    out, lse = torch.ops.flexattn_zoo.fa4_fwd(*args)
    dout = torch.randn_like(out)
    bwd_args = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), *args[3:])
    torch.library.opcheck(torch.ops.flexattn_zoo.fa4_bwd.default, bwd_args)


# -- autograd: out and lse against the float64 reference ---------------------------------------


def _bhld(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


CASES: dict[str, tuple[int, int, float, Any]] = {
    # name: (window_left, window_right, softcap, reference mask)
    "full": (-1, -1, 0.0, None),
    "causal": (-1, 0, 0.0, masks.Causal()),
    "sliding": (5, 2, 0.0, masks.SlidingWindow(left=5, right=2)),
    "softcap_causal": (-1, 0, 2.0, masks.Causal()),
}


@pytest.mark.parametrize("path", ["eager", "op"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("use", ["out", "lse", "both"])
def test_gradients_through_out_and_lse(
    emulated: None, case: str, use: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ways a call runs: plain eager calls (the ``autograd.Function``) and the op (what
    traced calls and calls under a mode take), forward and backward against float64."""
    if path == "op":
        monkeypatch.setattr(fa4_op, "_plain_eager", lambda *tensors: False)
    wl, wr, cap, mask = CASES[case]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 24, 4, 16, generator=g, dtype=torch.float64, requires_grad=True)  # FA4 layout
    k = torch.randn(2, 24, 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 24, 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
    out, lse = fa4_attention(q, k, v, scale=0.4, softcap=cap, window=(wl, wr))
    score = score_mods.SoftCap(cap=cap) if cap else None
    ref_out, ref_lse = reference_attention(
        _bhld(q), _bhld(k), _bhld(v), mask=mask, score_mod=score, scale=0.4, enable_gqa=True, return_lse=True
    )
    torch.testing.assert_close(_bhld(out), ref_out)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)  # lse is float32
    go, gl = torch.randn_like(ref_out), torch.randn(lse.shape, generator=g, dtype=torch.float64)

    def loss(o: torch.Tensor, lse_: torch.Tensor) -> torch.Tensor:
        parts = {"out": [(o * go).sum()], "lse": [(lse_ * gl).sum()]}
        parts["both"] = parts["out"] + parts["lse"]
        return torch.stack(parts[use]).sum()

    got = torch.autograd.grad(loss(_bhld(out), lse.double()), (q, k, v), allow_unused=True)
    want = torch.autograd.grad(loss(ref_out, ref_lse), (q, k, v), allow_unused=True)
    for a, b in zip(got, want, strict=True):
        if b is None:  # the lse does not depend on v
            assert a is None or not a.any()
            continue
        assert a is not None
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_unused_lse_costs_no_second_backward(emulated: None, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def counted(*args: Any) -> Any:
        calls.append(1)
        return emulated_backward(*args)

    monkeypatch.setattr(fa4_op, "_bwd_kernel", counted)
    q = torch.randn(1, 8, 2, 16, requires_grad=True)
    out, _ = fa4_attention(q, q, q, scale=0.25, window=(-1, 0))
    out.sum().backward()
    assert len(calls) == 1


class _RecordedPacket:
    """Stands in for an op's ``torch.ops`` packet: records its calls and passes every attribute
    (``.default``, the schema) through to the real one, which torch itself looks up by name
    while dispatching (a dispatch mode resolves ``torch.ops.flexattn_zoo.fa4_fwd.default``)."""

    def __init__(self, name: str, real: Any, calls: list[str]) -> None:
        self._name, self._real, self._calls = name, real, calls

    def __call__(self, *args: Any) -> Any:
        self._calls.append(self._name)
        return self._real(*args)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._real, attr)


@contextlib.contextmanager
def _recorded_ops() -> Iterator[list[str]]:
    """Record calls of ``torch.ops.flexattn_zoo.fa4_fwd`` / ``fa4_bwd`` (still run)."""
    calls: list[str] = []
    real = {name: getattr(torch.ops.flexattn_zoo, name) for name in ("fa4_fwd", "fa4_bwd")}
    try:
        for name, op in real.items():
            setattr(torch.ops.flexattn_zoo, name, _RecordedPacket(name, op, calls))
        yield calls
    finally:
        for name, op in real.items():
            setattr(torch.ops.flexattn_zoo, name, op)


def _step(q: torch.Tensor) -> None:
    out, _ = fa4_attention(q, q, q, scale=0.25, window=(-1, 0))
    out.sum().backward()


def test_plain_eager_calls_skip_the_op(emulated: None) -> None:
    """A plain eager call, forward and backward, runs the kernels without dispatching the ops."""
    q = torch.randn(1, 8, 2, 16, requires_grad=True)
    with _recorded_ops() as calls:
        _step(q)
    assert calls == [] and q.grad is not None


def test_calls_without_gradients_skip_the_autograd_function(
    emulated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inference (no input requires grad, or ``torch.no_grad()``) runs the kernel alone: an
    ``autograd.Function`` costs host time per call that nothing would use."""
    q = torch.randn(1, 8, 2, 16, requires_grad=True)
    want, want_lse = fa4_attention(q, q, q, scale=0.25, window=(-1, 0))

    def refuse(*args: Any) -> Any:
        raise AssertionError("autograd.Function used without gradients")

    monkeypatch.setattr(fa4_op._EagerFA4, "apply", refuse)
    for inputs, context in ((q.detach(), contextlib.nullcontext()), (q, torch.no_grad())):
        with _recorded_ops() as calls, context:
            out, lse = fa4_attention(inputs, inputs, inputs, scale=0.25, window=(-1, 0))
        assert calls == [] and not out.requires_grad
        torch.testing.assert_close(out, want.detach())
        torch.testing.assert_close(lse, want_lse.detach())


@pytest.mark.parametrize("where", ["dispatch_mode", "function_mode", "parameter"])
def test_modes_and_subclasses_take_the_ops(emulated: None, where: str) -> None:
    """Under a TorchDispatchMode (FLOP counters, FakeTensor tracing) or a TorchFunctionMode
    (``with torch.device(...)``), and for tensor subclasses (``nn.Parameter``), both ops run."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    q = torch.randn(1, 8, 2, 16, requires_grad=True)
    if where == "parameter":
        q = torch.nn.Parameter(q.detach())
    context = {"dispatch_mode": Passthrough(), "function_mode": torch.device("cpu")}.get(where)
    with _recorded_ops() as calls, context or contextlib.nullcontext():
        _step(q)
    assert "fa4_fwd" in calls and "fa4_bwd" in calls, calls


@pytest.mark.parametrize("path", ["eager", "op"])
def test_no_double_backward(emulated: None, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Second-order gradients are refused on both paths (FA4 has no double backward), never
    returned partial."""
    if path == "op":
        monkeypatch.setattr(fa4_op, "_plain_eager", lambda *tensors: False)
    q = torch.randn(1, 8, 2, 16, dtype=torch.float64, requires_grad=True)
    out, lse = fa4_attention(q, q, q, scale=0.25, window=(-1, 0))
    (g,) = torch.autograd.grad(out.sum() + lse.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(g.sum(), q)


# -- the route's layouts (rows, chunks, packed), on CPU tensors --------------------------------


def _problem(mask: Any, batch: int, length: int, score: Any = None) -> Problem:
    return Problem(
        batch=batch,
        heads=4,
        kv_heads=2,
        q_len=length,
        kv_len=length,
        head_dim=16,
        dtype=torch.float64,
        device_type="cuda",  # what the route is planned for; run() itself only reshapes and calls
        arch="sm90",
        requires_grad=True,
        return_lse=True,
        mask=mask.bind(length, length) if mask is not None else None,
        score=score,
    )


ROUTE_CASES: dict[str, tuple[Any, int, int, Any]] = {
    # name: (mask, batch, length, score)
    "rows_causal_softcap": (masks.Causal(), 2, 40, score_mods.SoftCap(cap=3.0, approx=True)),
    "rows_sliding": (masks.SlidingWindow(left=6, right=1), 1, 40, None),
    "chunks": (masks.Chunked(size=10) & masks.Causal(), 2, 40, None),
    "packed_chunks": (masks.Chunked(size=15) & masks.Causal(), 2, 40, None),
    "packed_documents": (masks.Document.from_lengths([[10, 25, 5], [40]]) & masks.Causal(), 2, 40, None),
}


def _route_inputs(batch: int, length: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(batch, length, 4, 16, generator=g, dtype=torch.float64).transpose(1, 2)  # projections
    k = torch.randn(batch, 2, length, 16, generator=g, dtype=torch.float64)
    v = torch.randn(batch, 2, length, 16, generator=g, dtype=torch.float64)
    return tuple(t.requires_grad_(True) for t in (q, k, v))


@pytest.mark.parametrize("case", list(ROUTE_CASES))
def test_route_layouts_match_the_reference(emulated: None, case: str) -> None:
    mask, batch, length, score = ROUTE_CASES[case]
    p = _problem(mask, batch, length, score)
    assert FA4.mask_reasons(p) == []
    q, k, v = _route_inputs(batch, length)
    out, lse = FA4.run(q, k, v, p, scale=0.3)
    assert lse is not None
    ref_score = score_mods.SoftCap(cap=score.cap) if score is not None else None  # exact tanh
    ref_out, ref_lse = reference_attention(
        q, k, v, mask=mask, score_mod=ref_score, scale=0.3, enable_gqa=True, return_lse=True
    )
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    go = torch.randn_like(out)
    gl = torch.randn_like(ref_lse)
    got = torch.autograd.grad((out * go).sum() + (lse * gl).sum(), (q, k, v))
    want = torch.autograd.grad((ref_out * go).sum() + (ref_lse * gl).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(ROUTE_CASES))
@pytest.mark.parametrize("return_lse", [True, False])
def test_bound_route_calls_match_the_route(emulated: None, case: str, return_lse: bool) -> None:
    """The call the plan cache keeps (``bind``: the layout, window and soft-cap worked out once)
    gives what the route's ``run`` gives, call after call, output, lse and gradients."""
    mask, batch, length, score = ROUTE_CASES[case]
    p = dataclasses.replace(_problem(mask, batch, length, score), return_lse=return_lse)
    bound = FA4.bind(p, torch.device("cpu"))
    for _ in range(2):
        q, k, v = _route_inputs(batch, length)
        out, lse = bound(q, k, v, 0.3)
        want_out, want_lse = FA4.run(q, k, v, p, scale=0.3)
        torch.testing.assert_close(out, want_out, atol=0, rtol=0)
        assert out.shape == want_out.shape and out.stride() == want_out.stride()
        ref_score = score_mods.SoftCap(cap=score.cap) if score is not None else None  # exact tanh
        ref = reference_attention(q, k, v, mask=mask, score_mod=ref_score, scale=0.3, enable_gqa=True)
        torch.testing.assert_close(out, ref)
        if return_lse:
            assert lse is not None and want_lse is not None
            torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
        else:
            assert lse is None and want_lse is None
        go = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), go)
        want = torch.autograd.grad(want_out, (q, k, v), go)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


# -- inside torch.compile ------------------------------------------------------------------------


def test_op_compiles_fullgraph(emulated: None) -> None:
    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, lse = fa4_attention(q, k, v, scale=0.3, softcap=2.0, window=(4, 0))
        return (out * 2).sum() + lse.sum()

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 12, 2, 8, generator=g, requires_grad=True) for _ in range(3))
    explained = torch._dynamo.explain(step)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)(q, k, v)
    got = torch.autograd.grad(compiled, (q, k, v))
    eager = step(q, k, v)
    want = torch.autograd.grad(eager, (q, k, v))
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("case", ["rows_causal_softcap", "chunks"])
def test_route_compiles_fullgraph(emulated: None, case: str) -> None:
    """The route's run (layouts and op) traced whole, as fz.attention traces it on CUDA."""
    mask, batch, length, score = ROUTE_CASES[case]
    p = _problem(mask, batch, length, score)

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert FA4.mask_reasons(p) == []
        out, lse = FA4.run(q, k, v, p, scale=0.3)
        assert lse is not None
        return out, lse

    q, k, v = _route_inputs(batch, length)
    explained = torch._dynamo.explain(step)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    out, lse = torch.compile(step, fullgraph=True)(q, k, v)
    ref_out, ref_lse = step(q, k, v)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    got = torch.autograd.grad(out.square().sum() + lse.sum(), (q, k, v))
    want = torch.autograd.grad(ref_out.square().sum() + ref_lse.sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_traced_call_refuses_only_packed_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_compat, "is_compiling", lambda: True)
    assert FA4.mask_reasons(_problem(masks.Causal(), 2, 40)) == []
    assert FA4.mask_reasons(_problem(masks.Chunked(size=10) & masks.Causal(), 2, 40)) == []  # chunks
    reasons = " ".join(FA4.mask_reasons(_problem(masks.Chunked(size=15) & masks.Causal(), 2, 40)))
    assert "cu_seqlens" in reasons and "torch.compile" in reasons


@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
def test_op_exports(emulated: None, strict: bool) -> None:
    class Block(torch.nn.Module):
        def forward(
            self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return fa4_attention(q, k, v, scale=0.3, window=(-1, 0))

    q = torch.randn(2, 12, 2, 8, generator=torch.Generator().manual_seed(4))
    exported = torch.export.export(Block(), (q, q, q), strict=strict)
    assert "flexattn_zoo.fa4_fwd" in str(exported.graph)
    for a, b in zip(exported.module()(q, q, q), Block()(q, q, q), strict=True):
        torch.testing.assert_close(a, b)
