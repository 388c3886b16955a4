"""Input checks shared by the public entry points and the reference.

Every failure is a ``ValueError``/``TypeError`` naming the argument and what would be valid, so
nothing crashes deep inside torch.
"""

from __future__ import annotations

import dataclasses
import math
import os
from numbers import Integral, Real
from typing import Any

import torch

from flexattn_zoo import _compat

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Devices some route runs on; anything else (meta, mps, xpu...) is refused before planning.
SUPPORTED_DEVICES = ("cpu", "cuda")

#: Largest magnitude of a number that kernels multiply scores by (``scale``, ``SoftCap``'s ``cap``
#: and ``1 / cap``, ``Alibi`` slopes). Every route computes scores in float32 (bfloat16 has the same
#: exponent range; float16 inputs are upcast), so such a factor must be a finite float32 -- and
#: the product of the factor with a score must be too. Splitting float32's range evenly between
#: the two, ``sqrt(finfo(float32).max)`` ~ 1.8e19, guarantees that for every score up to the same
#: bound; its reciprocal (~5.4e-20) is still a normal float32, so ``1 / cap`` is not flushed to
#: zero on GPUs either. One rule for every such factor.
SCORE_FACTOR_MAX = math.sqrt(torch.finfo(torch.float32).max)


@dataclasses.dataclass(frozen=True)
class Shape:
    """Sizes of one attention problem (layout ``[B, H, L, D]``)."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    v_dim: int


def check_flag(name: str, value: object) -> bool:
    """``value`` if it is a real bool; a truthy int or string is a typo we refuse to guess about."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} {value!r}")
    return value


def check_integer(name: str, value: object) -> int:
    """``value`` as a plain int if it is an integer (numpy's integers too, as a config read with
    numpy gives them); TypeError naming ``name`` (e.g. ``"Sandwich(dim=...)"``) otherwise. ``bool``
    is refused although it subclasses ``int``. Range checks are the caller's."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def check_count(name: str, value: object) -> int:
    """``value`` as an int if it is an integer >= 1 (a number of heads, a layer period; numpy's
    integers too, as a config read with numpy gives them); ``name`` is how the message names the
    argument, e.g. ``"Attention(num_heads=...)"``. ``bool`` is refused although it subclasses
    ``int``: ``num_heads=True`` is a bug, not one head."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int >= 1, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def check_tolerance(name: str, value: object, *, positive: bool = False) -> float:
    """``value`` as a float if it is a finite real number ``>= 0`` (``> 0`` with ``positive``):
    for the knobs of the testing helpers, where NaN would make every comparison false and so
    every check pass, and a negative budget make every check fail."""
    wanted = "a finite number > 0" if positive else "a finite number >= 0"
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be {wanted}, got {type(value).__name__} {value!r}")
    f = float(value)
    if not math.isfinite(f) or f < 0 or (positive and f == 0):
        raise ValueError(f"{name} must be {wanted}, got {value!r}")
    return f


def check_score_factor(name: str, value: object, *, reciprocal: bool = False) -> float:
    """``value`` as a float if it is a real number a kernel may multiply scores by: finite and at
    most :data:`SCORE_FACTOR_MAX` in magnitude (with ``reciprocal``, ``1 / value`` is used as a
    factor too, so ``value`` must also be 0 or at least ``1 / SCORE_FACTOR_MAX`` in magnitude).
    TypeError for non-numbers, ValueError naming ``name`` and the valid range otherwise."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    try:
        f = float(value)
    except OverflowError:  # an int beyond float's range, e.g. 10**400
        f = math.inf
    low = 1.0 / SCORE_FACTOR_MAX if reciprocal else 0.0
    if not math.isfinite(f) or abs(f) > SCORE_FACTOR_MAX or (f != 0 and abs(f) < low):
        span = (
            f"{low:.3g} <= |value| <= {SCORE_FACTOR_MAX:.3g}"
            if reciprocal
            else f"|value| <= {SCORE_FACTOR_MAX:.3g}"
        )
        raise ValueError(
            f"{name} must be a finite number with {span} (scores are computed in float32; a larger "
            f"factor overflows it and gives NaN), got {value!r}"
        )
    return f


def check_scale(scale: object) -> float | None:
    """``None`` or a finite real number (as float) with ``|scale| <= SCORE_FACTOR_MAX``; TypeError
    for other types, ValueError for nan/inf and scales that overflow float32 scores."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, Real):
        got = f"{type(scale).__name__} {scale!r}"
        raise TypeError(f"scale must be None or a finite real number (e.g. 0.125), got {got}")
    try:
        value = float(scale)
    except OverflowError:  # an int beyond float's range, e.g. 10**400
        value = math.inf
    if not math.isfinite(value):
        raise ValueError(f"scale must be None or a finite number, got {scale!r}")
    return check_score_factor("scale", value)


