"""Replays of the FA4 launches in torch's generated code for flex's ``BACKEND="FLASH"`` (route
``flex_flash``).

For a FLASH-backend ``flex_attention`` Inductor generates a kernel function that, on every call,
imports ``flash_attn.cute.interface._flash_attn_fwd`` (the backward: ``_flash_attn_bwd``),
defines its score and mask functions anew (each tagged with a ``__cute_hash__`` naming the
generated kernel) and calls FA4's launcher with the BlockMask's tensors and output tensors it
allocated. The launcher's Python then costs as much host time per call as in route ``fa4``.

:func:`install` replaces those two attributes of ``flash_attn.cute.interface`` with wrappers
that hand the calls made by Inductor's generated code (code loaded from Inductor's cache
directory) to :func:`flexattn_zoo.backends.fa4_replay.launch`: noted on the first call of a
kind, recorded and checked on the second, replayed from the third (that module's docstring
says what a recording may contain and how it is checked). Every other call -- FA4's own
functions, a user calling FA4 directly, a call with a function that carries no hash or an
argument that is not a plain value -- goes to FA4's launcher unchanged.

A kind is keyed by every tensor argument (:func:`~flexattn_zoo.backends.fa4_replay.tensor_key`:
shape, strides, dtype, device, alignment, ``requires_grad``), the arguments' structure with the
functions' hashes and the plain values in it, which arguments are the same tensor, and what FA4
reads from the process per call (as route ``fa4`` keys its calls). The generated code passes the
tensors the launcher writes (``out``/``lse``, ``dq``/``dk``/``dv``): a recording's check run
poisons them first and must write FA4's values into them again (the forward bit for bit, the
backward within the tolerance of its atomics).

``FLEXATTN_ZOO_FA4_REPLAY=0`` turns these replays off with route ``fa4``'s; the wrappers then
pass every call through.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from flexattn_zoo.backends import fa4_replay

#: The launchers torch's generated FLASH code calls, and whether a replay must match bit for bit
#: (the backward accumulates with atomics).
_LAUNCHERS = {"_flash_attn_fwd": True, "_flash_attn_bwd": False}

_LOCK = threading.Lock()


class _Unkeyable(Exception):
    pass


def _shape(value: Any, tensors: list[torch.Tensor]) -> Any:
    """A hashable picture of an argument, each tensor in it replaced by its key and collected
    (in order) into ``tensors``; raises :class:`_Unkeyable` for what a key cannot hold."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return fa4_replay.tensor_key(value)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_shape(v, tensors) for v in value))
    if isinstance(value, fa4_replay.PLAIN):
        return value
    if callable(value):
        cute_hash = getattr(value, "__cute_hash__", None)
        if not isinstance(cute_hash, str):
            raise _Unkeyable
        return ("fn", cute_hash, getattr(value, "__vec_size__", None))
    raise _Unkeyable


def _cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


class Replayed:
    """Stands in for one FA4 launcher (``inner``) in ``flash_attn.cute.interface``: calls from
    Inductor's generated code are replayed (module docstring), every other call is ``inner``'s.
    ``compile_cache`` is the launcher's own (FA4 reads it through the module attribute)."""

    def __init__(self, inner: Callable[..., Any], name: str, exact: bool) -> None:
        self.__wrapped__ = inner
        self.name = name
        self.exact = exact

    @property
    def compile_cache(self) -> Any:
        return self.__wrapped__.compile_cache  # type: ignore[attr-defined]

    @compile_cache.setter
    def compile_cache(self, value: Any) -> None:
        self.__wrapped__.compile_cache = value  # type: ignore[attr-defined]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inner = self.__wrapped__
        if not fa4_replay.enabled() or not sys._getframe(1).f_code.co_filename.startswith(_cache_dir()):
            return inner(*args, **kwargs)
        tensors: list[torch.Tensor] = []
        try:
            shape = _shape((args, tuple(sorted(kwargs.items()))), tensors)
        except _Unkeyable:
            return inner(*args, **kwargs)
        from flash_attn.cute import interface

        from flexattn_zoo.backends.fa4_op import process_key

        def call(*_inputs: torch.Tensor) -> Any:  # recorded with this call's own tensors
            return inner(*args, **kwargs)

        key = (self.name, shape, fa4_replay.identities(tensors), *process_key(interface))
        return fa4_replay.launch(key, interface, call, tensors, exact=self.exact)

    def __repr__(self) -> str:
        return f"Replayed({self.__wrapped__!r})"


def install() -> bool:
    """Wrap FA4's launchers in ``flash_attn.cute.interface`` (once; later calls do nothing).
    Returns whether they are wrapped (False: FA4 is not installed)."""
    try:
        from flash_attn.cute import interface
    except ImportError:
        return False
    with _LOCK:
        for name, exact in _LAUNCHERS.items():
            current = getattr(interface, name, None)
            if current is not None and not isinstance(current, Replayed):
                setattr(interface, name, Replayed(current, name, exact))
    return True


@torch.compiler.assume_constant_result
def installed() -> bool:
    """:func:`install`, run eagerly also while ``torch.compile`` traces a flex_flash call (a
    trace-time constant), so that the graph's generated code finds the wrappers at run time."""
    return install()


__all__ = ["Replayed", "install", "installed"]
