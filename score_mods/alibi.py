"""``alibi``: linear distance penalty per head (Press et al., "Train Short, Test Long")."""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real

import torch

from flexattn_zoo.registry import SCORES
from flexattn_zoo.spec import LinearBiasForm, ScoreMod, ScoreSpec, Spec, spec_dataclass, static_int
from flexattn_zoo.validation import check_integer, check_score_factor


def _exponent_pieces(num_heads: int) -> tuple[int, float, float, float, float]:
    """``(n, a1, b1, a2, b2)`` with ``log2(slope[h]) = a1*h + b1`` for ``h < n``, else ``a2*h + b2``.

    ``n`` is the largest power of two ``<= num_heads``. The first ``n`` slopes are the geometric
    sequence ``2^(-8(h+1)/n)``; the remaining ``num_heads - n`` are every other element (starting at
    the first) of the sequence for ``2n`` heads, ``2^(-8(2m+1)/(2n))`` with ``m = h - n``. Both
    pieces are affine in ``h``, which is what lets the kernel compute them with one ``exp2``.
    """
    n = 1 << (num_heads.bit_length() - 1)
    return n, -8.0 / n, -8.0 / n, -8.0 / n, 8.0 - 4.0 / n


def _check_num_heads(num_heads: object) -> int:
    heads = check_integer("Alibi(num_heads=...)", num_heads)
    if heads < 1:
        raise ValueError(f"Alibi(num_heads=...) must be >= 1, got {heads}")
    return heads


def _check_slopes(slopes: object, num_heads: int) -> tuple[float, ...] | None:
    if slopes is None:
        return None
    if isinstance(slopes, torch.Tensor):
        if slopes.requires_grad:
            # The slopes become Python floats in the score_mod: a learned tensor would get no
            # gradient and its optimizer steps would never be seen.
            raise TypeError(
                "Alibi(slopes=...) got a tensor that requires grad; ALiBi reads its slopes once, as "
                "floats (a snapshot), so it would neither train them nor see their updates. Pass "
                "slopes.detach() for fixed slopes, or learn them with a score_mod callable such as "
                "lambda score, b, h, q_idx, kv_idx: score - slopes[h] * (q_idx - kv_idx).abs()"
            )
        slopes = slopes.detach().cpu().reshape(-1).tolist()
    if isinstance(slopes, (str, bytes)) or not isinstance(slopes, Sequence):
        raise TypeError(
            f"Alibi(slopes=...) must be None or a sequence of {num_heads} floats, got {type(slopes).__name__}"
        )
    if len(slopes) != num_heads:
        raise ValueError(f"Alibi(slopes=...) needs num_heads={num_heads} values, got {len(slopes)}")
    out = []
    for s in slopes:
        if isinstance(s, bool) or not isinstance(s, Real):
            raise TypeError(f"Alibi(slopes=...) values must be real numbers, got {type(s).__name__}")
        out.append(check_score_factor("Alibi(slopes=...) values", s))
    return tuple(out)


