"""``tree``: speculative-decoding token trees; a drafted token sees the context and its ancestors."""

from __future__ import annotations

from typing import Any

import torch

from flexattn_zoo._compat import outside_inference_mode
from flexattn_zoo.registry import MASKS
from flexattn_zoo.spec import (
    SPLIT_MASK_PAIRS,
    BlockMap,
    MaskMod,
    MaskSpec,
    SdpaForm,
    Spec,
    SplitForm,
    SplitPart,
    block_ranges,
    known_true,
    lower_triangle_fraction,
    spec_dataclass,
    tracing,
)

from ._blocks import INDEX_LIMIT, check_int


@MASKS.register
@spec_dataclass
class Tree(MaskSpec):
    """A token tree after a committed context: a tree token sees the context and its own path.

    ``parents[t]`` is the index of tree token ``t``'s parent within the tree, ``-1`` for a root
    (several roots make a forest), and always ``< t``: tokens come in an order where a parent
    precedes its children (breadth-first or depth-first, as drafters lay them out). The tree
    follows ``prefix_len`` committed tokens: tree token ``t`` is at absolute position
    ``prefix_len + t``, so the row is ``L = prefix_len + len(parents)`` positions long. A query in
    the context sees the keys at or before it (causal); a query in the tree sees the whole context
    and exactly its ancestors-or-self in the tree, never a sibling branch. This is the verification
    mask of tree speculative decoding (Medusa, EAGLE, SpecInfer): one forward pass scores every
    drafted path at once. A chain (``parents[t] = t - 1``) is plain causal attention.

    Queries are absolute positions shifted by ``q_offset``: query ``i`` is the token at position
    ``q_offset + i``, keys are positions ``0 .. Lkv - 1``. ``q_offset=0`` (default, ``Lq == Lkv``
    usually) scores the context and the tree together, as in training or a first pass;
    ``q_offset=prefix_len`` with ``Lq = len(parents)`` and ``Lkv = L`` is the decoding case: the
    drafted tokens as queries against the cached context plus themselves (the last query lines up
    with the last key, FlashAttention's bottom-right alignment when ``Lkv = L``). The problem must
    fit in the row: ``q_offset + Lq <= L`` and ``Lkv <= L``.

    Picture (``prefix_len=2``, ``parents = [-1, 0, 0, 1, 2]``: context c c | tree t0, its children
    t1 and t2, t3 under t1, t4 under t2)::

        #......
        ##.....
        ###....
        ####...
        ###.#..
        ####.#.
        ###.#.#

    The ``mask_mod`` numbers the positions in depth-first preorder of one tree: the context is a
    chain above the tree's roots, so a key is an ancestor-or-self of a query iff the query's
    number lies in the key's subtree interval (two table lookups and two comparisons per pair, the
    tables ``O(L)``). The :meth:`dense` oracle walks parent chains instead.

    The mask leaves positional encodings to the model: :meth:`position_ids` gives the positions
    tree tokens usually get (``prefix_len + depth``).

    Forms offered: SDPA ``is_causal=True`` when ``Lq == Lkv``, ``q_offset == 0`` and the tree is a
    chain (or the problem ends inside the context); a split form when there is a context, the keys
    are the whole row, the tree has at most 256 tokens (``spec.SPLIT_MASK_PAIRS`` pairs) and the
    queries are the whole row (``q_offset=0``: the context causal, the tree rows over the context
    unmasked, the tree over itself as a small mask) or the tree alone (``q_offset=prefix_len``,
    decoding: the last two parts), so SDPA's fused kernels run all but the tree's own block (none
    while ``torch.compile`` traces, like the block map; a chain has the SDPA form instead); a
    table-based block map for any lengths (context
    keys by the causal rule; tree keys from each tree token's set of ancestor key blocks, built by
    pointer doubling in ``O(T log T)`` block-set steps, ``T`` the tree size; full pairs from the
    intersection of the key block's subtree intervals; none while ``torch.compile`` traces, where
    the generic builder evaluates the ``mask_mod``). No varlen form, no lowest visible key
    (every query sees key 0 when there is a context; in a forest without one the lowest key, a
    query's root, need not grow with the query).

    Args:
        parents: integer tensor ``[T]`` (``T >= 1``), ``-1 <= parents[t] < t`` (lists are
            converted; stored as int64). Read once when the spec is built (a device sync).
        prefix_len: committed tokens before the tree (``>= 0``; default 0).
        q_offset: absolute position of query 0 (``>= 0``, below ``L``; default 0).
    """

    built_from_values = True  # __post_init__ reads parents (see Spec.built_from_values)

    pair_loads = False  # tree numbers are read per query and per key

    parents: torch.Tensor
    prefix_len: int = 0
    q_offset: int = 0

    def __post_init__(self) -> None:
        owner = "Tree"
        prefix = check_int("prefix_len", self.prefix_len, minimum=0, owner=owner)
        offset = check_int("q_offset", self.q_offset, minimum=0, owner=owner)
        par: Any = self.parents
        if isinstance(par, (list, tuple)) and not par:
            par = torch.zeros(0, dtype=torch.int64)  # an empty list would become float32
        elif not isinstance(par, torch.Tensor):
            try:
                par = torch.as_tensor(par)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise TypeError(f"{owner}(parents=...) must be a 1-D integer tensor [T]: {exc}") from exc
        if par.dtype == torch.bool or par.is_floating_point() or par.is_complex():
            raise TypeError(f"{owner}(parents=...) must be a 1-D integer tensor [T], got dtype {par.dtype}")
        if par.dim() != 1 or par.numel() == 0:
            raise ValueError(
                f"{owner}(parents=...) must have shape [T] with T >= 1 (one parent per tree token), got "
                f"{tuple(par.shape)}"
            )
        size = prefix + par.numel()
        if size > INDEX_LIMIT:
            raise ValueError(
                f"{owner}: prefix_len + len(parents) = {size} positions exceed the kernels' index range "
                f"({INDEX_LIMIT})"
            )
        if offset >= size:
            raise ValueError(
                f"{owner}(q_offset=...) must be below prefix_len + len(parents) = {size} (query 0's "
                f"position in the row), got {offset}"
            )
        listed = [int(v) for v in par.tolist()]
        for t, p in enumerate(listed):
            if not -1 <= p < t:
                raise ValueError(
                    f"{owner}(parents=...) must hold -1 (a root) or the index of an earlier tree token "
                    f"for every token, got parents[{t}] = {p}"
                )
        object.__setattr__(self, "prefix_len", prefix)
        object.__setattr__(self, "q_offset", offset)
        object.__setattr__(self, "parents", par.to(torch.int64))
        # The mask_mod's tables over the row: each position's preorder number, and the end of its
        # subtree's interval (context positions: themselves, and the whole row after them).
        order, span = _preorder(listed)
        dev = par.device
        i32 = torch.int32
        pre = torch.tensor(order, dtype=i32, device="cpu") + prefix
        context = torch.arange(prefix, dtype=i32, device="cpu")
        number = torch.cat([context, pre]).to(dev)
        ends = (
            torch.full((prefix,), size, dtype=i32, device="cpu"),
            pre + torch.tensor(span, dtype=i32, device="cpu"),
        )
        end = torch.cat(ends).to(dev)
        object.__setattr__(self, "_number", number)
        object.__setattr__(self, "_end", end)
        object.__setattr__(self, "_q_number", number[offset:].clone())
        object.__setattr__(self, "_chain", all(p == t - 1 for t, p in enumerate(listed)))
        depth = [0] * len(listed)
        for t, p in enumerate(listed):
            depth[t] = depth[p] + 1 if p >= 0 else 0
        object.__setattr__(self, "_depth", depth)

    def position_ids(self) -> torch.Tensor:
        """Rotary / absolute positions of the row's tokens, int64 ``[L]``: ``0 .. prefix_len - 1``
        for the context, ``prefix_len + depth`` for a tree token (a root is at depth 0), so every
        drafted path has the positions it would have alone. The mask does not use them; models do."""
        depth = torch.tensor(self.__dict__["_depth"], dtype=torch.int64, device="cpu") + self.prefix_len
        return torch.cat([torch.arange(self.prefix_len, device="cpu"), depth]).to(self.parents.device)

    def _make_mask_mod(self) -> MaskMod:
        q_number: torch.Tensor = self.__dict__["_q_number"]
        number: torch.Tensor = self.__dict__["_number"]
        end: torch.Tensor = self.__dict__["_end"]

        def tree_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            q = q_number[q_idx]
            return (number[kv_idx] <= q) & (q < end[kv_idx])

        return tree_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        self._check_lengths(q_len, kv_len)
        prefix, offset = self.prefix_len, self.q_offset
        parents = self.parents.tolist()
        # Oracle: for every tree token, walk its parent chain up to the root and mark the keys met;
        # context rows are a causal triangle. No preorder numbers, no intervals.
        out = torch.zeros(q_len, kv_len, dtype=torch.bool)
        for i in range(q_len):
            pos = offset + i
            if pos < prefix:
                out[i, : pos + 1] = True
                continue
            out[i, :prefix] = True
            t = pos - prefix
            while t >= 0:
                if prefix + t < kv_len:
                    out[i, prefix + t] = True
                t = parents[t]
        return out[None, None].to(self.parents.device)

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        self._check_lengths(q_len, kv_len)

    def hides_future_keys(self, q_len: int, kv_len: int) -> bool:
        return known_true(self.q_offset == 0)  # ancestors come first; a shift shows keys after i

    def visible_fraction(self, q_len: int, kv_len: int) -> float:
        if not isinstance(self.q_offset, int):
            return 1.0  # symbolic while a compiled call traces
        return lower_triangle_fraction(q_len, kv_len, self.q_offset)

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        if q_len != kv_len or not known_true(self.q_offset == 0):
            return None
        causal = self.__dict__["_chain"] or known_true(q_len <= self.prefix_len + 1)
        return SdpaForm(is_causal=True) if causal else None

    def split_form(self, q_len: int, kv_len: int) -> SplitForm | None:
        prefix, size = self.prefix_len, self.parents.numel()
        if (
            tracing()
            or not isinstance(self.q_offset, int)
            or prefix == 0
            or kv_len != prefix + size
            or size * size > SPLIT_MASK_PAIRS
            or self.sdpa_form(q_len, kv_len) is not None
        ):
            return None
        whole = (prefix, kv_len)
        context: tuple[SplitPart, ...]
        if self.q_offset == 0 and q_len == kv_len:  # the context and the tree as queries
            tree_rows = whole
            context = (SplitPart(q=(0, prefix), kv=(0, prefix), is_causal=True),)
        elif self.q_offset == prefix and q_len == size:  # the drafted tokens as queries (decoding)
            tree_rows = (0, q_len)
            context = ()
        else:
            return None
        # Tree queries see the whole context, and among the tree keys exactly their ancestors-or-
        # self: the mask_mod's preorder intervals over the tree's positions (built on first use,
        # from the tables the spec fixed when built).
        ancestors = self.__dict__.get("_ancestors")
        if ancestors is None:
            number, end = self.__dict__["_number"][prefix:], self.__dict__["_end"][prefix:]
            # Kept beyond the call: a normal tensor even when built under inference_mode.
            ancestors = outside_inference_mode(
                lambda: (number[None, :] <= number[:, None]) & (number[:, None] < end[None, :])
            )
            self.__dict__["_ancestors"] = ancestors
        return SplitForm(
            parts=(
                *context,
                SplitPart(q=tree_rows, kv=(0, prefix), is_causal=False),
                SplitPart(q=tree_rows, kv=whole, is_causal=False, mask=ancestors),
            )
        )

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        self._check_lengths(q_len, kv_len)
        if tracing():
            return None  # its loops and slices follow the spec's sizes, which a trace would specialize
        prefix, offset, size = self.prefix_len, self.q_offset, self.parents.numel()
        q_first, q_last, q_complete = block_ranges(q_len, q_block, device)
        k_first, k_last, k_complete = block_ranges(kv_len, kv_block, device)
        n_q, n_kv = q_first.numel(), k_first.numel()
        # Context keys: visible to every query at or after them (the block's last query sees the
        # block's first key, if any).
        any_ = (k_first < prefix)[None, :] & (k_first[None, :] <= (q_last + offset)[:, None])
        # Tree keys: the key blocks holding an ancestor-or-self of each tree token, as a bool set per
        # token. Start from the token's own block, then double: or in the set of the 2^s-th ancestor
        # (a root is its own ancestor), so after s steps every ancestor closer than 2^s is in.
        first_tree_block = prefix // kv_block
        width = n_kv - first_tree_block
        if width > 0 and q_len + offset > prefix:
            tokens = torch.arange(size, device=device)
            own = (prefix + tokens) // kv_block - first_tree_block
            reach = torch.zeros(size, width, dtype=torch.bool, device=device)
            keep = prefix + tokens < kv_len  # a token past Lkv is no key: its row stays empty
            reach[tokens, torch.where(keep, own, 0)] = keep
            parents = self.parents.to(device)
            jump = torch.where(parents < 0, tokens, parents)
            for _ in range((size - 1).bit_length()):
                reach |= reach[jump]
                jump = jump[jump]
            # The tree queries are the rows from max(0, prefix - offset) on; or their sets per block.
            start = max(0, prefix - offset)
            rows = torch.zeros(n_q * q_block, width, dtype=torch.bool, device=device)
            rows[start:q_len] = reach[torch.arange(start, q_len, device=device) + offset - prefix]
            any_[:, first_tree_block:] |= rows.view(n_q, q_block, width).any(dim=1)
        # All visible iff every query's preorder number lies in every key's subtree interval: in
        # their intersection, [largest key number, smallest key end).
        q_number = self.__dict__["_q_number"].to(device)[:q_len].long()
        number = self.__dict__["_number"].to(device)[:kv_len].long()
        end = self.__dict__["_end"].to(device)[:kv_len].long()
        q_lo = _per_block(q_number, q_block, n_q, INDEX_LIMIT, torch.amin)
        q_hi = _per_block(q_number, q_block, n_q, -1, torch.amax)
        k_lo = _per_block(number, kv_block, n_kv, -1, torch.amax)
        k_hi = _per_block(end, kv_block, n_kv, INDEX_LIMIT, torch.amin)
        full = (q_lo[:, None] >= k_lo[None, :]) & (q_hi[:, None] < k_hi[None, :])
        full &= q_complete[:, None] & k_complete[None, :]
        return BlockMap(any=any_[None, None], full=full[None, None])

    @classmethod
    def typical_example(cls, q_len: int, kv_len: int, batch: int, heads: int) -> Spec:
        # A binary draft tree of up to 63 tokens (6 levels) after the context; queries shifted so
        # that Lq < Lkv lines the last query up with the last key (the decoding case).
        n = max(q_len, kv_len, 1)
        size = max(1, min(63, n // 4))
        return cls(parents=_heap(size, 2), prefix_len=n - size, q_offset=max(0, kv_len - q_len))

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        n = max(q_len, kv_len, 1)
        gen = torch.Generator().manual_seed(3571 * n + batch)
        size = n - n // 3
        # Random drafts: half the tokens extend the previous one, the others branch off anywhere.
        branch = (torch.rand(size, generator=gen) * torch.arange(size)).long()
        drafts = torch.where(torch.rand(size, generator=gen) < 0.5, torch.arange(size) - 1, branch)
        drafts[0] = -1
        groups = torch.arange(n)
        return [
            cls(parents=drafts, prefix_len=n // 3),  # context + tree, Lq == Lkv style
            # Decoding: the last Lq positions are a ternary tree, queried against the whole row.
            cls(parents=_heap(q_len, 3), prefix_len=n - q_len, q_offset=n - q_len),
            # No context: a forest of stars (a root and its candidate next tokens, Medusa-like).
            cls(parents=torch.where(groups % 8 == 0, -1, groups - groups % 8)),
        ]

    def _check_lengths(self, q_len: int, kv_len: int) -> None:
        size = self.prefix_len + self.parents.numel()
        if self.q_offset + q_len > size or kv_len > size:
            raise ValueError(
                f"Tree covers prefix_len + len(parents) = {size} positions, but the problem needs "
                f"q_offset + Lq = {self.q_offset + q_len} and Lkv = {kv_len} (both at most {size})"
            )


def _preorder(parents: list[int]) -> tuple[list[int], list[int]]:
    """Depth-first preorder numbers of the forest ``parents`` (roots, and each node's children, in
    index order) and subtree sizes. Parents precede children, so one pass each way suffices."""
    count = len(parents)
    span = [1] * count
    for t in range(count - 1, 0, -1):
        if parents[t] >= 0:
            span[parents[t]] += span[t]
    order = [0] * count
    after = [1] * count  # next free number below each node, relative to its own
    free = 0  # next free number for a root
    for t, p in enumerate(parents):
        if p < 0:
            order[t], free = free, free + span[t]
        else:
            order[t] = order[p] + after[p]
            after[p] += span[t]
    return order, span


def _heap(size: int, arity: int) -> torch.Tensor:
    """Parents of a complete ``arity``-ary tree of ``size`` tokens in breadth-first order."""
    return torch.tensor([(t - 1) // arity if t else -1 for t in range(size)], dtype=torch.int64)


def _per_block(values: torch.Tensor, block: int, blocks: int, pad: int, reduce: Any) -> torch.Tensor:
    """``reduce`` (amin / amax) of ``values`` over each block, padding the last one with ``pad``."""
    padded = torch.full((blocks * block,), pad, dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values
    return reduce(padded.view(blocks, block), dim=1)
