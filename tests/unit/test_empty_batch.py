"""An empty batch (``B = 0``) behaves as in SDPA, and as zero lengths do already: an empty output
of SDPA's shape, dtype and device (an lse ``[0, H, Lq]`` in the API's dtype), no kernel run, and
zero-size gradients. Masks and score mods are still checked against the shapes, and a named
route must still accept the problem. Dynamic-batching servers meet B = 0 (a step with no live
rows); it used to be "batch, heads and head dim must be positive". Heads and head dims of 0
stay refused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import flexattn_zoo as fz
from flexattn_zoo import decode, masks, plan_cache, score_mods
from flexattn_zoo.lru import LRUCache
from flexattn_zoo.testing import spec_examples

H, HKV, LQ, LKV, D = 4, 2, 16, 24, 16

#: The CPU routes a call may name (fz.plan(...).explain() lists them).
CPU_ROUTES = ["auto", "dense", "sdpa_math", "sdpa_flash", "flex_cpu"]

#: (id, mask, score_mod) from the registry: none, by name, a spec, a score mod, both.
CASES: list[tuple[str, Any, Any]] = [
    ("plain", None, None),
    ("causal_name", "causal", None),
    ("sliding_window", masks.SlidingWindow(left=4), None),
    ("softcap", None, score_mods.SoftCap(cap=20.0)),
    ("causal_softcap", masks.Causal(), score_mods.SoftCap(cap=20.0)),
]


def _qkv(
    batch: int, *, lq: int = LQ, lkv: int = LKV, dtype: torch.dtype = torch.float32, grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(batch + lq + lkv)
    q = torch.randn(batch, H, lq, D, generator=g).to(dtype).requires_grad_(grad)
    k = torch.randn(batch, HKV, lkv, D, generator=g).to(dtype).requires_grad_(grad)
    v = torch.randn(batch, HKV, lkv, D, generator=g).to(dtype).requires_grad_(grad)
    return q, k, v


def _sdpa_empty(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """SDPA's own answer for these (empty-batch) inputs."""
    with torch.no_grad():
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def _refusal(call: Any) -> str | None:
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return None


@pytest.fixture(autouse=True)
def _fresh_plan_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_cache, "PLANS", LRUCache(64))


