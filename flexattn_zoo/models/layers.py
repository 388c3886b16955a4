"""Attention as a model layer: ``fz.Attention`` (an ``nn.Module``) and ``attention_layer`` (functional).

Both take ``q, k, v`` in ``[B, H, L, D]``, or ``[B, L, H, D]`` with ``layout="bshd"`` (projections,
RoPE and the KV cache stay in the model), and a configuration given once:

* ``config=``: a preset name (``"gemma2"``, with ``layer=``/``num_heads=``; see ``fz.presets``), a
  :class:`~flexattn_zoo.models.presets.LayerAttention`, a YAML path or text (``{mask: ..., score_mod: ...}``,
  see :mod:`flexattn_zoo.config`) or an already-parsed mapping;
* or ``mask=`` / ``score_mod=`` directly (specs, registry names or callables).

What the layer adds over ``fz.attention``: the configuration is resolved **once** into spec
objects that are reused on every call, so the BlockMask cache (keyed by spec value and shape) and
the compiled-kernel cache (keyed by ``mask_mod`` identity) hit from the second step on; GQA is
detected from the shapes; and learned **attention sinks** (see :mod:`flexattn_zoo.models.sinks`) are
applied through the route's lse, so they run on every route that returns a differentiable lse.

``Attention(..., sinks=True)`` creates the per-head sink logits as a parameter (zeros); a tensor
is used as given (a parameter if it requires grad). ``nn.Parameter`` tensors inside the layer's
specs (a learned ``RelPosBias`` table) are registered as the module's parameters too
(``mask_param{i}`` / ``score_mod_param{i}``), so an optimizer over ``model.parameters()`` trains them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from collections.abc import Mapping
from typing import Any, Literal, overload

import torch
from torch import nn

from flexattn_zoo import _compat, sharding
from flexattn_zoo.coercion import as_mask_spec, as_score_spec, tensor_args, with_causal
from flexattn_zoo.dispatch import as_bhsd, attention, check_backend, check_layout
from flexattn_zoo.models import presets as _presets
from flexattn_zoo.models.alignment import TopLeftCheck, functional_check
from flexattn_zoo.models.alignment import plain_4d as _plain_4d
from flexattn_zoo.models.presets import LayerAttention
from flexattn_zoo.models.sinks import apply_sinks, check_sinks
from flexattn_zoo.registry import MASKS, SCORES, did_you_mean
from flexattn_zoo.validation import check_count, check_dropout_p, check_flag, check_qkv, check_scale

__all__ = ["Attention", "attention_layer", "resolve_config"]


def resolve_config(
    config: Any = None,
    *,
    mask: Any = None,
    score_mod: Any = None,
    layer: int = 0,
    num_heads: int | None = None,
    preset_params: Mapping[str, Any] | None = None,
) -> LayerAttention:
    """Turn any accepted configuration into a :class:`LayerAttention` of spec objects.

    ``config`` (preset name, ``LayerAttention``, YAML path/text, or mapping) and ``mask``/``score_mod``
    are exclusive. ``layer``, ``num_heads`` and ``preset_params`` (the preset's own parameters, e.g.
    ``prefix_len`` of ``prefix_lm``) are only used by presets.
    """
    if config is not None and (mask is not None or score_mod is not None):
        raise ValueError("give either config= or mask=/score_mod=, not both")
    if preset_params and not (isinstance(config, str) and config in _presets.names()):
        raise TypeError(
            f"preset parameters ({', '.join(sorted(preset_params))}) need config= to name a preset "
            f"(one of {', '.join(_presets.names())}); got config={config!r}"
        )
    if config is None:
        mask, score_mod = tensor_args(mask, score_mod)
        if num_heads is not None:  # a registry name with a num_heads parameter (e.g. "alibi") gets it
            mask = _with_num_heads(mask, MASKS, num_heads)
            score_mod = _with_num_heads(score_mod, SCORES, num_heads)
        return LayerAttention(mask=as_mask_spec(mask), score_mod=as_score_spec(score_mod))
    if isinstance(config, LayerAttention):
        return config
    if isinstance(config, str) and config in _presets.names():
        return _presets.get(config, layer=layer, num_heads=num_heads, **(preset_params or {}))
    from flexattn_zoo.config import load_yaml_spec, spec_from_dict

    if isinstance(config, Mapping):
        m, s = spec_from_dict(dict(config))
    elif isinstance(config, (str, os.PathLike)):
        text = str(config)
        if "\n" not in text and ":" not in text and not text.endswith((".yaml", ".yml")):
            raise ValueError(
                f"config {text!r} is neither a preset ({', '.join(_presets.names())}) nor YAML "
                "(a path ending in .yaml/.yml, or text such as 'mask: {name: causal}')"
            )
        m, s = load_yaml_spec(config)
    else:
        raise TypeError(
            "config must be a preset name, a presets.LayerAttention, a YAML path or text, or a mapping; "
            f"got {type(config).__name__}"
        )
    return LayerAttention(mask=m, score_mod=s)


def _with_num_heads(arg: Any, registry: Any, num_heads: int) -> Any:
    """``arg`` built with ``num_heads=`` when it is the name of a registry entry taking that
    parameter (``"alibi"``); anything else as given."""
    if isinstance(arg, str):
        entry = registry.find(arg)
        if entry is not None and any(name == "num_heads" for name, _ in entry.params):
            return registry.get(arg, num_heads=num_heads)
    return arg


def _gqa(q: torch.Tensor, k: torch.Tensor, enable_gqa: bool | None) -> bool:
    if enable_gqa is None:
        return _plain_4d(q) and _plain_4d(k) and q.shape[1] != k.shape[1]
    return enable_gqa


def _run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    la: LayerAttention,
    *,
    scale: float | None,
    enable_gqa: bool | None,
    return_lse: bool,
    sinks: torch.Tensor | None,
    backend: str,
    layout: str = "bhsd",
    dropout_p: float | None = None,
    top_left: TopLeftCheck | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if layout != "bhsd":  # [B, L, H, D]: the layer runs on [B, H, L, D] views, out transposed back
        q, k, v = as_bhsd(q, k, v, layout)
        result = _run(
            q, k, v, la, scale=scale, enable_gqa=enable_gqa, return_lse=return_lse, sinks=sinks,
            backend=backend, dropout_p=dropout_p, top_left=top_left,
        )  # fmt: skip
        if isinstance(result, tuple):
            return result[0].transpose(1, 2), result[1]
        return result.transpose(1, 2)
    if top_left is not None and top_left.seen is not None:  # the layer's own mask, eager
        try:
            lq, lkv = q.shape[2], k.shape[2]
        except Exception:  # not a 4-D tensor: check_qkv names what is wrong
            lq = lkv = 0
        if 0 < lq < lkv and (lq, lkv) not in top_left.seen:
            top_left.check(q, k, lq, lkv)
    if la.uses_sinks and sinks is None:
        raise ValueError(
            f"this layer ({la.kind or 'preset'} attention) has learned attention sinks: pass sinks= "
            "(a float tensor [H]), or Attention(..., sinks=True) to learn them"
        )
    scale = la.scale if scale is None else scale
    gqa = _gqa(q, k, enable_gqa)
    kwargs: dict[str, Any] = dict(
        mask=la.mask, score_mod=la.score_mod, scale=scale, enable_gqa=gqa, backend=backend
    )
    if dropout_p:  # (given only when asked: a call without it is the call it always was)
        # With sinks the dropped probabilities are rescaled by the sink factor below: the same as
        # dropping the probabilities of the softmax that includes the sink (its value vector is 0).
        kwargs["dropout_p"] = dropout_p
    if sinks is None:
        return attention(q, k, v, return_lse=return_lse, **kwargs)
    if sharding.holds_dtensor(q, k, v) and not sharding.holds_dtensor(sinks):
        return _run_on_shard(
            q, k, v, la, scale=scale, enable_gqa=gqa, return_lse=return_lse, sinks=sinks,
            backend=backend, dropout_p=dropout_p,
        )  # fmt: skip
    if not _plain_4d(q):  # q's heads and device are read for the sinks: say what is wrong first
        check_qkv(q, k, v, enable_gqa=gqa)  # (a plain 4-D q is checked by attention, once)
    check_sinks(sinks, q.shape[1], q.device)
    score = as_score_spec(la.score_mod)
    if score is not None and score.is_activation():
        raise ValueError(
            f"sinks take part in a softmax; score_mod {type(score).__name__} is activation attention "
            "(unnormalised weights), which has none: drop sinks= or the activation score_mod"
        )
    out, lse = attention(q, k, v, return_lse=True, **kwargs)
    out, lse = apply_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out


def _run_on_shard(
    q: Any,
    k: Any,
    v: Any,
    la: LayerAttention,
    *,
    scale: float | None,
    enable_gqa: bool,
    return_lse: bool,
    sinks: torch.Tensor,
    backend: str,
    dropout_p: float | None,
) -> Any:
    """``_run`` of DTensor ``q, k, v`` with plain-tensor ``sinks [H]`` (one logit per head of the
    whole call): this rank's local call, its specs re-based as ``fz.attention`` re-bases them, with
    the sinks of its own heads, wrapped back as DTensors. The sinks' gradient on each rank is that
    of its own rows and heads, as for any tensor a spec reads (no communication)."""
    local = sharding.localize(q, k, v, enable_gqa=enable_gqa)
    check_sinks(sinks, local.total[1], local.q.device)
    mask, score_mod = sharding.rebase(local, *tensor_args(la.mask, la.score_mod))
    start, stop = local.heads
    result = _run(
        local.q, local.k, local.v, dataclasses.replace(la, mask=mask, score_mod=score_mod),
        scale=scale, enable_gqa=enable_gqa, return_lse=return_lse, sinks=sinks[start:stop],
        backend=backend, dropout_p=dropout_p,
    )  # fmt: skip
    return local.to_global(result)


@overload
def attention_layer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    config: Any = ...,
    mask: Any = ...,
    score_mod: Any = ...,
    layer: int = ...,
    scale: float | None = ...,
    enable_gqa: bool | None = ...,
    return_lse: Literal[False] = ...,
    sinks: torch.Tensor | None = ...,
    backend: str = ...,
    layout: str = ...,
    dropout_p: float | None = ...,
    **preset_params: Any,
) -> torch.Tensor: ...
@overload
def attention_layer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    config: Any = ...,
    mask: Any = ...,
    score_mod: Any = ...,
    layer: int = ...,
    scale: float | None = ...,
    enable_gqa: bool | None = ...,
    return_lse: Literal[True],
    sinks: torch.Tensor | None = ...,
    backend: str = ...,
    layout: str = ...,
    dropout_p: float | None = ...,
    **preset_params: Any,
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def attention_layer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    config: Any = ...,
    mask: Any = ...,
    score_mod: Any = ...,
    layer: int = ...,
    scale: float | None = ...,
    enable_gqa: bool | None = ...,
    return_lse: bool = ...,
    sinks: torch.Tensor | None = ...,
    backend: str = ...,
    layout: str = ...,
    dropout_p: float | None = ...,
    **preset_params: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def attention_layer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    config: Any = None,
    mask: Any = None,
    score_mod: Any = None,
    layer: int = 0,
    scale: float | None = None,
    enable_gqa: bool | None = None,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
    backend: str = "auto",
    layout: str = "bhsd",
    dropout_p: float | None = None,
    **preset_params: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Functional layer: ``fz.attention`` configured by a preset / YAML / specs, with sinks.

    Args:
        config: preset name, ``LayerAttention``, YAML path or text, or mapping (or use mask/score_mod).
        layer: the layer index, for presets whose layers differ (local/global patterns).
        scale: overrides the preset's scale (default ``1/sqrt(D)``).
        enable_gqa: None detects grouped-query attention from the head counts.
        return_lse: also return the lse (with sinks: the log-normaliser including the sink).
        sinks: per-head sink logits ``[H]`` (see :mod:`flexattn_zoo.models.sinks`), or None.
        backend: as for ``fz.attention``; with sinks the route must return an lse.
        layout: as for ``fz.attention``: ``"bhsd"`` (default) or ``"bshd"`` (``[B, L, H, D]`` in
            and out, viewed with ``transpose(1, 2)``, no copy; the lse stays ``[B, H, Lq]``).
        dropout_p: as for ``fz.attention`` (applied whenever above 0: pass 0.0 in evaluation).
        **preset_params: the preset's own parameters, as for :class:`Attention`, e.g.
            ``attention_layer(q, k, v, config="prefix_lm", prefix_len=32)``.

    For repeated calls prefer :class:`Attention`, which resolves the configuration once; here a
    preset or YAML config is resolved on every call (equal specs still hit the caches).
    """
    heads_dim = 2 if check_layout(layout) == "bshd" else 1
    heads = q.shape[heads_dim] if _plain_4d(q) else None
    _check_own_keywords(attention_layer, config, preset_params)
    la = resolve_config(
        config, mask=mask, score_mod=score_mod, layer=layer, num_heads=heads, preset_params=preset_params
    )
    return _run(
        q, k, v, la, scale=scale, enable_gqa=enable_gqa, return_lse=return_lse, sinks=sinks, backend=backend,
        layout=layout, dropout_p=check_dropout_p(dropout_p), top_left=functional_check(la.mask),
    )  # fmt: skip


