"""DTensor inputs to ``fz.attention`` / ``fz.plan``, and calls under torch's ``context_parallel``.

**DTensors.** q, k, v must all be DTensors on one device mesh with the same placements, each
``Replicate()``, ``Shard(0)`` (batch rows) or ``Shard(1)`` (heads). Attention never mixes batch
rows or heads, so every rank computes exactly its shard of the output from its local tensors, on
any route, with no communication: ``fz.attention`` runs on ``to_local()`` and returns ``out`` (and
``lse``) as DTensors with the inputs' mesh and placements (``from_local``, which autograd flows
through). Specs keep seeing global indices: a shard of rows ``[b0, b1)`` and heads ``[h0, h1)``
runs them re-based (:func:`flexattn_zoo.compose.on_shard`): ALiBi's slope of head ``h0 + h``,
``Document`` ids of row ``b0 + b``. ``fz.plan`` describes the local call of this rank.

Refused with a ``ValueError`` -- decided from global shapes and placements alone, so every rank
raises alike instead of some ranks running on into a collective:

* sequence sharding (``Shard(2)``), ``Shard(3)``, ``Partial`` and other placements: attention of a
  query needs every key, which takes context parallelism (ring attention), not implemented here;
* one tensor dim sharded over several mesh dims (how they nest differs between torch versions);
* a split that leaves some rank an empty shard (e.g. 1 batch row over 2 ranks);
* grouped-query attention whose head shards split a group (each rank's query heads must read
  exactly its own k/v heads: ``H / H_kv`` query heads per local k/v head);
* a user ``BlockMask`` with sharded inputs: it is built for the whole call's indices (pass the mask
  spec or ``mask_mod`` instead, which are re-based);
* a DTensor inside a spec (refused when the spec is built, :mod:`flexattn_zoo.spec`): specs take
  plain tensors of the whole call.

**Context parallel.** ``torch.distributed.tensor.experimental.context_parallel(mesh, ...)`` swaps
``torch.nn.functional.scaled_dot_product_attention`` for a wrapper that treats plain q, k, v as
sequence shards and runs ring attention when SDPA reaches torch's flash, memory-efficient or cuDNN
kernel. Every other route would attend within the local slice of the sequence only, silently; so
under that context manager a call runs only on ``sdpa_flash``, ``sdpa_efficient`` or
``sdpa_cudnn`` (CUDA, no mask or causal, no chunk view), and ``auto`` picks the first of those that
accepts it. Detected by the patched function itself (:func:`context_parallel_active`), the one
thing the context manager changes. torch's newer module-wrapper form of context parallelism hands
the attention module sequence-sharded DTensors, which the rules above refuse.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from flexattn_zoo import _compat
from flexattn_zoo.coercion import as_mask_spec, as_score_spec
from flexattn_zoo.compose import on_shard
from flexattn_zoo.problem import Problem
from flexattn_zoo.validation import check_qkv

_DIM_NAMES = ("batch (dim 0)", "heads (dim 1)", "sequence (dim 2)", "head dim (dim 3)")

_CONTEXT_PARALLEL_HINT = (
    "sequence-sharded attention needs context parallelism (every query needs every key: ring "
    "attention), which flexattn_zoo does not implement yet; run it through torch's "
    "torch.distributed.tensor.experimental.context_parallel with an SDPA route "
    "(backend='sdpa_flash', 'sdpa_efficient' or 'sdpa_cudnn' on CUDA), or gather the sequence first"
)


def holds_dtensor(*tensors: object) -> bool:
    """Whether any argument is a DTensor (a subclass of Tensor: none when every argument is a
    plain Tensor, checked first; else one dict lookup when DTensor was never imported)."""
    for t in tensors:
        if type(t) is not torch.Tensor:
            break
    else:
        return False
    cls = _compat.dtensor_class()
    if cls is None:
        return False
    for t in tensors:
        if type(t) is not torch.Tensor and isinstance(t, cls):  # a plain Tensor is none
            return True
    return False


# ---------------------------------------------------------------------------------------------
# DTensor inputs


@dataclasses.dataclass(frozen=True)
class Local:
    """This rank's part of a DTensor call: local q, k, v, the rows and heads it covers, and what
    :meth:`to_global` needs to wrap local results back."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    #: ``[start, stop)`` of the batch rows and of the query heads of the whole call.
    batch: tuple[int, int]
    heads: tuple[int, int]
    #: ``(B, H)`` of the whole call.
    total: tuple[int, int]
    #: Whether some placement splits the call (a shard is smaller than the whole on some rank).
    split: bool
    mesh: Any
    placements: tuple[Any, ...]

    def to_global(self, result: Any) -> Any:
        """``out`` or ``(out, lse)`` of the local call as DTensors of the whole call."""
        if isinstance(result, tuple):
            return tuple(self._wrap(t) for t in result)
        return self._wrap(result)

    def _wrap(self, t: torch.Tensor) -> Any:
        from torch.distributed.tensor import DTensor  # imported already: we were given DTensors

        shape = (self.total[0], self.total[1], *t.shape[2:])
        return DTensor.from_local(
            t,
            self.mesh,
            self.placements,
            run_check=False,
            shape=torch.Size(shape),
            stride=_stride_like(t, shape),
        )


