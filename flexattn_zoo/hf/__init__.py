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
  no mask, ModernBERT-style bidirectional window -> ``SlidingWindow(left=W, right=W)``, bidirectional
  Gemma 3 (its own ``|q - kv| < W`` overlay ORed over the causal window, and an always-true lambda
  for full layers, both known by code object) -> ``SlidingWindow(left=W - 1, right=W - 1)`` / no mask;
* cache offsets shift the band: with ``d = q_offset - kv_offset`` a causal band becomes
  ``OffsetCausal(d)`` and a window ``Band(lo + d, hi + d)`` (the decode step); both read their
  offsets from captured tensors, so every step of a ``generate`` reuses one compiled kernel. A
  chunked layer's step (Llama 4) whose queries lie in one chunk per row reads as a
  ``KeyPadding`` of that chunk's keys (eagerly: its offsets' values are read);
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
  ``s_aux`` / ``sinks`` (gpt-oss) -> attention sinks through the lse (:mod:`flexattn_zoo.models.sinks`).

Anything the reader does not recognise (another transformers version's closures, or overlays such
as vision ``block_sequence_ids``) is *not* dropped: the attention runs with transformers' own mask
function as a ``mask_mod`` (exact, but with no cheap forms and a new BlockMask per forward), and a
warning says so once. ALiBi: no model family in transformers 5.x passes ALiBi to the attention
function as an argument (BLOOM and MPT compute it in their own attention code), so
``position_bias`` / ``alibi`` arguments are refused rather than ignored. Models that compute
with the mask tensor themselves (Falcon with ``alibi=True`` adds ALiBi to it; BLOOM and MPT add it
to their own scores) cannot run on the zoo: the first tensor attribute they read from the
:class:`HFMask`, or its use as an operand, raises an error that says so.

A ready-made 4-D mask passed by the caller (``attention_mask`` of shape ``[B, 1|H, Lq, Lkv]``)
bypasses the builder. A boolean one (or a float one holding only 0 and the dtype's minimum, the
``eager`` convention) becomes the public spec ``masks.Dense`` and runs on any route that takes it
exactly (SDPA's ``attn_mask``, flex with the tensor captured, dense). Any other float (a learned
bias) raises ``ValueError``.

Inside ``torch.compile`` transformers builds the mask functions in the graph, where Dynamo cannot
read a closure's captured values; :func:`register` gives Dynamo a stand-in for each mask factory
that records its arguments (:mod:`flexattn_zoo.hf.factories`), so compiled models get specs too,
with no graph break (the general exact ones where a value is known only at run time: packed
sequence ids, padding that may pad nothing, Llama 4's chunks as document labels).

``generate`` with a static cache builds masks ahead of the forward and hands them back to the
model, which may pass them into transformers' mask creation again: :class:`HFMask` answers the
few tensor attributes transformers reads there, and the builder rebuilds a handed-back HFMask for
the new call with its padding.

Attention dropout while training (``dropout > 0``) is SDPA's ``dropout_p``, on the routes whose
kernels implement it; a backend named in :func:`register` that has none raises instead of silently
not dropping. ``output_attentions=True`` raises: no route computes the attention weights (use
``eager`` for them).
"""

from flexattn_zoo.hf.integration import DEFAULT_NAME, HFMask, register, translate

__all__ = ["DEFAULT_NAME", "HFMask", "register", "translate"]
