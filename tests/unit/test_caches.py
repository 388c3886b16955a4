"""Caches are thread-safe LRUs with documented bounds (docs/caches.md):

* ``spec._MODS`` -- one ``mask_mod``/``score_mod`` function object per spec value (``MOD_CACHE_SIZE``);
* ``blockmask.CACHE`` -- built BlockMasks (``BLOCK_MASK_CACHE_SIZE``);
* ``compile.CACHE`` -- compiled flex entries, each with its own Dynamo cache (``COMPILE_CACHE_SIZE``);
* ``backends.varlen.CU_SEQLENS_CACHE`` -- cu_seqlens per (spec, batch, length, device).

Bounds are tested on fresh small instances swapped in with ``monkeypatch`` (so the session's real
caches, and the kernels compiled for other tests, are not evicted).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import flexattn_zoo as fz
from flexattn_zoo import blockmask, compile, masks, score_mods, spec
from flexattn_zoo.backends import flex as flex_backend
from flexattn_zoo.backends import varlen
from flexattn_zoo.lru import LRUCache
from flexattn_zoo.spec import MaskMod, MaskSpec, spec_dataclass
from flexattn_zoo.testing import assert_matches_reference


def _in_threads(fns: list[Callable[[], Any]]) -> list[Any]:
    """Run each fn in its own thread, released together; re-raise the first failure."""
    barrier = threading.Barrier(len(fns))
    results: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            barrier.wait()
            results[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - reported in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _sdpa_flags() -> tuple[bool, ...]:
    b = torch.backends.cuda
    return (b.flash_sdp_enabled(), b.math_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled())


WORKLOADS: dict[str, list[tuple[str, Any, Any]]] = {
    # (route, mask, score_mod); each thread has its own specs, so caches fill concurrently
    "a": [
        ("dense", masks.SlidingWindow(left=5) & masks.Causal(), score_mods.SoftCap(cap=4.0)),
        ("sdpa_math", masks.Causal(), None),
        ("sdpa_flash", None, None),
        ("flex_cpu", masks.SlidingWindow(left=9, right=1), None),
    ],
    "b": [
        ("dense", masks.Chunked(size=16) | masks.PrefixLM(prefix_len=3), score_mods.Alibi(num_heads=4)),
        ("sdpa_flash", masks.Causal(), None),
        ("sdpa_math", None, None),
        ("flex_cpu", masks.Chunked(size=16) & masks.Causal(), None),
    ],
}


def test_two_threads_with_different_specs_match_the_reference() -> None:
    flags = _sdpa_flags()

    def worker(name: str) -> list[tuple[Any, ...]]:
        g = torch.Generator().manual_seed(ord(name))
        done = []
        for _ in range(3):  # repeat so the threads overlap inside the same routes
            for route, mask, score in WORKLOADS[name]:
                q, k, v = (torch.randn(2, 4, 48, 16, generator=g) for _ in range(3))
                done.append(
                    (fz.attention(q, k, v, mask=mask, score_mod=score, backend=route), q, k, v, mask, score)
                )
        return done

    for results in _in_threads([lambda: worker("a"), lambda: worker("b")]):
        for out, q, k, v, mask, score in results:
            assert_matches_reference(out, q, k, v, mask=mask, score_mod=score)
    # sdpa_kernel flips process-global flags; our calls hold a lock so they are always restored.
    assert _sdpa_flags() == flags


def test_concurrent_sdpa_routes_leave_global_flags_as_they_were() -> None:
    """Without our lock, interleaved ``sdpa_kernel`` enter/exit pairs from threads pinning
    different kernels left flash attention disabled process-wide (measured)."""
    flags = _sdpa_flags()

    def hammer(route: str) -> None:
        q = torch.randn(1, 2, 16, 16)
        for _ in range(200):
            fz.attention(q, q, q, mask="causal", backend=route)

    _in_threads([lambda r=r: hammer(r) for r in ("sdpa_flash", "sdpa_math") * 2])  # type: ignore[misc]
    assert _sdpa_flags() == flags


def test_mod_cache_is_bounded_lru(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spec, "_MODS", LRUCache(4))
    mods = [masks.SlidingWindow(left=i).mask_mod() for i in range(10)]
    assert len(spec._MODS) == 4  # holds left=6..9
    assert masks.SlidingWindow(left=9).mask_mod() is mods[9]  # cached: the same object back
    # Touching an entry protects it: left=6 is the oldest, but used now, so 7 and 8 go first.
    assert masks.SlidingWindow(left=6).mask_mod() is mods[6]
    for i in (20, 21):
        masks.SlidingWindow(left=i).mask_mod()
    assert len(spec._MODS) == 4
    assert masks.SlidingWindow(left=6).mask_mod() is mods[6]
    assert masks.SlidingWindow(left=7).mask_mod() is not mods[7]  # evicted, rebuilt


def test_block_mask_cache_is_bounded_lru(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blockmask, "CACHE", LRUCache(3))
    first = fz.block_mask(masks.Causal(), 64, 64)
    for n in (80, 96, 112, 128, 144):
        fz.block_mask(masks.Causal(), n, n)
        assert len(blockmask.CACHE) <= 3
    assert fz.block_mask(masks.Causal(), 144, 144) is fz.block_mask(masks.Causal(), 144, 144)
    assert fz.block_mask(masks.Causal(), 64, 64) is not first  # evicted, rebuilt
    assert len(blockmask.CACHE) == 3


def test_compile_cache_is_bounded_lru(monkeypatch: pytest.MonkeyPatch) -> None:
    small = compile.CompileCache(2)
    monkeypatch.setattr(compile, "CACHE", small)
    monkeypatch.setattr(flex_backend, "CACHE", small)
    # get() only wraps with torch.compile (lazy): nothing is compiled here.
    mods = [masks.SlidingWindow(left=i).mask_mod() for i in range(5)]
    entries = [small.get(m, None, None, False, False) for m in mods]
    assert len(small) == 2
    assert small.get(mods[4], None, None, False, False) is entries[4]
    assert small.get(mods[0], None, None, False, False) is not entries[0]
    assert len(small) == 2


def test_compile_keys_compare_by_value_with_their_hash_kept() -> None:
    """Entry keys keep their hash (a caller looks its entry up on every call); two keys built
    from equal arguments are still equal, and any differing part still tells them apart."""
    mod = masks.SlidingWindow(left=3).mask_mod()
    shape = (2, 2, 16, torch.float32)
    first = compile.CACHE.key(mod, None, {"BLOCK_M": 16}, False, False, shape)
    second = compile.CACHE.key(
        masks.SlidingWindow(left=3).mask_mod(), None, {"BLOCK_M": 16}, False, False, shape
    )
    assert first is not second and first == second and hash(first) == hash(second)
    assert first != compile.CACHE.key(mod, None, {"BLOCK_M": 32}, False, False, shape)
    assert first != compile.CACHE.key(mod, None, {"BLOCK_M": 16}, True, False, shape)
    assert first != compile.CACHE.key(
        masks.SlidingWindow(left=4).mask_mod(), None, {"BLOCK_M": 16}, False, False, shape
    )


class _Capped:
    """A score_mod as a bound method reading a float attribute of its object."""

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def score(
        self, s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> Any:
        return self.cap * torch.tanh(s / self.cap)


#: Read by :func:`_global_capped` (a module global a score_mod reads).
_GLOBAL_CAP = 2.0


def _global_capped(
    s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
) -> Any:
    return _GLOBAL_CAP * torch.tanh(s / _GLOBAL_CAP)


def _default_capped(cap: float) -> Callable[..., Any]:
    def capped(s: Any, b: Any, h: Any, q: Any, kv: Any, cap: float = cap) -> Any:
        return cap * torch.tanh(s / cap)

    return capped


def test_compile_keys_hold_the_constants_a_mod_reads_however_it_reads_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Python value a mod reads is baked into its compiled graph, whether it comes from a
    closure cell, a default argument, a global or the object of a bound method. Mods that read
    different values share no compiled entry: sharing one, Dynamo recompiled it with the value
    made symbolic, which torch's CPU flex kernel cannot lower (an InductorError on the second
    mod's first call). Equal values still share one."""
    key = compile.mod_key
    assert key(_Capped(2.0).score) == key(_Capped(2.0).score)
    assert key(_Capped(2.0).score) != key(_Capped(0.5).score)
    assert key(_default_capped(2.0)) == key(_default_capped(2.0))
    assert key(_default_capped(2.0)) != key(_default_capped(0.5))
    before = key(_global_capped)
    monkeypatch.setattr(f"{__name__}._GLOBAL_CAP", 0.5)
    assert key(_global_capped) != before
    # Captured tensors still count by shape, dtype and device only (a new Document per step).
    assert masks.Document(doc_ids=torch.tensor([0, 0, 1, 1])).mask_mod() is not None
    assert key(masks.Document(doc_ids=torch.tensor([0, 0, 1, 1])).mask_mod()) == key(
        masks.Document(doc_ids=torch.tensor([0, 1, 1, 1])).mask_mod()
    )