@pytest.mark.parametrize("route", CPU_ROUTES)
@pytest.mark.parametrize(("name", "mask", "score"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("grad", [False, True])
def test_a_route_serves_an_empty_batch_where_it_serves_a_full_one(
    route: str, name: str, mask: Any, score: Any, grad: bool
) -> None:
    """A named route accepts B = 0 exactly where it accepts B = 2 (same refusal otherwise); the
    output is SDPA's empty tensor (shape, dtype, device), and the backward gives zero-size grads."""
    full = _qkv(2)
    q, k, v = _qkv(0, grad=grad)
    kwargs = dict(mask=mask, score_mod=score, enable_gqa=True, backend=route)
    full_refusal = _refusal(lambda: fz.plan(*full, **kwargs, deterministic=False))
    if grad:
        full_refusal = full_refusal or _refusal(
            lambda: fz.plan(*(t.requires_grad_() for t in _qkv(2)), **kwargs, deterministic=False)
        )
    if full_refusal is not None:
        with pytest.raises(ValueError) as info:
            fz.attention(q, k, v, **kwargs)
        assert str(info.value) == full_refusal.replace("B=2", "B=0")
        return
    out = fz.attention(q, k, v, **kwargs)
    expected = _sdpa_empty(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, expected)  # shape, dtype and device
    assert out.shape == (0, H, LQ, D)
    if grad:
        out.sum().backward()
        for t in (q, k, v):
            assert t.grad is not None
            torch.testing.assert_close(t.grad, torch.zeros_like(t))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_lse_of_an_empty_batch_has_the_apis_dtype(dtype: torch.dtype) -> None:
    q, k, v = _qkv(0, dtype=dtype)
    out, lse = fz.attention(q, k, v, mask="causal", enable_gqa=True, return_lse=True, backend="dense")
    torch.testing.assert_close(out, _sdpa_empty(q, k, v, enable_gqa=True))
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    torch.testing.assert_close(lse, torch.empty(0, H, LQ, dtype=lse_dtype))
    # As for B > 0 (the same call, two rows).
    assert fz.attention(*_qkv(2, dtype=dtype), enable_gqa=True, return_lse=True)[1].dtype == lse_dtype


def test_layouts_tensor_masks_and_is_causal_take_an_empty_batch() -> None:
    q, k, v = _qkv(0, lq=LKV, grad=True)
    expected = _sdpa_empty(q, k, v, enable_gqa=True)
    bshd = fz.attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout="bshd", enable_gqa=True
    )
    torch.testing.assert_close(bshd, expected.transpose(1, 2))
    causal = fz.attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(causal, _sdpa_empty(q, k, v, is_causal=True, enable_gqa=True))
    for attn_mask in (
        torch.ones(0, 1, LKV, LKV, dtype=torch.bool),  # per batch row: none
        torch.ones(0, H, LKV, LKV, dtype=torch.bool),
        torch.ones(1, 1, 1, LKV, dtype=torch.bool),  # broadcast over the batch
        torch.ones(LKV, LKV, dtype=torch.bool).tril(),
        torch.zeros(0, 1, LKV, LKV),  # additive (score_mods.Bias)
    ):
        out = fz.attention(q, k, v, mask=attn_mask, enable_gqa=True)
        torch.testing.assert_close(out, _sdpa_empty(q, k, v, attn_mask=attn_mask, enable_gqa=True))
        out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


def test_a_mask_built_for_other_batch_rows_is_refused_at_an_empty_batch() -> None:
    """As SDPA refuses an attn_mask of 2 batch rows for a batch of 0."""
    q, k, v = _qkv(0)
    doc = masks.Document(doc_ids=torch.zeros(2, LKV, dtype=torch.long))
    with pytest.raises(ValueError, match=r"Document\(doc_ids=...\) has 2 rows but the batch size is 0"):
        fz.attention(q, k, v, mask=doc, enable_gqa=True)
    with pytest.raises(ValueError, match=r"has shape \(2, 1, 16, 24\); need one broadcastable to \[0\|1"):
        fz.attention(q, k, v, mask=torch.ones(2, 1, LQ, LKV, dtype=torch.bool), enable_gqa=True)


def test_every_registered_spec_takes_an_empty_batch_or_names_its_rows() -> None:
    """Every family's example built for one batch row serves B = 0 (broadcast over the batch), as
    it serves zero lengths (test_registry: test_every_registered_mask_takes_empty_problems), or,
    where the spec holds exactly one entry per batch row (KeyPadding, a per-row PrefixLM), is
    refused naming the batch size (it refuses 1 row for a batch of 2 alike)."""
    q = torch.randn(0, 2, 16, 8, dtype=torch.float64)
    kv = torch.randn(0, 2, 16, 8, dtype=torch.float64)
    served = 0
    for kind, arg in (("mask", "mask"), ("score", "score_mod")):
        for name, spec in spec_examples(kind, 16, 16, batch=1, heads=2):
            try:
                out = fz.attention(q, kv, kv, **{arg: spec}, backend="dense")
            except ValueError as exc:
                assert "but the batch size is 0" in str(exc), (kind, name, str(exc))
                continue
            served += 1
            torch.testing.assert_close(out, _sdpa_empty(q, kv, kv), msg=f"{kind} {name}")
    assert served > 40


def test_plan_of_an_empty_batch_names_its_route() -> None:
    q, k, v = _qkv(0)
    chosen = fz.plan(q, k, v, mask="causal", enable_gqa=True)
    assert chosen.problem.batch == 0
    assert chosen.backend == fz.plan(*_qkv(2), mask="causal", enable_gqa=True).backend
    assert "B=0" in chosen.explain()
    assert fz.plan(q, k, v, enable_gqa=True, backend="dense").backend == "dense"


def test_an_empty_batch_between_full_ones_is_not_served_a_cached_plan() -> None:
    """The plan cache keys shapes: a full call, an empty one, a full one again each give their
    own answer (the empty call stores nothing)."""
    full = _qkv(2)
    first = fz.attention(*full, mask="causal", enable_gqa=True)
    stored = len(plan_cache.PLANS)
    for _ in range(2):
        out = fz.attention(*_qkv(0), mask="causal", enable_gqa=True)
        assert out.shape == (0, H, LQ, D)
    assert len(plan_cache.PLANS) == stored
    torch.testing.assert_close(fz.attention(*full, mask="causal", enable_gqa=True), first)


@pytest.mark.parametrize(
    ("q_shape", "kv_shape"),
    [((0, 0, LQ, D), (0, 0, LKV, D)), ((0, H, LQ, 0), (0, HKV, LKV, 0)), ((2, 0, LQ, D), (2, 0, LKV, D))],
    ids=["no_heads", "no_head_dim", "full_batch_no_heads"],
)
def test_zero_heads_or_head_dims_stay_refused(q_shape: tuple[int, ...], kv_shape: tuple[int, ...]) -> None:
    q, k = torch.randn(q_shape), torch.randn(kv_shape)
    with pytest.raises(ValueError, match=r"heads and head dim must be positive \(only the batch and lengths"):
        fz.attention(q, k, k, enable_gqa=True)


def test_layers_take_an_empty_batch() -> None:
    q, k, v = _qkv(0, lq=LKV, grad=True)  # Lq == Lkv: no top-left alignment warning
    expected = _sdpa_empty(q, k, v, enable_gqa=True)
    layer_out = fz.Attention(mask="causal", score_mod=score_mods.SoftCap(cap=20.0))(q, k, v)
    torch.testing.assert_close(layer_out, expected)
    preset = fz.layers.attention_layer(q, k, v, config="llama4", layer=3)
    torch.testing.assert_close(preset, expected)
    out, lse = fz.layers.attention_layer(q, k, v, mask="causal", sinks=torch.zeros(H), return_lse=True)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, torch.empty(0, H, LKV))
    (layer_out.sum() + preset.sum() + out.sum()).backward()
    assert q.grad is not None and q.grad.shape == q.shape


