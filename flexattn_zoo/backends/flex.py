"""FlexAttention routes: Triton (``flex``), FlashAttention-4 CuTe (``flex_flash``), CPU (``flex_cpu``).

Flex is exact for every spec: the BlockMask only skips blocks the spec proves invisible and
``mask_mod`` runs inside partial blocks. Each route compiles through :mod:`flexattn_zoo.compile`.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

from flexattn_zoo import _compat, arch
from flexattn_zoo.backends.base import (
    FLASH_CUTE,
    IN_GRAPH,
    LOW_PRECISION,
    Backend,
    BoundCall,
    flash_cute_lock,
    is_dense_block,
)
from flexattn_zoo.blockmask import BLOCK_MASK_PARTS, DEFAULT_BLOCK_SIZE, bound_mask_mod
from flexattn_zoo.blockmask import block_mask as build_block_mask
from flexattn_zoo.compile import CACHE, UnfusedFallbackError
from flexattn_zoo.functions import KERNEL_HAZARDS, LOADS_ONE_ELEMENT, _Ref, kernel_hazards
from flexattn_zoo.lru import LRUCache
from flexattn_zoo.problem import Problem
from flexattn_zoo.spec import graph_memo

#: torch's Triton flex-*decoding* template fails to compile (an int32/int64 type clash in its
#: 64-bit indexing) when an input spans this many elements or more; the main flex template runs
#: them (H200, torch 2.11: benchmarks/large_index_probe.py, results/large_index_probe_h200.txt).
#: The flex route then asks for the main kernel; ``fz.decode.decode_step`` instead splits the
#: batch of a contiguous cache, which keeps the faster decoding kernel.
MAX_FLEX_ELEMENTS = 2**31


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Kernel options measured faster than torch's defaults on one GPU generation, for 16-bit
    inputs with one of ``head_dims`` (other problems keep the defaults)."""

    generation: str  # an ``arch.generation`` key: "sm80", "sm86", "sm90", "sm100"
    head_dims: tuple[int, ...]
    options: tuple[tuple[str, int | bool], ...]

    def applies(self, p: Problem) -> bool:
        return (
            arch.generation(p.arch) == self.generation
            and p.dtype in LOW_PRECISION
            and p.head_dim in self.head_dims
        )


#: The Triton flex kernel's forward tiles, measured faster than torch's defaults on an H200
#: (causal, D=128, bf16); the backward keeps torch's autotuned defaults.
SM90_FORWARD_TILES = Tuning(
    "sm90", (128,), (("fwd_BLOCK_M", 128), ("fwd_BLOCK_N", 128), ("fwd_num_warps", 8), ("fwd_num_stages", 3))
)


def _loads_pairs(p: Problem) -> bool:
    """Whether ``p``'s mask or score mod reads a captured tensor per (query, key) pair
    (``Spec.loads_pairs``: a bias or mask table, a relative-position table, any user callable).
    Triton's flex kernel streams that value as a ``[BLOCK_M, BLOCK_N]``
    tile through shared memory beside K and V."""
    return any(s is not None and s.loads_pairs() for s in (p.mask, p.score))


#: Head dims up to which torch's default forward tiles may leave no room on sm90 for a pair-loaded
#: tile, and the pipeline depth that makes it fit: a table[kv - q] or bias[h, q, kv] score mod at
#: D=64 failed to compile on the H200 with torch's defaults ("out of resource: Required 245760,
#: Hardware limit 232448") and ran with 2 stages; Graphormer's table[pos[b, q, kv], h] compiled
#: with the defaults, which were faster there (forward 0.138 vs 0.150 ms at 1K, 2.226 vs 2.615 at
#: 4K); at D=128 the defaults fit (benchmarks/gathered_tile_probe.py). Eager calls therefore try
#: the defaults first and compile the shallower pipeline only when the defaults fail to compile
#: (``FlexCall.launch``); a traced call cannot catch its caller's compile error, so it takes the
#: shallow pipeline at once (or the smallest, :data:`PAIR_TILES_SMALLEST`). Positional gathers (``Spec.pair_gathers``: T5's bucketed table,
#: Sandwich's table[kv - q]) start on the shallow pipeline, up to :data:`PAIR_GATHER_SHALLOW_HEAD_DIM`:
#: T5's compiled with the defaults but ran about 1.9x slower at D=64 on the H200 and 2.3-2.4x
#: slower at D=128 on an H100 (1K and 4K, causal; Sandwich at D=128 1.00-1.12x), and Sandwich's
#: did not compile with them at D=64 (benchmarks/pair_load_probe.py).
PAIR_LOAD_SHALLOW_HEAD_DIM = 64
PAIR_GATHER_SHALLOW_HEAD_DIM = 128
PAIR_LOAD_STAGES = 2
#: The last forward pipeline an eager pair-loaded call on CUDA falls back to when neither torch's
#: defaults nor the shallow pipeline compile, and the one a traced call with several tiles per
#: pair takes at once (:data:`PAIR_TILES_SMALLEST`): one stage of 64 x 64 tiles (tiles that divide
#: the BlockMask's blocks; see ``_tiles_within``). Graphormer with an edge bias beside its
#: distances (two pair-loaded tiles: int32 indices and a float32 bias) needed 278528 bytes of
#: shared memory at D=64 with two stages on an H100 (limit 232448). Slower, but it compiles.
PAIR_LOAD_SMALLEST = (("fwd_num_stages", 1), ("fwd_BLOCK_M", 64), ("fwd_BLOCK_N", 64))


#: Below this share of visible pairs (``MaskSpec.visible_fraction``, an upper bound) torch's default
#: forward tiles beat the pinned ones: the blocks are mostly partial, where a narrower tile wastes
#: less of the mask_mod's work. H200, forward ms pinned / default, best of 4 interleaved rounds
#: (benchmarks/flex_options_probe.py, results/flex_options_probe_c_h200.txt): NATTEN 2-D 4K at 1.2%
#: visible 0.362 / 0.318, sliding tile 6400 at 2.2% 0.712 / 0.587; at 12.5% (sliding window 1024
#: of 8K) 0.521 / 0.530 and above it the pinned tiles win or tie (causal 1.468 / 1.523, document
#: & causal 0.737 / 0.788).
PINNED_TILES_MIN_VISIBLE = 1 / 16


