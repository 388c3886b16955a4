"""Whole Hugging Face models under ``torch.compile``: HF ``sdpa`` / ``flex_attention`` vs flexattn_zoo.

Each row builds one model with one attention implementation, wraps it in
``torch.compile(model, dynamic=False)`` (default mode) and times one step:

* ``train``: ``model.zero_grad(set_to_none=True)``, a forward with ``labels`` (HF's shifted
  cross-entropy) and ``loss.backward()``; no optimizer, so the weights never change;
* ``prefill``: a forward under ``torch.no_grad()`` with ``use_cache=False`` and
  ``logits_to_keep=1`` (the last position's logits only) where the model's ``forward`` takes it.

Implementations (``--impls``): transformers' ``sdpa``, ``flex_attention`` and ``eager``, and
``flexattn_zoo`` (``flexattn_zoo.hf.register(backend=--backend)``; with a backend other than
``auto`` the row is labelled ``flexattn_zoo:<backend>``).

Conventions
-----------
* Models: random weights from ``AutoModelForCausalLM.from_config(cfg, dtype=bfloat16)`` built on
  the CPU right after ``torch.manual_seed(--seed)`` and then moved to the device, so every
  implementation gets the same weights (each row records a digest of them, and a row whose
  digest differs from its reference's is flagged). Inputs: uniform random token ids from a
  generator seeded with ``--seed + 1``; ``labels`` are the ids.
* Shapes (``--batch`` / ``--seq-len`` override them): ``llama`` B=2 L=4096, ``mistral_swa``
  B=1 L=8192, ``gemma2`` B=2 L=8192. ``--tiny``: 2 layers, hidden 128, 4 q / 2 kv heads of 32
  (Gemma 2: 64), windows of 128, vocabulary 2048, B=1 L=256 -- a smoke test that runs on a CPU.
* Time: the first call (Dynamo + Inductor, forward and, for ``train``, backward) on the wall
  clock with a device sync, ``--warmup`` untimed steps, then ``--steps`` steps each bracketed by
  CUDA events (CPU: ``time.perf_counter``), launched back to back. Reported: median, p10 and p90
  in ms; ``compile s`` = first call minus the median step. Inductor's on-disk caches are left as
  the machine has them, so a row run a second time on one machine compiles faster.
* Memory: ``torch.cuda.max_memory_allocated`` over the timed steps (after
  ``reset_peak_memory_stats``), in GiB; weights, gradients and activations included. CPU: n/a.
* Graph breaks: the sum of ``torch._dynamo.utils.counters["graph_break"]`` (cleared, with
  ``torch._dynamo.reset()``, before each row); the first reasons are kept in the JSON.
* Exactness: one more step after the timed ones gives the loss and per-parameter gradient norms
  (``train``) or the last position's logits (``prefill``). Each row is compared with its model's
  *reference* row (same model, shape and mode): the first of ``REFERENCES[model]`` that ran and
  computes the model's function. ``train``: |loss - ref| (absolute and relative) and the largest
  relative difference of a parameter's gradient norm; ``prefill``: max |logits - ref| and that
  over max |ref|.

Same function or not
--------------------
Gemma 2 soft-caps its attention logits (``attn_logit_softcapping``). transformers passes
``softcap=`` to the attention function; whether an implementation honours it is *probed* (once
per implementation and process): the function is called on a small problem with logits far above
a cap of 1 and compared with float32 references with and without the cap. An implementation that
ignores the cap is marked "NOT the same function" and is neither a reference nor counted in "vs
best HF"; one that raises is an error row. The probe is needed because the numbers cannot tell:
with random weights the attention logits stay far below a cap of 50, so a row that ignores the
cap matches the others to rounding. transformers 5.24's Gemma 2 refuses ``sdpa`` at
construction (``_supports_sdpa = False``) and its ``sdpa`` function raises on ``softcap``; other
releases have ignored ``softcap`` silently. Gemma 2's reference is therefore HF
``flex_attention`` (then ``eager``, which materialises B x H x L x L logits in float32 and is not
in the default ``--impls``); Llama's and Mistral's is HF ``sdpa``.

flexattn_zoo rows also record which route and specs each attention layer's call got as traced:
the first (compiling) call records them as Dynamo traces it (``FunctionMask(transformers_mask)``
is transformers' mask function run as an opaque ``mask_mod``: what a transformers release other
than the one the mask reader was tested with gets).

Output: ``--json`` merges the rows into an existing file (a row replaces the one with the same
model, shape, impl, mode and ``fa4``), so a full table can be built from several runs of <= 10
minutes; every run's command and environment is kept. ``--md`` is regenerated from every row of
the JSON. A row that fails records its error and the run goes on. ``--time-budget S`` starts no
row that would end past ``S`` seconds (judged by the longest row so far) and exits with code 3;
``--resume`` skips the rows the JSON already holds without error. Graph-break sites come from
Dynamo's ``graph_breaks`` log, which this script turns on (unless ``TORCH_LOGS`` is set): the
breaks are also printed to stderr. A tree copied without ``.git`` records its commit from
``FLEXATTN_ZOO_GIT``; ``FLEXATTN_ZOO_BENCH_COMMAND`` replaces the recorded command line.

    PYTHONPATH=. python benchmarks/compiled_models.py --tiny --device cpu --steps 2 --warmup 1 \\
        --json /tmp/cm.json --md /tmp/cm.md
    python benchmarks/compiled_models.py --models llama --time-budget 540 --resume \\
        --json benchmarks/results/compiled_models_h200.json --md benchmarks/results/compiled_models_h200.md
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import datetime
import gc
import importlib
import inspect
import json
import logging
import math
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexattn_zoo.bench.env import block_fa4, collect_env, dist_version  # noqa: E402

GIB = 2**30
FZ = "flexattn_zoo"
HF_IMPLS = ("sdpa", "flex_attention", "eager")
MODES = ("train", "prefill")
COMMAND_ENV = "FLEXATTN_ZOO_BENCH_COMMAND"  # recorded instead of argv when set
#: Reference implementation of each model, first that ran and computes the model's function.
REFERENCES = {
    "llama": ("sdpa", "flex_attention", "eager"),
    "mistral_swa": ("sdpa", "flex_attention", "eager"),
    "gemma2": ("flex_attention", "eager"),
}
SOFTCAP_PROBE_CAP = 1.0
KEEP_BREAK_REASONS = 5


# ---------------------------------------------------------------------------------------------
# Models


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    config_class: str  # a transformers config class name
    family: str  # transformers.models.<family>.modeling_<family>
    config: dict[str, Any]
    batch: int
    seq_len: int
    tiny: dict[str, Any]  # applied over TINY for --tiny


_BASE = {
    "num_hidden_layers": 8,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 5632,
    "vocab_size": 32000,
}
TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "vocab_size": 2048,
}
TINY_BATCH, TINY_SEQ_LEN = 1, 256

MODELS = {
    "llama": ModelSpec("LlamaConfig", "llama", dict(_BASE), 2, 4096, {}),
    "mistral_swa": ModelSpec(
        "MistralConfig", "mistral", {**_BASE, "sliding_window": 2048}, 1, 8192, {"sliding_window": 128}
    ),
    # Gemma2Config's default layer_types alternate sliding / full, starting with a sliding layer.
    "gemma2": ModelSpec(
        "Gemma2Config",
        "gemma2",
        {
            **_BASE,
            "head_dim": 256,
            "sliding_window": 4096,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": 256,
        },
        2,
        8192,
        {"head_dim": 64, "sliding_window": 128, "query_pre_attn_scalar": 64},
    ),
}


def model_config(name: str, tiny: bool, seq_len: int) -> Any:
    import transformers

    spec = MODELS[name]
    kwargs = {**spec.config, **TINY, **spec.tiny} if tiny else dict(spec.config)
    kwargs["max_position_embeddings"] = max(seq_len, 2048)
    return getattr(transformers, spec.config_class)(**kwargs)


def shape_of(name: str, args: argparse.Namespace) -> tuple[int, int]:
    spec = MODELS[name]
    batch = args.batch or (TINY_BATCH if args.tiny else spec.batch)
    seq_len = args.seq_len or (TINY_SEQ_LEN if args.tiny else spec.seq_len)
    return batch, seq_len


def shape_label(batch: int, seq_len: int, tiny: bool) -> str:
    return f"{'tiny ' if tiny else ''}B={batch} L={seq_len}"


def build_model(name: str, impl_name: str, tiny: bool, seq_len: int, seed: int) -> Any:
    """The model with seeded random bf16 weights, built on the CPU (identical for every impl)."""
    from transformers import AutoModelForCausalLM

    cfg = model_config(name, tiny, seq_len)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl_name, dtype=torch.bfloat16)
    return model


def weights_digest(model: torch.nn.Module) -> list[float]:
    """Sum and sum of squares of every parameter (float64 on the CPU): equal weights, equal digest."""
    total, squares = 0.0, 0.0
    with torch.no_grad():
        for p in model.parameters():
            d = p.detach().to(torch.float64)
            total += float(d.sum())
            squares += float(d.square().sum())
    return [total, squares]


# ---------------------------------------------------------------------------------------------
# Does an attention function honour ``softcap``?

_PROBES: dict[str, str] = {}


class _ProbeModule(torch.nn.Module):
    """What transformers' attention functions read off the attention module."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.is_causal = False
        self.num_key_value_groups = 1
        self.head_dim = head_dim
        self.training = False


