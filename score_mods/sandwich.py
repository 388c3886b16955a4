"""``sandwich``: the inner product of sinusoidal position embeddings as a bias per head (Chi et al.,
"Dissecting Transformer Length Extrapolation via the Lens of Receptive Field Analysis", 2023)."""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import torch

from flexattn_zoo._compat import outside_inference_mode
from flexattn_zoo.lru import LRUCache
from flexattn_zoo.masks._blocks import _canonical_device
from flexattn_zoo.registry import SCORES
from flexattn_zoo.spec import ScoreMod, ScoreSpec, Spec, spec_dataclass, static_int
from flexattn_zoo.validation import check_integer

if sys.version_info >= (3, 11):
    from typing import Self
else:  # typing_extensions: a dependency of torch, declared for 3.10 in pyproject
    from typing_extensions import Self

#: Largest ``dim`` and ``max_len`` accepted: the table costs ``dim / 2 * max_len`` cosines to build
#: (once per value, see ``_TABLES``) and ``12 * (2 * max_len - 1)`` bytes per device.
DIM_MAX = 1024
MAX_LEN_MAX = 1 << 20

#: Distance tables by ``(dim, max_len, device)``: specs built anew with the same parameters (a
#: model building its spec per call) share them instead of evaluating the cosines again. Nothing
#: ever writes to a table.
_TABLES: LRUCache[tuple[torch.Tensor, torch.Tensor]] = LRUCache(8)


def _check_int(name: str, value: object, minimum: int, maximum: int) -> int:
    number = check_integer(f"Sandwich({name}=...)", value)
    if not minimum <= number <= maximum:
        raise ValueError(f"Sandwich({name}=...) must be in [{minimum}, {maximum}], got {number}")
    return number


