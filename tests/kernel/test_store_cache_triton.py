"""The Triton store_cache path writes each new K/V row to its slot and nothing else."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import store_cache_triton
from mllmd_kernels.testing import DTYPES_WITH_FP32, kernel_device, on_gpu, skip_reason

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=skip_reason())

CASES = [(64, 1, 2, 16), (300, 37, 8, 128), (17, 17, 1, 64), (40, 5, 3, 24)]
if on_gpu():
    CASES += [(70000, 2048, 8, 128), (5000, 64, 8, 128)]


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize(("slots", "tokens", "heads", "dim"), CASES)
def test_store_cache_triton_writes_exactly_the_given_slots(dtype, slots, tokens, heads, dim) -> None:
    g = torch.Generator().manual_seed(slots * 1000 + tokens)
    poison = -12345.0
    k_cache = torch.full((slots, heads, dim), poison, dtype=dtype, device=DEVICE)
    v_cache = torch.full((slots, heads, dim), poison, dtype=dtype, device=DEVICE)
    loc = torch.randperm(slots, generator=g)[:tokens].to(DEVICE)
    # k/v as strided views into a fused qkv output, as the model produces them.
    # New K/V arrive in the cache dtype, so the copy must be exact.
    qkv = torch.randn(tokens, 3 * heads * dim, generator=g).to(device=DEVICE, dtype=dtype)
    k = qkv[:, heads * dim : 2 * heads * dim].view(tokens, heads, dim)
    v = qkv[:, 2 * heads * dim :].view(tokens, heads, dim)
    store_cache_triton(k_cache, v_cache, loc, k, v)
    assert torch.equal(k_cache[loc], k.to(dtype)) and torch.equal(v_cache[loc], v.to(dtype))
    untouched = torch.ones(slots, dtype=torch.bool, device=DEVICE)
    untouched[loc] = False
    assert (k_cache[untouched] == poison).all() and (v_cache[untouched] == poison).all()


@pytest.mark.skipif(not on_gpu(), reason="dispatch to Triton happens for CUDA tensors only")
def test_store_cache_dispatches_to_triton_on_cuda() -> None:
    from mllmd_kernels import store_cache, store_cache_ref

    g = torch.Generator().manual_seed(1)
    a = torch.randn(50, 2, 32, generator=g).cuda()
    b = a.clone()
    loc = torch.tensor([3, 7, 9], device="cuda")
    k = torch.randn(3, 2, 32, generator=g).cuda()
    store_cache(a, a.clone(), loc, k, k)
    store_cache_ref(b, b.clone(), loc, k, k)
    assert torch.equal(a, b)


def test_store_cache_triton_casts_to_the_cache_dtype() -> None:
    g = torch.Generator().manual_seed(2)
    k_cache = torch.zeros(20, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros(20, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    loc = torch.tensor([4, 1, 19], device=DEVICE)
    k = torch.randn(3, 2, 16, generator=g).to(DEVICE)
    v = torch.randn(3, 2, 16, generator=g).to(DEVICE)
    store_cache_triton(k_cache, v_cache, loc, k, v)
    torch.testing.assert_close(k_cache[loc], k.to(torch.bfloat16), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(v_cache[loc], v.to(torch.bfloat16), rtol=1e-2, atol=1e-2)
