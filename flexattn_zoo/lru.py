"""The bounded, thread-safe maps behind every cache of the library.

:class:`LRUCache` (least recently used dropped first) is used for mod identity (``spec``),
BlockMasks (``blockmask``), compiled flex entries (``compile``), varlen offsets
(``backends.varlen``) and decode masks (``decode``); :class:`ClockCache`, the same map with an
approximate recency order whose hits take no lock, for the dispatcher's plans (``plan_cache``),
read on every eager call. Each module documents its size. When two threads build the same key
at once, the first value stored wins and both get it, so identity-based reuse (mask_mod
objects, compiled kernels) stays stable.

While ``torch.compile`` traces a call, every cache is transparent: ``get`` misses and ``put``
stores nothing. Dynamo cannot enter a lock, and a traced call needs no cache: what it builds
(BlockMasks, mods) becomes part of the compiled graph, which Dynamo itself caches and guards.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from flexattn_zoo import _compat

V = TypeVar("V")
_MISSING = object()


class _BoundedCache(Generic[V]):
    """What both caches share: ``size`` entries at most in ``_data`` (a dict the subclass fills in
    its own order), a lock for writes; ``inserts`` counts new entries since the last ``clear()``
    (tests use it to prove a step built nothing)."""

    def __init__(self, size: int, data: Any) -> None:
        if size < 1:
            raise ValueError(f"LRU size must be >= 1, got {size}")
        self.size = size
        self.inserts = 0
        self._data: Any = data  # the subclass's dict (an OrderedDict, or key -> [value, flag])
        self._lock = threading.RLock()

    def get(self, key: Hashable) -> V | None:
        if _compat.is_compiling():
            return None  # see the module docstring: a traced call neither reads nor stores
        return self.get_eager(key)

    def get_eager(self, key: Hashable) -> V | None:
        """``get`` for a caller that has found already that no torch.compile trace is running
        (host time: the question costs as much as a hit)."""
        raise NotImplementedError

    def put(self, key: Hashable, value: V) -> V:
        raise NotImplementedError

    def replace(self, key: Hashable, value: V) -> V:
        """Store ``value`` under ``key`` even if one is cached (counts as an insert)."""
        if _compat.is_compiling():
            return value
        with self._lock:  # one hold (the lock is re-entrant): no other store lands in between
            self._data.pop(key, None)
            return self.put(key, value)

    def get_or_create(self, key: Hashable, make: Callable[[], V]) -> V:
        """The cached value, or ``make()`` stored and returned (built outside the lock)."""
        found = self.get(key)
        return found if found is not None else self.put(key, make())

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self.inserts = 0

    def __len__(self) -> int:
        return len(self._data)


class LRUCache(_BoundedCache[V]):
    """``size`` entries at most, least recently used dropped first."""

    def __init__(self, size: int) -> None:
        super().__init__(size, OrderedDict())

    def get_eager(self, key: Hashable) -> V | None:
        with self._lock:
            # Taken out and put back at the end under the caller's key (equal to the stored one):
            # one comparison of a new key with the stored one instead of two (``get`` then
            # ``move_to_end``; a spec in a key compares in Python), and a caller that passes the
            # same objects again (a spec it holds) finds them by identity next time.
            value = self._data.pop(key, _MISSING)
            if value is _MISSING:
                return None
            self._data[key] = value
            return value

    def put(self, key: Hashable, value: V) -> V:
        """Store ``value`` unless another thread stored one first; return the stored value."""
        if _compat.is_compiling():
            return value
        with self._lock:
            if key not in self._data:
                self._data[key] = value
                self.inserts += 1
            self._data.move_to_end(key)
            while len(self._data) > self.size:
                self._data.popitem(last=False)
            return self._data[key]

    def values(self) -> list[V]:
        with self._lock:
            return list(self._data.values())


class ClockCache(_BoundedCache[V]):
    """A bounded map like :class:`LRUCache` whose hits are a dict lookup and a flag write, without
    the lock: the CLOCK (second chance) approximation of least-recently-used. A hit marks its
    entry used; when an insert overflows ``size``, entries are examined oldest first, and a used
    one is unmarked and moved to the newest end instead of being dropped, so the entry dropped is
    one not hit since the previous sweep passed it. An entry comes in unmarked: keys met once
    (a generation loop's ``fz.attention`` over a cache whose length is new every step) then leave
    before any entry that was hit again, instead of each earning a second chance that pushes the
    repeated ones out. Writes (``put``, ``replace``, ``clear``) take
    the lock; a hit races only with them, and each single dict operation is atomic.

    A hit leaves the stored key in place, so later lookups compare against it: made for keys that
    compare in C, or whose Python-compared parts a caller passes again as the same objects
    (compared by identity). :class:`LRUCache` re-stores the caller's key on a hit instead."""

    def __init__(self, size: int) -> None:
        super().__init__(size, {})  # key -> [value, used since the last sweep]

    def get_eager(self, key: Hashable) -> V | None:
        entry = self._data.get(key)
        if entry is None:
            return None
        entry[1] = True
        return entry[0]

    def put(self, key: Hashable, value: V) -> V:
        """Store ``value`` unless another thread stored one first; return the stored value."""
        if _compat.is_compiling():
            return value
        with self._lock:
            entry = self._data.get(key)
            if entry is None:
                entry = self._data[key] = [value, False]
                self.inserts += 1
                self._sweep(entry)
            else:
                entry[1] = True
            return entry[0]

    def _sweep(self, new: list[Any]) -> None:
        """Drop entries, oldest first, until ``size`` are left; never ``new`` (the entry just put),
        which a sweep over a map whose every other entry was hit would otherwise reach first."""
        entries = self._data
        while len(entries) > self.size:
            oldest = next(iter(entries))
            entry = entries.pop(oldest)
            if entry[1] or entry is new:  # a second chance, at the newest end
                entry[1] = False
                entries[oldest] = entry
        # Each pass over a used entry unmarks it, so the loop ends within two rounds of the map.

    def values(self) -> list[V]:
        with self._lock:
            return [entry[0] for entry in self._data.values()]
