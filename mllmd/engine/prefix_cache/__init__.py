"""Prefix caches over KV-slot indices: ``RadixCache`` (enabled) and ``ChunkCache`` (disabled)."""

from __future__ import annotations

from mllmd.engine.prefix_cache.base import MatchResult, PrefixCache
from mllmd.engine.prefix_cache.chunk_cache import ChunkCache
from mllmd.engine.prefix_cache.hybrid_radix_cache import HybridRadixCache
from mllmd.engine.prefix_cache.radix_cache import RadixCache, TreeNode

__all__ = ["ChunkCache", "HybridRadixCache", "MatchResult", "PrefixCache", "RadixCache", "TreeNode"]
