"""Token-level (page size 1) radix tree over KV-slot indices, with lock refs and LRU eviction."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import torch

from mllmd.engine.prefix_cache.base import FreeSlotsFn, MatchResult, PrefixCache


class TreeNode:
    """One edge of the radix tree: a run of tokens and the slots that hold their KV."""

    __slots__ = ("id", "key", "value", "parent", "children", "lock_ref", "last_access_time")

    def __init__(self, node_id: int, key: tuple[int, ...], value: torch.Tensor,
                 parent: TreeNode | None, access_time: int) -> None:
        self.id = node_id
        self.key = key  # token ids of this edge
        self.value = value  # [len(key)] int64 slot indices
        self.parent = parent
        self.children: dict[int, TreeNode] = {}  # first token -> child
        self.lock_ref = 0
        self.last_access_time = access_time

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


def _common_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixCache(PrefixCache):
    """SGLang-style radix cache (see ``base`` for the ownership contract)."""

    enabled = True

    def __init__(self, free_slots: FreeSlotsFn, device: torch.device | str = "cpu") -> None:
        super().__init__(free_slots, device)
        self._ids = itertools.count()
        self._clock = itertools.count(1)  # monotonic LRU time
        self.reset()

    def reset(self) -> None:
        """Drop the whole tree WITHOUT freeing anything (the caller resets the KV pool too)."""
        self.root = TreeNode(next(self._ids), (), self._empty(), None, 0)
        self.root.lock_ref = 1  # the root is never evictable
        self._evictable = 0
        self._protected = 0
        self._total = 0
        self._leaves: set[TreeNode] = set()  # unlocked non-root nodes without children

    # ---- queries -------------------------------------------------------------------------
    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        _, node, values = self._walk(self.root, key, next(self._clock))
        indices = torch.cat(values) if values else self._empty()
        return MatchResult(indices=indices, last_node=node)

    def _walk(self, node: TreeNode, key: Sequence[int], now: int) -> tuple[int, TreeNode, list[torch.Tensor]]:
        """Follow `key` down from `node` as far as the tree has it, splitting the edge where it stops
        inside one: (tokens followed, the node that ends there, the slots of each edge passed)."""
        values: list[torch.Tensor] = []
        i = 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            n = _common_len(child.key, key[i:i + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            values.append(child.value)
            node = child
            i += n
        return i, node, values

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._total

    def held_slots(self) -> torch.Tensor:
        values, stack = [], [self.root]
        while stack:
            node = stack.pop()
            values.append(node.value)
            stack.extend(node.children.values())
        return torch.cat(values)

    # ---- mutation ------------------------------------------------------------------------
    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        if value.numel() != len(key):
            raise ValueError(f"insert: {len(key)} tokens but {value.numel()} slots")
        now = next(self._clock)
        node, i = self.root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            n = _common_len(child.key, key[i:i + len(child.key)])
            if n < len(child.key):
                if i + n == len(key):  # key ends inside this edge: nothing new to add
                    child.last_access_time = now
                    return len(key)
                child = self._split(child, n)
            child.last_access_time = now
            node = child
            i += n
        if i < len(key):
            self._add_leaf(node, tuple(key[i:]), value[i:].to(torch.int64, copy=True), now)
        return i

    def extend(self, node: TreeNode, key: Sequence[int], value: torch.Tensor) -> tuple[int, TreeNode, torch.Tensor]:
        """Insert `key` (the tokens that follow `node`'s path) with `value` below `node`, for a request
        that is still running. Returns (how many of key's tokens were cached already, the node that ends
        exactly after key, the cache's slots of those tokens): the caller frees its own slots of them
        and uses the cache's instead."""
        if value.numel() != len(key):
            raise ValueError(f"extend: {len(key)} tokens but {value.numel()} slots")
        now = next(self._clock)
        i, node, values = self._walk(node, key, now)
        cached = torch.cat(values) if values else self._empty()
        if i < len(key):
            node = self._add_leaf(node, tuple(key[i:]), value[i:].to(torch.int64, copy=True), now)
        return i, node, cached

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
                self._leaves.discard(node)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]  # only the root has no parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref on unlocked {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
                if not node.children:
                    self._leaves.add(node)
            node = node.parent  # type: ignore[assignment]  # only the root has no parent

    def evict(self, num_tokens: int) -> int:
        heap = [(n.last_access_time, n.id, n) for n in self._leaves]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            freed.append(node.value)
            num_freed += len(node.key)
            parent = self._delete_leaf(node)
            if parent in self._leaves:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        if freed:
            self.free_slots(torch.cat(freed))
        return num_freed

    def flush(self) -> int:
        return self.evict(self._evictable)

    # ---- tree surgery --------------------------------------------------------------------
    def _add_leaf(self, parent: TreeNode, key: tuple[int, ...], value: torch.Tensor, now: int) -> TreeNode:
        node = TreeNode(next(self._ids), key, value, parent, now)
        parent.children[key[0]] = node
        self._leaves.discard(parent)
        self._leaves.add(node)
        self._evictable += len(key)
        self._total += len(key)
        return node

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split ``child`` after its first ``n`` tokens; return the new upper node."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = TreeNode(next(self._ids), child.key[:n], child.value[:n].clone(), parent,
                         child.last_access_time)
        upper.lock_ref = child.lock_ref  # a lock on child covers its ancestors, so also upper
        upper.children[child.key[n]] = child
        parent.children[child.key[0]] = upper
        child.parent = upper
        child.key = child.key[n:]
        child.value = child.value[n:].clone()
        return upper

    def _delete_leaf(self, node: TreeNode) -> TreeNode:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        del parent.children[node.key[0]]
        self._leaves.discard(node)
        self._evictable -= len(node.key)
        self._total -= len(node.key)
        if parent is not self.root and not parent.children and parent.lock_ref == 0:
            self._leaves.add(parent)
        return parent
