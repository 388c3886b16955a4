"""Recording and replaying FA4 launches (``backends.fa4_replay``), on the CPU with a stand-in
launcher: a function with a JIT cache whose "compiled kernels" are torch code run outside the
recording's view, as FA4's CuTe kernels are (they take tensors through TVM-FFI, not torch ops).

The real launchers run on the GPU suite (tests/gpu/test_fa4_replay_gpu.py)."""

from __future__ import annotations

import sys
import threading
import types
import weakref
from typing import Any, NamedTuple

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from flexattn_zoo.backends import fa4_replay
from flexattn_zoo.backends.fa4_replay import (
    MAX_INCONCLUSIVE,
    PROGRAMS,
    Program,
    Refused,
    _Inconclusive,
    _Nested,
    _Ref,
    _Step,
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
    verdict = record(mod, mod.launcher, _inputs(0), True)[1]
    assert isinstance(verdict, _Inconclusive) and "compiled" in verdict.reason, verdict
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


def _counting_module(on_call: Any) -> types.SimpleNamespace:
    """``_module(_plain)`` whose kernel, already compiled, runs ``on_call(n, args)`` first (its
    ``n``-th run) and counts its runs in ``mod.count[0]``."""
    count = [0]

    def kernel(*args: Any) -> None:
        count[0] += 1
        on_call(count[0], args)
        _scores(*args)

    mod = _module(_plain)
    mod.launcher.compile_cache["scores"] = kernel  # type: ignore[attr-defined]
    mod.count = count
    return mod


def _entry(key: Any) -> Any:
    return PROGRAMS.get_eager((key, torch.get_default_dtype()))


def test_a_kind_met_once_runs_its_kernels_once() -> None:
    """Kinds that change every call (a new document count per batch) pay no recording."""
    PROGRAMS.clear()
    mod = _counting_module(lambda n, args: None)
    for step in range(10):
        launch(("docs", step), mod, mod.launcher, _inputs(step))
    assert mod.count[0] == 10  # no check runs
    assert not any(isinstance(e, (Program, Refused)) for e in PROGRAMS.values())


def test_an_error_in_the_check_run_returns_fa4s_result_and_refuses_the_kind() -> None:
    PROGRAMS.clear()

    def on_call(n: int, args: Any) -> None:
        if n == 3:  # call 1 notes the kind, call 2 is FA4's own run while recording, 3 the check
            raise RuntimeError("a kernel error in the check run")

    mod = _counting_module(on_call)
    q, k = _inputs(0)
    launch("error", mod, mod.launcher, (q, k))
    got = launch("error", mod, mod.launcher, (q, k))
    assert torch.equal(got[0], _plain(_scores, q, k)[0])
    verdict = _entry("error")
    assert isinstance(verdict, Refused) and "a kernel error" in verdict.reason, verdict


def test_a_check_run_out_of_memory_is_tried_again_then_refused() -> None:
    PROGRAMS.clear()

    def on_call(n: int, args: Any) -> None:
        # call 1 runs once; each recording then runs FA4's call (n even) and the check (n odd)
        if n in {2 * i + 1 for i in range(1, MAX_INCONCLUSIVE + 1)}:
            raise torch.OutOfMemoryError("CUDA out of memory (check run)")

    mod = _counting_module(on_call)
    q, k = _inputs(0)
    for call in range(MAX_INCONCLUSIVE + 3):
        got = launch("oom", mod, mod.launcher, (q, k))
        assert torch.equal(got[0], _plain(_scores, q, k)[0])
        if call < MAX_INCONCLUSIVE:
            assert not isinstance(_entry("oom"), Refused)
    verdict = _entry("oom")
    assert isinstance(verdict, Refused) and "out of memory" in verdict.reason, verdict
    assert mod.launcher.calls == MAX_INCONCLUSIVE + 3  # never replayed
    assert mod.count[0] == 1 + 2 * MAX_INCONCLUSIVE + 2  # no recording after the refusal


def test_fa4s_scratch_is_released_before_the_check_run() -> None:
    PROGRAMS.clear()
    scratch: list[weakref.ref[torch.Tensor]] = []
    alive: list[bool] = []

    def on_call(n: int, args: Any) -> None:
        if n == 3:  # the check run: is run 2's k.t() view (held only by FA4's call) gone?
            alive.append(scratch[-1]() is not None)
        scratch.append(weakref.ref(args[1]))

    mod = _counting_module(on_call)
    for _ in range(2):
        launch("scratch", mod, mod.launcher, _inputs(0))
    assert isinstance(_entry("scratch"), Program)
    assert alive == [False]


def test_nan_in_an_exact_result_compares_bit_for_bit() -> None:
    """The same kernels on the same inputs give the same NaN bits: a NaN row (padding, a bad
    step) does not keep a forward from being recorded."""
    PROGRAMS.clear()
    mod = _module(_plain)
    q, k = _inputs(0)
    q[0, 0] = float("nan")
    launch("nan", mod, mod.launcher, (q, k))  # notes the kind (and compiles)
    launch("nan", mod, mod.launcher, (q, k))  # records
    assert isinstance(_entry("nan"), Program), _entry("nan")


def test_nan_in_an_inexact_result_is_tried_again_then_refused() -> None:
    PROGRAMS.clear()
    mod = _module(_plain)
    q, k = _inputs(0)
    q[0, 0] = float("nan")
    launch("nan-inexact", mod, mod.launcher, (q, k), exact=False)
    launch("nan-inexact", mod, mod.launcher, (q, k), exact=False)
    assert isinstance(_entry("nan-inexact"), fa4_replay._Seen)
    launch("nan-inexact", mod, mod.launcher, _inputs(1), exact=False)  # a finite call records
    assert isinstance(_entry("nan-inexact"), Program)

    PROGRAMS.clear()
    for _ in range(MAX_INCONCLUSIVE + 2):
        launch("always-nan", mod, mod.launcher, (q, k), exact=False)
    verdict = _entry("always-nan")
    assert isinstance(verdict, Refused) and "NaN" in verdict.reason, verdict


def test_the_check_run_poisons_memory_a_missed_kernel_would_have_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel the recording cannot see (here: a fill outside the dispatcher, standing in for a
    kernel launched outside the JIT caches) writes a scratch buffer that a recorded kernel reads.
    On a GPU the check run's allocation can reuse FA4's freed buffer, bytes included: here every
    replayed ``empty`` returns such memory (ones). Without the poison the check would pass."""
    monkeypatch.setitem(
        fa4_replay._FAST,
        "aten::empty.memory_format",
        lambda size, **kw: torch.ones(size, dtype=kw.get("dtype")),
    )

    def body(kernel: Any, q: torch.Tensor, k: torch.Tensor) -> Any:
        out = torch.empty(q.shape[0], k.shape[0])
        rowsum = torch.empty(q.shape[0])
        with _disable_current_modes():
            rowsum.fill_(1.0)  # unseen by the recording
        kernel(q, k.t(), out, rowsum, 1.0)
        return out, rowsum

    _, verdict = _recorded(body)
    assert isinstance(verdict, Refused) and "differed" in verdict.reason, verdict


def test_a_poisoned_run_fills_every_uninitialized_allocation() -> None:
    aten = torch.ops.aten
    cpu = torch.device("cpu")
    allocations = [
        _Step.of(aten.empty.memory_format, ([3],), {"dtype": dtype, "device": cpu}, True)
        for dtype in (torch.bfloat16, torch.int32, torch.uint8, torch.bool)
    ]
    zeros = _Step.of(aten.zeros.default, ([3],), {"dtype": torch.float32, "device": cpu}, True)
    program = Program(steps=[*allocations, zeros], result=_Nested(tuple, tuple(_Ref(i) for i in range(5))))
    floats, ints, bytes_, bools, zeroed = program.run((), poison=True)
    assert floats.isnan().all() and (ints == -1).all() and (bytes_ == 255).all() and bools.all()
    assert (zeroed == 0).all()  # initialized allocations keep their values


def test_another_threads_fa4_calls_during_a_recording_are_not_recorded() -> None:
    """Other FA4 callers (torch's flex FLASH backward on an autograd thread, user code) do not
    take this library's lock: their calls during a recording belong to them."""
    PROGRAMS.clear()
    holder: list[Any] = []

    def on_call(n: int, args: Any) -> None:
        if n == 2:  # during the recording
            t = threading.Thread(target=lambda: holder[0].launcher(*_inputs(9)))
            t.start()
            t.join()

    mod = _counting_module(on_call)
    holder.append(mod)
    for seed in range(2):
        launch("race", mod, mod.launcher, _inputs(seed))
    assert isinstance(_entry("race"), Program), _entry("race")


def test_the_fa4_routes_key_reads_what_fa4_reads_from_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """FA4's log level (in its kernels' compile key), its scheduling tunables and its SM-count
    override change what its launcher does: each is in the fa4 route's replay key."""
    from flexattn_zoo.backends import fa4_op

    level = [0]
    cute = types.ModuleType("flash_attn.cute")
    cute.fa_logging = types.SimpleNamespace(get_fa_log_level=lambda: level[0])  # type: ignore[attr-defined]
    package = types.ModuleType("flash_attn")
    package.cute = cute  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    for name in fa4_op._FA4_PER_CALL_ENV:
        monkeypatch.delenv(name, raising=False)
    interface = types.SimpleNamespace(BIN_BATCH_SEARCH_THRESH=256, USE_BLOCKS_TO_BATCH=True)
    fa4_op._fa4_log_level.cache_clear()  # the getter of this stand-in FA4, imported once
    try:
        _check_the_key(fa4_op, interface, level, monkeypatch)
    finally:
        fa4_op._fa4_log_level.cache_clear()


def _check_the_key(fa4_op: Any, interface: Any, level: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.zeros(2, 3)
    base = fa4_op._replay_key((t, None), interface)
    assert fa4_op._replay_key((t, None), interface) == base
    level[0] = 2
    assert fa4_op._replay_key((t, None), interface) != base
    level[0] = 0
    interface.BIN_BATCH_SEARCH_THRESH = 8
    assert fa4_op._replay_key((t, None), interface) != base
    interface.BIN_BATCH_SEARCH_THRESH = 256
    monkeypatch.setenv("FLASH_ATTENTION_NUM_SMS", "66")
    assert fa4_op._replay_key((t, None), interface) != base
    monkeypatch.delenv("FLASH_ATTENTION_NUM_SMS")
    assert fa4_op._replay_key((t, None), interface) == base
    monkeypatch.setenv("FLASH_ATTENTION_BWD_TILE_N", "64")
    assert fa4_op._replay_key((t, None), interface) != base
    monkeypatch.delenv("FLASH_ATTENTION_BWD_TILE_N")
    assert fa4_op._replay_key((t, t), interface) != fa4_op._replay_key((t, t.clone()), interface)


def test_an_infinite_result_compares_exactly() -> None:
    """An lse of -inf (a row that sees no key) is recorded: -inf equals -inf."""

    def with_inf(kernel: Any, q: torch.Tensor, k: torch.Tensor) -> Any:
        out, rowsum = _plain(kernel, q, k)
        rowsum.fill_(float("-inf"))
        return out, rowsum

    _, program = _recorded(with_inf)
    assert isinstance(program, Program), program
