"""Decoding, sinks and the layer API on CUDA (``pytest -m gpu``), vs the float64 reference.

The budget is fz.testing's tolerance rule computed per case: the route's error against float64
may be at most twice the error of eager attention in the input dtype (the same problem, the same
math), plus the floor of ``fz.testing``.
"""

from __future__ import annotations

import math

import pytest
import torch
from decode_checks import assert_decode_matches

import flexattn_zoo as fz
from flexattn_zoo import _compat, masks, score_mods
from flexattn_zoo.compile import CACHE as COMPILE_CACHE
from flexattn_zoo.models import decode
from flexattn_zoo.spec import MaskSpec
from flexattn_zoo.testing import assert_matches_reference, eager_attention, reference_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
B, H, HKV, D, BS = 3, 8, 2, 128, 128
CAP = 2048


def _cache(dtype=torch.bfloat16, seed=0):  # type: ignore[no-untyped-def]
    g = torch.Generator(device=DEV).manual_seed(seed)
    k = torch.randn(B, HKV, CAP, D, generator=g, device=DEV).to(dtype)
    v = torch.randn(B, HKV, CAP, D, generator=g, device=DEV).to(dtype)
    return k, v


CASES = {
    "causal": (lambda: masks.Causal(), lambda: None),
    "sliding_alibi": (lambda: masks.SlidingWindow.from_hf(300), lambda: score_mods.Alibi(num_heads=H)),
    "chunked_softcap": (
        lambda: masks.Chunked(size=512) & masks.Causal(),
        lambda: score_mods.SoftCap(cap=30.0),
    ),
}


@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_decode_steps_match_reference_without_recompiling(case: str, q_len: int) -> None:
    mask, score = CASES[case][0](), CASES[case][1]()
    k, v = _cache()
    g = torch.Generator(device=DEV).manual_seed(1)
    steps = [torch.tensor(t, device=DEV) for t in ([700, 129, 2048], [701, 130, 1500], [1999, 5, 1024])]
    with torch.no_grad():
        for i, lens in enumerate(steps):
            q = torch.randn(B, H, q_len, D, generator=g, device=DEV).to(torch.bfloat16)
            out = decode.decode_step(q, k, v, lens, mask=mask, score_mod=score)
            assert_decode_matches(out, q, k, v, lens, mask, score)
            if i == 0:
                compiles = COMPILE_CACHE.total_compiles()
    assert COMPILE_CACHE.total_compiles() == compiles