def check_traced_scale(scale: object) -> float | None:
    """``check_scale`` while ``torch.compile`` traces, by comparisons alone: under dynamic shapes
    Dynamo makes a float read from an object (a module's ``scale``) symbolic, and cannot trace
    ``math.isfinite`` on it. The rule is the same (NaN and inf fail ``abs(x) <= max`` too);
    Dynamo guards on the comparison."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, Real):
        got = f"{type(scale).__name__} {scale!r}"
        raise TypeError(f"scale must be None or a finite real number (e.g. 0.125), got {got}")
    value = float(scale)
    if not abs(value) <= SCORE_FACTOR_MAX:
        raise ValueError(
            f"scale must be None or a finite number with |value| <= {SCORE_FACTOR_MAX:.3g}, got {scale!r}"
        )
    return value


def check_dropout_p(dropout_p: object) -> float:
    """``dropout_p`` as a float in ``[0, 1)`` (SDPA's meaning: the probability of zeroing each
    attention probability, the kept ones scaled by ``1 / (1 - dropout_p)``); ValueError naming it
    otherwise (bools, non-numbers, NaN, values outside ``[0, 1)``). Comparisons only, so a float
    Dynamo made symbolic is checked too (it guards on them); NaN fails ``0 <= x < 1``. None is
    0.0 (the default of the functions that take it)."""
    if dropout_p is None:
        return 0.0
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, Real):
        got = f"{type(dropout_p).__name__} {dropout_p!r}"
        raise ValueError(f"dropout_p must be a float in [0, 1) (0.0: no dropout), got {got}")
    value = float(dropout_p)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1) (0.0: no dropout), got {dropout_p!r}")
    return value


def env_number(name: str, default: float, *, unit: str = "") -> float:
    """The non-negative number in environment variable ``name`` (``default`` when unset or empty).

    The one parser of every numeric ``FLEXATTN_ZOO_*`` variable: ``inf`` (or ``infinity``, any
    case) means no limit; anything else that is not a number >= 0 (garbage, nan, negatives)
    raises a ValueError naming the variable and what it accepts.
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    what = f"a number >= 0{f' ({unit})' if unit else ''} or 'inf' for no limit"
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError(f"{name} must be {what}, got {raw!r}") from None
    if math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be {what}, got {raw!r}")
    return value


def check_device(t: torch.Tensor) -> None:
    """Refuse devices no route runs on (checked after q/k/v are known to share one device)."""
    if t.device.type not in SUPPORTED_DEVICES:
        raise ValueError(
            f"q, k, v are on device {t.device.type!r}; flexattn_zoo runs on: {', '.join(SUPPORTED_DEVICES)}"
        )


