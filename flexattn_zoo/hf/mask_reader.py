"""Reading Hugging Face transformers' attention masks into zoo specs (for :mod:`flexattn_zoo.hf`).

The mask builder that :func:`flexattn_zoo.hf.register` installs returns an :class:`HFMask`
descriptor instead of an ``Lq x Lkv`` tensor; :func:`translate` turns it into specs by reading
transformers' mask-function closures structurally (see :mod:`flexattn_zoo.hf` for the mapping).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from flexattn_zoo.functions import FunctionMask
from flexattn_zoo.hf import factories
from flexattn_zoo.masks import Causal, Chunked, Dense, Document, SlidingWindow
from flexattn_zoo.masks._blocks import CapturedOffsets, check_int
from flexattn_zoo.masks.band import Band
from flexattn_zoo.masks.causal import OffsetCausal
from flexattn_zoo.masks.padding import KeyPadding
from flexattn_zoo.spec import MaskMod, MaskSpec, maybe_true, spec_dataclass, tracing

log = logging.getLogger(__name__)

__all__ = ["HFMask", "dense_mask_spec", "masking_utils", "transformers_module", "translate"]


_MODULES: dict[str, Any] = {}


def transformers_module() -> Any:
    """The ``transformers`` package, imported on the first (eager) call and kept: inside a
    compiled model Dynamo cannot trace ``import transformers`` (its lazy top-level module is no
    plain module to it: "Bad import result", torch 2.11), and ``register()`` runs eagerly first."""
    if "transformers" not in _MODULES:
        try:
            import transformers
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("flexattn_zoo.hf needs transformers: pip install 'flexattn-zoo[hf]'") from exc
        _MODULES["transformers"] = transformers
        _MODULES["masking_utils"] = importlib.import_module("transformers.masking_utils")
    return _MODULES["transformers"]


def masking_utils() -> Any:
    """``transformers.masking_utils`` (a plain module, kept as :func:`transformers_module` is)."""
    transformers_module()
    return _MODULES["masking_utils"]


# ---------------------------------------------------------------------------------------------
# The mask descriptor


@dataclasses.dataclass(eq=False)
class HFMask:
    """What transformers' mask builder told us, unevaluated (what our attention function receives).

    ``padding`` is the 2-D ``attention_mask`` (bool, True = real token), or None when it has no
    padding; ``mask_function`` is transformers' pattern over absolute positions (padding excluded).
    """

    mask_function: Callable[..., Any]
    padding: torch.Tensor | None
    batch_size: int
    q_length: int
    kv_length: int
    q_offset: int
    kv_offset: int
    _spec: Any = dataclasses.field(default=None, repr=False)
    _done: bool = dataclasses.field(default=False, repr=False)

    def spec(self) -> MaskSpec | None:
        """The zoo spec of this mask (computed once, shared by every layer that receives it)."""
        if not self._done:
            self._spec, self._done = translate(self), True
        return self._spec

    # The little of the tensor interface transformers reads from a *prepared* mask. With a
    # compilable (static) cache, ``generate`` builds the masks ahead of the forward
    # (``create_masks_for_generate``, which calls our mask builder) and hands them to the model
    # as ``attention_mask``; transformers then calls ``.contiguous()`` on them (5.23: on every
    # value of the per-layer-type dict), and models without ``layer_types`` (Llama, Phi-3) pass
    # the mask into ``create_causal_mask`` again, which reads ``.ndim`` (2 = a padding mask to
    # convert) and, without a cache, ``.shape[-1]``. We describe a ``[B, 1, Lq, Lkv]`` mask; the
    # builder recognises an HFMask handed back and rebuilds from the new call's sizes with this
    # mask's padding (see ``integration._mask_builder``).

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, 1, self.q_length, self.kv_length)

    @property
    def ndim(self) -> int:
        return 4

    def dim(self) -> int:
        return 4

    def contiguous(self, *args: Any, **kwargs: Any) -> HFMask:
        return self

    # Model code that computes with the mask as a tensor itself (Falcon with alibi=True adds its
    # ALiBi bias to it; BLOOM and MPT add it to their own attention scores) would otherwise fail
    # with a bare "'HFMask' object has no attribute 'dtype'" or "unsupported operand type(s)".

    def __getattr__(self, name: str) -> Any:
        # Called only for attributes HFMask lacks. Still an AttributeError, so hasattr() and
        # getattr(..., default) answer as before.
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(_not_a_tensor(f"reads {name!r} from it"))

    def _operand(self, *_: Any) -> Any:
        raise TypeError(_not_a_tensor("uses it as an operand"))

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _operand
    __and__ = __rand__ = __or__ = __ror__ = __invert__ = __getitem__ = _operand


def _not_a_tensor(action: str) -> str:
    return (
        "the attention mask is a flexattn_zoo.hf.HFMask (a description for the zoo's attention, not a "
        f"tensor), and this model's code {action} to compute with the mask itself (as Falcon with "
        "alibi=True, BLOOM and MPT do); such a model cannot run on flexattn_zoo: use "
        "attn_implementation='sdpa' or 'eager' for it"
    )


# ---------------------------------------------------------------------------------------------
# Reading transformers' mask functions


class _Unknown(Exception):
    """A mask function we cannot read exactly (handled by the exact generic fallback)."""


_CODES: dict[str, Any] | None = None


def _codes() -> dict[str, Any]:
    """Code objects of transformers' mask-function closures, taken from live instances (eagerly:
    :func:`factories.install` has given Dynamo stand-ins for these factories)."""
    global _CODES
    if _CODES is None:
        mu = masking_utils()
        example_args = factories.example_args(mu)
        codes = {}
        for kind, name in factories.FACTORIES.items():
            try:
                codes[kind] = getattr(mu, name)(*example_args[kind]).__code__
            except (AttributeError, TypeError):  # absent in this transformers version
                continue
        _CODES = codes
    return _CODES


#: Where a model's forward passes ``or_mask_function=lambda *args: torch.tensor(True, dtype=torch.bool)``
#: (every pair visible): ``(module, class, method)``. Gemma 3 (and Step3p7) with
#: ``use_bidirectional_attention=True``, for their full-attention layers.
_ALWAYS_TRUE_LAMBDAS = (
    ("transformers.models.gemma3.modeling_gemma3", "Gemma3TextModel", "forward"),
    ("transformers.models.step3p7.modeling_step3p7", "Step3p7TextModel", "forward"),
)

#: Model modules' mask code objects found so far: code -> the reader's kind (``"everything"`` for
#: the always-true lambdas), with each code's module globals; and the modules already looked at.
_MODEL_CODES: dict[Any, tuple[str, dict[str, Any]]] = {}
_MODEL_MODULES_SEEN: set[str] = set()


def _always_true_lambda(method: Any) -> Any:
    """The code object of the one ``lambda *args: torch.tensor(True, dtype=torch.bool)`` in
    ``method`` (searched through its nested code objects), or None if there is not exactly one."""
    found = []
    stack = [inspect.unwrap(method).__code__]
    while stack:
        code = stack.pop()
        for const in code.co_consts:
            if not isinstance(const, types.CodeType):
                continue
            stack.append(const)
            if (
                const.co_name == "<lambda>"
                and const.co_argcount == 0
                and const.co_kwonlyargcount == 0
                and const.co_flags & inspect.CO_VARARGS
                and not const.co_flags & inspect.CO_VARKEYWORDS
                and not const.co_freevars
                and const.co_names == ("torch", "tensor", "bool")
                and const.co_consts == (None, True, ("dtype",))
            ):
                found.append(const)
    return found[0] if len(found) == 1 else None


def _model_codes() -> dict[Any, tuple[str, dict[str, Any]]]:
    """Code objects of model modules' mask functions (:data:`factories.MODEL_FACTORIES` closures
    and :data:`_ALWAYS_TRUE_LAMBDAS`), from the modules imported so far: a closure of a module
    can only exist once its module is imported, and importing every model module would be slow."""
    wanted = {m for copies in factories.MODEL_FACTORIES.values() for m, _ in copies}
    wanted |= {m for m, _, _ in _ALWAYS_TRUE_LAMBDAS}
    for module_name in wanted - _MODEL_MODULES_SEEN:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        _MODEL_MODULES_SEEN.add(module_name)
        found: dict[Any, tuple[str, dict[str, Any]]] = {}
        for kind, copies in factories.MODEL_FACTORIES.items():
            for m, name in copies:
                original = getattr(module, name, None) if m == module_name else None
                if not isinstance(original, types.FunctionType):
                    continue
                try:
                    sample = original(*factories.MODEL_EXAMPLE_ARGS[kind])
                except (TypeError, ValueError):  # another signature in this transformers version
                    continue
                if isinstance(sample, types.FunctionType):
                    found[sample.__code__] = (kind, module.__dict__)
        for m, cls, method in _ALWAYS_TRUE_LAMBDAS:
            fn = getattr(getattr(module, cls, None), method, None) if m == module_name else None
            code = _always_true_lambda(fn) if isinstance(fn, types.FunctionType) else None
            if code is not None:
                found[code] = ("everything", module.__dict__)
        _MODEL_CODES.update(found)
    return _MODEL_CODES


def _cells(fn: Any) -> dict[str, Any]:
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ()), strict=True))


def _factory(fn: Any) -> tuple[str, dict[str, Any]]:
    """Which of transformers' factories made the closure ``fn``, and its arguments (by name)."""
    found = factories.recorded(fn)
    if found is not None:
        return found
    name = getattr(fn, "__qualname__", None) or type(fn).__name__  # no repr(): Dynamo cannot run it
    if torch.compiler.is_dynamo_compiling():
        # A closure made in the graph by no stand-in: Dynamo cannot read its cells. (Non-strict
        # export traces without Dynamo: there closures are Python objects, read as eagerly.)
        raise _Unknown(f"{name} (made inside the compiled graph)")
    code = getattr(fn, "__code__", None)
    kind = next((k for k, c in _codes().items() if c is code), None)
    if kind is None:
        kind, module_globals = _model_codes().get(code, (None, None))
        # The same code run with other globals (``torch`` rebound) is not provably the same function.
        if kind is None or getattr(fn, "__globals__", None) is not module_globals:
            raise _Unknown(name)
    return kind, _cells(fn)