def test_dead_blocks_are_not_read() -> None:
    # NaN in every block outside [window start, last live key]: a kernel reading one would give NaN.
    mask = masks.SlidingWindow.from_hf(300)
    k, v = _cache()
    lens = torch.tensor([700, 129, 2048], device=DEV)
    vp = v.clone()
    for b in range(B):
        n = int(lens[b])
        vp[b, :, : max(0, n - 300) // BS * BS] = float("nan")
        vp[b, :, -(-n // BS) * BS :] = float("nan")
    q = torch.randn(B, H, 1, D, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        out = decode.decode_step(q, k, vp, lens, mask=mask)
    assert torch.isfinite(out).all()
    assert_decode_matches(out, q, k, v, lens, mask)


def test_decode_with_sinks_and_lse_on_flex() -> None:
    k, v = _cache()
    lens = torch.tensor([900, 64, 2000], device=DEV)
    q = torch.randn(B, H, 1, D, device=DEV, dtype=torch.bfloat16)
    sinks = torch.linspace(-2, 4, H, device=DEV)
    mask = masks.SlidingWindow.from_hf(128)
    with torch.no_grad():
        out = decode.decode_step(q, k, v, lens, mask=mask, sinks=sinks)
    assert_decode_matches(out, q, k, v, lens, mask, sinks=sinks)


def test_paged_flex_and_varlen_match_contiguous() -> None:
    n_pages = 64
    g = torch.Generator(device=DEV).manual_seed(2)
    kp = torch.randn(1, HKV, n_pages * BS, D, generator=g, device=DEV).to(torch.bfloat16)
    vp = torch.randn(1, HKV, n_pages * BS, D, generator=g, device=DEV).to(torch.bfloat16)
    perm = torch.randperm(n_pages, generator=torch.Generator().manual_seed(3)).to(DEV)
    table = perm[: B * 16].view(B, 16)
    lens = torch.tensor([1000, 2048, 77], device=DEV)
    k = decode._gather_pages(kp, table, 16, BS)
    v = decode._gather_pages(vp, table, 16, BS)
    q = torch.randn(B, H, 1, D, device=DEV, dtype=torch.bfloat16)
    for mask, window in ((masks.Causal(), None), (masks.SlidingWindow.from_hf(200), 200)):
        with torch.no_grad():
            out = decode.decode_step(q, kp, vp, lens, block_table=table, mask=mask)
        assert_decode_matches(out, q, k, v, lens, mask)
        if _compat.varlen_supports("block_table"):
            # varlen's page layout: [n_pages, page_size, Hkv, D]
            kv_pages = [t[0].view(HKV, n_pages, BS, D).permute(1, 2, 0, 3).contiguous() for t in (kp, vp)]
            with torch.no_grad():
                out_v = decode.decode_step_varlen(q, kv_pages[0], kv_pages[1], lens, table, window=window)
            assert_decode_matches(out_v, q, k, v, lens, mask)


@pytest.mark.parametrize("page", [1, 16, 64, 128])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_serving_layouts_append_then_decode(layout: str, page: int) -> None:
    """Pools in vLLM's / FlashInfer's layouts written by append_kv and decoded in place (pages
    below 16 keys take the dense route over the gathered pages)."""
    n_pages = 2 * B * 1024 // page
    shape = (n_pages, page, HKV, D) if layout == "NHD" else (n_pages, HKV, page, D)
    g = torch.Generator(device=DEV).manual_seed(page)
    kp, vp = (torch.randn(*shape, generator=g, device=DEV).to(torch.bfloat16) for _ in range(2))
    perm = torch.randperm(n_pages, generator=torch.Generator().manual_seed(page)).to(DEV)
    table = perm[: B * (1024 // page)].view(B, -1).to(torch.int32)
    new = torch.randn(2, B, HKV, 700, D, generator=g, device=DEV).to(torch.bfloat16)
    lens = decode.append_kv(
        kp, vp, table, torch.zeros(B, dtype=torch.int32, device=DEV), new[0], new[1], kv_layout=layout
    )
    k, v = new[0], new[1]  # the dense cache: every row holds its 700 tokens
    q = torch.randn(B, H, 1, D, device=DEV, dtype=torch.bfloat16)
    for mask in (masks.Causal(), masks.SlidingWindow.from_hf(200)):
        with torch.no_grad():
            out = decode.decode_step(q, kp, vp, lens, block_table=table, mask=mask, kv_layout=layout)
        assert_decode_matches(out, q, k, v, lens, mask)


def test_sink_gradients_on_flex() -> None:
    g = torch.Generator(device=DEV).manual_seed(4)
    q = torch.randn(2, H, 333, 64, generator=g, device=DEV).to(torch.bfloat16).requires_grad_()
    k = torch.randn(2, HKV, 333, 64, generator=g, device=DEV).to(torch.bfloat16).requires_grad_()
    v = torch.randn(2, HKV, 333, 64, generator=g, device=DEV).to(torch.bfloat16).requires_grad_()
    sinks = torch.linspace(-2, 4, H, device=DEV).requires_grad_()
    mask = masks.SlidingWindow.from_hf(100)
    out = fz.layers.attention_layer(q, k, v, mask=mask, sinks=sinks, backend="flex")
    grad_out = torch.randn(out.shape, generator=g, device=DEV).to(out.dtype)
    grads = torch.autograd.grad(out, (q, k, v, sinks), grad_out)
    assert_matches_reference(
        out, q, k, v, mask=mask, enable_gqa=True, sinks=sinks, grads=grads, grad_out=grad_out
    )


def test_attention_module_reuses_masks_and_kernels_on_gpu() -> None:
    from flexattn_zoo import blockmask

    layer = fz.Attention(fz.presets.get("gemma2", layer=0, window=256))
    q = torch.randn(2, H, 1024, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(2, HKV, 1024, D, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        layer(q, k, k)
        builds, compiles = blockmask.CACHE.inserts, COMPILE_CACHE.total_compiles()
        for _ in range(3):
            layer(q, k, k)
    assert blockmask.CACHE.inserts == builds and COMPILE_CACHE.total_compiles() == compiles


def test_hf_models_on_the_auto_route() -> None:
    transformers = pytest.importorskip("transformers")
    import flexattn_zoo.hf as zhf

    name = zhf.register("flexattn_zoo_gpu")
    common = dict(
        vocab_size=100,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
    )
    configs = [
        transformers.Gemma2Config(**common, sliding_window=64),
        transformers.GptOssConfig(
            **common,
            sliding_window=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ]
    ids = torch.randint(0, 100, (2, 300), device=DEV)
    for cfg in configs:
        torch.manual_seed(0)
        model = (
            transformers.AutoModelForCausalLM.from_config(
                cfg, attn_implementation="eager", experts_implementation="eager"
            )
            .to(DEV)
            .eval()
        )
        if hasattr(model.model.layers[0].self_attn, "sinks"):
            for layer in model.model.layers:
                torch.nn.init.normal_(layer.self_attn.sinks)
        with torch.no_grad():
            eager = model(ids).logits
            model.set_attn_implementation(name)
            ours = model(ids).logits
        # float32 end to end on both sides: a few float32 ulps per layer of the logit scale.
        tol = 64 * torch.finfo(torch.float32).eps * float(eager.abs().max())
        assert float((ours - eager).abs().max()) <= tol + math.ulp(1.0)


@pytest.mark.parametrize("case", ["causal", "sliding_alibi"])
def test_decode_step_replays_in_a_cuda_graph(case: str) -> None:
    """Captured once, replayed with new lengths and queries written in place: still exact.

    Serving loops capture their whole step in a CUDA graph; decode_step must be capturable (no
    host sync, no reallocation between steps) for both of DecodeMask.update's paths.
    """
    mask, score = CASES[case][0](), CASES[case][1]()
    k, v = _cache()
    g = torch.Generator(device=DEV).manual_seed(3)
    q = torch.randn(B, H, 1, D, generator=g, device=DEV).to(torch.bfloat16)
    lens = torch.tensor([700, 129, 2048], device=DEV)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and warm up outside the capture
            for _ in range(2):
                decode.decode_step(q, k, v, lens, mask=mask, score_mod=score)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = decode.decode_step(q, k, v, lens, mask=mask, score_mod=score)
        for new_lens in ([701, 130, 1500], [1999, 5, 1024], [2048, 2048, 1]):
            lens.copy_(torch.tensor(new_lens))
            q.copy_(torch.randn(B, H, 1, D, generator=g, device=DEV))
            graph.replay()
            torch.cuda.synchronize()
            assert_decode_matches(out, q, k, v, lens, mask, score)


def test_decode_plans_once_per_signature() -> None:
    k, v = _cache()
    q = torch.randn(B, H, 1, D, device=DEV, dtype=torch.bfloat16)
    decode.CACHE.clear()
    with torch.no_grad():
        for n in (100, 101, 102, 900):
            decode.decode_step(q, k, v, torch.full((B,), n, device=DEV))
        (dm,) = decode.CACHE.values()
        assert len(dm.runs) == 1
        decode.decode_step(q.float(), k.float(), v.float(), torch.full((B,), 5, device=DEV))
        assert len(dm.runs) == 2  # a new dtype is a new plan (and validated again)


def test_caches_too_large_for_one_flex_launch_are_split_by_rows() -> None:
    """K of 2**31 elements (torch's Triton flex template fails to compile it): rows in two launches."""
    batch, hkv, length = 32, 8, 65536
    k = torch.randn(batch, hkv, length, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, H * 4 // 2, 1, D, device=DEV, dtype=torch.bfloat16)  # 32 q heads : 8 kv heads
    lens = torch.randint(length // 2, length + 1, (batch,), device=DEV)
    with torch.no_grad():
        out = decode.decode_step(q, k, v, lens)
        for b in (0, batch // 2 - 1, batch // 2, batch - 1):  # both sides of the split
            # The newest query sees every live key: plain attention over the first n keys.
            n, one = int(lens[b]), slice(b, b + 1)
            ref = reference_attention(
                q[one].double(), k[one, :, :n].double(), v[one, :, :n].double(), enable_gqa=True
            )
            eager = torch.nn.functional.scaled_dot_product_attention(
                q[one], k[one, :, :n], v[one, :, :n], enable_gqa=True
            )
            err, eager_err = (float((t.double() - ref).abs().max()) for t in (out[one], eager))
            floor = float(ref.abs().max()) * torch.finfo(torch.bfloat16).eps
            assert err <= 2 * eager_err + floor, (
                f"row {b}: error {err:.3e} > 2 x {eager_err:.3e} + {floor:.3e}"
            )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_query_steps_run_sdpa_over_the_live_prefix(dtype: torch.dtype) -> None:
    """A plain generation step (one query, int cache_len, default causal pattern) is SDPA over the
    cache's live prefix: no DecodeMask, exact for every length, GQA included."""
    k, v = _cache(dtype)
    decode.CACHE.clear()
    g = torch.Generator(device=DEV).manual_seed(5)
    with torch.no_grad():
        for n in (1, 127, 128, 129, 1000, CAP):
            q = torch.randn(B, H, 1, D, device=DEV, dtype=dtype, generator=g)
            out = decode.decode_step(q, k, v, n)
            assert_decode_matches(out, q, k, v, [n] * B, masks.Causal())
    assert decode.CACHE.inserts == 0


@pytest.mark.parametrize(
    "mask",
    [
        masks.SlidingWindow.from_hf(300),
        masks.Chunked(size=512) & masks.Causal(),
        masks.PrefixLM(prefix_len=700),
        masks.SlidingWindow.from_hf(1024) | masks.Chunked(size=256),
    ],
    ids=repr,
)
def test_one_query_steps_under_one_run_masks_run_sdpa_over_the_run(mask: MaskSpec) -> None:
    """A one-query step whose mask shows the query one run of keys (a sliding window, a chunk,
    prefix-LM) is SDPA over that slice of the cache: no DecodeMask, within the error budget at
    every length (inside the first window, on its edges, past it), on a contiguous and a
    [B, L, H, D] cache."""
    g = torch.Generator(device="cpu").manual_seed(7)
    contiguous = _cache(torch.bfloat16)
    bshd = tuple(
        torch.randn(B, CAP, HKV, D, generator=g).to(DEV, torch.bfloat16).transpose(1, 2) for _ in range(2)
    )
    decode.CACHE.clear()
    with torch.no_grad():
        for k, v in (contiguous, bshd):
            for n in (1, 299, 300, 301, 511, 512, 513, 700, 1500, CAP):
                q = torch.randn(B, H, 1, D, generator=g).to(DEV, torch.bfloat16)
                out = decode.decode_step(q, k, v, n, mask=mask)
                assert_decode_matches(out, q, k, v, [n] * B, mask)
    assert decode.CACHE.inserts == 0


def test_one_query_steps_over_caches_of_every_layout() -> None:
    """A one-query step uses a prefix of a contiguous cache as it is when the cache's start and a
    row of D are 16-byte aligned; on CUDA caches of other layouts and alignments (a bf16 cache with
    D = 100 cut to 64, a cache starting one element in, a [B, L, H, D] cache) the shortcut must
    agree with the full check, and every step must match the float64 reference."""
    from flexattn_zoo.backends.base import is_dense_block, slices_are_dense_blocks

    g = torch.Generator(device="cpu").manual_seed(5)
    wide = torch.randn(2, 2, 300, 100, generator=g).to(DEV, torch.bfloat16)
    flat = torch.randn(2 * 2 * 300 * 64 + 1, generator=g).to(DEV, torch.bfloat16)
    caches = {
        "contiguous": torch.randn(2, 2, 300, 64, generator=g).to(DEV, torch.bfloat16),
        "d cut": wide[..., :64],
        "offset start": flat[1:].view(2, 2, 300, 64),
        "bshd": torch.randn(2, 300, 2, 64, generator=g).to(DEV, torch.bfloat16).transpose(1, 2),
    }
    q = torch.randn(2, 8, 1, 64, generator=g).to(DEV, torch.bfloat16)
    for name, cache in caches.items():
        for n in (1, 77, 300):
            if slices_are_dense_blocks(cache):
                assert is_dense_block(cache[:, :, :n]), name
            with torch.no_grad():
                out = decode.decode_step(q, cache, cache, n)
            assert_decode_matches(out, q, cache, cache, torch.tensor([n, n]), masks.Causal())


def test_long_caches_over_many_rows_take_the_split_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain one-query step over 8192 keys with 256 (batch x kv head) rows leaves the SDPA
    prefix path (FlashAttention-2 reads such caches at half of HBM bandwidth) for flex, and
    matches float64; one key less stays on the prefix path."""
    g = torch.Generator(device="cpu").manual_seed(9)
    b, hq, hkv, n, d = 32, 16, 8, 8192, 64
    k_cache = torch.randn(b, hkv, n, d, generator=g).to(DEV, torch.bfloat16)
    v_cache = torch.randn(b, hkv, n, d, generator=g).to(DEV, torch.bfloat16)
    q = torch.randn(b, hq, 1, d, generator=g).to(DEV, torch.bfloat16)
    seen = []
    prefix = decode.one_query_over_live_keys

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = prefix(*args, **kwargs)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(decode.step, "one_query_over_live_keys", spy)  # where decode_step looks it up
    for length, on_prefix in ((n, False), (n - 1, True)):
        with torch.no_grad():
            out = decode.decode_step(q, k_cache, v_cache, length)
        assert seen[-1] is on_prefix, length
        # The last query sees exactly the first ``length`` keys: unmasked attention over them.
        k, v = k_cache[:, :, :length], v_cache[:, :, :length]
        ref = reference_attention(q.double(), k.double(), v.double(), enable_gqa=True)
        eager = eager_attention(q, k, v, enable_gqa=True)
        err = float((out.double() - ref).abs().max())
        eager_err = float((eager.double() - ref).abs().max())
        floor = float(ref.abs().max()) * torch.finfo(q.dtype).eps
        assert err <= 2 * eager_err + floor, (length, err, eager_err)
