"""rope: rotary embedding ("rotate_half" layout, as mllmd/models/layers/rotary.py), optionally fused
with a per-head QK norm over head_dim: Qwen3's RMSNorm (mllmd/models/layers/norm.py) or Qwen3.5's
zero-centred one (rmsnorm_zero_centred).

One program per (token, block of up to 8 heads of q or of k): it reads each head's row once,
normalises it (if norm weights are given) and rotates it, rounding at the same points as the torch modules so that bf16/fp16 results
match them (up to fp32 rounding of the norm statistics).

Partial rotary (Qwen3.5): a cos/sin table narrower than head_dim rotates the first R (its width)
dims of each head; the other D - R dims pass through (normalised, when a norm is given, over all D).

Given the KV pool's layer caches and the tokens' slots, the k programs write the rotated k and the
token's v straight into the caches (what `store_cache` would do next, without its launch).
"""

from __future__ import annotations

import torch

from mllmd_kernels._triton import cdiv, next_pow2, pdl_args, pdl_sync, tl, triton
from mllmd_kernels.rmsnorm import rmsnorm_ref
from mllmd_kernels.rmsnorm_zero_centred import rmsnorm_zero_centred_ref


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_ref(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_cache: torch.Tensor,  # [P, R] fp32, R <= D
    sin_cache: torch.Tensor,  # [P, R] fp32
    q_norm_weight: torch.Tensor | None = None,  # [D]
    k_norm_weight: torch.Tensor | None = None,  # [D]
    eps: float = 1e-6,
    zero_centred_norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: optional per-head RMSNorm of q and k (the zero-centred one with
    `zero_centred_norm`), then RoPE at `positions` on the first R dims (the others pass through)."""
    norm = rmsnorm_zero_centred_ref if zero_centred_norm else rmsnorm_ref
    if q_norm_weight is not None:
        q = norm(q, q_norm_weight, eps)  # type: ignore[assignment]
    if k_norm_weight is not None:
        k = norm(k, k_norm_weight, eps)  # type: ignore[assignment]
    cos = cos_cache[positions].to(q.dtype).unsqueeze(1)  # [T, 1, R]
    sin = sin_cache[positions].to(q.dtype).unsqueeze(1)
    r = cos.shape[-1]
    if r == q.shape[-1]:
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def partial(x: torch.Tensor) -> torch.Tensor:
        rot = x[..., :r]
        return torch.cat((rot * cos + _rotate_half(rot) * sin, x[..., r:]), dim=-1)

    return partial(q), partial(k)


def rope_fp32_ref(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_cache: torch.Tensor,  # [P, D] fp32
    sin_cache: torch.Tensor,  # [P, D] fp32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of rope(..., round_products=False): the rotation in float32, one rounding."""
    cos = cos_cache[positions].unsqueeze(1)  # [T, 1, D]
    sin = sin_cache[positions].unsqueeze(1)
    qf, kf = q.float(), k.float()
    return (qf * cos + _rotate_half(qf) * sin).to(q.dtype), (kf * cos + _rotate_half(kf) * sin).to(k.dtype)


@triton.jit
def _rope_kernel(
    pos_ptr,  # [T] int64
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [T, Hkv, D]
    q_out_ptr,  # [T, Hq, D]
    k_out_ptr,  # [T, Hkv, D] (STORE_KV: the K cache [S, Hkv, D], row loc[t])
    v_ptr,  # [T, Hkv, D] (STORE_KV)
    v_cache_ptr,  # [S, Hkv, D] (STORE_KV)
    loc_ptr,  # [T] int64 cache slot of each token (STORE_KV)
    cos_ptr,  # [P, 2 * HALF] fp32
    sin_ptr,  # [P, 2 * HALF] fp32
    qw_ptr,  # [D] (HAS_NORM)
    kw_ptr,  # [D] (HAS_NORM)
    Hq,
    Hkv,
    HALF,  # half the rotary width R; D = 2 * HALF + PASS
    PASS,  # the dims after the rotary ones, which pass through (PASS_BLOCK)
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,  # STORE_KV: the K cache's slot stride
    stride_koh,
    stride_vt,
    stride_vh,
    stride_vc,  # the V cache's slot stride
    stride_cos,
    stride_sin,
    eps,
    HAS_NORM: tl.constexpr,
    ZERO_CENTRED: tl.constexpr,  # the norm is Qwen3.5's: x * rstd * (1 + w), rounded once
    STORE_KV: tl.constexpr,
    ROUND_PRODUCTS: tl.constexpr,  # each product rounded to the dtype (the text models) or one rounding (fp32)
    BLOCK_HEADS: tl.constexpr,
    BLOCK: tl.constexpr,
    PASS_BLOCK: tl.constexpr,  # >= PASS; 0: the rotary dims are the whole head (no pass-through code)
    USE_PDL: tl.constexpr,
):
    # Until the PDL wait below: only reads of what the kernel before this one (the qkv projection)
    # does not write: positions, slots, the cos/sin caches and the norm weights (see _triton.py).
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)  # head block: the first cdiv(Hq, BLOCK_HEADS) blocks are q heads, the rest k heads
    q_blocks = tl.cdiv(Hq, BLOCK_HEADS)
    if STORE_KV:
        slot = tl.load(loc_ptr + t)  # the token's row in the K and V caches
    if j < q_blocks:
        h0 = j * BLOCK_HEADS
        num_heads = Hq
        src = q_ptr + t * stride_qt
        src_h = stride_qh
        dst = q_out_ptr + t * stride_qot
        dst_h = stride_qoh
        w_ptr = qw_ptr
    else:
        h0 = (j - q_blocks) * BLOCK_HEADS
        num_heads = Hkv
        src = k_ptr + t * stride_kt
        src_h = stride_kh
        if STORE_KV:
            dst = k_out_ptr + slot * stride_kot
        else:
            dst = k_out_ptr + t * stride_kot
        dst_h = stride_koh
        w_ptr = kw_ptr
    heads = h0 + tl.arange(0, BLOCK_HEADS)  # [BLOCK_HEADS]
    offs = tl.arange(0, BLOCK)  # [BLOCK] within one half of head_dim
    mask_d = offs < HALF
    mask = (heads < num_heads)[:, None] & mask_d[None, :]  # [BLOCK_HEADS, BLOCK]
    src_ptrs = src + heads[:, None] * src_h + offs[None, :]
    dst_ptrs = dst + heads[:, None] * dst_h + offs[None, :]
    if PASS_BLOCK > 0:  # dims [2 * HALF, D) of each head
        offs_p = 2 * HALF + tl.arange(0, PASS_BLOCK)  # [PASS_BLOCK]
        mask_pd = tl.arange(0, PASS_BLOCK) < PASS
        mask_p = (heads < num_heads)[:, None] & mask_pd[None, :]
    pos = tl.load(pos_ptr + t)
    c1 = tl.load(cos_ptr + pos * stride_cos + offs, mask=mask_d, other=0.0)
    c2 = tl.load(cos_ptr + pos * stride_cos + HALF + offs, mask=mask_d, other=0.0)
    s1 = tl.load(sin_ptr + pos * stride_sin + offs, mask=mask_d, other=0.0)
    s2 = tl.load(sin_ptr + pos * stride_sin + HALF + offs, mask=mask_d, other=0.0)
    if HAS_NORM:
        w1 = tl.load(w_ptr + offs, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        if PASS_BLOCK > 0:
            wp = tl.load(w_ptr + offs_p, mask=mask_pd, other=0.0).to(tl.float32)[None, :]
        if ZERO_CENTRED:  # (1 + w) in float32, as the zero-centred norm applies its weight
            w1 = 1.0 + w1
            w2 = 1.0 + w2
            if PASS_BLOCK > 0:
                wp = 1.0 + wp
    pdl_sync(USE_PDL)
    x1 = tl.load(src_ptrs, mask=mask, other=0.0).to(tl.float32)  # first halves
    x2 = tl.load(src_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)  # second halves
    if PASS_BLOCK > 0:
        xp = tl.load(src + heads[:, None] * src_h + offs_p[None, :], mask=mask_p, other=0.0).to(tl.float32)
    if STORE_KV:
        if j >= q_blocks:  # the same heads of v, unchanged, into the V cache
            v_src = v_ptr + t * stride_vt + heads[:, None] * stride_vh + offs[None, :]
            v_dst = v_cache_ptr + slot * stride_vc + heads[:, None] * dst_h + offs[None, :]  # rows of D
            tl.store(v_dst, tl.load(v_src, mask=mask).to(v_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=mask).to(v_cache_ptr.dtype.element_ty), mask=mask)
            if PASS_BLOCK > 0:
                vp_src = v_ptr + t * stride_vt + heads[:, None] * stride_vh + offs_p[None, :]
                vp_dst = v_cache_ptr + slot * stride_vc + heads[:, None] * dst_h + offs_p[None, :]
                tl.store(vp_dst, tl.load(vp_src, mask=mask_p).to(v_cache_ptr.dtype.element_ty), mask=mask_p)
    if HAS_NORM:
        if PASS_BLOCK > 0:  # the statistics over the whole head
            var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xp * xp, axis=1)) / (2 * HALF + PASS)
        else:
            var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)  # [BLOCK_HEADS]
        rstd = tl.rsqrt(var + eps)[:, None]
        if ZERO_CENTRED:  # x * rstd * (1 + w), one rounding (the output dtype is q's)
            x1 = (x1 * rstd * w1).to(dst.dtype.element_ty).to(tl.float32)
            x2 = (x2 * rstd * w2).to(dst.dtype.element_ty).to(tl.float32)
            if PASS_BLOCK > 0:
                xp = (xp * rstd * wp).to(dst.dtype.element_ty).to(tl.float32)
        else:
            x1 = (x1 * rstd).to(src.dtype.element_ty).to(tl.float32)
            x2 = (x2 * rstd).to(src.dtype.element_ty).to(tl.float32)
            x1 = (w1 * x1).to(dst.dtype.element_ty).to(tl.float32)
            x2 = (w2 * x2).to(dst.dtype.element_ty).to(tl.float32)
            if PASS_BLOCK > 0:
                xp = (wp * (xp * rstd).to(src.dtype.element_ty).to(tl.float32)).to(dst.dtype.element_ty).to(tl.float32)
    if PASS_BLOCK > 0:  # not rotated
        tl.store(dst + heads[:, None] * dst_h + offs_p[None, :], xp.to(dst.dtype.element_ty), mask=mask_p)
    c1 = c1[None, :]  # [1, BLOCK]: the same shape in both branches below
    c2 = c2[None, :]
    s1 = s1[None, :]
    s2 = s2[None, :]
    if ROUND_PRODUCTS:
        c1 = c1.to(dst.dtype.element_ty).to(tl.float32)  # the torch module casts cos/sin first
        c2 = c2.to(dst.dtype.element_ty).to(tl.float32)
        s1 = s1.to(dst.dtype.element_ty).to(tl.float32)
        s2 = s2.to(dst.dtype.element_ty).to(tl.float32)
        # Round each product to the data type, as torch's q * cos + rotate_half(q) * sin does.
        a1 = (x1 * c1).to(dst.dtype.element_ty).to(tl.float32)
        b1 = (-x2 * s1).to(dst.dtype.element_ty).to(tl.float32)
        a2 = (x2 * c2).to(dst.dtype.element_ty).to(tl.float32)
        b2 = (x1 * s2).to(dst.dtype.element_ty).to(tl.float32)
    else:  # q.float() * cos + rotate_half(q.float()) * sin, rounded once (the vision tower's rotary)
        a1 = x1 * c1
        b1 = -x2 * s1
        a2 = x2 * c2
        b2 = x1 * s2
    tl.store(dst_ptrs, (a1 + b1).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst_ptrs + HALF, (a2 + b2).to(dst.dtype.element_ty), mask=mask)