def _stride_like(t: torch.Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Contiguous strides of ``shape`` with ``t``'s order of dims in memory (the whole tensor laid
    out as the local one is; DTensor records it as the global stride)."""
    strides = t.stride()
    order = sorted(range(t.dim()), key=lambda d: (-strides[d], d))
    stride = [0] * len(shape)
    step = 1
    for d in reversed(order):
        stride[d] = step
        step *= max(shape[d], 1)
    return tuple(stride)


def _chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` when ``size`` is split into ``parts`` as DTensor's
    ``Shard`` splits it (``torch.chunk``: chunks of ``ceil(size / parts)``, the last ones shorter
    or empty)."""
    step = -(-size // parts)
    start = min(index * step, size)
    return start, min(start + step, size)


def _check_placements(q: Any, k: Any, v: Any) -> dict[int, int]:
    """Refuse what cannot run shard by shard; ``{tensor dim: mesh dim}`` of the sharded dims."""
    from torch.distributed.tensor import DTensor, placement_types

    # _StridedShard (private; a subclass of Shard on some torch versions) interleaves its shards.
    strided: Any = getattr(placement_types, "_StridedShard", ())

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, DTensor):
            raise ValueError(
                f"{name} is a plain {type(t).__name__} but another of q, k, v is a DTensor: pass all "
                "three as DTensors on one device mesh with the same placements, or none"
            )
    for name, t in (("k", k), ("v", v)):
        if t.device_mesh != q.device_mesh:
            raise ValueError(
                f"{name} is on device mesh {t.device_mesh} but q is on {q.device_mesh}: q, k, v must "
                "share one device mesh"
            )
        if tuple(t.placements) != tuple(q.placements):
            raise ValueError(
                f"{name} has placements {tuple(t.placements)} but q has {tuple(q.placements)}: q, k, v "
                "must be sharded alike (each Replicate(), Shard(0) for batch rows or Shard(1) for heads)"
            )
    sharded: dict[int, int] = {}
    for mesh_dim, p in enumerate(q.placements):
        if p.is_replicate():
            continue
        if not p.is_shard() or isinstance(p, strided):
            why = (
                "partial sums (Partial) must be reduced before attention"
                if p.is_partial()
                else "only Replicate(), Shard(0) (batch rows) and Shard(1) (heads) run shard by shard"
            )
            raise ValueError(f"q, k, v have placement {p} on mesh dim {mesh_dim}: {why}")
        dim = p.dim % 4
        if dim == 2:
            raise ValueError(
                f"q, k, v are sharded along the sequence (Shard(2) on mesh dim {mesh_dim}): "
                f"{_CONTEXT_PARALLEL_HINT}"
            )
        if dim == 3:
            raise ValueError(
                f"q, k, v are sharded along the head dim (Shard(3) on mesh dim {mesh_dim}): scores "
                "sum over the whole head dim; gather it, or shard batch (Shard(0)) or heads (Shard(1))"
            )
        if q.device_mesh.size(mesh_dim) == 1:
            continue  # one part: nothing is split
        if dim in sharded:
            raise ValueError(
                f"q, k, v shard the {_DIM_NAMES[dim]} over mesh dims {sharded[dim]} and {mesh_dim}; "
                "shard each dim over at most one mesh dim (how several nest is not fixed across "
                "torch versions)"
            )
        sharded[dim] = mesh_dim
    return sharded


