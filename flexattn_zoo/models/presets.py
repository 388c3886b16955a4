"""Attention configurations of real models, layer by layer (``fz.presets``).

``get(name, layer=i, num_heads=H)`` returns what layer ``i`` of that model family computes, as zoo
specs::

    la = fz.presets.get("gemma2", layer=0)
    out = fz.attention(q, k, v, mask=la.mask, score_mod=la.score_mod, scale=la.scale)

Each preset's docstring cites where its numbers come from (paper, model card, reference code or
the Hugging Face config fields that carry them). Lengths follow the published checkpoints; pass
your own (``window=``, ``chunk=``, ``cap=`` ...) to model a variant. ``names()`` lists the presets;
``flexattn-zoo list presets`` prints them.

Conventions: a Hugging Face ``sliding_window=W`` means ``W`` keys including the query's own
(``SlidingWindow.from_hf(W)``, which is already causal). ``uses_sinks`` says the layer has learned
attention sinks; pass their values to :class:`flexattn_zoo.Attention` / ``attention_layer``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from numbers import Integral, Real
from typing import Any

from flexattn_zoo.registry import did_you_mean
from flexattn_zoo.spec import MaskSpec, ScoreSpec
from flexattn_zoo.validation import check_count

__all__ = ["LayerAttention", "Preset", "get", "names", "preset", "presets"]


@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """What one attention layer computes: mask, score mod, scale and whether it has sinks.

    ``scale=None`` means the default ``1/sqrt(head_dim)``. ``kind`` is a short label of the layer
    type (``"local"``, ``"global"``, ``"chunked"``) for printing.
    """

    mask: MaskSpec | None
    score_mod: ScoreSpec | None = None
    uses_sinks: bool = False
    scale: float | None = None
    kind: str = ""


@dataclasses.dataclass(frozen=True)
class Preset:
    """One model family: ``build(layer, num_heads, **params) -> LayerAttention`` plus its story."""

    name: str
    model: str
    pattern: str
    source: str
    build: Callable[..., LayerAttention]
    params: tuple[str, ...] = ()
    needs_heads: bool = False

    def layer(self, layer: int = 0, num_heads: int | None = None, **params: Any) -> LayerAttention:
        # numpy's integers too, as check_count takes them for num_heads: a config read with numpy
        # gives them, and a layer index is a count from 0.
        if isinstance(layer, bool) or not isinstance(layer, Integral):
            raise TypeError(
                f"presets.get({self.name!r}, layer=...) must be an int >= 0, got {type(layer).__name__} {layer!r}"
            )
        if layer < 0:
            raise ValueError(f"presets.get({self.name!r}, layer=...) must be an int >= 0, got {layer!r}")
        layer = int(layer)
        unknown = [p for p in params if p not in self.params]
        if unknown:
            raise ValueError(
                f"preset {self.name!r} got unknown parameter(s) {', '.join(map(repr, unknown))}; valid: "
                f"{', '.join(self.params) or '(none)'}.{did_you_mean(unknown[0], list(self.params))}"
            )
        if self.needs_heads and num_heads is None:
            raise ValueError(f"preset {self.name!r} needs num_heads= (its score mod is per head)")
        if num_heads is not None:
            check_count(f"presets.get({self.name!r}, num_heads=...)", num_heads)
        return self.build(layer, num_heads, **params)


_PRESETS: dict[str, Preset] = {}


def preset(
    name: str, *, model: str, pattern: str, params: tuple[str, ...] = (), needs_heads: bool = False
) -> Callable[[Callable[..., LayerAttention]], Callable[..., LayerAttention]]:
    """Decorator registering a layer builder as a preset; its docstring is the cited source."""

    def decorate(fn: Callable[..., LayerAttention]) -> Callable[..., LayerAttention]:
        if name in _PRESETS:
            raise ValueError(f"preset {name!r} is already defined")
        source = " ".join((fn.__doc__ or "").split())
        _PRESETS[name] = Preset(name, model, pattern, source, fn, params, needs_heads)
        return fn

    return decorate


def names() -> list[str]:
    """Preset names, sorted."""
    return sorted(_PRESETS)


def presets() -> list[Preset]:
    """Every preset, sorted by name."""
    return [_PRESETS[n] for n in names()]


def entry(name: str) -> Preset:
    """The :class:`Preset` called ``name`` (``ValueError`` listing the valid names otherwise)."""
    if not isinstance(name, str):
        raise TypeError(f"preset name must be a str, got {type(name).__name__}")
    if name not in _PRESETS:
        raise ValueError(
            f"unknown preset {name!r}; valid: {', '.join(names())}.{did_you_mean(name, names())}"
        )
    return _PRESETS[name]


def get(name: str, layer: int = 0, num_heads: int | None = None, **params: Any) -> LayerAttention:
    """Layer ``layer`` of preset ``name`` (``num_heads`` is needed by ALiBi presets)."""
    return entry(name).layer(layer, num_heads, **params)


# ---------------------------------------------------------------------------------------------
# The catalogue. Imports are local so that importing fz.presets stays cheap and cycle-free.


def _period(preset_name: str, every: object) -> int:
    """A preset's ``every`` (one global layer per ``every`` layers), an int >= 1: the layer index is
    taken modulo it, so 0 would divide by zero and a negative or bool one would pick layers silently."""
    return check_count(f"presets.get({preset_name!r}, every=...)", every)


def _scale_of(preset_name: str, query_pre_attn_scalar: object) -> float:
    """``query_pre_attn_scalar ** -0.5``, the scale Gemma uses, for a finite real scalar > 0 (0
    would divide by zero, a negative one give a complex scale)."""
    arg = f"presets.get({preset_name!r}, query_pre_attn_scalar=...)"
    if isinstance(query_pre_attn_scalar, bool) or not isinstance(query_pre_attn_scalar, Real):
        raise TypeError(
            f"{arg} must be a finite number > 0 (e.g. 256), got {type(query_pre_attn_scalar).__name__}"
        )
    value = float(query_pre_attn_scalar)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{arg} must be a finite number > 0 (e.g. 256), got {query_pre_attn_scalar!r}")
    return value**-0.5


def _masks() -> Any:
    from flexattn_zoo import masks

    return masks


def _scores() -> Any:
    from flexattn_zoo import score_mods

    return score_mods


@preset(
    "mistral_7b",
    model="Mistral 7B (v0.1)",
    pattern="every layer: causal sliding window of 4096",
    params=("window",),
)
def _mistral(layer: int, num_heads: int | None, window: int = 4096) -> LayerAttention:
    """Mistral 7B paper (Jiang et al., 2023, arXiv:2310.06825, section 2: sliding window attention,
    W = 4096, in every layer); Hugging Face MistralConfig ``sliding_window=4096`` for v0.1 (the
    Hugging Face convention: W keys including the query itself)."""
    m = _masks()
    return LayerAttention(mask=m.SlidingWindow.from_hf(window), kind="local")


@preset(
    "gemma2",
    model="Gemma 2",
    pattern="layers 0,2,4..: sliding 4096; 1,3,5..: global; softcap 50 everywhere",
    params=("window", "cap", "query_pre_attn_scalar"),
)
def _gemma2(
    layer: int,
    num_heads: int | None,
    window: int = 4096,
    cap: float = 50.0,
    query_pre_attn_scalar: float = 256,
) -> LayerAttention:
    """Gemma 2 report (Gemma Team, 2024, arXiv:2408.00118, section 2): local sliding-window and
    global attention alternate in every other layer (local span 4096, global 8192), attention
    logits soft-capped at 50.0. Hugging Face Gemma2Config: ``sliding_window=4096``,
    ``attn_logit_softcapping=50.0``, ``query_pre_attn_scalar=256`` (scale ``256**-0.5``),
    ``layer_types`` sliding for even layer indices, full for odd ones."""
    m, s = _masks(), _scores()
    local = layer % 2 == 0
    mask = m.SlidingWindow.from_hf(window) if local else m.Causal()
    return LayerAttention(
        mask=mask,
        score_mod=s.SoftCap(cap=cap),
        scale=_scale_of("gemma2", query_pre_attn_scalar),
        kind="local" if local else "global",
    )


@preset(
    "gemma3",
    model="Gemma 3",
    pattern="5 local (sliding 1024) : 1 global; layers 5, 11, 17.. global",
    params=("window", "every", "query_pre_attn_scalar"),
)
def _gemma3(
    layer: int, num_heads: int | None, window: int = 1024, every: int = 6, query_pre_attn_scalar: float = 256
) -> LayerAttention:
    """Gemma 3 technical report (Gemma Team, 2025, arXiv:2503.19786, section 2): 5 local layers per
    global layer, local span 1024 tokens, soft-capping replaced by QK-norm (so no score mod here).
    Hugging Face Gemma3TextConfig: ``sliding_window_pattern=6`` (layer i is global iff
    ``(i + 1) % 6 == 0``), ``sliding_window=1024`` in the released checkpoints' config.json,
    ``query_pre_attn_scalar=256``."""
    m = _masks()
    local = (layer + 1) % _period("gemma3", every) != 0
    mask = m.SlidingWindow.from_hf(window) if local else m.Causal()
    return LayerAttention(
        mask=mask, scale=_scale_of("gemma3", query_pre_attn_scalar), kind="local" if local else "global"
    )


@preset(
    "llama4",
    model="Llama 4 (Scout / Maverick)",
    pattern="3 chunked (8192) : 1 global; layers 3, 7, 11.. global",
    params=("chunk", "every"),
)
def _llama4(layer: int, num_heads: int | None, chunk: int = 8192, every: int = 4) -> LayerAttention:
    """Llama 4 model card (Meta, 2025: interleaved attention layers without positional
    embeddings, "iRoPE"); Hugging Face Llama4TextConfig: ``attention_chunk_size=8192``,
    ``no_rope_layer_interval=4`` -- layer i uses RoPE with chunked causal attention unless
    ``(i + 1) % 4 == 0``, where it is a global (NoPE) causal layer (``layer_types``
    "chunked_attention" / "full_attention"). The NoPE layers' attention-temperature tuning
    scales the queries before attention, outside this spec."""
    m = _masks()
    local = (layer + 1) % _period("llama4", every) != 0
    mask = (m.Chunked(size=chunk) & m.Causal()) if local else m.Causal()
    return LayerAttention(mask=mask, kind="chunked" if local else "global")


@preset("bloom", model="BLOOM", pattern="every layer: causal + ALiBi", needs_heads=True)
def _bloom(layer: int, num_heads: int | None) -> LayerAttention:
    """BLOOM paper (BigScience, 2022, arXiv:2211.05100, section 3.2: ALiBi positional embeddings
    instead of learned or rotary ones; causal decoder). Slopes are Press et al.'s
    (arXiv:2108.12409); BLOOM-176B has 112 heads."""
    m, s = _masks(), _scores()
    return LayerAttention(mask=m.Causal(), score_mod=s.Alibi(num_heads=num_heads), kind="global")


@preset("mpt", model="MPT-7B / MPT-30B", pattern="every layer: causal + ALiBi", needs_heads=True)
def _mpt(layer: int, num_heads: int | None) -> LayerAttention:
    """MPT-7B model card (MosaicML, 2023: "ALiBi" instead of positional embeddings); its config
    ``attn_config: {alibi: true, alibi_bias_max: 8}``, i.e. slopes ``2^(-8(h+1)/H)`` for H a power
    of two (MPT-7B: 32 heads). For other H, MPT's ``gen_slopes`` takes the odd-indexed slopes of
    the next power of two, then the even-indexed ones: the same values in the same order as Press
    et al.'s, which ``Alibi`` computes."""
    m, s = _masks(), _scores()
    return LayerAttention(mask=m.Causal(), score_mod=s.Alibi(num_heads=num_heads), kind="global")