def _default_tiles_faster(p: Problem) -> bool:
    """Problems whose forward runs faster on torch's default tiles than on the measured pinned ones:
    very sparse masks (:data:`PINNED_TILES_MIN_VISIBLE`), and activation attention
    (``ScoreSpec.is_activation``), whose score mod adds a log and an exp per score -- causal 8K
    with ``Sigmoid``: 3.922 ms pinned vs 3.652 default (same probe; a cheap score mod, soft-capping,
    keeps the pinned tiles ahead, 2.987 vs 3.073)."""
    if _decoding_kernel_chosen(p):
        return False  # measured for the main kernel; the decoding kernel keeps its tuned tiles
    if p.score is not None and p.score.is_activation():
        return True
    if p.mask is None or _compat.is_compiling():
        # Traced, lengths may be symbolic (Dynamo reports a SymInt as an int) and a share computed
        # from them would become a float guard: traced calls keep the measured tiles.
        return False
    return p.mask.visible_fraction(p.q_len, p.kv_len) < PINNED_TILES_MIN_VISIBLE


def _pair_gathers_only(p: Problem) -> bool:
    """Whether every per-pair read of ``p`` is a positional gather (``Spec.gathers_pairs_only``):
    then the shallow pipeline is the first choice, not a retry."""
    loading = [s for s in (p.mask, p.score) if s is not None and s.loads_pairs()]
    if not loading:
        return False
    # A loop, not all() over a generator: traced calls read this, and torch 2.11's Dynamo broke
    # the graph there ("Failed to trace builtin operator"; a raw mask_mod over captured ids).
    for spec in loading:
        if not spec.gathers_pairs_only():
            return False
    return True


#: Tiles read per (query, key) pair (``Spec.pair_tiles``) from which a traced call on sm90 at head
#: dims up to :data:`PAIR_LOAD_SHALLOW_HEAD_DIM` compiles :data:`PAIR_LOAD_SMALLEST` at once: it
#: cannot catch its caller's compile error and retry as an eager call does, and Graphormer's two
#: tiles did not fit two stages (its one-tile form, and a dense bias, fit them). Counted, not
#: weighed by element size: other two-tile combinations (a boolean mask table beside a bias) were
#: not measured and take the pipeline that compiles.
PAIR_TILES_SMALLEST = 2


def _traced_pair_pipeline(p: Problem) -> str:
    """The pair-load pipeline (``FlexBackend.options``' ``pair_loads``) a traced call compiles:
    ``"smallest"`` for :data:`PAIR_TILES_SMALLEST` or more tiles per pair that are not all
    positional gathers, at head dims up to :data:`PAIR_LOAD_SHALLOW_HEAD_DIM` on sm90; else
    ``"shallow"``, where it applies."""
    if (
        p.device_type != "cuda"
        or arch.generation(p.arch) != "sm90"
        or p.head_dim > PAIR_LOAD_SHALLOW_HEAD_DIM
        or _pair_gathers_only(p)
    ):
        return "shallow"
    tiles = 0
    for spec in (p.mask, p.score):  # a loop: traced calls read this (see _pair_gathers_only)
        if spec is not None:
            tiles += spec.pair_tiles()
    return "smallest" if tiles >= PAIR_TILES_SMALLEST else "shallow"


def _pair_load_options(p: Problem, pipeline: str = "shallow") -> dict[str, Any]:
    """The ``pipeline`` forward options of a pair-loaded problem: ``"shallow"``, where it applies
    (see :data:`PAIR_LOAD_SHALLOW_HEAD_DIM`), else no option; ``"smallest"``,
    :data:`PAIR_LOAD_SMALLEST` on CUDA (a last retry: shared memory is a GPU's limit)."""
    if pipeline == "smallest":
        return dict(PAIR_LOAD_SMALLEST) if p.device_type == "cuda" else {}
    limit = PAIR_GATHER_SHALLOW_HEAD_DIM if _pair_gathers_only(p) else PAIR_LOAD_SHALLOW_HEAD_DIM
    if arch.generation(p.arch) == "sm90" and p.head_dim <= limit:
        return {"fwd_num_stages": PAIR_LOAD_STAGES}
    return {}


def _mask_captures_grad_tensors(mask: Any) -> bool:
    """Whether ``mask`` (a spec) captures a tensor that requires grad. Not asked while traced:
    walking a callable's closure there trips Dynamo (a function made inside the graph shows it no
    cells), and HF's in-graph mask functions must keep their flex route; flex itself names the
    problem in a traced call."""
    if _compat.is_compiling():
        return False
    return any(t.requires_grad for t in mask.tensors())