def _check_own_keywords(fn: Any, config: Any, preset_params: Mapping[str, Any]) -> None:
    """``TypeError`` for a keyword that is no parameter of ``config``'s preset but close to one of
    ``fn``'s own (``dropout=`` for ``dropout_p=``, ``num_head=``): every other keyword is taken as a
    preset parameter, and the preset's error would not name the argument meant."""
    if not preset_params:
        return  # the common call: nothing to check (attention_layer runs this per call)
    known = _presets.entry(config).params if isinstance(config, str) and config in _presets.names() else ()
    own = _keyword_only(fn)
    for name in preset_params:
        hint = did_you_mean(name, list(own))
        if name not in known and hint:
            raise TypeError(f"{fn.__name__}() got an unexpected keyword argument {name!r}.{hint}")


@functools.cache
def _keyword_only(fn: Any) -> tuple[str, ...]:
    return tuple(
        p.name for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
    )


#: ``Attention.set_mask``'s "not given" (None means "no mask").
_KEEP: Any = object()


class Attention(nn.Module):
    """Attention over given ``q, k, v`` as a module: ``forward(q, k, v) -> out`` (or ``(out, lse)``).

    Args:
        config: preset name (then ``layer`` and, for ALiBi presets, ``num_heads``), a
            ``LayerAttention``, a YAML path or text, or a mapping. Exclusive with mask/score_mod.
        mask, score_mod: specs, registry names or callables.
        layer: layer index for presets.
        num_heads: number of query heads (needed for ALiBi presets and for ``sinks=True``; also
            given to a ``mask=`` / ``score_mod=`` registry name that takes it, e.g.
            ``score_mod="alibi"``).
        scale: overrides the preset's scale; default ``1/sqrt(D)``.
        enable_gqa: None detects GQA from the head counts.
        return_lse: forward also returns the lse.
        sinks: None; True to learn per-head sink logits (a parameter of zeros, needs ``num_heads``;
            also implied by a preset layer with sinks); False for none, also where the preset's
            layer has them (an ablation: the layer then runs without); or a tensor ``[H]`` (a parameter if it
            requires grad, else a buffer). A tensor that requires grad must be a leaf: one
            computed from others (a view of a larger parameter) raises ``TypeError``, as its
            gradient could not reach them through the layer's own parameter.
        backend: as for ``fz.attention``.
        is_causal: as for ``fz.attention`` (SDPA's flag): the layer's mask becomes ``mask & Causal()``
            (``Causal()`` without one). A mask given later (``set_mask``, ``forward(mask=)``)
            replaces the whole mask, the causal part included.
        **preset_params: the preset's own parameters, e.g.
            ``Attention("prefix_lm", prefix_len=32)``; ``flexattn-zoo presets`` lists them.
        layout: as for ``fz.attention``: ``"bhsd"`` (default, ``[B, H, L, D]``) or ``"bshd"``
            (``[B, L, H, D]``, as projections give: ``forward`` takes q, k, v and returns ``out``
            in that layout, viewed with ``transpose(1, 2)``, no copy; the lse stays ``[B, H, Lq]``).
            Checked here: another value raises ``ValueError``.
        dropout_p: attention dropout, as ``fz.attention``'s (a float in ``[0, 1)``, checked here),
            applied only while the module is training (``module.train()``, the default), as
            ``nn.MultiheadAttention``'s ``dropout``: ``eval()`` turns it off without a new layer.

    The specs are resolved in ``__init__`` and the same objects are passed on every call, so after
    the first step no BlockMask is built and no kernel compiled for an unchanged shape.

    Masks are top-left aligned, as SDPA's ``is_causal``: with fewer queries than keys (a KV-cache
    step) the queries are positions ``0..Lq-1``, not the cache's last ones. Where that changes what
    the last query sees, the first eager call at such lengths gives one ``UserWarning`` per layer
    (the output stays the top-left one; a ``forward(mask=...)`` override is not checked, nor are
    masks holding tensors or callables): decode with ``fz.decode.decode_step``, or give the layer a
    bottom-right mask (``masks.Causal(align="bottom_right")``).

    Changing the mask: specs own their tensors, so writing in place to the ids a ``Document`` was
    built from changes nothing. Pass the new layout per call, ``forward(q, k, v, mask=...)`` (and
    ``score_mod=``), or replace the layer's own with :meth:`set_mask`. A raw callable given as
    ``mask=`` is tracked instead: in-place writes to the tensors it captures are seen on the next
    call (see ``fz.invalidate`` for other captured state).
    """

    def __init__(
        self,
        config: Any = None,
        *,
        mask: Any = None,
        score_mod: Any = None,
        layer: int = 0,
        num_heads: int | None = None,
        scale: float | None = None,
        enable_gqa: bool | None = None,
        return_lse: bool = False,
        sinks: bool | torch.Tensor | None = None,
        backend: str = "auto",
        is_causal: bool = False,
        layout: str = "bhsd",
        dropout_p: float = 0.0,
        **preset_params: Any,
    ) -> None:
        super().__init__()
        if num_heads is not None:  # checked even where unused: a wrong count is a bug either way
            check_count("Attention(num_heads=...)", num_heads)
        _check_own_keywords(Attention, config, preset_params)
        self.layout = check_layout(layout)
        self.dropout_p = check_dropout_p(dropout_p)
        self.spec = resolve_config(
            config,
            mask=mask,
            score_mod=score_mod,
            layer=layer,
            num_heads=num_heads,
            preset_params=preset_params,
        )
        if is_causal is not False:
            self.spec = dataclasses.replace(self.spec, mask=with_causal(self.spec.mask, is_causal))
        check_scale(scale)
        self.scale = scale
        self.enable_gqa = enable_gqa if enable_gqa is None else check_flag("enable_gqa", enable_gqa)
        self.return_lse = check_flag("return_lse", return_lse)
        self.backend = check_backend(backend)
        self.sinks: torch.Tensor | None
        if sinks is True or (sinks is None and self.spec.uses_sinks):
            if num_heads is None:
                raise ValueError("Attention(sinks=True) (or a preset layer with sinks) needs num_heads=")
            self.sinks = nn.Parameter(torch.zeros(num_heads))
        elif isinstance(sinks, torch.Tensor):
            # Checked here as the call checks it (the call also matches H and the device).
            if not sinks.is_floating_point() or sinks.dim() != 1:
                raise TypeError(
                    f"sinks must be a floating tensor [H] (one logit per query head), got dtype "
                    f"{sinks.dtype} and shape {tuple(sinks.shape)}"
                )
            if num_heads is not None and sinks.shape[0] != num_heads:
                raise ValueError(f"sinks has {sinks.shape[0]} entries but num_heads={num_heads}")
            if isinstance(sinks, nn.Parameter):
                self.sinks = sinks
            elif sinks.requires_grad and sinks.grad_fn is not None:
                # nn.Parameter(sinks) would be a new leaf over the same storage: the gradient would
                # stop there and never reach the tensors sinks was computed from (a row of a
                # parameter of all layers' sinks, a reparametrization), which would silently not train.
                raise TypeError(
                    "sinks requires grad but is computed from other tensors (it has a grad_fn, e.g. "
                    "a row or view of a larger parameter): the layer keeps its sinks as a parameter "
                    "of its own, so their gradient would not reach those tensors. Pass an "
                    "nn.Parameter [H] (or sinks=True), or compute the sinks per call and pass them to "
                    "fz.layers.attention_layer(..., sinks=...)"
                )
            elif sinks.requires_grad:
                self.sinks = nn.Parameter(sinks)
            else:
                self.register_buffer("sinks", sinks)
        elif sinks is None or sinks is False:
            self.sinks = None
            if sinks is False and self.spec.uses_sinks:
                # An explicit opt-out: the preset's layer without its sinks (every call would
                # otherwise refuse for want of them).
                self.spec = dataclasses.replace(self.spec, uses_sinks=False)
        else:
            raise TypeError(f"sinks must be None, True, False or a tensor [H], got {type(sinks).__name__}")
        self._register_spec_parameters()

    def _register_spec_parameters(self) -> None:
        """Register the ``nn.Parameter`` tensors the layer's specs hold (a learned relative-position
        table) as parameters of this module, named
        ``mask_param{i}`` / ``score_mod_param{i}`` in the specs' order: ``model.parameters()``
        (an optimizer), ``state_dict`` and ``.to()`` reach them as they reach ``sinks``. Called
        again when the specs change (:meth:`set_mask`), dropping the former ones."""
        for name in [n for n in self._parameters if n.startswith(("mask_param", "score_mod_param"))]:
            del self._parameters[name]
        for kind, spec in (("mask", self.spec.mask), ("score_mod", self.spec.score_mod)):
            if spec is None:
                continue
            params = [t for t in spec.tensors() if isinstance(t, nn.Parameter)]
            for i, param in enumerate(dict.fromkeys(params)):  # one entry per parameter, in order
                self.register_parameter(f"{kind}_param{i}", param)

    @property
    def mask(self) -> Any:
        """The layer's mask spec (None: none); assigning to it is :meth:`set_mask`."""
        return self.spec.mask

    @mask.setter
    def mask(self, mask: Any) -> None:
        self.set_mask(mask)

    @property
    def score_mod(self) -> Any:
        """The layer's score spec (None: none); assigning to it is ``set_mask(score_mod=...)``."""
        return self.spec.score_mod

    @score_mod.setter
    def score_mod(self, score_mod: Any) -> None:
        self.set_mask(score_mod=score_mod)

    def set_mask(self, mask: Any = _KEEP, *, score_mod: Any = _KEEP) -> None:
        """Replace the layer's mask and/or score mod (spec, registry name or callable; ``None``
        removes it); what is not given is kept. The rest of the configuration (scale, sinks) stays.

        For a mask that changes every step (packed documents), passing ``mask=`` to
        :meth:`forward` is the same without touching the layer.
        """
        changes: dict[str, Any] = {}
        if mask is not _KEEP:
            changes["mask"] = as_mask_spec(mask)
        if score_mod is not _KEEP:
            changes["score_mod"] = as_score_spec(score_mod)
        if changes:
            self.spec = dataclasses.replace(self.spec, **changes)
            self._register_spec_parameters()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: Any = None, score_mod: Any = None
    ) -> Any:
        """Attention of ``q, k, v`` under the layer's configuration.

        ``mask`` / ``score_mod`` (spec, registry name, callable; ``mask`` also a ``BlockMask``)
        replace the layer's own for this call only, e.g. a ``masks.Document`` of this batch's
        packing (``& masks.Causal()`` for a causal layer: the override is the whole mask). None
        keeps the layer's.
        """
        la = self.spec
        top_left = None
        if mask is None and not _compat.is_compiling():  # the layer's own mask (see TopLeftCheck)
            top_left = self.__dict__.get("_top_left")
            if top_left is None or top_left.mask is not la.mask:
                top_left = self.__dict__["_top_left"] = TopLeftCheck(la.mask, "fz.Attention")
        if mask is not None or score_mod is not None:
            la = dataclasses.replace(
                la,
                mask=la.mask if mask is None else mask,
                score_mod=la.score_mod if score_mod is None else score_mod,
            )
        return _run(
            q,
            k,
            v,
            la,
            scale=self.scale,
            enable_gqa=self.enable_gqa,
            return_lse=self.return_lse,
            sinks=self.sinks,
            backend=self.backend,
            layout=self.layout,
            dropout_p=(self.dropout_p or None) if self.training else None,
            top_left=top_left,
        )

    def extra_repr(self) -> str:
        parts = [f"mask={self.spec.mask!r}", f"score_mod={self.spec.score_mod!r}"]
        if self.sinks is not None:
            parts.append(f"sinks=[{self.sinks.numel()}]")
        if self.layout != "bhsd":
            parts.append(f"layout={self.layout!r}")
        if self.dropout_p:
            parts.append(f"dropout_p={self.dropout_p:g}")
        return ", ".join(parts)
