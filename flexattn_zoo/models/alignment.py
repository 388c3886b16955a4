"""The alignment check of ``fz.Attention`` / ``attention_layer``: a layer's own mask is top-left
aligned (as SDPA's ``is_causal``), so a call with fewer queries than keys (a KV-cache step) lets
its queries see the cache's first keys, not its last ones. Where that changes what the last query
sees, the first such eager call warns once (:class:`TopLeftCheck`); the output is unchanged."""

from __future__ import annotations

import inspect
import os
import sys
import warnings
from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

from flexattn_zoo import _compat

__all__ = ["TopLeftCheck", "functional_check", "plain_4d"]


def plain_4d(t: object) -> bool:
    """Whether ``t`` is a tensor whose 4-D shape may be read (a strided nested tensor's ``.shape``
    raises): the layer reads head counts only from these, and leaves anything else to
    ``check_qkv``, which names what is wrong with it."""
    return isinstance(t, torch.Tensor) and not t.is_nested and t.dim() == 4


#: How many distinct ``(Lq, Lkv)`` pairs with ``Lq < Lkv`` one mask is checked at
#: (:class:`TopLeftCheck`) before the checks stop: a decode loop meets a new pair every step, and a
#: mask whose last rows agreed at this many pairs is taken as one that agrees.
_TOP_LEFT_CHECKS = 32


class TopLeftCheck:
    """Whether a layer's own mask, top-left aligned as SDPA's ``is_causal``, is called with fewer
    queries than keys (a KV-cache step?) where that alignment changes what the queries see.

    ``seen`` holds the ``(Lq, Lkv)`` pairs checked; None once done (one warning given, or
    :data:`_TOP_LEFT_CHECKS` pairs checked without one), after which ``_run`` asks nothing more.
    Only masks with a plain key (Python values only: no tensor, callable or BlockMask) are
    evaluated, on the CPU; others are recorded as checked and never warned about."""

    __slots__ = ("mask", "seen", "who")

    def __init__(self, mask: Any, who: str) -> None:
        self.mask = mask
        self.who = who
        self.seen: set[tuple[int, int]] | None = set()

    def check(self, q: Any, k: Any, lq: int, lkv: int) -> None:
        seen = self.seen
        if seen is None:
            return
        seen.add((lq, lkv))
        if len(seen) >= _TOP_LEFT_CHECKS:
            self.seen = None
        if not (plain_4d(q) and plain_4d(k)):
            return
        rows = _last_rows(self.mask, lq, lkv)
        if rows is None or torch.equal(rows[0], rows[1]):
            return
        self.seen = None  # one warning per layer (a decode loop would meet a new Lkv every step)
        warnings.warn(
            f"{self.who}: this layer's mask ({self.mask!r}) is top-left aligned, as SDPA's is_causal: "
            f"with Lq={lq} < Lkv={lkv} (a KV-cache step?) the last query sees {_keys(rows[0])}, where "
            f"a cache step would let it see {_keys(rows[1])}. For decoding use fz.decode.decode_step, "
            "or give the layer a bottom-right mask (e.g. masks.Causal(align='bottom_right')).",
            UserWarning,
            stacklevel=_callers_level(),
        )


def _last_rows(mask: Any, lq: int, lkv: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The keys (bool ``[Lkv]``, batch 0 and head 0) that the last query sees with ``mask`` bound
    to ``Lq x Lkv``, and that the last query of the square ``Lkv x Lkv`` problem sees; None where
    the mask cannot be evaluated cheaply and safely (no plain key, or its ``mask_mod`` raises)."""
    plain_key = getattr(mask, "plain_key", None)
    if plain_key is None or plain_key() is None:
        return None
    try:
        with torch.device("cpu"), torch.no_grad():
            zero = torch.zeros((), dtype=torch.int32)  # int32 indices, as the flex kernels pass
            keys = torch.arange(lkv, dtype=torch.int32)

            def last_row(q_len: int) -> torch.Tensor:
                last = torch.tensor(q_len - 1, dtype=torch.int32)
                seen = torch.as_tensor(mask.bind(q_len, lkv).mask_mod()(zero, zero, last, keys))
                return torch.broadcast_to(seen, (lkv,)).to(torch.bool)

            return last_row(lq), last_row(lkv)
    except Exception:  # a spec the check cannot evaluate: no warning (the call itself decides)
        return None


def _keys(row: torch.Tensor) -> str:
    """``"3 keys (0..2)"``: how many keys a row shows, and which where they are one run."""
    idx = torch.nonzero(row).flatten().tolist()
    if not idx:
        return "no key"
    if len(idx) == 1:
        return f"1 key ({idx[0]})"
    run = f" ({idx[0]}..{idx[-1]})" if idx[-1] - idx[0] == len(idx) - 1 else ""
    return f"{len(idx)} keys{run}"


_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # flexattn_zoo/
_MODULE_FILE = os.path.abspath(inspect.getfile(nn.Module))


def _callers_level() -> int:
    """``stacklevel`` for a warning given in this package that names the caller's line: the first
    frame outside ``flexattn_zoo`` and ``nn.Module``'s call machinery."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not (name.startswith(_HERE + os.sep) or name == _MODULE_FILE):
            break
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


#: ``attention_layer``'s checks, one per plain mask key (bounded: cleared when full).
_FUNCTIONAL_CHECKS: dict[Hashable, TopLeftCheck] = {}


def functional_check(mask: Any) -> TopLeftCheck | None:
    """The check ``attention_layer`` runs for ``mask`` (one per mask value, as the function keeps
    no state of its own); None while traced, or for a mask without a plain key."""
    if mask is None or _compat.is_compiling():
        return None
    key = mask.plain_key() if hasattr(mask, "plain_key") else None
    if key is None:
        return None
    check = _FUNCTIONAL_CHECKS.get(key)
    if check is None:
        if len(_FUNCTIONAL_CHECKS) >= 256:
            _FUNCTIONAL_CHECKS.clear()
        check = _FUNCTIONAL_CHECKS[key] = TopLeftCheck(mask, "fz.layers.attention_layer")
    return check
