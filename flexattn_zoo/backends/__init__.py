"""All routes, by name. Order here is only for display; dispatch order is ``arch.PRIORITY``.

A route is registered by listing it in ``BACKENDS``; the dispatcher, the plan cache's key,
``fz.decode``, the benchmark harness and the route tests all read the registered routes' facts.
"""

from __future__ import annotations

from flexattn_zoo.backends.base import Backend
from flexattn_zoo.backends.dense import DENSE
from flexattn_zoo.backends.fa4 import FA4
from flexattn_zoo.backends.flex import FLEX, FLEX_CPU, FLEX_FLASH
from flexattn_zoo.backends.sdpa import SDPA_CHOICE, SDPA_CUDNN, SDPA_EFFICIENT, SDPA_FLASH, SDPA_MATH
from flexattn_zoo.backends.split import SDPA_SPLIT
from flexattn_zoo.backends.varlen import VARLEN

BACKENDS: tuple[Backend, ...] = (
    SDPA_CHOICE,
    SDPA_CUDNN,
    SDPA_FLASH,
    SDPA_EFFICIENT,
    SDPA_MATH,
    SDPA_SPLIT,
    VARLEN,
    FLEX,
    FLEX_FLASH,
    FA4,
    FLEX_CPU,
    DENSE,
)
BY_NAME: dict[str, Backend] = {b.name: b for b in BACKENDS}

__all__ = ["BACKENDS", "BY_NAME", "Backend"]
