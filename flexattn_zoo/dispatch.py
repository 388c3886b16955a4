"""``fz.attention`` / ``fz.plan``: pick the fastest exact route and run it.

Every backend is asked for its reasons to refuse the problem; ``backend="auto"`` takes the first
route of the measured per-generation priority (``arch.priority``) that has none. A named backend
never falls back: it runs, or raises ``ValueError`` with its reasons.

Measured route choice (``tune=True``, ``fz.tune.enable()``; :mod:`flexattn_zoo.tuning`) changes
only ``auto``'s pick among the routes that accept the call: the first eager call of a signature
times them, later calls (and traced ones) read the table. A named backend is never changed.

DTensor inputs run shard by shard, and calls under torch's ``context_parallel`` only on the SDPA
routes it reroutes (:mod:`flexattn_zoo.sharding`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Literal, overload

import torch

from flexattn_zoo import _compat, plan_cache, sharding, tuning
from flexattn_zoo.arch import Sizes, applied_rules, detect_arch, generation, priority
from flexattn_zoo.backends import BACKENDS, BY_NAME
from flexattn_zoo.backends.base import IN_GRAPH, api_lse_dtype
from flexattn_zoo.coercion import as_mask_spec, as_score_spec, check_kernel_options, tensor_args, with_causal
from flexattn_zoo.plan_cache import call_key
from flexattn_zoo.problem import Problem
from flexattn_zoo.segments import segment_layout
from flexattn_zoo.spec import Spec, unused_forms
from flexattn_zoo.tuning import TuneInfo
from flexattn_zoo.validation import (
    Shape,
    check_device,
    check_dropout_p,
    check_flag,
    check_learned_devices,
    check_qkv,
    check_scale,
    check_traced_scale,
    inputs_nonfinite,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One route's verdict: accepted, or the reasons it refused; ``rank`` in the priority list."""

    name: str
    accepted: bool
    reasons: tuple[str, ...]
    rank: int | None


@dataclasses.dataclass(frozen=True)
class Plan:
    """The chosen route and every candidate's verdict. Runs nothing."""

    backend: str
    requested: str
    problem: Problem
    #: Every route's verdict, or None where the dispatcher planned a call from the verdicts it
    #: needed alone (``plan_problem(lazy=True)``): :attr:`candidates` works them out when read.
    verdicts: tuple[Candidate, ...] | None = dataclasses.field(default=None, compare=False, repr=False)
    #: Measured route choice's view of this plan: its signature, the measurement (if any) and the
    #: routes it compares; None when tuning was off for the call or a route was named.
    tuning: TuneInfo | None = None

    @property
    def candidates(self) -> tuple[Candidate, ...]:
        """Every route's verdict: accepted, or refused with its reasons, and its rank in ``auto``'s
        order."""
        if self.verdicts is None:
            object.__setattr__(self, "verdicts", tuple(_verdicts(self.problem)))
        assert self.verdicts is not None
        return self.verdicts

    @property
    def measured(self) -> bool:
        """Whether ``backend`` was chosen by measurement rather than by the static order."""
        return self.tuning is not None and self.tuning.measured(self.backend)

    def explain(self) -> str:
        """The plan as text: the problem, what tuning said (when it was on), then every route in
        this arch's priority order (routes that ``auto`` never picks last) with its verdict, and
        the reasons of each refusal."""
        p = self.problem
        mask = type(p.mask).__name__ if p.mask is not None else ("BlockMask" if p.user_block_mask else "none")
        score = type(p.score).__name__ if p.score is not None else "none"
        lines = [
            f"route: {self.backend} (requested {self.requested!r}; arch {p.arch}, mode {p.mode}"
            f"{', deterministic' if p.deterministic else ''}"
            f"{f', dropout_p={p.dropout_p:g}' if p.dropout_p > 0 else ''})",
            f"problem: B={p.batch} H={p.heads}/{p.kv_heads} Lq={p.q_len} Lkv={p.kv_len} D={p.head_dim} "
            f"{str(p.dtype).removeprefix('torch.')} on {p.device_type}; mask={mask} score_mod={score}",
        ]
        for spec in (p.mask, p.score):
            for cls, maker, parent, unused in unused_forms(spec):
                runs = "replaces" if maker is cls else f"runs {maker.__name__}'s function in place of"
                public = [n for n in unused if not n.startswith("_")]
                example = next((n for n in ("sdpa_form", "block_map", *public) if n in public), None)
                lines.append(
                    f"note: {cls.__name__} {runs} {parent.__name__}'s function, so it does not use "
                    f"{parent.__name__}'s {', '.join(unused)}"
                    + (
                        f" (restate in its class body one that still holds, e.g. {example} = "
                        f"{parent.__name__}.{example})"
                        if example
                        else ""
                    )
                )
        if self.tuning is not None:
            lines.append(self.tuning.describe(self.backend))
            lines.append(f"signature: {self.tuning.signature.describe()}")
        lines.extend(self._order_source())
        ranked = sorted(self.candidates, key=lambda c: (c.rank is None, c.rank or 0))
        for c in ranked:
            rank = f"#{c.rank + 1}" if c.rank is not None else "--"
            if c.name == self.backend:
                verdict = "chosen (measured)" if self.measured else "chosen"
            elif c.accepted:
                verdict = "could run (lower priority)" if c.rank is not None else "could run (only if named)"
            else:
                verdict = "refused: " + "; ".join(c.reasons)
            lines.append(f"  {rank:>3} {c.name:<15} {verdict}")
        return "\n".join(lines)

    def _order_source(self) -> list[str]:
        """Where ``auto``'s order of routes came from: the arch's table and each measured rule
        (``arch.RULES``) that moved routes to its front, with the benchmark rows behind it."""
        p = self.problem
        if self.requested != "auto":
            return [f"order: none asked (route {self.requested!r} named)"]
        gen = generation(p.arch)
        rules = applied_rules(p.arch, p.mode, problem_traits(p), _sizes(p))
        if not rules:
            return [f"order: the {gen} table for {p.mode}, no measured rule applies"]
        out = [f"order: the {gen} table for {p.mode}, then these measured rules (arch.RULES; the last wins):"]
        for rule in rules:
            what = rule.why.split(":")[0]  # the why's first clause names the problems it covers
            rows = f"{len(rule.evidence)} row{'s' if len(rule.evidence) > 1 else ''} of {rule.benchmark}"
            out.append(f"  {', '.join(rule.front)} first: {what} ({rows})")
        return out

    def __str__(self) -> str:
        return self.explain()


