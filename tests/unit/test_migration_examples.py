"""docs/migration.md, row by row: each "from" call and its flexattn_zoo call give the same output.

Where the "from" library runs here (SDPA, flex_attention: CPU torch; Hugging Face transformers
when installed) it is called and compared with. flash_attn and vLLM do not run on this machine
(CUDA-only, not installed): their rows are compared with the float64 reference given the mask the
flash_attn docstring states (window ``[i + Lk - Lq - left, i + Lk - Lq + right]``, causal
bottom-right), written here with plain index arithmetic.

The flexattn_zoo calls pin ``backend="dense"`` where ``auto`` would compile a CPU flex kernel
(seconds each on CI's 2 cores); they are otherwise the calls the page shows.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from zoo_oracles import flash_visible

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods
from flexattn_zoo.testing import reference_attention

B, H, HKV, L, D = 2, 4, 2, 32, 16
ATOL = 2e-5


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _bhsd(lq: int = L, lk: int = L, kv_heads: int = H) -> tuple[torch.Tensor, ...]:
    return _randn(B, H, lq, D, seed=1), _randn(B, kv_heads, lk, D, seed=2), _randn(B, kv_heads, lk, D, seed=3)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.double(), want.double(), atol=ATOL, rtol=1e-4)


# ---- PyTorch SDPA -----------------------------------------------------------------------------


def test_sdpa_is_causal() -> None:
    q, k, v = _bhsd()
    _close(fz.attention(q, k, v, is_causal=True), F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_sdpa_bool_attn_mask() -> None:
    q, k, v = _bhsd()
    keep = _randn(B, 1, L, L, seed=4) > 0
    keep[..., 0] = True  # every row sees a key (SDPA gives NaN rows otherwise; fz gives 0)
    _close(fz.attention(q, k, v, mask=keep), F.scaled_dot_product_attention(q, k, v, attn_mask=keep))


def test_sdpa_float_attn_mask() -> None:
    q, k, v = _bhsd()
    bias = _randn(1, H, L, L, seed=5)
    _close(fz.attention(q, k, v, mask=bias), F.scaled_dot_product_attention(q, k, v, attn_mask=bias))
    _close(fz.attention(q, k, v, score_mod=bias), F.scaled_dot_product_attention(q, k, v, attn_mask=bias))


def test_sdpa_enable_gqa() -> None:
    q, k, v = _bhsd(kv_heads=HKV)
    _close(
        fz.attention(q, k, v, is_causal=True, enable_gqa=True),
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
    )


def test_sdpa_dropout_p() -> None:
    # On the CPU both run SDPA's math kernel (torch's CPU flash kernel has no dropout): with the
    # same seed, the same mask is drawn.
    q, k, v = _bhsd()
    torch.manual_seed(0)
    got = fz.attention(q, k, v, is_causal=True, dropout_p=0.1)
    torch.manual_seed(0)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)
    _close(got, want)
    assert not torch.equal(got, fz.attention(q, k, v, is_causal=True))


# ---- flash_attn (not installed: the float64 reference of its documented semantics) ------------


def _flash_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None, **kw: Any
) -> torch.Tensor:
    """flash_attn_func's math on ``[B, L, H, D]``, in float64, back in ``[B, L, H, D]``."""
    mask = None if keep is None else masks.Dense(mask=keep)
    out = reference_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask=mask, **kw)
    return out.transpose(1, 2)


def _bshd(lq: int, lk: int) -> tuple[torch.Tensor, ...]:
    return tuple(t.transpose(1, 2) for t in _bhsd(lq, lk))


@pytest.mark.parametrize(("lq", "lk"), [(L, L), (8, L)])
def test_flash_attn_func_causal(lq: int, lk: int) -> None:
    q, k, v = _bshd(lq, lk)  # flash_attn_func(q, k, v, causal=True)
    ours = fz.attention(q, k, v, mask=masks.Causal(align="bottom_right"), layout="bshd", backend="dense")
    _close(ours, _flash_reference(q, k, v, flash_visible(lq, lk, -1, 0)))
    if lq == lk:  # square: SDPA's top-left flag is the same mask
        _close(fz.attention(q, k, v, is_causal=True, layout="bshd"), ours)


