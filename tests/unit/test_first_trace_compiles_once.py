"""A user's first compiled training step, in a fresh process, compiles the step once.

The bug class: library state that a traced call reads *and fills* (a memo dict, a lazily set
global, an attribute cached on the caller's object). Dynamo guards on what the trace read (``key
not in memo``, ``mask._done == False``); the trace filled it, so the next call fails that guard
and the caller's function is compiled a second time (the H200 found ``arch._CUDA_ARCH``: step 2 of
a training loop recompiled). Within one pytest process the caches are already warm from earlier
tests, so each group of cases runs in its own fresh interpreter, as a user's first steps do, and
compiles each step function with ``fullgraph=True`` under a ``CompileCounter``: three calls with
new data (new q/k/v, new document ids, prefix lengths, padding), one frame compiled. The backend
is Dynamo's own (no Inductor): the guards are Dynamo's whatever the backend. Found this way on
the old code: ``_compat.fast_tanh_op``'s lazily registered op (the CUDA flex route's traced
SoftCap(approx=True) failed: Dynamo cannot enter its lock, nor register an op).

Not here: a decode step whose position changes every call on the CPU recompiles per offset by
design (``masks._blocks.CapturedOffsets._offset_tensor``: Inductor's CPU flex kernel cannot take
it symbolic); ``fz.decode.decode_step`` is an eager serving API (thread-local masks, host-side
length checks), not traced. A transformers mask prepared before the compiled forward and passed
again *as the same object* compiles the forward once more, by choice: the first trace fills its
spec memo, which lets every layer of that trace share the spec and so one BlockMask built in the
graph (translating it when made instead gave each layer its own spec and BlockMask: about 4x the
graph's mask ops over four layers); transformers prepares a new mask each step, which compiles
once (``hf_prepared_mask_per_step``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Shared by every group: the step runner. Each case compiles its own function (its own Dynamo
#: cache) and records its frame count, or the error that stopped it. No eager ``fz.attention``
#: call runs before the compiled ones: the first call that touches the library's state is traced.
PRELUDE = """
import json
import torch
from torch._dynamo.testing import CompileCounter

import flexattn_zoo as fz
from flexattn_zoo import masks, score_mods

B, H, L, D = 2, 2, 128, 16
GEN = torch.Generator().manual_seed(0)
FRAMES = {}


def qkv(q_len=L, grad=False, kv_len=L):
    shapes = ((B, H, q_len, D), (B, H, kv_len, D), (B, H, kv_len, D))
    return tuple(torch.randn(s, generator=GEN).requires_grad_(grad) for s in shapes)


def run(name, fn, make_args, grad=False, steps=3):
    counter = CompileCounter()
    step = torch.compile(fn, backend=counter, fullgraph=True)
    try:
        with torch.set_grad_enabled(grad):
            for i in range(steps):
                out = step(*make_args(i))
                if grad:
                    out.sum().backward()
        FRAMES[name] = counter.frame_count
    except Exception as exc:
        FRAMES[name] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"


def ids(i):
    rows = ([[40, 88], [128]], [[1, 127], [64, 64]], [[100, 28], [3, 125]])[i]
    return masks.Document.from_lengths(rows).doc_ids


def valid(i):
    return torch.arange(L).expand(B, L) < torch.tensor([[100 - 10 * i], [60 + i]])
"""

GROUPS = {
    "attention": """
run("causal", lambda q, k, v: fz.attention(q, k, v, mask="causal"), lambda i: qkv())
run(
    "sliding_window_softcap",
    lambda q, k, v: fz.attention(
        q, k, v, mask=masks.SlidingWindow(left=16) & masks.Causal(), score_mod=score_mods.SoftCap(cap=20.0)
    ),
    lambda i: qkv(),
)
run(
    "document_causal_new_ids",
    lambda q, k, v, t: fz.attention(q, k, v, mask=masks.Document(doc_ids=t) & masks.Causal()),
    lambda i: (*qkv(), ids(i)),
)
run(
    "prefix_lm_tensor",
    lambda q, k, v, t: fz.attention(q, k, v, mask=masks.PrefixLM(prefix_len=t)),
    lambda i: (*qkv(), torch.tensor([[5, 40], [128, 0], [1, 17]][i])),
)
run(
    "key_padding_causal",
    lambda q, k, v, t: fz.attention(q, k, v, mask=masks.KeyPadding(valid=t) & masks.Causal()),
    lambda i: (*qkv(), valid(i)),
)
# One spec made outside the step and passed on every call (its per-instance memos are the
# caller's object; the CPU flex route reads them while traced).
same = masks.KeyPadding(valid=valid(0)) & masks.Causal()
run("same_spec_every_call", lambda q, k, v, m: fz.attention(q, k, v, mask=m), lambda i: (*qkv(), same))
run(
    "decode_step_bottom_right",
    lambda q, k, v: fz.attention(q, k, v, mask=masks.Causal(align="bottom_right")),
    lambda i: qkv(q_len=1),
)
run(
    "document_causal_fwd_bwd",
    lambda q, k, v, t: fz.attention(q, k, v, mask=masks.Document(doc_ids=t) & masks.Causal()),
    lambda i: (*qkv(grad=True), ids(i)),
    grad=True,
)
run("causal_fwd_bwd", lambda q, k, v: fz.attention(q, k, v, mask="causal"), lambda i: qkv(grad=True), grad=True)
""",
    "layers": """