def attention_function(impl_name: str, family: str) -> Callable[..., Any]:
    if impl_name == "eager":
        return importlib.import_module(
            f"transformers.models.{family}.modeling_{family}"
        ).eager_attention_forward  # type: ignore[no-any-return]
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[impl_name]  # type: ignore[no-any-return]


def softcap_probe(impl_name: str, family: str, device: torch.device) -> str:
    """``"applied"``, ``"ignored"``, ``"raises: ..."`` or ``"unclear: ..."`` (see the module docstring)."""
    key = f"{impl_name}/{family}/{device.type}"
    if key in _PROBES:
        return _PROBES[key]
    gen = torch.Generator().manual_seed(123)
    b, h, length, d = 1, 2, 32, 64
    q, k, v = (torch.randn(b, h, length, d, generator=gen) for _ in range(3))
    q, k = q * 3, k * 3  # logits with std ~9 at scale 1/8: far above a cap of 1
    scale = d**-0.5
    logits = q @ k.transpose(-1, -2) * scale
    capped = torch.tanh(logits / SOFTCAP_PROBE_CAP) * SOFTCAP_PROBE_CAP
    with_cap = (capped.softmax(-1) @ v).transpose(1, 2)
    without_cap = (logits.softmax(-1) @ v).transpose(1, 2)
    dt = torch.bfloat16
    try:
        fn = attention_function(impl_name, family)
        with torch.no_grad():
            out, _ = fn(
                _ProbeModule(d),
                q.to(device, dt),
                k.to(device, dt),
                v.to(device, dt),
                None,
                dropout=0.0,
                scaling=scale,
                softcap=SOFTCAP_PROBE_CAP,
            )
        out = out.float().cpu()
        err_cap = float((out - with_cap).abs().max())
        err_nocap = float((out - without_cap).abs().max())
        if err_cap < 0.05 and err_cap < err_nocap / 4:
            verdict = "applied"
        elif err_nocap < 0.05 and err_nocap < err_cap / 4:
            verdict = "ignored"
        else:
            verdict = f"unclear: max err {err_cap:.3g} vs capped, {err_nocap:.3g} vs uncapped"
    except Exception as exc:  # noqa: BLE001 - any failure is the verdict
        verdict = f"raises: {short_error(exc)}"
    _PROBES[key] = verdict
    return verdict


