"""extend_attention: prefill with a cached prefix, over the paged KV pool.

Row b of the batch computes queries for positions [prefix_b, seq_len_b) (its extend_len_b new
tokens, stored at q[qo_start_b : qo_start_b + extend_len_b]); their K/V were already written to the
pool, so every key (prefix and new) is read through req_to_token, with a causal mask on positions.
Grid (B, Hq, cdiv(max_extend_len, BLOCK_M)); query head h reads KV head h // (Hq / Hkv).
A decode row is an extend of length 1, so mixed batches work unchanged.
Per query block, the key blocks that lie wholly before its first query position run without any
mask (most of a long prompt's work); only the blocks up to its last query are masked. Softmax is in
base 2 (the scale folded with log2(e)), and the last query blocks, which see the most keys, are
scheduled first so the short ones fill the tail.
"""

from __future__ import annotations

import torch

from mllmd_kernels._triton import cdiv, dot_in_fp32, next_pow2, tl, triton
from mllmd_kernels.tiling import max_shared_memory

LOG2E = 1.4426950408889634  # softmax in base 2: exp(x * scale) == exp2(x * scale * log2(e))
# 64 x 64 tiles at head_dim 256 take about 160 KiB of shared memory in two stages: Hopper's 227 KiB
# hold them, sm80 / sm87's 163 KiB do not (the CPU interpreter and the sm87 compile check stay small)
WIDE_HEAD_SMEM = 200 * 1024


def extend_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    req_to_token: torch.Tensor,  # [R, L] int64
    req_pool_indices: torch.Tensor,  # [B] int64
    seq_lens: torch.Tensor,  # [B] int64
    extend_lens: torch.Tensor,  # [B] int64
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Torch reference in fp32 (one row at a time)."""
    hq, hkv = q.shape[1], k_buffer.shape[1]
    out = torch.empty_like(q)
    start = 0
    for b in range(len(seq_lens)):
        n, e = int(seq_lens[b]), int(extend_lens[b])
        slots = req_to_token[int(req_pool_indices[b]), :n]
        k = k_buffer[slots].float().repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        v = v_buffer[slots].float().repeat_interleave(hq // hkv, dim=1)
        qb = q[start : start + e].float()  # [e, Hq, D]
        scores = torch.einsum("ehd,nhd->hen", qb, k) * scale  # [Hq, e, n]
        q_pos = torch.arange(n - e, n, device=q.device)
        causal = torch.arange(n, device=q.device)[None, :] <= q_pos[:, None]  # [e, n]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out[start : start + e] = torch.einsum("hen,nhd->ehd", probs, v).to(q.dtype)
        start += e
    return out


@triton.jit
def _attend_keys(
    acc, l_i, m_i, q, q_pos, lo, hi, k_ptr, v_ptr, slot_ptr, kv_off, stride_ks, stride_vs, offs_d, mask_d,
    qk_scale, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Online softmax over keys [lo, hi) in BLOCK_N steps (scores in log2 units: exp2). CAUSAL masks
    keys past each query's position and past hi; without it every key in [lo, hi) is visible to
    every query row (hi a multiple of BLOCK_N past lo), so no mask is computed at all."""
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if CAUSAL:
            mask_n = offs_n < hi
            slots = tl.load(slot_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
            kv_mask = mask_n[:, None] & mask_d[None, :]
        else:
            slots = tl.load(slot_ptr + offs_n).to(tl.int64)
            kv_mask = mask_d[None, :]
        k = tl.load(k_ptr + slots[:, None] * stride_ks + kv_off + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = qk * qk_scale
        if CAUSAL:
            visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
            qk = tl.where(visible, qk, float("-inf"))  # [BLOCK_M, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))  # finite: each row's first key block shows it a key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + slots[:, None] * stride_vs + kv_off + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _extend_attention_kernel(
    q_ptr,  # [T, Hq, D]
    o_ptr,  # [T, Hq, D]
    k_ptr,  # [S, Hkv, D]
    v_ptr,  # [S, Hkv, D]
    req_to_token_ptr,  # [R, L]
    req_pool_indices_ptr,  # [B]
    seq_lens_ptr,  # [B]
    extend_lens_ptr,  # [B]
    qo_start_ptr,  # [B] first row of each batch row's queries in q / o
    qk_scale,  # softmax scale * log2(e)
    D,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_rt,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.num_programs(2) - 1 - tl.program_id(2)  # the longest (last) query blocks start first
    ext_len = tl.load(extend_lens_ptr + b).to(tl.int32)
    if mb * BLOCK_M < ext_len:
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
        prefix = seq_len - ext_len
        row = tl.load(req_pool_indices_ptr + b).to(tl.int64)
        q_start = tl.load(qo_start_ptr + b).to(tl.int64)
        kv_off = (h // GROUP) * stride_kh
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] index within this row's new tokens
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < ext_len
        mask_d = offs_d < D
        q = tl.load(
            q_ptr + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :], other=0.0,
        )  # [BLOCK_M, BLOCK_D]
        if DOT_F32:
            q = q.to(tl.float32)
        q_pos = prefix + offs_m  # [BLOCK_M]
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        slot_ptr = req_to_token_ptr + row * stride_rt
        # Keys before the block's first query position are visible to all its rows: whole key
        # blocks of them go without a mask; the rest (up to the block's last query) are masked.
        full = (prefix + mb * BLOCK_M) // BLOCK_N * BLOCK_N
        end = tl.minimum(seq_len, prefix + (mb + 1) * BLOCK_M)
        acc, l_i, m_i = _attend_keys(
            acc, l_i, m_i, q, q_pos, 0, full, k_ptr, v_ptr, slot_ptr, kv_off, stride_ks, stride_vs, offs_d,
            mask_d, qk_scale, BLOCK_N, False, DOT_F32,
        )
        acc, l_i, m_i = _attend_keys(
            acc, l_i, m_i, q, q_pos, full, end, k_ptr, v_ptr, slot_ptr, kv_off, stride_ks, stride_vs, offs_d,
            mask_d, qk_scale, BLOCK_N, True, DOT_F32,
        )
        out = acc / l_i[:, None]
        tl.store(
            o_ptr + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
            out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :],
        )


