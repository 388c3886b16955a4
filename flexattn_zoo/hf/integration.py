"""The attention function and mask builder that :func:`flexattn_zoo.hf.register` installs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flexattn_zoo import _compat
from flexattn_zoo.dispatch import attention, check_backend
from flexattn_zoo.hf import factories
from flexattn_zoo.hf.mask_reader import (
    HFMask,
    dense_mask_spec,
    masking_utils,
    structural_reader_enabled,
    translate,
)
from flexattn_zoo.hf.mask_reader import transformers_module as _transformers
from flexattn_zoo.masks import Causal, SlidingWindow
from flexattn_zoo.masks.band import Band
from flexattn_zoo.masks.causal import OffsetCausal
from flexattn_zoo.models.decode import one_query_over_live_keys
from flexattn_zoo.models.sinks import apply_sinks, check_sinks
from flexattn_zoo.score_mods import SoftCap

DEFAULT_NAME = "flexattn_zoo"
#: Keyword arguments transformers passes that change the math and that we cannot honour.
UNSUPPORTED_KWARGS = ("position_bias", "alibi", "head_mask")

__all__ = ["DEFAULT_NAME", "HFMask", "register", "translate"]


# ---------------------------------------------------------------------------------------------
# The mask builder


def _mask_builder(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    mask_function: Callable[..., Any] | None = None,
    attention_mask: torch.Tensor | HFMask | None = None,
    **_: Any,
) -> HFMask:
    padding = None
    if isinstance(attention_mask, HFMask):
        # Our own mask handed back (static-cache generate builds masks ahead of the forward and
        # models without layer_types build theirs again from it): keep its padding, take the
        # pattern, sizes and offsets from this call, which knows the layer being built.
        padding = attention_mask.padding
    elif attention_mask is not None:
        padding = attention_mask.to(torch.bool)
        # Keys past the mask's end are padding (transformers pads the 2-D mask with False), so a
        # mask of ones shorter than the keys still hides some: it is no padding only when it
        # covers every key. Traced, whether anything is padded is unknown until run: kept (exact).
        covers_keys = padding.shape[-1] >= int(kv_offset) + int(kv_length)
        if not _compat.is_compiling() and covers_keys and bool(padding.all()):
            padding = None
    if mask_function is None:
        mask_function = masking_utils().causal_mask_function
    return HFMask(
        mask_function, padding, int(batch_size), int(q_length), int(kv_length), int(q_offset), int(kv_offset)
    )


# ---------------------------------------------------------------------------------------------
# The attention function


def _attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    backend: str = "auto",
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    # transformers passes attention_dropout while training, 0 in eval: SDPA's dropout_p, on the
    # routes whose kernels implement it (the others refuse, and auto passes over them).
    dropout_p = float(dropout) if dropout else 0.0
    for name in UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"flexattn_zoo attention cannot apply {name!r} (transformers passed one)")
    if kwargs.get("output_attentions"):
        # No kernel here computes the probabilities; transformers would then return an empty
        # `attentions` tuple (a warning per layer and call, and an IndexError far from the cause).
        raise ValueError(
            "output_attentions=True: flexattn_zoo attention computes no attention weights; run the "
            "model with attn_implementation='eager' (model.set_attn_implementation('eager')) to get them"
        )
    route = backend
    if isinstance(attention_mask, HFMask):
        mask: Any = attention_mask.spec()
    elif attention_mask is None:
        mask = _maskless(module, query.shape[2], kwargs.get("is_causal"))
    elif isinstance(attention_mask, _compat.BlockMask):
        mask = attention_mask
    elif isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        mask = dense_mask_spec(attention_mask)  # masks.Dense: SDPA attn_mask, flex or dense routes
    else:
        raise TypeError(
            "flexattn_zoo attention got an attention_mask it cannot read exactly: "
            f"{type(attention_mask).__name__} of shape {tuple(getattr(attention_mask, 'shape', ()))}; "
            "expected the mask built by flexattn_zoo.hf.register()'s mask builder or a 4-D bool mask"
        )
    softcap = kwargs.get("softcap")
    score = SoftCap(cap=float(softcap)) if softcap else None
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    gqa = query.shape[1] != key.shape[1]
    if route == "auto" and sinks is None and score is None and not dropout_p and query.shape[2] == 1:
        out = _decode_step(query, key, value, mask, scaling, gqa)
        if out is not None:
            return out.transpose(1, 2).contiguous(), None
    if sinks is None:
        out = attention(
            query, key, value, mask=mask, score_mod=score, scale=scaling, enable_gqa=gqa, backend=route,
            dropout_p=dropout_p,
        )  # fmt: skip
    else:
        check_sinks(sinks, query.shape[1], query.device)
        out, lse = attention(
            query,
            key,
            value,
            mask=mask,
            score_mod=score,
            scale=scaling,
            enable_gqa=gqa,
            backend=route,
            return_lse=True,
            dropout_p=dropout_p,
        )
        out, _ = apply_sinks(out, lse, sinks)
    return out.transpose(1, 2).contiguous(), None


def _maskless(module: Any, q_len: int, is_causal: Any) -> Any:
    """The mask of a call that got no ``attention_mask``, as transformers' ``sdpa`` and
    FlashAttention functions read it: causal (top-left aligned, SDPA's ``is_causal``) where more
    than one query comes and the call's ``is_causal`` (else the module's ``is_causal``, True when
    it has none) asks for it, else none. A decoder's module is causal, an encoder's says
    ``is_causal = False``. Models whose masks go through the registered mask builder always pass
    one; this serves those that call the attention function without building a mask, so they
    compute what they compute on ``sdpa``."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    return Causal() if causal and q_len > 1 else None


