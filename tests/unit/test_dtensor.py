"""DTensor inputs and torch's context_parallel (flexattn_zoo.sharding, compose.on_shard).

Most tests run on a one-process gloo mesh (the process group is created for this module and
destroyed after it); one test spawns two processes that shard heads and batch rows for real.
Routes are picked so nothing compiles (dense with grad, SDPA without): CPU flex compiles cost
seconds, and the one test on flex_cpu is marked slow.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods, sharding
from flexattn_zoo.compose import MaskOnShard, ScoreOnShard, on_shard
from flexattn_zoo.problem import Problem
from flexattn_zoo.reference import reference_attention
from flexattn_zoo.testing import assert_mask_consistent, assert_score_consistent

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover - builds without distributed support
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: E402


@pytest.fixture(scope="module")
def mesh() -> Any:
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _qkv(b: int = 2, h: int = 4, hkv: int | None = None, length: int = 8, d: int = 16, *, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hkv = h if hkv is None else hkv
    return (
        torch.randn(b, h, length, d, generator=gen),
        torch.randn(b, hkv, length, d, generator=gen),
        torch.randn(b, hkv, length, d, generator=gen),
    )


def _dt(mesh: Any, placements: list[Any], *tensors: torch.Tensor) -> list[Any]:
    return [DTensor.from_local(t, mesh, placements, run_check=False) for t in tensors]


# ---------------------------------------------------------------------------------------------
# One-process mesh


@pytest.mark.parametrize("placement", [Replicate(), Shard(0), Shard(1)], ids=str)
def test_causal_dtensor_runs_and_returns_dtensors(mesh: Any, placement: Any) -> None:
    # Old code: SDPA's CPU flash kernel has no DTensor sharding rule (NotImplementedError).
    q, k, v = _qkv()
    dq, dk, dv = _dt(mesh, [placement], q, k, v)
    out = fz.attention(dq, dk, dv, mask="causal")
    assert isinstance(out, DTensor)
    assert tuple(out.placements) == (placement,) and out.shape == q.shape
    torch.testing.assert_close(out.full_tensor(), fz.attention(q, k, v, mask="causal"))
    assert fz.plan(dq, dk, dv, mask="causal").backend == fz.plan(q, k, v, mask="causal").backend


def test_backward_and_lse_with_per_head_and_per_batch_specs(mesh: Any) -> None:
    # Grad on the CPU: the dense route, which evaluates mask_mod/score_mod on index grids.
    q, k, v = (t.requires_grad_() for t in _qkv(h=4, hkv=2))
    doc = masks.Document(doc_ids=torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 1, 1, 1, 1, 1, 1]]))
    kw: dict[str, Any] = dict(
        mask=doc & masks.Causal(), score_mod=score_mods.Alibi(num_heads=4), enable_gqa=True
    )
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    dts = _dt(mesh, [Shard(1)], *leaves)
    out, lse = fz.attention(*dts, return_lse=True, **kw)
    assert isinstance(out, DTensor) and isinstance(lse, DTensor)
    assert lse.shape == (2, 4, 8) and tuple(lse.placements) == (Shard(1),)
    want, want_lse = fz.attention(q, k, v, return_lse=True, **kw)
    torch.testing.assert_close(out.full_tensor(), want)
    torch.testing.assert_close(lse.full_tensor(), want_lse)
    grad = torch.randn_like(want)
    want.backward(grad)
    out.backward(DTensor.from_local(grad, mesh, [Shard(1)], run_check=False))
    for got, ref in zip(leaves, (q, k, v), strict=True):
        assert got.grad is not None and ref.grad is not None
        torch.testing.assert_close(got.grad, ref.grad)


def test_refuses_sequence_sharding(mesh: Any) -> None:
    # Old code ran this (SDPA on the DTensor) instead of refusing it.
    q, k, v = _dt(mesh, [Shard(2)], *_qkv())
    with pytest.raises(ValueError, match=r"sequence \(Shard\(2\).*context parallel"):
        fz.attention(q, k, v)
    with pytest.raises(ValueError, match="context parallel"):
        fz.plan(q, k, v)


@pytest.mark.parametrize(
    ("placement", "match"), [(Shard(3), "head dim"), (Partial(), "Partial")], ids=["shard3", "partial"]
)
def test_refuses_other_placements(mesh: Any, placement: Any, match: str) -> None:
    q, k, v = _dt(mesh, [placement], *_qkv())
    with pytest.raises(ValueError, match=match):
        fz.attention(q, k, v)


def test_refuses_mixed_and_mismatched_inputs(mesh: Any) -> None:
    q, k, v = _qkv()
    dq, dk, dv = _dt(mesh, [Shard(0)], q, k, v)
    with pytest.raises(ValueError, match="k is a plain Tensor"):
        fz.attention(dq, k, dv)
    with pytest.raises(ValueError, match="v is a plain Tensor"):
        fz.attention(dq, dk, v)
    (k1,) = _dt(mesh, [Shard(1)], k)
    with pytest.raises(
        ValueError, match=r"k has placements \(Shard\(dim=1\),\) but q has \(Shard\(dim=0\),\)"
    ):
        fz.attention(dq, k1, dv)


def test_refuses_dtensors_inside_specs(mesh: Any) -> None:
    # Old code built the spec and failed deep in a route ("got mixed torch.Tensor and DTensor"),
    # or ran collectives inside the spec's checks and hashes.
    q, k, v = _qkv()
    dq, dk, dv = _dt(mesh, [Shard(0)], q, k, v)
    ids, keep, bias = _dt(
        mesh,
        [Replicate()],
        torch.tensor([[0] * 4 + [1] * 4] * 2),
        torch.ones(2, 1, 8, 8, dtype=torch.bool),
        torch.randn(2, 4, 8, 8),
    )
    calls = {
        r"Document\(doc_ids=\.\.\.\)": lambda: fz.attention(dq, dk, dv, mask=masks.Document(doc_ids=ids)),
        r"Dense\(mask=\.\.\.\)": lambda: fz.attention(q, k, v, mask=keep),
        r"Bias\(bias=\.\.\.\)": lambda: fz.attention(dq, dk, dv, score_mod=bias),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=name + r" is a DTensor.*full_tensor\(\)"):
            call()


def test_callables_capturing_dtensors_are_refused_with_the_fix(mesh: Any) -> None:
    """A raw mask or score callable that captures a DTensor failed with the probe's generic
    "failed when called as flex calls it" and torch's mixed-tensor error; it now names the
    DTensor and the fix, and the fix (capturing ``full_tensor()``) runs."""
    q, k, v = _qkv()
    dq, dk, dv = _dt(mesh, [Shard(1)], q, k, v)
    (ids,) = _dt(mesh, [Replicate()], torch.tensor([0, 0, 0, 1, 1, 1, 2, 2]))
    (bias,) = _dt(mesh, [Replicate()], torch.randn(8))

    def same_doc(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return ids[q_idx] == ids[kv_idx]

    def key_bias(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return score + bias[kv_idx]

    for kwargs in ({"mask": same_doc}, {"score_mod": key_bias}):
        with pytest.raises(TypeError, match=r"callable captures a DTensor.*t\.full_tensor\(\)"):
            fz.attention(dq, dk, dv, backend="dense", **kwargs)
    whole = ids.full_tensor()

    def same_doc_plain(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return whole[q_idx] == whole[kv_idx]

    out = fz.attention(dq, dk, dv, mask=same_doc_plain, backend="dense")
    want = reference_attention(q, k, v, mask=masks.Document(doc_ids=whole))
    torch.testing.assert_close(out.full_tensor().double(), want, rtol=1e-5, atol=1e-5)


def test_context_parallel_refuses_local_only_routes(mesh: Any) -> None:
    from torch.distributed.tensor.experimental import context_parallel

    q, k, v = _qkv()
    qg = q.clone().requires_grad_()  # grad on the CPU: the dense route
    window = masks.SlidingWindow(left=2)
    before = fz.attention(qg, k, v, mask=window)  # caches a plan; inside it must not be reused
    buffer = torch.zeros(1, 1, 8, 1)
    with context_parallel(mesh, buffers=[buffer], buffer_seq_dims=[2]):
        # q, k, v are this rank's slices of the sequence here. Old code ran the dense route on
        # the slice alone, silently; on the CPU no route is rerouted to ring attention.
        with pytest.raises(ValueError, match="context_parallel.*'dense'.*local slice only"):
            fz.attention(qg, k, v, mask=window)
        with pytest.raises(ValueError, match="context_parallel"):
            fz.plan(q, k, v, mask="causal")
        assert sharding.context_parallel_active()
    assert not sharding.context_parallel_active()
    torch.testing.assert_close(fz.attention(qg, k, v, mask=window), before)


def test_context_parallel_refuses_local_only_routes_while_compiled(mesh: Any) -> None:
    # Old code checked the route only eagerly: traced by torch.compile, the call ran the dense
    # route on the local slice of the sequence, silently. (backend="eager": Dynamo traces the
    # call as any compile does, without generating code.)
    from torch.distributed.tensor.experimental import context_parallel

    q, k, v = _qkv()
    window = masks.SlidingWindow(left=2)
    compiled = torch.compile(lambda q, k, v: fz.attention(q, k, v, mask=window), backend="eager")
    before = compiled(q, k, v)
    buffer = torch.zeros(1, 1, 8, 1)
    with context_parallel(mesh, buffers=[buffer], buffer_seq_dims=[2]):
        with pytest.raises(ValueError, match="context_parallel.*local slice only"):
            compiled(q, k, v)
    torch.testing.assert_close(compiled(q, k, v), before)


def _cuda_problem(mask: Any) -> Problem:
    return Problem(
        batch=1, heads=2, kv_heads=2, q_len=16, kv_len=16, head_dim=64, dtype=torch.bfloat16,
        device_type="cuda", arch="sm90", requires_grad=False, mask=mask,
    )  # fmt: skip


def test_context_parallel_route_choice() -> None:
    # auto moves to the first accepted route that CP reroutes (not sdpa_math: CP does not handle
    # its kernel); chunked SDPA calls do not count; a named route never moves.
    route = sharding.context_parallel_route
    accepted = ["flex", "sdpa_math", "sdpa_flash"]
    assert route(_cuda_problem(masks.Causal()), "flex", "auto", accepted) == "sdpa_flash"
    assert route(_cuda_problem(None), "sdpa_cudnn", "auto", accepted) == "sdpa_cudnn"
    with pytest.raises(ValueError, match="local slice only"):
        route(_cuda_problem(masks.Chunked(size=4)), "flex", "auto", accepted)
    with pytest.raises(ValueError, match="route 'flex' would"):
        route(_cuda_problem(masks.Causal()), "flex", "flex", accepted)
    cpu = dataclasses.replace(_cuda_problem(None), device_type="cpu", arch="cpu")
    with pytest.raises(ValueError, match="on CUDA"):
        route(cpu, "sdpa_flash", "auto", ["sdpa_flash"])


# ---------------------------------------------------------------------------------------------
# The re-based specs


def test_mask_on_shard_is_the_slice_of_the_whole() -> None:
    ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 12, [0] * 3 + [1] * 3 + [2] * 6, [0] * 6 + [1] * 6])
    doc = masks.Document(doc_ids=ids)
    shard = on_shard(doc & masks.Causal(), batch=(2, 4), heads=(0, 3), total=(4, 3))
    assert isinstance(shard, MaskOnShard)
    assert_mask_consistent(shard, q_len=12, kv_len=12, batch=2, heads=3, block_sizes=((4, 4),))
    whole = doc.dense(12, 12, batch=4)
    assert torch.equal(
        shard.dense(12, 12, batch=2, heads=3).expand(2, 1, 12, 12), whole[2:4] & whole.new_ones(12, 12).tril()
    )
    assert torch.equal(
        on_shard(doc, batch=(2, 4), heads=(0, 3), total=(4, 3)).varlen_form(12, 12, 2).segments,
        doc.varlen_form(12, 12, 4).segments[2:4],
    )
    with pytest.raises(ValueError, match="covers batch"):
        shard.validate(12, 12, 4, 3)
    # Nothing to re-base: the spec itself (same mask_mod, same caches).
    assert on_shard(masks.Causal(), batch=(2, 4), heads=(1, 2), total=(4, 3)) == masks.Causal()
    assert on_shard(doc, batch=(0, 4), heads=(1, 2), total=(4, 3)) is doc
    # Equal parameters, equal specs and one mask_mod object.
    again = on_shard(doc & masks.Causal(), batch=(2, 4), heads=(0, 3), total=(4, 3))
    assert again == shard and hash(again) == hash(shard) and again.mask_mod() is shard.mask_mod()


def test_score_on_shard_offsets_heads() -> None:
    alibi = score_mods.Alibi(num_heads=8)
    shard = on_shard(alibi, batch=(0, 2), heads=(4, 8), total=(2, 8))
    assert isinstance(shard, ScoreOnShard)
    assert_score_consistent(shard, batch=2, heads=4, q_len=9, kv_len=9)
    form = shard.linear_bias_form()
    assert form is not None and form.slopes == tuple(alibi.head_slopes()[4:])
    scores = torch.randn(2, 8, 9, 9, dtype=torch.float64)
    torch.testing.assert_close(shard.dense(scores[:, 4:].clone()), alibi.dense(scores.clone())[:, 4:])
    with pytest.raises(ValueError, match="Alibi"):
        on_shard(score_mods.Alibi(num_heads=4), batch=(0, 2), heads=(4, 8), total=(2, 8)).validate(9, 9, 2, 4)
    capped = on_shard(score_mods.SoftCap(cap=20.0), batch=(1, 2), heads=(0, 8), total=(2, 8))
    assert capped.softcap_form() == score_mods.SoftCap(cap=20.0).softcap_form()


def test_shards_keep_sdpa_attn_mask_forms() -> None:
    # Old code dropped every attn_mask form on a shard, so a named SDPA route refused a batch- or
    # head-sharded call with a mask tensor, KeyPadding or a Bias that it runs unsharded.
    q, k, v = _qkv(b=4, h=4, length=8)
    gen = torch.Generator().manual_seed(1)
    valid = torch.arange(8)[None] < torch.tensor([3, 8, 5, 1])[:, None]
    calls: list[dict[str, Any]] = [
        dict(mask=masks.KeyPadding(valid=valid)),
        dict(mask=masks.Dense(mask=torch.rand(4, 4, 8, 8, generator=gen) > 0.3)),
        dict(score_mod=score_mods.Bias(bias=torch.randn(4, 1, 8, 8, generator=gen))),
        dict(score_mod=score_mods.Bias(bias=torch.randn(1, 4, 8, 8, generator=gen))),
    ]
    for kw in calls:
        whole = fz.attention(q, k, v, backend="sdpa_math", **kw)
        for rows, heads in (((2, 4), (0, 4)), ((0, 4), (2, 4)), ((1, 3), (1, 2))):
            part = {name: on_shard(spec, batch=rows, heads=heads, total=(4, 4)) for name, spec in kw.items()}
            local = [t[rows[0] : rows[1], heads[0] : heads[1]] for t in (q, k, v)]
            got = fz.attention(*local, backend="sdpa_math", **part)
            torch.testing.assert_close(got, whole[rows[0] : rows[1], heads[0] : heads[1]])


# ---------------------------------------------------------------------------------------------
# Two processes


def _two_rank_worker(rank: int, store_path: str) -> None:
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        # Heads: ALiBi's slopes are per head, and GQA groups stay whole (4 q heads, 2 k/v heads).
        q, k, v = (t.requires_grad_() for t in _qkv(b=2, h=4, hkv=2, length=8, seed=1))
        _check_sharded(
            mesh, Shard(1), (q, k, v), mask="causal", score_mod=score_mods.Alibi(num_heads=4), enable_gqa=True
        )
        # Batch rows, split unevenly (3 rows: 2 and 1): per-row document ids, and a raw score_mod
        # that reads the batch index.
        q, k, v = (t.requires_grad_() for t in _qkv(b=3, h=2, length=8, seed=2))
        ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1]])

        def row_bias(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return score + 0.5 * b - 0.25 * h

        doc = masks.Document(doc_ids=ids) & masks.Causal()
        _check_sharded(mesh, Shard(0), (q, k, v), mask=doc, score_mod=row_bias)
        _check_sinks(mesh)
        # GQA heads that would split a group: 6 q heads / 3 k/v heads give rank 0 q heads [0, 3)
        # but k/v heads [0, 2). Refused on every rank alike.
        parts = [distribute_tensor(t, mesh, [Shard(1)]) for t in _qkv(b=1, h=6, hkv=3)]
        with pytest.raises(ValueError, match="grouped-query heads do not shard along their groups"):
            fz.attention(*parts, enable_gqa=True)
        parts = [distribute_tensor(t, mesh, [Shard(0)]) for t in _qkv(b=1, h=2)]
        with pytest.raises(ValueError, match="empty shard"):
            fz.attention(*parts)
        parts = [distribute_tensor(t, mesh, [Shard(1)]) for t in _qkv(b=1, h=2)]
        bm = fz.block_mask("causal", 8, 8)
        with pytest.raises(ValueError, match="BlockMask"):
            fz.attention(*parts, mask=bm)
        # Both ranks done before either tears the group down: a rank that destroyed it while the
        # other was still in its last collective aborted now and then (gloo's "terminate called
        # without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _check_sharded(mesh: Any, placement: Any, qkv: tuple[torch.Tensor, ...], **kw: Any) -> None:
    """Sharded forward, lse and backward gathered against the same call on the full tensors, and
    the float64 reference."""
    leaves = [distribute_tensor(t.detach(), mesh, [placement]).requires_grad_() for t in qkv]
    out, lse = fz.attention(*leaves, return_lse=True, **kw)
    assert isinstance(out, DTensor) and tuple(out.placements) == (placement,)
    local_shape = out.to_local().shape
    assert local_shape[placement.dim] < qkv[0].shape[placement.dim]  # really a shard
    want, want_lse = fz.attention(*qkv, return_lse=True, **kw)
    torch.testing.assert_close(out.full_tensor(), want)
    torch.testing.assert_close(lse.full_tensor(), want_lse)
    ref = reference_attention(*(t.detach() for t in qkv), **kw)
    torch.testing.assert_close(out.full_tensor().double(), ref, atol=1e-5, rtol=1e-5)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(3))
    want.backward(grad)
    out.backward(distribute_tensor(grad, mesh, [placement]))
    for got, full in zip(leaves, qkv, strict=True):
        assert got.grad is not None and full.grad is not None
        torch.testing.assert_close(got.grad.full_tensor(), full.grad)


def _check_sinks(mesh: Any) -> None:
    """fz.Attention with a plain sinks tensor [H] on DTensors sharded by heads and by batch rows:
    out and lse against the unsharded layer and the float64 reference, and gradients (each rank's
    sinks gradient is its rows' and heads' part; summed over the ranks, the unsharded one).
    Old code: the sinks were applied to the DTensor out, and a plain tensor beside a DTensor is a
    RuntimeError ("got mixed torch.Tensor and DTensor")."""
    q, k, v = _qkv(b=2, h=4, hkv=2, length=8, seed=4)
    kw: dict[str, Any] = dict(mask="causal", score_mod=score_mods.Alibi(num_heads=4), return_lse=True)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(5))
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(6))
    for placement in (Shard(1), Shard(0)):
        whole, shard = (fz.Attention(sinks=sinks.clone().requires_grad_(), **kw) for _ in range(2))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        want, want_lse = whole(*leaves)
        ref, ref_lse = reference_attention(
            q, k, v, mask=kw["mask"], score_mod=kw["score_mod"], enable_gqa=True, return_lse=True, sinks=sinks
        )
        dts = [distribute_tensor(t, mesh, [placement]).requires_grad_() for t in (q, k, v)]
        out, lse = shard(*dts)
        assert isinstance(out, DTensor) and tuple(out.placements) == (placement,)
        torch.testing.assert_close(out.full_tensor(), want)
        torch.testing.assert_close(lse.full_tensor(), want_lse)
        torch.testing.assert_close(out.full_tensor().double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.full_tensor().double(), ref_lse, atol=1e-5, rtol=1e-5)
        want.backward(grad)
        out.backward(distribute_tensor(grad, mesh, [placement]))
        assert whole.sinks is not None and whole.sinks.grad is not None
        assert shard.sinks is not None and shard.sinks.grad is not None
        summed = shard.sinks.grad.clone()
        dist.all_reduce(summed)
        torch.testing.assert_close(summed, whole.sinks.grad)
        for got, full in zip(dts, leaves, strict=True):
            assert got.grad is not None and full.grad is not None
            torch.testing.assert_close(got.grad.full_tensor(), full.grad)


def test_two_ranks_shard_heads_and_batch(tmp_path: Any) -> None:
    import torch.multiprocessing as mp

    store = os.path.join(tmp_path, "store")
    mp.spawn(_two_rank_worker, args=(store,), nprocs=2, join=True)


# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_flex_route_with_dtensors(mesh: Any) -> None:
    # The route of the issue: flex_cpu compiles (seconds), hence slow.
    q, k, v = _qkv()
    dq, dk, dv = _dt(mesh, [Shard(1)], q, k, v)
    alibi = score_mods.Alibi(num_heads=4)
    assert fz.plan(dq, dk, dv, score_mod=alibi).backend == "flex_cpu"
    out = fz.attention(dq, dk, dv, score_mod=alibi)
    torch.testing.assert_close(out.full_tensor(), fz.attention(q, k, v, score_mod=alibi))