def _ranges(size: int, parts: int, what: str, mesh_dim: int) -> list[tuple[int, int]]:
    chunks = [_chunk(size, parts, i) for i in range(parts)]
    if any(start == stop for start, stop in chunks):
        raise ValueError(
            f"{what} of size {size} split over {parts} ranks (mesh dim {mesh_dim}) leaves some rank "
            f"an empty shard; use a size of at least {parts} (ideally a multiple)"
        )
    return chunks


def localize(q: Any, k: Any, v: Any, *, enable_gqa: bool) -> Local:
    """This rank's local call of DTensor inputs (``ValueError`` for what the module docstring lists)."""
    sharded = _check_placements(q, k, v)
    shape = check_qkv(q, k, v, enable_gqa=enable_gqa)  # the whole call's sizes
    mesh = q.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this rank is not part of the device mesh of q, k, v")
    batch, heads, kv_heads = (0, shape.batch), (0, shape.heads), (0, shape.kv_heads)
    if 0 in sharded:
        mesh_dim = sharded[0]
        rows = _ranges(shape.batch, mesh.size(mesh_dim), "the batch", mesh_dim)
        batch = rows[coordinate[mesh_dim]]
    if 1 in sharded:
        mesh_dim, parts = sharded[1], mesh.size(sharded[1])
        q_parts = _ranges(shape.heads, parts, "q heads", mesh_dim)
        kv_parts = _ranges(shape.kv_heads, parts, "k/v heads", mesh_dim)
        group = shape.heads // shape.kv_heads
        for (qs, qe), (ks, ke) in zip(q_parts, kv_parts, strict=True):
            if (qs, qe) != (ks * group, ke * group):
                raise ValueError(
                    f"grouped-query heads do not shard along their groups: {shape.heads} q heads and "
                    f"{shape.kv_heads} k/v heads over {parts} ranks give one rank q heads [{qs}, {qe}) "
                    f"but k/v heads [{ks}, {ke}), which serve q heads [{ks * group}, {ke * group}); "
                    f"shard so every rank holds whole groups (k/v heads a multiple of {parts})"
                )
        heads, kv_heads = q_parts[coordinate[mesh_dim]], kv_parts[coordinate[mesh_dim]]
    local = (q.to_local(), k.to_local(), v.to_local())
    for name, t, h in zip("qkv", local, (heads, kv_heads, kv_heads), strict=True):
        expected = (batch[1] - batch[0], h[1] - h[0])
        if tuple(t.shape[:2]) != expected:
            # DTensor splits as torch.chunk does on every version we know; say so if one does not.
            raise ValueError(
                f"local {name} has batch/heads {tuple(t.shape[:2])} but a Shard split gives {expected}; "
                "this DTensor's layout is not the one flexattn_zoo runs shard by shard"
            )
    return Local(
        *local,
        batch=batch,
        heads=heads,
        total=(shape.batch, shape.heads),
        split=bool(sharded),
        mesh=mesh,
        placements=tuple(q.placements),
    )


