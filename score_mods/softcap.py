"""``softcap``: squash scores smoothly into ``(-cap, cap)`` (Gemma 2, Grok)."""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Real

import torch

from flexattn_zoo.registry import SCORES
from flexattn_zoo.spec import (
    ScoreMod,
    ScoreSpec,
    SoftCapForm,
    Spec,
    keep_static_float,
    spec_dataclass,
    static_float,
)
from flexattn_zoo.validation import check_score_factor


@SCORES.register(name="softcap")
@spec_dataclass
class SoftCap(ScoreSpec):
    """Soft capping: the scaled score ``s`` becomes ``cap * tanh(s / cap)``.

    The curve for ``cap = 2`` (close to the identity near 0, flat at ``+-cap``)::

        out
         2 |                   _.-----------
           |                 /
         0 +----------------/----------------> in
           |               /
        -2 |-----------.-'
           -6              0              6

    Args:
        cap: Positive number in ``[1 / SCORE_FACTOR_MAX, SCORE_FACTOR_MAX]`` (~5.4e-20 .. 1.8e19,
            see ``validation.SCORE_FACTOR_MAX``); scores far beyond it are clipped to about ``+-cap``.
        approx: Allow a fast hardware ``tanh`` (an approximation, a few ulps off) on kernels that
            have one (``score_mod(fast=True)``); elsewhere and by default the exact ``torch.tanh``.
            The dense oracle is exact either way, so the testing tolerance absorbs the difference.

    Forms offered: ``softcap_form()`` is ``SoftCapForm(cap, approx)``, which kernels with a native
    soft-cap argument read.
    """

    cap: float
    approx: bool = False

    scalar_fields = frozenset({"cap", "approx"})  # a float and a bool (__post_init__)

    def __post_init__(self) -> None:
        cap = self.cap
        if isinstance(cap, bool) or not isinstance(cap, Real):
            raise TypeError(f"SoftCap(cap=...) must be a real number, got {type(cap).__name__}")
        if not (math.isfinite(cap) and cap > 0):
            raise ValueError(f"SoftCap(cap=...) must be finite and > 0, got {cap}")
        # The kernels multiply scores by 1/cap and tanh by cap: both must be score factors.
        cap = check_score_factor("SoftCap(cap=...)", cap, reciprocal=True)
        if not isinstance(self.approx, bool):
            raise TypeError(f"SoftCap(approx=...) must be a bool, got {type(self.approx).__name__}")
        # SoftCap(cap=30) and SoftCap(cap=30.0) must be the same spec (same hash, same score_mod).
        keep_static_float(self, "cap", float(cap))

    def static_cap(self) -> float:
        """``cap``, read so that ``torch.compile`` sees a constant (``spec.static_float``)."""
        return static_float(self, "cap")

    def _make_score_mod(self, *, fast: bool) -> ScoreMod:
        cap = self.static_cap()
        inv_cap = 1.0 / cap
        tanh = _fast_tanh() if (fast and self.approx) else None
        if tanh is not None:
            fast_tanh = tanh

            def softcap_fast(score, b, h, q_idx, kv_idx):
                return cap * fast_tanh(score * inv_cap)

            return softcap_fast

        def softcap(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score * inv_cap)

        return softcap

    def has_fast_variant(self) -> bool:
        return self.approx

    def dense(self, scores: torch.Tensor) -> torch.Tensor:
        # Independent of torch.tanh: tanh(x) = sign(x) * (1 - e) / (1 + e) with e = exp(-2|x|),
        # which never overflows (e <= 1) and keeps full relative precision near 0 via expm1.
        x = scores / self.cap
        em1 = torch.expm1(-2.0 * x.abs())
        return self.cap * torch.sign(x) * (-em1) / (2.0 + em1)

    def softcap_form(self) -> SoftCapForm | None:
        return SoftCapForm(cap=self.static_cap(), approx=self.approx)  # read while tracing too

    @classmethod
    def typical_example(cls, q_len: int, kv_len: int, batch: int, heads: int) -> Spec:
        # Grok's cap (Gemma 2 uses 50).
        return cls(cap=30.0)

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        # A large cap (nearly the identity, as in Gemma 2's 50) and a small one that bends
        # unit-scale scores hard.
        return [cls(cap=50.0), cls(cap=1.5, approx=True)]


def _fast_tanh() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The hardware tanh the lead's ``_compat`` exposes, or None (then exact ``torch.tanh``)."""
    from flexattn_zoo import _compat

    return _compat.fast_tanh_op()