def _decode_case(case: str, batch: int) -> Any:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(batch, H, 2, D, generator=g)
    k = torch.randn(batch, HKV, 64, D, generator=g)
    v = torch.randn(batch, HKV, 64, D, generator=g)
    lens = torch.full((batch,), 10, dtype=torch.long)
    pool = torch.randn(1, HKV, 4 * 16, D, generator=g)
    table = torch.arange(batch * 2).remainder(4).view(batch, 2)
    calls = {
        "auto": lambda: decode.decode_step(q[:, :, :1], k, v, 10),  # the plain one-query step
        "int_len": lambda: decode.decode_step(q, k, v, 10),
        "tensor_len": lambda: decode.decode_step(q, k, v, lens),
        "dense": lambda: decode.decode_step(q, k, v, lens, backend="dense"),
        "flex_cpu": lambda: decode.decode_step(q, k, v, 10, backend="flex_cpu", block_size=16),
        "sliding_softcap": lambda: decode.decode_step(
            q, k, v, lens, mask=masks.SlidingWindow(left=4), score_mod=score_mods.SoftCap(cap=20.0)
        ),
        "return_lse": lambda: decode.decode_step(q, k, v, lens, return_lse=True),
        "sinks": lambda: decode.decode_step(q, k, v, lens, sinks=torch.zeros(H), return_lse=True),
        "paged": lambda: decode.decode_step(q, pool, pool, lens, block_table=table, block_size=16),
    }
    return calls[case]()


@pytest.mark.parametrize(
    "case",
    ["auto", "int_len", "tensor_len", "dense", "flex_cpu", "sliding_softcap", "return_lse", "sinks", "paged"],
)
def test_decode_step_of_an_empty_batch_has_a_full_steps_shape(case: str) -> None:
    with torch.no_grad():
        full = _decode_case(case, 2)
        empty = _decode_case(case, 0)
    for got, want in zip(
        empty if isinstance(empty, tuple) else (empty,),
        full if isinstance(full, tuple) else (full,),
        strict=True,
    ):
        torch.testing.assert_close(got, want.new_empty((0, *want.shape[1:])))


def test_decode_step_of_an_empty_batch_has_zero_size_grads() -> None:
    q = torch.randn(0, H, 1, D, requires_grad=True)
    k = torch.randn(0, HKV, 64, D, requires_grad=True)
    v = torch.randn(0, HKV, 64, D, requires_grad=True)
    out, lse = decode.decode_step(q, k, v, 10, return_lse=True)
    torch.testing.assert_close(out, _sdpa_empty(q, k[:, :, :10], v[:, :, :10], enable_gqa=True))
    torch.testing.assert_close(lse, torch.empty(0, H, 1))
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None
        torch.testing.assert_close(t.grad, torch.zeros_like(t))


def test_decode_step_still_checks_an_empty_batchs_arguments() -> None:
    q, k = torch.randn(0, H, 2, D), torch.randn(0, HKV, 64, D)
    with pytest.raises(ValueError, match=r"cache_len 1 is out of range"):
        decode.decode_step(q, k, k, 1)
    with pytest.raises(ValueError, match=r"cache_len must hold one length per batch row \(0\), got 2"):
        decode.decode_step(q, k, k, torch.tensor([10, 10]))
    with pytest.raises(ValueError, match=r"k_cache/v_cache hold 2 rows but q has batch 0"):
        decode.decode_step(q, torch.randn(2, HKV, 64, D), torch.randn(2, HKV, 64, D), 10)
