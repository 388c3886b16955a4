"""flex_flash's BlockMask block sizes: FA4's block-sparse kernels read a kv block as one key tile,
so at head dim 256 (Gemma-2/3) the route builds 64-key blocks, everywhere it builds a BlockMask
(eagerly, and in a traced graph, where one spec may serve routes of different block sizes).
Planning and BlockMask building only: the kernels run in tests/gpu/test_routes_gpu.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from flexattn_zoo import _compat, masks, score_mods
from flexattn_zoo.backends import BY_NAME
from flexattn_zoo.backends.flex import FLEX_FLASH, _traced_block_mask
from flexattn_zoo.dispatch import plan_problem
from flexattn_zoo.problem import Problem


def _problem(head_dim: int, mask: Any = None, score: Any = None, **fields: Any) -> Problem:
    base: dict[str, Any] = {
        "batch": 2,
        "heads": 16,
        "kv_heads": 8,
        "q_len": 1000,
        "kv_len": 1000,
        "head_dim": head_dim,
        "dtype": torch.bfloat16,
        "device_type": "cuda",
        "arch": "sm90",
        "requires_grad": True,
        "mask": mask,
        "score": score,
        "return_lse": False,
    }
    base.update(fields)
    return Problem(**base)


@pytest.fixture
def fa4(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_compat, "flash_cute_available", lambda: True)


def _head_dim_reasons(p: Problem) -> list[str]:
    return [r for r in FLEX_FLASH.reasons(p) if "head dim" in r]


@pytest.mark.parametrize(("head_dim", "blocks"), [(64, (128, 128)), (128, (128, 128)), (256, (128, 64))])
def test_block_size_per_head_dim(head_dim: int, blocks: tuple[int, int]) -> None:
    assert FLEX_FLASH.sparse_block_size(_problem(head_dim)) == blocks
    assert BY_NAME["flex"].sparse_block_size(_problem(head_dim)) == (128, 128)  # Triton: any block


def test_head_dims_by_generation(fa4: None) -> None:
    gemma = masks.SlidingWindow(left=255) & masks.Causal()
    assert _head_dim_reasons(_problem(256, gemma)) == []
    assert (
        plan_problem(_problem(256, gemma, score_mods.SoftCap(cap=50.0)), "flex_flash").backend == "flex_flash"
    )
    for refused in (160, 192, 224):
        (why,) = _head_dim_reasons(_problem(refused, gemma))
        assert f"head dim {refused}: the kernels run at 64, 96, 128, 256 on sm90" in why
    (why,) = _head_dim_reasons(_problem(256, gemma, arch="sm100"))
    assert "64, 96, 128 on sm100" in why
    (why,) = _head_dim_reasons(_problem(288, gemma))
    assert "outside 64..256, multiple of 32" in why


def test_a_callers_block_mask_is_refused_at_head_dim_256(fa4: None) -> None:
    """A BlockMask given as mask keeps the caller's block size, which FA4 cannot run at 256."""
    assert not any("BlockMask blocks" in r for r in FLEX_FLASH.reasons(_problem(128, user_block_mask=True)))
    why = [r for r in FLEX_FLASH.reasons(_problem(256, user_block_mask=True)) if "BlockMask blocks" in r]
    assert why == [
        "at head dim 256 FA4's kernels need BlockMask blocks of (128, 64); a BlockMask given as mask "
        "is run up to head dim 128 (pass the mask spec instead)"
    ]


@pytest.mark.parametrize(
    "mask",
    [
        masks.SlidingWindow(left=300) & masks.Causal(),
        masks.Document.from_lengths([[100, 700, 200], [1000]]) & masks.Causal(),
        masks.PrefixLM(prefix_len=333),
    ],
)
def test_eager_block_mask_has_the_kernels_block_size(mask: Any) -> None:
    """Built on the CPU here (the route runs on CUDA): the blocks of ``prepared`` at (128, 64) are
    those torch's ``create_block_mask`` finds at that block size."""
    p = _problem(256, mask)
    built = FLEX_FLASH.prepared(p, torch.device("cpu")).block_mask
    assert tuple(built.BLOCK_SIZE) == (128, 64)
    bound = mask.bind(p.q_len, p.kv_len)
    theirs = create_block_mask(
        bound.mask_mod(), p.batch, None, p.q_len, p.kv_len, device="cpu", BLOCK_SIZE=(128, 64)
    )
    for name in ("kv_num_blocks", "full_kv_num_blocks"):
        ours, ref = getattr(built, name), getattr(theirs, name)
        assert torch.equal(ours.expand_as(ref), ref), name
    assert tuple(FLEX_FLASH.prepared(_problem(128, mask), torch.device("cpu")).block_mask.BLOCK_SIZE) == (
        128,
        128,
    )


def test_traced_block_masks_are_kept_per_block_size() -> None:
    """A spec made in a traced graph keeps the BlockMasks built from it for the rest of the trace;
    a flex layer (128-key blocks) and a flex_flash layer at head dim 256 (64-key blocks) in one
    graph must each get their own."""
    spec = masks.SlidingWindow(left=200) & masks.Causal()
    object.__setattr__(spec, "_graph_memo", {})  # as a spec built while torch.compile traces
    p = _problem(256, spec)
    device = torch.device("cpu")
    wide = _traced_block_mask(p, spec, device, (128, 128))
    narrow = _traced_block_mask(p, spec, device, (128, 64))
    assert tuple(wide.BLOCK_SIZE) == (128, 128) and tuple(narrow.BLOCK_SIZE) == (128, 64)
    again = _traced_block_mask(p, spec, device, (128, 64))
    assert tuple(again.BLOCK_SIZE) == (128, 64)
    assert again.kv_num_blocks is narrow.kv_num_blocks  # the memo's, not a second build
