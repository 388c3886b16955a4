"""``per_document``: any mask applied inside each packed document, in the document's own coordinates."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import torch

from flexattn_zoo.registry import MASKS
from flexattn_zoo.spec import (
    BlockMap,
    MaskMod,
    MaskSpec,
    SdpaForm,
    Spec,
    SplitForm,
    StridedForm,
    VarlenForm,
    keeps_function_of,
    spec_dataclass,
    tracing,
)

from ._blocks import evaluate_blocks, spec_cached
from .causal import Causal
from .document import Document, _run_layout
from .prefix_lm import PrefixLM
from .sliding_window import SlidingWindow


@MASKS.register
@spec_dataclass
class PerDocument(MaskSpec):
    """Any mask applied inside each document of a packed sequence, in the document's own positions.

    ``inner`` sees every document as if it started at position 0. The documents are the maximal runs of equal ``doc_ids`` of ``documents`` (a :class:`Document`,
    or ids it accepts). For query ``i`` and key ``j`` of one run starting at ``s`` the mask is
    ``inner`` at local positions ``(i - s, j - s)``; keys of another run are never visible. So
    ``PerDocument(PrefixLM(prefix_len=4), docs)`` gives every document its own 4-token prefix, and
    ``PerDocument(Causal(), docs)`` is ``Document(...) & Causal()``. A label that comes back after
    another one starts a new document (unlike :class:`Document`, which joins its pieces).

    ``inner`` is any mask spec, bound as for equal query and key lengths (self-attention inside a
    document: ``Causal(align="bottom_right")`` acts as ``Causal()``); it may depend on the batch row
    and head (it sees the call's ``b`` and ``h``), and it is validated at every document length.

    Picture (``inner=PrefixLM(prefix_len=2)``, documents of 3 and 5 tokens; ``#`` visible)::

        ##......
        ##......
        ###.....
        ...##...
        ...##...
        ...###..
        ...####.
        ...#####

    Forms offered (none while ``torch.compile`` traces: they read the ids):

    * varlen, when ``Lq == Lkv`` and ``inner`` offers the same window form (no segments) at every
      document length: the documents as segments with that window (``Causal``, ``SlidingWindow``);
    * SDPA, split and strided forms of ``inner`` when one document covers the whole problem and
      ``Lq == Lkv``;
    * a block map: when every document starts on a multiple of both block sizes, composed from
      ``inner``'s own block maps (one per distinct document length, placed on the diagonal); else,
      when ``inner`` depends on neither batch nor head, by evaluating the ``mask_mod`` only on the
      block pairs that share a document (what the document layout allows, O(sum of squared
      document lengths) instead of ``Lq * Lkv``); otherwise none (the generic builder).

    Args:
        inner: the mask applied inside each document (a spec, or a registry name without
            parameters such as ``"causal"``).
        documents: a :class:`Document`, or ids for one (``[L]`` / ``[B, L]``); see
            :meth:`from_lengths`.
    """

    pair_loads = False  # its own runs and starts are read per query and per key (loads_pairs)

    inner: MaskSpec
    documents: Document

    def __post_init__(self) -> None:
        inner: Any = self.inner
        if isinstance(inner, str):
            inner = MASKS.get(inner)
        if not isinstance(inner, MaskSpec):
            raise TypeError(
                f"PerDocument(inner=...) must be a mask spec (e.g. masks.PrefixLM(prefix_len=4)) or a "
                f"registry name, got {type(inner).__name__}"
            )
        docs: Any = self.documents
        if not isinstance(docs, Document):
            docs = Document(doc_ids=docs)
        elif not keeps_function_of(docs, Document):
            raise TypeError(
                f"PerDocument(documents=...) reads only the document ids; {type(docs).__name__} "
                "replaces Document's mask function, which it would ignore: pass a masks.Document "
                "(or the ids) and combine the rest with & / |"
            )
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "documents", docs)
        run, start = _run_layout(docs.doc_ids)  # tensor ops only: fine while traced
        object.__setattr__(self, "_run", run)
        object.__setattr__(self, "_start", start)
        object.__setattr__(self, "_cache", {})  # data-dependent facts (each a device sync); not a field

    @classmethod
    def from_lengths(
        cls,
        inner: MaskSpec | str,
        lengths: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor,
        *,
        device: torch.device | str | None = None,
    ) -> PerDocument:
        """From document lengths, as :meth:`Document.from_lengths` takes them."""
        spec = inner if isinstance(inner, MaskSpec) else MASKS.get(inner)  # a name: as __post_init__
        return cls(inner=spec, documents=Document.from_lengths(lengths, device=device))

    # ---- spec protocol ------------------------------------------------------------------------

    def uses_batch(self) -> bool:
        return self.documents.uses_batch() or self.inner.uses_batch()

    def uses_head(self) -> bool:
        return self.inner.uses_head()

    def reads_scalar_tensors(self) -> bool:
        return self.inner.reads_scalar_tensors()

    def bind(self, q_len: int, kv_len: int) -> MaskSpec:
        n = max(q_len, kv_len)
        inner = self.inner.bind(n, n)
        return self if inner is self.inner else dataclasses.replace(self, inner=inner)

    def _make_mask_mod(self) -> MaskMod:
        mod = self.inner.mask_mod()
        run: torch.Tensor = self.__dict__["_run"]
        start: torch.Tensor = self.__dict__["_start"]

        if run.dim() == 1:

            def per_document_mask(
                b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
            ) -> torch.Tensor:
                same, s = run[q_idx] == run[kv_idx], start[q_idx]
                # A key of another document is evaluated at the query's own position (always a
                # valid local index for the inner spec), then masked.
                local_kv = torch.where(same, kv_idx - s, q_idx - s)
                return same & mod(b, h, q_idx - s, local_kv)

            return per_document_mask

        def batched_per_document_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            same, s = run[b, q_idx] == run[b, kv_idx], start[b, q_idx]
            local_kv = torch.where(same, kv_idx - s, q_idx - s)
            return same & mod(b, h, q_idx - s, local_kv)

        return batched_per_document_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        n = max(q_len, kv_len)
        self._check_length(n)
        inner = self.inner.bind(n, n)
        rows = batch if self.uses_batch() else 1
        out = torch.zeros(rows, heads if inner.uses_head() else 1, q_len, kv_len, dtype=torch.bool)
        ids = self.documents.doc_ids.cpu().view(-1, self.documents.doc_ids.shape[-1])[:, :n]
        # Oracle: cut each row into its runs (unique_consecutive) and paint the inner mask's own
        # oracle, at the run's lengths, on the diagonal.
        for r in range(rows):
            _, lengths = torch.unique_consecutive(ids[r if ids.shape[0] > 1 else 0], return_counts=True)
            s = 0
            for length in lengths.tolist():
                qn, kn = min(s + length, q_len) - s, min(s + length, kv_len) - s
                if qn > 0 and kn > 0:
                    # The inner oracle at the document's own square (the lengths it is validated
                    # for), cut to the part inside the problem when Lq != Lkv cuts the document.
                    piece = inner.dense(length, length, batch=batch, heads=heads)[..., :qn, :kn]
                    # The oracle contract is [B|1, H|1]: an inner spec may give every head although
                    # it reads none (a FunctionMask broadcasts to the call's), then any one will do.
                    here = piece[r if piece.shape[0] > 1 else 0]
                    out[r, :, s : s + qn, s : s + kn] = here[: out.shape[1]]
                s += length
        return out

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        self.documents.validate(q_len, kv_len, batch, heads)
        if tracing():  # the document lengths are read from the ids
            return
        n = max(q_len, kv_len)
        inner = self.inner.bind(n, n)  # as the mask_mod and the oracle bind it

        def check() -> bool:
            # Every length, not only the longest: an inner spec sized for one length (a Dense
            # tensor, a Natten canvas) must not run on the others' corners while its oracle
            # refuses them.
            for length in sorted(self._lengths(n), reverse=True):
                inner.validate(length, length, batch, heads)
            return True

        self._cached(("validated", n, batch, heads), check)

    def varlen_form(self, q_len: int, kv_len: int, batch: int) -> VarlenForm | None:
        if q_len != kv_len or tracing():
            return None
        windows = set()
        for n in self._lengths(q_len):
            form = self.inner.bind(n, n).varlen_form(n, n, batch)
            if form is None or form.segments is not None:
                return None
            windows.add(form.window)
        if len(windows) != 1:
            return None
        return VarlenForm(segments=self._runs(q_len), window=windows.pop())

    def _single(self, q_len: int, kv_len: int) -> MaskSpec | None:
        """The bound inner spec when one document spans the whole square problem, else None.

        Square only: the inner spec is validated for its document's ``n x n`` square, and its
        forms at other lengths need not describe that square's corner (a ``Dense`` inner's
        ``attn_mask`` keeps its ``n x n`` shape)."""
        n = max(q_len, kv_len)
        if tracing() or q_len != kv_len or self._lengths(n) != {n}:
            return None
        return self.inner.bind(n, n)

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        inner = self._single(q_len, kv_len)
        return None if inner is None else inner.sdpa_form(q_len, kv_len)

    def split_form(self, q_len: int, kv_len: int) -> SplitForm | None:
        inner = self._single(q_len, kv_len)
        return None if inner is None else inner.split_form(q_len, kv_len)

    def strided_form(self, q_len: int, kv_len: int) -> StridedForm | None:
        inner = self._single(q_len, kv_len)
        return None if inner is None else inner.strided_form(q_len, kv_len)

    def hides_future_keys(self, q_len: int, kv_len: int) -> bool:
        if tracing():
            return False
        return all(self.inner.bind(n, n).hides_future_keys(n, n) for n in self._lengths(max(q_len, kv_len)))

    def starts_mask_mod(self, q_len: int, kv_len: int) -> MaskMod | None:
        # Where the inner mask hides future keys in every document, a key is visible iff it lies
        # in [start[q], q] and the inner mask shows it: documents are runs, so no per-key lookup.
        if not self.hides_future_keys(q_len, kv_len):
            return None
        mod = self.inner.mask_mod()
        start: torch.Tensor = self.__dict__["_start"]
        batched = start.dim() == 2  # a Python constant of the function: flex traces one branch

        def per_document_starts_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            s = start[b, q_idx] if batched else start[q_idx]
            here = (s <= kv_idx) & (kv_idx <= q_idx)
            # Keys outside the query's document are evaluated at its own position (a valid local
            # index for the inner spec), then masked.
            return here & mod(b, h, q_idx - s, torch.where(here, kv_idx - s, q_idx - s))

        return per_document_starts_mask

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        if tracing():
            return None  # the document layout is data (see spec.tracing)
        n = max(q_len, kv_len)
        self._check_length(n)
        composed = self._composed_map(q_len, kv_len, q_block, kv_block, device)
        if composed is not None:
            return composed
        if self.inner.uses_batch() or self.inner.uses_head():
            return None  # the evaluation below knows no batch size nor head count
        runs = Document(doc_ids=self.__dict__["_run"][..., :n])
        candidates = runs.block_map(q_len, kv_len, q_block, kv_block, device)
        assert candidates is not None  # run numbers never decrease: Document's closed form
        bound = self.bind(q_len, kv_len)
        return evaluate_blocks(
            bound.mask_mod(), candidates.any[:, 0], q_len, kv_len, q_block, kv_block, device
        )

    def _composed_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        """The inner spec's block maps on the diagonal, when every document starts on a block
        boundary of both sides (then no block holds two documents); else None."""
        n = max(q_len, kv_len)
        layout = self._layout(n)
        if any(s % q_block or s % kv_block for row in layout for s, _ in row):
            return None
        inner = self.inner.bind(n, n)
        maps: dict[tuple[int, int], BlockMap | None] = {}
        pieces = []
        for r, row in enumerate(layout):
            for s, length in row:
                qn, kn = min(s + length, q_len) - s, min(s + length, kv_len) - s
                if qn <= 0 or kn <= 0:
                    continue
                if (qn, kn) not in maps:
                    maps[(qn, kn)] = inner.block_map(qn, kn, q_block, kv_block, device)
                piece = maps[(qn, kn)]
                if piece is None:
                    return None
                pieces.append((r, s, piece))
        rows = max([len(layout)] + [p.any.shape[0] for _, _, p in pieces])
        heads = max([1] + [p.any.shape[1] for _, _, p in pieces])
        n_q, n_kv = -(-q_len // q_block), -(-kv_len // kv_block)
        any_ = torch.zeros(rows, heads, n_q, n_kv, dtype=torch.bool, device=device)
        full = torch.zeros_like(any_)
        for r, s, piece in pieces:
            targets = range(rows) if len(layout) == 1 else [r]  # shared documents: every row
            for t in targets:
                pick = t if piece.any.shape[0] > 1 else 0
                rq, rk = s // q_block, s // kv_block
                a, f = piece.any[pick], piece.full[pick]
                any_[t, :, rq : rq + a.shape[-2], rk : rk + a.shape[-1]] = a
                full[t, :, rq : rq + f.shape[-2], rk : rk + f.shape[-1]] = f
        return BlockMap(any=any_, full=full)

    @classmethod
    def typical_example(cls, q_len: int, kv_len: int, batch: int, heads: int) -> Spec:
        # Three packed documents (Document's typical layout), each with its own 16-token prefix.
        docs = Document.typical_example(q_len, kv_len, batch, heads)
        assert isinstance(docs, Document)
        return cls(inner=PrefixLM(prefix_len=16), documents=docs)

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        n = max(q_len, kv_len, 1)
        gen = torch.Generator().manual_seed(7307 * n + batch)
        thirds = Document.from_lengths([n // 3, n // 3, n - 2 * (n // 3)])
        # Documents on 128-token boundaries: the composed block map at 128 (and 16 x 32) blocks.
        aligned = Document(doc_ids=torch.arange(n) // 128)
        out: list[Spec] = [
            cls(inner=PrefixLM(prefix_len=4), documents=thirds),
            cls(inner=Causal(), documents=thirds),
            cls(inner=SlidingWindow(left=3, right=1), documents=aligned),
            cls(
                inner=PrefixLM(prefix_len=2),
                documents=Document(doc_ids=(torch.arange(n) // max(1, n // 7)) % 2),
            ),
        ]
        if batch > 1:
            starts = torch.rand(batch, n, generator=gen) < 6.0 / n
            out.append(
                cls(
                    inner=PrefixLM(prefix_len=torch.arange(batch) * 3),
                    documents=Document(doc_ids=torch.cumsum(starts.long(), dim=-1)),
                )
            )
        return out

    # ---- helpers ------------------------------------------------------------------------------

    def _layout(self, n: int) -> list[list[tuple[int, int]]]:
        """Per row of the ids, ``(start, length)`` of each run within the first ``n`` positions."""

        def make() -> list[list[tuple[int, int]]]:
            ids = self.documents.doc_ids.view(-1, self.documents.doc_ids.shape[-1])[:, :n].cpu()
            out = []
            for row in ids:
                _, counts = torch.unique_consecutive(row, return_counts=True)
                lengths = counts.tolist()
                starts = [0, *itertools.accumulate(lengths)][:-1]
                out.append(list(zip(starts, lengths, strict=True)))
            return out

        return self._cached(("layout", n), make)

    def _check_length(self, needed: int) -> None:
        length = self.documents.doc_ids.shape[-1]
        if length < needed:
            raise ValueError(
                f"PerDocument(documents=...) has length {length} but the problem needs at least "
                f"max(Lq, Lkv) = {needed}"
            )

    def _lengths(self, n: int) -> set[int]:
        return {length for row in self._layout(n) for _, length in row}

    def _runs(self, n: int) -> torch.Tensor:
        """Run lengths as varlen segments: ``[S]``, or ``[B, S]`` zero-padded."""
        rows = [
            torch.tensor([length for _, length in row], dtype=torch.int64, device="cpu")
            for row in self._layout(n)
        ]
        if self.documents.doc_ids.dim() == 1:
            return rows[0]
        width = max(r.numel() for r in rows)
        return torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows])

    def loads_pairs(self) -> bool:
        # The inner mask reads its indices shifted by the query's document start: a table it
        # reads per key (flags[kv], ids[kv]) is read at kv - start[q], per (query, key) pair.
        return self.inner.loads_pairs() or bool(self.inner.tensors())

    def pair_tiles(self) -> int:
        # (See loads_pairs.) Not tensors() of an inner mask that loads pairs: a raw callable's
        # walks its closure, which Dynamo cannot trace in a mask made in the graph.
        if self.inner.loads_pairs():
            return self.inner.pair_tiles()
        return len(self.inner.tensors())

    def _cached(self, key: tuple[Any, ...], make: Any) -> Any:
        return spec_cached(self, key, make)
