"""Which hardware generation a problem runs on, and the per-generation route priorities (data).

``FLEXATTN_ZOO_ARCH`` (e.g. ``sm90``, ``sm80``, ``cpu``) overrides the detected generation for CUDA
tensors, so dispatch tables can be unit-tested on a CPU-only machine.
"""

from __future__ import annotations

import os
import re

import torch

ARCH_ENV = "FLEXATTN_ZOO_ARCH"
_ARCH = re.compile(r"^sm(\d+)$")


def parse_arch(arch: str) -> tuple[int, int] | None:
    """``"sm90"`` -> ``(9, 0)``, ``"sm86"`` -> ``(8, 6)``, ``"sm100"`` -> ``(10, 0)``; ``"cpu"`` -> None."""
    if arch == "cpu":
        return None
    m = _ARCH.match(arch)
    if not m:
        raise ValueError(f"arch must look like 'sm80', 'sm90', 'sm100' or be 'cpu', got {arch!r}")
    digits = m.group(1)
    return int(digits[:-1]), int(digits[-1])


def detect_arch(device: torch.device | str | None = None) -> str:
    """The generation name of ``device``: ``"cpu"`` or ``"sm<major><minor>"``.

    The environment variable ``FLEXATTN_ZOO_ARCH`` wins for CUDA devices (and for ``device=None``).
    """
    override = os.environ.get(ARCH_ENV)
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cpu":
        return "cpu"
    if override:
        parse_arch(override)
        return override
    if dev is None:
        if not torch.cuda.is_available():
            return "cpu"
        dev = torch.device("cuda")
    if dev.type != "cuda":
        return dev.type
    major, minor = torch.cuda.get_device_capability(dev)
    return f"sm{major}{minor}"


def generation(arch: str) -> str:
    """Priority-table key of an arch: ``cpu``, ``sm80``, ``sm86`` (sm86/sm89), ``sm90``, ``sm100``."""
    cc = parse_arch(arch)
    if cc is None:
        return "cpu"
    if cc >= (10, 0):
        return "sm100"
    if cc >= (9, 0):
        return "sm90"
    if cc >= (8, 6):
        return "sm86"
    return "sm80"


# Route order per generation and mode: the first route that accepts a problem wins. sm90 comes
# from benchmarks/results/h200*.md (measured on an H200); the others follow the same kernels'
# relative speeds and are marked as not yet measured here. "dense" is never auto-picked on GPUs:
# it materializes Lq x Lkv and is only taken when asked for. sdpa_split (prefix-LM as two cuDNN
# parts) is measured only on sm90: 578 / 454 vs Triton flex 436 / 388, below flex_flash (680 / 566);
# and on the CPU (torch's flash kernel per part; benchmarks/results/cpu_prefix.md): prefix-LM
# fp32 forward 1.3-1.4x flex_cpu (1x8x2048x64, 1x8x4096x64), training 7.5x dense at 2K and the
# only route at 4K (dense would materialize 2 GiB of scores).
PRIORITY: dict[str, dict[str, tuple[str, ...]]] = {
    "sm90": {
        "fwd": ("fa4", "flex_flash", "sdpa_cudnn", "sdpa_split", "flex", "varlen", "sdpa_flash", "sdpa_efficient",
                "sdpa_math"),
        "fwdbwd": ("fa4", "flex_flash", "sdpa_cudnn", "sdpa_split", "flex", "varlen", "sdpa_flash",
                   "sdpa_efficient", "sdpa_math"),
    },
    "sm100": {
        "fwd": ("fa4", "flex_flash", "sdpa_cudnn", "flex", "varlen", "sdpa_flash", "sdpa_efficient", "sdpa_math"),
        "fwdbwd": ("fa4", "flex_flash", "sdpa_cudnn", "flex", "varlen", "sdpa_flash", "sdpa_efficient", "sdpa_math"),
    },
    "sm86": {
        "fwd": ("sdpa_flash", "sdpa_cudnn", "flex", "varlen", "sdpa_efficient", "sdpa_math"),
        "fwdbwd": ("sdpa_flash", "sdpa_cudnn", "flex", "varlen", "sdpa_efficient", "sdpa_math"),
    },
    "sm80": {
        "fwd": ("sdpa_flash", "sdpa_cudnn", "flex", "varlen", "sdpa_efficient", "sdpa_math"),
        "fwdbwd": ("sdpa_flash", "sdpa_cudnn", "flex", "varlen", "sdpa_efficient", "sdpa_math"),
    },
    "cpu": {
        "fwd": ("sdpa_flash", "sdpa_split", "flex_cpu", "sdpa_math", "dense"),
        "fwdbwd": ("sdpa_flash", "sdpa_split", "sdpa_math", "dense"),
    },
}