def _host_or_own(value: Any) -> torch.Tensor:
    """``value`` as a tensor: a tensor stays on its device, a number goes to the CPU (not the
    caller's default device)."""
    return value if isinstance(value, torch.Tensor) else torch.tensor(value, device="cpu")


@dataclasses.dataclass(frozen=True)
class _BandNode:
    lo: int | None
    hi: int | None


def _read(fn: Any) -> Any:
    """A small tree describing ``fn`` over absolute positions; ``_Unknown`` if not exactly known."""
    mu = masking_utils()
    if fn is getattr(mu, "causal_mask_function", None):
        return _BandNode(None, 0)
    if fn is getattr(mu, "bidirectional_mask_function", None):
        return _BandNode(None, None)
    kind, cells = _factory(fn)

    def cell(name: str) -> Any:
        if name not in cells:  # another release's closure, or an argument not recorded
            raise _Unknown(f"{kind} closure without {name}")
        return cells[name]

    if kind in ("and", "or"):
        return (kind, [_read(f) for f in cell("mask_functions")])
    if kind == "sliding":  # kv > q - W
        return _BandNode(1 - int(cell("sliding_window")), None)
    if kind == "sliding_bidirectional":  # |q - kv| <= W
        w = int(cell("sliding_window"))
        return _BandNode(-w, w)
    if kind == "window_bidirectional":  # |q - kv| < W
        w = cell("sliding_window")
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            raise _Unknown(f"{kind} closure with sliding_window={w!r}")
        return _BandNode(1 - w, w - 1)
    if kind == "everything":  # lambda *args: torch.tensor(True)
        return _BandNode(None, None)
    if kind == "chunked":
        return ("chunked", int(cell("chunk_size")), cell("left_padding"))
    if kind == "packed":
        return ("packed", cell("packed_sequence_mask"))
    if kind == "remap":
        return ("remap", _read(cell("mask_function")), cell("position_ids"))
    return ("padding", cell("padding_mask"))


