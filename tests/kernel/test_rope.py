"""rope (+ fused QK-norm) against the model's RotaryEmbedding / RMSNorm numerics on fresh random inputs;
Qwen3.5's partial rotary with its zero-centred QK norm against the torch route."""

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

from mllmd.models.layers.norm import RMSNorm, ZeroCentredRMSNorm
from mllmd.models.layers.rotary import RopeTable, RotaryEmbedding, apply_rope

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


# Partial rotary (Qwen3.5): (tokens, Hq, Hkv, head_dim, rotary width R)
PARTIAL_SHAPES = [(1, 4, 2, 32, 8), (5, 8, 2, 256, 64), (3, 6, 2, 32, 8), (2, 3, 1, 40, 24)]
if on_gpu():
    PARTIAL_SHAPES += [(1, 8, 2, 256, 64), (1, 16, 4, 256, 64), (2048, 8, 2, 256, 64), (64, 16, 4, 256, 64)]
NORMS = [None, "rms", "zero_centred"]


def _partial_inputs(
    shape: tuple[int, int, int, int, int], dtype: torch.dtype, norm: str | None, seed: int
) -> tuple[torch.Tensor, ...]:
    """Per-token cos / sin rows of width R (M-RoPE's tables: row t for token t), and q / k / v as the
    views Qwen3.5's fused qkv output gives: q the first half of each head's [query | gate] slice."""
    t, hq, hkv, d, r = shape
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(t, r // 2, generator=g) * 100
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(DEVICE) for f in (torch.cos, torch.sin))
    qkv = randn(t, (2 * hq + 2 * hkv) * d, dtype=dtype, device=DEVICE, gen=g, scale=2.0)
    q_gate, k, v = qkv.split([2 * hq * d, hkv * d, hkv * d], dim=-1)
    q = q_gate.view(t, hq, 2 * d)[..., :d]  # head stride 2 * D
    k, v = k.view(t, hkv, d), v.view(t, hkv, d)
    qw = kw = torch.empty(0)
    if norm == "rms":
        qw, kw = (randn(d, dtype=dtype, device=DEVICE, gen=g, scale=0.1) + 1 for _ in range(2))
    elif norm == "zero_centred":  # offsets from 1, as stored
        qw, kw = (randn(d, dtype=dtype, device=DEVICE, gen=g, scale=0.3) for _ in range(2))
    rows = torch.arange(t, device=DEVICE)
    return rows, q, k, v, cos, sin, qw, kw


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize("shape", PARTIAL_SHAPES)
@pytest.mark.parametrize("norm", NORMS)
def test_partial_rope_matches_reference(shape: tuple[int, int, int, int, int], dtype: torch.dtype, norm: str | None) -> None:
    """The first R dims rotated, the other D - R passed through (normalised over all D with a norm)."""
    rows, q, k, _, cos, sin, qw, kw = _partial_inputs(shape, dtype, norm, seed=sum(shape) + NORMS.index(norm))
    t, hq, hkv, d, _ = shape
    weights = (qw, kw) if norm else (None, None)
    zc = norm == "zero_centred"
    q_out, k_out = poisoned((t, hq, d), dtype, DEVICE), poisoned((t, hkv, d), dtype, DEVICE)
    got_q, got_k = rope(rows, q, k, cos, sin, *weights, 1e-6, q_out=q_out, k_out=k_out, zero_centred_norm=zc)
    assert not q_out.isnan().any() and not k_out.isnan().any(), "some outputs were never written"
    exp_q, exp_k = rope_ref(rows, q, k, cos, sin, *weights, 1e-6, zero_centred_norm=zc)
    torch.testing.assert_close(got_q, exp_q, **close_tol(dtype))
    torch.testing.assert_close(got_k, exp_k, **close_tol(dtype))
    if norm is None:  # the passed dims are copies; rotated ones are exact wherever the casts round (not bf16 in the interpreter)
        assert torch.equal(got_q[..., shape[4]:], q[..., shape[4]:]) and torch.equal(got_k[..., shape[4]:], k[..., shape[4]:])
        if dtype != torch.bfloat16 or on_gpu():
            assert torch.equal(got_q, exp_q) and torch.equal(got_k, exp_k)


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize("shape", PARTIAL_SHAPES)
def test_partial_rope_is_the_zero_centred_torch_route(shape: tuple[int, int, int, int, int], dtype: torch.dtype) -> None:
    """Qwen3.5's attention: the kernel gives what ZeroCentredRMSNorm (its Triton kernel on a GPU) then
    apply_rope give, bit for bit but for the norm statistics' float32 summation order: in fp16 and
    bf16 (on a GPU) all but a rare element equal, none off by more than one unit in the last place."""
    rows, q, k, _, cos, sin, qw, kw = _partial_inputs(shape, dtype, "zero_centred", seed=3 * sum(shape))
    qn, kn = ZeroCentredRMSNorm(shape[3], 1e-6, dtype=dtype).to(DEVICE), ZeroCentredRMSNorm(shape[3], 1e-6, dtype=dtype).to(DEVICE)
    qn.weight.data.copy_(qw)
    kn.weight.data.copy_(kw)
    exp_q, exp_k = apply_rope(RopeTable(cos, sin, rows), qn(q), kn(k))
    got_q, got_k = rope(rows, q, k, cos, sin, qw, kw, 1e-6, zero_centred_norm=True)
    assert got_q.dtype == dtype and got_k is not None and got_k.dtype == dtype
    if dtype == torch.bfloat16 and not on_gpu():  # the interpreter truncates float32 -> bfloat16
        torch.testing.assert_close(got_q, exp_q, **close_tol(dtype))
        return
    for got, exp in ((got_q, exp_q), (got_k, exp_k)):
        if dtype == torch.float32:
            torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)
            continue
        differ = got != exp
        assert differ.float().mean() <= 1e-3, f"{int(differ.sum())} of {got.numel()} differ"
        ulp = torch.finfo(dtype).eps * exp.float().abs().clamp_min(1.0)
        assert ((got.float() - exp.float()).abs() <= ulp).all()


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize("shape", PARTIAL_SHAPES)
@pytest.mark.parametrize("norm", [None, "zero_centred"])
def test_partial_rope_writes_all_of_k_and_v_into_the_kv_cache(
    shape: tuple[int, int, int, int, int], dtype: torch.dtype, norm: str | None
) -> None:
    """With kv_cache and partial rotary, all D dims of the rotated k (its passed dims too) and of v land
    in the cache rows `loc` (random slots), bit for bit what rope followed by store_cache writes."""
    rows, q, k, v, cos, sin, qw, kw = _partial_inputs(shape, dtype, norm, seed=5 * sum(shape) + (norm is None))
    t, _, hkv, d, _ = shape
    weights = (qw, kw) if norm else (None, None)
    zc = norm == "zero_centred"
    g = torch.Generator().manual_seed(t + d)
    slots = 2 * t + 5
    loc = torch.randperm(slots, generator=g)[:t].to(DEVICE)
    k_cache, v_cache = poisoned((slots, hkv, d), dtype, DEVICE), poisoned((slots, hkv, d), dtype, DEVICE)
    exp_k_cache, exp_v_cache = k_cache.clone(), v_cache.clone()
    exp_q, exp_k = rope(rows, q, k, cos, sin, *weights, 1e-6, zero_centred_norm=zc)
    store_cache(exp_k_cache, exp_v_cache, loc, exp_k, v)
    got_q, got_k = rope(rows, q, k, cos, sin, *weights, 1e-6, kv_cache=(v, k_cache, v_cache, loc), zero_centred_norm=zc)
    assert got_k is None and torch.equal(got_q, exp_q)
    assert torch.equal(k_cache[loc], exp_k) and torch.equal(v_cache[loc], v)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[loc.cpu()] = False
    assert k_cache[untouched.to(DEVICE)].isnan().all() and v_cache[untouched.to(DEVICE)].isnan().all()


