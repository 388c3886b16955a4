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
#: The arch name of AMD GPUs under a ROCm (HIP) build of torch. Their devices are "cuda" devices to
#: torch and report a compute capability such as (9, 4) on MI300, which is no NVIDIA generation:
#: read as "sm94" they would be taken for Hopper and sent to cuDNN and FA4, which ROCm lacks.
ROCM = "rocm"


def parse_arch(arch: str) -> tuple[int, int] | None:
    """``"sm90"`` -> ``(9, 0)``, ``"sm86"`` -> ``(8, 6)``, ``"sm100"`` -> ``(10, 0)``; ``"cpu"`` and
    ``"rocm"`` (no NVIDIA compute capability) -> None."""
    if arch in ("cpu", ROCM):
        return None
    m = _ARCH.match(arch)
    if not m:
        raise ValueError(f"arch must look like 'sm80', 'sm90', 'sm100' or be 'cpu' or 'rocm', got {arch!r}")
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
    if torch.version.hip is not None:
        return ROCM
    major, minor = torch.cuda.get_device_capability(dev)
    return f"sm{major}{minor}"


def generation(arch: str) -> str:
    """Priority-table key of an arch: ``cpu``, ``rocm``, ``sm80``, ``sm86`` (sm86/sm89), ``sm90``, ``sm100``."""
    if arch == ROCM:
        return ROCM
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


# Route order per generation and mode: the first route that accepts a problem wins. Every name is
# a registered route (``backends.BY_NAME``); what a route can run lives with the route. sm90 is
# measured on an H200 (benchmarks/results/h200*.md); sm80/sm86/sm100 follow the same kernels'
# relative speeds, not measured here. A route that could run on a generation but is missing from
# its list is taken there only when named: "dense" on GPUs (it materializes Lq x Lkv), "sdpa_split"
# where it is not measured.
# On the CPU, sdpa_split (torch's flash kernel per part) beats flex_cpu on prefix-LM and is the only
# training route that does not materialize the scores (benchmarks/results/cpu_prefix.md).
PRIORITY: dict[str, dict[str, tuple[str, ...]]] = {
    "sm90": {
        "fwd": (
            "fa4",
            "flex_flash",
            "sdpa_cudnn",
            "sdpa_split",
            "flex",
            "varlen",
            "sdpa_flash",
            "sdpa_efficient",
            "sdpa_math",
        ),
        "fwdbwd": (
            "fa4",
            "flex_flash",
            "sdpa_cudnn",
            "sdpa_split",
            "flex",
            "varlen",
            "sdpa_flash",
            "sdpa_efficient",
            "sdpa_math",
        ),
    },
    "sm100": {
        "fwd": (
            "fa4",
            "flex_flash",
            "sdpa_cudnn",
            "flex",
            "varlen",
            "sdpa_flash",
            "sdpa_efficient",
            "sdpa_math",
        ),
        "fwdbwd": (
            "fa4",
            "flex_flash",
            "sdpa_cudnn",
            "flex",
            "varlen",
            "sdpa_flash",
            "sdpa_efficient",
            "sdpa_math",
        ),
    },
    "sm86": {
        "fwd": ("sdpa_flash", "sdpa_cudnn", "flex", "varlen", "sdpa_efficient", "sdpa_math"),
        "fwdbwd": ("sdpa_flash", "sdpa_cudnn", "flex", "varlen", "sdpa_efficient", "sdpa_math"),
    },
    "sm80": {
        "fwd": ("sdpa_flash", "sdpa_cudnn", "flex", "varlen", "sdpa_efficient", "sdpa_math"),
        "fwdbwd": ("sdpa_flash", "sdpa_cudnn", "flex", "varlen", "sdpa_efficient", "sdpa_math"),
    },
    # ROCm: only the routes built for it (``Backend.rocm``); not measured here -- SDPA's fused
    # kernels where the mask has an SDPA form, then Triton flex for everything else.
    ROCM: {
        "fwd": ("sdpa_flash", "sdpa_efficient", "flex", "sdpa_math"),
        "fwdbwd": ("sdpa_flash", "sdpa_efficient", "flex", "sdpa_math"),
    },
    "cpu": {
        "fwd": ("sdpa_flash", "sdpa_split", "flex_cpu", "sdpa_math", "dense"),
        "fwdbwd": ("sdpa_flash", "sdpa_split", "sdpa_math", "dense"),
    },
}

# Measured exceptions to the table above: (generation, mode, traits, routes moved to the front),
# applied in order when a problem has every listed trait (``dispatch.problem_traits``: "score_mod",
# "fast_score_mod" -- one that allows an approximation such as SoftCap(approx=True) --,
# "packed_segments" -- a mask of unequal segments, i.e. documents). Later entries win. On the H200
# (benchmarks/results/h200.md):
# - documents, forward: fa4 packs q/k/v into cu_seqlens order, which costs more than its kernel saves;
# - score mods: fa4's own soft-capping is slower than flex_flash's score_mod, and Triton's hardware
#   tanh (SoftCap(approx=True), which the CuTe path cannot emit) makes flex the fastest softcap forward.
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


def ordered_routes(gen: str) -> frozenset[str]:
    """Every route that generation ``gen``'s order names in either mode: those ``backend="auto"``
    may pick there (the others run there only when named)."""
    return frozenset(name for order in PRIORITY[gen].values() for name in order)