def _difference_only(node: Any) -> bool:
    """Whether ``node`` depends on positions only through ``kv - q`` (so remapping is a no-op
    inside one packed sequence, where positions advance by one per token)."""
    if isinstance(node, _BandNode):
        return True
    return isinstance(node, tuple) and node[0] in ("and", "or") and all(_difference_only(n) for n in node[1])


def _flatten_and(nodes: list[Any]) -> list[Any]:
    out: list[Any] = []
    for n in nodes:
        out.extend(_flatten_and(n[1]) if isinstance(n, tuple) and n[0] == "and" else [n])
    return out


def _combine_labels(labels: list[torch.Tensor]) -> torch.Tensor:
    """One label per position equal iff all ``labels`` are equal; sorted rows stay sorted (each
    label is nondecreasing inside the runs of the previous ones: mixed-radix, first label most
    significant)."""
    out = labels[0].to(torch.int64)
    for lab in labels[1:]:
        lab = lab.to(torch.int64)
        lo = lab.min()
        out = out * (lab.max() - lo + 1) + (lab - lo)
    return out


def band_spec(lo: int | None, hi: int | None, offset: int = 0) -> MaskSpec | None:
    """The zoo spec of ``lo + offset <= j - i <= hi + offset`` (None for no mask at all).

    ``offset`` is the cache offset ``q_offset - kv_offset``. Without one the spec is canonical
    (``Causal``, ``SlidingWindow``: the forms prefill routes need). With one (decode steps, whose
    offset moves every step) it is ``OffsetCausal`` / ``Band``, whose ``mask_mod`` reads the
    offsets from captured tensors: every step shares one compiled kernel, where a
    ``SlidingWindow(left=W - 1 - d, right=d)`` per step would compile one per step.
    """
    if lo is None and hi is None:
        return None
    # A compiled decode step may hand a data-dependent offset (read from cache_position): then
    # the offset forms, exact for any value, 0 included.
    if maybe_true(offset != 0):
        if lo is None:
            assert hi is not None
            return OffsetCausal(offset=hi + offset)
        return Band(lo=lo + offset, hi=None if hi is None else hi + offset)
    if lo is None:
        assert hi is not None
        return Causal() if hi == 0 else OffsetCausal(offset=hi)
    if hi is not None and lo <= 0 <= hi:
        return SlidingWindow(left=-lo, right=hi)
    return Band(lo=lo, hi=hi)


