"""The backend contract: a route declares what it supports and lists reasons when it refuses.

A backend never guesses: ``reasons(problem)`` is empty only when ``run`` computes exactly the
attention the problem describes (same mask, score mod, scale, GQA grouping, lse convention).
"""

from __future__ import annotations

import dataclasses

import torch

from flexattn_zoo.arch import parse_arch
from flexattn_zoo.problem import Problem

LOW_PRECISION = frozenset({torch.float16, torch.bfloat16})
FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _dtype_names(dtypes: frozenset[torch.dtype]) -> str:
    return ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))


@dataclasses.dataclass(frozen=True)
class Backend:
    """Declarative capabilities shared by every route; subclasses add mask-form checks and ``run``."""

    name: str
    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    head_dims: tuple[int, int] = (1, 1024)  # inclusive range
    head_dim_multiple: int = 1
    min_cc: tuple[int, int] | None = None
    max_cc: tuple[int, int] | None = None
    score_mods: bool = False
    lse: bool = False
    backward: bool = True
    gqa: bool = True
    doc: str = ""

    # -- machine-level ------------------------------------------------------------------------
    def unavailable_reasons(self) -> list[str]:
        """Why this route cannot run on this machine at all (imports, torch version); [] if it can."""
        return []

    # -- problem-level ------------------------------------------------------------------------
    def reasons(self, p: Problem) -> list[str]:
        """Every reason this route refuses ``p``; empty means it runs ``p`` exactly."""
        out = list(self.unavailable_reasons())
        if p.device_type not in self.devices:
            out.append(f"runs on {'/'.join(sorted(self.devices))}, not {p.device_type}")
        if p.dtype not in self.dtypes:
            out.append(f"dtype {str(p.dtype).removeprefix('torch.')} not in {{{_dtype_names(self.dtypes)}}}")
        lo, hi = self.head_dims
        if not lo <= p.head_dim <= hi or p.head_dim % self.head_dim_multiple:
            extra = f", multiple of {self.head_dim_multiple}" if self.head_dim_multiple > 1 else ""
            out.append(f"head dim {p.head_dim} outside {lo}..{hi}{extra}")
        if p.v_dim != p.head_dim:
            out.append(f"value head dim {p.v_dim} differs from q/k head dim {p.head_dim}")
        cc = parse_arch(p.arch) if p.device_type == "cuda" else None
        if cc is not None:
            if self.min_cc and cc < self.min_cc:
                out.append(f"needs compute capability >= {self.min_cc[0]}.{self.min_cc[1]}, have {p.arch}")
            if self.max_cc and cc > self.max_cc:
                out.append(f"needs compute capability <= {self.max_cc[0]}.{self.max_cc[1]}, have {p.arch}")
        if p.score is not None and not self.score_mods:
            out.append("cannot apply a score_mod")
        if p.return_lse and not self.lse:
            out.append("cannot return lse")
        if p.requires_grad and not self.backward:
            out.append("has no backward (inputs require grad)")
        if p.gqa and not self.gqa:
            out.append(f"no grouped-query attention ({p.heads} q heads vs {p.kv_heads} kv heads)")
        out.extend(self.mask_reasons(p))
        return out

    def mask_reasons(self, p: Problem) -> list[str]:
        """Reasons specific to the mask form this route needs (override)."""
        return []

    def run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: Problem, *, scale: float, block_mask: object = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Compute ``(out, lse or None)``; only called when ``reasons(p)`` is empty."""
        raise NotImplementedError
