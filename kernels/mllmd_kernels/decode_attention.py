"""decode_attention: one new query token per request attends to its whole KV history in the paged pool.

K/V rows are found through the request-to-token table: slot = req_to_token[req_pool_indices[b], pos].
Two stages (split-KV, as in SGLang/vLLM Triton decode):

* `_decode_attention_stage1_kernel`, grid (B, Hkv, NUM_SPLITS): each program takes one KV head and
  all of its GROUP = Hq / Hkv query heads (padded to BLOCK_H >= 16 rows for tl.dot), walks one
  split of the sequence with an online softmax and writes a normalised partial output and its
  log-sum-exp;
* `_decode_attention_stage2_kernel`, grid (B, Hq): merges the splits.

The split length is computed on the device from seq_lens (rounded up to BLOCK_N), so NUM_SPLITS is
the only launch parameter and the launch is CUDA-graph friendly; empty splits are skipped.

Two launches rather than one: a one-launch merge (the last split of each KV head to finish merging
the partials, as the split-K GEMM does) runs the merge serially in one program, where stage 2
spreads it over Hq programs, and was slower. RoPE stays a launch of its own: inside stage 1 the
step's own k must reach the pool before the split that holds it reads it, which lengthens that
program's chain more than the launch saves (PDL already hides most of a launch). These variants and
shorter tiles for short sequences, with their figures: NOTES.md.
"""

from __future__ import annotations

import torch

from mllmd_kernels._triton import cdiv, dot_in_fp32, next_pow2, pdl_args, pdl_sync, sm_count_for, tl, triton


