"""``decode_step``'s DecodeMasks (:data:`CACHE`), kept per calling thread (:func:`_caller`).

A DecodeMask is state: each step's update writes it and that step's kernel reads it, so threads
never share one (see :func:`_caller`). Module state, one of each per process.
"""

from __future__ import annotations

import threading

from flexattn_zoo.lru import LRUCache
from flexattn_zoo.models.decode.mask import DecodeMask

#: DecodeMask objects kept by ``decode_step`` (least recently used dropped first); one per
#: (pattern, shape, calling thread), so a few threads with a few shapes each fit.
DECODE_CACHE_SIZE = 64
#: decode_step's DecodeMasks, keyed by pattern, shape, device *and calling thread* (see
#: :func:`_caller`).
CACHE: LRUCache[DecodeMask] = LRUCache(DECODE_CACHE_SIZE)

_THREAD = threading.local()


class _Caller:
    """One thread's share of :data:`CACHE` (stored in the cache keys, so never reused by a later
    thread the way a thread id can be)."""

    def __init__(self) -> None:
        self.thread = threading.current_thread().name

    def __repr__(self) -> str:
        return f"<decode caller {self.thread}>"


def _caller() -> _Caller:
    """The calling thread's key into :data:`CACHE`.

    Why per thread: a DecodeMask is *state*, written by each step's ``update`` and read by the
    kernel that step launches. Shared between threads, thread A's update could land between
    thread B's update and B's kernel, and B would attend with A's lengths (8 CPU threads with
    different cache lengths all got wrong outputs). Within one thread the steps are ordered:
    on the CPU every call finishes before the next starts; on CUDA the update and the kernel of a
    step are queued on the current stream, after the previous step's kernel. So each thread owns
    its masks, and no lock is held while a kernel runs. (One thread alternating streams for
    steps of one shape must order those streams itself, as for any tensor two streams share.)
    """
    caller = getattr(_THREAD, "caller", None)
    if caller is None:
        caller = _THREAD.caller = _Caller()
    return caller
