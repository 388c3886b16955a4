"""``sigmoid`` and ``relu``: activation (non-softmax) attention, computed through the lse.

Activation attention weighs each visible key by an elementwise function of its scaled score and
does not normalise the weights::

    out_i = sum_j w(s_ij) v_j          (softmax attention: exp(s_ij) v_j / sum_j exp(s_ij))

No attention kernel computes that, but a kernel that runs the score mod and returns the
log-sum-exp serves it exactly. The spec's ``score_mod`` returns the log-weight ``log w(s)``; the
kernel's softmax of the log-weights is ``out_i = sum_j w_ij v_j / W_i`` with ``lse_i = log W_i``,
``W_i = sum_j w_ij``, so ``out_i * exp(lse_i)`` is the activation output. ``fz.attention`` asks
the route for the lse and returns that product (computed in float32; float64 for float64 inputs).
Gradients reach q, k and v through both factors, so training needs a route whose lse is
differentiable: Triton ``flex`` on CUDA and ``dense`` (``flex_flash``'s backward has no lse
gradient and refuses training calls; SDPA, ``varlen`` and ``fa4`` apply no such score mod;
``flex_cpu`` returns no lse). ``return_lse=True`` returns ``log W_i`` (the row's log total
weight). A row that sees no key, or whose weights are all 0 (ReLU), gives 0. Partial results of
one row over disjoint key sets add up (``fz.merge_attention`` is for softmax partials).

Both families ship with the oracle the tests use (``dense``: the log-weights in float64 from an
independent formula); the reference attention (``fz.testing``) computes ``sum_j w_ij v_j``
directly, not through the lse.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from flexattn_zoo.registry import SCORES
from flexattn_zoo.spec import ScoreMod, ScoreSpec, Spec, keep_static_float, spec_dataclass, static_float
from flexattn_zoo.validation import check_integer, check_score_factor


@SCORES.register(name="sigmoid")
@spec_dataclass
class Sigmoid(ScoreSpec):
    """Sigmoid attention: ``out_i = sum_j sigmoid(s_ij + bias) v_j`` over the visible keys.

    ``s_ij`` is the scaled score (after any score spec chained before this one). The weights are
    not normalised; the sigmoid attention literature (Ramapuram et al., 2024, FlashSigmoid) takes
    ``bias = -log(n)`` for ``n`` keys, so that the weights of a row start near a total of 1:
    :meth:`for_length` builds that.

    Weight against score for ``bias = 0``::

        w
        1 |                  ______
          |              .-''
      0.5 +-----------.'-------------
          |       _.-'
        0 |______'
          -6            0            6   s

    Args:
        bias: a finite real number added to every score before the sigmoid (default 0).

    Runs through the lse (see the module docstring): the score mod is
    ``log sigmoid(x) = min(x, 0) - log1p(exp(-|x|))``, ``x = s + bias``, finite for every finite
    score, with the derivative ``sigmoid(-x)`` everywhere (``1/2`` at ``x = 0``).
    """

    bias: float = 0.0

    activation = True
    scalar_fields = frozenset({"bias"})

    def __post_init__(self) -> None:
        bias = check_score_factor("Sigmoid(bias=...)", self.bias)
        # Sigmoid(bias=-2) and Sigmoid(bias=-2.0) must be the same spec (same hash, same score_mod).
        keep_static_float(self, "bias", float(bias))

    @classmethod
    def for_length(cls, n_keys: int) -> Sigmoid:
        """``Sigmoid(bias=-log(n_keys))``, the bias FlashSigmoid recommends for ``n_keys`` keys."""
        n = check_integer("Sigmoid.for_length(n_keys=...)", n_keys)
        if n < 1:
            raise ValueError(f"Sigmoid.for_length(n_keys=...) must be an int >= 1, got {n}")
        return cls(bias=-math.log(n))

    def _make_score_mod(self, *, fast: bool) -> ScoreMod:
        bias = static_float(self, "bias")

        def log_sigmoid(score, b, h, q_idx, kv_idx):
            x = score + bias
            # log sigmoid(x) = neg - log1p(exp(neg - pos)) with pos = max(x, 0), neg = x - pos
            # (so neg - pos = -|x| <= 0: no overflow). Written with a where, not minimum/abs: FA4's
            # CuTe code generator has no minimum, and with pos taking x at 0 the derivative there
            # is sigmoid(0) = 1/2 (abs' and a where on x < 0 would both give 0 at x = 0).
            pos = torch.where(x < 0, torch.zeros_like(x), x)
            neg = x - pos
            return neg - torch.log1p(torch.exp(neg - pos))

        return log_sigmoid

    def dense(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.logsigmoid(scores + self.bias)

    @classmethod
    def typical_example(cls, q_len: int, kv_len: int, batch: int, heads: int) -> Spec:
        return cls.for_length(max(kv_len, 1))

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        # No bias (weights near 1/2 for unit-scale scores) and the length bias.
        return [cls(), cls.for_length(max(kv_len, 1))]


@SCORES.register(name="relu")
@spec_dataclass
class Relu(ScoreSpec):
    """ReLU attention: ``out_i = sum_j relu(s_ij + offset) ** power / divisor * v_j``.

    ``s_ij`` is the scaled score. ``divisor`` rescales every weight: ReLU attention for vision
    transformers (Wortsman et al., 2023) divides by the sequence length, ``divisor = n``; squared
    ReLU (``power = 2``) is another common choice. Keys whose shifted score is <= 0 get weight 0.

    Args:
        power: a real number > 0 (default 1).
        offset: a finite real number added to every score before the ReLU (default 0).
        divisor: a real number > 0 every weight is divided by (default 1).

    Runs through the lse (see the module docstring): the score mod is
    ``power * log(s + offset) - log(divisor)`` where ``s + offset > 0``, else ``-inf`` (weight 0;
    its gradient is 0, as ReLU's). The three numbers are constants of the compiled kernel: under
    ``torch.compile`` a divisor that follows the sequence length compiles once per length.
    """

    power: float = 1.0
    offset: float = 0.0
    divisor: float = 1.0

    activation = True
    scalar_fields = frozenset({"power", "offset", "divisor"})

    def __post_init__(self) -> None:
        for name in ("power", "divisor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Real):
                raise TypeError(f"Relu({name}=...) must be a real number, got {type(value).__name__}")
            if not (math.isfinite(value) and float(value) > 0):
                raise ValueError(f"Relu({name}=...) must be finite and > 0, got {value!r}")
        power = check_score_factor("Relu(power=...)", self.power, reciprocal=True)
        divisor = check_score_factor("Relu(divisor=...)", self.divisor, reciprocal=True)
        offset = check_score_factor("Relu(offset=...)", self.offset)
        for name, value in (("power", power), ("offset", offset), ("divisor", divisor)):
            keep_static_float(self, name, float(value))

    def _make_score_mod(self, *, fast: bool) -> ScoreMod:
        power, offset = static_float(self, "power"), static_float(self, "offset")
        log_divisor = math.log(static_float(self, "divisor"))

        def log_relu(score, b, h, q_idx, kv_idx):
            x = score + offset
            positive = x > 0
            # log of x where x > 0 only: the other branch's log(1) = 0 keeps its gradient finite.
            log_x = torch.log(torch.where(positive, x, torch.ones_like(x)))
            return torch.where(positive, power * log_x - log_divisor, torch.full_like(x, -math.inf))

        return log_relu

    def dense(self, scores: torch.Tensor) -> torch.Tensor:
        relu = torch.clamp(scores + self.offset, min=0.0)
        positive = relu > 0
        # -inf where the weight is 0 (the reference hides the key); the log is taken of positive
        # values only, so its gradient is finite everywhere (log(0)' would give 0 * inf = NaN).
        weights = torch.where(positive, relu, torch.ones_like(relu)) ** self.power / self.divisor
        return torch.where(positive, torch.log(weights), torch.full_like(relu, -math.inf))

    @classmethod
    def typical_example(cls, q_len: int, kv_len: int, batch: int, heads: int) -> Spec:
        return cls(divisor=float(max(kv_len, 1)))

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        # A shifted squared ReLU, and plain ReLU divided by the length.
        return [cls(power=2.0, offset=0.5), cls(divisor=float(max(kv_len, 1)))]
