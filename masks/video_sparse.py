"""``video_sparse``: Sparse-VideoGen's spatial and temporal attention heads over a frame-major video."""

from __future__ import annotations

import torch

from flexattn_zoo.registry import MASKS
from flexattn_zoo.spec import (
    BlockMap,
    MaskMod,
    MaskSpec,
    SdpaForm,
    Spec,
    VarlenForm,
    block_ranges,
    known_true,
    spec_dataclass,
    static_int,
)

from ._blocks import INDEX_LIMIT, check_int
from .chunked import Chunked

_OWNER = "VideoSparse"
KINDS = ("spatial", "temporal")


@MASKS.register
@spec_dataclass
class VideoSparse(MaskSpec):
    """Sparse-VideoGen's spatial heads (nearby frames) or temporal heads (one token, every frame).

    A ``"spatial"`` head attends within the query's frame and its neighbours, a ``"temporal"`` head
    to the query's spatial position (and its neighbours) in every frame.

    Layout (frame-major, for both kinds): ``frames`` frames of ``frame_tokens`` tokens each, then
    ``text_len`` text tokens. Position ``p < frames * frame_tokens`` is token ``p % frame_tokens``
    (its spatial index, the frame's tokens flattened in the model's order) of frame
    ``p // frame_tokens``. Rules for a video query ``i`` and video key ``j``:

    * ``kind="spatial"``: visible iff ``|frame(i) - frame(j)| <= window`` (``window`` in frames; 0:
      the query's own frame, block-diagonal);
    * ``kind="temporal"``: visible iff ``|token(i) - token(j)| <= window`` (``window`` in spatial
      indices; 0: the very same spatial token), in every frame.

    Besides: the keys of the first ``sink_frames`` frames are visible to every query, and text
    tokens attend to every token and are attended by every token. Queries and keys are the first
    ``Lq`` / ``Lkv`` positions.

    Pictures (rows are queries, ``#`` visible). ``frames=3, frame_tokens=3, kind="spatial",
    sink_frames=1, text_len=2``::

        ###......##
        ###......##
        ###......##
        ######...##
        ######...##
        ######...##
        ###...#####
        ###...#####
        ###...#####
        ###########
        ###########

    ``frames=3, frame_tokens=3, kind="temporal"``::

        #..#..#..
        .#..#..#.
        ..#..#..#
        #..#..#..
        .#..#..#.
        ..#..#..#
        #..#..#..
        .#..#..#.
        ..#..#..#

    The temporal head's mask is strided in this layout: a query block sees a diagonal stripe of keys
    in every frame, so it visits a key block in every frame, and none of them is full unless
    ``window`` is wider than a block (CogVideoX's 13 frames of 1350 tokens, 128-token blocks,
    ``window=0``: 18% of the video's block pairs visited, none full). Sparse-VideoGen permutes a
    temporal head's video tokens to token-major order (all frames of spatial index 0, then of index
    1, ...) before its kernel: there the temporal head *is* the spatial head with ``frames`` and
    ``frame_tokens`` swapped (:meth:`token_major_order`; without sink frames), a band of whole
    runs of ``frames`` tokens (the same example: 2% of the block pairs; at SVG's width of about 206
    spatial indices, 92% of the visited blocks full against 21% frame-major). The block map is exact
    in either layout.

    Convention next to Sparse-VideoGen's (Xi et al., "Sparse VideoGen", ICML 2025) and
    attention-gym's port (``generate_spatial_head_mask_mod`` / ``generate_temporal_head_mask_mod``):
    both write the spatial head as a band over positions, ``|i - j| < W`` with ``W`` about ``width *
    frame_tokens`` rounded to a multiple of 128 positions, rather than whole frames; here the
    band is in frames (the literal token band is ``Band(lo=-(W - 1), hi=W - 1)``). SVG's temporal
    head is the same band after its token-major permutation, about ``width * frame_tokens / frames``
    spatial indices wide; attention-gym's temporal head is ``|token(i) - token(j)| < (width *
    frame_tokens) // frames``, i.e. ``window = (width * frame_tokens) // frames - 1`` here. Text:
    SVG's HunyuanVideo code keeps the text after the video and dense both ways, as here;
    CogVideoX (and attention-gym's port) put the prompt first: roll such a sequence by the prompt
    length (``torch.roll(x, -prompt, dims=-2)``) to use this layout. Sinks: SVG's Wan 2.1 mask and
    attention-gym's ``attn_sink=True`` keep the first ``frame_tokens`` keys of the kernel's layout
    for every query: a spatial head's first frame, ``sink_frames=1``. SVG applies the same mask to
    its permuted temporal heads, where those keys are the first spatial indices of every frame;
    that sink is not expressible here.

    Forms offered: SDPA ``is_causal=False`` when everything is visible (the window spans every
    frame or every spatial index, the problem fits in ``window + 1`` frames of a spatial head, or
    every key is a sink); for a spatial head with ``window=0`` and neither sinks nor text, all of
    ``Chunked(size=frame_tokens)``'s forms (varlen with one segment per frame); the lowest visible
    key for spatial heads without sinks or text (the first key of frame ``max(frame(i) - window, 0)``);
    a closed-form block map for either kind, any lengths and block sizes (spatial: the frames of a
    block form a range; temporal: the spatial indices of a block form one range or two, when the
    block wraps past a frame's end).

    Args:
        frames: number of frames (``>= 1``).
        frame_tokens: tokens per frame (``>= 1``).
        kind: ``"spatial"`` or ``"temporal"``.
        window: reach in frames (spatial) or spatial indices (temporal), ``>= 0``; default 0.
        sink_frames: leading frames whose keys every query sees (``0 <= sink_frames <= frames``);
            default 0.
        text_len: text tokens after the video (``>= 0``; default 0), attending and attended densely.
    """

    frames: int
    frame_tokens: int
    kind: str
    window: int = 0
    sink_frames: int = 0
    text_len: int = 0

    def __post_init__(self) -> None:
        frames = check_int("frames", self.frames, minimum=1, owner=_OWNER)
        frame_tokens = check_int("frame_tokens", self.frame_tokens, minimum=1, owner=_OWNER)
        if not isinstance(self.kind, str):
            raise TypeError(
                f"{_OWNER}(kind=...) must be a str, one of {KINDS}, got {type(self.kind).__name__}"
            )
        if self.kind not in KINDS:
            raise ValueError(f"{_OWNER}(kind=...) must be one of {KINDS}, got {self.kind!r}")
        window = check_int("window", self.window, minimum=0, owner=_OWNER)
        sinks = check_int("sink_frames", self.sink_frames, minimum=0, owner=_OWNER)
        if sinks > frames:
            raise ValueError(f"{_OWNER}(sink_frames=...) must be at most frames ({frames}), got {sinks}")
        text = check_int("text_len", self.text_len, minimum=0, owner=_OWNER)
        if frames * frame_tokens + text > INDEX_LIMIT:
            raise ValueError(
                f"{_OWNER}: frames * frame_tokens + text_len = {frames * frame_tokens + text} positions "
                f"exceed the kernels' index range ({INDEX_LIMIT})"
            )
        object.__setattr__(self, "frames", frames)
        object.__setattr__(self, "frame_tokens", frame_tokens)
        object.__setattr__(self, "window", window)
        object.__setattr__(self, "sink_frames", sinks)
        object.__setattr__(self, "text_len", text)

    @property
    def video_tokens(self) -> int:
        """Video tokens, ``frames * frame_tokens``; the text follows them."""
        return self.frames * self.frame_tokens

    @property
    def tokens(self) -> int:
        """Positions of the layout, ``frames * frame_tokens + text_len``."""
        return self.video_tokens + self.text_len

    def token_major_order(self) -> torch.Tensor:
        """int64 ``[tokens]``: the frame-major position of the token at each token-major position
        (the video transposed to all frames of spatial index 0, then 1, ...; the text unmoved).

        Permuting q, k and v by it (``x[..., order, :]``) turns this spec's pattern into the one of
        ``VideoSparse(frames=frame_tokens, frame_tokens=frames, kind=<the other kind>, window=window,
        text_len=text_len)``; ``out[..., order.argsort(), :]`` takes the output back. Sink frames do
        not survive the permutation (they become a strided set of keys). Sparse-VideoGen runs its
        temporal heads so, as banded spatial heads."""
        video = torch.arange(self.video_tokens).view(self.frames, self.frame_tokens).t().reshape(-1)
        return torch.cat([video, torch.arange(self.video_tokens, self.tokens)])

    def validate(self, q_len: int, kv_len: int, batch: int, heads: int) -> None:
        self._check(q_len, kv_len)

    def _check(self, q_len: int, kv_len: int) -> None:
        if max(q_len, kv_len) > self.tokens:
            raise ValueError(
                f"{_OWNER}(frames={self.frames}, frame_tokens={self.frame_tokens}, text_len="
                f"{self.text_len}) has {self.tokens} positions but the problem has Lq={q_len}, "
                f"Lkv={kv_len}; the layout must hold max(Lq, Lkv)"
            )

    def _make_mask_mod(self) -> MaskMod:
        per_frame = static_int(self.frame_tokens)
        window = static_int(self.window)
        sink = static_int(self.sink_frames) * per_frame
        video = static_int(self.video_tokens)
        text = static_int(self.text_len) > 0
        spatial = self.kind == "spatial"

        def video_sparse_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            if spatial:  # frame numbers
                q, k = (q_idx // per_frame, kv_idx // per_frame) if per_frame > 1 else (q_idx, kv_idx)
            else:  # spatial indices within the frame
                q, k = q_idx % per_frame, kv_idx % per_frame
            # |q - k| <= window
            out = (q - k <= window) & (k - q <= window)
            if sink:
                out = out | (kv_idx < sink)
            if text:  # positions past the video are text: seen by all, seeing all
                out = out | (q_idx >= video) | (kv_idx >= video)
            return out

        return video_sparse_mask

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        self._check(q_len, kv_len)

        # Oracle: the head's pattern as a Kronecker product -- a band over frames repeated over
        # each frame pair's tokens (spatial), or a band over spatial indices repeated for every
        # frame pair (temporal) -- then the sink columns and the text rows and columns painted in.
        def band(n: int) -> torch.Tensor:
            pos = torch.arange(n)
            return ((pos[:, None] - pos[None, :]).abs() <= self.window).to(torch.uint8)

        frames, per_frame = self.frames, self.frame_tokens
        if self.kind == "spatial":
            video = torch.kron(band(frames), torch.ones(per_frame, per_frame, dtype=torch.uint8))
        else:
            video = torch.kron(torch.ones(frames, frames, dtype=torch.uint8), band(per_frame))
        out = torch.ones(self.tokens, self.tokens, dtype=torch.bool)
        out[: self.video_tokens, : self.video_tokens] = video.bool()
        out[:, : self.sink_frames * per_frame] = True
        return out[:q_len, :kv_len][None, None]

    def _all_visible(self, q_len: int, kv_len: int) -> bool:
        # Length conditions through known_true: a compiled decode step's lengths may be unknown.
        if known_true(kv_len <= self.sink_frames * self.frame_tokens):
            return True  # every key is a sink
        if self.kind == "spatial":
            return self.window >= self.frames - 1 or known_true(
                max(q_len, kv_len) <= (self.window + 1) * self.frame_tokens
            )
        return self.window >= self.frame_tokens - 1

    def _frame_local(self) -> bool:
        """Spatial, one frame, no sinks, no text: exactly ``Chunked(size=frame_tokens)``."""
        return self.kind == "spatial" and self.window == 0 and self.sink_frames == 0 and self.text_len == 0

    def sdpa_form(self, q_len: int, kv_len: int) -> SdpaForm | None:
        return SdpaForm(is_causal=False) if self._all_visible(q_len, kv_len) else None

    def varlen_form(self, q_len: int, kv_len: int, batch: int) -> VarlenForm | None:
        if not self._frame_local():
            return None
        return Chunked(size=self.frame_tokens).varlen_form(q_len, kv_len, batch)

    def lowest_visible_key(self, q_idx: torch.Tensor) -> torch.Tensor | None:
        if self.kind != "spatial" or self.sink_frames or self.text_len:
            return None  # sinks and text queries see key 0; temporal rows restart every frame
        per_frame = self.frame_tokens
        frame = torch.div(q_idx, per_frame, rounding_mode="floor")
        return (frame - self.window).clamp(min=0) * per_frame

    def visible_fraction(self, q_len: int, kv_len: int) -> float:
        # A video query sees its window (whole frames, or one spatial range per frame), the sink
        # frames and the text; a text query sees everything.
        span = 2 * self.window + 1
        window = span * self.frame_tokens if self.kind == "spatial" else span * self.frames
        seen = window + self.sink_frames * self.frame_tokens + self.text_len
        return min(1.0, seen / max(1, kv_len) + self.text_len / max(1, q_len))

    def block_map(
        self, q_len: int, kv_len: int, q_block: int, kv_block: int, device: torch.device | str
    ) -> BlockMap | None:
        self._check(q_len, kv_len)
        q_first, q_last, q_complete = block_ranges(q_len, q_block, device)
        k_first, k_last, k_complete = block_ranges(kv_len, kv_block, device)
        video, sink = self.video_tokens, self.sink_frames * self.frame_tokens
        # Pairs with a text query, a text key or a sink key are visible. What remains is the head's
        # rule between each query block's video run [qa, qb] and each key block's run of non-sink
        # video keys [ka, kb] (either may be empty).
        qa, qb = q_first, q_last.clamp(max=video - 1)
        ka, kb = k_first.clamp(min=sink), k_last.clamp(max=video - 1)
        q_video, k_rest = qa <= qb, ka <= kb
        if self.kind == "spatial":
            some, every = self._spatial_pairs(qa, qb, ka, kb)
        else:
            some, every = self._temporal_pairs(qa, qb, ka, kb)
        any_ = some & q_video[:, None] & k_rest[None, :]
        any_ |= (q_last >= video)[:, None] | ((k_last >= video) | (k_first < sink))[None, :]
        full = every | ~q_video[:, None] | ~k_rest[None, :]
        full &= q_complete[:, None] & k_complete[None, :]
        return BlockMap(any=any_[None, None], full=full[None, None])

    def _spatial_pairs(
        self, qa: torch.Tensor, qb: torch.Tensor, ka: torch.Tensor, kb: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # A run of positions meets every frame from its first position's to its last's: the pair
        # sees some key iff the two frame ranges come within the window, all iff their farthest
        # frames do.
        per_frame, w = self.frame_tokens, self.window
        qf, ql = (qa // per_frame)[:, None], (qb // per_frame)[:, None]
        kf, kl = (ka // per_frame)[None, :], (kb // per_frame)[None, :]
        some = (kf <= ql + w) & (qf <= kl + w)
        every = (kl <= qf + w) & (ql <= kf + w)
        return some, every

    def _temporal_pairs(
        self, qa: torch.Tensor, qb: torch.Tensor, ka: torch.Tensor, kb: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The spatial indices met by a run: [a % T, b % T] when it stays in one frame, all of them
        # when it spans T positions, else it wraps once: [a % T, T - 1] and [0, b % T].
        per_frame, w = self.frame_tokens, self.window

        def pieces(
            a: torch.Tensor, b: torch.Tensor
        ) -> tuple[list[tuple[torch.Tensor, ...]], torch.Tensor, torch.Tensor]:
            whole = b - a + 1 >= per_frame
            wraps = (a // per_frame != b // per_frame) & ~whole
            head_lo = torch.where(whole, 0, a % per_frame)
            head_hi = torch.where(whole | wraps, per_frame - 1, b % per_frame)
            tail_lo, tail_hi = torch.zeros_like(a), b % per_frame
            lowest = torch.where(wraps, 0, head_lo)
            return [(head_lo, head_hi, torch.ones_like(wraps)), (tail_lo, tail_hi, wraps)], lowest, head_hi

        q_pieces, q_min, q_max = pieces(qa, qb)
        k_pieces, k_min, k_max = pieces(ka, kb)
        some = torch.zeros(qa.numel(), ka.numel(), dtype=torch.bool, device=qa.device)
        for q_lo, q_hi, q_ok in q_pieces:
            for k_lo, k_hi, k_ok in k_pieces:
                some |= (
                    (q_ok[:, None] & k_ok[None, :])
                    & (k_lo[None, :] <= q_hi[:, None] + w)
                    & (q_lo[:, None] <= k_hi[None, :] + w)
                )
        # Every pair within the window iff the farthest two indices are.
        every = (k_max[None, :] - q_min[:, None] <= w) & (q_max[:, None] - k_min[None, :] <= w)
        return some, every

    @classmethod
    def typical_example(cls, q_len: int, kv_len: int, batch: int, heads: int) -> Spec:
        # Eight frames, a spatial head that reaches one frame either side.
        n = max(q_len, kv_len, 1)
        return cls(frames=8, frame_tokens=-(-n // 8), kind="spatial", window=1)

    @classmethod
    def examples(cls, q_len: int, kv_len: int, batch: int, heads: int) -> list[Spec]:
        n = max(q_len, kv_len, 1)
        frames = max(1, (n - 1) // 12)  # 12-token frames, the rest of the row text (from n = 13 on)
        return [
            # First: the same spec for every length up to 320 (compiled tests reuse one graph).
            cls(frames=max(20, -(-n // 16)), frame_tokens=16, kind="spatial", window=1),
            cls(
                frames=frames,
                frame_tokens=12,
                kind="temporal",
                window=1,
                sink_frames=1,
                text_len=max(0, n - 12 * frames),
            ),
            cls(frames=max(2, -(-(n - 3) // 7)), frame_tokens=7, kind="spatial", sink_frames=1, text_len=3),
            cls(frames=-(-n // 10), frame_tokens=10, kind="temporal"),
        ]
