"""The description of one attention call that backends inspect (no tensors needed)."""

from __future__ import annotations

import dataclasses

import torch

from flexattn_zoo.spec import MaskSpec, ScoreSpec


@dataclasses.dataclass(frozen=True)
class Problem:
    """Everything a backend needs to decide whether it can run a call exactly.

    ``mask`` is already bound to the lengths (``spec.bind(Lq, Lkv)``); ``None`` means no mask.
    ``user_block_mask`` is set when the caller passed a BlockMask instead of a spec.
    ``deterministic`` asks for bitwise run-to-run reproducible forward and backward.
    ``nonfinite`` is True when q/k/v are known to hold NaN/inf; ``fz.attention`` only looks on
    the CPU, where the check costs no device synchronization, and there only where the verdict
    can change the route (``Backend.reads_finiteness``); ``fz.plan`` always looks there.
    ``index_extent`` is the largest element offset + 1 that a kernel reads in any of q/k/v (from
    their sizes and strides: an expanded tensor counts once); 0 when unknown.

    While ``torch.compile`` traces with dynamic shapes, ``batch``, ``q_len``, ``kv_len`` and
    ``index_extent`` may be ``torch.SymInt``: routes compare them (Dynamo guards on the outcome)
    and pass them to tensor ops, never convert them to Python ints.
    """

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: torch.dtype
    device_type: str
    arch: str
    requires_grad: bool
    mask: MaskSpec | None = None
    score: ScoreSpec | None = None
    return_lse: bool = False
    v_dim: int | None = None
    user_block_mask: bool = False
    deterministic: bool = False
    nonfinite: bool = False
    index_extent: int = 0
    #: ``scale <= 0`` was asked for: torch's CPU flash kernel returns NaN rows for causal calls then.
    nonpositive_scale: bool = False
    #: The caller's flex ``kernel_options`` (sorted ``(name, value)`` pairs), or None. Only the flex
    #: routes take them; every other route refuses a problem that has them.
    kernel_options: tuple[tuple[str, object], ...] | None = None
    #: SDPA's ``dropout_p``: each attention probability is zeroed with this probability and the
    #: kept ones scaled by ``1 / (1 - dropout_p)``. 0.0 (no dropout) leaves every verdict as it
    #: was; above it only the routes whose kernels drop (``Backend.dropout_devices``) accept.
    dropout_p: float = 0.0
    #: Called eagerly under ``torch.func.vmap`` / ``grad`` / ``jvp``
    #: (``_compat.under_func_transform``): routes that run something such a transform cannot call
    #: (a torch.compile'd kernel, an autograd.Function without functorch rules) refuse, saying
    #: what (``Backend.func_transform_blocker``).
    func_transform: bool = False

    def __post_init__(self) -> None:
        if self.v_dim is None:
            object.__setattr__(self, "v_dim", self.head_dim)
        # Problems are also built by hand (CLI `plan`, tests), not only from tensors: reject sizes
        # no call could have, so a plan never describes an impossible problem.
        for name in ("batch", "heads", "kv_heads", "head_dim", "v_dim", "q_len", "kv_len"):
            value = getattr(self, name)
            low = 0 if name in ("batch", "q_len", "kv_len") else 1
            if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)) or value < low:
                raise ValueError(f"Problem {name} must be an int >= {low}, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"q heads ({self.heads}) must be a multiple of k/v heads ({self.kv_heads}) "
                "for grouped-query attention"
            )
        if not 0.0 <= self.dropout_p < 1.0:
            raise ValueError(f"Problem dropout_p must be in [0, 1), got {self.dropout_p!r}")
        if self.mask is not None:
            object.__setattr__(self, "mask", self.mask.bind(self.q_len, self.kv_len))

    def __hash__(self) -> int:
        # Cached: a flex route looks its prepared call up by problem on every call (the fields
        # are frozen; the specs among them cache their own hashes too).
        cached = self.__dict__.get("_hash_value")
        if cached is None:
            cached = hash(tuple([getattr(self, name) for name in _FIELD_NAMES]))
            object.__setattr__(self, "_hash_value", cached)
        return cached

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state.pop("_hash_value", None)  # specs hash their class names, which differ by process
        return state

    @property
    def mode(self) -> str:
        return "fwdbwd" if self.requires_grad else "fwd"

    @property
    def gqa(self) -> bool:
        return self.heads != self.kv_heads


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(Problem))