def test_flash_attn_func_window() -> None:
    q, k, v = _bshd(L, L)  # flash_attn_func(q, k, v, window_size=(5, 0))
    ours = fz.attention(q, k, v, mask=masks.SlidingWindow(left=5), layout="bshd", backend="dense")
    _close(ours, _flash_reference(q, k, v, flash_visible(L, L, 5, 0)))
    q, k, v = _bshd(8, L)  # Lq != Lk: flash aligns the window bottom-right
    d = L - 8
    ours = fz.attention(q, k, v, mask=masks.Band(lo=d - 5, hi=d), layout="bshd", backend="dense")
    _close(ours, _flash_reference(q, k, v, flash_visible(8, L, 5, 0)))


def test_flash_attn_func_softcap() -> None:
    q, k, v = (t * 4 for t in _bshd(L, L))  # flash_attn_func(q, k, v, causal=True, softcap=3.0)
    ours = fz.attention(
        q, k, v, mask="causal", score_mod=score_mods.SoftCap(cap=3.0), layout="bshd", backend="dense"
    )
    # flash_attn's reference: scores = softcap * tanh(q @ k^T * softmax_scale / softcap), then mask.
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    scores = qd @ kd.transpose(-1, -2) / math.sqrt(D)
    scores = 3.0 * torch.tanh(scores / 3.0)
    scores = scores.masked_fill(~flash_visible(L, L, -1, 0), float("-inf"))
    _close(ours, (scores.softmax(-1) @ vd).transpose(1, 2))


def test_flash_attn_varlen_func() -> None:
    lens_q, lens_k = [5, 12, 3], [9, 12, 7]
    cu_q = torch.tensor([0, 5, 17, 20], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 21, 28], dtype=torch.int32)
    q, k, v = _randn(20, H, D, seed=1), _randn(28, HKV, D, seed=2), _randn(28, HKV, D, seed=3)
    # flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 12, causal=True, window_size=(4, 0))
    ours = fz.varlen_attention(
        q, k, v, cu_q, cu_k, 12, 12, causal=True, window_size=(4, 0), enable_gqa=True, backend="dense"
    )
    parts = []
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k, strict=True)):
        qi = q[cu_q[i] : cu_q[i + 1]][None]
        ki, vi = (t[cu_k[i] : cu_k[i + 1]][None] for t in (k, v))
        keep = flash_visible(lq, lk, 4, 0)
        parts.append(_flash_reference(qi, ki, vi, keep, enable_gqa=True)[0])
    _close(ours, torch.cat(parts))


def test_flash_attn_varlen_func_alibi_slopes_causal() -> None:
    """flash_attn's ``alibi_slopes`` adds ``-slope * |r + Lk_i - Lq_i - c|`` (its docstring): under
    ``causal=True`` that is ``score_mods.Alibi(signed=True)``; the unsigned ``|r - c|`` differs
    once ``Lq_i < Lk_i`` (keys after ``r`` are visible)."""
    lens_q, lens_k = [3, 6, 4], [5, 6, 9]
    cu_q = torch.tensor([0, 3, 9, 13], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 11, 20], dtype=torch.int32)
    q, k, v = _randn(13, H, D, seed=1), _randn(20, H, D, seed=2), _randn(20, H, D, seed=3)
    slopes = [0.5, 0.25, 0.125, 0.0625]
    parts = []
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k, strict=True)):
        qi, ki, vi = (t[cu[i] : cu[i + 1]][None] for t, cu in ((q, cu_q), (k, cu_k), (v, cu_k)))
        r, c = torch.arange(lq)[:, None], torch.arange(lk)[None]
        bias = -torch.tensor(slopes, dtype=torch.float64).view(1, H, 1, 1) * (r + lk - lq - c).abs()
        scores = qi.double().transpose(1, 2) @ ki.double().permute(0, 2, 3, 1) / math.sqrt(D) + bias
        scores = scores.masked_fill(~flash_visible(lq, lk, -1, 0), float("-inf"))
        parts.append((scores.softmax(-1) @ vi.double().transpose(1, 2))[0].transpose(0, 1))
    theirs = torch.cat(
        parts
    )  # flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 9, causal=True, alibi_slopes=s)

    def ours(signed: bool) -> torch.Tensor:
        alibi = score_mods.Alibi(num_heads=H, slopes=slopes, signed=signed)
        return fz.varlen_attention(q, k, v, cu_q, cu_k, 6, 9, causal=True, score_mod=alibi, backend="dense")

    _close(ours(signed=True), theirs)
    assert not torch.allclose(ours(signed=False).double(), theirs, atol=1e-3)