def decode_attention_ref(
    q: torch.Tensor,  # [B, Hq, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    req_to_token: torch.Tensor,  # [R, L] int64
    req_pool_indices: torch.Tensor,  # [B] int64
    seq_lens: torch.Tensor,  # [B] int64
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    """Torch reference in fp32 (one request at a time)."""
    bsz, hq, d = q.shape
    hkv = k_buffer.shape[1]
    out = torch.empty_like(q)
    for b in range(bsz):
        n = int(seq_lens[b])
        slots = req_to_token[int(req_pool_indices[b]), :n]
        k = k_buffer[slots].float().repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        v = v_buffer[slots].float().repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale  # [Hq, n]
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out


@triton.jit
def _decode_attention_stage1_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [S, Hkv, D]
    v_ptr,  # [S, Hkv, D]
    req_to_token_ptr,  # [R, L]
    req_pool_indices_ptr,  # [B]
    seq_lens_ptr,  # [B]
    mid_o_ptr,  # [B, Hq, NUM_SPLITS, D] fp32
    mid_lse_ptr,  # [B, Hq, NUM_SPLITS] fp32
    scale,
    D,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_rt,
    GROUP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # Before the PDL wait (see _triton.py): the batch's lengths, rows and its first tile of slots. The
    # kernel before this one (RoPE or the K/V store) writes none of them; every kernel before that has
    # finished by the time this one starts.
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    row = tl.load(req_pool_indices_ptr + b).to(tl.int64)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    offs_first = start + tl.arange(0, BLOCK_N)
    first_slots = tl.load(req_to_token_ptr + row * stride_rt + offs_first, mask=offs_first < end, other=0).to(tl.int64)
    pdl_sync(USE_PDL)
    if start < end:
        offs_g = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask_g = offs_g < GROUP
        mask_d = offs_d < D
        heads = kvh * GROUP + offs_g  # [BLOCK_H] query heads of this KV head
        q = tl.load(
            q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_g[:, None] & mask_d[None, :], other=0.0,
        )  # [BLOCK_H, BLOCK_D]
        if DOT_F32:
            q = q.to(tl.float32)
        m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            first = offs_n < start + BLOCK_N  # all lanes in the first tile, none after
            slots = tl.load(req_to_token_ptr + row * stride_rt + offs_n, mask=mask_n & ~first, other=0)
            slots = tl.where(first, first_slots, slots.to(tl.int64))  # the first tile's: loaded before the wait
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_ptr + slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
            if DOT_F32:
                qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k))
            qk = tl.where(mask_n[None, :], qk * scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
            if DOT_F32:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        base = (b.to(tl.int64) * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split  # [BLOCK_H]
        tl.store(mid_o_ptr + base[:, None] * D + offs_d[None, :], acc / l_i[:, None], mask=mask_g[:, None] & mask_d[None, :])
        tl.store(mid_lse_ptr + base, m_i + tl.log(l_i), mask=mask_g)


@triton.jit
def _decode_attention_stage2_kernel(
    mid_o_ptr,  # [B, Hq, NUM_SPLITS, D] fp32
    mid_lse_ptr,  # [B, Hq, NUM_SPLITS] fp32
    seq_lens_ptr,  # [B]
    out_ptr,  # [B, Hq, D]
    amax_ptr,  # [B, Hq] float32 (WRITE_AMAX)
    D,
    stride_ob,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
    WRITE_AMAX: tl.constexpr = False,  # each program also stores max |output| of its head
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)  # before the PDL wait: stage 1 does not write it
    pdl_sync(USE_PDL)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, BLOCK_D)
    valid = (offs_s < NUM_SPLITS) & (offs_s * split_len < seq_len)  # [SPLITS_P2] non-empty splits
    base = (b.to(tl.int64) * tl.num_programs(1) + h) * NUM_SPLITS + offs_s
    lse = tl.load(mid_lse_ptr + base, mask=valid, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # seq_len 0 (a padded row): output zeros, not NaN
    w = tl.where(valid, tl.exp(lse - m), 0.0)  # [SPLITS_P2]
    o = tl.load(mid_o_ptr + base[:, None] * D + offs_d[None, :], mask=valid[:, None] & (offs_d < D)[None, :], other=0.0)
    acc = tl.sum(o * w[:, None], axis=0)  # [BLOCK_D]
    denom = tl.maximum(tl.sum(w, axis=0), 1e-30)
    o = (acc / denom).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, o, mask=offs_d < D)
    if WRITE_AMAX:  # of the stored values (masked lanes hold 0)
        tl.store(amax_ptr + b * tl.num_programs(1) + h, tl.max(tl.abs(o.to(tl.float32)), axis=0))


def decode_num_splits(batch_size: int, num_kv_heads: int, num_sms: int, max_splits: int = 32) -> int:
    """Splits per sequence so that B * Hkv * splits covers the SMs about twice (shape-only: graph safe)."""
    want = cdiv(2 * num_sms, max(1, batch_size * num_kv_heads))
    return max(1, min(max_splits, next_pow2(want)))


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    req_to_token: torch.Tensor,  # [R, L] int64
    req_pool_indices: torch.Tensor,  # [B] int64
    seq_lens: torch.Tensor,  # [B] int64 (0 allowed: output zeros)
    scale: float,
    out: torch.Tensor | None = None,  # [B, Hq, D]
    num_splits: int | None = None,
    mid_o: torch.Tensor | None = None,  # [B, Hq, num_splits, D] fp32 workspace (reused across layers)
    mid_lse: torch.Tensor | None = None,  # [B, Hq, num_splits] fp32
    out_amax: torch.Tensor | None = None,  # [B * Hq] fp32: each head's max |output| written here
    block_n: int | None = None,  # tiling overrides (benchmarks)
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Paged GQA decode attention in Triton; no host synchronisation."""
    bsz, hq, d = q.shape
    hkv = k_buffer.shape[1]
    assert hq % hkv == 0 and q.stride(2) == 1 and k_buffer.stride(2) == 1 and v_buffer.stride(2) == 1
    group = hq // hkv
    if out is None:
        out = torch.empty((bsz, hq, d), dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    if num_splits is None:
        num_splits = decode_num_splits(bsz, hkv, sm_count_for(q))
    if mid_o is None:
        mid_o = torch.empty((bsz, hq, num_splits, d), dtype=torch.float32, device=q.device)
    if mid_lse is None:
        mid_lse = torch.empty((bsz, hq, num_splits), dtype=torch.float32, device=q.device)
    block_d = max(16, next_pow2(d))
    if block_n is None:
        if block_d > 128 or q.dtype == torch.float32:
            block_n = 32
        else:  # long splits (few sequences, many splits each) stream best in 128-token tiles (H200 sweep)
            block_n = 128 if num_splits >= 4 else 64
    block_h = max(16, next_pow2(group))
    dot_f32 = dot_in_fp32(q.dtype)
    _decode_attention_stage1_kernel[(bsz, hkv, num_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse, scale, d,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        GROUP=group, NUM_SPLITS=num_splits, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, DOT_F32=dot_f32,
        num_warps=num_warps, num_stages=num_stages, **pdl_args(q),
    )
    assert out_amax is None or (out_amax.dtype == torch.float32 and out_amax.numel() >= bsz * hq), "out_amax [B * Hq]"
    _decode_attention_stage2_kernel[(bsz, hq)](
        mid_o, mid_lse, seq_lens, out, out_amax if out_amax is not None else mid_lse, d, out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, SPLITS_P2=max(2, next_pow2(num_splits)), BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=4 if block_d >= 128 else 1, WRITE_AMAX=out_amax is not None, **pdl_args(q),
    )
    return out
