"""store_cache writes each new K/V row to its slot and nothing else (reference and dispatch)."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import store_cache, store_cache_ref


@pytest.mark.parametrize("fn", [store_cache_ref, store_cache])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("slots", "tokens", "heads", "dim"), [(64, 1, 2, 16), (300, 37, 8, 128), (17, 17, 1, 64)])
def test_store_cache_writes_exactly_the_given_slots(fn, dtype, slots, tokens, heads, dim) -> None:
    g = torch.Generator().manual_seed(slots * 1000 + tokens)
    poison = -12345.0
    k_cache = torch.full((slots, heads, dim), poison, dtype=dtype)
    v_cache = torch.full((slots, heads, dim), poison, dtype=dtype)
    loc = torch.randperm(slots, generator=g)[:tokens]
    k = torch.randn(tokens, heads, dim, generator=g)
    v = torch.randn(tokens, heads, dim, generator=g)
    fn(k_cache, v_cache, loc, k, v)
    torch.testing.assert_close(k_cache[loc], k.to(dtype))
    torch.testing.assert_close(v_cache[loc], v.to(dtype))
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[loc] = False
    assert (k_cache[untouched] == poison).all() and (v_cache[untouched] == poison).all()
