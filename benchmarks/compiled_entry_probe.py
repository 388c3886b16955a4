"""Why the library's compiled flex entry costs more host time per call than compiled flex itself.

``host_layers_probe.py`` put the library's compiled entry (``CompiledFlex._fn``) 10 us above
``torch.compile(flex_attention)`` per call on the H200 (2 us on a CPU). This probe times, on the
same prebuilt BlockMask, inputs and kernel options, interleaved round by round, variants that
differ from one another in one respect each:

* ``torch.compile(flex_attention)`` as a user writes it, and with ``fullgraph=True``;
* the same with the backend given as a callable (Inductor's registered backend, wrapped), as the
  library passes it to count compiles;
* the library's wrapper function (``compile._template``) compiled with ``backend="inductor"``, and
  with the counting backend and ``fullgraph=True`` (what ``CompiledFlex`` does);
* the library's entry itself.

For each it prints the median and 10th-percentile host time per call and the number of Dynamo
cache entries (compiled graphs) on the code object.

    PYTHONPATH=. python benchmarks/compiled_entry_probe.py [--device cuda] [--shape 1x8x512x64]
"""

from __future__ import annotations

import argparse
import statistics
import types
from collections.abc import Callable
from typing import Any

import torch
from host_layers_probe import measure  # the same interleaved timing

from flexattn_zoo import _compat, masks
from flexattn_zoo.backends import BY_NAME
from flexattn_zoo.compile import CACHE, _template
from flexattn_zoo.dispatch import plan


def _fresh(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` with a code object of its own (its own Dynamo cache)."""
    code = fn.__code__.replace(co_name=name)
    fresh = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    fresh.__kwdefaults__ = fn.__kwdefaults__
    return fresh


def _entries(fn: Callable[..., Any]) -> int:
    code = getattr(fn, "__code__", None)
    if code is None:
        return -1
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

        return len(_debug_get_cache_entry_list(code))
    except Exception:  # a torch without the debug hook
        return -1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", default="1x8x512x64")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--chunk", type=int, default=50)
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b, h, length, d = (int(x) for x in args.shape.split("x"))
    q, k, v = (torch.randn(b, h, length, d, device=device, dtype=dtype) for _ in range(3))
    mask = masks.SlidingWindow(left=length // 4, right=0) & masks.Causal()
    chosen = plan(q, k, v, mask=mask, backend="flex" if device.type == "cuda" else "flex_cpu")
    prepared = BY_NAME[chosen.backend].prepared(chosen.problem, device)
    opts = prepared.options
    bm = prepared.block_mask
    scale = d**-0.5
    flex = _compat.flex_attention
    inductor = _compat.inductor_backend()

    def counting(gm: Any, example_inputs: Any) -> Any:
        return inductor(gm, example_inputs)

    raw = torch.compile(_fresh(flex, "raw_default"))
    raw_full = torch.compile(_fresh(flex, "raw_fullgraph"), fullgraph=True)
    raw_cb = torch.compile(_fresh(flex, "raw_callable_backend"), backend=counting)
    tmpl_ind = torch.compile(_fresh(_template(opts, False, False), "template_inductor"))
    tmpl_lib = torch.compile(
        _fresh(_template(opts, False, False), "template_as_library"), backend=counting, fullgraph=True
    )
    entry = CACHE.get_keyed(prepared.key, prepared.options, prepared.lse, prepared.gqa)

    calls: dict[str, Callable[[], Any]] = {
        "torch.compile(flex_attention)": lambda: raw(
            q, k, v, block_mask=bm, scale=scale, kernel_options=opts
        ),
        "  fullgraph=True": lambda: raw_full(q, k, v, block_mask=bm, scale=scale, kernel_options=opts),
        "  backend=callable (Inductor's, wrapped)": lambda: raw_cb(
            q, k, v, block_mask=bm, scale=scale, kernel_options=opts
        ),
        "library wrapper, backend='inductor'": lambda: tmpl_ind(q, k, v, bm, scale, None),
        "library wrapper, callable backend, fullgraph": lambda: tmpl_lib(q, k, v, bm, scale, None),
        "library entry (CompiledFlex._fn)": lambda: entry._fn(q, k, v, bm, scale, None),
    }
    fns = [raw, raw_full, raw_cb, tmpl_ind, tmpl_lib, entry._fn]
    samples = measure(calls, device, args.rounds, args.chunk)
    print(f"# torch {torch.__version__}, {device}, {args.shape} {dtype}, options {opts}")
    print(f"{'variant':<50} {'median':>8} {'p10':>8} {'graphs':>7}")
    for (name, values), fn in zip(samples.items(), fns, strict=True):
        inner = getattr(fn, "_torchdynamo_orig_callable", fn)
        print(
            f"{name:<50} {statistics.median(values):8.1f} {statistics.quantiles(values, n=10)[0]:8.1f} {_entries(inner):7d}"
        )


if __name__ == "__main__":
    main()