def _and(specs: list[MaskSpec | None]) -> MaskSpec | None:
    parts = [s for s in specs if s is not None]
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out = out & p
    return out


def _as_band(node: Any) -> _BandNode | None:
    """``node`` as one band ``lo <= kv - q <= hi`` if it is one (a band; an ``and`` of bands, their
    intersection; an ``or`` of bands covering one interval), else None. An empty intersection is
    None too (left to the general path)."""
    if isinstance(node, _BandNode):
        return node
    if isinstance(node, tuple) and node[0] == "or":
        return _union_band([_as_band(c) for c in node[1]])
    if not (isinstance(node, tuple) and node[0] == "and"):
        return None
    bands = [_as_band(c) for c in node[1]]
    if not bands or any(b is None for b in bands):
        return None
    both = _intersect([b for b in bands if b is not None])
    return None if both.lo is not None and both.hi is not None and both.lo > both.hi else both


def _intersect(bands: list[_BandNode]) -> _BandNode:
    """The band every one of ``bands`` holds (empty where ``lo > hi``)."""
    los = [b.lo for b in bands if b.lo is not None]
    his = [b.hi for b in bands if b.hi is not None]
    return _BandNode(max(los) if los else None, min(his) if his else None)


def _union_band(bands: list[_BandNode | None]) -> _BandNode | None:
    """The union of ``bands`` if every one is a band and together they cover one interval of
    ``kv - q`` (integers: each overlaps or touches the next), else None."""
    if not bands or any(b is None for b in bands):
        return None
    # Sorted by lower end (None: unbounded below, first); sweep the covered interval.
    ordered = sorted((b for b in bands if b is not None), key=lambda b: (b.lo is not None, b.lo or 0))
    lo, hi = ordered[0].lo, ordered[0].hi
    for b in ordered[1:]:
        if hi is not None and b.lo is not None and b.lo > hi + 1:
            return None  # a gap
        hi = None if hi is None or b.hi is None else max(hi, b.hi)
    return _BandNode(lo, hi)