def rope(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D] (any token and head strides, e.g. a view into a fused qkv output)
    k: torch.Tensor,  # [T, Hkv, D]
    cos_cache: torch.Tensor,  # [P, R] fp32 (R even, <= D: the rotary dims)
    sin_cache: torch.Tensor,  # [P, R] fp32
    q_norm_weight: torch.Tensor | None = None,  # [D]
    k_norm_weight: torch.Tensor | None = None,  # [D]
    eps: float = 1e-6,
    q_out: torch.Tensor | None = None,  # [T, Hq, D]; may be q itself (in place)
    k_out: torch.Tensor | None = None,
    kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    round_products: bool = True,
    zero_centred_norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton RoPE (+ QK-norm when both norm weights are given); same results as rope_ref.

    The rotation covers the first R dims (the tables' width) of each head, the rest pass through;
    `zero_centred_norm`: the norm weights are Qwen3.5's offsets from 1 (rmsnorm_zero_centred's numerics;
    the result then has q's dtype).

    `round_products=False`: the rotation in float32 with one rounding to the output dtype, as
    `rope_fp32_ref` (the vision tower's rotary), instead of each product rounded as the text models'
    torch code does it.

    `kv_cache` = (v [T, Hkv, D], k_cache [S, Hkv, D], v_cache, loc [T] int64): write the rotated k to
    k_cache[loc] and v to v_cache[loc] (as `store_cache` would) instead of returning k; the second
    result is then None. k_cache must have the dtype rope returns."""
    assert (q_norm_weight is None) == (k_norm_weight is None), "give both QK-norm weights or neither"
    t, hq, d = q.shape
    hkv = k.shape[1]
    r = cos_cache.shape[1]
    assert r % 2 == 0 and 0 < r <= d and sin_cache.shape[1] == r, f"rotary width {r} for head_dim {d}"
    assert k.shape[2] == d and q.stride(2) == 1 and k.stride(2) == 1
    has_norm = q_norm_weight is not None
    # RMSNorm's weight multiply promotes; the zero-centred norm rounds to q's dtype (type_as).
    promotes = has_norm and not zero_centred_norm
    out_dtype = torch.promote_types(q.dtype, q_norm_weight.dtype) if promotes else q.dtype  # type: ignore[union-attr]
    if q_out is None:
        q_out = torch.empty((t, hq, d), dtype=out_dtype, device=q.device)
    if kv_cache is not None:
        assert k_out is None, "give k_out or kv_cache, not both"
        v, k_cache, v_cache, loc = kv_cache
        assert k_cache.dtype == out_dtype, f"a {k_cache.dtype} K cache for {out_dtype} keys"
        assert v.shape == k.shape and v.stride(2) == 1 and loc.shape == (t,)
        for cache in (k_cache, v_cache):
            assert cache.shape[1:] == (hkv, d) and cache.stride(2) == 1 and cache.stride(1) == d, "cache rows must be contiguous"
        k_dst, v_strides, vc_stride = k_cache, (v.stride(0), v.stride(1)), v_cache.stride(0)
    else:
        if k_out is None:
            k_out = torch.empty((t, hkv, d), dtype=out_dtype, device=k.device)
        v, v_cache, loc, k_dst, v_strides, vc_stride = k, k, positions, k_out, (0, 0), 0
    if t == 0:
        return q_out, k_out
    qw = q_norm_weight if has_norm else cos_cache
    kw = k_norm_weight if has_norm else cos_cache
    half, passed = r // 2, d - r
    # Qwen3.5's launches (partial rotary, the zero-centred norm) round every product and sum as torch
    # does: without FP fusion, which would fold a rounded product into an FMA with the add after it
    # (one rounding fewer). The other launches keep Triton's default (their numbers as before).
    fusion = {} if not passed and not zero_centred_norm else {"enable_fp_fusion": False}
    block = next_pow2(half)
    pass_block = next_pow2(passed) if passed else 0
    width = max(block, pass_block)  # the widest tile of a head (the rotary halves, or the passed dims)
    block_heads = min(next_pow2(max(hq, hkv)), max(1, 512 // width))
    # one warp for the partial launch: at Qwen3.5-2B's shapes (2 heads of 256 a program) 13.3 us against
    # 21.1 with four at 2,048 tokens, the same at one token (H200)
    warps = 1 if passed else 4 if block_heads * width >= 512 else 1
    grid = (t, cdiv(hq, block_heads) + cdiv(hkv, block_heads))
    _rope_kernel[grid](
        positions, q, k, q_out, k_dst, v, v_cache, loc, cos_cache, sin_cache, qw, kw, hq, hkv, half, passed,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_dst.stride(0), k_dst.stride(1), *v_strides, vc_stride,
        cos_cache.stride(0), sin_cache.stride(0), eps,
        HAS_NORM=has_norm, ZERO_CENTRED=zero_centred_norm and has_norm, STORE_KV=kv_cache is not None,
        ROUND_PRODUCTS=round_products, BLOCK_HEADS=block_heads, BLOCK=block, PASS_BLOCK=pass_block,
        num_warps=warps, **fusion, **pdl_args(q),
    )  # fmt: skip
    return q_out, k_out
