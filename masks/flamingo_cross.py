"""``flamingo_cross``: text-to-image cross-attention of interleaved text and images (Flamingo)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from flexattn_zoo.registry import MASKS
from flexattn_zoo.spec import BlockMap, MaskMod, MaskSpec, Spec, spec_dataclass, tracing

from ._blocks import check_int, interval_block_map
from .document import _int_vector

_ATTEND = ("last", "all")


def _labels(value: Any, name: str) -> torch.Tensor:
    t = value
    if not isinstance(t, torch.Tensor):
        try:
            t = torch.as_tensor(t)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(
                f"FlamingoCross({name}=...) must be an integer tensor [L] or [B, L]: {exc}"
            ) from exc
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(
            f"FlamingoCross({name}=...) must be an integer tensor [L] or [B, L], got dtype {t.dtype}"
        )
    if t.dim() not in (1, 2) or t.numel() == 0:
        raise ValueError(
            f"FlamingoCross({name}=...) must have shape [L] or [B, L] with L, B >= 1, got {tuple(t.shape)}"
        )
    if not tracing() and bool((t < -1).any()):  # traced, values are unknown until run
        raise ValueError(
            f"FlamingoCross({name}=...) holds image indices >= 0, or -1 for none; got {int(t.min())}"
        )
    return t.to(torch.int64)


@MASKS.register
@spec_dataclass
class FlamingoCross(MaskSpec):
    """Text-to-image cross-attention: text token ``i`` sees the tokens of the image it follows.

    Queries are the text tokens of an interleaved text-and-images sequence, keys the visual tokens
    of its images (e.g. a Perceiver resampler's outputs, laid end to end). ``last_image[i]`` is the
    index of the last image placed before text token ``i`` (``-1``: no image yet), ``key_image[j]``
    the image key ``j`` belongs to (``-1``: a key of no image, e.g. padding). With
    ``attend="last"`` (Flamingo) key ``j`` is visible iff ``key_image[j] == last_image[i] >= 0``:
    each text token attends to the visual tokens of the one image right before it. With
    ``attend="all"`` it is visible iff ``0 <= key_image[j] <= last_image[i]``: every image so far.
    A text token before the first image sees no key; its output is 0.

    Each index tensor is ``[L]`` (shared by the batch rows) or ``[B, L]``; ``last_image`` covers at
    least ``Lq`` positions, ``key_image`` at least ``Lkv``. :meth:`from_image_positions` builds both
    from where the images sit in the text.

    Picture (``attend="last"``; images 0, 1, 2 of 2 tokens each placed before text tokens 1, 3
    and 3; ``last_image = [-1, 0, 0, 2, 2, 2]``, ``key_image = [0, 0, 1, 1, 2, 2]``)::

        ......
        ##....
        ##....
        ....##
        ....##
        ....##

    Convention next to attention-gym's: ``generate_vision_cross_attention_mask_mod(intervals,
    image_token_length)`` gives image ``k`` to the text tokens of ``intervals[k] = [start, end)``,
    any interval per image. Flamingo's rule is the case where image ``k`` owns the text from its
    own position to the next image's (``attend="last"``) or to the end (``attend="all"``); this
    spec states the rule per text token instead, which also takes images of unequal lengths.

    Forms offered: a closed-form block map when ``last_image`` and ``key_image`` never decrease
    along a row (text and images in order), from the interval of keys each text token sees; no
    SDPA or varlen form (this is cross-attention).

    Args:
        last_image: integer tensor ``[Lq]`` or ``[B, Lq]``, values ``>= -1`` (stored as int64).
        key_image: integer tensor ``[Lkv]`` or ``[B, Lkv]``, values ``>= -1``.
        attend: ``"last"`` (default) or ``"all"``.
    """

    pair_loads = False  # its tables are read per query and per key

    last_image: torch.Tensor
    key_image: torch.Tensor
    attend: Literal["last", "all"] = "last"

    depends_on_batch = True  # class default; uses_batch() says whether this instance does

    def __post_init__(self) -> None:
        if self.attend not in _ATTEND:
            raise ValueError(
                f"FlamingoCross(attend=...) must be one of {', '.join(map(repr, _ATTEND))}, got {self.attend!r}"
            )
        last = _labels(self.last_image, "last_image")
        keys = _labels(self.key_image, "key_image")
        if last.dim() == 2 and keys.dim() == 2 and last.shape[0] != keys.shape[0]:
            raise ValueError(
                f"FlamingoCross: last_image has {last.shape[0]} rows but key_image has {keys.shape[0]}"
            )
        object.__setattr__(self, "last_image", last)
        object.__setattr__(self, "key_image", keys)
        # Per-instance caches of data-dependent checks (each a device sync); not fields.
        object.__setattr__(self, "_cache", {})

    @classmethod
    def from_image_positions(
        cls,
        image_positions: Sequence[int] | torch.Tensor,
        tokens_per_image: int,
        text_len: int,
        attend: Literal["last", "all"] = "last",
        *,
        device: torch.device | str | None = None,
    ) -> FlamingoCross:
        """Images placed in a text of ``text_len`` tokens: image ``k`` comes right before text token
        ``image_positions[k]`` (non-decreasing, in ``[0, text_len]``), and its ``tokens_per_image``
        visual tokens are keys ``k * tokens_per_image ..`` (so ``Lkv = images * tokens_per_image``).
        Shared by every batch row."""
        owner = "FlamingoCross.from_image_positions"
        n = check_int("text_len", text_len, minimum=1, owner=owner)
        per = check_int("tokens_per_image", tokens_per_image, minimum=1, owner=owner)
        # Checked as integers, not cast: a cast would truncate 2.5 to position 2.
        where = _int_vector(image_positions, f"{owner}(image_positions=...)")
        if (
            where.numel() == 0
            or bool(((where < 0) | (where > n)).any())
            or bool((where[1:] < where[:-1]).any())
        ):
            raise ValueError(
                f"{owner}(image_positions=...) must be non-decreasing text positions in [0, {n}], one per "
                f"image (at least one), got {where.tolist()[:8]}"
            )
        # Text token i follows every image placed at or before it: the last of them is its image.
        last = torch.searchsorted(where, torch.arange(n, device="cpu"), right=True) - 1
        keys = torch.arange(where.numel() * per, device="cpu") // per
        return cls(last_image=last.to(device), key_image=keys.to(device), attend=attend)

    def uses_batch(self) -> bool:
        return self.last_image.dim() == 2 or self.key_image.dim() == 2

    def _make_mask_mod(self) -> MaskMod:
        last, keys = self.last_image, self.key_image
        every = self.attend == "all"

        def text(b: torch.Tensor, q_idx: torch.Tensor) -> torch.Tensor:
            return last[b, q_idx] if last.dim() == 2 else last[q_idx]

        def image(b: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return keys[b, kv_idx] if keys.dim() == 2 else keys[kv_idx]

        if every:

            def flamingo_all_mask(
                b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
            ) -> torch.Tensor:
                k = image(b, kv_idx)
                return (k >= 0) & (k <= text(b, q_idx))

            return flamingo_all_mask

        def flamingo_last_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            k = image(b, kv_idx)
            return (k >= 0) & (k == text(b, q_idx))

        return flamingo_last_mask

    @staticmethod
    def _row_count(t: torch.Tensor) -> int:
        # Not reshape(-1, n): that is ambiguous at n == 0.
        return t.shape[0] if t.dim() == 2 else 1

    def _rows(self, q_len: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[R, Lq]`` and ``[R, Lkv]`` index rows, ``R`` the rows of the batched tensor (or 1)."""
        last = self.last_image[..., :q_len].reshape(self._row_count(self.last_image), q_len)
        keys = self.key_image[..., :kv_len].reshape(self._row_count(self.key_image), kv_len)
        rows = max(last.shape[0], keys.shape[0])
        return last.expand(rows, -1), keys.expand(rows, -1)

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        self._check_lengths(q_len, kv_len)
        last, keys = (t.cpu() for t in self._rows(q_len, kv_len))
        # Oracle: image by image, the outer product of "this text token looks at image m" and
        # "this key belongs to image m", instead of comparing indices pair by pair.
        out = torch.zeros(last.shape[0], q_len, kv_len, dtype=torch.bool)
        for r in range(last.shape[0]):
            for m in torch.unique(keys[r]).tolist():
                if m < 0:
                    continue
                readers = last[r] >= m if self.attend == "all" else last[r] == m
                out[r] |= readers[:, None] & (keys[r] == m)[None, :]
        return out[:, None]

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        self._check_lengths(q_len, kv_len)
        for name, t in (("last_image", self.last_image), ("key_image", self.key_image)):
            if t.dim() == 2 and t.shape[0] != batch:
                raise ValueError(
                    f"FlamingoCross({name}=...) has {t.shape[0]} rows but the batch size is {batch}; "
                    "pass [L] indices to share them across the batch, or one row per batch element"
                )

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        self._check_lengths(q_len, kv_len)
        if tracing():
            return None  # sortedness is read from the indices (see spec.tracing)
        last, keys = self._rows(q_len, kv_len)

        def check() -> bool:
            return bool((last[:, 1:] >= last[:, :-1]).all()) and bool((keys[:, 1:] >= keys[:, :-1]).all())

        cache: dict[tuple[Any, ...], Any] = self.__dict__["_cache"]
        key = ("sorted", q_len, kv_len)
        if key not in cache:
            cache[key] = check()
        if not cache[key]:
            return None
        # Images in order: the keys a text token sees are one run of sorted key indices, found by
        # binary search (those of its image, or of every image up to it).
        want_lo = torch.zeros_like(last) if self.attend == "all" else last
        starts = torch.searchsorted(keys.contiguous(), want_lo.contiguous(), right=False)
        ends = torch.searchsorted(keys.contiguous(), last.contiguous(), right=True)
        ends = torch.where(last >= 0, ends, starts)  # no image yet: nothing
        return interval_block_map(starts, ends, q_block, kv_block, kv_len, device)

    @classmethod
    def typical_example(cls, q_len: int, kv_len: int, batch: int, heads: int) -> Spec:
        # Four images spread through the text (the first at its start), their tokens filling Lkv.
        per = -(-kv_len // 4)
        where = torch.tensor([k * q_len // 4 for k in range(4)])
        last = torch.searchsorted(where, torch.arange(q_len), right=True) - 1
        return cls(last_image=last, key_image=torch.arange(kv_len) // per)

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        gen = torch.Generator().manual_seed(131 * q_len + kv_len + batch)
        per = -(-kv_len // 3)  # three images, the last one possibly cut short by Lkv
        keys = torch.arange(kv_len) // per
        # Images before text tokens Lq/4, Lq/2 and Lq/2 again: image 1 is never any token's last.
        where = torch.tensor([q_len // 4, q_len // 2, q_len // 2])
        last = torch.searchsorted(where, torch.arange(q_len), right=True) - 1
        out: list[Spec] = [
            cls(last_image=last, key_image=keys),
            cls(last_image=last, key_image=keys, attend="all"),
            # Out of order (and padding keys): the generic block builder's case.
            cls(
                last_image=torch.randint(-1, 4, (q_len,), generator=gen),
                key_image=torch.randint(-1, 4, (kv_len,), generator=gen),
                attend="all",
            ),
        ]
        if batch > 1:
            starts = torch.sort(torch.randint(0, q_len + 1, (batch, 4), generator=gen), dim=-1).values
            rows = torch.stack([torch.searchsorted(s, torch.arange(q_len), right=True) - 1 for s in starts])
            out.append(cls(last_image=rows, key_image=torch.arange(kv_len) * 4 // kv_len))
        return out

    def _check_lengths(self, q_len: int, kv_len: int) -> None:
        for name, t, needed, side in (
            ("last_image", self.last_image, q_len, "Lq"),
            ("key_image", self.key_image, kv_len, "Lkv"),
        ):
            if t.shape[-1] < needed:
                raise ValueError(
                    f"FlamingoCross({name}=...) has length {t.shape[-1]} but the problem has {side} = {needed}"
                )
