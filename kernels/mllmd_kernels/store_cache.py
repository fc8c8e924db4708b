"""store_cache: write one step's new K/V rows into the paged KV pool at their slot indices."""

from __future__ import annotations

import torch

from mllmd_kernels._triton import cdiv, next_pow2, pdl_args, pdl_sync, tl, triton, use_triton


def store_cache_ref(
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    loc: torch.Tensor,  # [T] int64 slot index of each new token
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
) -> None:
    """Torch reference: scatter rows of k/v into the caches (casting to the cache dtype)."""
    k_cache.index_copy_(0, loc, k.to(k_cache.dtype))
    v_cache.index_copy_(0, loc, v.to(v_cache.dtype))


@triton.jit
def _store_cache_kernel(
    k_cache_ptr,  # [S, Hkv, D]
    v_cache_ptr,  # [S, Hkv, D]
    loc_ptr,  # [T] int64
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    HD,  # Hkv * D (elements of one token's row)
    stride_kc,
    stride_vc,
    stride_k,
    stride_v,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < HD
    slot = tl.load(loc_ptr + t)
    k = tl.load(k_ptr + t * stride_k + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_v + offs, mask=mask)
    tl.store(k_cache_ptr + slot * stride_kc + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * stride_vc + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _flat_rows(t: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> [T, H * D] view when heads are contiguous within a token (else a copy)."""
    if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        t = t.contiguous()
    return t.as_strided((t.shape[0], t.shape[1] * t.shape[2]), (t.stride(0), 1))


def store_cache_triton(
    k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Triton scatter of k/v [T, Hkv, D] into rows `loc` of the caches (one program per token)."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    assert k_cache.stride(2) == 1 and k_cache.stride(1) == k_cache.shape[2], "cache rows must be contiguous"
    assert v_cache.stride(2) == 1 and v_cache.stride(1) == v_cache.shape[2], "cache rows must be contiguous"
    k2, v2 = _flat_rows(k), _flat_rows(v)
    hd = k2.shape[1]
    block = min(4096, next_pow2(hd))
    _store_cache_kernel[(num_tokens, cdiv(hd, block))](
        k_cache, v_cache, loc, k2, v2, hd, k_cache.stride(0), v_cache.stride(0), k2.stride(0), v2.stride(0),
        BLOCK=block, num_warps=4 if block >= 512 else 1, **pdl_args(k2),
    )


def store_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write new K/V rows: the Triton kernel on CUDA when Triton is installed, else the torch reference."""
    if use_triton(k_cache):
        store_cache_triton(k_cache, v_cache, loc, k, v)
    else:
        store_cache_ref(k_cache, v_cache, loc, k, v)