def rebase(local: Local, mask: Any, score_mod: Any) -> tuple[Any, Any]:
    """``mask`` and ``score_mod`` for the local call: specs re-based to the shard's global rows and
    heads (:func:`flexattn_zoo.compose.on_shard`); a user BlockMask only when nothing is split."""
    if isinstance(mask, _compat.BlockMask):
        if local.split:
            raise ValueError(
                "mask is a BlockMask, built for the indices of the whole call, but q, k, v are sharded "
                "by batch or heads; pass the mask spec or mask_mod instead (each shard re-bases it)"
            )
        mask_spec: Any = mask
    else:
        mask_spec = on_shard(as_mask_spec(mask), batch=local.batch, heads=local.heads, total=local.total)
    score_spec = on_shard(as_score_spec(score_mod), batch=local.batch, heads=local.heads, total=local.total)
    return mask_spec, score_spec


# ---------------------------------------------------------------------------------------------
# Context parallel

#: Modules where torch's context_parallel has kept its registry of the functions it patched
#: (``_replaced_functions``, wrapper -> original), across versions: a package since 2.9 or so (2.13
#: has it there), one module before. Looked up only while SDPA is patched.
_CONTEXT_PARALLEL_MODULES = (
    "torch.distributed.tensor.experimental._context_parallel._attention",
    "torch.distributed.tensor.experimental.context_parallel._attention",
    "torch.distributed.tensor.experimental._attention",
)

#: SDPA routes whose kernel torch's context-parallel handler turns into ring attention: it
#: handles the flash, memory-efficient and cuDNN ops (CUDA), not the math kernel nor the CPU
#: flash kernel.
CONTEXT_PARALLEL_ROUTES = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient")


def context_parallel_active() -> bool:
    """Whether torch's ``context_parallel`` context manager is active: SDPA is patched, and by it.

    One identity check when nothing patched SDPA (``torch._C._nn`` keeps the original builtin);
    another library's patch is not mistaken for it (torch records the functions it replaced)."""
    sdpa = F.scaled_dot_product_attention
    if sdpa is torch._C._nn.scaled_dot_product_attention:
        return False
    for name in _CONTEXT_PARALLEL_MODULES:
        replaced = getattr(sys.modules.get(name), "_replaced_functions", None)
        if isinstance(replaced, dict) and sdpa in replaced:
            return True
    return False


def _rerouted(name: str, p: Problem) -> bool:
    """Whether route ``name`` runs ``p`` as one plain SDPA call that context parallel reroutes."""
    if name not in CONTEXT_PARALLEL_ROUTES or p.device_type != "cuda" or p.user_block_mask:
        return False
    # No chunk view: the chunked call reshapes the sequence, which is only a local slice here.
    if p.score is not None:  # a Bias runs as an attn_mask, which context parallel does not shard
        return False
    if p.mask is None:
        return True
    form = p.mask.sdpa_form(p.q_len, p.kv_len)
    return form is not None and form.attn_mask is None


def context_parallel_route(p: Problem, chosen: str, requested: str, accepted: Sequence[str]) -> str:
    """The route for ``p`` under context parallel: ``chosen`` (the plan's route) if context
    parallel reroutes it; with ``requested == "auto"``, else the first of ``accepted`` (the
    routes that accept ``p``, in priority order) that it reroutes; else ``ValueError``."""
    if _rerouted(chosen, p):
        return chosen
    if requested == "auto":
        for name in accepted:
            if _rerouted(name, p):
                return name
    route = f"route {chosen!r}" + (" (chosen by auto)" if requested == "auto" else "")
    raise ValueError(
        "this call runs under torch's context_parallel, which hands each rank a slice of the sequence "
        f"and reroutes only SDPA's flash, memory-efficient and cuDNN kernels to ring attention; {route} "
        "would attend within the local slice only. Under context_parallel use "
        f"{', '.join(repr(n) for n in CONTEXT_PARALLEL_ROUTES)} on CUDA with no mask or a causal one "
        "(and no score_mod), or call outside it"
    )


__all__ = [
    "CONTEXT_PARALLEL_ROUTES",
    "Local",
    "context_parallel_active",
    "context_parallel_route",
    "holds_dtensor",
    "localize",
    "rebase",
]