# ---- flex_attention ---------------------------------------------------------------------------


def test_flex_attention_mask_mod_score_mod_block_mask() -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = _bhsd()

    def sliding_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= 8)

    def distance_penalty(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score - 0.1 * (q_idx - kv_idx).abs()

    block_mask = create_block_mask(sliding_causal, None, None, L, L, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention warns that it is unfused
        theirs = flex_attention(q, k, v, score_mod=distance_penalty, block_mask=block_mask)
    ours = fz.attention(q, k, v, mask=sliding_causal, score_mod=distance_penalty, backend="dense")
    _close(ours, theirs)
    # The BlockMask itself is accepted as mask= too (it then runs on the flex routes only).
    with torch.no_grad():
        _close(fz.attention(q, k, v, mask=block_mask, score_mod=distance_penalty), theirs)


# ---- Hugging Face transformers ----------------------------------------------------------------


def test_hf_attn_implementation() -> None:
    transformers = pytest.importorskip("transformers")
    import flexattn_zoo.hf

    name = flexattn_zoo.hf.register()
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = model(input_ids=ids).logits
        model.set_attn_implementation(name)  # from_config(..., attn_implementation=name) alike
        ours = model(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


# ---- vLLM paged decode (not installed: the float64 reference) ---------------------------------


def test_vllm_paged_decode_layout() -> None:
    """vLLM's FlashAttention KV cache is ``[num_blocks, block_size, Hkv, D]`` per k and v, which
    ``fz.decode.decode_step(kv_layout="NHD")`` reads as it is (no copy); its int32 block table
    and ``seq_lens`` go in unchanged. Queries ``[num_seqs, H, D]`` (one decode token each) become
    ``[num_seqs, H, 1, D]``. The new token's k and v go in with ``fz.decode.append_kv``."""
    num_blocks, block_size = 8, 16
    k_cache = _randn(num_blocks, block_size, HKV, D, seed=6)  # vLLM layout
    v_cache = _randn(num_blocks, block_size, HKV, D, seed=7)
    block_table = torch.tensor([[3, 0, -1], [5, 1, 7]], dtype=torch.int32)
    seq_lens = torch.tensor([19, 39])  # before the new token
    q = _randn(2, H, D, seed=8)
    k_new, v_new = _randn(2, HKV, 1, D, seed=9), _randn(2, HKV, 1, D, seed=10)

    seq_lens = fz.decode.append_kv(k_cache, v_cache, block_table, seq_lens, k_new, v_new, kv_layout="NHD")
    out = fz.decode.decode_step(
        q[:, :, None], k_cache, v_cache, seq_lens, block_table=block_table, kv_layout="NHD", backend="dense",
    )  # fmt: skip
    assert seq_lens.tolist() == [20, 40]
    for b, n in enumerate(seq_lens.tolist()):
        pages = block_table[b][block_table[b] >= 0].long()
        keys = k_cache[pages].flatten(0, 1)[:n].transpose(0, 1)[None]  # [1, Hkv, n, D]
        values = v_cache[pages].flatten(0, 1)[:n].transpose(0, 1)[None]
        assert torch.equal(keys[0, :, n - 1], k_new[b, :, 0]) and torch.equal(
            values[0, :, n - 1], v_new[b, :, 0]
        )
        ref = reference_attention(
            q[b : b + 1, :, None], keys, values, mask=masks.Causal(align="bottom_right"), enable_gqa=True
        )
        _close(out[b : b + 1], ref)