# Measured exceptions to the table above: (generation, mode, traits, routes moved to the front),
# applied in order when a problem has every listed trait (``dispatch.problem_traits``: "score_mod",
# "fast_score_mod" -- one that allows an approximation such as SoftCap(approx=True) --,
# "packed_segments" -- a mask of unequal segments, i.e. documents).
# Later entries win. H200 (benchmarks/results/h200.md, bf16 TFLOP/s):
# - documents, forward: fa4 packs q/k/v into cu_seqlens order, which costs more than its kernel
#   saves (document_causal: flex_flash 315 vs fa4 188; at D=64 149 vs 139; with GQA 342 vs 268);
# - score mods: fa4's own soft-capping is slower than flex_flash's score_mod (softcap_causal
#   334 / 378 vs 303 / 357); Triton's hardware tanh (SoftCap(approx=True), which the CuTe path
#   cannot emit) makes flex the fastest softcap forward (376 vs 334).
# (Documents at D=64 or with GQA once went to Triton flex because both FA4 routes looked unsteady
# there; the cause was a device sync in our spec comparison, fixed in 07f7535. Re-measured, the
# FA4 routes lead: document_causal_d64 149 / 235 vs flex 126 / 155.)
OVERRIDES: tuple[tuple[str, str, frozenset[str], tuple[str, ...]], ...] = (
    ("sm90", "fwd", frozenset({"packed_segments"}), ("flex_flash",)),
    ("sm90", "fwd", frozenset({"score_mod"}), ("flex_flash",)),
    ("sm90", "fwdbwd", frozenset({"score_mod"}), ("flex_flash",)),
    ("sm90", "fwd", frozenset({"fast_score_mod"}), ("flex",)),
)


def priority(arch: str, mode: str, traits: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """The ordered route names for ``arch`` in ``mode`` (``"fwd"`` or ``"fwdbwd"``) for a problem
    with ``traits`` (see ``OVERRIDES``)."""
    if mode not in ("fwd", "fwdbwd"):
        raise ValueError(f"mode must be 'fwd' or 'fwdbwd', got {mode!r}")
    gen = generation(arch)
    order = PRIORITY[gen][mode]
    for o_gen, o_mode, needs, front in OVERRIDES:
        if o_gen == gen and o_mode == mode and needs <= traits:
            order = front + tuple(r for r in order if r not in front)
    return order


# Triton flex kernel options per generation, applied to 16-bit inputs with the listed head dims.
# H200, causal B=4 H=16 L=8192 D=128 bf16: these forward tiles took flex from 403 to 431 TFLOP/s
# (benchmarks/README.md); the backward keeps torch's autotuned defaults.
FLEX_TRITON_OPTIONS: dict[str, tuple[tuple[int, ...], dict[str, int | bool]]] = {
    "sm90": ((128,), {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 3}),
}


def flex_triton_options(arch: str, head_dim: int, dtype: torch.dtype) -> dict[str, int | bool]:
    """Measured Triton kernel options for this generation/head dim, or {} (torch's defaults)."""
    entry = FLEX_TRITON_OPTIONS.get(generation(arch))
    if entry is None or dtype not in (torch.float16, torch.bfloat16) or head_dim not in entry[0]:
        return {}
    return dict(entry[1])
