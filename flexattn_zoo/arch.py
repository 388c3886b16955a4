"""Which hardware generation a problem runs on, and the per-generation route priorities (data).

``FLEXATTN_ZOO_ARCH`` (e.g. ``sm90``, ``sm80``, ``cpu``) overrides the detected generation for CUDA
tensors, so dispatch tables can be unit-tested on a CPU-only machine.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable

import torch

from flexattn_zoo import _compat

ARCH_ENV = "FLEXATTN_ZOO_ARCH"
#: ``sm`` then the major version (one or two digits) and the minor one (one digit).
_ARCH = re.compile(r"^sm(\d{1,2})(\d)$")
#: The arch name of AMD GPUs under a ROCm (HIP) build of torch. Their devices are "cuda" devices to
#: torch and report a compute capability such as (9, 4) on MI300, which is no NVIDIA generation:
#: read as "sm94" they would be taken for Hopper and sent to cuDNN and FA4, which ROCm lacks.
ROCM = "rocm"


def parse_arch(arch: str, what: str = "arch") -> tuple[int, int] | None:
    """``"sm90"`` -> ``(9, 0)``, ``"sm86"`` -> ``(8, 6)``, ``"sm100"`` -> ``(10, 0)``; ``"cpu"`` and
    ``"rocm"`` (no NVIDIA compute capability) -> None. ``what`` names the value in the error (an
    option or an environment variable)."""
    if arch in ("cpu", ROCM):
        return None
    m = _ARCH.match(arch)
    if not m:
        raise ValueError(f"{what} must look like 'sm80', 'sm90', 'sm100' or be 'cpu' or 'rocm', got {arch!r}")
    return int(m.group(1)), int(m.group(2))


def detect_arch(device: torch.device | str | None = None) -> str:
    """The generation name of ``device``: ``"cpu"`` or ``"sm<major><minor>"``.

    The environment variable ``FLEXATTN_ZOO_ARCH`` wins for CUDA devices (and for ``device=None``).
    """
    override = os.environ.get(ARCH_ENV)
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cpu":
        return "cpu"
    if override:
        parse_arch(override, ARCH_ENV)
        return override
    if dev is None:
        if not torch.cuda.is_available():
            return "cpu"
        dev = torch.device("cuda")
    if dev.type != "cuda":
        return dev.type
    if torch.version.hip is not None:
        return ROCM
    return _cuda_arch(dev)


#: ``detect_arch`` of each CUDA device by (torch's capability function, device index): a device's
#: compute capability cannot change within a process, and asking torch takes several microseconds
#: of every planned call (each step over a growing KV cache plans). Keyed by the function too, so a
#: test that replaces it is answered by the replacement. Not read or filled while torch.compile
#: traces: Dynamo guards on the global dict it reads, and a trace that filled it would fail its own
#: guard on the next call and compile the caller's function again.
_CUDA_ARCH: dict[tuple[object, int], str] = {}


def _cuda_arch(dev: torch.device) -> str:
    ask = torch.cuda.get_device_capability
    # The current device (index None) may change: asked each time.
    if dev.index is None or _compat.is_compiling():
        major, minor = ask(dev)
        return f"sm{major}{minor}"
    found = _CUDA_ARCH.get((ask, dev.index))
    if found is None:
        major, minor = ask(dev)
        found = _CUDA_ARCH[(ask, dev.index)] = f"sm{major}{minor}"
    return found


def generation(arch: str) -> str:
    """Priority-table key of an arch: ``cpu``, ``rocm``, ``sm80``, ``sm86`` (sm86/sm89), ``sm90``, ``sm100``."""
    if arch == ROCM:
        return ROCM
    cc = parse_arch(arch)
    if cc is None:
        return "cpu"
    if cc >= (10, 0):
        return "sm100"
    if cc >= (9, 0):
        return "sm90"
    if cc >= (8, 6):
        return "sm86"
    return "sm80"


# Route order per generation and mode: the first route that accepts a problem wins. Every name is
# a registered route (``backends.BY_NAME``); what a route can run lives with the route. sm90 is
# measured on an H200 (benchmarks/results/h200*.md); sm80/sm86/sm100 follow the same kernels'
# relative speeds, not measured here. A route that could run on a generation but is missing from
# its list is taken there only when named: "dense" on GPUs (it materializes Lq x Lkv), "sdpa_split"
# where it is not measured.
# On the CPU, sdpa_split (torch's flash kernel per part) beats flex_cpu on prefix-LM and is the only
# training route that does not materialize the scores (benchmarks/results/cpu_prefix.md).
PRIORITY: dict[str, dict[str, tuple[str, ...]]] = {
    "sm90": {
        "fwd": (
            "fa4",
            "flex_flash",
            "sdpa",
            "sdpa_cudnn",
            "sdpa_split",
            "flex",
            "varlen",
            "sdpa_flash",
            "sdpa_efficient",
            "sdpa_math",
        ),
        "fwdbwd": (
            "fa4",
            "flex_flash",
            "sdpa",
            "sdpa_cudnn",
            "sdpa_split",
            "flex",
            "varlen",
            "sdpa_flash",
            "sdpa_efficient",
            "sdpa_math",
        ),
    },
    "sm100": {
        "fwd": (
            "fa4",
            "flex_flash",
            "sdpa",
            "sdpa_cudnn",
            "flex",
            "varlen",
            "sdpa_flash",
            "sdpa_efficient",
            "sdpa_math",
        ),
        "fwdbwd": (
            "fa4",
            "flex_flash",
            "sdpa",
            "sdpa_cudnn",
            "flex",
            "varlen",
            "sdpa_flash",
            "sdpa_efficient",
            "sdpa_math",
        ),
    },
    "sm86": {
        "fwd": ("sdpa_flash", "sdpa_cudnn", "flex", "varlen", "sdpa_efficient", "sdpa_math"),
        "fwdbwd": ("sdpa_flash", "sdpa_cudnn", "flex", "varlen", "sdpa_efficient", "sdpa_math"),
    },
    "sm80": {
        "fwd": ("sdpa_flash", "sdpa_cudnn", "flex", "varlen", "sdpa_efficient", "sdpa_math"),
        "fwdbwd": ("sdpa_flash", "sdpa_cudnn", "flex", "varlen", "sdpa_efficient", "sdpa_math"),
    },
    # ROCm: only the routes built for it (``Backend.rocm``); not measured here -- SDPA's fused
    # kernels where the mask has an SDPA form, then Triton flex for everything else.
    ROCM: {
        "fwd": ("sdpa_flash", "sdpa_efficient", "flex", "sdpa_math"),
        "fwdbwd": ("sdpa_flash", "sdpa_efficient", "flex", "sdpa_math"),
    },
    "cpu": {
        "fwd": ("sdpa_flash", "sdpa_split", "flex_cpu", "sdpa_math", "dense"),
        "fwdbwd": ("sdpa_flash", "sdpa_split", "sdpa_math", "dense"),
    },
}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The sizes a :class:`Rule` may select on (a problem's, or a benchmark row's)."""

    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    #: Upper bound on the share of (query, key) pairs the mask leaves visible (1.0: no mask, or
    #: unknown without evaluating it; ``MaskSpec.visible_fraction``).
    visible: float = 1.0
    #: Key/value heads (None: ``heads``, no grouped-query attention).
    kv_heads: int | None = None

    @property
    def kv_rows(self) -> int:
        """``B * Hkv``: the (batch, kv head) rows a decoding kernel spreads over the GPU."""
        return self.batch * (self.heads if self.kv_heads is None else self.kv_heads)

    @property
    def q_rows(self) -> int:
        """``B * H * Lq``: the (batch, head, query) rows, over which kernels spread their work."""
        return self.batch * self.heads * self.q_len

    @property
    def work(self) -> float:
        """``B * H * Lq * Lkv * D`` times ``visible``: the attention's visible size. An integer
        product when ``visible`` is 1 (sizes traced symbolically then compare as integers)."""
        whole = self.batch * self.heads * self.q_len * self.kv_len * self.head_dim
        return whole if self.visible == 1.0 else whole * self.visible


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
    """A measured exception to ``PRIORITY``: on ``generation`` in ``modes``, a problem that has every
    trait in ``traits`` and fits the size bounds gets ``front`` moved to the front of the order
    (routes of ``front`` that refuse the problem are passed over as usual).

    ``evidence`` names the rows of ``benchmark`` (a results file under benchmarks/results) that
    justify the rule, as ``"case/mode"``; tests/unit/test_rules.py checks that each exists and that
    there a ``front`` route beats the route the order without this rule picks.
    """

    generation: str
    modes: tuple[str, ...]
    front: tuple[str, ...]
    why: str
    benchmark: str
    evidence: tuple[str, ...]
    traits: frozenset[str] = frozenset()
    #: Traits the problem must not have (e.g. a rule for exact score mods that leaves the
    #: approximate ones, whose fastest route differs, to other rules).
    absent: frozenset[str] = frozenset()
    #: Inclusive bounds on ``Sizes.work`` (None: no bound).
    max_work: int | None = None
    min_work: int | None = None
    #: Inclusive upper bound on the batch (None: no bound).
    max_batch: int | None = None
    #: Inclusive upper bound on the q/k head dim (None: no bound): the head dims the evidence
    #: covers, where kernels' relative speed changes with it.
    max_head_dim: int | None = None
    #: Inclusive lower bound on the q/k head dim (None: no bound).
    min_head_dim: int | None = None
    #: Inclusive upper bound on the queries per row (None: no bound): decoding rules.
    max_q_len: int | None = None
    #: Inclusive upper bound on ``Sizes.q_rows`` (None: no bound).
    max_q_rows: int | None = None
    #: Inclusive lower bounds on the keys per row and on ``Sizes.kv_rows`` (None: no bound).
    min_kv_len: int | None = None
    min_kv_rows: int | None = None

    def applies(self, gen: str, mode: str, traits: frozenset[str], sizes: Sizes | None) -> bool:
        if gen != self.generation or mode not in self.modes or not self.traits <= traits:
            return False
        if self.absent & traits:
            return False
        bounds = (
            self.max_work, self.min_work, self.max_batch, self.max_head_dim, self.min_head_dim,
            self.max_q_len, self.max_q_rows, self.min_kv_len, self.min_kv_rows,
        )  # fmt: skip
        if all(b is None for b in bounds):
            return True
        if sizes is None:  # size rules need sizes
            return False
        return (
            (self.max_work is None or sizes.work <= self.max_work)
            and (self.min_work is None or sizes.work >= self.min_work)
            and (self.max_batch is None or sizes.batch <= self.max_batch)
            and (self.max_head_dim is None or sizes.head_dim <= self.max_head_dim)
            and (self.min_head_dim is None or sizes.head_dim >= self.min_head_dim)
            and (self.max_q_len is None or sizes.q_len <= self.max_q_len)
            and (self.max_q_rows is None or sizes.q_rows <= self.max_q_rows)
            and (self.min_kv_len is None or sizes.kv_len >= self.min_kv_len)
            and (self.min_kv_rows is None or sizes.kv_rows >= self.min_kv_rows)
        )