def problem_traits(p: Problem) -> frozenset[str]:
    """The named properties that ``arch.RULES`` select on (measured exceptions to PRIORITY)."""
    traits = set()
    if p.score is not None:
        traits.add("score_mod")
        if p.score.has_fast_variant():
            traits.add("fast_score_mod")
    if p.mask is not None and p.q_len == p.kv_len and not p.user_block_mask:
        layout = segment_layout(p.mask, p.batch, p.q_len)
        if layout is not None and layout[0] == "packed":
            traits.add("packed_segments")
    if p.mask is not None and not p.user_block_mask:
        split = p.mask.split_form(p.q_len, p.kv_len)
        if split is not None and any(part.mask is not None for part in split.parts):
            traits.add("split_masked")
        if p.q_len == p.kv_len and p.mask.global_tokens_form(p.q_len, p.kv_len) is not None:
            traits.add("global_tokens")
    if p.kv_heads < p.heads:
        traits.add("gqa")
    return frozenset(traits)


def _visible(p: Problem) -> float:
    """The mask's bound on the visible share of pairs, for the size rules; 1.0 while
    ``torch.compile`` traces (lengths may be symbolic there, and Dynamo reports a SymInt as an
    int: a float share would turn the rules' comparison into a float guard), so a traced call's
    rules compare the unmasked size, with one integer guard."""
    if p.mask is None or _compat.is_compiling():
        return 1.0
    return p.mask.visible_fraction(p.q_len, p.kv_len)


def _sizes(problem: Problem) -> Sizes:
    """The sizes ``arch.RULES`` select on, of ``problem``."""
    return Sizes(
        problem.batch,
        problem.heads,
        problem.q_len,
        problem.kv_len,
        problem.head_dim,
        _visible(problem),
        problem.kv_heads,
    )


def _order(problem: Problem) -> tuple[str, ...]:
    """``auto``'s order of routes for ``problem`` (``arch.priority`` with its size rules)."""
    return tuple(priority(problem.arch, problem.mode, problem_traits(problem), _sizes(problem)))


def _first_accepted(problem: Problem, backend: str) -> str | None:
    """The route :func:`plan_problem` would choose without tuning, asking only the routes it must
    (the named one; for ``auto`` each in order up to the first that accepts), or None where it
    would raise (the full verdicts then say why)."""
    if backend != "auto":
        return None if BY_NAME[backend].reasons(problem) else backend
    return next((name for name in _order(problem) if not BY_NAME[name].reasons(problem)), None)


def _verdicts(problem: Problem) -> list[Candidate]:
    order = _order(problem)
    out = []
    for b in BACKENDS:
        reasons = b.reasons(problem)
        rank = order.index(b.name) if b.name in order else None
        if rank is None and not reasons:
            reasons_t: tuple[str, ...] = ()
        else:
            reasons_t = tuple(reasons)
        out.append(Candidate(b.name, not reasons, reasons_t, rank))
    return out


#: Added to a named route's refusal while traced when the call's mask or score holds tensors:
#: forms read from their values (document segments, whether a row sees a key) are unknown in the
#: graph, which is often why a route that runs the call eagerly refuses it there.
TRACED_DATA_NOTE = (
    f"{IN_GRAPH} the mask's and score's tensors are not read, so no form built from their values "
    "(document segments, rows that see no key) is available there"
)


def _holds_tensors(problem: Problem) -> bool:
    """Whether the call's mask or score holds tensors of its own (a ``Document``'s ids, a ``Bias``),
    the values forms are built from. What a raw callable captures does not count: no form is built
    from it, and a callable made inside the graph shows Dynamo no closure to walk (the walk raised
    in place of the route's refusal)."""
    return any(spec is not None and _owns_tensors(spec) for spec in (problem.mask, problem.score))


def _owns_tensors(spec: Spec) -> bool:
    for part in spec._parts():  # a plain loop: this runs while traced
        if isinstance(part, torch.Tensor) or (isinstance(part, Spec) and _owns_tensors(part)):
            return True
    return False


