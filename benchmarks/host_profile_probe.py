"""Where the eager host time of one ``fz.attention`` call goes, next to the call it wraps.

cProfile of many plan-cache hits of a tiny call (kernel time negligible next to the host): a flex
route (``SlidingWindow & Causal``) beside ``torch.compile(flex_attention)`` on a prebuilt
BlockMask with the same mask_mod, and the SDPA route beside plain SDPA. Prints the top functions
by own time per call, in microseconds (cProfile's overhead inflates every function alike: compare
rows, not totals with benchmarks/host_cost.py).

    PYTHONPATH=. python benchmarks/host_profile_probe.py [--device cuda] [--calls 3000]

With ``--example NAME`` (a registered mask, at ``--shape B,H,L,D``): that zoo entry's typical
example on the flex route next to the same compiled flex call with a BlockMask prebuilt from its
mask_mod, instead of the default pairs. ``--route flex_flash`` (flash-attn-4 installed) profiles that
route instead, beside compiled flex with ``kernel_options={"BACKEND": "FLASH"}``.

    PYTHONPATH=. python benchmarks/host_profile_probe.py --device cuda --example natten --shape 2,16,4096,128
    PYTHONPATH=. python benchmarks/host_profile_probe.py --example block_select --route flex_flash --shape 2,16,4096,128

With ``--fa4 B,H,HKV,LQ,LKV,D`` (CUDA, flash-attn-4 installed): FA4's own ``flash_attn_func`` on
``[B, L, H, D]`` views beside ``fz.attention(backend="fa4")``, no mask, forward without grad, then
forward + backward (``--fa4-grad``).

    PYTHONPATH=. python benchmarks/host_profile_probe.py --fa4 32,32,8,1,8192,128

With ``--decode``: one query per row against the live prefix of a KV cache (B=1, H=8, D=64, a
cache of 2048 keys, the prefix length cycling over 64 values, as ``benchmarks/host_cost.py``'s
``decode`` group): plain SDPA on the slices beside ``fz.attention`` on the same slices, then
``decode_step`` on the flex route (``decode-flex``).

    PYTHONPATH=. python benchmarks/host_profile_probe.py --device cuda --decode
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import flexattn_zoo as fz
from flexattn_zoo import masks, registry


def profile(name: str, call, calls: int, top: int) -> None:  # type: ignore[no-untyped-def]
    for _ in range(100):
        call()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    print(f"## {name}: {stats.total_tt / calls * 1e6:.1f} us per call under cProfile")  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(top)
    lines = text.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    print("\n".join(line for line in lines[start:] if line.strip()))
    print()


def profile_example(name: str, shape: tuple[int, ...], dev: torch.device, dtype: torch.dtype, args) -> None:  # type: ignore[no-untyped-def]
    b, h, length, d = shape
    spec = registry.MASKS.entry(name).factory.typical_example(length, length, b, h).to(dev)
    q, k, v = (torch.randn(b, h, length, d, device=dev, dtype=dtype) for _ in range(3))
    route = args.route or ("flex" if dev.type == "cuda" else "flex_cpu")
    mod = spec.mask_mod()
    bm = create_block_mask(
        mod, b if spec.uses_batch() else None, h if spec.uses_head() else None, length, length, device=dev
    )
    print(f"# {name}: {spec!r} at B={b} H={h} L={length} D={d} {dtype} on {dev}\n")
    profile_flex_pair((q, k, v), bm, spec, route, f'fz.attention(backend="{route}")', args)


def profile_flex_pair(qkv, bm, spec, route: str, label: str, args) -> None:  # type: ignore[no-untyped-def]
    """Compiled flex on the prebuilt BlockMask ``bm``, then ``fz.attention`` with ``spec`` on ``route``."""
    q, k, v = qkv
    compiled = torch.compile(flex_attention)
    options = {"BACKEND": "FLASH"} if route == "flex_flash" else None
    profile(
        "torch.compile(flex_attention), prebuilt BlockMask"
        + ("" if options is None else f", kernel_options={options}"),
        lambda: compiled(q, k, v, block_mask=bm, kernel_options=options),
        args.calls,
        args.top,
    )
    profile(label, lambda: fz.attention(q, k, v, mask=spec, backend=route), args.calls, args.top)


def profile_fa4(shape: tuple[int, ...], grad: bool, args) -> None:  # type: ignore[no-untyped-def]
    from flash_attn.cute import flash_attn_func

    b, h, hkv, lq, lkv, d = shape
    dev, dtype = torch.device("cuda"), torch.bfloat16
    q = torch.randn(b, h, lq, d, device=dev, dtype=dtype, requires_grad=grad)
    k, v = (torch.randn(b, hkv, lkv, d, device=dev, dtype=dtype, requires_grad=grad) for _ in range(2))
    gqa = h != hkv
    print(
        f"# fa4: B={b} H={h}:{hkv} Lq={lq} Lkv={lkv} D={d} {dtype}, {'forward + backward' if grad else 'forward'}\n"
    )

    def run(call):  # type: ignore[no-untyped-def]
        if not grad:
            with torch.no_grad():
                return call()
        out = call()
        out = out[0] if isinstance(out, tuple) else out
        out.sum().backward()
        return out

    direct = lambda: flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # noqa: E731
    ours = lambda: fz.attention(q, k, v, backend="fa4", enable_gqa=gqa)  # noqa: E731
    profile("flash_attn.cute.flash_attn_func", lambda: run(direct), args.calls, args.top)
    profile('fz.attention(backend="fa4")', lambda: run(ours), args.calls, args.top)


def profile_decode(dev: torch.device, dtype: torch.dtype, args) -> None:  # type: ignore[no-untyped-def]
    cache = torch.randn(1, 8, 2048, 64, device=dev, dtype=dtype)
    q1 = torch.randn(1, 8, 1, 64, device=dev, dtype=dtype)
    lengths = iter(range(10**12))

    def length() -> int:
        return 1024 + next(lengths) % 64

    def plain():  # type: ignore[no-untyped-def]
        n = length()
        return F.scaled_dot_product_attention(q1, cache[:, :, :n], cache[:, :, :n])

    def ours():  # type: ignore[no-untyped-def]
        n = length()
        return fz.attention(q1, cache[:, :, :n], cache[:, :, :n])

    route = "flex" if dev.type == "cuda" else "flex_cpu"

    def step_flex():  # type: ignore[no-untyped-def]
        return fz.decode.decode_step(q1, cache, cache, length(), backend=route)

    print(f"# decode: B=1 H=8 D=64 {dtype} on {dev}, one query over 1024-1087 cached keys\n")
    profile("F.scaled_dot_product_attention(q1, cache[:, :, :n])", plain, args.calls, args.top)
    profile("fz.attention(q1, cache[:, :, :n])", ours, args.calls, args.top)
    profile(f'fz.decode.decode_step(q1, cache, cache, n, backend="{route}")', step_flex, args.calls, args.top)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--example", default=None, help="a registered mask: profile its typical example")
    p.add_argument("--shape", default="2,16,4096,128", help="B,H,L,D for --example")
    p.add_argument("--route", default=None, help="with --example: the route (default flex, flex_cpu on CPU)")
    p.add_argument("--fa4", default=None, help="B,H,HKV,LQ,LKV,D: FA4's own call beside the fa4 route")
    p.add_argument("--fa4-grad", action="store_true", help="with --fa4: forward + backward")
    p.add_argument("--decode", action="store_true", help="one query over cycling cache prefixes")
    args = p.parse_args()
    if args.fa4 is not None:
        profile_fa4(tuple(int(n) for n in args.fa4.split(",")), args.fa4_grad, args)
        return
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if args.decode:
        profile_decode(dev, dtype, args)
        return
    if args.example is not None:
        profile_example(args.example, tuple(int(n) for n in args.shape.split(",")), dev, dtype, args)
        return
    q, k, v = (torch.randn(1, 8, 512, 64, device=dev, dtype=dtype) for _ in range(3))
    spec = masks.SlidingWindow(left=128) & masks.Causal()
    route = "flex" if dev.type == "cuda" else "flex_cpu"

    def mask_mod(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= 128)

    bm = create_block_mask(mask_mod, None, None, 512, 512, device=dev)
    label = f'fz.attention(mask=SlidingWindow & Causal, backend="{route}")'
    profile_flex_pair((q, k, v), bm, spec, route, label, args)
    profile(
        "F.scaled_dot_product_attention(is_causal=True)",
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        args.calls,
        args.top,
    )
    profile('fz.attention(mask="causal")', lambda: fz.attention(q, k, v, mask="causal"), args.calls, args.top)


if __name__ == "__main__":
    main()