def _to_spec(node: Any, m: HFMask) -> MaskSpec | None:
    d = m.q_offset - m.kv_offset
    if isinstance(node, _BandNode):
        return band_spec(node.lo, node.hi, offset=d)
    kind = node[0]
    if kind == "and":
        children = _flatten_and(node[1])
        packed = [c for c in children if isinstance(c, tuple) and c[0] == "packed"]
        if packed:
            if maybe_true(m.q_offset != 0) or maybe_true(m.kv_offset != 0):
                raise _Unknown("packed sequences with a cache offset")
            unwrapped, labels = [], [packed[0][1]]
            for c in children:
                if isinstance(c, tuple) and c[0] == "remap":
                    for n in _flatten_and([c[1]]):
                        if isinstance(n, tuple) and n[0] == "chunked":
                            # Chunks of the remapped positions (Llama 4 + packing): one more label.
                            pos = c[2].expand(m.batch_size, -1) - torch.as_tensor(
                                n[2], device=c[2].device
                            ).view(-1, 1)
                            labels.append(torch.div(pos, n[1], rounding_mode="floor"))
                        elif _difference_only(n):
                            unwrapped.append(n)
                        else:
                            raise _Unknown("packed sequences over a position-dependent pattern")
                elif not (isinstance(c, tuple) and c[0] == "packed"):
                    unwrapped.append(c)
            unwrapped.append(("packed", _combine_labels(labels)))
            children = _flatten_and(unwrapped)
        # Intersect the bands into one canonical spec (e.g. SlidingWindow), placed last as the zoo
        # writes compositions (Document(...) & Causal(), Chunked(...) & Causal()).
        as_bands = [_as_band(c) for c in children]
        bands = [b for b in as_bands if b is not None]
        specs: list[MaskSpec | None] = [
            _to_spec(c, m) for c, b in zip(children, as_bands, strict=True) if b is None
        ]
        if bands:
            specs.append(_to_spec(_intersect(bands), m))
        return _and(specs)
    if kind == "or":
        band = _as_band(node)
        if band is not None:  # one band (Gemma 3's bidirectional window over its sliding window)
            return _to_spec(band, m)
        parts = [_to_spec(c, m) for c in node[1]]
        present = [p for p in parts if p is not None]
        if len(present) < len(parts):
            return None  # one part sees everything
        out = present[0]
        for p in present[1:]:
            out = out | p
        return out
    if kind == "chunked":
        size, left_padding = node[1], _host_or_own(node[2])
        if maybe_true(m.q_offset != 0) or maybe_true(m.kv_offset != 0):
            return _chunk_of_the_step(size, left_padding, m)
        # Traced, the padding's values are unknown: the chunk-id form, exact for any of them.
        if not tracing() and not bool(left_padding.any()):
            return Chunked(size=size)
        # transformers counts chunks from each row's first real token: chunk id
        # (p - left_padding[b]) // size, sorted along the row, so a Document of chunk ids.
        n = max(m.q_length, m.kv_length)
        pos = torch.arange(n, device=left_padding.device)[None, :] - left_padding.view(-1, 1)
        return Document(doc_ids=torch.div(pos, size, rounding_mode="floor").expand(m.batch_size, n))
    if kind == "packed":
        ids = node[1]
        if ids.shape[-1] < max(m.q_length, m.kv_length):
            raise _Unknown("packed sequence ids shorter than the sequence")
        return Document(doc_ids=ids)
    if kind == "padding":
        return KeyPadding(valid=_key_slice(node[1], m))
    raise _Unknown(f"{kind} outside packed sequences")


