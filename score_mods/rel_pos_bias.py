"""``rel_pos_bias``: a learned bias per bucket of relative position and head (T5)."""

from __future__ import annotations

from typing import Any

import torch

from flexattn_zoo.registry import SCORES
from flexattn_zoo.spec import ScoreMod, ScoreSpec, Spec, spec_dataclass, static_int
from flexattn_zoo.validation import check_integer

#: Largest ``max_distance``: the bucket lookup holds ``2 * max_distance + 1`` entries, built when the
#: spec is (a "no limit" value such as 10**12 failed there as a multi-terabyte allocation). 2**24
#: positions is past any T5-style configuration (T5: 128); as Sandwich's ``max_len`` bound.
MAX_DISTANCE_MAX = 1 << 24


def _check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    number = check_integer(f"RelPosBias({name}=...)", value)
    if number < minimum:
        raise ValueError(f"RelPosBias({name}=...) must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ValueError(f"RelPosBias({name}=...) must be in [{minimum}, {maximum}], got {number}")
    return number


def _thresholds(buckets: int, exact: int, max_distance: int) -> list[int]:
    """Smallest distance of each logarithmic bucket ``exact + k`` (``k = 1 .. buckets - 1 - exact``).

    Bucket ``exact + k`` holds the distances ``d >= exact`` with
    ``floor((buckets - exact) * log(d / exact) / log(max_distance / exact)) >= k``, that is
    ``d ** (buckets - exact) * exact ** k >= max_distance ** k * exact ** (buckets - exact)``: an
    integer inequality, decided here exactly (Python integers) by bisection on ``d``.
    """
    span = buckets - exact
    out = []
    for k in range(1, buckets - exact):
        rhs = max_distance**k * exact**span
        lo, hi = exact, max_distance  # d = max_distance always qualifies: (md/e)^span >= (md/e)^k
        while lo < hi:
            mid = (lo + hi) // 2
            if mid**span * exact**k >= rhs:
                hi = mid
            else:
                lo = mid + 1
        out.append(lo)
    return out


@SCORES.register
@spec_dataclass
class RelPosBias(ScoreSpec):
    """T5's relative position bias: ``score + table[bucket(j - i), h]``, ``table`` a learned
    ``[num_buckets, H]`` tensor.

    Relative positions are bucketed as in T5 (``relative_attention_num_buckets`` =
    ``table.shape[0]``, ``relative_attention_max_distance`` = ``max_distance``). With
    ``bidirectional=True`` (encoders) half the buckets serve keys after the query: with
    ``B = num_buckets // 2``, a key after the query adds ``B`` and ``n = |j - i|``; with
    ``bidirectional=False`` (decoders) ``B = num_buckets`` and ``n = max(i - j, 0)`` (every later
    key shares bucket 0). Then, with ``E = B // 2`` exact buckets,

    * ``n < E``: bucket ``n``;
    * otherwise ``min(B - 1, E + floor((B - E) * log(n / E) / log(max_distance / E)))``: buckets
      growing logarithmically up to ``max_distance``, every farther distance in the last one.

    The floor is taken exactly (an integer inequality, see ``_thresholds``), where T5's code
    evaluates it in float32; the two agree on every configuration tested
    (``tests/unit/test_score_mods.py``), e.g. T5's 32 buckets and distance 128. The bias per head
    for ``bidirectional=False, num_buckets=6, max_distance=8`` (``E = 3``; ``t[k]`` the table's
    row ``k``; rows are queries, columns keys)::

          j:  0     1     2     3     4     5
        i=0  t0    t0    t0    t0    t0    t0
        i=1  t1    t0    t0    t0    t0    t0
        i=2  t2    t1    t0    t0    t0    t0
        i=3  t3    t2    t1    t0    t0    t0
        i=4  t3    t3    t2    t1    t0    t0
        i=5  t4    t3    t3    t2    t1    t0

    ``h`` is the query head (also under grouped-query attention), so ``table.shape[1]`` must be the
    number of query heads. A ``table`` that requires grad is kept as given (not copied): its
    gradient flows through routes with a backward that run score mods (``dense`` on the CPU,
    ``flex`` on CUDA); the spec compares such tables by identity.

    The score mod looks the bucket up in a precomputed table of ``2 * max_distance + 1`` entries
    (relative positions clamped to ``+-max_distance``, beyond which the bucket no longer changes)
    instead of evaluating a logarithm per score.

    Args:
        table: float tensor ``[num_buckets, H]`` (``num_buckets >= 2``; ``>= 4`` when bidirectional);
            an integer tensor is converted to float32.
        bidirectional: T5's encoder (True, default) or decoder (False) bucketing.
        max_distance: distance at which the last bucket starts (``> E``, at most ``2**24``; T5: 128).
    """

    depends_on_head = True
    pair_gathers = True  # table[bucket(kv - q), h]: a gather at a position-computed index

    table: torch.Tensor
    bidirectional: bool = True
    max_distance: int = 128

    scalar_fields = frozenset({"bidirectional", "max_distance"})

    def __post_init__(self) -> None:
        table: Any = self.table
        if not isinstance(table, torch.Tensor):
            raise TypeError(
                f"RelPosBias(table=...) must be a float tensor [num_buckets, H], got {type(table).__name__}"
            )
        if table.dtype != torch.bool and not table.is_floating_point() and not table.is_complex():
            table = table.to(torch.float32)  # integers (a table typed on the command line)
            object.__setattr__(self, "table", table)
        if not table.is_floating_point() or table.dim() != 2:
            raise ValueError(
                f"RelPosBias(table=...) must be a float tensor [num_buckets, H], got {table.dtype} {tuple(table.shape)}"
            )
        if not isinstance(self.bidirectional, bool):
            raise TypeError(
                f"RelPosBias(bidirectional=...) must be a bool, got {type(self.bidirectional).__name__}"
            )
        side = table.shape[0] // 2 if self.bidirectional else table.shape[0]
        if side < 2 or table.shape[1] < 1:
            raise ValueError(
                f"RelPosBias(table=...) needs at least {4 if self.bidirectional else 2} buckets (rows) and one "
                f"head (column), got shape {tuple(table.shape)}"
            )
        exact = side // 2
        distance = _check_int("max_distance", self.max_distance, exact + 1, MAX_DISTANCE_MAX)
        object.__setattr__(self, "max_distance", distance)
        # Bucket of every relative position j - i in [-max_distance, max_distance] (index + md).
        n = torch.arange(distance + 1, device="cpu")
        thresholds = torch.tensor(_thresholds(side, exact, distance), device="cpu")
        far = exact + torch.searchsorted(thresholds, n, right=True)
        by_distance = torch.where(n < exact, n, far)  # bucket of a distance n, one side
        if self.bidirectional:
            behind, ahead = by_distance.flip(0), side + by_distance[1:]  # j - i <= 0, then > 0
        else:
            behind, ahead = by_distance.flip(0), torch.zeros(distance, dtype=torch.int64, device="cpu")
        buckets = torch.cat([behind, ahead]).to(torch.int32)
        object.__setattr__(self, "_buckets", buckets.to(table.device))

    @property
    def num_buckets(self) -> int:
        return int(self.table.shape[0])

    def buckets(self) -> torch.Tensor:
        """int32 ``[2 * max_distance + 1]``: the bucket of relative position ``j - i``, at index
        ``j - i + max_distance`` (positions beyond ``+-max_distance`` share the end buckets)."""
        return self.__dict__["_buckets"]

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        if heads != self.table.shape[1]:
            raise ValueError(
                f"RelPosBias(table=...) has {self.table.shape[1]} head columns but the problem has "
                f"{heads} query heads"
            )

    def _make_score_mod(self, *, fast: bool) -> ScoreMod:
        table, buckets = self.table, self.buckets()
        md = static_int(self.max_distance)

        def rel_pos_bias(score, b, h, q_idx, kv_idx):
            # clamp(kv - q, -md, md) + md, written with where (FlashAttention-4's code generator
            # in torch 2.11 has no min/max)
            rel = kv_idx - q_idx
            rel = torch.where(rel < -md, -md, torch.where(rel > md, md, rel)) + md
            return score + table[buckets[rel], h].to(score.dtype)

        return rel_pos_bias

    def dense(self, scores: torch.Tensor) -> torch.Tensor:
        # Oracle: each relative position's bucket from the definition, one Python integer at a time
        # (a linear scan over the logarithmic buckets), independent of the precomputed lookup.
        _, heads, q_len, kv_len = scores.shape
        if heads != self.table.shape[1]:
            raise ValueError(f"RelPosBias(table=...) has {self.table.shape[1]} heads, scores have {heads}")
        side = self.num_buckets // 2 if self.bidirectional else self.num_buckets
        exact, md = side // 2, self.max_distance

        def bucket(rel: int) -> int:
            offset = side if (self.bidirectional and rel > 0) else 0
            n = abs(rel) if self.bidirectional else max(-rel, 0)
            if n < exact:
                return offset + n
            k = 0
            while k + 1 < side - exact and n ** (side - exact) * exact ** (k + 1) >= md ** (
                k + 1
            ) * exact ** (side - exact):
                k += 1
            return offset + exact + k

        rel = torch.arange(kv_len)[None, :] - torch.arange(q_len)[:, None]
        lookup = {r: bucket(r) for r in range(-(q_len - 1), kv_len)}
        index = torch.tensor([[lookup[int(r)] for r in row] for row in rel.tolist()], dtype=torch.int64)
        bias = self.table.detach().to(torch.float64, copy=True)[index.view(-1)].view(q_len, kv_len, heads)
        return scores + bias.permute(2, 0, 1)[None].to(scores.device, scores.dtype)

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        gen = torch.Generator().manual_seed(17 * heads + 3)
        return [
            cls(table=torch.randn(32, heads, generator=gen)),  # T5's defaults
            cls(table=torch.randn(6, heads, generator=gen), bidirectional=False, max_distance=8),
            cls(table=torch.randn(10, heads, generator=gen), max_distance=max(3, kv_len // 3)),
        ]