def plan_problem(
    problem: Problem,
    backend: str = "auto",
    *,
    tune: bool = False,
    device: torch.device | None = None,
    lazy: bool = False,
) -> Plan:
    """Choose a route for ``problem`` (see :class:`Problem`); ``ValueError`` if none can run it.

    ``tune``: for ``backend="auto"``, take the measured winner of the problem's signature on
    ``device`` (default: the problem's device type) from the in-memory table of
    :mod:`flexattn_zoo.tuning` where it accepts the problem (nothing is timed or loaded here).
    ``lazy`` (without ``tune``): ask only the routes the choice needs (a call over a growing KV
    cache plans every step); the plan's ``candidates`` are worked out when first read."""
    check_backend(backend)
    if lazy and not tune:
        route = _first_accepted(problem, backend)
        if route is not None:
            return Plan(route, backend, problem)
    cands = _verdicts(problem)
    by_name = {c.name: c for c in cands}
    if backend != "auto":
        chosen = by_name[backend]
        if not chosen.accepted:
            reasons = list(chosen.reasons)
            if _compat.is_compiling() and _holds_tensors(problem) and not any(IN_GRAPH in r for r in reasons):
                reasons.append(TRACED_DATA_NOTE)
            raise ValueError(f"backend {backend!r} cannot run this call: {'; '.join(reasons)}")
        return Plan(backend, backend, problem, tuple(cands))
    ranked = [c for c in sorted(cands, key=lambda c: (c.rank is None, c.rank or 0)) if c.rank is not None]
    accepted = tuple(c.name for c in ranked if c.accepted)
    if accepted:
        static = accepted[0]
        if not tune:
            return Plan(static, "auto", problem, tuple(cands))
        where = torch.device(problem.device_type) if device is None else device
        info = tuning.consult(problem, where, accepted, static)
        route = static if info is None else info.chosen(static)
        return Plan(route, "auto", problem, tuple(cands), info)
    detail = "; ".join(f"{c.name}: {', '.join(c.reasons)}" for c in ranked)
    # Suggest only what is true: routes outside the list that accept this very problem, if any.
    others = [c for c in cands if c.rank is None and BY_NAME[c.name].devices >= {problem.device_type}]
    can = [c.name for c in others if c.accepted]
    if can:
        hint = (
            f"Name one that can explicitly ({', '.join(f'backend={n!r}' for n in can)}) or change the inputs."
        )
    else:
        rest = "".join(f"; {c.name}: {', '.join(c.reasons)}" for c in others)
        hint = f"No other route can run it either{rest}. Change the inputs."
    raise ValueError(
        f"no route in the {generation(problem.arch)} priority list can run this call exactly ({detail}). {hint}"
    )


def _under_context_parallel(chosen: Plan) -> Plan:
    """``chosen``, or another accepted route of ``auto``'s order, that torch's context_parallel
    reroutes to ring attention (``sharding.context_parallel_route``; ValueError if none)."""
    ranked = sorted((c for c in chosen.candidates if c.rank is not None), key=lambda c: c.rank or 0)
    accepted = [c.name for c in ranked if c.accepted]
    name = sharding.context_parallel_route(chosen.problem, chosen.backend, chosen.requested, accepted)
    return chosen if name == chosen.backend else dataclasses.replace(chosen, backend=name)


def _check_user_block_mask(
    bm: Any, batch: int, heads: int, q_len: int, kv_len: int, device: torch.device
) -> None:
    if tuple(bm.seq_lengths) != (q_len, kv_len):
        raise ValueError(
            f"mask BlockMask was built for lengths {tuple(bm.seq_lengths)}, but Lq, Lkv = {q_len}, {kv_len}"
        )
    bb, bh = bm.kv_num_blocks.shape[:2]
    if bb not in (1, batch) or bh not in (1, heads):
        raise ValueError(f"mask BlockMask has batch/heads {bb}/{bh}; need 1 or {batch} and 1 or {heads}")
    if bm.kv_num_blocks.device != device:
        raise ValueError(f"mask BlockMask is on {bm.kv_num_blocks.device} but q is on {device}")


def _resolve_deterministic(deterministic: Any) -> bool:
    if deterministic is None:
        # Follow torch's own switch: under torch.use_deterministic_algorithms(True) torch itself
        # refuses cuDNN SDPA and FA4's block-sparse backward, so those routes must not be chosen.
        return _compat.strict_deterministic_mode()
    return check_flag("deterministic", deterministic)


def needs_grad(inputs: tuple[Any, ...], score: Any) -> bool:
    """Whether a call records a backward: grad mode is on and an input requires grad, or the score
    spec captures a learnable tensor (a spec's learned bias, or one a raw ``score_mod`` closes
    over: ``functions.captured_tensors``) -- its gradient needs a route with a backward. Traced,
    a raw ``score_mod`` that cannot be walked at trace time (made inside the compiled region, or
    torch before 2.13: ``functions.walkable_at_trace_time``) counts as capturing one."""
    if not torch.is_grad_enabled():
        return False
    for t in inputs:  # a plain loop: this runs on every call (no generator to build)
        if t is not None and t.requires_grad:
            return True
    return score is not None and score.captures_grad_tensors()