def _chunk_of_the_step(size: int, left_padding: torch.Tensor, m: HFMask) -> MaskSpec:
    """Chunked attention in a cache step (Llama 4 decoding): query ``i`` of row ``b`` sits at
    ``q_offset + i`` and key ``j`` at ``kv_offset + j``, each in chunk ``(p - left_padding[b]) //
    size``. When every query of a row is in one chunk (a decode step of one token, or a few that
    do not cross a chunk boundary), the keys of that chunk are a per-row key mask: an exact
    ``KeyPadding``, which SDPA takes as a broadcast ``attn_mask``. Read from the offsets' values,
    so not while traced (the generic path, exact for any offset, serves compiled steps)."""
    if tracing():
        raise _Unknown("chunked attention with a cache offset, traced")
    if m.q_length == 0:
        return KeyPadding(
            valid=torch.ones(m.batch_size, m.kv_length, dtype=torch.bool, device=left_padding.device)
        )
    lead = left_padding.to(torch.int64).reshape(-1, 1)
    q_pos = int(m.q_offset) + torch.arange(m.q_length, device=lead.device)[None, :] - lead
    kv_pos = int(m.kv_offset) + torch.arange(m.kv_length, device=lead.device)[None, :] - lead
    q_chunk = torch.div(q_pos, size, rounding_mode="floor")
    if not bool((q_chunk == q_chunk[:, :1]).all()):
        raise _Unknown("chunked attention with a cache offset, queries across a chunk boundary")
    visible = torch.div(kv_pos, size, rounding_mode="floor") == q_chunk[:, :1]
    return KeyPadding(valid=visible.expand(m.batch_size, m.kv_length))


def _key_slice(mask: torch.Tensor, m: HFMask) -> torch.Tensor:
    """``mask[:, kv_offset : kv_offset + Lkv]`` as bool, padded with False like transformers."""
    valid = mask.to(torch.bool)[:, m.kv_offset : m.kv_offset + m.kv_length]
    if valid.shape[-1] < m.kv_length:
        valid = torch.nn.functional.pad(valid, (0, m.kv_length - valid.shape[-1]), value=False)
    return valid


_WARNED: set[str] = set()


#: transformers releases (major, minor) whose mask-function closures the structural reader was
#: tested against (tests/hf runs whole models against ``eager``). The closures are private to
#: transformers and change between releases (5.23's sliding-window closures read differently
#: and gave wrong chunked-prefill logits), so any other release takes the exact generic path.
TESTED_TRANSFORMERS = frozenset({(5, 24), (5, 25)})