def _decode_step(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, scale: float | None, gqa: bool
) -> torch.Tensor | None:
    """A generation step's attention (one query per row at the end of the cache, whose mask hides
    no key) run as ``fz.decode.decode_step`` runs one: SDPA over the keys as they are, without
    planning. Each step meets a new cache length and a new mask offset, so ``fz.attention`` would
    plan every layer of every step anew (its plan cache keys exact shapes). None where that step
    does not apply (a mask that hides keys, e.g. padding; gradients; a traced call; a long cache
    over many rows, which ``fz.attention`` plans as usual)."""
    if _compat.is_compiling():
        return None  # traced: the step is planned into the graph (no guard on the mask's offsets)
    kv_len = key.shape[2]
    if mask is not None:
        # Only the band masks a cache step's offsets make (their forms are arithmetic on the
        # offsets); padding and the rest are planned as usual, without building their forms twice.
        if type(mask) not in _BAND_MASKS:
            return None
        form = mask.bind(1, kv_len).sdpa_form(1, kv_len)
        if form is None or form.is_causal or form.attn_mask is not None:
            return None
    return one_query_over_live_keys(query, key, value, kv_len, scale, gqa)


#: The masks :func:`_decode_step` reads: what the mask reader makes of a causal or windowed
#: pattern at a cache offset.
_BAND_MASKS = (Causal, OffsetCausal, Band, SlidingWindow)


def _builtin_names(*interfaces: Any) -> set[str]:
    """The implementation names transformers itself defines: ``eager`` (which the models call
    directly, not through the interface, unless the interface holds an entry of that name) and the
    entries of the global attention and mask interfaces whose functions transformers defines."""
    names = {"eager"}
    for interface in interfaces:
        for key, fn in getattr(interface, "_global_mapping", {}).items():
            if str(getattr(fn, "__module__", "")).split(".")[0] == "transformers":
                names.add(key)
    return names


def register(name: str = DEFAULT_NAME, *, backend: str = "auto") -> str:
    """Register the zoo as transformers attention implementation ``name`` and return ``name``.

    Then ``AutoModelForCausalLM.from_config(cfg, attn_implementation=name)`` (or
    ``model.set_attn_implementation(name)``) runs every attention layer through ``fz.attention``
    with the specs described in this module's docstring. ``backend`` is passed to
    ``fz.attention`` (``"auto"`` picks the fastest exact route); register several names to
    compare routes. Calling it again with the same name replaces the entry. transformers' own
    names (``eager``, ``sdpa``, ``flex_attention``, ...) are refused: the interfaces are global, so
    registering one would replace transformers' implementation for every model in the process.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    check_backend(backend)
    tf = _transformers()
    from transformers.masking_utils import AttentionMaskInterface

    builtin = _builtin_names(tf.AttentionInterface, AttentionMaskInterface)
    if name in builtin:
        # The interfaces are process-wide: "sdpa" would run every sdpa model (and every comparison
        # against it) on the zoo, with transformers' own function gone for the process.
        raise ValueError(
            f"name {name!r} is one of transformers' own attention implementations "
            f"({', '.join(sorted(builtin))}); registering it would replace transformers' {name!r} "
            f"in every model of the process: choose another name (the default is {DEFAULT_NAME!r})"
        )

    if structural_reader_enabled():
        # Inside a compiled model the mask functions are made in the graph: let the reader read
        # them there too (see flexattn_zoo.hf.factories).
        factories.install(masking_utils())

    def flexattn_zoo_attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        return _attention_forward(module, query, key, value, attention_mask, backend=backend, **kwargs)

    tf.AttentionInterface.register(name, flexattn_zoo_attention)
    AttentionMaskInterface.register(name, _mask_builder)
    return name