def _problem(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Any,
    score_mod: Any,
    enable_gqa: bool,
    return_lse: bool,
    deterministic: bool | None,
    scale: float | None,
    traced: bool = False,
    kernel_options: tuple[tuple[str, Any], ...] | None = None,
    dropout_p: float = 0.0,
    scan: bool = True,
) -> tuple[Problem, Any]:
    """The problem of a call, and the caller's BlockMask if it gave one. ``scan``: read whether
    q/k/v hold NaN/inf (CPU only, ``Problem.nonfinite``); False leaves ``nonfinite`` False, for a
    caller that scans only where the verdict can change the route (``attention``, with
    :func:`_finiteness_matters`)."""
    check_flag("enable_gqa", enable_gqa)
    check_flag("return_lse", return_lse)
    det = _resolve_deterministic(deterministic)
    shape = check_qkv(q, k, v, enable_gqa=enable_gqa)
    if traced:
        shape = _model_sizes_static(shape)
    check_device(q)
    user_bm = mask if isinstance(mask, _compat.BlockMask) else None
    mask_spec = None if user_bm is not None else as_mask_spec(mask)
    score_spec = as_score_spec(score_mod)
    if user_bm is not None:
        _check_user_block_mask(user_bm, shape.batch, shape.heads, shape.q_len, shape.kv_len, q.device)
    for arg, spec in (("mask", mask_spec), ("score_mod", score_spec)):
        if spec is not None:
            if not traced:  # listing a callable's tensors walks its closure, which Dynamo cannot
                check_learned_devices(arg, spec, q.device)  # first: validate reads tensor values
            spec.validate(shape.q_len, shape.kv_len, shape.batch, shape.heads)
    requires_grad = needs_grad((q, k, v), score_spec)
    nonfinite = inputs_nonfinite(q, k, v) if scan else False
    problem = Problem(
        batch=shape.batch,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        q_len=shape.q_len,
        kv_len=shape.kv_len,
        head_dim=shape.head_dim,
        v_dim=shape.v_dim,
        dtype=q.dtype,
        device_type=q.device.type,
        arch=detect_arch(q.device),
        requires_grad=requires_grad,
        mask=mask_spec,
        score=score_spec,
        # Activation attention runs through the route's lse (Backend.execute rescales by it).
        return_lse=return_lse or (score_spec is not None and score_spec.is_activation()),
        user_block_mask=user_bm is not None,
        deterministic=det,
        nonfinite=nonfinite,
        index_extent=max(_extent(t) for t in (q, k, v)),
        nonpositive_scale=scale is not None and scale <= 0,
        kernel_options=kernel_options,
        dropout_p=dropout_p,
        func_transform=not traced and _compat.under_func_transform(),
    )
    return problem, user_bm


def _model_sizes_static(shape: Shape) -> Shape:
    """``shape`` with the sizes that are constants of a model -- heads, kv heads, head dims --
    specialized while ``torch.compile`` traces (``_compat.static_int``: Dynamo guards on them).
    Batch and lengths stay as traced, symbolic under dynamic shapes: routes read them only
    through comparisons (guards) and tensor ops. Kernels take head counts and dims as Python
    values (``enable_gqa``, the default scale ``1/sqrt(D)``), and a model never varies them.
    (Dynamo gives sizes equal at the first trace one symbol: a batch equal to a head count is
    specialized with it, and a later batch recompiles once.)"""
    s = _compat.static_int
    return dataclasses.replace(
        shape,
        heads=s(shape.heads),
        kv_heads=s(shape.kv_heads),
        head_dim=s(shape.head_dim),
        v_dim=s(shape.v_dim),
    )


def _extent(t: torch.Tensor) -> int:
    """Largest element offset + 1 reachable through ``t``'s sizes and strides (0 if empty)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True))


_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)


def _under_autocast(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as SDPA sees them under ``torch.autocast``: floating inputs (not float64) in the
    autocast dtype of their device type. SDPA is on autocast's lower-precision list on CPU and
    CUDA, so every route, and the plan and its cache key, see the dtype the kernel computes in."""
    if not _compat.any_autocast_enabled() or not isinstance(q, torch.Tensor):
        return q, k, v  # (not a tensor: validation names the bad argument)
    device_type = q.device.type
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return q, k, v
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t: torch.Tensor) -> torch.Tensor:
        eligible = isinstance(t, torch.Tensor) and t.dtype in _AUTOCAST_ELIGIBLE
        return t.to(dtype) if eligible and t.dtype != dtype else t

    return cast(q), cast(k), cast(v)


def _call_args(
    mask: Any, score_mod: Any, is_causal: Any, kernel_options: Any, dropout_p: Any
) -> tuple[Any, Any, tuple[tuple[str, Any], ...] | None, float]:
    """``(mask, score_mod, kernel_options, dropout_p)`` of a call, coerced and checked: tensors
    as specs, ``is_causal`` folded into the mask (``plan`` and ``attention`` alike)."""
    if (
        is_causal is False
        and kernel_options is None
        and (dropout_p is None or (type(dropout_p) is float and dropout_p == 0.0))
        and not isinstance(mask, torch.Tensor)
        and not isinstance(score_mod, torch.Tensor)
    ):
        return mask, score_mod, None, 0.0  # nothing to coerce or check (most calls; host time)
    mask, score_mod = tensor_args(mask, score_mod)
    mask = with_causal(mask, is_causal)
    return mask, score_mod, check_kernel_options(kernel_options), check_dropout_p(dropout_p)


def _live(arg: Any) -> Any:
    """A spec argument with the current state of any raw callable in it (``Spec.live``): a spec
    wrapping a callable (e.g. ``fz.Attention(mask=fn)``) keys every cache by the versions of the
    tensors the callable captured when the spec was built. A raw callable is wrapped fresh later."""
    return arg.live() if isinstance(arg, Spec) else arg


def _tune_on(tune: Any, backend: str, options: Any, dropout: float, context_parallel: bool) -> bool:
    """Whether ``auto`` may take a measured choice for this call. Not under context_parallel (the
    route must be one it reroutes), nor with kernel_options (the measurements are of the routes'
    own options), nor with dropout (timing would draw from the caller's random generator,
    shifting its seeded stream); named routes are never replaced."""
    return bool(
        tuning.resolve(tune)
        and backend == "auto"
        and not context_parallel
        and options is None
        and dropout == 0
    )


def plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Any = None,
    score_mod: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    backend: str = "auto",
    return_lse: bool = False,
    deterministic: bool | None = None,
    tune: bool | None = None,
    is_causal: bool = False,
    kernel_options: dict[str, Any] | None = None,
    layout: str = "bhsd",
    dropout_p: float | None = None,
) -> Plan:
    """Which route ``attention`` would take with these arguments, and why. Runs nothing.

    The arguments are ``attention``'s. With tuning on (``tune``, as for ``attention``) the plan
    takes the measured winner where the table holds one; it never measures (the first tuned
    ``attention`` call does). ``layout="bshd"`` plans the ``[B, H, L, D]`` views that
    ``attention`` runs (``transpose(1, 2)``, no copy): the plan's ``problem`` is the same for
    ``plan(q, k, v, layout="bshd")`` and ``plan(q.transpose(1, 2), ..., layout="bhsd")``.
    For DTensor inputs: the plan of this rank's local call (see :mod:`flexattn_zoo.sharding`).
    Called eagerly, it plans an eager call: inside a compiled graph ``attention`` may refuse a
    route this plan takes (e.g. a deterministic FlashAttention-2 backward without torch's
    deterministic mode on; the refusal says why).
    """
    q, k, v = as_bhsd(q, k, v, layout)
    mask, score_mod, options, dropout = _call_args(mask, score_mod, is_causal, kernel_options, dropout_p)
    if sharding.holds_dtensor(q, k, v):
        local = sharding.localize(q, k, v, enable_gqa=check_flag("enable_gqa", enable_gqa))
        mask, score_mod = sharding.rebase(local, mask, score_mod)
        q, k, v = local.q, local.k, local.v
    q, k, v = _under_autocast(q, k, v)
    mask, score_mod = _live(mask), _live(score_mod)
    problem, _ = _problem(
        q, k, v, mask, score_mod, enable_gqa, return_lse, deterministic, check_scale(scale),
        kernel_options=options, dropout_p=dropout,
    )  # fmt: skip
    context_parallel = sharding.context_parallel_active()
    tune_on = _tune_on(tune, backend, options, dropout, context_parallel)
    if tune_on:
        tuning.ensure_loaded(q.device)
    chosen = plan_problem(problem, backend, tune=tune_on, device=q.device)
    return _under_context_parallel(chosen) if context_parallel else chosen


def _empty_result(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: Problem
) -> tuple[torch.Tensor, torch.Tensor]:
    """B == 0, Lq == 0 or Lkv == 0: output zeros (lse -inf), still connected to the inputs' graph."""
    link = (q.narrow(2, 0, 0).sum() + k.narrow(2, 0, 0).sum() + v.narrow(2, 0, 0).sum()) * 0
    assert p.v_dim is not None  # Problem.__post_init__ fills it in
    out = q.new_zeros(p.batch, p.heads, p.q_len, p.v_dim) + link
    lse = torch.full(
        (p.batch, p.heads, p.q_len), float("-inf"), device=q.device, dtype=api_lse_dtype(q.dtype)
    )
    return out, lse