@dataclasses.dataclass(frozen=True)
class FlexBackend(Backend):
    """flex_attention compiled with fixed ``kernel_options``, plus measured ones per generation."""

    kernel_options: tuple[tuple[str, Any], ...] = ()
    fast_score_mods: bool = False  # use score mods' GPU fast variants (e.g. approx tanh)
    #: Run the kernel on detached views of inputs that require grad: for a route without a
    #: backward (its reasons refuse calls that need one) whose kernel refuses such inputs anyway.
    detaches_inputs: bool = False
    #: Measured per-generation kernel options (the first that applies to a problem is used).
    tuning: tuple[Tuning, ...] = ()
    #: For a kernel wrong at small head dims (:data:`CPU_FLEX_MIN_HEAD_DIM`): q/k/v whose head
    #: dim is below this width reach the kernel padded with zeros to it, and the output is cut
    #: back to v's head dim (the lse needs no cut). Exact, whatever the scale. None: no padding.
    pad_head_dims_to: int | None = None
    #: Run a mask spelled with per-query key starts where it has such a spelling
    #: (``MaskSpec.starts_mask_mod``: ``Document & Causal`` as ``start[q] <= kv <= q``, one lookup
    #: per query instead of a label lookup per query and per key; ``PerDocument``,
    #: ``SharedPrefix``). Faster on Triton flex (H200, bf16, 4x16x8192 documents & causal: +18%
    #: forward / +6% forward+backward at D=64, +6% / +1% at D=128); slower on FA4's CuTe kernel
    #: (forward -21%), so only the Triton route asks.
    spells_key_starts: bool = False
    #: The compiled flex kernel this route runs (``"cuda"``: Triton; ``"cpu"``; ``"flash"``: FA4's
    #: CuTe kernel), for the user functions it refuses (``functions.kernel_hazards``).
    hazard_kernel: str = "cuda"

    def func_transform_blocker(self, p: Problem) -> str | None:
        # Eagerly, flex_attention runs compiled (flexattn_zoo.compile).
        return "its kernel is a torch.compile'd function (pytorch/pytorch#128711)"

    def mask_reasons(self, p: Problem) -> list[str]:
        if p.mask is not None and _mask_captures_grad_tensors(p.mask):
            # flex_attention asserts on it while tracing ("Captured buffers from mask mod that
            # require grad are not supported"); the mask passes no gradient anyway.
            return ["flex cannot take a mask_mod that captures tensors requiring grad (capture t.detach())"]
        # What this route's compiled kernel cannot lower or runs out of bounds in the call's user
        # functions (functions.kernel_hazards: measured without the library,
        # benchmarks/flex_mod_hazards_probe.py). dense evaluates them exactly where it fits.
        kernel = "CPU flex kernel" if self.hazard_kernel == "cpu" else "flex kernel"
        hazards = kernel_hazards((p.mask, p.score), self.hazard_kernel)
        if (
            LOADS_ONE_ELEMENT in KERNEL_HAZARDS[self.hazard_kernel]
            and LOADS_ONE_ELEMENT not in hazards
            and _declares_one_element_load(p)
        ):
            hazards += (LOADS_ONE_ELEMENT,)
        return [f"torch's compiled {kernel} cannot run a mod that {hazard}" for hazard in hazards]

    def sparse_block_size(self, p: Problem) -> tuple[int, int]:
        """The ``(q, kv)`` block size of the BlockMasks this route builds for ``p``."""
        return DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE

    def tuned_options(self, p: Problem) -> dict[str, Any]:
        """The measured kernel options for ``p``'s generation, head dim and dtype, or {} (defaults)."""
        return next((dict(t.options) for t in self.tuning if t.applies(p)), {})

    def kernel_options_reasons(self, p: Problem) -> list[str]:
        fixed = dict(self.kernel_options)
        clash = [f"{k}={v!r}" for k, v in p.kernel_options or () if k in fixed and fixed[k] != v]
        if clash:
            return [f"kernel_options {', '.join(clash)} conflict with this route's own {fixed}"]
        return []

    def pad_width(self, p: Problem) -> int | None:
        """The width :attr:`pad_head_dims_to` that ``p``'s q/k/v are padded to, or None where no
        head dim of ``p`` is below it (or the route pads none)."""
        width = self.pad_head_dims_to
        if width is None or min(p.head_dim, p.head_dim if p.v_dim is None else p.v_dim) >= width:
            return None
        return width

    def options(
        self, p: Problem, block_mask: Any = None, *, pair_loads: str = "shallow"
    ) -> dict[str, Any] | None:
        """The kernel_options this route passes to flex_attention for ``p`` (and its BlockMask):
        the route's fixed ones, then the measured ones, then the caller's (``p.kernel_options``,
        which may not contradict the fixed ones: ``kernel_options_reasons``).
        ``pair_loads``: the forward pipeline of a problem with a pair-loaded tile: ``"shallow"``
        where torch's defaults may leave it no room (:data:`PAIR_LOAD_SHALLOW_HEAD_DIM`),
        ``"default"`` torch's own, ``"smallest"`` :data:`PAIR_LOAD_SMALLEST` on CUDA; an eager
        caller tries them in the order :meth:`_prepare` sets, each only when the ones before it
        failed to compile."""
        opts = dict(self.kernel_options)
        if not _loads_pairs(p):
            tuned = self.tuned_options(p)
            if tuned and not _default_tiles_faster(p):
                opts.update(_tiles_within(tuned, block_mask))
        elif (
            pair_loads != "default"
            and opts.get("BACKEND", "TRITON") == "TRITON"
            and not any(name.startswith("fwd_") for name in opts)
        ):
            # The measured tiles (pinned: one Triton config) have no room left for a pair-loaded
            # tile (a captured table under transformers' packed-sequence mask needed 233472 bytes
            # of the H200's 232448); torch's defaults do where they fit, shallower pipelines
            # where they do not.
            opts.update(_tiles_within(_pair_load_options(p, pair_loads), block_mask))
        opts.update(p.kernel_options or ())
        if "BACKEND" not in opts and _decoding_kernel_chosen(p):
            if _decode_kernel_has_no_config(p, block_mask) or p.index_extent >= MAX_FLEX_ELEMENTS:
                opts["BACKEND"] = "TRITON"
            else:
                # The decoding kernel reads fwd_* options too, and a forward BLOCK_M (128 query
                # rows) replaces its own (the Lq * Hq/Hkv rows it packs, >= 16): measured on the
                # H200, decoding 16K x 64 rows then took 1.65 ms instead of 0.96 ms. Its BLOCK_N,
                # warps and stages keep the forward's tuned values (also the best decode variants
                # in benchmarks/decode_tuning.py at D=128).
                opts.pop("fwd_BLOCK_M", None)
        return opts or None

    def run(self, q, k, v, p, *, scale, block_mask=None):
        if _compat.is_compiling():
            if self.detaches_inputs:  # eager launches detach in FlexCall.launch
                q, k, v = q.detach(), k.detach(), v.detach()
            if _compat.FLEX_CPU_NEEDS_DISTINCT_INPUTS and q.device.type == "cpu":
                # Inside a graph the refusal is about buffers: q, k, v as views of one projection
                # (a fused qkv Linear) are one buffer to Inductor. Copies make three.
                q, k, v = q.clone(), k.clone(), v.clone()
            return self._run_traced(q, k, v, p, scale=scale, block_mask=block_mask)
        return self.prepared(p, q.device, block_mask).launch(q, k, v, scale, block_mask)

    def eager_bound_run(self, p: Problem, device: torch.device) -> BoundCall:
        return self.bound_run(p, device, eager=True)

    def bound_run(self, p: Problem, device: torch.device, *, eager: bool = False) -> BoundCall:
        """``run`` for ``p``; ``eager``: a plan-cache bound call (never traced, and its key pins
        q/k/v's shapes, strides and grad flags), which runs its compiled code directly from its
        second call on (``FlexCall.launch``'s ``ran``)."""
        # A prepared call with a BlockMask is held weakly: CALLS alone keeps those (and their
        # BlockMasks) alive, so its bound stays the memory bound however many plans are cached
        # (a training loop with new document ids per step makes a plan per step). Once CALLS
        # dropped it, the next launch prepares it again (the BlockMask cache first). One without
        # a BlockMask (no mask: decoding, full attention) holds nothing CALLS must bound, so the
        # plan keeps it: calls cycling over more shapes than CALLS holds (decoding over a set of
        # cache lengths) would otherwise prepare again on every call.
        prepared = self.prepared(p, device)
        ran: list[Any] | None = [None] if eager else None
        if prepared.block_mask is None:
            held = prepared

            def launch_held(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Any:
                return held.launch(q, k, v, scale, None, ran)

            return launch_held
        ref = weakref.ref(prepared)
        del prepared

        def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Any:
            nonlocal ref
            call = ref()
            if call is None:
                call = self.prepared(p, device)
                ref = weakref.ref(call)
            return call.launch(q, k, v, scale, None, ran)

        return launch

    def prepared(self, p: Problem, device: torch.device, block_mask: Any = None) -> FlexCall:
        """What :meth:`run` builds for ``p`` before launching (cached in :data:`CALLS`).

        For a caller's BlockMask (decode_step's, updated in place each step) the entry keeps none
        of its tensors: what ``_prepare`` reads from it is its mask_mod (by identity, held weakly)
        and block size, and :meth:`FlexCall.launch` runs the mask it is given.
        """
        if block_mask is None:
            key: tuple[Any, ...] = (self.name, p, device)
        else:
            key = (self.name, p, device, _Ref(block_mask.mask_mod), tuple(block_mask.BLOCK_SIZE))
        call = CALLS.get(key)
        if call is None:
            call = self._prepare(p, device, block_mask)
            if block_mask is not None:
                call = dataclasses.replace(call, block_mask=None)
            call = CALLS.put(key, call)
        return call

    def caller_mask_call(self, p: Problem, device: torch.device, block_mask: Any) -> FlexCall | None:
        """:meth:`prepared` for a caller's BlockMask, for a caller that launches it itself on
        every call with that BlockMask's mask_mod and block size (``fz.decode``: one lookup less
        per step); None where :meth:`run` must be called instead: a route that wraps it (a lock,
        detached inputs) does its part there, which a direct launch would skip."""
        if type(self).run is not FlexBackend.run:
            return None
        return self.prepared(p, device, block_mask)

    def _run_traced(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: Problem, *, scale: float, block_mask: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The call inside a caller's ``torch.compile``: flex_attention itself (its higher-order
        op lands in the caller's graph, compiled with it) and, for a spec, its BlockMask built
        in the graph by the same closed-form or block-by-block builders as eagerly (a spec's
        tensors, e.g. document ids, are graph inputs, so new values each step reuse the
        compiled graph). Head dims below :attr:`pad_head_dims_to` are padded here, as
        :meth:`FlexCall.launch` pads them eagerly."""
        width = self.pad_width(p)
        v_dim = v.shape[-1]
        if width is not None:
            q, k, v = _pad_head_dims(q, k, v, width)
        mask, score = p.mask, p.score
        if q.device.type == "cpu":
            mask = None if mask is None else mask.map_tensors(_cpu_flex_capture)
            score = None if score is None else score.map_tensors(_cpu_flex_capture)
        if block_mask is None and mask is not None:
            # The eager builders, traced into the graph, their block ordering one opaque op
            # (blockmask.block_order: fused with this kernel it gave wrong rows on CUDA); on the
            # CPU, torch's create_block_mask hit an Inductor C++ codegen error where these do not.
            block_mask = _traced_block_mask(p, mask, q.device, self.sparse_block_size(p))
        score_mod = None
        if score is not None:
            past = mask is not None and mask.hides_future_keys(p.q_len, p.kv_len)
            score_mod = score.to(q.device).score_mod(fast=self.fast_score_mods, future_keys_hidden=past)
        out = _compat.flex_attention(
            q,
            k,
            v,
            score_mod=score_mod,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=p.gqa,
            kernel_options=self.options(p, block_mask, pair_loads=_traced_pair_pipeline(p)),  # type: ignore[arg-type]  # see compile._template
            **_compat.flex_aux_request(p.return_lse),
        )
        result = _compat.unpack_flex_output(out, p.return_lse)
        return result if width is None else _cut(result, v_dim)

    def _prepare(self, p: Problem, device: torch.device, block_mask: Any) -> FlexCall:
        if block_mask is None and p.mask is not None:
            block_mask = build_block_mask(
                p.mask,
                p.q_len,
                p.kv_len,
                batch=p.batch,
                heads=p.heads,
                device=device,
                block_size=self.sparse_block_size(p),
                key_starts=self.spells_key_starts,
            )
        score_mod = None
        if p.score is not None:
            # A mask that hides every kv_idx > q_idx lets score mods skip work there (ALiBi's abs).
            past = p.mask is not None and p.mask.hides_future_keys(p.q_len, p.kv_len)
            score_mod = p.score.to(device).score_mod(fast=self.fast_score_mods, future_keys_hidden=past)

        def keyed(options: dict[str, Any] | None) -> tuple[Any, dict[str, Any] | None]:
            key = CACHE.key(
                block_mask.mask_mod if block_mask is not None else None,
                score_mod,
                options,
                p.return_lse,
                p.gqa,
                (p.heads, p.kv_heads, p.head_dim, p.v_dim, p.dtype),
                _block_size(block_mask),
            )
            return key, options

        options = self.options(p, block_mask, pair_loads="shallow" if _pair_gathers_only(p) else "default")
        # The pipelines an eager launch falls back to, in order, when the ones before fail to compile.
        fallbacks: list[dict[str, Any] | None] = []
        for pipeline in ("shallow", "smallest"):
            if not _pair_load_options(p, pipeline):
                continue  # not offered for this problem (off sm90, off CUDA, past its head dims)
            other = self.options(p, block_mask, pair_loads=pipeline)
            if other != options and other not in fallbacks:
                fallbacks.append(other)
        key, _ = keyed(options)
        return FlexCall(
            block_mask,
            score_mod,
            options,
            key,
            p.return_lse,
            p.gqa,
            self.detaches_inputs,
            self.pad_width(p),
            fallbacks=tuple(keyed(other) for other in fallbacks),
        )


def _traced_block_mask(p: Problem, mask: Any, device: torch.device, block_size: tuple[int, int]) -> Any:
    """The BlockMask of ``p`` at ``block_size`` built in the graph being traced, once per trace
    and block size for a spec made in that graph (a model's layers share the spec its forward
    built; see ``spec.graph_memo``).

    ``mask`` is ``p.mask`` as the route runs it (on the CPU, a copy). Sizes are compared with
    ``==``, never hashed: under dynamic shapes they are symbols, equal in every layer of a model
    without a guard, where hashing one would specialize it. The spec keeps the BlockMask's
    tensors and sizes, not the BlockMask: a spec that leaves the graph (returned, or live across a
    graph break) is rebuilt by Dynamo, which can rebuild tensors but not a BlockMask or a
    ``mask_mod`` made in the graph; the ``mask_mod`` is made again from the spec."""
    memo = graph_memo(p.mask)
    sizes = (p.q_len, p.kv_len, p.batch, p.heads)
    built: list[tuple[str, tuple[Any, ...], tuple[Any, ...]]] = (
        [] if memo is None else memo.setdefault("block_masks", [])
    )
    for where, seen, parts in built:
        if (
            where == str(device)
            and tuple(parts[_BLOCK_SIZE_PART]) == block_size
            and all(a == b for a, b in zip(seen, sizes, strict=True))
        ):
            return _compat.make_block_mask(*parts, bound_mask_mod(mask, p.q_len, p.kv_len, device))  # type: ignore[call-arg]  # the constructor's arguments, in order
    block_mask = build_block_mask(
        mask, p.q_len, p.kv_len, batch=p.batch, heads=p.heads, device=device, block_size=block_size
    )
    built.append((str(device), sizes, tuple(getattr(block_mask, name) for name in BLOCK_MASK_PARTS)))
    return block_mask


#: Where a BlockMask's ``BLOCK_SIZE`` sits among :data:`BLOCK_MASK_PARTS`.
_BLOCK_SIZE_PART = BLOCK_MASK_PARTS.index("BLOCK_SIZE")


@dataclasses.dataclass(frozen=True)
class FlexCall:
    """What a flex route builds for one problem before launching: its BlockMask, score_mod,
    kernel options and compiled-entry key, and the lse / GQA flags of that entry. The entry
    itself is held once looked up (the compile cache's LRU lookup cost host time on every call)
    and looked up again once it is retired (near Dynamo's recompile limit)."""

    block_mask: Any
    score_mod: Any
    options: dict[str, Any] | None
    key: Any
    lse: bool
    gqa: bool
    #: Launch detached views of inputs that require grad (``FlexBackend.detaches_inputs``).
    detach: bool = False
    #: Pad q/k/v's head dims with zeros to this width, cutting the output back to v's head dim
    #: (``FlexBackend.pad_width``); None: launch them as they are.
    pad_to: int | None = None
    #: ``(key, options)`` of shallower forward pipelines for a pair-loaded tile, tried in order once
    #: the first launch of :attr:`options` failed to compile (see :data:`PAIR_LOAD_SHALLOW_HEAD_DIM`
    #: and :data:`PAIR_LOAD_SMALLEST`); empty: no retry.
    fallbacks: tuple[tuple[Any, dict[str, Any] | None], ...] = ()
    #: ``[entry, key, options]``: the compiled entry last used (None before the first launch) and
    #: the key and options it is looked up by: :attr:`key` and :attr:`options`, or those of the
    #: fallback that ran.
    held: list[Any] = dataclasses.field(default_factory=lambda: [None, None, None], compare=False, repr=False)

    def launch(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        block_mask: Any = None,
        ran: list[Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the compiled kernel on q/k/v (in a canonical layout) with this call's BlockMask, or
        ``block_mask`` for a call prepared for a caller's BlockMask; padded to :attr:`pad_to`
        where set.

        ``ran``: for a caller whose every call has the same q/k/v shapes, strides, grad mode and
        requires-grad flags (a plan-cache bound call: its key pins them), a one-item list holding
        ``(entry, code, graph, block_mask_ref, scale, score_mod, same)`` of its last call (None
        at first; ``same``: which of q/k/v were one object, and their negative bits), updated
        here. A call that needs no layout copy, with the same BlockMask, scale, score_mod and
        ``same``, then runs ``graph``, the compiled graph that call ran, as a plain function
        (``CompiledFlex.run_unguarded``: no Dynamo frame evaluation or guards) while it is
        ``usable()`` (the global state Dynamo compares is unchanged and Dynamo still keeps the
        graph), or where there is none, or the process state does not allow it (a torch
        function or dispatch mode, a functorch transform), ``code`` without the entry's
        per-call signature check (``CompiledFlex.rerun``). Otherwise (``torch.compiler.reset``,
        a new thread count) the call runs through Dynamo again and updates the memo."""
        if self.pad_to is not None:
            padded = _pad_head_dims(q, k, v, self.pad_to)
            return _cut(self._launch(*padded, scale, block_mask, ran), v.shape[-1])
        return self._launch(q, k, v, scale, block_mask, ran)

    def _launch(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        block_mask: Any,
        ran: list[Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.detach and (q.requires_grad or k.requires_grad or v.requires_grad):
            q, k, v = q.detach(), k.detach(), v.detach()
        given = (q, k, v)
        q, k, v = _canonical_layout(q, k, v)
        if _compat.FLEX_CPU_NEEDS_DISTINCT_INPUTS and (k is q or v is q or v is k) and q.device.type == "cpu":
            q, k, v = _distinct_objects(q, k, v)
        # A copied layout (an input off its alignment, which the caller's key does not pin) may
        # have other strides than the call that filled ``ran``: such calls take the checked path.
        known = ran if ran is not None and q is given[0] and k is given[1] and v is given[2] else None
        mask = self.block_mask if block_mask is None else block_mask
        held = self.held
        entry = held[0]
        if entry is None or entry.retired:
            if held[1] is None:
                held[1], held[2] = self._pipeline_that_compiled()
            entry = held[0] = CACHE.get_keyed(held[1], held[2], self.lse, self.gqa)
        score_mod = self.score_mod
        # What Dynamo's guards check of q/k/v beyond the plan-cache key: which are one object
        # (Dynamo passes such an input to its graph once) and their negative bit.
        same = (q is k, q is v, k is v, q.is_neg(), k.is_neg(), v.is_neg())
        try:
            last = known[0] if known is not None else None
            if (
                last is not None
                and last[0] is entry
                and last[3]() is mask
                and last[4] == scale
                and last[5] is score_mod
                and last[6] == same
            ):
                graph = last[2]
                if graph is None or not _compat.unguarded_graph_allowed():
                    return entry.rerun(last[1], q, k, v, mask, scale, score_mod)
                if graph.usable():
                    return entry.run_unguarded(graph, q, k, v, mask, scale, score_mod)
                # Dynamo dropped the graph (torch.compiler.reset), or the global state its
                # guards compare changed (e.g. torch's thread count): through Dynamo again.
            try:
                out, code = entry.run(q, k, v, mask, scale, score_mod)
            except UnfusedFallbackError:
                raise  # the recompile limit, handled below
            except Exception:
                if not self.fallbacks or held[1] is not self.key:
                    raise
                # The first pipeline did not compile (on sm90: "out of resource: shared memory"
                # for the pair-loaded tile; whatever the reason, the shallow pipeline is the
                # choice this route made before trying the defaults): the fallbacks in turn,
                # the last one's error raised if none compiles.
                entry, out, code = self._fall_back(q, k, v, mask, scale, score_mod)
            if known is not None:
                graph = entry.unguarded(code, q, k, v, mask, scale, score_mod)
                # The BlockMask held weakly: a bound call must not keep it alive (see bound_run).
                mask_ref = _no_mask if mask is None else weakref.ref(mask)
                known[0] = (entry, code, graph, mask_ref, scale, score_mod, same)
            return out
        except UnfusedFallbackError:
            entry = held[0]  # a fallback's entry, when a fallback met the limit
            if not entry.retire_if_over_limit():
                raise
        # The recompile limit was lowered below the entry's graph count: a fresh entry compiles.
        entry = held[0] = CACHE.get_keyed(held[1], held[2], self.lse, self.gqa)
        return entry(q, k, v, mask, scale, self.score_mod)

    def _pipeline_that_compiled(self) -> tuple[Any, dict[str, Any] | None]:
        """``(key, options)`` to launch: the fallback an earlier prepared call of the same entry
        key ran on (:data:`DEFAULTS_DO_NOT_COMPILE`), else :attr:`key` and :attr:`options`."""
        ran = DEFAULTS_DO_NOT_COMPILE.get(self.key) if self.fallbacks else None
        if ran is not None:
            for fallback in self.fallbacks:
                if fallback[1] == ran:
                    return fallback
        return self.key, self.options

    def _fall_back(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, scale: float, score_mod: Any
    ) -> tuple[Any, Any, Any]:
        """``(entry, out, code)`` of the first of :attr:`fallbacks` that compiles and runs. It is
        then the choice for every caller of this prepared call and every later prepared call of
        the same entry key (a new bias each step must not fail a compile each step)."""
        error: Exception | None = None
        for key, options in self.fallbacks:
            entry = CACHE.get_keyed(key, options, self.lse, self.gqa)
            try:
                out, code = entry.run(q, k, v, mask, scale, score_mod)
            except UnfusedFallbackError:
                self.held[:] = [entry, key, options]  # the recompile limit: _launch retires this entry
                raise
            except Exception as exc:
                error = exc
                continue
            DEFAULTS_DO_NOT_COMPILE.put(self.key, options)
            self.held[:] = [entry, key, options]
            return entry, out, code
        assert error is not None  # fallbacks is not empty
        raise error


def _no_mask() -> None:
    """The BlockMask reference a launch memo holds for a call without one."""
    return None


#: Per (route, problem, device), and for a caller's BlockMask also its mask_mod and block size: a
#: model's repeated call skips the BlockMask / score_mod / key lookups (tens of microseconds of
#: host time per call, which short kernels wait for). Problems compare by value, so this is
#: exactly what ``_prepare`` would build again; it holds at most this many BlockMasks alive beyond
#: ``blockmask.CACHE`` (none of callers' BlockMasks).
CALLS: LRUCache[FlexCall] = LRUCache(64)

#: Compiled-entry keys (``FlexCall.key``: structural, shared by new tensors of the same shapes)
#: whose first launch with their first pipeline failed, with the options of the fallback that ran
#: (one of :attr:`FlexCall.fallbacks`): their prepared calls launch that one at once.
DEFAULTS_DO_NOT_COMPILE: LRUCache[dict[str, Any] | None] = LRUCache(256)


def _tiles_within(options: dict[str, Any], block_mask: Any) -> dict[str, Any]:
    """Measured ``options`` less the tile sizes that do not divide ``block_mask``'s block sizes.

    The tiles were measured on 128-key blocks; a kernel's tile must divide the block it walks
    (torch's templates skip, or refuse, configs whose BLOCK_N does not divide the kv block), and
    an explicit option overrides the clamp torch's own decoding configs apply. A paged decode of
    16-key pages would get ``fwd_BLOCK_N=128``: torch then picks a tile that fits instead."""
    if block_mask is None:
        return options
    q_block, kv_block = (int(x) for x in block_mask.BLOCK_SIZE)
    limits = {"fwd_BLOCK_M": q_block, "fwd_BLOCK_N": kv_block}
    return {k: v for k, v in options.items() if k not in limits or limits[k] % int(v) == 0}


def _block_size(block_mask: Any) -> tuple[int, int] | None:
    """A BlockMask's ``(q, kv)`` sparse block size as plain ints (part of the compile key), or
    None without one."""
    if block_mask is None:
        return None
    q_block, kv_block = block_mask.BLOCK_SIZE
    return int(q_block), int(kv_block)


def _decoding_kernel_chosen(p: Problem) -> bool:
    """Whether torch's BACKEND="AUTO" would lower this call to the flex-decoding kernel."""
    return p.device_type == "cuda" and 0 < p.q_len < 128


def _decode_kernel_has_no_config(p: Problem, block_mask: Any) -> bool:
    """Whether torch's automatic choice of the Triton flex-*decoding* kernel would fail to compile.

    For ``Lq < 128`` on CUDA, BACKEND="AUTO" picks flex decoding, which packs the ``Lq`` queries of
    all ``Hq / Hkv`` heads sharing a kv head into one tile of ``BLOCK_M = next_pow2(Lq * Hq / Hkv)``
    rows and keeps only configs whose BLOCK_M divides the BlockMask's q block size. With GQA and
    ``Lq * Hq / Hkv`` above that size no config remains and Inductor raises NoValidChoicesError
    (found by the GPU fuzz: Lq=64, 8:2 heads, torch 2.11). The main Triton kernel serves those
    calls (BACKEND="TRITON"); a routing choice, not a change of result.
    """
    if not _decoding_kernel_chosen(p):
        return False
    # next_pow2(Lq * group), at least 16, by doubling: under torch.compile with dynamic shapes Lq
    # is symbolic, and comparisons (range guards) need no concrete value where bit_length would.
    packed = p.q_len * (p.heads // p.kv_heads)
    rows = 16
    while rows < packed:
        rows *= 2
    q_block = block_mask.BLOCK_SIZE[0] if block_mask is not None else 128  # torch's default mask
    return int(q_block) % rows != 0


def _canonical_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v in one of a few layouts: all contiguous ``[B, H, L, D]``, all ``[B, L, H, D]``
    viewed with ``transpose(1, 2)`` (what projections produce; kept to avoid a copy on GPUs), or
    q contiguous with k/v read where they lie in a KV cache (a pool shared by the batch, or the
    live prefix of a contiguous cache). Anything else is copied contiguous.

    The kernels take any strides, but Dynamo guards on them: every new stride pattern
    (expanded, sliced, transposed...) is a recompile of the same code object, and past
    ``recompile_limit`` (8) flex would run unfused -- measured: six layouts took six of the
    eight slots. A few layouts bound that; the copy is O(L*D), small next to attention over
    many queries, but not next to a decoding step's (hence the cache layouts).
    """
    ts = (q, k, v)
    if q.is_contiguous() and k.is_contiguous() and v.is_contiguous():
        return ts
    if all(t.transpose(1, 2).is_contiguous() for t in ts):
        return ts
    if q.is_contiguous() and all(_batch_broadcast(t) for t in (k, v)):
        # A third layout: one k/v pool shared by every batch row (decode_step's paged cache,
        # expanded to [B, ...]). Copying it would allocate B x the pool (measured: 512 GiB asked
        # for at batch 64); the kernel reads it through the zero batch stride.
        return ts
    if q.is_contiguous() and _cache_prefix(k) and _cache_prefix(v):
        # A fourth: k/v the live prefix of a contiguous KV cache (``cache[:, :, :n]``, one
        # decoding step). A copy would read and write the cache once more than attention reads
        # it (three times the step's memory traffic); the strides stay those of the cache, so a
        # generation loop's new lengths make one dynamic-length graph, not a graph per length.
        return ts
    return tuple(t.contiguous() for t in ts)


def _cache_prefix(t: torch.Tensor) -> bool:
    """Whether ``t`` is the live prefix of a ``[B, H, capacity, D]`` cache (``cache[:, :, :n]``):
    a dense block (:func:`~flexattn_zoo.backends.base.is_dense_block`, aligned on CUDA) whose
    rows of D follow each other within a head."""
    return t.stride(2) == t.shape[3] and is_dense_block(t)


@torch.library.custom_op("flexattn_zoo::materialize", mutates_args=())
def materialize(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` as one opaque op of a compiled graph (see :func:`_cpu_flex_capture`)."""
    return t.clone()


@materialize.register_fake
def _materialize_fake(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t)


def _cpu_flex_capture(t: torch.Tensor) -> torch.Tensor:
    """A tensor a spec gives the traced CPU flex kernel: copied by one opaque op, so that a tensor
    computed in the graph by pointwise ops (a padding mask cast from a model's ``attention_mask``,
    document ids divided, a scaled bias) is a buffer of its own. Fused into Inductor's CPU flex
    template those ops leave it no kernel choice ("NoValidChoicesError", or an assertion that
    every buffer of the mask / score subgraph be a kernel input; torch 2.13). A tensor that
    requires grad is left as it is: the copy has no backward (a learned parameter is a graph
    input anyway)."""
    return t if t.requires_grad else materialize(t)


def _distinct_objects(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v with a repeated tensor replaced by a view of itself (no copy, same autograd graph):
    three tensor objects, so a compiled call sees three graph inputs
    (:data:`_compat.FLEX_CPU_NEEDS_DISTINCT_INPUTS`)."""
    if k is q:
        k = k.view(k.shape)
    if v is q or v is k:
        v = v.view(v.shape)
    return q, k, v


def _batch_broadcast(t: torch.Tensor) -> bool:
    """A pool shared by every row: batch stride 0, each key a contiguous row of D. Beyond a
    contiguous ``[Hkv, L, D]`` that covers ``fz.decode``'s views of serving-stack page pools
    (``decode.pool_view``: heads interleaved, or rows overlapping), which a copy would
    materialize per step."""
    return t.stride(0) == 0 and t.stride(-1) == 1


#: Up to this head dim FA4's sm90 kernels take 128-key blocks forward and backward; above it
#: (head dim 256) flex_flash builds its BlockMasks with :data:`NARROW_KV_BLOCK`-key blocks.
WIDE_KV_TILE_MAX_HEAD_DIM = 128
NARROW_KV_BLOCK = 64


@dataclasses.dataclass(frozen=True)
class FlexFlashBackend(FlexBackend):
    """flex with ``BACKEND="FLASH"``: the FlashAttention-4 CuTe kernels (sm90/sm100).

    FA4's block-sparse kernels read the BlockMask's kv blocks as their own key tiles, so a kv
    block must be exactly the tile the kernel runs at that head dim, in the forward and in the
    backward (flash-attn-4 4.0.0b36, sm90): 128 up to head dim 128; at head dim 256 the
    backward's block-sparse tile is 64 keys wide and the forward's 80 (it narrows to a smaller
    kv block, never widens to a larger one), so those BlockMasks are built with 64-key blocks
    (``sparse_block_size``). Query blocks stay 128, two of the backward's 64-row tiles.
    """

    hazard_kernel: str = "flash"

    def sparse_block_size(self, p: Problem) -> tuple[int, int]:
        if p.head_dim > WIDE_KV_TILE_MAX_HEAD_DIM:
            return DEFAULT_BLOCK_SIZE, NARROW_KV_BLOCK
        return DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE

    def run(self, q, k, v, p, *, scale, block_mask=None):
        with flash_cute_lock():  # the DSL's first-call compile is not thread-safe
            return super().run(q, k, v, p, scale=scale, block_mask=block_mask)

    def bound_run(self, p: Problem, device: torch.device, *, eager: bool = False) -> BoundCall:
        launch = super().bound_run(p, device, eager=eager)

        def locked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Any:
            with flash_cute_lock():
                return launch(q, k, v, scale)

        return locked

    def mask_reasons(self, p: Problem) -> list[str]:
        out = super().mask_reasons(p)
        if p.score is not None and p.score.captures_grad_tensors():
            out.append("FLASH cannot capture tensors that require grad in score_mod")
        if p.user_block_mask and p.head_dim > WIDE_KV_TILE_MAX_HEAD_DIM:
            out.append(
                f"at head dim {p.head_dim} FA4's kernels need BlockMask blocks of "
                f"({DEFAULT_BLOCK_SIZE}, {NARROW_KV_BLOCK}); a BlockMask given as mask is run up to "
                f"head dim {WIDE_KV_TILE_MAX_HEAD_DIM} (pass the mask spec instead)"
            )
        if p.return_lse and not _compat.FLASH_LSE_TRUSTWORTHY:
            out.append("FLASH lse is off by a factor ln 2 on this torch (< 2.13)")
        elif p.return_lse and p.requires_grad:
            # torch's FLASH backward raises NotImplementedError for a gradient through the lse
            # (torch 2.13, Inductor's flex_attention_backward), which sinks and activation
            # attention give it: that error would come in backward(), past any fallback.
            out.append("FLASH backward has no gradient through the lse (sinks, activation attention)")
        if p.requires_grad and p.gqa and p.score is not None and p.score.uses_head():
            # H200, torch 2.11, flash-attn-4 4.0.0b36 (benchmarks/flex_flash_grad_probe.py): with
            # GQA, a score_mod that reads h (ALiBi) gets dQ wrong by ~50x; the forward, GQA without
            # such a score, and head-dependent scores without GQA were all right.
            out.append("FLASH backward gives wrong dQ for a head-dependent score_mod under GQA")
        if not p.requires_grad and _compat.is_compiling():
            # H200, torch 2.11, flash-attn-4 4.0.0b36: in a forward-only graph Inductor's CuTe flex
            # template raised "convert FlexibleLayout to FixedLayout first" for q/k/v computed in
            # the graph, and freed a tensor the mask captures before the kernel read it; training
            # graphs (which keep both for the backward) ran and matched the reference.
            out.append(
                f"{IN_GRAPH} without gradients, Inductor's CuTe flex template "
                "fails on inputs computed in the graph and on tensors the mask captures"
            )
        return out


def _declares_one_element_load(p: Problem) -> bool:
    """Whether ``p``'s mask (bound to its lengths: ``Causal`` between unequal lengths keeps its
    offset in a 0-d tensor) or score spec says its function loads a captured tensor of one
    element (``reads_scalar_tensors``): the package's specs are not traced for
    :data:`~flexattn_zoo.functions.LOADS_ONE_ELEMENT`, they declare it."""
    return (p.mask is not None and p.mask.bind(p.q_len, p.kv_len).reads_scalar_tensors()) or (
        p.score is not None and p.score.reads_scalar_tensors()
    )


#: The CPU flex route's ``pad_head_dims_to``: head dims below it reach the kernel zero-padded to
#: this width. torch's compiled CPU flex kernel (torch 2.13, on an AVX2 machine) returned wrong
#: values, NaN among them, at head dim 8 and 16 for key lengths 24, 40, 56, 72, ... (with torch's
#: own ``torch.compile(flex_attention)`` too; 24 and up matched float64 at every length tried).
#: Padding is exact: zero columns add nothing to ``q . k``, the zero columns of ``v`` give zero
#: output columns, which are cut off, and the scale is the caller's (``1/sqrt(D)`` of the real D).
CPU_FLEX_MIN_HEAD_DIM = 32


def _pad_head_dims(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q/k/v with their last dims padded with zeros to ``width`` where shorter
    (``FlexBackend.pad_head_dims_to``)."""

    def pad(t: torch.Tensor) -> torch.Tensor:
        short = width - t.shape[-1]
        return torch.nn.functional.pad(t, (0, short)) if short > 0 else t

    return pad(q), pad(k), pad(v)


def _cut(
    result: tuple[torch.Tensor, torch.Tensor | None], v_dim: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A padded launch's ``(out, lse)`` with ``out`` cut back to v's head dim ``v_dim``."""
    out, lse = result
    return out[..., :v_dim], lse


@dataclasses.dataclass(frozen=True)
class FlexCpuBackend(FlexBackend):
    """Head dims below :data:`CPU_FLEX_MIN_HEAD_DIM` run padded with zeros to it (exact; see
    there why)."""

    pad_head_dims_to: int | None = CPU_FLEX_MIN_HEAD_DIM
    reads_finiteness: bool = True
    hazard_kernel: str = "cpu"

    def mask_reasons(self, p: Problem) -> list[str]:
        if p.nonfinite:
            # Measured (torch 2.13): a NaN in q row i gave a *finite* row i, and a NaN key reached
            # only some of the rows that see it -- a silent wrong result, so refuse; other CPU
            # routes propagate NaN (see fz.attention's docstring).
            return ["q/k/v hold NaN or inf, which torch's CPU flex kernel drops silently"]
        return super().mask_reasons(p)


FLEX = FlexBackend(
    name="flex",
    devices=frozenset({"cuda"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
    head_dims=(16, 256),
    min_cc=(8, 0),
    score_mods=True,
    lse=True,
    fast_score_mods=True,
    tuning=(SM90_FORWARD_TILES,),
    spells_key_starts=True,
    decode=True,
    rocm=True,
    value_dims=True,
    doc="FlexAttention compiled to Triton with BlockMask sparsity (any mask, any score mod)",
)
FLEX_FLASH = FlexFlashBackend(
    name="flex_flash",
    devices=frozenset({"cuda"}),
    dtypes=LOW_PRECISION,
    head_dims=(64, 256),
    head_dim_multiple=32,
    # 256 on sm90 only, with 64-key BlockMask blocks (FlexFlashBackend); 160-224 and 192 with a
    # 128 value head dim (FA4 direct runs DeepSeek's) are not run through flex here.
    head_dims_by_generation=(
        ("sm90", frozenset({64, 96, 128, 256})),
        ("sm100", frozenset({64, 96, 128})),
    ),
    min_cc=(9, 0),
    max_cc=(10, 9),
    score_mods=True,
    lse=True,
    kernel_options=(("BACKEND", "FLASH"),),
    requires=(FLASH_CUTE,),
    deterministic=False,
    nondeterministic_why=(
        "FA4's backward with a block mask is deterministic only on sm100+ with dQ write-order "
        "metadata (torch >= 2.13), which these BlockMasks do not carry"
    ),
    doc="FlexAttention on the FlashAttention-4 CuTe backend (flash-attn-4; sm90/sm100)",
)
FLEX_CPU = FlexCpuBackend(
    name="flex_cpu",
    # No backward here, but torch's CPU flex refuses any input that requires grad, also under
    # torch.no_grad().
    detaches_inputs=True,
    devices=frozenset({"cpu"}),
    dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
    head_dims=(1, 512),
    score_mods=True,
    lse=False,
    backward=False,
    decode=True,
    value_dims=True,
    doc="FlexAttention compiled to C++ on CPU (inference only: torch has no CPU flex backward or lse)",
)
