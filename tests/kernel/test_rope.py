"""rope (+ fused QK-norm) against the model's RotaryEmbedding / RMSNorm numerics on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import rope, rope_fp32_ref, rope_ref, store_cache
from mllmd_kernels.testing import (
    DTYPES_WITH_FP32,
    close_tol,
    kernel_device,
    on_gpu,
    poisoned,
    randn,
    skip_reason,
)

from mllmd.models.layers.norm import RMSNorm
from mllmd.models.layers.rotary import RotaryEmbedding

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=skip_reason())

# (tokens, Hq, Hkv, head_dim)
SHAPES = [(1, 4, 2, 16), (9, 4, 4, 64), (5, 6, 2, 24), (3, 20, 4, 64)] + ([(1, 32, 8, 128), (2048, 32, 8, 128), (64, 16, 8, 128)] if on_gpu() else [])


def _rotary(head_dim: int) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, max_position=4096, base=1_000_000.0)


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_matches_reference(shape: tuple[int, int, int, int], dtype: torch.dtype, qk_norm: bool) -> None:
    t, hq, hkv, d = shape
    g = torch.Generator().manual_seed(t * 100 + hq * 10 + d + qk_norm)
    rot = _rotary(d).to(DEVICE)
    positions = torch.randint(0, 4096, (t,), generator=g).to(DEVICE)
    # q and k as strided views of one fused qkv row, as the model produces them.
    qkv = randn(t, (hq + 2 * hkv) * d, dtype=dtype, device=DEVICE, gen=g, scale=2.0)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    qw = kw = None
    if qk_norm:
        qw = randn(d, dtype=dtype, device=DEVICE, gen=g, scale=0.1) + 1
        kw = randn(d, dtype=dtype, device=DEVICE, gen=g, scale=0.1) + 1
    q_out, k_out = poisoned((t, hq, d), dtype, DEVICE), poisoned((t, hkv, d), dtype, DEVICE)
    got_q, got_k = rope(positions, q, k, rot.cos_cache, rot.sin_cache, qw, kw, 1e-6, q_out=q_out, k_out=k_out)
    assert not q_out.isnan().any() and not k_out.isnan().any(), "some outputs were never written"
    exp_q, exp_k = rope_ref(positions, q, k, rot.cos_cache, rot.sin_cache, qw, kw, 1e-6)
    torch.testing.assert_close(got_q, exp_q, **close_tol(dtype))
    torch.testing.assert_close(got_k, exp_k, **close_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_is_the_model_layers(dtype: torch.dtype) -> None:
    """rope_ref with norm weights is exactly q_norm/k_norm followed by the model's RotaryEmbedding."""
    g = torch.Generator().manual_seed(4)
    d = 32
    rot = _rotary(d)
    qn, kn = RMSNorm(d, 1e-6, dtype=dtype), RMSNorm(d, 1e-6, dtype=dtype)
    qn.weight.data.copy_(torch.randn(d, generator=g))
    kn.weight.data.copy_(torch.randn(d, generator=g))
    q, k = torch.randn(3, 4, d, generator=g).to(dtype), torch.randn(3, 2, d, generator=g).to(dtype)
    pos = torch.tensor([0, 17, 4000])
    exp_q, exp_k = rot(pos, qn(q), kn(k))
    got_q, got_k = rope_ref(pos, q, k, rot.cos_cache, rot.sin_cache, qn.weight, kn.weight, 1e-6)
    assert torch.equal(got_q, exp_q) and torch.equal(got_k, exp_k)