BOTH = ("fwd", "fwdbwd")
#: SDPA's routes in the order short problems prefer them: SDPA's own choice, then the pinned
#: kernels, then the routes with masks SDPA cannot take (flex's one launch before sdpa_split's
#: several); FlashAttention-4 (fa4, flex_flash) last.
_SHORT_FIRST = ("sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex", "sdpa_split", "varlen")

#: Decoding sizes from which FlashAttention-2 leaves HBM bandwidth unused and a kernel that reads
#: the cache in wider tiles (flex at static shapes) wins: keys per row, and (batch x kv head) rows
#: (``fz.decode.decode_step``, whose shapes stay the same from step to step, takes its flex path
#: from these sizes). ``auto`` has no such rule: there SDPA's own choice decodes (cuDNN once a
#: shape repeats, see ``backends.sdpa``), as fast as FA4 at one length and faster while the
#: length grows.
SPLIT_DECODE_MIN_KV_LEN = 8192
SPLIT_DECODE_MIN_KV_ROWS = 256

# Measured exceptions, applied in order (later rules win). Traits (``dispatch.problem_traits``):
# "score_mod", "fast_score_mod" (one allowing an approximation, e.g. SoftCap(approx=True)),
# "packed_segments" (a mask of unequal segments, i.e. documents).
RULES: tuple[Rule, ...] = (
    Rule(
        generation="sm90",
        modes=BOTH,
        traits=frozenset({"split_masked"}),
        front=("flex", "flex_flash"),
        why="split forms with a masked part (a draft tree after its context): sdpa_split's three "
        "kernel calls, merges and dense block are host-bound on CUDA (H100, 8x16x2048x128 tree: "
        "0.997 ms forward, 0.967 of it host, vs flex 0.418; forward+backward 2.56 vs 1.53). Triton "
        "flex before flex_flash: on the H200 flex_flash's host time outlasts its kernel there "
        "(forward 273 vs hand-written flex 318 TFLOP/s, zoo_h200.json), where on an H100 its "
        "kernel led (458 vs 329)",
        benchmark="zoo_tree_nofa4_h100_r58.json",
        evidence=("zoo_tree/fwd",),
    ),
    Rule(
        generation="sm90",
        modes=("fwd",),
        traits=frozenset({"packed_segments"}),
        front=("flex_flash",),
        why="fa4 packs q/k/v into cu_seqlens order for documents, which costs more than its kernel saves",
        benchmark="h200.json",
        evidence=("document_causal/fwd", "document_causal_gqa/fwd"),
    ),
    Rule(
        generation="sm90",
        modes=("fwd",),
        traits=frozenset({"packed_segments"}),
        max_batch=1,
        min_head_dim=128,
        front=("fa4",),
        why="documents in one batch row at head dim 128: FA4's varlen kernel beats flex_flash "
        "(Llama-3 16K: 0.63 vs 0.80 ms; Mixtral 8K: 0.40 vs 0.63, flex_flash host-bound there), "
        "where with four rows it loses (document_causal: 0.96 vs 0.54 ms)",
        benchmark="generalization_h200.json",
        evidence=("docs_mixtral_l8192/fwd", "docs_llama3_8b_l16k/fwd"),
    ),
    Rule(
        generation="sm90",
        modes=("fwd",),
        traits=frozenset({"packed_segments"}),
        max_head_dim=64,
        front=("flex",),
        why="documents at head dims up to 64: Triton flex, which spells contiguous documents with "
        "row starts, beats flex_flash forward (Llama-3.2-1B style, B=2 H=32 L=8K D=64: 0.288 vs "
        "0.358 ms; document_causal_d64 in h200.json: 212 vs 196 TFLOP/s); at head dim 128 "
        "flex_flash leads (document_causal: 318 vs 271)",
        benchmark="generalization_h200.json",
        evidence=("docs_llama32_1b_l8192_b2_d64/fwd",),
    ),
    Rule(
        generation="sm90",
        modes=BOTH,
        traits=frozenset({"score_mod"}),
        front=("flex_flash",),
        why="fa4's own soft-capping is slower than flex_flash's score_mod",
        benchmark="h200.json",
        evidence=("softcap_causal/fwdbwd",),
    ),
    Rule(
        generation="sm90",
        modes=("fwd",),
        traits=frozenset({"fast_score_mod"}),
        front=("flex",),
        max_head_dim=128,
        why="Triton's hardware tanh (SoftCap(approx=True); the CuTe path cannot emit it), at head dims "
        "up to 128: at 256 FA4's own kernel is faster (h200_headdims_r14: Gemma-2 local attention, "
        "fa4 452 vs flex 287 TFLOP/s forward)",
        benchmark="h200.json",
        evidence=("softcap_causal/fwd",),
    ),
    Rule(
        generation="sm90",
        modes=("fwd",),
        max_work=3 * 10**10,
        front=_SHORT_FIRST,
        why="short forwards (visible B*H*Lq*Lkv*D up to 3e10, which includes decoding from any real cache): "
        "FA4's per-call host time (0.14-0.31 ms) exceeds the kernel time it saves; SDPA's kernels finish "
        "first (decoding: 2-10x faster than fa4 and flex). From 2e10 FA4's replayed launches lead "
        "(a later rule: DINOv2-g, 2.3e10: fa4 0.223 vs sdpa 0.246 ms; a Llama-3.2-3B-style 4 x 2K "
        "batch, 2.6e10: 0.190 vs 0.213), as above the bound (a Gemma-3-27B-style 4K sequence, 3.4e10: "
        "fa4 0.239 vs sdpa 0.277)",
        benchmark="generalization_h200.json",
        evidence=(
            "bert_base_l128_b128/fwd",
            "llama3_8b_l512_b32/fwd",
            "decode_llama3_8b_b1_32k/fwd",
            "decode_b1_128k/fwd",
            "decode_qwen25_7b_b64_1k/fwd",
        ),
    ),
    Rule(
        generation="sm90",
        modes=("fwd",),
        absent=frozenset({"global_tokens"}),
        min_head_dim=256,
        min_work=10**10,
        front=("fa4",),
        why="forwards at head dim 256 from 1e10 of visible work: Triton flex runs D=256 at about a "
        "third of FA4's rate (Gemma-3 global attention, 8K: 238 vs 755 TFLOP/s on an H100), so "
        "FA4's host time is repaid at a third of the size the short-forward rule assumes "
        "(Gemma-3-4B's 1024-key window, 8K, 1.6e10: fa4 0.252 vs flex 0.272 ms on the H200, "
        "0.170 vs 0.273 on an H100)",
        benchmark="generalization_h200.json",
        evidence=("gemma3_4b_local1024_l8192_d256/fwd",),
    ),
    Rule(
        generation="sm90",
        modes=("fwdbwd",),
        max_work=4 * 10**10,
        front=_SHORT_FIRST,
        why="short training steps (visible B*H*Lq*Lkv*D up to 4e10): FA4's host time per forward+backward "
        "(0.7-1.5 ms) exceeds the kernel time it saves",
        benchmark="generalization_h200.json",
        evidence=(
            "llama3_8b_l512_b32/fwdbwd",
            "vit_l14_l577_b32/fwdbwd",
            "prefix512_l2048_b8_d64/fwdbwd",
        ),
    ),
    Rule(
        generation="sm90",
        modes=("fwd",),
        absent=frozenset({"score_mod", "packed_segments", "global_tokens"}),
        min_work=2 * 10**10,
        max_work=4 * 10**10,
        front=("fa4",),
        why="forwards at the top of the short range (visible B*H*Lq*Lkv*D from 2e10), without a "
        "score mod or documents: with its launches replayed (backends.fa4_replay) FA4's host time "
        "per call is about half its launcher's, and its kernels beat SDPA's from here (H100: "
        "DINOv2-g, 2.3e10: 0.225 vs 0.243 ms; a Llama-3.2-3B-style 4 x 2K batch, 2.6e10: 0.205 vs "
        "0.225); below it SDPA led on most rows (Llama-3-8B heads at B=32, L=512, 1.7e10: sdpa "
        "0.197 vs 0.269). Not forward+backward: there FA4's host time decides with the host's "
        "speed (H100: fa4 0.88 vs sdpa 0.95 ms on the Llama-3.2-3B batch; the H200, whose host is "
        "slower: 1.19 vs 0.87, fa4 host-bound, and Gemma-3-27B-style 4K 1.06 vs 0.97), and SDPA "
        "is the choice that loses least where it loses. Where fa4 refuses the problem the "
        "short-range order stands",
        benchmark="generalization_fa4replay_h100.json",
        evidence=("dinov2_g_l1370_b8/fwd", "llama32_3b_l2048_b4/fwd"),
    ),
    Rule(
        generation="sm90",
        modes=("fwdbwd",),
        absent=frozenset({"score_mod", "packed_segments", "global_tokens", "gqa"}),
        min_work=2 * 10**10,
        max_work=4 * 10**10,
        front=("fa4",),
        why="training steps at the top of the short range (visible B*H*Lq*Lkv*D from 2e10) without "
        "grouped-query attention, a score mod or documents: FA4's backward beats SDPA's by more "
        "than its host time costs (DINOv2-g, 2.3e10: 0.76 vs 0.95 ms on an H100, 0.73 vs 0.91 on "
        "the H200). With GQA FA4's forward+backward is host-bound there and SDPA leads on the "
        "H200 (a Llama-3.2-3B-style 4 x 2K batch, 24:8 heads: fa4 1.19 vs sdpa 0.87 ms; "
        "Gemma-3-27B-style 4K, 32:16: 1.10 vs 1.06), though not on an H100 (0.88 vs 0.95)",
        benchmark="generalization_fa4replay_h100.json",
        evidence=("dinov2_g_l1370_b8/fwdbwd",),
    ),
    Rule(
        generation="sm90",
        modes=("fwd",),
        absent=frozenset({"score_mod", "packed_segments"}),
        min_work=3 * 10**10 + 1,
        max_work=5 * 10**10,
        max_head_dim=64,
        front=("fa4", "sdpa", "sdpa_cudnn", "flex"),
        why="forwards just above the short range (visible B*H*Lq*Lkv*D over 3e10 up to 5e10) at head "
        "dims up to 64, without a score mod or documents, that fa4 and SDPA cannot run (prefix-LM, "
        "masks without an SDPA form): Triton flex's kernel takes about as long as flex_flash's host "
        "time per call (0.21-0.36 ms on the H200, varying run to run), so flex_flash gains at most "
        "a few percent and loses far more when its host is slow (prefix-LM 512, B=8, H=16, L=2K: "
        "flex 0.242 vs flex_flash 0.406 ms, flex_flash host-bound; 0.243 vs 0.231 in an earlier "
        "run); sdpa_split is slower than both (0.325)",
        benchmark="generalization_h200.json",
        evidence=("prefix512_l2048_b8_d64/fwd",),
    ),
    Rule(
        generation="sm90",
        modes=("fwdbwd",),
        absent=frozenset({"score_mod", "packed_segments", "global_tokens"}),
        min_work=15 * 10**9,
        max_work=2 * 10**10,
        max_head_dim=64,
        front=("fa4",),
        why="training steps just below the top of the short range (visible B*H*Lq*Lkv*D from 1.5e10) "
        "at head dims up to 64: FA4's replayed launches already beat SDPA there (Llama-3.2-1B heads, "
        "B=64, L=512, 1.7e10: fa4 1.23 vs sdpa 1.32 ms on the H200, 1.39 vs 1.48 on an H100), "
        "where at head dim 128 SDPA still leads (Llama-3-8B heads, B=32, L=512: 1.03 vs 1.08) and "
        "below it by far (ViT-L/14, B=32, 1.1e10: 0.59 vs 1.09)",
        benchmark="generalization_h200.json",
        evidence=("llama32_1b_l512_b64/fwdbwd",),
    ),
    Rule(
        generation="sm90",
        modes=("fwdbwd",),
        traits=frozenset({"score_mod"}),
        min_work=3 * 10**10,
        front=("flex_flash",),
        why="score mods near the top of the short range (visible B*H*Lq*Lkv*D from 3e10): "
        "flex_flash's backward saves more than its host time costs (exact soft-capping, B=8, "
        "16:8 heads, L=2K, D=128: 1.64 vs flex 3.05 ms); with ALiBi's cheaper score the two "
        "are within 6% either way, flex_flash's row host-bound (B=8, D=64: 1.62 vs 1.63; "
        "MPT-7B, B=4, D=128: 1.65 vs 1.56)",
        benchmark="generalization_h200.json",
        evidence=("softcap50_l2048_b8_d128/fwdbwd", "alibi_bidir_l2048_b8_d64/fwdbwd"),
    ),
    Rule(
        generation="sm90",
        modes=BOTH,
        traits=frozenset({"packed_segments"}),
        max_work=6 * 10**10,
        front=("flex",),
        why="documents up to 6e10 (B*H*L*L*D, causal share counted; the documents' own share is not "
        "known without reading their ids): Triton flex's one launch beats FA4's host time per call "
        "(BERT-style bidirectional documents, B=4, L=4K, D=64: flex 0.13 / 0.99 ms vs flex_flash "
        "0.30 and fa4 1.45)",
        benchmark="generalization_h200.json",
        # Its forward rows are D=64, where the head-dim rule above already takes flex.
        evidence=("docs_bidir_bert_l4096_b4/fwdbwd",),
    ),
    Rule(
        generation="sm90",
        modes=("fwdbwd",),
        absent=frozenset({"global_tokens"}),
        min_head_dim=256,
        front=("sdpa", "sdpa_cudnn", "fa4"),
        why="training at head dim 256 (Gemma-2/3; at 192 FA4 leads, mla_d192 in h200.json): SDPA's own choice (cuDNN) where SDPA "
        "expresses the mask (Gemma-3 global attention, 8K: 2.14 vs fa4 2.35 ms in one H200 sweep, "
        "402 vs 351 TFLOP/s on an H100, a tie in a later H200 run: 2.37 vs 2.34 ms, so not this "
        "rule's evidence), else FA4, whose backward at D=256 beats Triton flex's (Gemma-3 local "
        "window 1024, 8K: 1.29 vs 1.68 ms) even on problems short enough that FA4's host time "
        "decides elsewhere",
        benchmark="generalization_h200.json",
        evidence=("gemma3_4b_local1024_l8192_d256/fwdbwd",),
    ),
    Rule(
        generation="sm90",
        modes=BOTH,
        traits=frozenset({"global_tokens"}),
        min_work=3 * 10**10,
        front=("flex_flash", "flex"),
        why="a window plus global tokens (Longformer): fa4 runs it as its windowed kernel plus the "
        "global keys merged in and the global rows apart, whose extra passes and host time "
        "(about 1.45 ms per forward on the H200's host) outweigh the windowed kernel's lead; "
        "flex_flash's one call stays ahead (2x16x8192x128, a [CLS] token, window 512 each side: "
        "0.50 vs 1.50 ms forward; 2.16 vs 6.27 forward+backward, measured with two needless FA4 "
        "backward calls since removed). Below 3e10 the short-range "
        "order takes Triton flex first, and the fa4 rules leave global tokens out",
        benchmark="zoo_global_window_h200_r59.json",
        evidence=(
            "zoo_global_window/fwd",
            "zoo_global_window/fwdbwd",
            "zoo_global_window_d64/fwd",
            "zoo_global_window_d64/fwdbwd",
        ),
    ),
)


