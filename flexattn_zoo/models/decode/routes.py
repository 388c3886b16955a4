"""Which routes a decode step may take: the names ``decode_step(backend=...)`` accepts
(:data:`DECODE_ROUTES`) and the smallest page a flex kernel takes (:data:`MIN_FLEX_PAGE`).
"""

from __future__ import annotations

from flexattn_zoo.backends import BACKENDS

#: The smallest kv block (page) a flex kernel takes, per device type (others: any). CUDA: the
#: Triton kernels tile keys in blocks of >= 16 (tl.dot), which must divide the kv block.
MIN_FLEX_PAGE = {"cuda": 16}
#: What ``decode_step(backend=...)`` takes: "auto" and the routes that declare ``decode``.
DECODE_ROUTES = ("auto", *(b.name for b in BACKENDS if b.decode))