def test_rope_in_place() -> None:
    g = torch.Generator().manual_seed(6)
    rot = _rotary(64).to(DEVICE)
    q = randn(3, 4, 64, dtype=torch.float16, device=DEVICE, gen=g)
    k = randn(3, 2, 64, dtype=torch.float16, device=DEVICE, gen=g)
    pos = torch.tensor([1, 2, 3], device=DEVICE)
    exp_q, exp_k = rope_ref(pos, q, k, rot.cos_cache, rot.sin_cache)
    rope(pos, q, k, rot.cos_cache, rot.sin_cache, q_out=q, k_out=k)
    torch.testing.assert_close(q, exp_q, **close_tol(torch.float16))
    torch.testing.assert_close(k, exp_k, **close_tol(torch.float16))


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize("shape", SHAPES)
def test_rope_writes_k_and_v_into_the_kv_cache_like_store_cache(shape: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    """With kv_cache, the rotated k and the unchanged v land in the cache rows `loc`, bit for bit what
    rope followed by store_cache writes there; q is unchanged; no other cache row is touched."""
    t, hq, hkv, d = shape
    g = torch.Generator().manual_seed(t * 7 + hq + d)
    rot = _rotary(d).to(DEVICE)
    positions = torch.randint(0, 4096, (t,), generator=g).to(DEVICE)
    qkv = randn(t, (hq + 2 * hkv) * d, dtype=dtype, device=DEVICE, gen=g, scale=2.0)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    qw = randn(d, dtype=dtype, device=DEVICE, gen=g, scale=0.1) + 1
    kw = randn(d, dtype=dtype, device=DEVICE, gen=g, scale=0.1) + 1
    slots = t + 5
    loc = torch.randperm(slots, generator=g)[:t].to(DEVICE)
    k_cache, v_cache = poisoned((slots, hkv, d), dtype, DEVICE), poisoned((slots, hkv, d), dtype, DEVICE)
    exp_k_cache, exp_v_cache = k_cache.clone(), v_cache.clone()
    exp_q, exp_k = rope(positions, q, k, rot.cos_cache, rot.sin_cache, qw, kw, 1e-6)
    store_cache(exp_k_cache, exp_v_cache, loc, exp_k, v)
    got_q, got_k = rope(positions, q, k, rot.cos_cache, rot.sin_cache, qw, kw, 1e-6, kv_cache=(v, k_cache, v_cache, loc))
    assert got_k is None
    assert torch.equal(got_q, exp_q)
    assert torch.equal(k_cache[loc], exp_k_cache[loc]) and torch.equal(v_cache[loc], exp_v_cache[loc])
    assert torch.equal(k_cache[loc], exp_k) and torch.equal(v_cache[loc], v)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[loc.cpu()] = False
    assert k_cache[untouched.to(DEVICE)].isnan().all() and v_cache[untouched.to(DEVICE)].isnan().all()


def test_rope_kv_cache_needs_the_output_dtype() -> None:
    rot = _rotary(16).to(DEVICE)
    q, k = torch.zeros(1, 4, 16, device=DEVICE), torch.zeros(1, 2, 16, device=DEVICE)
    caches = torch.zeros(3, 2, 16, dtype=torch.float16, device=DEVICE)
    loc = torch.tensor([1], device=DEVICE)
    with pytest.raises(AssertionError, match="K cache"):
        rope(torch.tensor([0], device=DEVICE), q, k, rot.cos_cache, rot.sin_cache, kv_cache=(k, caches, caches, loc))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_rotation_rounds_once(dtype: torch.dtype) -> None:
    """round_products=False (the vision tower's rotary): q / k of a fused qkv row [N, 3, H, D] rotated in
    float32 by per-token cos / sin tables and rounded once, as rope_fp32_ref; and not what the
    per-product rounding of the text route gives (the flag changes the numerics it says it does)."""
    g = torch.Generator().manual_seed(11)
    n, h, d = 37, 4, 32
    qkv = randn(n, 3 * h * d, dtype=dtype, device=DEVICE, gen=g, scale=3.0).view(n, 3, h, d)
    q, k = qkv[:, 0], qkv[:, 1]
    angles = torch.rand(n, d // 2, generator=g) * 40
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(DEVICE) for f in (torch.cos, torch.sin))
    rows = torch.arange(n, device=DEVICE)
    got_q, got_k = rope(rows, q, k, cos, sin, round_products=False)
    exp_q, exp_k = rope_fp32_ref(rows, q, k, cos, sin)
    torch.testing.assert_close(got_q, exp_q, atol=0, rtol=2**-7 if dtype == torch.bfloat16 else 2**-10)
    torch.testing.assert_close(got_k, exp_k, atol=0, rtol=2**-7 if dtype == torch.bfloat16 else 2**-10)
    if dtype == torch.float16 or on_gpu():  # the interpreter's float32 -> bfloat16 cast is not round-to-nearest
        assert (got_q == exp_q).float().mean() > 0.99  # one rounding: equal but for rare fp32 ties
    rounded_q, _ = rope_ref(rows, q, k, cos, sin)
    assert (rounded_q != exp_q).any()