def applied_rules(
    arch: str,
    mode: str,
    traits: frozenset[str] = frozenset(),
    sizes: Sizes | None = None,
    rules: Iterable[Rule] | None = None,
) -> tuple[Rule, ...]:
    """The rules (``RULES``, or ``rules``) that :func:`priority` applies for such a problem, in
    order."""
    gen = generation(arch)
    return tuple(
        rule for rule in (RULES if rules is None else rules) if rule.applies(gen, mode, traits, sizes)
    )


def priority(
    arch: str,
    mode: str,
    traits: frozenset[str] = frozenset(),
    sizes: Sizes | None = None,
    rules: Iterable[Rule] | None = None,
) -> tuple[str, ...]:
    """The ordered route names for ``arch`` in ``mode`` (``"fwd"`` or ``"fwdbwd"``) for a problem
    with ``traits`` and ``sizes`` (see ``RULES``; without sizes, only the trait rules apply).
    ``rules``: another rule set than ``RULES`` (the benchmark replay compares rule sets)."""
    if mode not in ("fwd", "fwdbwd"):
        raise ValueError(f"mode must be 'fwd' or 'fwdbwd', got {mode!r}")
    order = PRIORITY[generation(arch)][mode]
    for rule in applied_rules(arch, mode, traits, sizes, rules):
        order = rule.front + tuple(r for r in order if r not in rule.front)
    return order


def ordered_routes(gen: str) -> frozenset[str]:
    """Every route that generation ``gen``'s order names in either mode: those ``backend="auto"``
    may pick there (the others run there only when named)."""
    return frozenset(name for order in PRIORITY[gen].values() for name in order)
