"""Launching a decode step's attention: a flex call through a DecodeMask, planned once per
signature (:func:`_run_planned`, :func:`_run_and_keep`), ``fz.attention`` for the rest (:func:`_attend`), and how many
rows of a contiguous cache one flex launch can take (:func:`_rows_per_launch`).

``_rows_per_launch`` reads ``MAX_FLEX_ELEMENTS`` from this module's globals: a test that lowers
the limit patches it here (``flexattn_zoo.models.decode.launch``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from flexattn_zoo.backends.flex import MAX_FLEX_ELEMENTS
from flexattn_zoo.dispatch import _under_autocast, attention, plan
from flexattn_zoo.models.decode.mask import DecodeMask
from flexattn_zoo.models.decode.runs import _Run, run_signature


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, need_lse: bool, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fz.attention`` as ``(out, lse or None)``."""
    if need_lse:
        return attention(q, k, v, return_lse=True, **kwargs)
    return attention(q, k, v, **kwargs), None


def _rows_per_launch(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """How many batch rows of a contiguous cache one flex launch can take (see MAX_FLEX_ELEMENTS)."""
    per_row = max(math.prod(t.shape[1:]) for t in (k_cache, v_cache))  # elements of one row
    fit = max(1, (MAX_FLEX_ELEMENTS - 1) // max(per_row, 1))
    batch = k_cache.shape[0]
    # Equal slices (32 rows with room for 31: 16 + 16, not 31 + 1): fewer distinct batch sizes,
    # so fewer kernels to compile.
    return -(-batch // -(-batch // fit))


def _run_planned(
    dm: DecodeMask, q, k, v, bm, score, scale, gqa: bool, need_lse: bool, backend: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One flex call through ``dm``'s BlockMask, planned (validated, routed) once per signature
    (:func:`run_signature`). q/k/v are first cast as ``fz.attention`` casts them under
    ``torch.autocast``, so the plan, its signature and the kernel all see the dtype computed in."""
    out, lse, _ = _run_and_keep(dm, q, k, v, bm, score, scale, gqa, need_lse, backend)
    return out, lse


def _run_and_keep(
    dm: DecodeMask, q, k, v, bm, score, scale, gqa: bool, need_lse: bool, backend: str
) -> tuple[torch.Tensor, torch.Tensor | None, _Run]:
    """:func:`_run_planned`, also returning the run it launched (``decode_step`` keeps it)."""
    q, k, v = _under_autocast(q, k, v)
    sig = run_signature(q, k, v, score, scale, gqa, need_lse, backend)
    run = dm.runs.get(sig)
    if run is None:
        chosen = plan(
            q,
            k,
            v,
            mask=bm,
            score_mod=score,
            scale=scale,
            enable_gqa=gqa,
            backend=backend,
            return_lse=need_lse,
        )
        run = dm.runs.put(sig, _Run(chosen, bm, q.device, scale))
    out, lse = run(q, k, v, bm)
    return out, lse, run
