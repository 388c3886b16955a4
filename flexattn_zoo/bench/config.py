"""YAML sweep configs for :mod:`flexattn_zoo.bench`, validated strictly.

Schema (``defaults`` keys may also be given per case, where they win)::

    defaults:
      dtype: bf16            # bf16 | fp16 | fp32 | fp64
      device: auto           # auto (cuda when available) | cuda | cpu
      warmup: 5              # least untimed calls after the first (compiling) one (and >= 25 ms)
      iters: 20              # least timed calls (more to fill 100 ms, <= 1000); the median is reported
      modes: [fwd, fwdbwd]   # fwd: torch.no_grad inference; fwdbwd: forward + backward
      routes: [auto, sdpa_cudnn, flex, raw_flex, sdpa_dense_mask]
      max_dense_gib: 60      # routes whose dense-memory estimate exceeds this are skipped as OOM
      seed: 0                # inputs are torch.manual_seed(seed) + randn
    cases:
      - name: document_causal
        batch: 4
        heads: 16
        kv_heads: 4          # optional (default: heads); fewer = grouped-query attention
        seq_len: 8192        # key length (and query length unless q_len is given)
        # q_len: 1           # optional: fewer queries than keys (decode, chunked prefill)
        head_dim: 128
        # v_head_dim: 128    # optional: a value head dim other than head_dim
        mask: {name: causal}                 # as flexattn_zoo.config: mapping, or list joined with &
        score_mod: {name: softcap, cap: 30}  # mapping, or list chained with >>
        document_lengths: {min: 256, max: 2048, seed: 0}

``goal: {fwd: 640, fwdbwd: 570}`` (optional) is the TFLOP/s the ``auto`` row should reach; the
report marks it met or not (not for ``--no-fa4`` runs: the goals assume every route installed).

``document_lengths`` draws document lengths uniformly in ``[min, max]`` (the last one is cut to
fit ``seq_len``) and prepends ``Document.from_lengths(lengths) &`` to the mask. ``key_padding:
{min, max, seed}`` draws each batch row's number of real keys in ``[min, max]`` and prepends
``KeyPadding(valid) &`` (right padding, as a tokenizer's padded batch). A score entry
without ``num_heads`` (e.g. ``{name: alibi}``) gets the case's ``heads``. ``mask: causal`` is short
for ``mask: {name: causal}``. ``example: [tree]`` (a name or a list) joins each named family's
``typical_example`` for the case's shape: masks ANDed with ``mask``, score mods chained after
``score_mod``; for families built from tensors (trees, shared prefixes, bias tables).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
from pathlib import Path
from typing import Any

import torch
import yaml

from flexattn_zoo.backends import BY_NAME
from flexattn_zoo.config import read_text_file, spec_from_dict
from flexattn_zoo.registry import MASKS, SCORES, did_you_mean
from flexattn_zoo.spec import MaskSpec, ScoreSpec

#: Routes the harness adds to the dispatcher's: a user's hand-written flex, SDPA with a dense mask,
#: plain SDPA as a user calls it (its own kernel choice, ``is_causal`` / ``enable_gqa``) and
#: FlashAttention-4's ``flash_attn_func`` as a user calls it, and ``auto`` with measured route
#: choice (``bench.routes`` says what each runs).
EXTRA_ROUTES = ("raw_flex", "sdpa_dense_mask", "plain_sdpa", "fa4_direct", "auto_tuned")
MODES = ("fwd", "fwdbwd")
DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
}
DEFAULTS: dict[str, Any] = {
    "dtype": "bf16",
    "device": "auto",
    "warmup": 5,
    "iters": 20,
    "modes": list(MODES),
    "routes": ["auto"],
    "max_dense_gib": 60.0,
    "seed": 0,
}
CASE_KEYS = (
    "name",
    "batch",
    "heads",
    "kv_heads",
    "seq_len",
    "q_len",
    "head_dim",
    "v_head_dim",
    "mask",
    "score_mod",
    "document_lengths",
    "key_padding",
    "example",
    "goal",
)


def all_routes() -> list[str]:
    return ["auto", *BY_NAME, *EXTRA_ROUTES]


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem of a sweep and how to time it."""

    name: str
    batch: int
    heads: int
    kv_heads: int
    seq_len: int
    head_dim: int
    dtype: torch.dtype
    device: str
    warmup: int
    iters: int
    modes: tuple[str, ...]
    routes: tuple[str, ...]
    max_dense_gib: float
    seed: int
    mask: Any = None
    score_mod: Any = None
    document_lengths: dict[str, int] | None = None
    #: ``{min, max, seed}``: each batch row holds that many real keys, the rest is right padding.
    key_padding: dict[str, int] | None = None
    #: Target TFLOP/s of the ``auto`` row per mode (reported as met or not), e.g. (("fwd", 640.0),).
    goal: tuple[tuple[str, float], ...] = ()
    #: Query length when it differs from ``seq_len`` (the key length): decode and chunked prefill.
    q_len: int | None = None
    #: Value head dim when it differs from ``head_dim`` (DeepSeek-style q/k 192, v 128).
    v_head_dim: int | None = None
    #: Registry names whose ``typical_example`` for the case's shape joins it: masks ANDed with
    #: ``mask``, score mods chained after ``score_mod`` (families built from tensors: trees,
    #: shared prefixes, bias tables, block selections).
    example: tuple[str, ...] = ()

    @property
    def gqa(self) -> bool:
        return self.kv_heads != self.heads

    @property
    def dv(self) -> int:
        """The value head dim (``v_head_dim``, else ``head_dim``)."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def lq(self) -> int:
        """The query length (``q_len``, else ``seq_len``)."""
        return self.seq_len if self.q_len is None else self.q_len

    def specs(self, device: torch.device | str | None = None) -> tuple[MaskSpec | None, ScoreSpec | None]:
        """The case's (mask, score) specs, with captured tensors on ``device``."""
        mask, score = spec_from_dict(
            {
                "mask": _with_heads(self.mask, MASKS, self.heads),
                "score_mod": _with_heads(self.score_mod, SCORES, self.heads),
            }
        )
        for name in self.example:  # spec classes (checked at load: _examples)
            if name in MASKS:
                family: Any = MASKS.entry(name).factory
                built = family.typical_example(self.lq, self.seq_len, self.batch, self.heads)
                mask = built if mask is None else mask & built
            else:
                family = SCORES.entry(name).factory
                built = family.typical_example(self.lq, self.seq_len, self.batch, self.heads)
                score = built if score is None else score >> built
        if self.document_lengths is not None:
            from flexattn_zoo.masks import Document

            d = self.document_lengths
            doc = Document.from_lengths(document_lengths(self.seq_len, d["min"], d["max"], d.get("seed", 0)))
            mask = doc if mask is None else doc & mask
        if self.key_padding is not None:
            from flexattn_zoo.masks import KeyPadding

            d = self.key_padding
            gen = torch.Generator().manual_seed(d.get("seed", 0))
            real = torch.randint(d["min"], d["max"] + 1, (self.batch, 1), generator=gen)
            pad = KeyPadding(valid=torch.arange(self.seq_len)[None, :] < real)
            mask = pad if mask is None else pad & mask
        for spec in (mask, score):
            if spec is not None:
                spec.validate(self.lq, self.seq_len, self.batch, self.heads)
        if device is not None:
            mask = mask.to(device) if mask is not None else None
            score = score.to(device) if score is not None else None
        return mask, score

    def shape(self) -> str:
        heads = f"{self.heads}:{self.kv_heads}" if self.gqa else str(self.heads)
        lengths = f"L={self.seq_len}" if self.q_len is None else f"Lq={self.q_len} Lkv={self.seq_len}"
        dims = f"D={self.head_dim}" if self.v_head_dim is None else f"Dqk={self.head_dim} Dv={self.dv}"
        return f"B={self.batch} H={heads} {lengths} {dims}"


