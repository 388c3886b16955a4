"""Host time of planning a call whose mask is built anew every step, as a training loop with
per-step document ids or a generation loop does: a preset (``Document & Causal``), a user's spec
class, and a raw closure, each over new tensors of the same shape every step (a plan-cache miss
every step). A user's function is probed before it is evaluated on index grids (whether a
broadcast call computes what flex's 0-d calls compute); this measures what that costs per step.

Times ``fz.plan`` (the route choice, no kernel), median over ``--steps`` steps after a warm-up,
cases interleaved step by step, so drift hits them alike.

    PYTHONPATH=. python benchmarks/per_step_spec_probe.py --steps 200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flexattn_zoo as fz  # noqa: E402
from flexattn_zoo import masks  # noqa: E402
from flexattn_zoo.spec import MaskMod, MaskSpec, spec_dataclass  # noqa: E402


@spec_dataclass
class UserDocs(MaskSpec):
    """A user's packed-documents spec (causal within each document)."""

    ids: torch.Tensor

    def _make_mask_mod(self) -> MaskMod:
        ids = self.ids

        def same_doc_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (ids[q_idx] == ids[kv_idx]) & (kv_idx <= q_idx)

        return same_doc_causal


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    n, dev = args.length, args.device
    q = torch.randn(1, 8, n, 64, device=dev)

    def ids(step: int) -> torch.Tensor:
        return (torch.arange(n, device=dev) >= 7 + step % (n - 8)).long()

    def closure(step: int) -> Any:
        d = ids(step)
        return lambda b, h, i, j: (d[i] == d[j]) & (j <= i)

    cases = {
        "preset Document(ids) & Causal()": lambda s: masks.Document(doc_ids=ids(s)) & masks.Causal(),
        "user spec UserDocs(ids)": lambda s: UserDocs(ids=ids(s)),
        "raw closure over ids": closure,
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for step in range(args.steps + 10):
        for name, make in cases.items():
            mask = make(step)
            t0 = time.perf_counter()
            fz.plan(q, q, q, mask=mask)
            if step >= 10:
                times[name].append(time.perf_counter() - t0)
    print(f"torch {torch.__version__}, {dev}, L={n}, {args.steps} steps after 10 warm-up steps")
    print("| mask built every step | plan median us | p90 us |")
    print("|---|---:|---:|")
    for name, ts in times.items():
        ts.sort()
        print(f"| {name} | {statistics.median(ts) * 1e6:.0f} | {ts[int(0.9 * len(ts))] * 1e6:.0f} |")


if __name__ == "__main__":
    main()
