"""The routes :mod:`flexattn_zoo.bench` times, each prepared into a zero-argument forward call.

* ``auto`` and every dispatcher route: ``fz.attention(..., backend=route)``, run only when
  ``fz.plan`` accepts the call (else :class:`Unsupported` with the dispatcher's reasons).
* ``raw_flex``: what a user writes by hand: ``torch.compile(flex_attention)`` (default options) and
  a BlockMask from ``torch.compile(create_block_mask)``, as in a fresh process running this one
  variant: Dynamo is reset before each (case, mode), because one process sweeping many variants
  through the shared ``flex_attention`` code object exhausts Dynamo's recompile limit and runs
  unfused (measured: 0.7 instead of 126 TFLOP/s), which would flatter ``auto``. A limit hit within
  one case is still caught and noted. Its mask_mod and score_mod are the ones the flex routes run
  (e.g. int32 document labels, ALiBi without ``abs`` under a causal mask, as hand-written causal
  ALiBi usually is), so the comparison measures kernels, options and BlockMasks, not spelling.
  Activation attention (``score_mods.Sigmoid``) by hand asks flex for the lse and returns
  ``out * exp(lse)``, as the library does.
* ``plain_sdpa``: ``F.scaled_dot_product_attention`` as a user calls it (``is_causal``,
  ``enable_gqa``; SDPA picks its kernel), for problems it expresses without a mask tensor.
* ``fa4_direct``: FlashAttention-4's own ``flash_attn_func`` as a user calls it (``causal`` /
  ``window_size`` / ``softcap``, GQA by fewer k/v heads, its own autograd), for problems it expresses
  on whole sequences: no mask, or a mask whose varlen form is one window per row (causal, sliding
  windows) with ``Lq == Lkv``, and no score mod or ``SoftCap(approx=True)``. Inputs are the sweep's
  ``[B, H, L, D]`` tensors viewed as FA4's ``[B, L, H, D]`` (no copy).
* ``auto_tuned``: ``fz.attention(..., tune=True)``: measured route choice from an empty tuning
  table (a fresh cache directory per row, unless the caller set ``FLEXATTN_ZOO_CACHE_DIR``). The
  tuning runs while the route is prepared (the first call of the signature, in the row's mode);
  its seconds are in the row's notes, apart from the timed calls; ``chosen`` is the route the
  table then gives.
* ``sdpa_dense_mask``: SDPA with a boolean ``[B|1, H|1, L, L]`` mask materialized from the spec (or
  a float bias when the score mod is additive: it offers a ``linear_bias_form()``, like ALiBi); k/v
  are expanded for GQA so SDPA can use its memory-efficient kernel.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import flexattn_zoo as fz
from flexattn_zoo import _compat, tuning
from flexattn_zoo import blockmask as fz_blockmask
from flexattn_zoo.backends import BACKENDS
from flexattn_zoo.backends.fa4 import fa4_window
from flexattn_zoo.backends.flex import FlexBackend
from flexattn_zoo.bench.config import Case
from flexattn_zoo.bench.timing import GIB, dense_bias, dense_mask, measure, timed, torch_warnings
from flexattn_zoo.dispatch import problem_traits
from flexattn_zoo.segments import segment_layout
from flexattn_zoo.spec import MaskSpec, ScoreSpec

#: Routes that run flex with a BlockMask built by ``fz.block_mask`` (its build time is reported).
BLOCKMASK_ROUTES = frozenset(b.name for b in BACKENDS if isinstance(b, FlexBackend))
#: Steady-state BlockMask builds timed (after the first, compiling one).
BLOCKMASK_REPEATS = 3


class Unsupported(Exception):
    """The route cannot run this case exactly; the message holds the reasons."""


class SkippedOOM(Exception):
    """The route's estimated dense memory is over the case's ``max_dense_gib``."""


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor | None  # fwdbwd only

    @classmethod
    def make(cls, case: Case, mode: str, device: torch.device) -> Inputs:
        torch.manual_seed(case.seed)
        grad = mode == "fwdbwd"
        b, length, lq, d = case.batch, case.seq_len, case.lq, case.head_dim
        q = torch.randn(b, case.heads, lq, d, device=device, dtype=case.dtype, requires_grad=grad)
        k = torch.randn(b, case.kv_heads, length, d, device=device, dtype=case.dtype, requires_grad=grad)
        v = torch.randn(
            b, case.kv_heads, length, case.dv, device=device, dtype=case.dtype, requires_grad=grad
        )
        g = torch.randn(b, case.heads, lq, case.dv, device=device, dtype=case.dtype) if grad else None
        return cls(q, k, v, g)


@dataclasses.dataclass
class Prepared:
    call: Callable[[], torch.Tensor]  # one forward; returns out [B, H, L, D]
    chosen: str | None = None
    #: For ``auto``: the dispatcher's traits of the problem and the routes that accepted it, so a
    #: route order can be replayed on the sweep's rows offline (benchmarks/regret.py).
    traits: list[str] | None = None
    accepted: list[str] | None = None
    blockmask_s: float | None = None
    blockmask_compile_s: float | None = None
    notes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Outcome:
    prepared: Prepared
    ms: float
    compile_s: float
    peak_mib: float | None
    base_mib: float | None
    out: torch.Tensor | None  # first fwd output, for the error check
    notes: list[str]
    host_ms: float | None = None
    timed_iters: int | None = None
    #: The timed call, warm (for :func:`flexattn_zoo.bench.timing.interleaved`).
    step: Callable[[], Any] | None = None


# ---------------------------------------------------------------------------------------------
# Dispatcher routes


def _plan(route: str, case: Case, mask: Any, score: Any, x: Inputs) -> fz.Plan:
    try:
        return fz.plan(x.q, x.k, x.v, mask=mask, score_mod=score, enable_gqa=case.gqa, backend=route)
    except ValueError as exc:
        text = str(exc)
        prefix = f"backend {route!r} cannot run this call: "
        raise Unsupported(text.removeprefix(prefix)) from None


def _time_fz_block_mask(case: Case, mask: MaskSpec, device: torch.device) -> float:
    """Median build time of ``fz.block_mask`` from an empty cache; the last build stays cached."""
    times = []
    for _ in range(BLOCKMASK_REPEATS):
        fz_blockmask.CACHE.clear()
        _, seconds = timed(
            lambda: fz.block_mask(
                mask, case.lq, case.seq_len, batch=case.batch, heads=case.heads, device=device
            ),
            device,
        )
        times.append(seconds)
    return sorted(times)[len(times) // 2]


def prepare_fz(
    route: str, plan: fz.Plan, case: Case, mask: Any, score: Any, x: Inputs, device: torch.device
) -> Prepared:
    def call() -> torch.Tensor:
        return fz.attention(x.q, x.k, x.v, mask=mask, score_mod=score, enable_gqa=case.gqa, backend=route)

    chosen = plan.backend
    prep = Prepared(call=call, chosen=chosen if route == "auto" else None)
    if route == "auto":
        prep.traits = sorted(problem_traits(plan.problem))
        prep.accepted = [c.name for c in plan.candidates if c.accepted]
    if chosen in BLOCKMASK_ROUTES and mask is not None:
        prep.blockmask_s = _time_fz_block_mask(case, mask, device)
    return prep


def prepare_tuned(case: Case, mode: str, mask: Any, score: Any, x: Inputs, device: torch.device) -> Prepared:
    """``auto_tuned``: tune the signature now (its first call, in ``mode``), then time the winner."""
    _fresh_tuning_dir()
    kwargs = {"mask": mask, "score_mod": score, "enable_gqa": case.gqa, "tune": True}
    grad = torch.enable_grad() if mode == "fwdbwd" else torch.no_grad()

    def call() -> torch.Tensor:
        return fz.attention(x.q, x.k, x.v, **kwargs)

    with grad:
        _, seconds = timed(call, device)
        plan = fz.plan(x.q, x.k, x.v, **kwargs)
    entry = plan.tuning.entry if plan.tuning is not None else None
    timings = ", ".join(f"{n} {ms:.3f}" for n, ms in entry.ms) if entry is not None else "nothing measured"
    note = f"tuning: {seconds:.1f} s; static {entry.static if entry else '-'}; ms {timings}"
    return Prepared(call=call, chosen=plan.backend, notes=[note])


#: The tuning cache directory the last ``auto_tuned`` row made (each row gets a new, empty one).
_TUNING_DIR: list[str | None] = [None]


def _fresh_tuning_dir() -> None:
    """Point the tuning table at a new empty directory for this row (the table's next read drops
    the entries read from another), unless the caller set ``FLEXATTN_ZOO_CACHE_DIR`` to a directory
    of their own: then the row measures what that table lacks and reads the rest. The previous
    row's directory is removed."""
    current = os.environ.get(tuning.store.CACHE_DIR_ENV)
    if current is not None and current != _TUNING_DIR[0]:
        return
    made = _TUNING_DIR[0] = tempfile.mkdtemp(prefix="flexattn_zoo_bench_tune_")
    os.environ[tuning.store.CACHE_DIR_ENV] = made
    if current is not None:
        shutil.rmtree(current, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# raw_flex: a compiled flex_attention and create_block_mask as a user's one-variant script has


def _raw_compiled() -> tuple[Any, Any]:
    # A fresh Dynamo per (case, mode): see the module docstring (the runner resets it per case as
    # well, for every route). Our own compiled entries lose their graphs too; they recompile on
    # their next call, outside any timed region. A limit hit inside one case still reaches the
    # row's notes (bench.timing catches Dynamo's log).
    torch.compiler.reset()
    return torch.compile(_compat.flex_attention), torch.compile(_compat.create_block_mask)


def prepare_raw_flex(
    case: Case, mask: MaskSpec | None, score: ScoreSpec | None, x: Inputs, device: torch.device
) -> Prepared:
    flex, cbm = _raw_compiled()
    block_mask = build_s = build_compile_s = None
    if mask is not None:
        mod = mask.bind(case.lq, case.seq_len).mask_mod()
        b = case.batch if mask.uses_batch() else None
        h = case.heads if mask.uses_head() else None

        def build() -> Any:
            return cbm(mod, b, h, case.lq, case.seq_len, device=device)

        block_mask, first = timed(build, device)
        times = []
        for _ in range(BLOCKMASK_REPEATS):
            block_mask, seconds = timed(build, device)
            times.append(seconds)
        build_s = sorted(times)[len(times) // 2]
        build_compile_s = max(0.0, first - build_s)
    score_mod = None
    if score is not None:
        past = mask is not None and mask.hides_future_keys(case.lq, case.seq_len)
        score_mod = score.score_mod(future_keys_hidden=past)
    gqa = case.gqa
    if score is not None and score.is_activation():
        # Activation attention by hand: the softmax of the log-weights times exp(lse).
        aux = _compat.flex_aux_request(True)

        def activation_call() -> torch.Tensor:
            res = flex(x.q, x.k, x.v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa, **aux)
            out, lse = _compat.unpack_flex_output(res, True)
            assert lse is not None
            return (out.float() * lse.exp().unsqueeze(-1)).to(out.dtype)

        return Prepared(call=activation_call, blockmask_s=build_s, blockmask_compile_s=build_compile_s)

    def call() -> torch.Tensor:
        return flex(x.q, x.k, x.v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)

    return Prepared(call=call, blockmask_s=build_s, blockmask_compile_s=build_compile_s)


# ---------------------------------------------------------------------------------------------
# sdpa_dense_mask


def _additive(score: ScoreSpec) -> bool:
    """Whether the score mod only adds a bias to the score, so SDPA can take it as a float mask."""
    return score.linear_bias_form() is not None


def dense_estimate_bytes(
    route: str, case: Case, mode: str, mask: MaskSpec | None, score: ScoreSpec | None
) -> int:
    """Rough peak of the routes that hold ``L x L`` tensors (0 for the others)."""
    b, h, n = case.batch, case.heads, case.lq * case.seq_len
    elem = case.dtype.itemsize
    if route == "sdpa_dense_mask":
        if score is not None:
            nb = b if (mask is not None and mask.uses_batch()) else 1
            mask_bytes = nb * h * n * elem
        else:
            nb = b if mask is not None and mask.uses_batch() else 1
            nh = h if mask is not None and mask.uses_head() else 1
            mask_bytes = nb * nh * n
        return mask_bytes + b * h * n * 2
    if route == "sdpa_math":  # float32 scores and probabilities (and their grads)
        return b * h * n * 4 * (4 if mode == "fwdbwd" else 2)
    return 0


def prepare_dense_mask(
    case: Case, mask: MaskSpec | None, score: ScoreSpec | None, x: Inputs, device: torch.device
) -> Prepared:
    if score is not None:
        mod = score.score_mod()
        attn_mask, seconds = timed(
            lambda: dense_bias(mod, mask, case.seq_len, case.batch, case.heads, case.dtype, device), device
        )
    elif mask is not None:
        attn_mask, seconds = timed(
            lambda: dense_mask(mask, case.seq_len, case.batch, case.heads, device), device
        )
    else:
        attn_mask, seconds = None, None
    group = case.heads // case.kv_heads

    def call() -> torch.Tensor:
        k, v = x.k, x.v
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(x.q, k, v, attn_mask=attn_mask)

    return Prepared(call=call, blockmask_s=seconds)


# ---------------------------------------------------------------------------------------------
# plain_sdpa: the call a user writes by hand


def prepare_plain_sdpa(case: Case, mask: MaskSpec | None, score: ScoreSpec | None, x: Inputs) -> Prepared:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=..., enable_gqa=...)`` with SDPA's own
    kernel choice: runs problems with no mask, or a mask whose exact SDPA form is ``is_causal``."""
    if score is not None:
        raise Unsupported("plain SDPA takes no score_mod")
    is_causal = False
    if mask is not None:
        form = mask.bind(case.lq, case.seq_len).sdpa_form(case.lq, case.seq_len)
        if form is None or form.attn_mask is not None:
            raise Unsupported("plain SDPA runs no mask or is_causal only (a dense mask is sdpa_dense_mask)")
        is_causal = form.is_causal  # False: the mask hides nothing (e.g. Full)
    gqa = case.gqa

    def call() -> torch.Tensor:
        return F.scaled_dot_product_attention(x.q, x.k, x.v, is_causal=is_causal, enable_gqa=gqa)

    return Prepared(call=call)


# ---------------------------------------------------------------------------------------------
# fa4_direct: FlashAttention-4's public function called by hand


def fa4_direct_arguments(
    case: Case, mask: MaskSpec | None, score: ScoreSpec | None
) -> tuple[tuple[int | None, int | None], float]:
    """``(window_size, softcap)`` of ``flash_attn_func`` for the case, or :class:`Unsupported`
    naming what FA4's own function cannot express."""
    softcap = 0.0
    if score is not None:
        form = score.softcap_form()
        if form is None or not form.approx:
            raise Unsupported("FA4's own score mod is soft-capping with its tanh: SoftCap(approx=True) only")
        softcap = form.cap
    if mask is None:
        return (None, None), softcap
    if case.lq != case.seq_len:
        raise Unsupported("FA4 direct aligns masks bottom-right: measured at Lq == Lkv only")
    layout = segment_layout(mask.bind(case.lq, case.seq_len), case.batch, case.lq)
    if layout is None or layout[0] != "rows" or layout[1] != case.lq:
        raise Unsupported(f"mask {type(mask).__name__} is not one window per whole row")
    return fa4_window(layout[2]), softcap


def prepare_fa4_direct(case: Case, mask: MaskSpec | None, score: ScoreSpec | None, x: Inputs) -> Prepared:
    """``flash_attn.cute.flash_attn_func`` on ``[B, L, H, D]`` views of the inputs, with the window
    and soft-cap the problem needs (see the module docstring for what it expresses)."""
    window, softcap = fa4_direct_arguments(case, mask, score)
    if not _compat.flash_cute_available() or x.q.device.type != "cuda":
        raise Unsupported("FA4 direct needs flash_attn.cute (flash-attn-4) and a CUDA device")
    from flash_attn.cute import flash_attn_func

    def call() -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (x.q, x.k, x.v))
        res = flash_attn_func(q, k, v, window_size=window, softcap=softcap)
        out = res[0] if isinstance(res, tuple) else res
        return out.transpose(1, 2)

    return Prepared(call=call)


