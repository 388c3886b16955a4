"""Route choice pinned for a grid of problems on every generation (planning only, no kernels run).

``dispatch_pinned.json`` holds, per problem, the route ``backend="auto"`` picks (``-`` when none can
run it) and every route that accepts the problem when named. It was recorded from the dispatcher
before the route registry was reorganized; a refactor must leave every entry unchanged. A change
of the route order or of a route's capabilities that is meant updates the file:

    PYTHONPATH=. python tests/unit/test_dispatch_pinned.py    # rewrite dispatch_pinned.json
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from flexattn_zoo import _compat, masks, score_mods
from flexattn_zoo.dispatch import Problem, _verdicts, plan_problem

PINNED = Path(__file__).with_name("dispatch_pinned.json")
ARCHS = ("cpu", "sm80", "sm86", "sm90", "sm100")


def _masks(length: int = 1024) -> dict[str, Any]:
    doc = masks.Document.from_lengths([300, 500, length - 800])
    return {
        "none": None,
        "causal": masks.Causal(),
        "causal_br": masks.Causal(align="bottom_right"),
        "sliding": masks.SlidingWindow(left=127),
        "doc_causal": doc & masks.Causal(),
        "prefix": masks.PrefixLM(prefix_len=300),
        "prefix_rows": masks.PrefixLM(prefix_len=torch.tensor([3, 300])),
        "chunk_causal": masks.Chunked(size=256) & masks.Causal(),
        "chunk_unequal_causal": masks.Chunked(size=300) & masks.Causal(),
        "chunk": masks.Chunked(size=256),
    }


def _scores() -> dict[str, Any]:
    return {
        "none": None,
        "softcap": score_mods.SoftCap(cap=30.0),
        "softcap_approx": score_mods.SoftCap(cap=30.0, approx=True),
        "alibi": score_mods.Alibi(num_heads=16),
    }


#: Variations of the base problem (name -> Problem fields); each is tried with a few masks.
VARIATIONS: dict[str, dict[str, Any]] = {
    "d64": {"head_dim": 64},
    "d100": {"head_dim": 100},
    "d256": {"head_dim": 256},
    "fp16": {"dtype": torch.float16},
    "fp32": {"dtype": torch.float32},
    "fp64": {"dtype": torch.float64},
    "gqa": {"kv_heads": 4},
    "lse": {"return_lse": True},
    "det": {"deterministic": True},
    "lq_ne_lkv": {"q_len": 1000, "kv_len": 1200},
    "decode": {"q_len": 16, "kv_len": 4096, "kv_heads": 4},
    "nonpositive_scale": {"nonpositive_scale": True},
    "nonfinite": {"nonfinite": True},
    "huge_index": {"index_extent": 2**31},
    "big_dense": {"batch": 8, "q_len": 8192, "kv_len": 8192},
}


def _problem(arch: str, grad: bool, mask: Any, score: Any, **fields: Any) -> Problem:
    cpu = arch == "cpu"
    base: dict[str, Any] = dict(
        batch=2,
        heads=16,
        kv_heads=16,
        q_len=1024,
        kv_len=1024,
        head_dim=128,
        dtype=torch.float32 if cpu else torch.bfloat16,
        device_type="cpu" if cpu else "cuda",
        arch=arch,
        requires_grad=grad,
        mask=mask,
        score=score,
    )
    base.update(fields)
    return Problem(**base)


def cases() -> Iterator[tuple[str, Problem]]:
    """Every pinned problem with a readable id (the arch, FA4 availability is set by the caller)."""
    ms, ss = _masks(), _scores()
    for arch, grad, (mn, m), (sn, s) in itertools.product(ARCHS, (False, True), ms.items(), ss.items()):
        yield f"{arch}/{'fwdbwd' if grad else 'fwd'}/{mn}/{sn}", _problem(arch, grad, m, s)
    few = ("none", "causal", "doc_causal", "prefix", "chunk_causal")
    for arch, grad, mn, (vn, fields) in itertools.product(ARCHS, (False, True), few, VARIATIONS.items()):
        m = _masks(max(fields.get("q_len", 1024), fields.get("kv_len", 1024)))[mn]
        for sn in ("none", "softcap"):
            yield (
                f"{arch}/{'fwdbwd' if grad else 'fwd'}/{mn}/{sn}/{vn}",
                _problem(arch, grad, m, ss[sn], **fields),
            )


def verdict(p: Problem) -> str:
    """``"<auto route or -> <every route that accepts p, comma separated>"``."""
    try:
        plan = plan_problem(p)
    except ValueError:
        return "- " + ",".join(c.name for c in _verdicts(p) if c.accepted)
    return plan.backend + " " + ",".join(c.name for c in plan.candidates if c.accepted)


def record() -> dict[str, str]:
    """Verdicts of every case, without and with FA4 (flash_attn.cute) importable."""
    out: dict[str, str] = {}
    saved = _compat.flash_cute_available
    try:
        for fa4 in (False, True):
            _compat.flash_cute_available = lambda v=fa4: v  # type: ignore[misc]
            for name, p in cases():
                out[f"{'fa4' if fa4 else 'nofa4'}/{name}"] = verdict(p)
    finally:
        _compat.flash_cute_available = saved  # type: ignore[misc]
    return out


@pytest.fixture(scope="module")
def pinned() -> dict[str, str]:
    return json.loads(PINNED.read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def now() -> dict[str, str]:
    return record()


@pytest.mark.parametrize("arch", ARCHS)
def test_route_choice_is_pinned(arch: str, pinned: dict[str, str], now: dict[str, str]) -> None:
    mine = {k: v for k, v in now.items() if k.split("/")[1] == arch}
    want = {k: v for k, v in pinned.items() if k.split("/")[1] == arch}
    assert mine.keys() == want.keys()
    changed = {k: (want[k], mine[k]) for k in want if want[k] != mine[k]}
    assert not changed, f"{len(changed)} changed (pinned, now): {dict(list(changed.items())[:10])}"


if __name__ == "__main__":
    PINNED.write_text(json.dumps(record(), indent=0, sort_keys=True) + "\n")
    print(f"wrote {PINNED}")
