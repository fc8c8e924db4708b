"""Prefix caches: matching, insert ownership, lock refs, LRU eviction, sizes, slot conservation."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from mllmd.engine.prefix_cache import ChunkCache, PrefixCache, RadixCache


class FakeAllocator:
    """Hands out fresh slot ids and records frees, failing on double or unknown frees."""

    def __init__(self) -> None:
        self.next_slot = 0
        self.freed: Counter[int] = Counter()
        self.calls = 0

    def alloc(self, n: int) -> torch.Tensor:
        out = torch.arange(self.next_slot, self.next_slot + n, dtype=torch.int64)
        self.next_slot += n
        return out

    def free(self, slots: torch.Tensor) -> None:
        self.calls += 1
        for s in slots.tolist():
            assert 0 <= s < self.next_slot, f"freed unknown slot {s}"
            assert self.freed[s] == 0, f"double free of slot {s}"
            self.freed[s] += 1

    def freed_set(self) -> set[int]:
        return set(self.freed)


def make_radix() -> tuple[RadixCache, FakeAllocator]:
    alloc = FakeAllocator()
    return RadixCache(alloc.free), alloc


def check_sizes(cache: PrefixCache) -> None:
    held = cache.held_slots()
    assert cache.evictable_size() + cache.protected_size() == cache.total_size() == held.numel()
    assert cache.evictable_size() >= 0 and cache.protected_size() >= 0
    assert len(set(held.tolist())) == held.numel(), "a slot is cached twice"


def insert_fresh(cache: PrefixCache, alloc: FakeAllocator, key: list[int]) -> torch.Tensor:
    """Insert ``key`` with fresh slots, freeing the caller's duplicates as the contract says."""
    value = alloc.alloc(len(key))
    n = cache.insert(key, value)
    if n:
        alloc.free(value[:n])
    return value


# ---- matching --------------------------------------------------------------------------------
def test_match_full_partial_mid_edge_and_none() -> None:
    cache, alloc = make_radix()
    v = insert_fresh(cache, alloc, [1, 2, 3, 4, 5])

    full = cache.match_prefix([1, 2, 3, 4, 5])
    assert full.indices.tolist() == v.tolist()
    longer = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert longer.indices.tolist() == v.tolist()

    mid = cache.match_prefix([1, 2, 3, 9])  # diverges inside the edge -> node split
    assert mid.indices.tolist() == v[:3].tolist()
    assert mid.last_node.key == (1, 2, 3)
    assert mid.indices.dtype == torch.int64

    short = cache.match_prefix([1, 2])  # key ends inside the (split) edge
    assert short.indices.tolist() == v[:2].tolist()
    assert short.last_node.key == (1, 2)

    none = cache.match_prefix([7, 1, 2])
    assert none.indices.numel() == 0 and none.indices.dtype == torch.int64
    assert none.last_node is cache.root
    assert cache.match_prefix([]).last_node is cache.root
    # splits never change what is cached
    assert cache.match_prefix([1, 2, 3, 4, 5]).indices.tolist() == v.tolist()
    check_sizes(cache)
    assert cache.total_size() == 5


def test_match_across_branches() -> None:
    cache, alloc = make_radix()
    a = insert_fresh(cache, alloc, [1, 2, 3, 4])
    b = alloc.alloc(5)
    assert cache.insert([1, 2, 7, 8, 9], b) == 2
    alloc.free(b[:2])
    assert cache.match_prefix([1, 2, 7, 8, 9]).indices.tolist() == a[:2].tolist() + b[2:].tolist()
    assert cache.match_prefix([1, 2, 3, 4]).indices.tolist() == a.tolist()
    assert cache.total_size() == 7
    check_sizes(cache)


# ---- insert ownership ------------------------------------------------------------------------
def test_insert_returns_cached_len_and_takes_only_the_suffix() -> None:
    cache, alloc = make_radix()
    assert cache.insert([1, 2, 3], alloc.alloc(3)) == 0
    v = alloc.alloc(6)
    n = cache.insert([1, 2, 3, 4, 5, 6], v)
    assert n == 3
    held = set(cache.held_slots().tolist())
    assert set(v[3:].tolist()) <= held and not set(v[:3].tolist()) & held
    alloc.free(v[:n])  # the caller's duplicates
    assert cache.total_size() == 6
    assert cache.flush() == 6
    assert alloc.freed_set() == set(range(alloc.next_slot))


