"""A radix cache for hybrid models (Qwen3.5): KV per token, plus recurrent-state snapshots at nodes.

A request can reuse a cached prefix only if it can also start from the recurrent state after that
prefix: a node may hold a snapshot (a slot of the state pool with the state after the node's last
token), and a match is cut back to the deepest matched node that has one (SGLang's MambaRadixCache
design). Snapshots come from released requests: the state after everything they computed, and the
states they took at aligned positions while prefilling (so that a shared prefix longer than the
snapshot interval matches even when the requests diverge after it). Those taken while prefilling
enter the tree at once, with the KV before them (`Scheduler._cache_unfinished`), so a request that
arrives meanwhile with the same prefix hits them, and they are evictable like any other snapshot.

KV and snapshots are evicted apart: KV by the base class (LRU leaves; a deleted node's snapshot goes
with it), snapshots LRU over unlocked nodes (`evict_states`), leaving the node's KV as a "tombstone"
that longer matches may still pass through. A snapshot is locked from match until its copy into the
request's own slot has been enqueued (`lock_state` / `unlock_state`), so that making room for that
slot cannot evict it; with no other slot to be had, the request takes the snapshot's slot itself
(`take_state`).

Ownership of state slots: a slot given to `insert` belongs to the cache from then on, except those
`insert` returns (a node that already had a snapshot), which the caller frees; the cache frees its
slots through `free_states`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import torch

from mllmd.engine.prefix_cache.base import FreeSlotsFn, MatchResult
from mllmd.engine.prefix_cache.radix_cache import RadixCache, TreeNode, _common_len

FreeStatesFn = Callable[[list[int]], None]


class HybridRadixCache(RadixCache):
    def __init__(self, free_slots: FreeSlotsFn, free_states: FreeStatesFn, device: torch.device | str = "cpu") -> None:
        self.free_states = free_states
        self._state: dict[int, int] = {}  # node id -> snapshot slot
        self._state_nodes: dict[int, TreeNode] = {}
        self._state_locks: dict[int, int] = {}
        super().__init__(free_slots, device)

    def reset(self) -> None:
        super().reset()
        self._state, self._state_nodes, self._state_locks = {}, {}, {}

    @property
    def num_states(self) -> int:
        return len(self._state)

    # ---- queries -------------------------------------------------------------------------
    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        """The longest cached prefix that ends at a node with a snapshot (`MatchResult.state`)."""
        full = super().match_prefix(key)
        node: TreeNode = full.last_node
        path_len = int(full.indices.numel())
        while node is not self.root and node.id not in self._state:
            path_len -= len(node.key)
            assert node.parent is not None  # only the root has no parent
            node = node.parent
        state = self._state.get(node.id)
        if state is not None:
            node.last_access_time = next(self._clock)
        return MatchResult(indices=full.indices[:path_len], last_node=node, state=state)

    def lock_state(self, node: TreeNode) -> None:
        self._state_locks[node.id] = self._state_locks.get(node.id, 0) + 1

    def unlock_state(self, node: TreeNode) -> None:
        n = self._state_locks.get(node.id, 0) - 1
        if n < 0:
            raise RuntimeError(f"unlock_state on unlocked {node!r}")
        if n:
            self._state_locks[node.id] = n
        else:
            self._state_locks.pop(node.id, None)

    # ---- mutation ------------------------------------------------------------------------
    def insert_with_states(self, key: Sequence[int], value: torch.Tensor, states: Sequence[tuple[int, int]]) -> tuple[int, list[int]]:
        """`insert(key, value)`, then each (length, slot) of `states` becomes the snapshot of the node that
        ends after `length` tokens of key (split where needed). Returns (insert's result, the slots
        not kept because their node had a snapshot already: the caller frees them)."""
        n = self.insert(key, value)
        surplus = [slot for length, slot in states if not self.attach_state(self._node_at(key, length), slot)]
        return n, surplus

    def has_state(self, node: TreeNode) -> bool:
        """Whether `node` holds a snapshot."""
        return node.id in self._state

    def attach_state(self, node: TreeNode | None, slot: int) -> bool:
        """Make `slot` the snapshot of `node` (the state after its last token); False, and the slot stays
        the caller's, if the node already has one (or there is no such node)."""
        if node is None or node is self.root or node.id in self._state:
            return False
        self._state[node.id] = slot
        self._state_nodes[node.id] = node
        return True

    def _node_at(self, key: Sequence[int], length: int) -> TreeNode | None:
        """The node whose path ends exactly after key[:length] (splitting an edge there), or None."""
        if length <= 0 or length > len(key):
            return None
        node, i = self.root, 0
        while i < length:
            child = node.children.get(key[i])
            if child is None:
                return None
            n = _common_len(child.key, key[i : i + len(child.key)])
            if i + n > length:
                n = length - i
            if n < len(child.key):
                if n == 0:
                    return None
                child = self._split(child, n)
            node, i = child, i + n
        return node

    def take_state(self, node: TreeNode) -> int | None:
        """Detach `node`'s snapshot and hand its slot to the caller (who owns it from then on): a request
        that starts from this snapshot when no other slot can be had; the node keeps its KV."""
        slot = self._state.pop(node.id, None)
        if slot is not None:
            del self._state_nodes[node.id]
            self._state_locks.pop(node.id, None)
        return slot

    def evict_states(self, count: int) -> int:
        """Free up to `count` snapshot slots, least recently used unlocked nodes first."""
        heap = [(n.last_access_time, n.id, n) for nid, n in self._state_nodes.items() if nid not in self._state_locks]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < count and heap:
            _, nid, _ = heapq.heappop(heap)
            freed.append(self._state.pop(nid))
            del self._state_nodes[nid]
        if freed:
            self.free_states(freed)
        return len(freed)

    def flush(self) -> int:
        freed = super().flush()
        self.evict_states(len(self._state))
        return freed

    def _delete_leaf(self, node: TreeNode) -> TreeNode:
        slot = self._state.pop(node.id, None)
        if slot is not None:
            del self._state_nodes[node.id]
            self._state_locks.pop(node.id, None)
            self.free_states([slot])
        return super()._delete_leaf(node)
