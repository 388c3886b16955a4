"""Recording and replaying FA4 launches (``backends.fa4_replay``), on the CPU with a stand-in
launcher: a function with a JIT cache whose "compiled kernels" are torch code run outside the
recording's view, as FA4's CuTe kernels are (they take tensors through TVM-FFI, not torch ops).

The real launchers run on the GPU suite (tests/gpu/test_fa4_replay_gpu.py)."""

from __future__ import annotations

import types
from typing import Any, NamedTuple

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from flexattn_zoo.backends import fa4_replay
from flexattn_zoo.backends.fa4_replay import (
    PROGRAMS,
    Program,
    Refused,
    identities,
    launch,
    record,
    tensor_key,
)


class Aux(NamedTuple):
    tensors: Any = None
    scalars: Any = None


class JitCache:
    """FA4's in-memory JIT cache, as far as its launchers use it."""

    def __init__(self) -> None:
        self.cache: dict[Any, Any] = {}

    def __contains__(self, key: Any) -> bool:
        return key in self.cache

    def __getitem__(self, key: Any) -> Any:
        return self.cache[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self.cache[key] = value


def _scores(
    q: torch.Tensor, kt: torch.Tensor, out: torch.Tensor, rowsum: torch.Tensor, scale: float, *rest: Any
) -> None:
    """A "compiled kernel": writes its outputs, as a CuTe kernel would, unseen by torch modes."""
    with _disable_current_modes():
        out.copy_(q @ kt * scale)
        rowsum.add_(out.sum(-1))
        if rest and isinstance(rest[-1], Aux) and rest[-1].tensors is not None:
            rowsum.add_(rest[-1].tensors[0].sum())


def _module(body: Any) -> types.SimpleNamespace:
    """A stand-in for ``flash_attn.cute.interface`` whose launcher ``body(q, k)`` gets a fresh
    JIT cache (compiling ``_scores`` on first use)."""

    def launcher(q: torch.Tensor, k: torch.Tensor) -> Any:
        launcher.calls += 1  # type: ignore[attr-defined]
        if "scores" not in launcher.compile_cache:  # type: ignore[attr-defined]
            launcher.compile_cache["scores"] = _scores  # type: ignore[attr-defined]
        return body(launcher.compile_cache["scores"], q, k)  # type: ignore[attr-defined]

    launcher.compile_cache = JitCache()  # type: ignore[attr-defined]
    launcher.calls = 0  # type: ignore[attr-defined]
    return types.SimpleNamespace(launcher=launcher)


def _plain(kernel: Any, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(q.shape[0], k.shape[0])
    rowsum = torch.zeros(q.shape[0])
    kernel(q.detach(), k.t(), out, rowsum, 2.0, None, Aux())
    return out, rowsum


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, generator=g), torch.randn(5, 3, generator=g)


def _recorded(body: Any) -> tuple[types.SimpleNamespace, Program | Refused | None]:
    mod = _module(body)
    record(mod, mod.launcher, _inputs(0), True)  # compiles: not recorded
    return mod, record(mod, mod.launcher, _inputs(0), True)[1]


def test_a_call_that_compiles_is_not_recorded_and_the_next_one_is() -> None:
    mod = _module(_plain)
    assert record(mod, mod.launcher, _inputs(0), True)[1] is None
    program = record(mod, mod.launcher, _inputs(0), True)[1]
    assert isinstance(program, Program), program
    assert isinstance(mod.launcher.compile_cache, JitCache)  # the real cache is put back


def test_replay_equals_the_launcher_on_new_inputs_without_running_it() -> None:
    mod, program = _recorded(_plain)
    assert isinstance(program, Program)
    calls = mod.launcher.calls
    q, k = _inputs(1)
    got = program.run((q, k))
    assert mod.launcher.calls == calls  # the launcher's Python did not run
    want = mod.launcher(q, k)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    # detach is passed through; the transpose of k is re-run on the new k
    names = [str(step.fn) for step in program.steps]
    assert not any("detach" in n for n in names), names
    assert any("aten.t" in n for n in names), names  # OpOverload(op='aten.t', ...)


def test_fills_are_replayed() -> None:
    def filled(kernel: Any, q: torch.Tensor, k: torch.Tensor) -> Any:
        out = torch.empty(q.shape[0], k.shape[0])
        rowsum = torch.empty_like(q[:, 0], memory_format=torch.preserve_format)
        rowsum.fill_(10.0)  # the kernel adds to it: a replay must fill it again
        kernel(q, k.t(), out, rowsum, 1.0)
        return out, rowsum

    _, program = _recorded(filled)
    assert isinstance(program, Program)
    q, k = _inputs(2)
    torch.testing.assert_close(program.run((q, k))[1], 10.0 + (q @ k.t()).sum(-1), rtol=0, atol=1e-5)


def test_tensors_inside_tuple_arguments_are_rebuilt() -> None:
    def aux(kernel: Any, q: torch.Tensor, k: torch.Tensor) -> Any:
        out = torch.empty(q.shape[0], k.shape[0])
        rowsum = torch.zeros(q.shape[0])
        kernel(q, k.t(), out, rowsum, 1.0, Aux(tensors=(q,), scalars=(1, 2)))
        return out, rowsum

    mod, program = _recorded(aux)
    assert isinstance(program, Program)
    q, k = _inputs(3)
    assert torch.equal(program.run((q, k))[1], mod.launcher(q, k)[1])


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("clone", "aten.clone"),  # FA4's copy of a misaligned input
        ("sum", "aten.sum"),  # a reduction (or a value read on the host)
        ("global", "cannot place"),  # a kernel argument made outside the call
        ("object", "not a plain value"),  # an opaque object (it could hold pointers)
        ("nothing", "no compiled kernel"),  # FA4's empty-input path (torch ops only)
        ("result", "cannot place"),  # a result the recording did not see made
    ],
)
def test_what_cannot_be_replayed_is_refused_with_its_reason(name: str, reason: str) -> None:
    stray = torch.zeros(4)

    def body(kernel: Any, q: torch.Tensor, k: torch.Tensor) -> Any:
        out = torch.empty(q.shape[0], k.shape[0])
        rowsum = torch.zeros(q.shape[0])
        if name == "clone":
            q = q.clone()
        if name == "sum":
            rowsum = rowsum + q.sum()
        if name == "nothing":
            return out.zero_(), rowsum
        kernel(
            q, k.t(), out, stray if name == "global" else rowsum, 1.0, object() if name == "object" else None
        )
        if name == "result":
            with _disable_current_modes():
                return out, torch.ones(1)
        return out, rowsum

    _, verdict = _recorded(body)
    assert isinstance(verdict, Refused), verdict
    assert reason in verdict.reason, verdict.reason