def check_device_arg(device: Any, arg: str = "device") -> torch.device:
    """``device`` (a ``torch.device`` or a string such as ``"cuda:0"``) as a ``torch.device`` that
    a route can run on and that this machine has: ValueError naming ``arg`` otherwise. Checked up
    front because torch's own refusals come from the first tensor made there: a RuntimeError for
    a malformed string, an AssertionError for CUDA on a CPU-only build."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        msg = f"{arg} must be a torch.device or a string like 'cpu' or 'cuda:0', got {device!r}"
        raise ValueError(msg) from exc
    if dev.type not in SUPPORTED_DEVICES:
        choices = ", ".join(SUPPORTED_DEVICES)
        raise ValueError(f"{arg} {str(dev)!r} has no attention route; use one of: {choices}")
    if dev.type == "cuda" and not _compat.is_compiling():
        # (Not while traced: Dynamo cannot put device_count() in a graph, and the traced call's
        # tensors are already on the device.)
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{arg} {str(dev)!r} is not available (no CUDA device); use 'cpu'")
        if dev.index is not None and dev.index >= count:
            raise ValueError(
                f"{arg} {str(dev)!r} is not available: this machine has {count} CUDA device(s), "
                f"cuda:0..cuda:{count - 1}"
            )
    return dev


def check_learned_devices(arg: str, spec: Any, device: torch.device) -> None:
    """Refuse a learned tensor (one that requires grad) of ``spec`` on a device other than q's:
    the routes would run on a copy made once, which the optimizer's updates of the caller's
    tensor never reach. Other spec tensors are immutable snapshots, copied once to q's device,
    but for one on the meta device, which holds no data to copy (a spec built under
    ``torch.device("meta")``): refused here, before the spec's checks read its values."""
    for t in spec.tensors():
        if t.requires_grad and t.device != device:  # (a learned meta tensor gets this message)
            raise ValueError(
                f"{arg}: {type(spec).__name__} holds a learned tensor (requires_grad) on {t.device}, "
                f"q is on {device}: move the tensor to q's device (a copy would not follow its updates)"
            )
        if t.is_meta and device.type != "meta":
            raise ValueError(
                f"{arg}: {type(spec).__name__} holds a tensor on the meta device (shapes only, no "
                f"values), q is on {device}: build the spec from real tensors, e.g. on q's device"
            )


def check_strided(name: str, t: torch.Tensor) -> None:
    """Refuse a sparse or nested tensor, naming ``name``: a strided nested tensor is a plain
    ``torch.Tensor`` whose ``.shape`` raises torch's "NestedTensorImpl doesn't support sizes"."""
    if t.is_sparse or t.is_nested:
        kind = "sparse" if t.is_sparse else "nested"
        raise TypeError(f"{name} must be a dense (strided) tensor, got a {kind} one")


def check_qkv(q: object, k: object, v: object, *, enable_gqa: bool = False) -> Shape:
    """Validate q/k/v and return their sizes."""
    check_flag("enable_gqa", enable_gqa)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape [B, H, L, D], got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dims [B, H, L, D] (like SDPA and flex), got shape {tuple(t.shape)}"
            )
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32, float64")
        check_strided(name, t)
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    b, hq, lq, d = q.shape
    bk, hk, lk, dk = k.shape
    bv, hv, lv, dv = v.shape
    if not (b == bk == bv):
        raise ValueError(f"batch size (dim 0) differs: q={b}, k={bk}, v={bv}")
    if hk != hv:
        raise ValueError(f"k and v must have the same number of heads (dim 1), got k={hk}, v={hv}")
    if lk != lv:
        raise ValueError(f"k and v must have the same length (dim 2), got k={lk}, v={lv}")
    if d != dk:
        raise ValueError(f"q and k head dims (dim 3) differ: q={d}, k={dk}")
    if hq != hk:
        if not enable_gqa:
            raise ValueError(
                f"q has {hq} heads but k/v have {hk}; pass enable_gqa=True for grouped-query attention"
            )
        if hk == 0 or hq % hk != 0:
            raise ValueError(f"enable_gqa=True needs q heads ({hq}) to be a multiple of k/v heads ({hk})")
    if min(hq, hk, d) == 0:
        # (An empty batch is valid, as empty lengths are: SDPA gives an empty output.)
        raise ValueError(
            f"heads and head dim must be positive (only the batch and lengths may be 0), got q shape "
            f"{tuple(q.shape)}, k shape {tuple(k.shape)}"
        )
    return Shape(batch=b, heads=hq, kv_heads=hk, q_len=lq, kv_len=lk, head_dim=d, v_dim=dv)