def document_lengths(seq_len: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """Random document lengths in ``[lo, hi]`` that tile ``seq_len`` (the last one is cut to fit)."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    total = 0
    while total < seq_len:
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        n = n if total + n <= seq_len else seq_len - total
        out.append(n)
        total += n
    return out


def _with_heads(entries: Any, registry: Any, heads: int) -> Any:
    """Fill ``num_heads`` into entries whose spec takes it (ALiBi) and that do not give it."""
    if entries is None:
        return None
    if isinstance(entries, str):
        entries = {"name": entries}
    if isinstance(entries, list):
        return [_with_heads(e, registry, heads) for e in entries]
    name = entries.get("name") if isinstance(entries, dict) else None
    # (a name that is not a str, e.g. a list, is left to spec_from_dict, which names the mistake:
    # ``in registry`` would raise "unhashable type" here)
    if isinstance(name, str) and name in registry and "num_heads" not in entries:
        factory = registry.entry(entries["name"]).factory
        if dataclasses.is_dataclass(factory) and "num_heads" in {f.name for f in dataclasses.fields(factory)}:
            return {**entries, "num_heads": heads}
    return entries


def _int(where: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where} must be an int >= {minimum}, got {value!r}")
    return value


def parse_names(where: str, value: Any, valid: list[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} must be a non-empty list, one of {', '.join(valid)}")
    for v in value:
        if v not in valid:
            raise ValueError(
                f"{where}: unknown {v!r}; valid: {', '.join(valid)}.{did_you_mean(str(v), valid)}"
            )
    return tuple(value)


def _settings(where: str, data: dict[str, Any]) -> dict[str, Any]:
    out = dict(data)
    if "dtype" in out and str(out["dtype"]).lower() not in DTYPES:
        raise ValueError(f"{where}.dtype: unknown {out['dtype']!r}; valid: bf16, fp16, fp32, fp64")
    if "device" in out and out["device"] not in ("auto", "cuda", "cpu"):
        raise ValueError(f"{where}.device must be auto, cuda or cpu, got {out['device']!r}")
    for key, minimum in (("warmup", 0), ("iters", 1), ("seed", 0)):
        if key in out:
            _int(f"{where}.{key}", out[key], minimum)
    if "modes" in out:
        out["modes"] = parse_names(f"{where}.modes", out["modes"], list(MODES))
    if "routes" in out:
        out["routes"] = parse_names(f"{where}.routes", out["routes"], all_routes())
    if "max_dense_gib" in out:
        v = out["max_dense_gib"]
        # ``not v > 0`` refuses NaN too, which no estimate exceeds: nothing would be skipped
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{where}.max_dense_gib must be a positive number, got {v!r}")
    return out


def _case(i: int, raw: Any, defaults: dict[str, Any]) -> Case:
    where = f"cases[{i}]"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping with keys {', '.join(CASE_KEYS)}")
    valid = [*CASE_KEYS, *DEFAULTS]
    for key in raw:
        if key not in valid:
            raise ValueError(
                f"{where}: unknown key {key!r}; valid: {', '.join(valid)}.{did_you_mean(str(key), valid)}"
            )
    for key in ("name", "batch", "heads", "seq_len", "head_dim"):
        if key not in raw:
            raise ValueError(f"{where} needs {key!r}")
    name = raw["name"]
    if not isinstance(name, str) or not name or "," in name:
        raise ValueError(f"{where}.name must be a non-empty string without commas, got {name!r}")
    where = f"case {name!r}"
    s = {**defaults, **_settings(where, {k: v for k, v in raw.items() if k in DEFAULTS})}
    heads = _int(f"{where}.heads", raw["heads"])
    kv_heads = _int(f"{where}.kv_heads", raw.get("kv_heads", heads))
    if heads % kv_heads:
        raise ValueError(f"{where}: heads {heads} must be a multiple of kv_heads {kv_heads}")
    docs = _length_range(where, "document_lengths", raw.get("document_lengths"))
    padding = _length_range(where, "key_padding", raw.get("key_padding"))
    seq_len = _int(f"{where}.seq_len", raw["seq_len"])
    # Draws past seq_len would be cut to it: one whole-sequence document, or no padding at all,
    # whatever the range asked for.
    for key, drawn, bound in (("document_lengths", docs, "min"), ("key_padding", padding, "max")):
        if drawn is not None and drawn[bound] > seq_len:
            raise ValueError(
                f"{where}.{key}.{bound} is {drawn[bound]}, past seq_len {seq_len}: draws must fit the sequence"
            )
    goal = _goal(where, raw.get("goal"))
    case = Case(
        name=name,
        batch=_int(f"{where}.batch", raw["batch"]),
        heads=heads,
        kv_heads=kv_heads,
        seq_len=seq_len,
        q_len=_int(f"{where}.q_len", raw["q_len"]) if raw.get("q_len") is not None else None,
        v_head_dim=_int(f"{where}.v_head_dim", raw["v_head_dim"])
        if raw.get("v_head_dim") is not None
        else None,
        head_dim=_int(f"{where}.head_dim", raw["head_dim"]),
        dtype=DTYPES[str(s["dtype"]).lower()],
        device=s["device"],
        warmup=s["warmup"],
        iters=s["iters"],
        modes=tuple(s["modes"]),
        routes=tuple(s["routes"]),
        max_dense_gib=float(s["max_dense_gib"]),
        seed=s["seed"],
        mask=raw.get("mask"),
        score_mod=raw.get("score_mod"),
        document_lengths=docs,
        key_padding=padding,
        example=_examples(where, raw.get("example")),
        goal=goal,
    )
    try:
        case.specs()  # fail at load time, not half-way through a sweep
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from exc
    return case


def _examples(where: str, raw: Any) -> tuple[str, ...]:
    """``example: NAME`` or a list of names, each a registered mask or score mod."""
    if raw is None:
        return ()
    names = raw if isinstance(raw, list) else [raw]
    valid = [*MASKS.names(), *SCORES.names()]
    for name in names:
        if not isinstance(name, str) or name not in valid:
            raise ValueError(
                f"{where}.example: unknown {name!r}; valid: {', '.join(valid)}.{did_you_mean(str(name), valid)}"
            )
        factory = (MASKS if name in MASKS else SCORES).entry(name).factory
        if not callable(getattr(factory, "typical_example", None)):
            raise ValueError(
                f"{where}.example: {name!r} is a registered function, not a spec class with examples"
            )
    return tuple(names)


def _length_range(where: str, key: str, raw: Any) -> dict[str, int] | None:
    """A validated ``{min: int, max: int, seed: int}`` entry (lengths drawn uniformly), or None."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) - {"min", "max", "seed"} or not {"min", "max"} <= set(raw):
        raise ValueError(f"{where}.{key} must be {{min: int, max: int, seed: int}}, got {raw!r}")
    lo, hi = _int(f"{where}.{key}.min", raw["min"]), _int(f"{where}.{key}.max", raw["max"])
    if hi < lo:
        raise ValueError(f"{where}.{key}: max {hi} < min {lo}")
    _int(f"{where}.{key}.seed", raw.get("seed", 0), 0)
    return raw


def _goal(where: str, raw: Any) -> tuple[tuple[str, float], ...]:
    """``goal: {fwd: 640, fwdbwd: 570}`` (either mode may be left out) as sorted pairs."""
    if raw is None:
        return ()
    if not isinstance(raw, dict) or not raw or set(raw) - set(MODES):
        raise ValueError(f"{where}.goal must map {' and/or '.join(MODES)} to TFLOP/s, got {raw!r}")
    out = []
    for mode, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{where}.goal.{mode} must be a positive number, got {value!r}")
        out.append((mode, float(value)))
    return tuple(sorted(out))


def goals(cases: list[Case]) -> dict[str, float]:
    """``{"case/mode": TFLOP/s}`` of every case's goal, as stored in a results file."""
    return {f"{c.name}/{mode}": value for c in cases for mode, value in c.goal}


def parse_config(data: Any) -> list[Case]:
    """Cases of an already-parsed sweep config (see the module docstring)."""
    if not isinstance(data, dict) or set(data) - {"defaults", "cases"}:
        raise ValueError("a sweep config is a mapping with keys 'defaults' (optional) and 'cases'")
    raw_defaults = data.get("defaults") or {}
    if not isinstance(raw_defaults, dict):
        raise ValueError("defaults must be a mapping")
    for key in raw_defaults:
        if key not in DEFAULTS:
            valid = list(DEFAULTS)
            raise ValueError(
                f"defaults: unknown key {key!r}; valid: {', '.join(valid)}.{did_you_mean(str(key), valid)}"
            )
    defaults = {**DEFAULTS, **_settings("defaults", raw_defaults)}
    cases = data.get("cases")
    if not isinstance(cases, list) or not cases:
        raise ValueError("cases must be a non-empty list")
    out = [_case(i, c, defaults) for i, c in enumerate(cases)]
    names = [c.name for c in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"duplicate case names: {', '.join(dupes)}")
    return out


def packaged_configs() -> list[str]:
    """Names of the sweep configs shipped in the package (``flexattn_zoo/bench/configs/NAME.yaml``;
    ``benchmarks/configs`` in a checkout points there): ``flexattn-zoo bench NAME`` runs one."""
    folder = importlib.resources.files("flexattn_zoo.bench").joinpath("configs")
    return sorted(f.name[: -len(".yaml")] for f in folder.iterdir() if f.name.endswith(".yaml"))


def config_text(source: str | Path) -> tuple[str, str]:
    """``(label, YAML text)`` of a sweep config: a file, or else the name of a packaged one.

    An existing file wins; a bare name (no directory, no ``.yaml`` needed) that is not a file is
    looked up in the package data. ValueError naming the packaged configs when neither exists.
    """
    p = Path(source)
    name = p.name[: -len(".yaml")] if p.name.endswith(".yaml") else p.name
    bare = str(source) in (name, f"{name}.yaml")
    if not bare or p.exists():
        return str(p), read_text_file(p, "sweep config")
    names = packaged_configs()
    if name not in names:
        raise ValueError(
            f"sweep config {str(source)!r} is neither a file nor a packaged config "
            f"({', '.join(names)}).{did_you_mean(name, names)}"
        )
    resource = importlib.resources.files("flexattn_zoo.bench").joinpath("configs").joinpath(f"{name}.yaml")
    return f"{name} (packaged)", resource.read_text(encoding="utf-8")


def load_config(source: str | Path) -> list[Case]:
    """Read and validate a YAML sweep config: a file, or the name of a packaged one
    (:func:`packaged_configs`: ``"h200"``, ``"smoke"``, ...)."""
    label, text = config_text(source)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"malformed YAML in {label!r}: {exc}") from exc
    return parse_config(data)
