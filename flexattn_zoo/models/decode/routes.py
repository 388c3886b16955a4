"""Which routes a decode step may take: the names ``decode_step(backend=...)`` accepts
(:data:`DECODE_ROUTES`), the smallest page a flex kernel takes (:data:`MIN_FLEX_PAGE`), and what
keeps a step off the CPU's compiled flex kernel (:func:`_cpu_hazards`).
"""

from __future__ import annotations

from typing import Any

from flexattn_zoo.backends import BACKENDS

#: The smallest kv block (page) a flex kernel takes, per device type (others: any). CUDA: the
#: Triton kernels tile keys in blocks of >= 16 (tl.dot), which must divide the kv block.
MIN_FLEX_PAGE = {"cuda": 16}
#: What ``decode_step(backend=...)`` takes: "auto" and the routes that declare ``decode``.
DECODE_ROUTES = ("auto", *(b.name for b in BACKENDS if b.decode))


def _cpu_hazards(spec: Any, score: Any) -> tuple[str, ...]:
    """:meth:`Spec.flex_cpu_hazards` of the step's mask and score specs, each phrase once."""
    found = (*(spec.flex_cpu_hazards() if spec is not None else ()),
             *(score.flex_cpu_hazards() if score is not None else ()))  # fmt: skip
    return tuple(dict.fromkeys(found))
