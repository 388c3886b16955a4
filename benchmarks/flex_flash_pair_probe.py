"""Device time and host time of the ``flex_flash`` route next to the same flex call written by hand.

For zoo masks whose rows on ``flex_flash`` gained little over hand-written Triton flex, four calls
on each mask's typical example (a BlockMask built once from its mask_mod by
``create_block_mask``): compiled ``flex_attention`` with ``kernel_options={"BACKEND": "FLASH"}``
(``raw_flash``), the same on Triton (``raw_flex``), ``fz.attention(backend="flex_flash")`` and
``fz.attention`` on ``auto``. Each call is timed alone (a synchronization before it, CUDA events
around it): ``host ms`` is the wall time until the call returns (the launch queue is empty, so
a launch never waits for the device); ``device ms`` is the event time, from before the call is
issued to after its last kernel, so it holds the host's launch time too wherever the kernels
wait for it (it is not the kernels' time alone). ``back-to-back ms`` is the
event time with calls issued one after another, as the benchmark times them: when a call's host
time exceeds its device time, the device waits and this column shows the host.

    PYTHONPATH=. python benchmarks/flex_flash_pair_probe.py [--examples dilated_sliding_window block_select global_window] [--shape 2,16,4096,128]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import flexattn_zoo as fz
from flexattn_zoo import registry


def _alone(call: Callable[[], Any], iters: int) -> tuple[float, float]:
    """Median (device ms, host ms) of ``call`` timed alone, after a synchronization each time."""
    device, host = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        call()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize()
        device.append(start.elapsed_time(end))
    return statistics.median(device), statistics.median(host)


def _back_to_back(call: Callable[[], Any], iters: int) -> float:
    """Median event time of ``call`` issued back to back (no synchronization between calls)."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda.synchronize()
    for i in range(iters):
        starts[i].record()
        call()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def _rows(
    name: str, spec: Any, bm: Any, mode: str, shape: tuple[int, ...], compiled: Any, iters: int
) -> None:
    """The four calls' rows for one mask and mode (see the module docstring)."""
    grad = mode == "fwdbwd"
    dev, dtype = torch.device("cuda"), torch.bfloat16
    q, k, v = (torch.randn(*shape, device=dev, dtype=dtype, requires_grad=grad) for _ in range(3))
    dout = torch.randn(*shape, device=dev, dtype=dtype)
    forwards: dict[str, Callable[[], torch.Tensor]] = {
        "raw_flash": lambda: compiled(q, k, v, block_mask=bm, kernel_options={"BACKEND": "FLASH"}),
        "raw_flex": lambda: compiled(q, k, v, block_mask=bm),
        "fz flex_flash": lambda: fz.attention(q, k, v, mask=spec, backend="flex_flash"),
        "fz auto": lambda: fz.attention(q, k, v, mask=spec),
    }
    outs = {}
    for label, forward in forwards.items():

        def call(forward: Callable[[], torch.Tensor] = forward) -> torch.Tensor:
            if not grad:
                with torch.no_grad():
                    return forward()
            out = forward()
            out.backward(dout)
            q.grad = k.grad = v.grad = None
            return out

        try:
            outs[label] = call().detach().float()
            for _ in range(5):
                call()
            dev_ms, host_ms = _alone(call, iters)
            b2b = _back_to_back(call, iters)
        except Exception as exc:  # noqa: BLE001 - a probe: report and go on
            print(f"| {name} | {mode} | {label} | {type(exc).__name__}: {str(exc)[:80]} | | |")
            continue
        print(f"| {name} | {mode} | {label} | {dev_ms:.3f} | {host_ms:.3f} | {b2b:.3f} |", flush=True)
    if "raw_flash" in outs and "fz flex_flash" in outs:
        err = (outs["raw_flash"] - outs["fz flex_flash"]).abs().max().item()
        print(f"| {name} | {mode} | max abs diff raw_flash vs fz flex_flash | {err:.2e} | | |")
    print(f"| {name} | {mode} | auto's route: {fz.plan(q, k, v, mask=spec).backend} | | | |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--examples", nargs="+", default=["dilated_sliding_window", "block_select", "global_window"]
    )
    p.add_argument("--shape", default="2,16,4096,128", help="B,H,L,D")
    p.add_argument("--iters", type=int, default=40)
    args = p.parse_args()
    b, h, length, d = (int(n) for n in args.shape.split(","))
    dev, dtype = torch.device("cuda"), torch.bfloat16
    compiled = torch.compile(flex_attention)
    print(
        f"# B={b} H={h} L={length} D={d} {dtype}, {torch.cuda.get_device_name()}, torch {torch.__version__}\n"
    )
    print("| mask | mode | call | device ms | host ms | back-to-back ms |")
    print("|---|---|---|---:|---:|---:|")
    for name in args.examples:
        spec = registry.MASKS.entry(name).factory.typical_example(length, length, b, h).to(dev)
        bm = create_block_mask(
            spec.mask_mod(),
            b if spec.uses_batch() else None,
            h if spec.uses_head() else None,
            length,
            length,
            device=dev,
        )
        for mode in ("fwd", "fwdbwd"):
            _rows(name, spec, bm, mode, (b, h, length, d), compiled, args.iters)


if __name__ == "__main__":
    main()
