"""causal_conv1d: the Gated DeltaNet's depthwise causal conv over time, with its state kept in a pool.

A GDN layer convolves the fused q|k|v projection (C = conv_dim channels) with a width-K kernel per
channel (K = linear_conv_kernel_dim = 4 for Qwen3.5) and applies SiLU. The state a request carries
between prefill chunks and decode steps is the last K-1 pre-conv inputs of every channel, kept in
the layer's pool `conv_state [num_slots, C, K-1]` (model dtype; column K-2 is the newest input, as
transformers' `conv_state`), indexed by the request's slot; slot 0 is the engine's dummy for padded
CUDA-graph rows.

Numerics as transformers' `causal_conv1d_fn` / `causal_conv1d_update`: products summed in float32
(plus the bias), rounded to the output dtype, then SiLU in float32 and rounded again.

* `causal_conv1d_prefill`: varlen tokens (sequences concatenated, `cu_seqlens`); each sequence's
  history before its first token is its slot's K-1 columns when `has_initial_state`, else zeros.
  Two launches: the conv (grid over token tiles and channel blocks), then the state write-back (one
  program per sequence and channel block), so that no program overwrites a slot another one still
  reads. A sequence shorter than K-1 shifts its old state by its length.
* `causal_conv1d_decode`: one token per row, the state shifted in place; one launch whose grid
  depends only on the shapes (CUDA-graph safe). Rows that share a slot (padded rows at slot 0)
  race on it: only that slot's contents are then undefined.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mllmd_kernels._triton import cdiv, next_pow2, pdl_args, pdl_sync, tl, triton


def _conv_silu_ref(hist: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None) -> torch.Tensor:
    """Full depthwise conv of hist [C, K-1 + L] (history then inputs), the last L outputs; as transformers."""
    c, k = weight.shape
    out = F.conv1d(hist.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), bias, padding=0, groups=c)[0]  # [C, L]
    if activation is not None:
        out = F.silu(out)
    return out


def _check_activation(activation: str | None) -> None:
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d: activation {activation!r} is not supported (silu or None)")


def causal_conv1d_prefill_ref(
    x: torch.Tensor,  # [T, C] sequences concatenated
    weight: torch.Tensor,  # [C, K]
    bias: torch.Tensor | None,  # [C]
    cu_seqlens: torch.Tensor,  # [N + 1]
    conv_state: torch.Tensor,  # [num_slots, C, K-1] model dtype, updated in place
    state_indices: torch.Tensor,  # [N]
    has_initial_state: torch.Tensor,  # [N] bool
    activation: str | None = "silu",
) -> torch.Tensor:  # [T, C] x's dtype
    """Torch reference: per sequence, a full conv over [history (slot or zeros), inputs]; the slot then
    holds the last K-1 columns of that concatenation."""
    _check_activation(activation)
    k = weight.shape[1]
    y = torch.empty_like(x)
    cu = cu_seqlens.tolist()
    for n, slot in enumerate(state_indices.tolist()):
        bos, eos = cu[n], cu[n + 1]
        hist = conv_state[slot] if bool(has_initial_state[n]) else torch.zeros_like(conv_state[slot])
        full = torch.cat([hist, x[bos:eos].t().to(hist.dtype)], dim=-1)  # [C, K-1 + L]
        if eos > bos:
            y[bos:eos] = _conv_silu_ref(full, weight, bias, activation).t().to(x.dtype)
        conv_state[slot] = full[:, full.shape[1] - (k - 1) :]
    return y


def causal_conv1d_decode_ref(
    x: torch.Tensor,  # [B, C]
    weight: torch.Tensor,  # [C, K]
    bias: torch.Tensor | None,  # [C]
    conv_state: torch.Tensor,  # [num_slots, C, K-1] updated in place
    state_indices: torch.Tensor,  # [B]
    activation: str | None = "silu",
) -> torch.Tensor:  # [B, C]
    """Torch reference: transformers' `causal_conv1d_update` on each row's slot (rows in order)."""
    _check_activation(activation)
    y = torch.empty_like(x)
    for b, slot in enumerate(state_indices.tolist()):
        full = torch.cat([conv_state[slot], x[b, :, None].to(conv_state.dtype)], dim=-1)  # [C, K]
        conv_state[slot] = full[:, 1:]
        y[b] = _conv_silu_ref(full, weight, bias, activation)[:, -1].to(x.dtype)
    return y


@triton.jit
def _silu_rounded(acc, OUT_DTYPE: tl.constexpr, SILU: tl.constexpr):
    """The float32 conv sum rounded to the output dtype, then SiLU in float32 (transformers' order)."""
    y = acc.to(OUT_DTYPE).to(tl.float32)
    if SILU:
        y = y * tl.sigmoid(y)
    return y


@triton.jit
def _causal_conv1d_prefill_kernel(
    x_ptr,  # [T, C]
    w_ptr,  # [C, K]
    bias_ptr,  # [C] (HAS_BIAS)
    cu_ptr,  # [N + 1]
    state_ptr,  # [S, C, K-1]
    idx_ptr,  # [N]
    init_ptr,  # [N] bool
    y_ptr,  # [T, C]
    T,
    C,
    N,
    stride_xt,
    stride_yt,
    stride_wc,
    stride_ss,
    stride_sc,
    stride_sk,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_t = offs_t < T
    mask_c = offs_c < C
    # Each token's sequence: how many sequences end at or before it.
    seq = tl.zeros((BLOCK_T,), dtype=tl.int32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ends = tl.load(cu_ptr + 1 + offs_n, mask=offs_n < N, other=2**31 - 1).to(tl.int32)
        seq += tl.sum((ends[None, :] <= offs_t[:, None]).to(tl.int32), axis=1)
    seq = tl.minimum(seq, N - 1)
    bos = tl.load(cu_ptr + seq, mask=mask_t, other=0).to(tl.int32)  # [BLOCK_T]
    slot = tl.load(idx_ptr + seq, mask=mask_t, other=0).to(tl.int64)
    init = tl.load(init_ptr + seq, mask=mask_t, other=0) != 0
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    mask_tc = mask_t[:, None] & mask_c[None, :]
    for j in tl.static_range(K):
        src = offs_t - (K - 1) + j  # the input this tap reads
        in_seq = src >= bos
        xv = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_xt + offs_c[None, :],
                     mask=mask_tc & in_seq[:, None], other=0.0)  # fmt: skip
        col = src - bos + (K - 1)  # before the sequence: a column of its saved history (>= 0)
        sv = tl.load(state_ptr + slot[:, None] * stride_ss + offs_c[None, :] * stride_sc + col[:, None] * stride_sk,
                     mask=mask_tc & (~in_seq & init)[:, None], other=0.0)  # fmt: skip
        wj = tl.load(w_ptr + offs_c * stride_wc + j, mask=mask_c, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * wj[None, :]
    y = _silu_rounded(acc, y_ptr.dtype.element_ty, SILU)
    tl.store(y_ptr + offs_t.to(tl.int64)[:, None] * stride_yt + offs_c[None, :], y.to(y_ptr.dtype.element_ty), mask=mask_tc)


@triton.jit
def _conv_state_store_kernel(
    x_ptr,  # [T, C]
    cu_ptr,  # [N + 1]
    state_ptr,  # [S, C, K-1]
    idx_ptr,  # [N]
    init_ptr,  # [N] bool
    C,
    stride_xt,
    stride_ss,
    stride_sc,
    stride_sk,
    K: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    n = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_k = tl.arange(0, BLOCK_K)
    mask_c = offs_c < C
    bos = tl.load(cu_ptr + n).to(tl.int32)
    length = tl.load(cu_ptr + n + 1).to(tl.int32) - bos
    slot = tl.load(idx_ptr + n).to(tl.int64)
    init = tl.load(init_ptr + n).to(tl.int32)
    # New column i is column length + i of [history (K-1), inputs (length)].
    pos = length + offs_k  # [BLOCK_K]
    col_ok = offs_k < K - 1
    from_x = pos >= K - 1
    src = (bos + pos - (K - 1)).to(tl.int64)
    xv = tl.load(x_ptr + src[None, :] * stride_xt + offs_c[:, None],
                 mask=mask_c[:, None] & (col_ok & from_x)[None, :], other=0.0)  # fmt: skip
    base = state_ptr + slot * stride_ss + offs_c[:, None] * stride_sc
    sv = tl.load(base + pos[None, :] * stride_sk, mask=mask_c[:, None] & (col_ok & ~from_x & (offs_k * 0 + init != 0))[None, :], other=0.0)
    new = tl.where(from_x[None, :], xv.to(state_ptr.dtype.element_ty), sv)
    tl.debug_barrier()  # every thread has read the old columns before any is overwritten
    tl.store(base + offs_k[None, :] * stride_sk, new, mask=mask_c[:, None] & col_ok[None, :])


@triton.jit
def _causal_conv1d_decode_kernel(
    x_ptr,  # [B, C]
    w_ptr,  # [C, K]
    bias_ptr,  # [C] (HAS_BIAS)
    state_ptr,  # [S, C, K-1]
    idx_ptr,  # [B]
    y_ptr,  # [B, C]
    C,
    stride_xb,
    stride_yb,
    stride_wc,
    stride_ss,
    stride_sc,
    stride_sk,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_k = tl.arange(0, BLOCK_K)
    mask_c = offs_c < C
    slot = tl.load(idx_ptr + b).to(tl.int64)
    x = tl.load(x_ptr + b * stride_xb + offs_c, mask=mask_c, other=0.0)
    base = state_ptr + slot * stride_ss + offs_c[:, None] * stride_sc
    # The K-tap window: K-1 saved columns, then this token.
    win = tl.load(base + offs_k[None, :] * stride_sk, mask=mask_c[:, None] & (offs_k < K - 1)[None, :], other=0.0)
    win = tl.where((offs_k == K - 1)[None, :], x.to(win.dtype)[:, None], win)
    w = tl.load(w_ptr + offs_c[:, None] * stride_wc + offs_k[None, :], mask=mask_c[:, None] & (offs_k < K)[None, :],
                other=0.0)  # fmt: skip
    acc = tl.sum(win.to(tl.float32) * w.to(tl.float32), axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    y = _silu_rounded(acc, y_ptr.dtype.element_ty, SILU)
    tl.store(y_ptr + b * stride_yb + offs_c, y.to(y_ptr.dtype.element_ty), mask=mask_c)
    # The state shifted by one: new column i is window column i + 1.
    nxt = tl.load(base + (offs_k + 1)[None, :] * stride_sk, mask=mask_c[:, None] & (offs_k + 1 < K - 1)[None, :],
                  other=0.0)  # fmt: skip
    nxt = tl.where((offs_k == K - 2)[None, :], x.to(nxt.dtype)[:, None], nxt)
    tl.debug_barrier()  # every thread has read the old columns before any is overwritten
    tl.store(base + offs_k[None, :] * stride_sk, nxt, mask=mask_c[:, None] & (offs_k < K - 1)[None, :])


def _check_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> None:
    c, k = weight.shape
    assert x.dim() == 2 and x.shape[1] == c and x.stride(1) == 1, "x must be [rows, C] with unit channel stride"
    assert weight.stride(1) == 1, "weight must be [C, K] with unit tap stride"
    assert conv_state.dim() == 3 and conv_state.shape[1:] == (c, k - 1), "conv_state must be [num_slots, C, K-1]"


def causal_conv1d_prefill(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, K]
    bias: torch.Tensor | None,  # [C]
    cu_seqlens: torch.Tensor,  # [N + 1] int32/int64
    conv_state: torch.Tensor,  # [num_slots, C, K-1] updated in place
    state_indices: torch.Tensor,  # [N]
    has_initial_state: torch.Tensor,  # [N] bool
    activation: str | None = "silu",
    out: torch.Tensor | None = None,  # [T, C]
) -> torch.Tensor:
    """Triton varlen causal conv (+ SiLU) with per-sequence history from, and new history into, the
    slots `state_indices` (equal to causal_conv1d_prefill_ref). No host synchronisation."""
    _check_activation(activation)
    _check_conv(x, weight, conv_state)
    t, c = x.shape
    k = weight.shape[1]
    n = state_indices.shape[0]
    y = torch.empty_like(x) if out is None else out
    if n == 0:
        return y
    block_c = min(256, next_pow2(c))
    has_bias = bias is not None
    if t:
        block_t = 16
        _causal_conv1d_prefill_kernel[(cdiv(t, block_t), cdiv(c, block_c))](
            x, weight, bias if has_bias else weight, cu_seqlens, conv_state, state_indices, has_initial_state, y,
            t, c, n, x.stride(0), y.stride(0), weight.stride(0), *conv_state.stride(),
            K=k, HAS_BIAS=has_bias, SILU=activation is not None, BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_N=64,
            num_warps=4, **pdl_args(x),
        )  # fmt: skip
    _conv_state_store_kernel[(n, cdiv(c, block_c))](
        x, cu_seqlens, conv_state, state_indices, has_initial_state, c, x.stride(0), *conv_state.stride(),
        K=k, BLOCK_C=block_c, BLOCK_K=next_pow2(k), num_warps=4, **pdl_args(x),
    )  # fmt: skip
    return y


def causal_conv1d_decode(
    x: torch.Tensor,  # [B, C]
    weight: torch.Tensor,  # [C, K]
    bias: torch.Tensor | None,  # [C]
    conv_state: torch.Tensor,  # [num_slots, C, K-1] updated in place
    state_indices: torch.Tensor,  # [B]
    activation: str | None = "silu",
    out: torch.Tensor | None = None,  # [B, C]
) -> torch.Tensor:
    """Triton one-token conv step (+ SiLU) per row on its slot's state, shifted in place (equal to
    causal_conv1d_decode_ref for rows with distinct slots). Grid from shapes only: CUDA-graph safe."""
    _check_activation(activation)
    _check_conv(x, weight, conv_state)
    bsz, c = x.shape
    k = weight.shape[1]
    y = torch.empty_like(x) if out is None else out
    if bsz == 0:
        return y
    block_c = min(256, next_pow2(c))
    has_bias = bias is not None
    _causal_conv1d_decode_kernel[(bsz, cdiv(c, block_c))](
        x, weight, bias if has_bias else weight, conv_state, state_indices, y, c, x.stride(0), y.stride(0),
        weight.stride(0), *conv_state.stride(),
        K=k, HAS_BIAS=has_bias, SILU=activation is not None, BLOCK_C=block_c, BLOCK_K=next_pow2(k),
        num_warps=4, **pdl_args(x),
    )  # fmt: skip
    return y