# ---------------------------------------------------------------------------------------------


def prepare(
    route: str, case: Case, mode: str, mask: Any, score: Any, x: Inputs, device: torch.device
) -> Prepared:
    """Check the route can run exactly, apply the memory guard, then build what it needs (timed)."""
    chosen, plan = route, None
    if route == "plain_sdpa":
        return prepare_plain_sdpa(case, mask, score, x)
    if route == "fa4_direct":
        return prepare_fa4_direct(case, mask, score, x)
    if route == "sdpa_dense_mask":
        if case.lq != case.seq_len:
            raise Unsupported("the dense-mask baseline is measured at Lq == Lkv only")
        if score is not None and not _additive(score):
            raise Unsupported(
                f"score_mod {type(score).__name__} is not an additive bias; SDPA cannot express it"
            )
    elif route != "raw_flex":
        # auto_tuned: the static choice (the memory guard below reads it; tuning never picks a
        # route that holds Lq x Lkv unless the static order does).
        plan = _plan("auto" if route == "auto_tuned" else route, case, mask, score, x)
        chosen = plan.backend
    need = max(
        dense_estimate_bytes(route, case, mode, mask, score),
        dense_estimate_bytes(chosen, case, mode, mask, score),
    )
    if need > case.max_dense_gib * GIB:
        raise SkippedOOM(f"skipped: estimated {need / GIB:.1f} GiB > max_dense_gib {case.max_dense_gib:g}")
    if route == "raw_flex":
        return prepare_raw_flex(case, mask, score, x, device)
    if route == "sdpa_dense_mask":
        return prepare_dense_mask(case, mask, score, x, device)
    if route == "auto_tuned":
        return prepare_tuned(case, mode, mask, score, x, device)
    assert plan is not None  # every other route was planned above
    return prepare_fz(route, plan, case, mask, score, x, device)


def run(route: str, case: Case, mode: str, mask: Any, score: Any, x: Inputs, device: torch.device) -> Outcome:
    """Prepare and time one route in one mode (exceptions propagate to the caller)."""
    with torch_warnings() as notes:
        prep = prepare(route, case, mode, mask, score, x, device)
        first: list[torch.Tensor] = []
        if mode == "fwd":

            def step() -> torch.Tensor:
                with torch.no_grad():
                    return prep.call()

            def keep(out: torch.Tensor) -> None:
                first.append(out)
        else:
            inputs = (x.q, x.k, x.v)

            def step() -> torch.Tensor:
                out = prep.call()
                torch.autograd.grad(out, inputs, x.grad_out)
                return out

            def keep(out: torch.Tensor) -> None:
                pass

        t = measure(step, device, case.warmup, case.iters, on_first=keep)
    return Outcome(
        prep,
        t.median_ms,
        t.compile_s,
        t.peak_mib,
        t.base_mib,
        first[0] if first else None,
        [*prep.notes, *notes],
        t.host_ms,
        len(t.times_ms),
        step,
    )