def extend_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    req_to_token: torch.Tensor,  # [R, L] int64
    req_pool_indices: torch.Tensor,  # [B] int64
    seq_lens: torch.Tensor,  # [B] int64
    extend_lens: torch.Tensor,  # [B] int64
    qo_start: torch.Tensor,  # [B] int64 exclusive cumsum of extend_lens
    max_extend_len: int,  # host-side bound for the grid (e.g. max(extend_lens_cpu))
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    tiles: tuple[int, int, int, int] | None = None,  # (BLOCK_M, BLOCK_N, num_warps, num_stages) override
) -> torch.Tensor:
    """Causal attention of new tokens over prefix + new KV in the paged pool (Triton, no host sync)."""
    t, hq, d = q.shape
    hkv = k_buffer.shape[1]
    assert hq % hkv == 0 and q.stride(2) == 1 and k_buffer.stride(2) == 1 and v_buffer.stride(2) == 1
    if out is None:
        out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    bsz = seq_lens.shape[0]
    if t == 0 or bsz == 0 or max_extend_len == 0:
        return out
    block_d = max(16, next_pow2(d))
    dot_f32 = dot_in_fp32(q.dtype)
    if dot_f32:
        block_m, block_n = (32, 32) if block_d <= 128 else (16, 32)
    elif block_d <= 128 or (q.is_cuda and max_shared_memory(q) >= WIDE_HEAD_SMEM):
        block_m, block_n = 64, 64  # head_dim 256 too where its tiles fit (the sweep: NOTES.md)
    else:  # head_dim 256 on sm80 / sm87 (163 KiB a block)
        block_m, block_n = 32, 32
    num_warps, num_stages = 4, 2
    if tiles is not None:
        block_m, block_n, num_warps, num_stages = tiles
    block_m = min(block_m, max(16, next_pow2(max_extend_len)))
    grid = (bsz, hq, cdiv(max_extend_len, block_m))
    _extend_attention_kernel[grid](
        q, out, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, extend_lens, qo_start, scale * LOG2E, d,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        GROUP=hq // hkv, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DOT_F32=dot_f32,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
