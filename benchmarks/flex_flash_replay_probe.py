"""Can the FA4 launches inside compiled flex (``BACKEND="FLASH"``) be replayed? (CUDA, FA4 installed)

torch's generated code for a FLASH-backend ``flex_attention`` imports
``flash_attn.cute.interface._flash_attn_fwd`` (``_flash_attn_bwd`` for the backward) inside the
kernel function and calls it on every call, with the score and mask functions defined anew per
call (tagged with a ``__cute_hash__``), the BlockMask's tensors, and preallocated outputs. This
probe wraps those two module attributes (``_Replayed``) so that calls from Inductor's generated
code go through :func:`flexattn_zoo.backends.fa4_replay.launch`, keyed by every tensor argument's
:func:`~flexattn_zoo.backends.fa4_replay.tensor_key`, the arguments' structure with the functions'
hashes and the plain values, and reports for raw compiled flex and for the library's flex_flash
route, per case:

* what the replay recorded or refused for each kind;
* the replayed results against unwrapped calls on new inputs (forward bit for bit, gradients'
  largest difference);
* host time per call (``perf_counter`` around back-to-back calls, synchronized between runs;
  best of ``--repeat``), unwrapped against replayed, forward and forward+backward.

    python benchmarks/flex_flash_replay_probe.py
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch


class _Replayed:
    """Stands in for FA4's launcher ``inner`` in ``flash_attn.cute.interface``: calls from code
    under Inductor's cache directory are replayed, others run ``inner``; FA4 reads its JIT
    cache through the module attribute, so ``compile_cache`` is ``inner``'s."""

    def __init__(self, inner: Any, name: str, exact: bool) -> None:
        self.__wrapped__, self.name, self.exact = inner, name, exact

    @property
    def compile_cache(self) -> Any:
        return self.__wrapped__.compile_cache

    @compile_cache.setter
    def compile_cache(self, value: Any) -> None:
        self.__wrapped__.compile_cache = value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import sys

        from flash_attn.cute import interface
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        from flexattn_zoo.backends import fa4_op, fa4_replay

        inner = self.__wrapped__
        if not sys._getframe(1).f_code.co_filename.startswith(cache_dir()):
            return inner(*args, **kwargs)
        tensors: list[torch.Tensor] = []
        try:
            shape = _shape((args, tuple(sorted(kwargs.items()))), tensors)
        except LookupError:
            return inner(*args, **kwargs)

        def call(*_inputs: torch.Tensor) -> Any:  # recorded with this call's own tensors
            return inner(*args, **kwargs)

        key = (self.name, shape, *fa4_op._replay_key(tuple(tensors), interface))
        return fa4_replay.launch(key, interface, call, tensors, exact=self.exact)


def _shape(value: Any, tensors: list[torch.Tensor]) -> Any:
    from flexattn_zoo.backends import fa4_replay

    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return fa4_replay.tensor_key(value)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_shape(v, tensors) for v in value))
    if callable(value):
        cute_hash = getattr(value, "__cute_hash__", None)
        if not isinstance(cute_hash, str):
            raise LookupError(f"{value!r} has no __cute_hash__")
        return ("fn", cute_hash, getattr(value, "__vec_size__", None))
    hash(value)
    return value


def _wrapped(on: bool) -> None:
    """FA4's launchers wrapped (``on``) or as FA4 made them."""
    from flash_attn.cute import interface

    for name, exact in (("_flash_attn_fwd", True), ("_flash_attn_bwd", False)):
        current = getattr(interface, name)
        inner = current.__wrapped__ if isinstance(current, _Replayed) else current
        setattr(interface, name, _Replayed(inner, name, exact) if on else inner)


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
    from flexattn_zoo.backends import fa4_replay

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

    _wrapped(False)
    plain = (
        _host_us(fwd, args.number, args.repeat, grad=False),
        _host_us(step, args.number // 4, args.repeat),
    )
    _wrapped(True)
    fa4_replay.PROGRAMS.clear()
    try:
        for _ in range(3):
            with torch.no_grad():
                fwd()
            grads()
        entries = [(type(e).__name__, getattr(e, "reason", "")) for e in fa4_replay.PROGRAMS.values()]
        with torch.no_grad():  # new inputs: a replay that wrote nothing would keep the old output
            for t in (q, k, v):
                t.copy_(torch.randn_like(t))
        with torch.no_grad():
            got = fwd()
        got_g = grads()
        _wrapped(False)
        with torch.no_grad():
            want = fwd()
        want_g = grads()
        _wrapped(True)
        same = torch.equal(got.view(torch.int16), want.view(torch.int16))
        gdiff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got_g, want_g, strict=True))
        gscale = max(float(b.float().abs().max()) for b in want_g)
        replayed = (
            _host_us(fwd, args.number, args.repeat, grad=False),
            _host_us(step, args.number // 4, args.repeat),
        )
    finally:
        _wrapped(False)
    print(f"\n{label}: kinds {entries}")
    print(f"  forward bit-identical to unwrapped: {same}; grads max diff {gdiff:.3g} (largest {gscale:.3g})")
    print(
        f"  host us/call fwd: unwrapped {plain[0]:.1f}, replayed {replayed[0]:.1f};"
        f" fwd+bwd: unwrapped {plain[1]:.1f}, replayed {replayed[1]:.1f}"
    )
    _route(q, k, v, dout, score is not None, args)


def _route(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, softcap: bool, args: Any
) -> None:
    """The same through the library's flex_flash route (plan-cache hits): ms per call by CUDA
    events over back-to-back calls and host us per call, replays off then on."""
    import flexattn_zoo as fz
    from flexattn_zoo import score_mods

    score = score_mods.SoftCap(cap=30.0) if softcap else None

    def fwd() -> torch.Tensor:
        return fz.attention(q, k, v, mask="causal", score_mod=score, backend="flex_flash")

    def step() -> None:
        fwd().backward(dout)

    row = []
    for on in (False, True):
        _wrapped(on)
        try:
            for fn, n, grad in ((fwd, args.number, False), (step, args.number // 4, True)):
                host = _host_us(fn, n, args.repeat, grad=grad)
                with torch.set_grad_enabled(grad):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    torch.cuda.synchronize()
                    start.record()
                    for _ in range(n):
                        fn()
                    end.record()
                    torch.cuda.synchronize()
                row.append(f"{start.elapsed_time(end) / n * 1e3:.1f} us ({host:.1f} host)")
        finally:
            _wrapped(False)
    print(
        f"  fz flex_flash route fwd: off {row[0]}, replayed {row[2]}; fwd+bwd: off {row[1]}, replayed {row[3]}"
    )


if __name__ == "__main__":
    main()