@SCORES.register
@spec_dataclass
class Alibi(ScoreSpec):
    """ALiBi: subtract ``slope[h] * |i - j|`` from the scaled score of query ``i``, key ``j``.

    The bias for one head (``Lq = Lkv = 5``; ``s = slope[h]``; rows are queries, columns keys)::

          j:  0    1    2    3    4
        i=0   0   -s  -2s  -3s  -4s
        i=1  -s    0   -s  -2s  -3s
        i=2 -2s   -s    0   -s  -2s
        i=3 -3s  -2s   -s    0   -s
        i=4 -4s  -3s  -2s   -s    0

    Combine with ``masks.Causal()`` for the original decoder use (only the lower triangle is
    seen). ``h`` is the *query* head, also under grouped-query attention.

    ``signed=True`` adds ``slope[h] * (j - i)`` instead: the same penalty for keys before the query,
    a bonus growing with the distance for keys after it. That is attention-gym's ``alibi_mod``
    (``bias = (kv_idx - q_idx) * slope``), whose slopes ``2^(-8(h+1)/H)`` are this spec's default
    ones when ``H`` is a power of two (for other ``H`` pass them as ``slopes``). The two variants
    agree wherever the mask hides every later key (causal, left-only windows); only there is the
    signed one a penalty at all, so use it under such masks.

    Args:
        num_heads: Number of query heads of the problem; must match at run time.
        slopes: ``None`` for the slopes of Press et al. -- ``2^(-8(h+1)/H)`` when ``H`` is a power
            of two; otherwise the ``n`` slopes for the largest power of two ``n < H`` followed by
            every other slope (starting with the first) of the ``2n`` sequence -- or ``num_heads``
            floats of your own, each finite with ``|slope| <= SCORE_FACTOR_MAX`` (~1.8e19, see
            ``validation.SCORE_FACTOR_MAX``), stored as a tuple so the spec stays hashable. A
            tensor is read once (a snapshot); one that requires grad is refused (TypeError).
        signed: ``False`` (default): ``- slope * |i - j|``; ``True``: ``+ slope * (j - i)``.

    Under a mask that hides every later key (``Causal``, a left-only window, ...) flex routes run
    ``score_mod(future_keys_hidden=True)``, which uses ``i - j`` instead of ``|i - j|``.

    Default slopes are computed inline from ``h`` (one ``exp2`` of an affine function of ``h``),
    which measured clearly faster on the H200 than loading them from a captured tensor. Given
    slopes are a sum of indicators, ``sum_k (h == k) * slope_k``: it captures no tensor, so the
    same ``score_mod`` runs on any device without ``spec.to(device)`` (a captured table would be
    pinned to the device it was built on). Neither spelling selects a per-head value with
    ``torch.where``, which FA4's CuTe flex kernel multiplied by the distance wrongly (H100,
    flash-attn-4 4.0.0b36). In the Triton flex kernel ``h`` is one value per program, so the sum
    should cost scalar work per tile rather than per score; not timed on a GPU.

    Forms offered: ``linear_bias_form()`` is ``LinearBiasForm(slopes=tuple(head_slopes()))``: the
    score mod is an additive bias (not for ``signed=True``, which that form cannot state).
    """

    depends_on_head = True

    num_heads: int
    slopes: tuple[float, ...] | None = None
    signed: bool = False

    scalar_fields = frozenset({"num_heads", "slopes", "signed"})  # an int, floats, a bool (__post_init__)

    def __post_init__(self) -> None:
        if not isinstance(self.signed, bool):
            raise TypeError(f"Alibi(signed=...) must be a bool, got {type(self.signed).__name__}")
        num_heads = _check_num_heads(self.num_heads)
        # Frozen dataclass: normalise in place so equal parameters give equal (hashable) specs.
        object.__setattr__(self, "num_heads", num_heads)
        slopes = _check_slopes(self.slopes, num_heads)
        object.__setattr__(self, "slopes", slopes)
        # See static_slopes.
        object.__setattr__(self, "_slopes_text", None if slopes is None else tuple(map(repr, slopes)))

    def head_slopes(self) -> list[float]:
        """The ``num_heads`` slopes as Python floats (given ones, or Press et al.'s)."""
        if self.slopes is not None:
            return list(self.slopes)
        return _press_slopes(self.num_heads)

    def linear_bias_form(self) -> LinearBiasForm | None:
        return None if self.signed else LinearBiasForm(slopes=tuple(self.head_slopes()))

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        if heads != self.num_heads:
            raise ValueError(
                f"Alibi(num_heads={self.num_heads}) used on a problem with {heads} query heads; "
                f"build it with num_heads={heads}"
            )

    def static_slopes(self) -> tuple[float, ...] | None:
        """``slopes``, read so that ``torch.compile`` sees constants (as ``spec.static_float``:
        Dynamo makes floats read from an object symbolic under dynamic shapes, never a str)."""
        if "_slopes_text" not in self.__dict__:  # pickled before it was kept
            return self.slopes
        text = self.__dict__["_slopes_text"]
        return None if text is None else tuple(float(t) for t in text)

    def _make_score_mod(self, *, fast: bool) -> ScoreMod:
        # Signed: score - slope * (q_idx - kv_idx) everywhere, which is the unsigned spec's
        # past-only function (one function object serves both calls of a signed spec).
        signed = self.signed
        slopes = self.static_slopes()
        if slopes is None:
            return _inline_press_mod(static_int(self.num_heads), past_only=signed)
        return _selected_slopes_mod(slopes, past_only=signed)

    def _make_past_score_mod(self, *, fast: bool) -> ScoreMod:
        if self.signed:
            return self.score_mod(fast=fast)  # already without the abs
        # Where kv_idx <= q_idx, |q_idx - kv_idx| is q_idx - kv_idx. Dropping the abs measured on
        # the H200 (benchmarks/results/mod_spelling_probe_h200_v1.txt, causal B=4 H=16 L=8K D=128):
        # flex_flash 528 -> 567 / 535 -> 546 TFLOP/s, Triton flex 375 -> 401 / 365 -> 379.
        slopes = self.static_slopes()
        if slopes is None:
            return _inline_press_mod(static_int(self.num_heads), past_only=True)
        return _selected_slopes_mod(slopes, past_only=True)

    def dense(self, scores: torch.Tensor) -> torch.Tensor:
        # Independent of the score_mod: slopes from math.pow in a Python list, not from exp2 of h.
        _, heads, q_len, kv_len = scores.shape
        slopes = torch.tensor(self.head_slopes(), dtype=torch.float64, device=scores.device)
        if slopes.numel() != heads:
            raise ValueError(f"Alibi(num_heads={self.num_heads}) got scores with {heads} heads")
        i = torch.arange(q_len, dtype=torch.float64, device=scores.device)
        j = torch.arange(kv_len, dtype=torch.float64, device=scores.device)
        offset = j[None, :] - i[:, None]  # j - i
        bias = slopes.view(1, heads, 1, 1) * (offset if self.signed else -offset.abs())
        return scores + bias.to(scores.dtype)

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        given = tuple(0.5 / (k + 1) for k in range(heads))
        return [cls(num_heads=heads), cls(num_heads=heads, slopes=given), cls(num_heads=heads, signed=True)]


