"""Can the FA4 launches inside compiled flex (``BACKEND="FLASH"``) be replayed? (CUDA, FA4 installed)

torch's generated code for a FLASH-backend ``flex_attention`` imports
``flash_attn.cute.interface._flash_attn_fwd`` (``_flash_attn_bwd`` for the backward) inside the
kernel function and calls it on every call, with the score and mask functions defined anew per
call (tagged with a ``__cute_hash__``), the BlockMask's tensors, and preallocated outputs. This
probe wraps those two module attributes with :func:`flexattn_zoo.backends.fa4_replay.launch`,
keyed by every tensor argument's :func:`~flexattn_zoo.backends.fa4_replay.tensor_key`, the
functions' hashes and the plain arguments, and reports for each case:

* whether the generated code goes through the wrapper, and what the replay recorded or refused;
* the replayed results against unwrapped calls (forward bit for bit, gradients' largest
  difference);
* host time per call (``perf_counter`` around back-to-back calls, synchronized between runs;
  best of ``--repeat``), unwrapped against replayed, forward and forward+backward.

    python benchmarks/flex_flash_replay_probe.py
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch


def _flatten(value: Any, tensors: list[torch.Tensor]) -> Any:
    """A hashable picture of ``value`` with each tensor replaced by its key (and collected)."""
    from flexattn_zoo.backends import fa4_replay

    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return ("tensor", fa4_replay.tensor_key(value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_flatten(v, tensors) for v in value))
    if callable(value):
        cute_hash = getattr(value, "__cute_hash__", None)
        if cute_hash is None:
            raise LookupError(f"{value!r} has no __cute_hash__")
        return ("fn", cute_hash)
    hash(value)
    return value


def _rebuild(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return tensors.pop(0)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_rebuild(v, tensors) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuild(v, tensors) for v in value)
    return value


STATS: dict[str, int] = {"fwd": 0, "bwd": 0, "unkeyed": 0}


def _wrap(name: str, inner: Any, exact: bool) -> Any:
    from flash_attn.cute import interface

    from flexattn_zoo.backends import fa4_op, fa4_replay

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        STATS[name] += 1
        tensors: list[torch.Tensor] = []
        try:
            shape = _flatten((args, sorted(kwargs.items())), tensors)
        except (LookupError, TypeError):
            STATS["unkeyed"] += 1
            return inner(*args, **kwargs)

        def call(*inputs: torch.Tensor) -> Any:
            a, kw = _rebuild((args, sorted(kwargs.items())), list(inputs))
            return inner(*a, **dict(kw))

        key = (name, shape, *fa4_op._replay_key(tuple(tensors), interface))
        return fa4_replay.launch(key, interface, call, tensors, exact=exact)

    return wrapped


def _host_us(fn: Any, number: int, repeat: int, grad: bool = True) -> float:
    best = float("inf")
    with torch.set_grad_enabled(grad):
        for _ in range(3):
            fn()
        for _ in range(repeat):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            best = min(best, (t1 - t0) / number * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1x8x512x64,4x32x1024x128")
    ap.add_argument("--number", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    flex = torch.compile(flex_attention)

    def causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return q >= kv

    def softcap(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return 30.0 * torch.tanh(s / 30.0)

    for spec in args.shapes.split(","):
        B, H, L, D = (int(x) for x in spec.split("x"))
        mask = create_block_mask(causal, None, None, L, L, device="cuda")
        for label, score in (("causal", None), ("causal+softcap", softcap)):
            _case(flex, (B, H, L, D), mask, score, f"{spec} {label}", args)


def _case(flex: Any, shape: tuple[int, ...], mask: Any, score: Any, label: str, args: Any) -> None:
    from flash_attn.cute import interface

    from flexattn_zoo.backends import fa4_replay

    orig_fwd, orig_bwd = interface._flash_attn_fwd, interface._flash_attn_bwd
    torch.manual_seed(0)
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    opts = {"BACKEND": "FLASH"}

    def fwd() -> torch.Tensor:
        return flex(q, k, v, score_mod=score, block_mask=mask, kernel_options=opts)

    def step() -> None:
        fwd().backward(dout)

    def grads() -> tuple[torch.Tensor, ...]:
        q.grad = k.grad = v.grad = None
        step()
        return tuple(t.grad.clone() for t in (q, k, v))

    with torch.no_grad():
        want = fwd()
    want_g = grads()
    plain = (
        _host_us(fwd, args.number, args.repeat, grad=False),
        _host_us(step, args.number // 4, args.repeat),
    )
    interface._flash_attn_fwd = _wrap("fwd", orig_fwd, True)
    interface._flash_attn_bwd = _wrap("bwd", orig_bwd, False)
    fa4_replay.PROGRAMS.clear()
    try:
        for _ in range(3):
            with torch.no_grad():
                fwd()
            grads()
        entries = [(type(e).__name__, getattr(e, "reason", "")) for e in fa4_replay.PROGRAMS.values()]
        with torch.no_grad():
            got = fwd()
        got_g = grads()
        same = torch.equal(got.view(torch.int16), want.view(torch.int16))
        gdiff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got_g, want_g, strict=True))
        gscale = max(float(b.float().abs().max()) for b in want_g)
        replayed = (
            _host_us(fwd, args.number, args.repeat, grad=False),
            _host_us(step, args.number // 4, args.repeat),
        )
    finally:
        interface._flash_attn_fwd, interface._flash_attn_bwd = orig_fwd, orig_bwd
    print(f"\n{label}: wrapper calls {STATS}; entries {entries}")
    print(f"  forward bit-identical to unwrapped: {same}; grads max diff {gdiff:.3g} (largest {gscale:.3g})")
    print(
        f"  host us/call fwd: unwrapped {plain[0]:.1f}, replayed {replayed[0]:.1f};"
        f" fwd+bwd: unwrapped {plain[1]:.1f}, replayed {replayed[1]:.1f}"
    )


if __name__ == "__main__":
    main()