_CYCLE: list[Any] = []
_CYCLE.append(_CYCLE)


def _reads_a_cyclic_global(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
    return score if _CYCLE else -score


def test_compile_keys_leave_out_what_a_mod_does_not_read_and_follow_deep_closures() -> None:
    """What must still share an entry: an attribute the mod never names (a step counter on the
    same object) stays out of the key, and a new per-step closure under many levels of composed
    closures keys like the last one. Self-referencing values key without recursing forever."""
    key = compile.mod_key
    capped = _Capped(2.0)
    before = key(capped.score)
    capped.step = 7  # an attribute score() never reads
    assert key(capped.score) == before

    def nested(ids: torch.Tensor) -> Any:
        def same_doc(b: Any, h: Any, q: Any, kv: Any) -> Any:
            return ids[q] == ids[kv]

        mod = same_doc
        for _ in range(compile.MOD_KEY_DEPTH + 2):
            mod = _and_causal(mod)
        return mod

    assert key(nested(torch.zeros(8))) == key(nested(torch.ones(8)))

    def recursive() -> Any:
        def mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
            return q >= kv if mod is not None else q < kv

        return mod

    assert key(recursive()) == key(recursive())
    assert key(_reads_a_cyclic_global) == key(_reads_a_cyclic_global)


def _and_causal(inner: Any) -> Any:
    def both(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return inner(b, h, q, kv) & (q >= kv)

    return both


def test_two_bound_method_score_mods_with_different_constants_run_on_flex_cpu() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    for cap in (2.0, 0.5):
        mod = _Capped(cap).score
        out = fz.attention(q, k, v, score_mod=mod, backend="flex_cpu")
        assert_matches_reference(out, q, k, v, score_mod=mod)


def test_cu_seqlens_cache_is_bounded_lru(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(varlen, "CU_SEQLENS_CACHE", LRUCache(2))
    doc = masks.Document.from_lengths([3, 5, 8])
    got = [varlen.cu_seqlens(doc, 2, 16, 16, "cpu") for _ in range(2)]
    assert got[0] is got[1]  # cached
    assert got[0].cu_q.tolist() == [0, 3, 8, 16, 19, 24, 32] and got[0].max_q == 8
    assert got[0].cu_k is got[0].cu_q and got[0].max_k == 8
    for n in (8, 12, 20, 24):
        varlen.cu_seqlens(masks.Chunked(size=4), 1, n, n, "cpu")
        assert len(varlen.CU_SEQLENS_CACHE) <= 2


@spec_dataclass
class SlowMask(MaskSpec):
    """Causal, but building its mask_mod takes a while: widens the window for races."""

    tag: int = 0

    def _make_mask_mod(self) -> MaskMod:
        time.sleep(0.05)

        def slow_causal(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return kv_idx <= q_idx

        return slow_causal

    def dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
        return torch.ones(q_len, kv_len, dtype=torch.bool).tril()[None, None]


def test_mask_mod_identity_is_stable_under_concurrent_get_or_create() -> None:
    # Eight threads ask for the mod of equal-but-distinct spec objects at the same moment; the
    # builders race, but everyone must get the one object that went into the cache.
    mods = _in_threads([lambda: SlowMask(tag=7).mask_mod() for _ in range(8)])
    assert all(m is mods[0] for m in mods)
    assert SlowMask(tag=7).mask_mod() is mods[0]
    # The same for BlockMasks and compiled entries built from it.
    bms = _in_threads([lambda: fz.block_mask(SlowMask(tag=7), 200, 200) for _ in range(6)])
    assert all(b is bms[0] for b in bms) and bms[0].mask_mod is mods[0]
    entries = _in_threads([lambda: compile.CACHE.get(mods[0], None, None, False, False) for _ in range(6)])
    assert all(e is entries[0] for e in entries)


def test_deterministic_mode_survives_overlapping_threads() -> None:
    from flexattn_zoo import _compat

    before = torch.are_deterministic_algorithms_enabled()
    seen: list[bool] = []

    def hold(delay: float) -> None:
        with _compat.deterministic_algorithms():
            time.sleep(delay)
            seen.append(torch.are_deterministic_algorithms_enabled())

    _in_threads([lambda d=d: hold(d) for d in (0.01, 0.05, 0.02, 0.08)])  # type: ignore[misc]
    assert seen == [True] * 4  # nobody switched it off under another thread
    assert torch.are_deterministic_algorithms_enabled() == before


def test_specs_with_different_tensors_do_not_share_hash_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new Document per step must not be compared against every cached one (a sync each on GPU)."""
    docs = [masks.Document(doc_ids=torch.arange(512) // (i + 2)) for i in range(60)]
    for d in docs:
        d.mask_mod()
    calls = []
    real = spec._values_equal
    monkeypatch.setattr(spec, "_values_equal", lambda a, b: calls.append(1) or real(a, b))
    fresh = masks.Document(doc_ids=torch.arange(512) // 97)
    fresh.mask_mod()
    assert len(calls) <= 2, len(calls)  # shape-only hashes compared it with all 60
    same = masks.Document(doc_ids=(torch.arange(512) // 2).clone())
    assert same.mask_mod() is docs[0].mask_mod()  # equal values still share one function object


def test_value_equal_specs_compare_tensor_contents_once_per_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cache lookups with a value-equal spec built anew must not read tensors (sync) every call."""
    import gc

    cached = masks.Document(doc_ids=torch.arange(512) // 7) & masks.Causal()
    fresh = masks.Document(doc_ids=(torch.arange(512) // 7).clone()) & masks.Causal()
    other = masks.Document(doc_ids=torch.arange(512) // 9) & masks.Causal()
    calls = []
    real = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: calls.append(1) or real(a, b))
    before = len(spec._EQ_MEMO)
    assert fresh == cached and cached == fresh and fresh == cached
    assert cached != other and other != cached
    assert len(calls) == 2, len(calls)  # one comparison per pair, remembered after
    remembered = len(spec._EQ_MEMO)
    assert remembered > before
    assert masks.Causal() == masks.Causal() and len(spec._EQ_MEMO) == remembered  # tensor-free: not kept
    del fresh, other
    gc.collect()
    assert len(spec._EQ_MEMO) == before  # verdicts leave with their specs


def test_pickled_specs_rehash_in_the_receiving_process() -> None:
    import pickle

    m = masks.Document.from_lengths([3, 5]) & masks.Causal()
    hash(m)  # caches the hash on the instance
    back = pickle.loads(pickle.dumps(m))
    assert "_hash_value" not in back.__dict__  # string hashes differ between processes
    assert back == m and hash(back) == hash(m)


def test_plan_cache_drops_an_entry_not_hit_since_the_last_sweep() -> None:
    """``plan_cache.PLANS`` is a ClockCache: bounded, and an entry hit since the sweep last passed
    it gets a second chance, so a model's hot call kinds outlive a burst of one-off calls."""
    from flexattn_zoo.lru import ClockCache

    cache: ClockCache[int] = ClockCache(4)
    for i in range(4):
        cache.put(i, i)
    assert cache.inserts == 4 and len(cache) == 4
    cache.put(4, 4)  # no entry was hit since its insert: the oldest, 0, is dropped
    assert cache.get(0) is None and len(cache) == 4
    assert cache.get(1) == 1  # hit: marked
    cache.put(5, 5)  # 1 is oldest but marked: moved to the newest end; 2 is dropped
    assert cache.get(1) == 1 and cache.get(2) is None
    for i in range(6, 30):
        cache.put(i, i)
        cache.get(1)  # a hot entry, hit between one-off inserts
        assert len(cache) <= 4
    assert cache.get(1) == 1
    assert cache.put(1, 99) == 1  # the first stored value wins
    assert cache.replace(1, 7) == 7 and cache.get(1) == 7
    assert len(cache.values()) == len(cache) and 7 in cache.values()
    cache.clear()
    assert len(cache) == 0 and cache.inserts == 0 and cache.get(1) is None


def test_plan_cache_keeps_repeated_calls_through_a_stream_of_one_off_keys() -> None:
    """Keys met once (a decode loop's ``fz.attention`` over a cache of a new length every step)
    come in unmarked, so they leave first: calls that repeat, each hit once per 8 inserts in a
    cache of 16, stay cached. When an insert counted as a use, every one-off key got a second
    chance and every repeated call missed."""
    from flexattn_zoo.lru import ClockCache

    cache: ClockCache[int] = ClockCache(16)
    repeated = [("repeated", i) for i in range(8)]
    for key in repeated:
        cache.put(key, 0)
    misses = 0
    for step in range(100):
        for i, key in enumerate(repeated):
            if cache.get(key) is None:
                misses += 1
                cache.put(key, 0)
            cache.put(("once", step, i), 0)
    assert misses == 0 and len(cache) == 16

    # A new key in a cache whose every entry was hit since the last sweep stays (the sweep
    # unmarks the others and drops the oldest of them, not the entry it was made room for).
    cache = ClockCache(16)
    for i in range(16):
        cache.put(i, i)
        cache.get(i)
    assert cache.put("new", -1) == -1 and cache.get("new") == -1
    assert len(cache) == 16 and cache.get(0) is None


def test_plan_cache_under_concurrent_hits_and_inserts() -> None:
    """Hits take no lock: threads reading while others insert and sweep never see a wrong value,
    an error, or more entries than the bound."""
    from flexattn_zoo.lru import ClockCache

    cache: ClockCache[tuple[int, int]] = ClockCache(32)
    errors: list[str] = []

    def reader(seed: int) -> None:
        for i in range(20000):
            key = (seed * 7 + i) % 100
            found = cache.get(key)
            if found is not None and found != (key, key * key):
                errors.append(f"{key}: {found}")

    def writer(seed: int) -> None:
        for i in range(5000):
            key = (seed * 13 + i * 3) % 100
            cache.put(key, (key, key * key))

    _in_threads([lambda s=s: reader(s) for s in range(3)] + [lambda s=s: writer(s) for s in range(3)])  # type: ignore[misc]
    assert not errors, errors[:5]
    assert len(cache) <= 32


def test_replace_stores_its_value_when_another_thread_stores_meanwhile() -> None:
    """``replace`` drops the old entry and stores the new one under one hold of the lock: a store
    by another thread between the two cannot win over it."""
    from flexattn_zoo.lru import ClockCache, LRUCache

    for cache in (ClockCache(4), LRUCache(4)):
        cache.put("k", "old")
        plain_put = cache.put
        others: list[threading.Thread] = []

        def put(key: str, value: str, plain_put=plain_put, others=others) -> str:  # type: ignore[no-untyped-def]
            other = threading.Thread(target=plain_put, args=(key, "other"))
            other.start()
            other.join(timeout=0.2)  # blocked on the lock while replace holds it
            others.append(other)
            return plain_put(key, value)

        cache.put = put  # type: ignore[method-assign]
        assert cache.replace("k", "new") == "new"
        for other in others:
            other.join()
        assert cache.get("k") == "new"