@preset("grok1", model="Grok-1", pattern="every layer: causal, logits soft-capped at 30", params=("cap",))
def _grok1(layer: int, num_heads: int | None, cap: float = 30.0) -> LayerAttention:
    """xAI grok-1 open release, model.py (MultiHeadAttention): logits are multiplied by
    ``attn_output_multiplier`` (0.0883883..., i.e. 1/sqrt(128) for head dim 128), then
    ``max_attn_val * tanh(logits / max_attn_val)`` with ``max_attn_val = 30.0``; causal decoder,
    48 query heads over 8 key/value heads."""
    m, s = _masks(), _scores()
    return LayerAttention(mask=m.Causal(), score_mod=s.SoftCap(cap=cap), kind="global")


@preset(
    "gpt_oss",
    model="gpt-oss-20b / gpt-oss-120b",
    pattern="layers 0,2,4..: sliding 128; 1,3,5..: global; learned sinks",
    params=("window",),
)
def _gpt_oss(layer: int, num_heads: int | None, window: int = 128) -> LayerAttention:
    """OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card" (August 2025, architecture): attention alternates
    between banded windows of 128 tokens and fully dense layers; every head has a learned bias in
    the softmax denominator ("attention sink"). Hugging Face GptOssConfig: ``sliding_window=128``,
    ``layer_types`` sliding for even layer indices; the modeling code passes the per-head
    ``sinks`` parameter to the attention function as ``s_aux``."""
    m = _masks()
    local = layer % 2 == 0
    mask = m.SlidingWindow.from_hf(window) if local else m.Causal()
    return LayerAttention(mask=mask, uses_sinks=True, kind="local" if local else "global")