layer = fz.Attention(
    mask=masks.SlidingWindow(left=16) & masks.Causal(), score_mod=score_mods.SoftCap(cap=30.0)
)
run("attention_module", layer, lambda i: qkv())
run(
    "attention_module_document_per_call",
    lambda q, k, v, t: layer(q, k, v, mask=masks.Document(doc_ids=t) & masks.Causal()),
    lambda i: (*qkv(), ids(i)),
)
run("layers_preset", lambda q, k, v: fz.layers.attention_layer(q, k, v, config="gemma2", layer=0), lambda i: qkv())

# The CUDA flex route's traced call (its score_mod built in the caller's graph), run on CPU
# tensors: SoftCap(approx=True) asks for the hardware tanh op, registered on first use. Short
# rows: eagerly, torch's CPU flex applies that op element by element (no batching rule).
from flexattn_zoo.backends import BY_NAME
from flexattn_zoo.problem import Problem


def flex_softcap_approx(q, k, v):
    n = q.shape[2]
    p = Problem(
        batch=B, heads=H, kv_heads=H, q_len=n, kv_len=n, head_dim=D, dtype=q.dtype, device_type="cpu",
        arch="cpu", requires_grad=False, mask=masks.Causal(), score=score_mods.SoftCap(cap=5.0, approx=True),
    )
    return BY_NAME["flex"]._run_traced(q, k, v, p, scale=0.25, block_mask=None)[0]


run("flex_route_softcap_approx", flex_softcap_approx, lambda i: qkv(q_len=16, kv_len=16))
""",
    "hf": """
import flexattn_zoo.hf as zhf
from transformers import masking_utils as mu
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

name = zhf.register()  # eagerly, as a user does before compiling the model
attend = ALL_ATTENTION_FUNCTIONS[name]
build = mu.ALL_MASK_ATTENTION_FUNCTIONS[name]


def mask_of(t):
    fn = mu.and_masks(mu.causal_mask_function, mu.sliding_window_overlay(32))
    return build(
        batch_size=B, q_length=L, kv_length=L, mask_function=fn, attention_mask=t.to(torch.long)
    )


def hf_step(q, k, v, m):
    return attend(None, q, k, v, m, scaling=0.25)[0]


# A training forward: transformers builds the mask inside the compiled model.
run("hf_mask_built_in_graph", lambda q, k, v, t: hf_step(q, k, v, mask_of(t)), lambda i: (*qkv(), valid(i)))
# Masks prepared before the compiled forward (static-cache generate): a new one per step.
run("hf_prepared_mask_per_step", hf_step, lambda i: (*qkv(), mask_of(valid(i))))
""",
}

EPILOGUE = '\nprint("FRAMES " + json.dumps(FRAMES))\n'


def _frames(group: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEXATTN_ZOO_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    code = textwrap.dedent(PRELUDE) + textwrap.dedent(GROUPS[group]) + EPILOGUE
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("FRAMES ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return dict(json.loads(lines[-1].removeprefix("FRAMES ")))


@pytest.mark.parametrize("group", list(GROUPS))
def test_each_step_function_compiles_once_in_a_fresh_process(group: str) -> None:
    if group == "hf" and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs transformers (the hf extra)")
    frames = _frames(group)
    compiled_again = {name: n for name, n in frames.items() if n != 1}
    assert frames and not compiled_again, f"not compiled exactly once: {compiled_again}; all: {frames}"


def test_a_compiled_decode_step_as_a_process_first_call_runs() -> None:
    """A function calling ``decode_step`` under ``torch.compile`` (graph breaks allowed) as the
    process's first library call. The trace made the first lookup of flash-attn-4, whose
    ``find_spec("flash_attn.cute")`` raises without the package; Dynamo turned that into an
    internal error instead of letting the lookup's ``except`` answer "not installed"."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEXATTN_ZOO_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    code = textwrap.dedent(
        """
        import torch
        from flexattn_zoo import masks
        from flexattn_zoo.models import decode

        q, k, v = (torch.randn(1, 2, n, 16) for n in (1, 64, 64))
        window = masks.SlidingWindow(left=8)
        step = torch.compile(lambda q, k, v, n: decode.decode_step(q, k, v, n, mask=window), backend="eager")
        with torch.no_grad():
            out = step(q, k, v, 40)
            ref = decode.decode_step(q, k, v, 40, mask=window)
        torch.testing.assert_close(out, ref)
        print("OK")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-4000:]
