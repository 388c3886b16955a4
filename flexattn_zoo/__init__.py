"""flexattn_zoo: programmable attention on the fastest exact kernel.

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods

out = fz.attention(q, k, v, mask=masks.SlidingWindow(left=1023))
out = fz.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, causal=True)  # [T, H, D]
print(fz.plan(q, k, v, mask="causal").explain())
with fz.tune.enabled():  # measured route choice: time the candidates once per kind of call
    out = fz.attention(q, k, v, mask="causal")
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

# In a source checkout, masks/ and score_mods/ sit beside this package instead of inside it; let
# the import system find them there as our subpackages. Checked by the checkout's own layout rather
# than by find_spec: with a second checkout installed editable, find_spec answers with that
# checkout's masks/ and this one would silently run another tree's masks and score mods.
_checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_checkout, "pyproject.toml")) and os.path.isfile(
    os.path.join(_checkout, "masks", "__init__.py")
):  # pragma: no cover - install-dependent
    __path__.append(_checkout)
elif importlib.util.find_spec("flexattn_zoo.masks") is None:  # pragma: no cover - install-dependent
    __path__.append(_checkout)
del _checkout

from flexattn_zoo import masks, score_mods  # noqa: E402
from flexattn_zoo import tuning as tune  # noqa: E402
from flexattn_zoo.backends.merge import merge_attention  # noqa: E402
from flexattn_zoo.blockmask import block_mask  # noqa: E402
from flexattn_zoo.compose import Chain  # noqa: E402
from flexattn_zoo.dispatch import Plan, attention, plan  # noqa: E402
from flexattn_zoo.functions import invalidate  # noqa: E402
from flexattn_zoo.models import layers, presets  # noqa: E402
from flexattn_zoo.models.layers import Attention  # noqa: E402
from flexattn_zoo.packed import varlen_attention  # noqa: E402
from flexattn_zoo.spec import MaskSpec, ScoreSpec  # noqa: E402

__all__ = [
    "Attention",
    "Chain",
    "MaskSpec",
    "Plan",
    "ScoreSpec",
    "attention",
    "block_mask",
    "decode",
    "invalidate",
    "layers",
    "masks",
    "merge_attention",
    "pages",
    "plan",
    "presets",
    "score_mods",
    "testing",
    "tune",
    "varlen_attention",
    "viz",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # fz.testing is imported on first use: it pulls in test-only helpers users may not need.
    # fz.decode, fz.pages and fz.viz likewise; fz.hf needs the optional 'hf' extra
    # (transformers), so it is never imported implicitly: ``import flexattn_zoo.hf``.
    lazy = {
        "testing": "flexattn_zoo.testing",
        "decode": "flexattn_zoo.models.decode",
        "pages": "flexattn_zoo.models.pages",
        "viz": "flexattn_zoo.viz",
    }
    if name in lazy:
        module = importlib.import_module(lazy[name])
        # Kept as a module attribute, so later ``fz.decode`` reads skip this function and the
        # import machinery (microseconds per read: per step in a decode loop).
        globals()[name] = module
        return module
    raise AttributeError(f"module 'flexattn_zoo' has no attribute {name!r}")