def test_insert_fully_present_takes_nothing() -> None:
    cache, alloc = make_radix()
    insert_fresh(cache, alloc, [1, 2, 3, 4])
    before = cache.held_slots().tolist()
    v = alloc.alloc(4)
    assert cache.insert([1, 2, 3, 4], v) == 4
    w = alloc.alloc(2)
    assert cache.insert([1, 2], w) == 2  # ends mid-edge
    assert sorted(cache.held_slots().tolist()) == sorted(before)
    assert cache.insert([], alloc.alloc(0)) == 0
    check_sizes(cache)


def test_insert_copies_value_and_checks_length() -> None:
    cache, alloc = make_radix()
    v = alloc.alloc(3)
    cache.insert([1, 2, 3], v)
    v.fill_(-1)  # e.g. the caller's req_to_token row is reused
    assert cache.match_prefix([1, 2, 3]).indices.tolist() == [0, 1, 2]
    with pytest.raises(ValueError):
        cache.insert([1, 2], alloc.alloc(3))


# ---- lock refs -------------------------------------------------------------------------------
def test_lock_protects_node_and_ancestors() -> None:
    cache, alloc = make_radix()
    insert_fresh(cache, alloc, [1, 2, 3])
    insert_fresh(cache, alloc, [1, 2, 3, 4, 5])  # child of [1,2,3]
    insert_fresh(cache, alloc, [9, 9])
    m = cache.match_prefix([1, 2, 3, 4, 5])
    cache.inc_lock_ref(m.last_node)
    cache.inc_lock_ref(m.last_node)
    assert cache.protected_size() == 5 and cache.evictable_size() == 2
    check_sizes(cache)

    assert cache.evict(100) == 2  # only [9, 9]; the locked leaf and its ancestor stay
    assert cache.match_prefix([1, 2, 3, 4, 5]).indices.numel() == 5
    cache.dec_lock_ref(m.last_node)
    assert cache.evict(100) == 0 and cache.protected_size() == 5  # still one lock
    cache.dec_lock_ref(m.last_node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 5
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(m.last_node)
    assert cache.evict(100) == 5
    assert alloc.freed_set() == set(range(alloc.next_slot))


def test_lock_of_root_is_a_noop() -> None:
    cache, alloc = make_radix()
    m = cache.match_prefix([5])
    cache.inc_lock_ref(m.last_node)
    cache.dec_lock_ref(m.last_node)
    assert cache.protected_size() == 0


def test_split_keeps_locks_and_sizes_consistent() -> None:
    cache, alloc = make_radix()
    insert_fresh(cache, alloc, [1, 2, 3, 4, 5, 6])
    full = cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.inc_lock_ref(full.last_node)
    part = cache.match_prefix([1, 2, 3, 0])  # splits a locked node
    assert cache.protected_size() == 6 and cache.evictable_size() == 0
    insert_fresh(cache, alloc, [1, 2, 3, 7, 7])  # new unlocked branch under the split point
    assert cache.protected_size() == 6 and cache.evictable_size() == 2
    check_sizes(cache)
    cache.inc_lock_ref(part.last_node)
    cache.dec_lock_ref(full.last_node)
    assert cache.protected_size() == 3 and cache.evictable_size() == 5
    assert cache.evict(100) == 5
    cache.dec_lock_ref(part.last_node)
    assert cache.flush() == 3
    check_sizes(cache)
    assert alloc.freed_set() == set(range(alloc.next_slot))


# ---- eviction --------------------------------------------------------------------------------
def test_evicts_least_recently_used_first_and_match_refreshes() -> None:
    cache, alloc = make_radix()
    a = insert_fresh(cache, alloc, [1, 1])
    b = insert_fresh(cache, alloc, [2, 2])
    c = insert_fresh(cache, alloc, [3, 3])
    cache.match_prefix([1, 1])  # a is now the most recent
    assert cache.evict(1) == 2
    assert alloc.freed_set() == set(b.tolist())
    assert cache.evict(2) == 2
    assert alloc.freed_set() == set(b.tolist()) | set(c.tolist())
    assert cache.match_prefix([1, 1]).indices.tolist() == a.tolist()


def test_evicting_a_leaf_makes_its_parent_evictable() -> None:
    cache, alloc = make_radix()
    p = insert_fresh(cache, alloc, [1, 2])
    leaf = alloc.alloc(4)
    cache.insert([1, 2, 3, 4], leaf)
    alloc.free(leaf[:2])
    other = insert_fresh(cache, alloc, [5])  # newer than the [1,2] path
    assert cache.evict(3) == 4  # leaf (2, oldest), then its parent (2) before the newer [5]
    assert alloc.freed_set() == set(leaf.tolist()) | set(p.tolist())
    assert cache.held_slots().tolist() == other.tolist()


def test_evict_calls_free_once_per_call() -> None:
    cache, alloc = make_radix()
    for t in range(10):
        insert_fresh(cache, alloc, [t, t + 100, t + 200])
    calls = alloc.calls
    assert cache.evict(7) == 9  # whole leaves: 3 nodes of 3
    assert alloc.calls == calls + 1
    assert cache.evict(0) == 0 and alloc.calls == calls + 1  # nothing freed -> no call
    assert cache.flush() == 21 and alloc.calls == calls + 2
    assert cache.evict(5) == 0 and alloc.calls == calls + 2
    check_sizes(cache)


def test_flush_frees_only_unlocked() -> None:
    cache, alloc = make_radix()
    insert_fresh(cache, alloc, [1, 2, 3])
    insert_fresh(cache, alloc, [1, 2, 4, 5])
    insert_fresh(cache, alloc, [6])
    m = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(m.last_node)
    assert cache.flush() == 3  # [4, 5] and [6]
    assert cache.evictable_size() == 0 and cache.protected_size() == cache.total_size() == 3
    assert cache.match_prefix([1, 2, 3]).indices.numel() == 3
    cache.dec_lock_ref(m.last_node)
    assert cache.flush() == 3 and cache.total_size() == 0
    assert alloc.freed_set() == set(range(alloc.next_slot))


# ---- the scheduler protocol on both caches -------------------------------------------------
@pytest.mark.parametrize("cache_cls", [RadixCache, ChunkCache])
def test_scheduler_protocol_frees_every_slot_exactly_once(cache_cls: type[PrefixCache]) -> None:
    alloc = FakeAllocator()
    cache = cache_cls(alloc.free)
    prompts = [[1, 2, 3, 4], [1, 2, 3, 9, 9], [1, 2, 3, 4], [7], [1, 2]]
    running = []
    for key in prompts:  # all in flight at once: they race to insert the same prefixes
        m = cache.match_prefix(key)
        cache.inc_lock_ref(m.last_node)
        value = torch.cat([m.indices, alloc.alloc(len(key) - m.indices.numel())])
        running.append((key, m, value))
    for key, m, value in running:
        n = cache.insert(key, value)
        assert n >= m.indices.numel()
        alloc.free(value[m.indices.numel():n])
        cache.dec_lock_ref(m.last_node)
        check_sizes(cache)
    # a second wave reuses the cache (radix) or recomputes (chunk)
    for key in prompts:
        m = cache.match_prefix(key)
        assert m.indices.numel() == (len(key) if cache.enabled else 0)
        cache.inc_lock_ref(m.last_node)
        value = torch.cat([m.indices, alloc.alloc(len(key) - m.indices.numel())])
        n = cache.insert(key, value)
        alloc.free(value[m.indices.numel():n])
        cache.dec_lock_ref(m.last_node)
    cache.flush()
    assert cache.total_size() == 0
    assert alloc.freed_set() == set(range(alloc.next_slot))  # no leak (and FakeAllocator: no double free)


def test_chunk_cache_caches_nothing() -> None:
    alloc = FakeAllocator()
    cache = ChunkCache(alloc.free)
    assert not cache.enabled and RadixCache(alloc.free).enabled
    v = alloc.alloc(3)
    assert cache.insert([1, 2, 3], v) == 0
    assert alloc.freed_set() == {0, 1, 2} and alloc.calls == 1
    m = cache.match_prefix([1, 2, 3])
    assert m.indices.numel() == 0 and m.indices.dtype == torch.int64
    assert cache.evict(10) == cache.flush() == cache.total_size() == 0
    check_sizes(cache)


# ---- randomized property test against a brute-force model ----------------------------------
def _model_match(model: dict[tuple[int, ...], int], key: list[int]) -> list[int]:
    out = []
    for j in range(1, len(key) + 1):
        slot = model.get(tuple(key[:j]))
        if slot is None:
            break
        out.append(slot)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_random_operations_match_brute_force_model(seed: int) -> None:
    rng = random.Random(seed)
    cache, alloc = make_radix()
    model: dict[tuple[int, ...], int] = {}  # every cached prefix -> slot of its last token
    running: list[tuple[list[int], int, torch.Tensor, object]] = []  # key, prefix_len, value, node

    def rand_key() -> list[int]:
        return [rng.randrange(3) for _ in range(rng.randrange(0, 9))]

    def locked_prefixes() -> set[tuple[int, ...]]:
        return {tuple(k[:j]) for k, p, _, _ in running for j in range(1, p + 1)}

    def check() -> None:
        check_sizes(cache)
        assert cache.total_size() == len(model)
        assert cache.protected_size() == len(locked_prefixes())
        held = cache.held_slots().tolist()
        assert sorted(held) == sorted(model.values())
        owned = [s for k, p, v, _ in running for s in v[p:].tolist()]
        everything = held + owned + list(alloc.freed)
        assert sorted(everything) == list(range(alloc.next_slot))  # each slot in exactly one place

    for _ in range(250):
        op = rng.random()
        if op < 0.25:  # a request arrives: match, lock, allocate the rest
            key = rand_key()
            m = cache.match_prefix(key)
            assert m.indices.tolist() == _model_match(model, key)
            cache.inc_lock_ref(m.last_node)
            p = m.indices.numel()
            running.append((key, p, torch.cat([m.indices, alloc.alloc(len(key) - p)]), m.last_node))
        elif op < 0.45 and running:  # a request finishes: insert, free duplicates, unlock
            key, p, value, node = running.pop(rng.randrange(len(running)))
            expected = len(_model_match(model, key))
            assert model.get(tuple(key[:p]), None) == (value[p - 1].item() if p else None)
            n = cache.insert(key, value)
            assert n == expected and n >= p
            for j in range(n, len(key)):
                model[tuple(key[:j + 1])] = value[j].item()
            alloc.free(value[p:n])
            cache.dec_lock_ref(node)
        elif op < 0.55 and running:  # a request is aborted: free its own slots, unlock
            key, p, value, node = running.pop(rng.randrange(len(running)))
            alloc.free(value[p:])
            cache.dec_lock_ref(node)
        elif op < 0.7:  # a plain insert with fresh slots
            key = rand_key()
            expected = len(_model_match(model, key))
            value = insert_fresh(cache, alloc, key)
            for j in range(expected, len(key)):
                model[tuple(key[:j + 1])] = value[j].item()
        elif op < 0.85:  # a lookup
            key = rand_key()
            assert cache.match_prefix(key).indices.tolist() == _model_match(model, key)
        else:  # eviction (sometimes a flush)
            want = rng.randrange(0, 8) if rng.random() < 0.9 else 10**9
            evictable, calls = cache.evictable_size(), alloc.calls
            before = set(alloc.freed)
            freed = cache.evict(want)
            assert freed >= min(want, evictable) and freed <= evictable
            assert alloc.calls == calls + (1 if freed else 0)
            newly = set(alloc.freed) - before
            assert len(newly) == freed
            slot_to_prefix = {s: k for k, s in model.items()}
            gone = {slot_to_prefix[s] for s in newly}
            assert not gone & locked_prefixes()
            for k in gone:
                del model[k]
            assert all(k[:-1] in model for k in model if len(k) > 1), "eviction broke a prefix"
        check()

    for _, p, value, node in running:  # drain: abort the rest, then flush everything
        alloc.free(value[p:])
        cache.dec_lock_ref(node)
    running.clear()
    cache.flush()
    assert cache.total_size() == cache.protected_size() == 0
    assert sorted(alloc.freed) == list(range(alloc.next_slot))
    assert max(alloc.freed.values(), default=1) == 1


def test_extend_adds_below_a_locked_node_and_reports_what_was_cached() -> None:
    """`extend` (a running request's next chunk): the tokens after the request's node, the count another
    request cached first, the node that ends exactly after them (an edge split there), and the cache's
    slots of the whole chunk."""
    cache, alloc = make_radix()
    a = alloc.alloc(8)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], a)  # another request's prompt
    start = cache.match_prefix([1, 2]).last_node  # this request: 2 tokens matched at admission
    cache.inc_lock_ref(start)
    own = alloc.alloc(4)  # it computed tokens 3, 4, 5, 9
    had, node, slots = cache.extend(start, [3, 4, 5, 9], own)
    assert had == 3 and node.key == (9,) and slots.tolist() == a[2:5].tolist()
    assert cache.match_prefix([1, 2, 3, 4, 5, 9]).last_node is node
    cache.inc_lock_ref(node)
    cache.dec_lock_ref(start)
    assert cache.protected_size() == 6 and cache.total_size() == 9
    # a chunk that ends inside an edge splits it, so the node ends exactly there
    had, mid, slots = cache.extend(cache.root, [1, 2, 3, 4, 5, 6], alloc.alloc(6))
    assert had == 6 and mid.key[-1] == 6 and cache.match_prefix([1, 2, 3, 4, 5, 6]).last_node is mid
    assert slots.tolist() == a[:6].tolist()
    with pytest.raises(ValueError, match="2 tokens but 1 slots"):
        cache.extend(cache.root, [1, 2], alloc.alloc(1))