def test_partial_rope_in_place() -> None:
    """q_out = q: the passed dims stay, the rotated ones are rotated (the model's in-place use)."""
    rows, q, k, _, cos, sin, _, _ = _partial_inputs((3, 4, 2, 32, 8), torch.float16, None, seed=9)
    q, k = q.clone(), k.clone()
    exp_q, exp_k = rope_ref(rows, q, k, cos, sin)
    rope(rows, q, k, cos, sin, q_out=q, k_out=k)
    assert torch.equal(q, exp_q) and torch.equal(k, exp_k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_partial_reference_is_the_model_layers(dtype: torch.dtype) -> None:
    """rope_ref with zero-centred norm weights and a narrow table is exactly Qwen3.5's torch route:
    ZeroCentredRMSNorm (its reference on the CPU) then apply_rope."""
    g = torch.Generator().manual_seed(8)
    d, r = 32, 8
    qn, kn = ZeroCentredRMSNorm(d, 1e-6, dtype=dtype), ZeroCentredRMSNorm(d, 1e-6, dtype=dtype)
    qn.weight.data.copy_(torch.randn(d, generator=g) * 0.3)
    kn.weight.data.copy_(torch.randn(d, generator=g) * 0.3)
    q, k = torch.randn(3, 4, d, generator=g).to(dtype), torch.randn(3, 2, d, generator=g).to(dtype)
    angles = torch.rand(3, r // 2, generator=g) * 50
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    rows = torch.arange(3)
    exp_q, exp_k = apply_rope(RopeTable(cos, sin, rows), qn(q), kn(k))
    got_q, got_k = rope_ref(rows, q, k, cos, sin, qn.weight, kn.weight, 1e-6, zero_centred_norm=True)
    assert torch.equal(got_q, exp_q) and torch.equal(got_k, exp_k)
    assert torch.equal(got_q[..., r:], qn(q)[..., r:])  # the passed dims: normalised, not rotated