def test_aliases_made_below_the_dispatcher_are_placed_unless_ambiguous() -> None:
    def aliased(kernel: Any, q: torch.Tensor, k: torch.Tensor) -> Any:
        out, rowsum = _plain(kernel, q, k)
        with _disable_current_modes():  # unseen, as autograd's own aliases of outputs
            return out.view(out.shape), rowsum

    mod, program = _recorded(aliased)
    assert isinstance(program, Program), program
    q, k = _inputs(4)
    assert torch.equal(program.run((q, k))[0], mod.launcher(q, k)[0])

    def three(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        out = torch.empty(q.shape[0], k.shape[0])
        with _disable_current_modes():
            unseen = v.view(v.shape)  # k or v? the two inputs are one memory
        three.compile_cache["scores"](q, unseen.t(), out, torch.zeros(q.shape[0]), 1.0)  # type: ignore[attr-defined]
        return out

    three.compile_cache = JitCache()  # type: ignore[attr-defined]
    three.compile_cache["scores"] = _scores  # type: ignore[attr-defined]
    q, k = _inputs(5)
    verdict = record(types.SimpleNamespace(three=three), three, (q, k, k.view(k.shape)), True)[1]
    assert isinstance(verdict, Refused) and "cannot place" in verdict.reason, verdict


def test_a_program_that_differs_from_the_launcher_is_refused() -> None:
    """The check run catches GPU work the recording cannot see (here: a kernel that keeps state
    between calls, standing in for a kernel launched outside the JIT caches)."""
    seen = []

    def stateful(kernel: Any, q: torch.Tensor, k: torch.Tensor) -> Any:
        out, rowsum = _plain(kernel, q, k)
        with _disable_current_modes():
            seen.append(1)
            rowsum.add_(len(seen))
        return out, rowsum

    _, verdict = _recorded(stateful)
    assert isinstance(verdict, Refused) and "differed" in verdict.reason, verdict


def test_launch_keeps_programs_and_refusals_per_key() -> None:
    PROGRAMS.clear()
    mod = _module(_plain)
    for seed in range(4):
        q, k = _inputs(seed)
        want = _plain(_scores, q, k)
        got = launch("plain", mod, mod.launcher, (q, k))
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    # call 1 compiled, call 2 recorded (plus its check run), calls 3 and 4 replayed
    assert mod.launcher.calls == 2
    assert len(PROGRAMS) == 1

    refused = _module(lambda kernel, q, k: _plain(kernel, q.clone(), k))
    for seed in range(3):
        launch("clone", refused, refused.launcher, _inputs(seed))
    assert refused.launcher.calls == 3  # a refused kind always runs the launcher
    assert len(PROGRAMS) == 2


def test_default_dtype_is_part_of_the_key() -> None:
    PROGRAMS.clear()
    mod = _module(_plain)
    q, k = _inputs(0)
    for _ in range(3):
        launch("dtype", mod, mod.launcher, (q, k))
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out, _ = launch("dtype", mod, mod.launcher, (q.double(), k.double()))
    finally:
        torch.set_default_dtype(old)
    assert out.dtype == torch.float64
    assert mod.launcher.calls == 3  # compile, record, then the float64 kind's own first call


def test_tensor_key_reads_what_a_launcher_reads() -> None:
    buf = torch.zeros(4096)
    t = buf[:32].view(8, 4)
    assert tensor_key(None) is None
    assert tensor_key(t) == tensor_key(buf[64:96].view(8, 4))  # 256 bytes further: same alignment
    assert tensor_key(t) != tensor_key(buf[1:33].view(8, 4))  # pointer alignment
    assert tensor_key(t) != tensor_key(buf[:32].view(4, 8).t())  # shape and strides
    assert tensor_key(t) != tensor_key(buf.view(torch.int32)[:32].view(8, 4))  # dtype
    assert tensor_key(t) != tensor_key(t.detach().requires_grad_(True))
    assert identities((t, None, t, None)) == (0, 1, 0, 1)


def test_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fa4_replay.enabled()
    monkeypatch.setenv("FLEXATTN_ZOO_FA4_REPLAY", "0")
    assert not fa4_replay.enabled()