@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Any = ...,
    score_mod: Any = ...,
    scale: float | None = ...,
    enable_gqa: bool = ...,
    backend: str = ...,
    return_lse: Literal[False] = ...,
    deterministic: bool | None = ...,
    tune: bool | None = ...,
    is_causal: bool = ...,
    kernel_options: dict[str, Any] | None = ...,
    layout: str = ...,
    dropout_p: float | None = ...,
) -> torch.Tensor: ...
@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Any = ...,
    score_mod: Any = ...,
    scale: float | None = ...,
    enable_gqa: bool = ...,
    backend: str = ...,
    return_lse: Literal[True],
    deterministic: bool | None = ...,
    tune: bool | None = ...,
    is_causal: bool = ...,
    kernel_options: dict[str, Any] | None = ...,
    layout: str = ...,
    dropout_p: float | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Any = ...,
    score_mod: Any = ...,
    scale: float | None = ...,
    enable_gqa: bool = ...,
    backend: str = ...,
    return_lse: bool = ...,
    deterministic: bool | None = ...,
    tune: bool | None = ...,
    is_causal: bool = ...,
    kernel_options: dict[str, Any] | None = ...,
    layout: str = ...,
    dropout_p: float | None = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Any = None,
    score_mod: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    backend: str = "auto",
    return_lse: bool = False,
    deterministic: bool | None = None,
    tune: bool | None = None,
    is_causal: bool = False,
    kernel_options: dict[str, Any] | None = None,
    layout: str = "bhsd",
    dropout_p: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q, k, v`` (layout ``[B, H, L, D]``) on the fastest exact route.

    Any strides work (transposed, sliced, expanded): a route copies an input only where its kernel
    needs another layout.

    Args:
        mask: a mask spec, registry name, ``mask_mod`` callable or a ``BlockMask``; or, as SDPA's
            ``attn_mask``, a bool tensor (True = attend; ``masks.Dense``) or a floating tensor,
            added to the scaled scores (``score_mods.Bias``; refused beside a ``score_mod``),
            ``[Lq, Lkv]`` or broadcastable 4-D ``[B|1, H|1, Lq|1, Lkv|1]``.
        score_mod: a score spec, registry name or ``score_mod`` callable (sees the scaled score),
            or a floating tensor added to the scaled scores (``score_mods.Bias``).
        scale: a finite real number; defaults to ``1/sqrt(D)``.
        enable_gqa: allow fewer k/v heads than q heads (q head h reads kv head h // group).
        backend: ``"auto"`` or a route name (see ``fz.plan(...).explain()``); a named route never
            falls back, it raises ``ValueError`` with its reasons.
        return_lse: also return the natural-log log-sum-exp ``[B, H, Lq]`` (float32; float64 for
            float64 inputs).
        deterministic: ``True`` takes only routes whose forward and backward are bitwise
            reproducible run to run (same inputs, shapes, machine and torch), and runs FA2 /
            memory-efficient backwards under torch's deterministic mode; routes that cannot
            promise it refuse with the reason. ``None`` (default) follows
            ``torch.use_deterministic_algorithms`` (non-warn-only); ``False`` does not ask.
        tune: measured route choice for ``backend="auto"`` (docs/tuning.md): ``True`` times the
            routes that accept the call on its first eager call of a signature (on clones of the
            inputs) and takes the fastest from then on, ``False`` keeps the static order, ``None``
            (default) follows ``fz.tune.enable()`` / ``disable()`` / ``FLEXATTN_ZOO_TUNE``. Every
            route it can pick is exact; while traced or captured it only reads measurements.
        is_causal: SDPA's flag: ``True`` adds ``masks.Causal()`` (top-left aligned: key ``j`` visible
            to query ``i`` iff ``j <= i``, also when Lq != Lkv), ANDed with ``mask`` when one is
            given (``mask & Causal()``; refused with a ``BlockMask``). Unlike SDPA, a mask tensor
            and ``is_causal`` may be given together.
        kernel_options: flex_attention's ``kernel_options`` (a dict of str to bool/int/float/str),
            passed to the flex routes over their measured defaults. Given, only the flex routes
            accept the call: every other route refuses it (so ``auto`` picks among the flex
            routes, and raises when none can run it), measured route choice is off, and a named
            non-flex route raises with the reason.
        layout: ``"bhsd"`` (default: ``[B, H, L, D]``, SDPA's and flex's) or ``"bshd"``
            (``[B, L, H, D]``, FlashAttention's and projections'): q, k, v are viewed as
            ``[B, H, L, D]`` with ``transpose(1, 2)`` (no copy) and ``out`` is returned in the same
            layout (a view of the route's output); ``lse`` stays ``[B, H, Lq]``. Masks and score
            mods see ``[B, H, Lq, Lkv]`` indices either way.
        dropout_p: SDPA's: a float in ``[0, 1)`` (None, the default, is 0.0: no float default for
            ``torch.compile`` to make symbolic under dynamic shapes); above 0 each attention probability is zeroed with
            that probability (drawn from torch's default generator of q's device: seed it with
            ``torch.manual_seed`` for reproducible runs) and the kept ones are scaled by
            ``1 / (1 - dropout_p)``; the lse is that of the undropped scores. Applied whenever it
            is above 0, as in SDPA: pass 0.0 in evaluation (``fz.Attention`` does so itself when
            not training). Only routes whose kernels drop accept it (``dense``, ``sdpa_math``;
            on CUDA also ``sdpa``, ``sdpa_cudnn``, ``sdpa_flash``, ``sdpa_efficient``); the others
            refuse with "no dropout in this kernel". Measured route choice is off for such calls
            (timing would draw from the generator). 0.0 (default) changes nothing.

    Returns:
        ``out`` with q's dtype (under ``torch.autocast``: the autocast dtype, as SDPA), or ``(out, lse)``. Rows that see no key give 0 and lse -inf.

    Empty inputs, as SDPA: a batch of 0 (``B = 0``, a dynamic-batching server's empty step) or
    empty sequences (``Lq = 0`` or ``Lkv = 0``) run no kernel; ``out`` is ``[B, H, Lq, Dv]``
    (zeros where ``Lkv = 0``), the lse ``[B, H, Lq]`` (-inf), connected to the inputs' graph
    (their gradients are zeros of their shapes). Masks and score mods are still checked against
    the shapes, and a named ``backend`` must still accept the problem. Heads and head dims must
    be positive.

    Non-finite inputs: NaN/inf are not checked on CUDA (that would cost a device sync per call);
    a NaN in query row ``i``, or in a key or value that row ``i`` sees, puts NaN in output row
    ``i`` on every route, as in SDPA (a value's NaN reaches only its own column). Rows that do
    not see it may come out NaN too (dense routes multiply masked probabilities, which are 0, by
    the values: 0 * NaN = NaN), so never rely on them. ``+inf`` scores give NaN rows; ``-inf``
    scores just hide that key. On the CPU the check needs no sync, and ``flex_cpu`` (whose kernel
    drops NaN silently) refuses non-finite inputs; a call is checked only where that can change
    its route (``flex_cpu`` named, or reached in ``auto``'s order).

    Distributed: DTensors sharded by batch (``Shard(0)``) or heads (``Shard(1)``) run on each
    rank's local shard, with specs seeing global indices, and give DTensors; sequence sharding is
    refused, and under torch's ``context_parallel`` only the SDPA routes it reroutes run
    (:mod:`flexattn_zoo.sharding`, docs/distributed.md).
    """
    if layout != "bhsd":
        return _bshd_attention(
            q, k, v, layout, mask=mask, score_mod=score_mod, scale=scale, enable_gqa=enable_gqa,
            backend=backend, return_lse=return_lse, deterministic=deterministic, tune=tune,
            is_causal=is_causal, kernel_options=kernel_options, dropout_p=dropout_p,
        )  # fmt: skip
    mask, score_mod, options, dropout = _call_args(mask, score_mod, is_causal, kernel_options, dropout_p)
    if sharding.holds_dtensor(q, k, v):
        local = sharding.localize(q, k, v, enable_gqa=check_flag("enable_gqa", enable_gqa))
        mask, score_mod = sharding.rebase(local, mask, score_mod)
        result = attention(
            local.q,
            local.k,
            local.v,
            mask=mask,
            score_mod=score_mod,
            scale=scale,
            enable_gqa=enable_gqa,
            backend=backend,
            return_lse=return_lse,
            deterministic=deterministic,
            tune=tune,
            kernel_options=kernel_options,
            dropout_p=dropout,
        )
        return local.to_global(result)
    if _compat.is_compiling():
        scale_checked = check_traced_scale(scale)  # a float Dynamo made symbolic is checked too
        q, k, v = _under_autocast(q, k, v)
        return _traced_attention(
            q, k, v, mask, score_mod, scale_checked, enable_gqa, backend, return_lse, deterministic, tune,
            options, dropout,
        )  # fmt: skip
    scale_checked = check_scale(scale)
    q, k, v = _under_autocast(q, k, v)
    mask, score_mod = _live(mask), _live(score_mod)
    # A non-bool ``deterministic`` skips the cache: the full path names the error. So does a call
    # under context_parallel, whose route choice is narrower (and must not be cached for others).
    det = (
        _resolve_deterministic(deterministic)
        if deterministic is None or type(deterministic) is bool
        else None
    )
    context_parallel = sharding.context_parallel_active()
    key = (
        None
        if det is None or context_parallel
        else call_key(
            q, k, v, mask, score_mod, enable_gqa, return_lse, det, backend, scale_checked, tune, options,
            dropout,
        )
    )  # fmt: skip
    hit = plan_cache.lookup(key, q, k, v) if key is not None else None
    if hit is plan_cache.UNHASHABLE:  # an unhashable mask/score argument: the full path says what is wrong
        key = hit = None
    if hit is not None:
        log.debug("flexattn_zoo route %s", hit.plan.backend)
        out, maybe_lse = hit.run(q, k, v, hit.scale if scale_checked is None else scale_checked)
        if not return_lse:
            return out
        return out, maybe_lse
    tune_on = _tune_on(tune, backend, options, dropout, context_parallel)
    # Measured choice times the routes that accept the problem, so it must know the verdict
    # first; otherwise the inputs are scanned only where it can change the route.
    problem, user_bm = _problem(
        q, k, v, mask, score_mod, enable_gqa, return_lse, deterministic, scale_checked,
        kernel_options=options, dropout_p=dropout, scan=tune_on,
    )  # fmt: skip
    if problem.batch == 0 or problem.q_len == 0 or problem.kv_len == 0:
        if backend != "auto":
            plan_problem(problem, backend)  # a named route must still be able to serve the call
        out, lse = _empty_result(q, k, v, problem)
        return (out, lse) if return_lse else out
    state = tuning.state()
    if tune_on:
        tuning.ensure_loaded(q.device)
    chosen = plan_problem(problem, backend, tune=tune_on, device=q.device, lazy=True)
    finiteness_matters = None if tune_on else _finiteness_matters(chosen, q.device)
    if finiteness_matters and inputs_nonfinite(q, k, v):
        # A route that refuses NaN/inf (and only such a route) came at or before the chosen one.
        problem = dataclasses.replace(problem, nonfinite=True)
        chosen = plan_problem(problem, backend, device=q.device, lazy=True)
    if tuning.needs_measuring(chosen.tuning) and tuning.can_measure(q):
        chosen = _measured(chosen, q, k, v, scale_checked, user_bm)
    if context_parallel:
        chosen = _under_context_parallel(chosen)
    if key is not None and tuning.state() != state:  # the table changed: key the plan anew
        key = call_key(
            q, k, v, mask, score_mod, enable_gqa, return_lse, det, backend, scale_checked, tune, options,
            dropout,
        )  # fmt: skip
    # A plan still waiting for its measurement (this call could not take it: a CUDA graph was
    # being captured) is not kept, so the next eager call measures.
    log.debug("flexattn_zoo route %s", chosen.backend)
    if key is not None and not tuning.needs_measuring(chosen.tuning):
        # This call already runs the bound call its later hits run (the route is bound once, and
        # what the bound call keeps from its first call is kept from this one).
        bound = BoundPlan.of(chosen, q.device)
        if finiteness_matters is None:  # measured choice: its plan may differ from the static one
            finiteness_matters = _finiteness_matters(chosen, q.device)
        plan_cache.store(key, bound, finiteness_matters)
        out, maybe_lse = bound.run(q, k, v, bound.scale if scale_checked is None else scale_checked)
    else:
        out, maybe_lse = execute_plan(chosen, q, k, v, scale=scale_checked, block_mask=user_bm)
    if not return_lse:
        return out
    assert maybe_lse is not None  # the problem asked for it: routes without an lse refused it
    return out, maybe_lse


#: The values of ``layout=`` (``attention``, ``plan``, ``fz.Attention``).
LAYOUTS = ("bhsd", "bshd")


def check_backend(backend: Any) -> str:
    """``backend`` if it is ``"auto"`` or a route's name; TypeError for a non-str, ValueError
    naming the valid routes for an unknown name."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    if backend != "auto" and backend not in BY_NAME:
        raise ValueError(f"unknown backend {backend!r}; valid: auto, {', '.join(BY_NAME)}")
    return backend


def check_layout(layout: Any) -> str:
    """``layout`` if it is one of :data:`LAYOUTS`, else ``ValueError`` naming the choices."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return layout


def as_bhsd(q: Any, k: Any, v: Any, layout: Any) -> tuple[Any, Any, Any]:
    """``q, k, v`` of ``layout`` as ``[B, H, L, D]``: unchanged for ``"bhsd"``, ``transpose(1, 2)``
    views (no copy) of ``[B, L, H, D]`` tensors for ``"bshd"``; ``ValueError`` for another layout
    or a ``"bshd"`` input that is not a 4-D tensor."""
    if check_layout(layout) == "bhsd":
        return q, k, v
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor [B, L, H, D] for layout='bshd', got {got}")
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _bshd_attention(
    q: Any, k: Any, v: Any, layout: Any, **kwargs: Any
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``attention`` of ``[B, L, H, D]`` inputs: transposed views in, the output transposed back."""
    q, k, v = as_bhsd(q, k, v, layout)
    result = attention(q, k, v, **kwargs)
    if isinstance(result, tuple):
        return result[0].transpose(1, 2), result[1]
    return result.transpose(1, 2)


def _measured(
    chosen: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, block_mask: Any
) -> Plan:
    """Time ``chosen``'s candidates (``tuning.measure``, on clones of q/k/v), then plan again
    with the measurement in the table.

    Each route is timed as repeated calls will run it: through the bound call the plan cache
    keeps (``BoundPlan``), whose host time per call can be a fraction of the unbound path's
    (a flex route's BlockMask and compiled entry are looked up once there), so a route is not
    judged by host work its cached calls never do. A caller's BlockMask has no bound call: those
    calls time the route's full path, which is what they run."""
    info = chosen.tuning
    assert info is not None
    static = info.candidates[0]  # the static order's choice leads the candidates
    bound: dict[str, BoundPlan] = {}

    def run(name: str, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, Any]:
        route = dataclasses.replace(chosen, backend=name)
        if block_mask is not None:
            return execute_plan(route, a, b, c, scale=scale, block_mask=block_mask)
        if name not in bound:
            bound[name] = BoundPlan.of(route, a.device)
        call = bound[name]
        return call.run(a, b, c, call.scale if scale is None else scale)

    tuning.measure(info, static, run, q, k, v, chosen.problem)
    return plan_problem(chosen.problem, "auto", tune=True, device=q.device)


def _finiteness_matters(chosen: Plan, device: torch.device) -> bool:
    """Whether a call like ``chosen``'s, but whose q/k/v are (or are not) finite where these were
    not (were), could take another route or fail (CPU only: elsewhere the inputs are never
    scanned). Without measured choice, only where a route whose verdicts read the finiteness
    (``Backend.reads_finiteness``) is the named one or comes at or before the chosen one in
    ``auto``'s order: the routes before the chosen one refused, and only such a route's verdict
    can turn; with it, planned again with ``Problem.nonfinite`` flipped."""
    p = chosen.problem
    if p.device_type != "cpu":
        return False
    if chosen.tuning is None:
        if chosen.requested != "auto":
            return BY_NAME[chosen.requested].reads_finiteness
        order = _order(p)
        if chosen.backend in order:
            reached = order[: order.index(chosen.backend) + 1]
            return any(BY_NAME[name].reads_finiteness for name in reached)
    try:
        flipped = dataclasses.replace(p, nonfinite=not p.nonfinite)
        other = plan_problem(
            flipped, chosen.requested, tune=chosen.tuning is not None, device=device, lazy=True
        )
    except ValueError:
        return True
    return other.backend != chosen.backend


def _traced_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Any,
    score_mod: Any,
    scale: float | None,
    enable_gqa: bool,
    backend: str,
    return_lse: bool,
    deterministic: bool | None,
    tune: bool | None = None,
    kernel_options: tuple[tuple[str, Any], ...] | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``attention`` while ``torch.compile`` traces the caller: the same route choice, made as
    plain Python that Dynamo guards like any other decision (on shapes, dtypes, grad mode, the
    spec objects, the table of measured route choices when tuning is on: never timed here), with
    no cache, lock or log on the way, and the route's op put into the caller's graph. Nothing
    here reads tensor data (see ``Problem``: data-derived facts are unknown while tracing, and
    routes that need them refuse). Under dynamic shapes batch and
    lengths stay symbolic (a route decision on them is a guard), while model constants are
    specialized (``_model_sizes_static``; spec parameters: ``spec.static_int``)."""
    problem, user_bm = _problem(
        q, k, v, mask, score_mod, enable_gqa, return_lse, deterministic, scale, traced=True,
        kernel_options=kernel_options, dropout_p=dropout_p,
    )  # fmt: skip
    if problem.batch == 0 or problem.q_len == 0 or problem.kv_len == 0:
        if backend != "auto":
            plan_problem(problem, backend)
        out, lse = _empty_result(q, k, v, problem)
        return (out, lse) if return_lse else out
    context_parallel = sharding.context_parallel_active()
    tune_on = _tune_on(tune, backend, kernel_options, dropout_p, context_parallel)
    if tune_on:
        tuning.ensure_loaded(q.device)
    chosen = plan_problem(problem, backend, tune=tune_on, device=q.device)
    if context_parallel:
        chosen = _under_context_parallel(chosen)
    out, maybe_lse = execute_plan(chosen, q, k, v, scale=scale, block_mask=user_bm)
    if not return_lse:
        return out
    assert maybe_lse is not None
    return out, maybe_lse


def execute_plan(
    chosen: Plan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None,
    block_mask: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run a plan's route on inputs it was made for: ``(out, lse or None)``.

    ``scale`` must already be checked (``validation.check_scale``); None means ``1/sqrt(D)``.
    """
    scale_f = default_scale(chosen.problem) if scale is None else scale
    return BY_NAME[chosen.backend].execute(q, k, v, chosen.problem, scale=scale_f, block_mask=block_mask)


def default_scale(p: Problem) -> float:
    """The scale of a call that gives none: ``1/sqrt(D)`` of the q/k head dim."""
    return 1.0 / math.sqrt(p.head_dim)


class BoundPlan:
    """What the plan cache keeps for a call: the plan, and its route bound to the plan's problem
    (``Backend.bind``: the work that depends only on the problem done once), so a repeated call
    runs ``run(q, k, v, scale)`` straight away; ``scale`` is the default scale of the problem."""

    __slots__ = ("plan", "run", "scale")

    def __init__(self, plan: Plan, run: Any, scale: float) -> None:
        self.plan, self.run, self.scale = plan, run, scale

    @classmethod
    def of(cls, plan: Plan, device: torch.device) -> BoundPlan:
        return cls(plan, BY_NAME[plan.backend].bind(plan.problem, device), default_scale(plan.problem))