# ---------------------------------------------------------------------------------------------
# flexattn_zoo's routes as traced


def _describe_spec(spec: Any) -> str:
    """The spec's classes, composites with their parts (no repr: this runs while Dynamo traces)."""
    from flexattn_zoo.spec import Spec

    if spec is None:
        return "none"
    label = getattr(spec, "label", None)
    name = f"{type(spec).__name__}({label})" if isinstance(label, str) else type(spec).__name__
    parts = (
        [_describe_spec(x) for x in spec._parts() if isinstance(x, Spec)] if isinstance(spec, Spec) else []
    )
    return f"{name}({', '.join(parts)})" if parts else name


@contextlib.contextmanager
def recording_routes(found: list[str]) -> Iterator[None]:
    """Record the route and specs of each ``fz.attention`` call traced meanwhile (the first call
    of a compiled model: what its graph holds), running the call unchanged."""
    from flexattn_zoo import dispatch

    run = dispatch.execute_plan

    def recording(chosen: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> Any:
        p = chosen.problem
        found.append(f"{chosen.backend} [mask {_describe_spec(p.mask)}, score {_describe_spec(p.score)}]")
        return run(chosen, q, k, v, **kw)

    with mock.patch.object(dispatch, "execute_plan", recording):
        yield


def count_routes(found: list[str]) -> list[str]:
    unique: dict[str, int] = {}
    for item in found:
        unique[item] = unique.get(item, 0) + 1
    return [f"{n}x {item}" for item, n in unique.items()]


# ---------------------------------------------------------------------------------------------
# Timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def quantile(values: list[float], q: float) -> float:
    """Linear interpolation between the order statistics (numpy's default)."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def time_steps(step: Callable[[], Any], device: torch.device, steps: int) -> list[float]:
    """Milliseconds of each of ``steps`` back-to-back calls (CUDA events; CPU: perf_counter)."""
    if device.type == "cuda":
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)
        ]
        for start, stop in events:
            start.record()
            step()
            stop.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(stop) for start, stop in events]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def short_error(exc: BaseException, limit: int = 400) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------
# One row


def encode_tensor(t: torch.Tensor) -> dict[str, Any]:
    """A bf16 tensor as base64 of its bytes (the logits are bf16: nothing is lost)."""
    t = t.detach().to("cpu", torch.bfloat16).contiguous()
    raw = t.view(torch.int16).numpy().tobytes()
    return {"shape": list(t.shape), "bf16_b64": base64.b64encode(raw).decode("ascii")}


def decode_tensor(blob: dict[str, Any]) -> torch.Tensor:
    import numpy as np

    raw = np.frombuffer(base64.b64decode(blob["bf16_b64"]), dtype=np.int16).copy()
    return torch.from_numpy(raw).view(torch.bfloat16).reshape(blob["shape"]).float()


def impl_label(impl: str, backend: str) -> str:
    return impl if impl != FZ or backend == "auto" else f"{FZ}:{backend}"


def row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["model"], row["shape"], row["impl"], row["mode"], bool(row["fa4"]))


class BreakSites(logging.Handler):
    """Where Dynamo broke the graph, from its ``graph_breaks`` log (the counters hold only the
    reasons): per innermost user-code location, the count, the explanation and the caller. The
    log also goes to stderr as usual."""

    #: The artifact logger Dynamo reports graph breaks on (torch 2.11-2.13).
    LOGGER = "torch._dynamo.symbolic_convert.__graph_breaks"

    def __init__(self) -> None:
        super().__init__()
        self.sites: dict[str, list[Any]] = {}  # location -> [count, explanation, caller]

    def emit(self, record: logging.LogRecord) -> None:
        lines = [line.strip() for line in record.getMessage().splitlines() if line.strip()]
        if not lines:
            return
        where = _short_path(lines[0].rpartition(" in user code at ")[2] or lines[0])
        why = next((line for line in lines if line.startswith("Explanation:")), "")
        frames = [_short_path(line) for line in lines if line.startswith('File "')]
        site = self.sites.setdefault(where, [0, why.removeprefix("Explanation: "), None])
        site[0] += 1
        if site[2] is None and len(frames) >= 2:
            site[2] = frames[-2]

    def summary(self) -> list[str]:
        return [
            f"{n}x {where}{f' (from {caller})' if caller else ''}: {why}"[:400]
            for where, (n, why, caller) in self.sites.items()
        ]

    @classmethod
    @contextlib.contextmanager
    def installed(cls) -> Iterator[BreakSites]:
        handler = cls()
        ours = "TORCH_LOGS" not in os.environ  # the user's own TORCH_LOGS wins
        if ours:
            torch._logging.set_logs(graph_breaks=True)
        logging.getLogger(cls.LOGGER).addHandler(handler)
        try:
            yield handler
        finally:
            logging.getLogger(cls.LOGGER).removeHandler(handler)
            if ours:
                torch._logging.set_logs()


BREAKS: BreakSites | None = None


def _short_path(text: str) -> str:
    """A traceback location without the site-packages / repository prefix."""
    text = text.strip().removeprefix('File "')
    for marker in ("site-packages/", str(Path(__file__).resolve().parents[1]) + "/"):
        if marker in text:
            text = text.split(marker, 1)[1]
    return text.replace('", line ', ":")


def read_dynamo_counters(row: dict[str, Any]) -> None:
    """Graph breaks (their first reasons and sites) and graphs compiled since the row's reset."""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    row["graph_breaks"] = int(sum(breaks.values()))
    row["break_reasons"] = [str(r)[:300] for r in list(breaks)[:KEEP_BREAK_REASONS]]
    row["graphs"] = int(counters["stats"]["unique_graphs"])
    if BREAKS is not None:
        row["break_sites"] = BREAKS.summary()[:KEEP_BREAK_REASONS]


def run_row(
    name: str,
    impl: str,
    mode: str,
    args: argparse.Namespace,
    device: torch.device,
    fz_name: str,
    fa4: bool,
    run_index: int,
) -> dict[str, Any]:
    """One (model, impl, mode) row; a failure is recorded in the row, not raised."""
    from torch._dynamo.utils import counters

    batch, seq_len = shape_of(name, args)
    row: dict[str, Any] = {
        "model": name,
        "shape": shape_label(batch, seq_len, args.tiny),
        "batch": batch,
        "seq_len": seq_len,
        "tiny": args.tiny,
        "impl": impl_label(impl, args.backend),
        "backend": args.backend if impl == FZ else None,
        "mode": mode,
        "fa4": fa4,
        "device": str(device),
        "steps": args.steps,
        "warmup": args.warmup,
        "run": run_index,
        "status": "error",
        "error": None,
        "notes": [],
    }
    impl_name = fz_name if impl == FZ else impl
    if getattr(model_config(name, args.tiny, seq_len), "attn_logit_softcapping", None):
        row["softcap"] = softcap_probe(impl_name, MODELS[name].family, device)
    start = time.perf_counter()
    torch._dynamo.reset()
    counters.clear()
    if BREAKS is not None:
        BREAKS.sites.clear()
    try:
        _measure(row, impl_name, args, device, with_routes=impl == FZ)
        row["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - a failing row records its error, the run goes on
        row["status"] = "oom" if isinstance(exc, torch.cuda.OutOfMemoryError) else "error"
        row["error"] = short_error(exc)
        row["traceback_tail"] = traceback.format_exc(limit=-4)[-2000:]
        chained: BaseException | None = exc
        for _ in range(16):  # tracebacks (of the chain too) hold frames that hold the model
            if chained is None:
                break
            chained.__traceback__ = None
            chained = chained.__cause__ or chained.__context__
    if "graph_breaks" not in row:  # failed before _measure read them
        read_dynamo_counters(row)
    torch._dynamo.reset()
    free_memory(device)
    row["wall_s"] = time.perf_counter() - start
    return row


def _measure(
    row: dict[str, Any], impl_name: str, args: argparse.Namespace, device: torch.device, with_routes: bool
) -> None:
    """Build, compile, time and check one row (fills ``row``); everything it built dies with it."""
    name, mode, batch, seq_len = row["model"], row["mode"], row["batch"], row["seq_len"]
    t0 = time.perf_counter()
    model = build_model(name, impl_name, args.tiny, seq_len, args.seed)
    row["weights_digest"] = weights_digest(model)
    model = model.to(device)
    row["build_s"] = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=gen).to(device)
    extra: dict[str, Any] = {}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        extra["logits_to_keep"] = 1
    elif mode == "prefill":
        row["notes"].append("forward has no logits_to_keep: all logits computed")

    compiled = torch.compile(model, dynamic=False)
    if mode == "train":
        model.train()

        def step() -> torch.Tensor:
            model.zero_grad(set_to_none=True)
            loss = compiled(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            return loss.detach()
    else:
        model.eval()

        def step() -> torch.Tensor:
            with torch.no_grad():
                return compiled(input_ids=ids, use_cache=False, **extra).logits  # type: ignore[no-any-return]

    sync(device)
    found: list[str] = []
    t0 = time.perf_counter()
    with recording_routes(found) if with_routes else contextlib.nullcontext():
        step()
    sync(device)
    row["first_call_s"] = time.perf_counter() - t0
    for _ in range(args.warmup):
        step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = time_steps(step, device, args.steps)
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    row["times_ms"] = times
    row["median_ms"] = quantile(times, 0.5)
    row["p10_ms"] = quantile(times, 0.1)
    row["p90_ms"] = quantile(times, 0.9)
    row["compile_s"] = max(0.0, row["first_call_s"] - row["median_ms"] / 1e3)

    out = step()
    check: dict[str, Any] = {}
    if mode == "train":
        check["loss"] = float(out)
        check["grad_norms"] = [
            None if p.grad is None else float(p.grad.float().norm()) for p in model.parameters()
        ]
        model.zero_grad(set_to_none=True)
    else:
        check["logits"] = encode_tensor(out[:, -1])
    del out
    if not all(math.isfinite(x) for x in _finite_view(check)):
        row["notes"].append("loss / logits hold NaN or inf")
    row["check"] = check
    read_dynamo_counters(row)
    if with_routes:
        row["routes"] = count_routes(found)


def _finite_view(check: dict[str, Any]) -> list[float]:
    if "loss" in check:
        return [check["loss"]] + [g for g in check["grad_norms"] if g is not None]
    return [float(decode_tensor(check["logits"]).abs().max())]


# ---------------------------------------------------------------------------------------------
# Comparisons against the reference


def same_function(row: dict[str, Any]) -> bool:
    return row.get("softcap") in (None, "applied")


def reference_row(rows: list[dict[str, Any]], row: dict[str, Any]) -> dict[str, Any] | None:
    """The reference of ``row``'s model / shape / mode: same FA4 setting preferred."""
    group = [
        r
        for r in rows
        if (r["model"], r["shape"], r["mode"]) == (row["model"], row["shape"], row["mode"])
        and r["status"] == "ok"
        and "check" in r
        and same_function(r)
    ]
    for impl in REFERENCES.get(row["model"], ()):
        for want_fa4 in (row["fa4"], not row["fa4"]):
            for r in group:
                if r["impl"] == impl and bool(r["fa4"]) == bool(want_fa4):
                    return r
    return None


def compare(rows: list[dict[str, Any]]) -> None:
    """Fill each ok row's ``diff`` against its reference (recomputed whenever the JSON is saved)."""
    for row in rows:
        row.pop("diff", None)
        if row["status"] != "ok" or "check" not in row:
            continue
        ref = reference_row(rows, row)
        if ref is None:
            continue
        diff: dict[str, Any] = {"reference": ref["impl"], "is_reference": ref is row}
        if ref.get("weights_digest") != row.get("weights_digest"):
            diff["weights_differ"] = True
        a, b = row["check"], ref["check"]
        if row["mode"] == "train":
            diff["loss_abs"] = abs(a["loss"] - b["loss"])
            diff["loss_rel"] = diff["loss_abs"] / max(abs(b["loss"]), 1e-30)
            rel = [
                abs(x - y) / max(abs(y), 1e-30)
                for x, y in zip(a["grad_norms"], b["grad_norms"], strict=False)
                if x is not None and y is not None
            ]
            diff["grad_norm_rel"] = max(rel) if rel else None
        else:
            x, y = decode_tensor(a["logits"]), decode_tensor(b["logits"])
            if x.shape != y.shape:
                diff["error"] = f"shapes differ: {tuple(x.shape)} vs {tuple(y.shape)}"
            else:
                diff["logits_abs"] = float((x - y).abs().max())
                diff["logits_rel"] = diff["logits_abs"] / max(float(y.abs().max()), 1e-30)
        row["diff"] = diff


# ---------------------------------------------------------------------------------------------
# Report


def _esc(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _md_table(header: list[str], lines: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(_esc(c) for c in line) + " |" for line in lines]
    return out


def _diff_cell(row: dict[str, Any]) -> str:
    d = row.get("diff")
    if row["status"] != "ok":
        return ""
    if d is None:
        return "no reference"
    if d.get("error"):
        return d["error"]
    weights = " (weights differ!)" if d.get("weights_differ") else ""
    if d["is_reference"]:
        return "reference" + weights
    if row["mode"] == "train":
        grad = f"; grad norms {d['grad_norm_rel']:.1e} rel" if d.get("grad_norm_rel") is not None else ""
        return f"loss {d['loss_abs']:.1e} ({d['loss_rel']:.1e} rel){grad}{weights}"
    return f"logits {d['logits_abs']:.2e} ({d['logits_rel']:.1e} rel){weights}"


def _same_cell(row: dict[str, Any]) -> str:
    probe = row.get("softcap")
    if probe is None:
        return "yes"
    if probe == "applied":
        return "yes (softcap applied)"
    if probe == "ignored":
        return "NOT the same function: attention softcap ignored"
    if probe.startswith("raises"):
        return f"softcap refused ({probe.removeprefix('raises: ').split(':')[0]})"
    return f"softcap {probe}"


def _notes_cell(row: dict[str, Any]) -> str:
    parts: list[str] = []
    if row["status"] != "ok":
        parts.append(f"{row['status'].upper()}: {row.get('error')}")
    if row.get("routes"):
        parts.append("routes: " + "; ".join(row["routes"]))
    if row.get("graph_breaks"):
        sites = row.get("break_sites") or row.get("break_reasons") or []
        parts += [f"break: {site[:200]}" for site in sites[:2]]
    parts += row.get("notes", [])
    return " / ".join(parts)


def _impl_order(impl: str) -> tuple[int, str]:
    return (HF_IMPLS.index(impl), impl) if impl in HF_IMPLS else (len(HF_IMPLS), impl)


def markdown(data: dict[str, Any]) -> str:
    rows: list[dict[str, Any]] = data["rows"]
    lines = ["# Whole HF models under torch.compile: attention implementations", ""]
    lines += [
        "Generated by `benchmarks/compiled_models.py` from its JSON (conventions: the script's docstring). "
        "bf16, random seeded weights (the same for every implementation), `torch.compile(model, dynamic=False)`. "
        "Step time: median (p10-p90) of steps timed with CUDA events (CPU: perf_counter); `vs best HF`: the fastest HF row "
        "that computes the model's function divided by this row's time (> 1: faster). Peak: "
        "`max_memory_allocated` over the timed steps. Compile: first call minus a step. "
        "Diff: against the reference row of the same model, shape and mode.",
        "",
        "## Runs",
        "",
    ]
    used = {row.get("run") for row in rows}
    for i, run in enumerate(data["runs"]):
        if i not in used:  # every row it measured was measured again later
            continue
        git = (run.get("git") or "?")[:12] + (" (dirty)" if run.get("git_dirty") else "")
        fa4 = "yes" if run.get("fa4_import") else f"no ({run.get('fa4_import_error') or 'not installed'})"
        lines += [
            f"{i}. `{run['command']}`",
            f"   - {run['date']}, commit {git}; torch {run['torch']}, transformers {run.get('transformers')}, "
            f"triton {run.get('triton')}, CUDA {run.get('cuda')}; {run.get('gpu') or run['device']}; "
            f"FA4 (`flash_attn.cute`) importable: {fa4}{' (hidden by --no-fa4)' if run.get('no_fa4') else ''}; "
            f"flexattn_zoo mask reader structural: {run.get('structural_reader')}",
        ]
    lines.append("")
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["shape"], row["mode"]), []).append(row)
    model_order = list(MODELS)
    for (model, shape, mode), group in sorted(
        groups.items(),
        key=lambda kv: (
            model_order.index(kv[0][0]) if kv[0][0] in model_order else 99,
            kv[0][1],
            MODES.index(kv[0][2]) if kv[0][2] in MODES else 9,
        ),
    ):
        ok_hf = [
            r["median_ms"]
            for r in group
            if r["status"] == "ok" and r["impl"] in HF_IMPLS and same_function(r) and r.get("median_ms")
        ]
        best_hf = min(ok_hf) if ok_hf else None
        ref = next((r["diff"]["reference"] for r in group if r.get("diff")), None)
        lines += [f"## {model}, {shape}, {mode}" + (f" (reference: {ref})" if ref else ""), ""]
        table = []
        for row in sorted(group, key=lambda r: (_impl_order(r["impl"]), bool(r["fa4"]))):
            ok = row["status"] == "ok"
            ms = f"{row['median_ms']:.2f} ({row['p10_ms']:.2f}-{row['p90_ms']:.2f})" if ok else "-"
            ratio = f"{best_hf / row['median_ms']:.2f}x" if ok and best_hf and same_function(row) else "-"
            peak = f"{row['peak_gib']:.2f}" if row.get("peak_gib") is not None else "n/a"
            comp = f"{row['compile_s']:.1f}" if row.get("compile_s") is not None else "-"
            breaks = str(row["graph_breaks"]) if row.get("graph_breaks") is not None else "-"
            table.append(
                [
                    row["impl"],
                    "yes" if row["fa4"] else "no",
                    ms,
                    ratio,
                    peak,
                    comp,
                    breaks,
                    _diff_cell(row),
                    _same_cell(row),
                    _notes_cell(row),
                ]
            )
        lines += _md_table(
            [
                "impl",
                "FA4",
                "step ms median (p10-p90)",
                "vs best HF",
                "peak GiB",
                "compile s",
                "graph breaks",
                "diff vs reference",
                "same function",
                "notes",
            ],
            table,
        )
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Driver


def fa4_import() -> tuple[bool, str | None]:
    """Whether ``import flash_attn.cute`` works here (and the error if not)."""
    try:
        importlib.import_module("flash_attn.cute")
    except Exception as exc:  # noqa: BLE001 - any failure means FA4 is not usable
        return False, short_error(exc, 200)
    return True, None


def load(path: Path | None) -> dict[str, Any]:
    if path is not None and path.exists():
        data = json.loads(path.read_text())
        data.setdefault("runs", [])
        data.setdefault("rows", [])
        return data
    return {"runs": [], "rows": []}


def save(path: Path | None, data: dict[str, Any]) -> None:
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def merge(data: dict[str, Any], row: dict[str, Any]) -> None:
    data["rows"] = [r for r in data["rows"] if row_key(r) != row_key(row)] + [row]


def _names(text: str, valid: list[str], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in valid]
    if bad:
        raise SystemExit(f"unknown {what}: {', '.join(bad)} (choose from {', '.join(valid)})")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)}")
    p.add_argument(
        "--impls", default=f"sdpa,flex_attention,{FZ}", help=f"comma-separated: {', '.join(HF_IMPLS)}, {FZ}"
    )
    p.add_argument("--modes", default="train,prefill", help="comma-separated: train, prefill")
    p.add_argument("--steps", type=int, default=20, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the first call")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=None, help="override every selected model's batch")
    p.add_argument("--seq-len", type=int, default=None, help="override every selected model's length")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (2 layers, hidden 128, B=1 L=256)")
    p.add_argument("--backend", default="auto", help="flexattn_zoo route for the flexattn_zoo impl")
    p.add_argument("--no-fa4", action="store_true", help="hide flash_attn.cute from this process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="merge rows into this file")
    p.add_argument("--md", type=Path, default=None, help="write the report of every row of --json")
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds: start no row that would end past it (by the longest row so far); exit code 3",
    )
    p.add_argument("--resume", action="store_true", help="skip rows --json already holds without error")
    p.add_argument("--report-only", action="store_true", help="rewrite --md from --json, run nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    data = load(args.json)
    if args.report_only:
        compare(data["rows"])
        save(args.json, data)
        if args.md:
            args.md.write_text(markdown(data) + "\n")
        return 0
    models = _names(args.models, list(MODELS), "models")
    impls = _names(args.impls, [*HF_IMPLS, FZ], "impls")
    modes = _names(args.modes, list(MODES), "modes")
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    device = torch.device(args.device)
    if args.no_fa4:
        block_fa4()
    fa4, fa4_error = fa4_import()

    import transformers

    import flexattn_zoo.hf
    from flexattn_zoo.hf.mask_reader import structural_reader_enabled

    fz_name = flexattn_zoo.hf.register()
    if args.backend != "auto":
        fz_name = flexattn_zoo.hf.register(f"{FZ}_{args.backend}", backend=args.backend)
    given = sys.argv[1:] if argv is None else argv
    command = os.environ.get(COMMAND_ENV) or shlex.join(["python", "benchmarks/compiled_models.py", *given])
    run = collect_env(device, command)
    run.update(
        transformers=transformers.__version__,
        fa4_import=fa4,
        fa4_import_error=fa4_error,
        no_fa4=args.no_fa4,
        structural_reader=structural_reader_enabled(),
        flash_attn_4=dist_version("flash-attn-4", "flash_attn_4"),
        started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    data["runs"].append(run)
    run_index = len(data["runs"]) - 1
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, device {run.get('gpu') or device}, "
        f"FA4 {'yes' if fa4 else 'no'}",
        flush=True,
    )
    global BREAKS
    with BreakSites.installed() as BREAKS:
        return _run_all(models, impls, modes, args, data, device, fz_name, fa4, run_index)


def _run_all(
    models: list[str],
    impls: list[str],
    modes: list[str],
    args: argparse.Namespace,
    data: dict[str, Any],
    device: torch.device,
    fz_name: str,
    fa4: bool,
    run_index: int,
) -> int:
    done = {row_key(r) for r in data["rows"] if r["status"] == "ok"} if args.resume else set()
    todo = [
        (name, impl, mode)
        for name in models
        for impl in impls
        for mode in modes
        if (name, shape_label(*shape_of(name, args), args.tiny), impl_label(impl, args.backend), mode, fa4)
        not in done
    ]
    began, longest = time.perf_counter(), 0.0
    for i, (name, impl, mode) in enumerate(todo):
        if args.time_budget and time.perf_counter() - began + longest > args.time_budget:
            left = ", ".join(f"{n}/{im}/{mo}" for n, im, mo in todo[i:])
            print(f"time budget reached; not run: {left} (run again with --resume)", flush=True)
            return 3
        row = run_row(name, impl, mode, args, device, fz_name, fa4, run_index)
        longest = max(longest, row["wall_s"])
        merge(data, row)
        compare(data["rows"])
        save(args.json, data)
        if args.md:
            args.md.write_text(markdown(data) + "\n")
        print(_line(row), flush=True)
    return 0


def _line(row: dict[str, Any]) -> str:
    what = f"{row['model']} {row['shape']} {row['impl']} {row['mode']} fa4={'y' if row['fa4'] else 'n'}"
    if row["status"] != "ok":
        return f"{what}: {row['status']}: {row['error']} ({row['wall_s']:.0f} s)"
    peak = f"{row['peak_gib']:.2f} GiB" if row.get("peak_gib") is not None else "peak n/a"
    diff = _diff_cell(row)
    return (
        f"{what}: {row['median_ms']:.2f} ms ({row['p10_ms']:.2f}-{row['p90_ms']:.2f}), {peak}, "
        f"compile {row['compile_s']:.1f} s, {row['graph_breaks']} breaks, {diff} ({row['wall_s']:.0f} s)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
