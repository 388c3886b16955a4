"""Hugging Face transformers integration (optional extra ``hf``): run a model's attention on the zoo.

::

    import flexattn_zoo.hf
    name = flexattn_zoo.hf.register()                      # "flexattn_zoo"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)

``register`` adds two entries under ``name``: an attention function (``AttentionInterface``) and a
mask builder (``AttentionMaskInterface``). Both are needed: without a mask builder transformers
hands a custom attention function no mask at all, so padding would be lost.

How each layer's configuration becomes zoo specs
------------------------------------------------
The mask builder is called by transformers' ``create_causal_mask`` /
``create_sliding_window_causal_mask`` / ``create_chunked_causal_mask`` / ``create_bidirectional_mask``
with the pattern as a *mask function* (built from the config: causal, ``sliding_window``,
``attention_chunk_size``, bidirectional, packed sequences), the 2-D padding ``attention_mask`` and
the cache offsets of the queries and keys. Instead of evaluating that function into an
``Lq x Lkv`` tensor (what the ``eager``/``sdpa`` builders do), we return a small
:class:`HFMask` descriptor, and the attention function translates it once per forward (the
descriptor is shared by every layer of one type) into specs:

* the pattern is read structurally from transformers' mask-function closures (their code objects
  and captured values, e.g. ``sliding_window``): causal -> ``Causal``, sliding window
  ``W`` -> ``SlidingWindow.from_hf(W)``, chunk ``C`` -> ``Chunked(C) & Causal()``, bidirectional ->
  no mask, ModernBERT-style bidirectional window -> ``SlidingWindow(left=W, right=W)``;
* cache offsets shift the band: with ``d = q_offset - kv_offset`` a causal band becomes
  ``OffsetCausal(d)`` and a window ``Band(lo + d, hi + d)`` (the decode step);
* **padding**: the 2-D ``attention_mask`` (True = real token) becomes
  ``KeyPadding(valid=attention_mask[:, kv_offset : kv_offset + Lkv])``: padded keys are invisible, as in
  transformers. A query row that sees only padding outputs 0 here, while ``eager`` outputs the mean
  of the values there (its masked logits are a large finite negative number, not -inf); those
  are padded positions, whose outputs no real token ever reads;
* **packed sequences** (no padding mask, no cache, ``position_ids`` restarting inside a row):
  transformers marks them with a sequence-id tensor; it becomes ``Document(doc_ids=...)`` and the
  pattern stays a band, which is exact because inside one sequence ``position_ids`` advance by
  exactly one per token, so position differences equal index differences (chunked attention
  over packed sequences adds the chunk of each remapped position to the document label);
* ``softcap`` (Gemma 2) -> ``SoftCap(cap)``; ``scaling`` -> ``scale``; GQA from the head counts;
  ``s_aux`` / ``sinks`` (gpt-oss) -> attention sinks through the lse (:mod:`flexattn_zoo.sinks`).

Anything the reader does not recognise (another transformers version's closures, or overlays such
as vision ``block_sequence_ids``) is *not* dropped: the attention runs with transformers' own mask
function as a ``mask_mod`` (exact, but with no cheap forms and a new BlockMask per forward), and a
warning says so once. ALiBi: no model family in transformers 5.x passes ALiBi through the
attention interface (BLOOM, MPT and Falcon compute it in their own attention code), so
``position_bias`` / ``alibi`` arguments are refused rather than ignored.

A ready-made 4-D mask passed by the caller (``attention_mask`` of shape ``[B, 1|H, Lq, Lkv]``)
bypasses the builder. A boolean one (or a float one holding only 0 and the dtype's minimum, the
``eager`` convention) is accepted **only through the ``dense`` route**: the caller has already
materialised ``Lq x Lkv``, the dense route reads it exactly, and deriving a BlockMask from it would
scan the whole tensor on every call. Any other float (a learned bias) raises ``ValueError``.

Dropout is not implemented: a call with ``dropout > 0`` raises instead of silently not dropping.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from flexattn_zoo import _compat
from flexattn_zoo.dispatch import attention
from flexattn_zoo.hf_masks import HFMask, dense_mask_spec, translate
from flexattn_zoo.hf_masks import transformers_module as _transformers
from flexattn_zoo.score_mods import SoftCap
from flexattn_zoo.sinks import apply_sinks, check_sinks

log = logging.getLogger(__name__)

DEFAULT_NAME = "flexattn_zoo"
#: Keyword arguments transformers passes that change the math and that we cannot honour.
UNSUPPORTED_KWARGS = ("position_bias", "alibi", "head_mask")

__all__ = ["DEFAULT_NAME", "HFMask", "register", "translate"]


# ---------------------------------------------------------------------------------------------
# The mask builder


def _mask_builder(
    batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: Any = 0,
    mask_function: Callable[..., Any] | None = None, attention_mask: torch.Tensor | None = None, **_: Any,
) -> HFMask:  # fmt: skip
    padding = None
    if attention_mask is not None:
        padding = attention_mask.to(torch.bool)
        if bool(padding.all()):
            padding = None
    if mask_function is None:
        mask_function = _transformers().masking_utils.causal_mask_function
    return HFMask(
        mask_function, padding, int(batch_size), int(q_length), int(kv_length), int(q_offset), int(kv_offset)
    )


# ---------------------------------------------------------------------------------------------
# The attention function


def _attention_forward(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
    scaling: float | None = None, dropout: float = 0.0, *, backend: str = "auto", **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    if dropout and float(dropout) > 0:
        raise ValueError(
            f"flexattn_zoo attention has no dropout (got dropout={dropout}); use model.eval() or set "
            "attention_dropout=0"
        )
    for name in UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"flexattn_zoo attention cannot apply {name!r} (transformers passed one)")
    if kwargs.get("output_attentions"):
        log.warning("flexattn_zoo attention does not return attention weights (output_attentions=True)")
    route = backend
    if isinstance(attention_mask, HFMask):
        mask: Any = attention_mask.spec()
    elif attention_mask is None:
        mask = None  # what eager does with no mask: nothing is masked
    elif isinstance(attention_mask, _compat.BlockMask):
        mask = attention_mask
    elif isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        mask, route = dense_mask_spec(attention_mask), "dense"
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
    common: dict[str, Any] = dict(mask=mask, score_mod=score, scale=scaling, enable_gqa=gqa, backend=route)
    if sinks is None:
        out = attention(query, key, value, **common)
    else:
        check_sinks(sinks, query.shape[1], query.device)
        out, lse = attention(query, key, value, return_lse=True, **common)  # type: ignore[misc]
        out, _ = apply_sinks(out, lse, sinks)
    return out.transpose(1, 2).contiguous(), None  # type: ignore[union-attr]


def register(name: str = DEFAULT_NAME, *, backend: str = "auto") -> str:
    """Register the zoo as transformers attention implementation ``name`` and return ``name``.

    Then ``AutoModelForCausalLM.from_config(cfg, attn_implementation=name)`` (or
    ``model.set_attn_implementation(name)``) runs every attention layer through ``fz.attention``
    with the specs described in this module's docstring. ``backend`` is passed to
    ``fz.attention`` (``"auto"`` picks the fastest exact route); register several names to
    compare routes. Calling it again with the same name replaces the entry.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    tf = _transformers()
    from transformers.masking_utils import AttentionMaskInterface

    def flexattn_zoo_attention(module, query, key, value, attention_mask, **kwargs):  # type: ignore[no-untyped-def]
        return _attention_forward(module, query, key, value, attention_mask, backend=backend, **kwargs)

    tf.AttentionInterface.register(name, flexattn_zoo_attention)
    AttentionMaskInterface.register(name, _mask_builder)
    return name
