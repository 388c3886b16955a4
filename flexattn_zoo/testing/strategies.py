"""Hypothesis strategies for property-testing attention specs (``fz.testing.strategies``).

Shapes come from small fixed *buckets* rather than free integers: every distinct shape can cost
a compile on the compiled routes (5-25 s on a CI CPU, and past dynamo's recompile limit flex
silently runs unfused), so a test's worst case must be a bounded set of shapes. The buckets still
include ``Lq != Lkv``, lengths that are not multiples of 128 (and of the 16/32 test blocks), and
grouped-query head counts.

Requires ``hypothesis`` (the ``dev`` extra).
"""

from __future__ import annotations

from typing import NamedTuple, TypeVar

import torch
from hypothesis import strategies as st

from flexattn_zoo.spec import MaskSpec, ScoreSpec
from flexattn_zoo.testing.checks import spec_examples

__all__ = [
    "BATCH_BUCKETS",
    "HEAD_BUCKETS",
    "HEAD_DIM_BUCKETS",
    "LENGTH_BUCKETS",
    "ProblemShape",
    "mask_specs",
    "qkv",
    "score_specs",
    "shapes",
]

#: Sequence lengths: tiny, around one 128-block, several blocks, and ragged tails.
LENGTH_BUCKETS: tuple[int, ...] = (1, 17, 64, 100, 128, 129, 200, 256, 300, 513, 1000, 1024, 2047)
#: ``(query heads, key/value heads)``; the unequal pairs exercise grouped-query attention.
HEAD_BUCKETS: tuple[tuple[int, int], ...] = ((1, 1), (2, 2), (4, 4), (4, 2), (4, 1), (6, 3), (8, 2))
#: Head dims the flex kernels accept (16..256); small ones keep CPU tests fast.
HEAD_DIM_BUCKETS: tuple[int, ...] = (16, 32, 64)
BATCH_BUCKETS: tuple[int, ...] = (1, 2)

_S = TypeVar("_S", MaskSpec, ScoreSpec)


class ProblemShape(NamedTuple):
    """One attention problem's sizes; unpacks as ``B, Hq, Hkv, Lq, Lkv, D``."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int


def lengths(max_len: int = 300) -> st.SearchStrategy[int]:
    """A sequence length from :data:`LENGTH_BUCKETS` not above ``max_len``."""
    allowed = [n for n in LENGTH_BUCKETS if n <= max_len]
    if not allowed:
        raise ValueError(f"lengths(max_len=...) must be >= {LENGTH_BUCKETS[0]}, got {max_len}")
    return st.sampled_from(allowed)


def shapes(
    *,
    max_len: int = 300,
    gqa: bool = True,
    equal_lengths: bool | None = None,
    batches: tuple[int, ...] = BATCH_BUCKETS,
    head_dims: tuple[int, ...] = HEAD_DIM_BUCKETS,
) -> st.SearchStrategy[ProblemShape]:
    """Problem shapes drawn from the buckets.

    Args:
        max_len: Upper bound on ``Lq`` and ``Lkv``.
        gqa: Include head pairs with fewer key/value heads than query heads.
        equal_lengths: ``True``: ``Lq == Lkv``; ``False``: ``Lq != Lkv`` (when the buckets allow);
            ``None``: either, about half the time each.
        batches, head_dims: Override the batch and head-dim buckets.
    """
    heads = [p for p in HEAD_BUCKETS if gqa or p[0] == p[1]]

    @st.composite
    def draw_shape(draw: st.DrawFn) -> ProblemShape:
        b = draw(st.sampled_from(batches))
        hq, hkv = draw(st.sampled_from(heads))
        d = draw(st.sampled_from(head_dims))
        same = draw(st.booleans()) if equal_lengths is None else equal_lengths
        lq = draw(lengths(max_len))
        if same:
            lkv = lq
        else:
            others = [n for n in LENGTH_BUCKETS if n <= max_len and n != lq]
            lkv = draw(st.sampled_from(others)) if others else lq
        return ProblemShape(b, hq, hkv, lq, lkv, d)

    return draw_shape()


def mask_specs(
    q_len: int,
    kv_len: int,
    batch: int = 1,
    heads: int = 1,
    *,
    names: list[str] | None = None,
    compose: bool = True,
    depth: int = 1,
) -> st.SearchStrategy[MaskSpec]:
    """Registered mask specs (each class's ``examples()`` for this shape), optionally combined
    with ``&``, ``|`` and ``~`` up to ``depth`` levels deep (``compose=False``: none). ``names``
    restricts the registry entries drawn from."""
    spec = st.sampled_from(_valid("mask", MaskSpec, q_len, kv_len, batch, heads, names))
    for _ in range(depth if compose else 0):
        pairs = st.tuples(spec, spec)
        spec = st.one_of(
            spec,
            pairs.map(lambda ab: ab[0] & ab[1]),
            pairs.map(lambda ab: ab[0] | ab[1]),
            spec.map(lambda a: ~a),
        )
    return spec


def score_specs(
    q_len: int,
    kv_len: int,
    batch: int = 1,
    heads: int = 1,
    *,
    names: list[str] | None = None,
    chain: bool = True,
) -> st.SearchStrategy[ScoreSpec]:
    """Registered score specs (``examples()`` for this shape), optionally chained with ``>>``."""
    base = st.sampled_from(_valid("score", ScoreSpec, q_len, kv_len, batch, heads, names))
    if not chain:
        return base
    return st.one_of(base, st.tuples(base, base).map(lambda ab: ab[0] >> ab[1]))


def _valid(
    kind: str, base: type[_S], q_len: int, kv_len: int, batch: int, heads: int, names: list[str] | None
) -> list[_S]:
    found: list[_S] = []
    for _, spec in spec_examples(kind, q_len, kv_len, batch, heads, names=names):
        assert isinstance(spec, base)  # the registry of ``kind`` holds only specs of that base
        try:
            spec.validate(q_len, kv_len, batch, heads)
        except ValueError:
            continue  # an example that does not fit this shape is simply not drawn
        found.append(spec)
    if not found:
        raise ValueError(f"no registered {kind} spec fits q_len={q_len}, kv_len={kv_len} (names={names})")
    return found


def qkv(
    shape: ProblemShape | tuple[int, int, int, int, int, int],
    dtype: torch.dtype = torch.float32,
    *,
    device: torch.device | str = "cpu",
    requires_grad: bool = False,
    magnitudes: tuple[float, ...] = (1.0, 4.0),
) -> st.SearchStrategy[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(q, k, v)`` for ``shape``: standard normal times a drawn magnitude, from a drawn seed.

    Drawing a seed (not every element) keeps examples small and shrinkable; larger magnitudes
    make scores large enough to stress softmax and soft-capping.
    """
    b, hq, hkv, lq, lkv, d = shape

    @st.composite
    def draw_qkv(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        seed = draw(st.integers(min_value=0, max_value=2**31 - 1))
        mag = draw(st.sampled_from(magnitudes))
        gen = torch.Generator().manual_seed(seed)
        out = []
        for sizes in ((b, hq, lq, d), (b, hkv, lkv, d), (b, hkv, lkv, d)):
            t = (torch.randn(sizes, generator=gen) * mag).to(device=device, dtype=dtype)
            out.append(t.requires_grad_(requires_grad))
        return out[0], out[1], out[2]

    return draw_qkv()