def qkv_acceptable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: object) -> bool:
    """Whether :func:`check_qkv` accepts these tensors (``type(x) is torch.Tensor`` each), as a
    few comparisons without building messages or sizes: for paths whose whole host time is a few
    tens of microseconds (a decode step). Call :func:`check_qkv` when it is False, to raise with
    the reason."""
    q_shape, k_shape, v_shape = q.shape, k.shape, v.shape
    return (
        len(q_shape) == 4
        and len(k_shape) == 4
        and len(v_shape) == 4
        and q_shape[0] == k_shape[0] == v_shape[0]
        and k_shape[1] == v_shape[1]
        and k_shape[2] == v_shape[2]
        and aligned_qkv_acceptable(q, k, v, enable_gqa, q_shape, k_shape)
    )


def aligned_qkv_acceptable(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: object, q_shape: Any, k_shape: Any
) -> bool:
    """:func:`qkv_acceptable` for 4-D q/k/v whose caller has compared their shapes already: q, k
    and v agree in batch, k and v in heads and length (``q_shape``/``k_shape``: q's and k's
    shapes). The rest of its rules, without reading the shapes again."""
    dtype = q.dtype
    batch, heads, _, dim = q_shape
    kv_heads = k_shape[1]
    return (
        type(enable_gqa) is bool
        and dtype in SUPPORTED_DTYPES
        and k.dtype == dtype
        and v.dtype == dtype
        # One device: by type flags and CUDA indices where they say it (comparing torch.device
        # objects builds one per tensor), else by the devices.
        and (
            (k.is_cpu and v.is_cpu)
            if q.is_cpu
            else (k.is_cuda and v.is_cuda and q.get_device() == k.get_device() == v.get_device())
            if q.is_cuda
            else (k.device == q.device and v.device == q.device)
        )
        and not (q.is_sparse or k.is_sparse or v.is_sparse or q.is_nested or k.is_nested or v.is_nested)
        and k_shape[3] == dim
        and batch > 0  # stricter than check_qkv: an empty batch takes the callers' full path
        and heads > 0
        and kv_heads > 0
        and dim > 0
        and (heads == kv_heads or (enable_gqa and heads % kv_heads == 0))
    )


def inputs_nonfinite(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether q/k/v are known to hold NaN/inf: checked on the CPU only, where it costs no device
    synchronization (on CUDA, and while torch.compile traces us, where the data-dependent branch
    would break the graph, non-finite inputs go unchecked: False). Nor under ``torch.func.vmap``
    / ``grad`` / ``jvp``, which refuse reading a value: the route that reads the verdict
    (``flex_cpu``) refuses such calls anyway (``Problem.func_transform``)."""
    if q.device.type != "cpu" or _compat.is_compiling() or _compat.under_func_transform():
        return False
    # A tensor passed twice (self-attention with q is k is v) is read once.
    tensors = (q,) + ((k,) if k is not q else ()) + ((v,) if v is not q and v is not k else ())
    if q.requires_grad or k.requires_grad or v.requires_grad:
        with torch.no_grad():
            return not _all_finite_tensors(tensors)
    return not _all_finite_tensors(tensors)


def _all_finite_tensors(tensors: tuple[torch.Tensor, ...]) -> bool:
    for t in tensors:  # a plain loop, stopping at the first non-finite tensor (every CPU call)
        if not _all_finite(t):
            return False
    return True


#: The dtype of the quick sum per input dtype: float16 sums in float32 (its own range overflows).
_SUM_DTYPE = {torch.float16: torch.float32}


def _all_finite(t: torch.Tensor) -> bool:
    # A sum: NaN/inf anywhere in t make it NaN/inf (IEEE addition), so a finite sum proves every
    # element finite. Finite values can still overflow it (huge float32 / float64 values): then the
    # exact elementwise check decides, so the verdict is always exact. A sum in the input's own
    # precision (float32 accumulation for 16-bit inputs) is the fastest reduction torch has: 4x
    # the float64 sum this replaced at 1x8x512x64 float32, and no boolean map.
    if math.isfinite(t.sum(dtype=_SUM_DTYPE.get(t.dtype)).item()):
        return True
    return bool(torch.isfinite(t).all())