@preset(
    "modernbert",
    model="ModernBERT",
    pattern="bidirectional; layers 0,3,6..: global; others: local +-64 (128 window)",
    params=("window", "every"),
)
def _modernbert(layer: int, num_heads: int | None, window: int = 128, every: int = 3) -> LayerAttention:
    """ModernBERT paper (Warner et al., 2024, arXiv:2412.13663, section 2.1.2): global attention
    every third layer, otherwise local sliding-window attention over 128 tokens; an encoder, so
    bidirectional. Hugging Face ModernBertConfig: ``local_attention=128`` (a key is visible iff
    ``|i - j| <= 128 // 2``), ``global_attn_every_n_layers=3`` (layer i global iff ``i % 3 == 0``)."""
    m = _masks()
    local = layer % _period("modernbert", every) != 0
    # Checked here, not by SlidingWindow: window // 2 would turn True into 0 and a str into
    # Python's own TypeError, and a negative window's error would name left= with half its value.
    half = check_count("presets.get('modernbert', window=...)", window) // 2
    mask = m.SlidingWindow(left=half, right=half) if local else None
    return LayerAttention(mask=mask, kind="local" if local else "global")


@preset(
    "prefix_lm",
    model="T5 prefix LM / PaliGemma",
    pattern="every layer: prefix bidirectional, then causal",
    params=("prefix_len",),
)
def _prefix_lm(layer: int, num_heads: int | None, prefix_len: Any = None) -> LayerAttention:
    """T5 paper (Raffel et al., 2020, arXiv:1910.10683, section 3.2.1, "prefix LM" mask: fully
    visible over the prefix, causal after it); PaliGemma (Beyer et al., 2024, arXiv:2407.07726,
    section 3.2: full attention on image and prefix tokens, autoregressive on the suffix).
    ``prefix_len`` (an int or a ``[B]`` tensor) is required."""
    if prefix_len is None:
        raise ValueError("preset 'prefix_lm' needs prefix_len= (an int, or a [B] tensor of per-row prefixes)")
    m = _masks()
    return LayerAttention(mask=m.PrefixLM(prefix_len=prefix_len), kind="global")
