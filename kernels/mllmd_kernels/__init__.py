"""mllmd's kernel library: each kernel sits beside its torch reference (used on CPU and in tests)."""

from mllmd_kernels.store_cache import store_cache, store_cache_ref

__all__ = ["store_cache", "store_cache_ref"]