def _shifted_sums(dim: int, max_len: int) -> torch.Tensor:
    """float64 ``[max_len]``: ``sum_{k=1..dim/2} cos(n / 10000^(2k/dim)) - dim/2`` at ``n = 0 ..
    max_len - 1``, accumulated one frequency at a time (memory ``O(max_len)``)."""
    n = torch.arange(max_len, dtype=torch.float64, device="cpu")
    total = torch.zeros(max_len, dtype=torch.float64, device="cpu")
    for k in range(1, dim // 2 + 1):
        total += torch.cos(n * math.pow(10000.0, -2.0 * k / dim))
    return total - dim / 2


def _distance_tables(dim: int, max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float64, float32)`` tables of ``2 * max_len - 1`` entries: the shifted sum at relative
    position ``j - i``, stored at index ``j - i + max_len - 1`` (the sum is even in ``j - i``)."""
    key = (dim, max_len, str(device))
    found = _TABLES.get(key)
    if found is not None:
        return found
    if device.type == "cpu":
        half = _shifted_sums(dim, max_len)
        full = torch.cat([half.flip(0), half[1:]])
    else:  # one evaluation on the CPU, then a copy
        full = _distance_tables(dim, max_len, torch.device("cpu"))[0].to(device)
    return _TABLES.put(key, (full, full.to(torch.float32)))


@SCORES.register
@spec_dataclass
class Sandwich(ScoreSpec):
    """Sandwich: add ``(p_i . p_j - d'/2) / r_h`` to the scaled score of query ``i``, key ``j``, with
    ``p`` the sinusoidal position embedding of dimension ``d' = dim`` and ``r_h = 8 (h + 1) / H``.

    The inner product of two sinusoidal embeddings depends only on ``i - j``::

        p_i . p_j = sum_{k=1..d'/2} cos((i - j) / 10000^(2k/d'))

    It is ``d'/2`` at ``i = j`` and smaller elsewhere (logarithmic-looking decay, then small
    oscillations around ``-d'/2`` far away), so the shifted bias is 0 on the diagonal and negative
    off it. Each head divides it by its own ratio ``r_h = 8 (h + 1) / H`` (``h`` from 0; ALiBi's
    ``n * 8 / H`` with ``n = h + 1``): head 0 has the steepest bias, the last head (``r = 8``) the
    flattest. This is the paper's parameter-free bias (Chi, Fan, Rudnicky, Ramadge, ACL 2023,
    arXiv 2212.10356) with its per-head ratios, written as NVIDIA NeMo's Sandwich module
    computes it (frequencies ``k = 1 .. d'/2``, the ``d'/2`` shift, the ratio dividing the bias).
    attention-gym's ``generate_sandwich_bias`` sums ``k = 0 .. d'/2 - 1`` instead (one frequency
    of 1 more, ``10000^-1`` less) and adds no shift: see docs/zoo.md.

    The bias for ``dim = 128`` (the default) and a head with ``r_h = 1`` (head 0 of 8), ``Lq = Lkv
    = 5``; rows are queries, columns keys (symmetric: it depends on ``|i - j|``)::

          j:    0      1      2      3      4
        i=0     0    -1.45  -5.20  -9.82 -13.76
        i=1   -1.45    0    -1.45  -5.20  -9.82
        i=2   -5.20  -1.45    0    -1.45  -5.20
        i=3   -9.82  -5.20  -1.45    0    -1.45
        i=4  -13.76  -9.82  -5.20  -1.45    0

    (``-16.9`` at distance 6, ``-28.2`` at 32, ``-50.9`` at 1024.) Head ``h`` of ``H`` shows these
    values divided by ``8 (h + 1) / H``. Combine with ``masks.Causal()`` for a decoder, as in the
    paper; ``h`` is the *query* head, also under grouped-query attention.

    The sum has no closed form, and evaluating ``d'/2`` cosines per score is slow on a GPU and, in
    float32, inaccurate far from the diagonal (the cosine's argument alone is off by
    ``|i - j| * 6e-8``). So the score mod loads it from a table of every relative position in
    ``(-max_len, max_len)``, computed once in float64 (a float32 copy for float32 scores): one load
    and one division per score. The table lives on one device: ``spec.to(device)`` returns the
    spec for another one (routes call it), and the device takes part in equality, so a CPU table
    never reaches a CUDA kernel. Specs are built for the CPU.

    Args:
        num_heads: Number of query heads of the problem, ``>= 1``; must match at run time.
        dim: ``d'``, the dimension of the sinusoidal embeddings: even, in ``[2, 1024]`` (default
            128). Not the model's head dim: a parameter of the bias alone.
        max_len: Longest query or key sequence the spec serves, in ``[1, 2^20]`` (default 8192);
            longer problems are refused with the fix. The table holds ``2 * max_len - 1`` values.

    Forms offered: none (the bias is not linear in the distance, so no ``linear_bias_form``).
    """

    depends_on_head = True
    pair_loads = True  # its table (not a field) is read at kv - q
    pair_gathers = True

    num_heads: int
    dim: int = 128
    max_len: int = 8192

    scalar_fields = frozenset({"num_heads", "dim", "max_len"})  # ints (__post_init__)

    def __post_init__(self) -> None:
        heads = _check_int("num_heads", self.num_heads, 1, 1 << 20)
        dim = _check_int("dim", self.dim, 2, DIM_MAX)
        if dim % 2:
            raise ValueError(f"Sandwich(dim=...) must be even (sin/cos pairs), got {dim}")
        max_len = _check_int("max_len", self.max_len, 1, MAX_LEN_MAX)
        # Stored as plain ints: a NumPy integer would otherwise stay in the fields (and the repr).
        object.__setattr__(self, "num_heads", heads)
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "max_len", max_len)
        self._set_device(torch.device("cpu"))

    def _set_device(self, device: torch.device) -> None:
        object.__setattr__(self, "_device", device)
        # Shared by later specs (``_TABLES``), training ones too: never as inference tensors.
        tables = outside_inference_mode(
            lambda: _distance_tables(static_int(self.dim), static_int(self.max_len), device)
        )
        object.__setattr__(self, "_tables", tables)

    @property
    def device(self) -> torch.device:
        """Where the distance table (and so the ``score_mod``) lives."""
        return self.__dict__["_device"]

    def _fields(self) -> tuple[Any, ...]:
        # The device is part of the value: the score_mod captures a table on it.
        return (*super()._fields(), self.__dict__.get("_device"))

    def to(self, device: torch.device | str) -> Self:
        dev = _canonical_device(device)
        if dev == self.__dict__.get("_device"):
            return self
        moved = dataclasses.replace(self)
        moved._set_device(dev)
        return moved

    def head_ratios(self) -> list[float]:
        """``r_h = 8 (h + 1) / H`` for every query head ``h``: the bias of head ``h`` is divided by it."""
        return [8.0 * (h + 1) / self.num_heads for h in range(self.num_heads)]

    def distance_table(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """``[2 * max_len - 1]``: ``p_i . p_j - d'/2`` at index ``j - i + max_len - 1`` (before the
        head's ratio), float64 or float32, on :attr:`device`. Read it, never write to it."""
        t64, t32 = self.__dict__["_tables"]
        return t64 if dtype == torch.float64 else t32

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        if heads != self.num_heads:
            raise ValueError(
                f"Sandwich(num_heads={self.num_heads}) used on a problem with {heads} query heads; "
                f"build it with num_heads={heads}"
            )
        if max(q_len, kv_len) > self.max_len:
            raise ValueError(
                f"Sandwich(max_len={self.max_len}) covers sequences of at most {self.max_len} tokens, "
                f"got Lq={q_len}, Lkv={kv_len}; build it with max_len >= {max(q_len, kv_len)}"
            )

    def _make_score_mod(self, *, fast: bool) -> ScoreMod:
        t64, t32 = self.distance_table(torch.float64), self.distance_table(torch.float32)
        offset = static_int(self.max_len) - 1
        per_head = static_int(self.num_heads) / 8.0  # 1 / r_h = (H / 8) / (h + 1)

        def sandwich(score, b, h, q_idx, kv_idx):
            # float64 scores (tests) read the float64 table; kernels hand float32 ones.
            table = t64 if score.dtype == torch.float64 else t32
            head = (h + 1).to(table.dtype)
            return score + (table[kv_idx - q_idx + offset] * per_head / head).to(score.dtype)

        return sandwich

    def dense(self, scores: torch.Tensor) -> torch.Tensor:
        # Oracle, independent of the table: the inner products of the sinusoidal embeddings
        # themselves, [sin(i w_k), cos(i w_k)]_k, in float64.
        _, heads, q_len, kv_len = scores.shape
        if heads != self.num_heads:
            raise ValueError(f"Sandwich(num_heads={self.num_heads}) got scores with {heads} heads")
        half = self.dim // 2
        freq = torch.tensor(
            [10000.0 ** (-2.0 * k / self.dim) for k in range(1, half + 1)], dtype=torch.float64
        )

        def embed(n: int) -> torch.Tensor:
            angle = torch.arange(n, dtype=torch.float64)[:, None] * freq
            return torch.cat([angle.sin(), angle.cos()], dim=-1)  # [n, dim]

        inner = embed(q_len) @ embed(kv_len).T  # [Lq, Lkv]
        ratios = torch.tensor(self.head_ratios(), dtype=torch.float64).view(1, heads, 1, 1)
        bias = (inner - half) / ratios
        return scores + bias.to(scores.device, scores.dtype)

    @classmethod
    def typical_example(cls, q_len: int, kv_len: int, batch: int, heads: int) -> Spec:
        # The paper's d' = 128, a table just long enough for the problem.
        return cls(num_heads=heads, max_len=max(q_len, kv_len))

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        # The first does not depend on the lengths up to 512 (a compiled call with dynamic
        # shapes reuses one graph for it); the second is d' = 128 with a table exactly as long
        # as the problem (its last entries in use).
        return [
            cls(num_heads=heads, dim=16, max_len=max(512, q_len, kv_len)),
            cls(num_heads=heads, max_len=max(q_len, kv_len)),
        ]