def _release(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def structural_reader_enabled() -> bool:
    """Whether the installed transformers is a release the structural mask reader knows."""
    return _release(str(getattr(transformers_module(), "__version__", ""))) in TESTED_TRANSFORMERS


def translate(m: HFMask) -> MaskSpec | None:
    """The zoo spec equal to transformers' mask ``m`` (pattern, offsets and padding)."""
    try:
        if not structural_reader_enabled():
            version = getattr(transformers_module(), "__version__", "?")
            tested = ", ".join(f"{a}.{b}" for a, b in sorted(TESTED_TRANSFORMERS))
            raise _Unknown(f"transformers {version} is not a release this reader was tested with ({tested})")
        pattern = _to_spec(_read(m.mask_function), m)
    except _Unknown as exc:
        # The reason is the exception's argument: Dynamo cannot call str() on an exception, and
        # a compiled model skips the warning (logging is a side effect the graph cannot hold).
        reason = str(exc.args[0]) if exc.args else type(exc).__name__
        if not tracing() and reason not in _WARNED:
            _WARNED.add(reason)
            log.warning(
                "flexattn_zoo.hf: transformers mask pattern not recognised (%s); running it exactly as a "
                "mask_mod (no cheap forms, a new BlockMask per forward)",
                reason,
            )
        return _generic(m)
    if m.padding is None:
        return pattern
    return _and([pattern, KeyPadding(valid=_key_slice(m.padding, m))])


@spec_dataclass
class ShiftedFunctionMask(CapturedOffsets, FunctionMask):
    """``fn(b, h, q_idx + q_offset, kv_idx + kv_offset)``: a mask function over absolute positions
    (transformers' patterns) applied to the queries and keys of a cache step.

    The offsets are captured 0-d tensors in the ``mask_mod`` (see ``CapturedOffsets``), so the
    steps of a generation loop, whose offsets move every token, share one compiled kernel; a
    closure over the Python ints compiled one per token.
    """

    q_offset: int = 0
    kv_offset: int = 0

    # The shift moves positions only: whether the function reads the batch row or the head is
    # the wrapped function's (a replaced function drops the forms it does not restate).
    uses_batch = FunctionMask.uses_batch
    uses_head = FunctionMask.uses_head
    # FunctionMask's oracle applies ``index_offsets``: it is this class's too.
    dense = FunctionMask.dense

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("q_offset", "kv_offset"):
            object.__setattr__(
                self, name, check_int(name, getattr(self, name), minimum=None, owner="ShiftedFunctionMask")
            )
        self._set_device()

    def index_offsets(self) -> tuple[int, int]:
        return self.q_offset, self.kv_offset

    def _make_mask_mod(self) -> MaskMod:
        inner = super()._make_mask_mod()
        q_offset = self._offset_tensor(self.q_offset)
        kv_offset = self._offset_tensor(self.kv_offset)

        def shifted_mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return inner(b, h, q_idx + q_offset, kv_idx + kv_offset)

        return shifted_mask


def _generic(m: HFMask) -> MaskSpec:
    """transformers' own mask function (at the step's offsets) and the padding as ``KeyPadding``:
    always exact. The padding stays a spec of its own so that every route reads it as one (an
    SDPA ``attn_mask``; on the compiled CPU flex kernel a copied buffer, where a cast fused into
    the kernel leaves Inductor no kernel choice)."""
    label = "transformers_mask"
    pattern: MaskSpec
    if maybe_true(m.q_offset != 0) or maybe_true(m.kv_offset != 0):
        pattern = ShiftedFunctionMask(
            fn=m.mask_function, label=label, q_offset=m.q_offset, kv_offset=m.kv_offset
        )
    else:
        pattern = FunctionMask(fn=m.mask_function, label=label)
    if m.padding is None:
        return pattern
    return pattern & KeyPadding(valid=_key_slice(m.padding, m))


# ---------------------------------------------------------------------------------------------
# Ready-made 4-D masks


def dense_mask_spec(mask: torch.Tensor) -> Dense:
    """A ready-made 4-D ``attention_mask`` as ``masks.Dense``: bool (True = attend), or float
    holding only 0 (attend) and values at or below half the dtype's minimum (transformers' "masked")."""
    if mask.dtype == torch.bool:
        return Dense(mask=mask)
    if not mask.is_floating_point():
        raise TypeError(f"4-D attention_mask must be bool or float, got {mask.dtype}")
    lowest = torch.finfo(mask.dtype).min
    blocked = mask <= lowest / 2
    if not bool(((mask == 0) | blocked).all()):
        raise ValueError(
            "4-D float attention_mask holds values other than 0 and the dtype's minimum (an additive "
            "bias); flexattn_zoo reads it as a mask only: pass a boolean mask, or the bias as "
            "score_mods.Bias through fz.attention"
        )
    return Dense(mask=~blocked)