def _press_slopes(num_heads: int) -> list[float]:
    """Press et al.'s slopes written the textbook way (powers of a ratio), for the oracle."""

    def geometric(n: int) -> list[float]:
        ratio = math.pow(2.0, -8.0 / n)
        return [math.pow(ratio, k + 1) for k in range(n)]

    n = 1
    while n * 2 <= num_heads:
        n *= 2
    return geometric(n) + geometric(2 * n)[0::2][: num_heads - n]


def _compute_dtype(score: torch.Tensor) -> torch.dtype:
    # Kernels hand score_mods float32 scores; keep float64 when a test evaluates in float64.
    return torch.float64 if score.dtype == torch.float64 else torch.float32


def _distance(q_idx: torch.Tensor, kv_idx: torch.Tensor, past_only: bool) -> torch.Tensor:
    """``|q_idx - kv_idx|``, or ``q_idx - kv_idx`` when only pairs with ``kv_idx <= q_idx`` count."""
    diff = q_idx - kv_idx
    return diff if past_only else diff.abs()


def _inline_press_mod(num_heads: int, *, past_only: bool) -> ScoreMod:
    n, a1, b1, a2, b2 = _exponent_pieces(num_heads)

    def alibi_inline(score, b, h, q_idx, kv_idx):
        dtype = _compute_dtype(score)
        hf = h.to(dtype)
        if n == num_heads:
            exponent = hf * a1 + b1
        else:
            # Both exponents are finite, so the indicator picks one exactly (x * 1 + y * 0 == x);
            # not torch.where on h (functions.SELECTS_PER_HEAD).
            low = (h < n).to(dtype)
            exponent = (hf * a1 + b1) * low + (hf * a2 + b2) * (1 - low)
        return score - torch.exp2(exponent) * _distance(q_idx, kv_idx, past_only).to(dtype)

    return alibi_inline


def _selected_slopes_mod(slopes: tuple[float, ...], *, past_only: bool) -> ScoreMod:
    def alibi_given(score, b, h, q_idx, kv_idx):
        # One indicator is 1 and the others 0, so the sum is that head's slope exactly; not
        # torch.where on h (functions.SELECTS_PER_HEAD).
        dtype = _compute_dtype(score)
        slope = (h == 0).to(dtype) * slopes[0]
        for k in range(1, len(slopes)):
            slope = slope + (h == k).to(dtype) * slopes[k]
        return score - slope * _distance(q_idx, kv_idx, past_only).to(dtype)

    return alibi_given
