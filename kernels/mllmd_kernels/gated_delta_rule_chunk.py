"""chunk_gated_delta_rule: the Gated DeltaNet prefill in chunks of 64 tokens (WY / UT-transform form).

Varlen: sequences concatenated along T with `cu_seqlens [N + 1]`; each sequence starts from its
slot of the layer's state pool `ssm_state [num_slots, Hv, Dk, Dv]` float32 (key dimension first, as
gated_delta_rule_decode) when `has_initial_state`, else from zeros, and its final state is written
back to that slot. The recurrence is gated_delta_rule_decode's, token by token; per chunk of BT = 64
tokens, with gc the cumulative log decay inside the chunk, it is the same function computed as

    A    = strictly_lower(beta_i k_i.k_j exp(gc_i - gc_j)),  T = (I + A)^-1       (UT transform)
    w    = T (beta exp(gc) k),  u = T (beta v)
    v'   = u - w S                         (what the chunk's tokens write after the old state's part)
    o    = (exp(gc) q) S + causal(q k^T exp(gc_i - gc_j)) v'
    S    <- exp(gc_last) S + (exp(gc_last - gc) k)^T v'

Two launches, no host synchronisation (the chunk of each program is found on the device):

* `_gdn_chunk_wy_kernel`, grid (chunks, Hv): everything of one chunk and value head that does not
  depend on the state: gc, the intra-chunk attention causal(q k^T exp(gc_i - gc_j)), the row scales
  of q and k (their l2 norms, the decays), A, T by forward substitution (63 row steps on the 64 x 64
  tile) and w, u. Dk and Dv are taken in pieces of 32 columns (16 for float32).
* `_gdn_chunk_state_kernel`, grid (N, Hv, Dv / 16): the sequential pass over one sequence's chunks
  with its [Dk, 16] state block in registers, writing the outputs on the way (no per-chunk states in
  memory, which would take 64 MiB at 2,048 tokens of a 32-head layer). Four dots a chunk.

Sized for sm87 with Triton 3.0 at Dk = Dv = 128 (16-bit inputs: no register spills, 17 / 35 KB of
shared memory; ptxas -v): Triton 3.0 keeps a dot's whole operand fragments in registers, so 64 x 64
float32 dots (a blocked inverse) and 64-bit pointer offsets on [64, 128] tiles both spilled.
Snapshots for the hybrid prefix cache: `chunk_snapshot_indices [N, C]` names, for column c, a slot
that receives the state after the first (c + 1) * 64 tokens of the sequence in this call (-1: none;
only full chunks), and `final_snapshot_indices [N]` a second slot for a copy of the final state.
Token offsets count from the sequence's first token in this call, so the positions are absolute
multiples of 64 when the engine starts every continued prefill at a multiple of 64.

Dots take bf16/fp16 operands with float32 accumulation for 16-bit inputs (the usual GDN kernel
precision), the normalisations and decays applied in float32 to their results; float32 inputs use
3xTF32 dots (about float32's precision; the state pass then spills registers: a test path, the
models run in 16 bits); the interpreter computes in float32. Outputs come out in q's dtype.
"""

from __future__ import annotations

import torch

from mllmd_kernels._triton import dot_in_fp32, multi_dot_min_tile, next_pow2, pdl_args, pdl_sync, tl, triton
from mllmd_kernels.gated_delta_rule_decode import l2norm_ref

CHUNK = 64  # BT: the chunk length of the Triton path and the reference


def gated_delta_rule_chunked_ref(
    q: torch.Tensor,  # [L, Hk, Dk]
    k: torch.Tensor,  # [L, Hk, Dk]
    v: torch.Tensor,  # [L, Hv, Dv]
    g: torch.Tensor,  # [L, Hv] log decay
    beta: torch.Tensor,  # [L, Hv]
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,  # [Hv, Dk, Dv]
    use_qk_l2norm: bool = True,
    chunk_size: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence in the chunked form, float32 (transformers' torch_chunk_gated_delta_rule semantics):
    (o [L, Hv, Dv] in q's dtype, final state [Hv, Dk, Dv], states after each full chunk [L // chunk, Hv, Dk, Dv])."""
    out_dtype = q.dtype
    length, hk, dk = k.shape
    hv, dv = v.shape[1:]
    scale = dk**-0.5 if scale is None else scale
    q, k = (x.float().repeat_interleave(hv // hk, dim=1) for x in (q, k))
    if use_qk_l2norm:
        q, k = l2norm_ref(q), l2norm_ref(k)
    q = q * scale
    pad = -length % chunk_size
    # [Hv, chunks, BT, D]; padded tokens have k = v = beta = 0 and g = 0 (no decay): they change nothing.
    q, k, v = (torch.nn.functional.pad(x.float(), (0, 0, 0, 0, 0, pad)).transpose(0, 1) for x in (q, k, v))
    g, beta = (torch.nn.functional.pad(x.float(), (0, 0, 0, pad)).t() for x in (g, beta))
    q, k, v = (x.reshape(hv, -1, chunk_size, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(hv, -1, chunk_size) for x in (g, beta))
    gc = g.cumsum(-1)  # [Hv, C, BT]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [Hv, C, BT, BT]
    kb = k * beta[..., None]
    a = (kb @ k.transpose(-1, -2) * decay).tril(-1)
    eye = torch.eye(chunk_size, device=q.device)
    t_inv = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)
    w = t_inv @ (kb * gc.exp()[..., None])  # [Hv, C, BT, Dk]
    u = t_inv @ (v * beta[..., None])  # [Hv, C, BT, Dv]
    attn = q @ k.transpose(-1, -2) * decay
    qg = q * gc.exp()[..., None]
    kd = k * (gc[..., -1:] - gc).exp()[..., None]
    state = torch.zeros(hv, dk, dv, device=q.device) if initial_state is None else initial_state.float().clone()
    o = torch.empty_like(v)
    snaps = []
    for c in range(q.shape[1]):
        v_new = u[:, c] - w[:, c] @ state
        o[:, c] = qg[:, c] @ state + attn[:, c] @ v_new
        state = state * gc[:, c, -1, None, None].exp() + kd[:, c].transpose(-1, -2) @ v_new
        if (c + 1) * chunk_size <= length:
            snaps.append(state)
    o = o.reshape(hv, -1, dv)[:, :length].transpose(0, 1).to(out_dtype)
    return o, state, torch.stack(snaps) if snaps else state.new_zeros(0, hv, dk, dv)


def chunk_gated_delta_rule_ref(
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv] float32
    beta: torch.Tensor,  # [T, Hv]
    scale: float | None,
    ssm_state: torch.Tensor,  # [num_slots, Hv, Dk, Dv] float32, updated in place
    state_indices: torch.Tensor,  # [N]
    has_initial_state: torch.Tensor,  # [N] bool
    cu_seqlens: torch.Tensor,  # [N + 1]
    use_qk_l2norm: bool = True,
    final_snapshot_indices: torch.Tensor | None = None,  # [N], -1: none
    chunk_snapshot_indices: torch.Tensor | None = None,  # [N, C], -1: none
) -> torch.Tensor:  # [T, Hv, Dv] q's dtype
    """Torch reference of chunk_gated_delta_rule: gated_delta_rule_chunked_ref per sequence, the initial
    states read before any slot is written."""
    cu = cu_seqlens.tolist()
    slots = state_indices.tolist()
    init = [ssm_state[s].clone() if bool(h) else None for s, h in zip(slots, has_initial_state.tolist())]
    o = torch.empty(v.shape, dtype=q.dtype, device=v.device)
    for n, slot in enumerate(slots):
        sl = slice(cu[n], cu[n + 1])
        o[sl], final, snaps = gated_delta_rule_chunked_ref(
            q[sl], k[sl], v[sl], g[sl], beta[sl], scale, init[n], use_qk_l2norm
        )
        ssm_state[slot] = final
        if final_snapshot_indices is not None and int(final_snapshot_indices[n]) >= 0:
            ssm_state[int(final_snapshot_indices[n])] = final
        if chunk_snapshot_indices is not None:
            for c, dst in enumerate(chunk_snapshot_indices[n].tolist()[: snaps.shape[0]]):
                if dst >= 0:
                    ssm_state[dst] = snaps[c]
    return o


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr, DTYPE: tl.constexpr):
    """a @ b accumulated in float32: float32 operands (3xTF32, about float32's precision, on the tensor
    cores; exact in the interpreter), or both rounded to the inputs' 16-bit dtype."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3")
    else:
        return tl.dot(a.to(DTYPE), b.to(DTYPE))


@triton.jit
def _inv_unit_lower(a, BT: tl.constexpr):
    """(I + a)^-1 for a strictly lower-triangular float32 [BT, BT] tile: forward substitution, one row a
    step (no dots: 64 x 64 float32 dots do not fit sm87's registers with Triton 3.0)."""
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    x = -a
    for i in range(1, BT):
        sel = rows == i
        r = tl.sum(tl.where(sel, x, 0.0), axis=0)  # row i
        r = r + tl.sum(r[:, None] * x, axis=0)  # + its combination of the rows above, already final
        x = tl.where(sel, r[None, :], x)
    return x + (rows == cols).to(tl.float32)


@triton.jit
def _gdn_chunk_wy_kernel(
    q_ptr,  # [T, Hk, Dk]
    k_ptr,  # [T, Hk, Dk]
    v_ptr,  # [T, Hv, Dv]
    g_ptr,  # [T, Hv] float32
    beta_ptr,  # [T, Hv]
    cu_ptr,  # [N + 1]
    chunk_cu_ptr,  # [N + 1] first chunk of each sequence
    chunk_seq_ptr,  # [max_chunks] sequence of each chunk (N: none)
    gc_ptr,  # [T, Hv] float32, written: cumulative log decay within the chunk
    qs_ptr,  # [T, Hv] float32, written: scale exp(gc) / |q|
    ks_ptr,  # [T, Hv] float32, written: exp(gc_last - gc) / |k|
    attn_ptr,  # [T, Hv, 64] written: row t's causal q.k exp(gc_t - gc_j) (normalised q, k) in its chunk
    w_ptr,  # [T, Hv, Dk] written
    u_ptr,  # [T, Hv, Dv] written
    scale,
    N,
    Dk,
    Dv,
    GROUP,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_bt,
    stride_wt,
    stride_wh,
    stride_ut,
    stride_uh,
    L2NORM: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Everything of one 64-token chunk and value head that does not depend on the state. The l2 norms
    are row scales applied to the dots' results (q and k enter the dots as loaded), and Dk and Dv are
    taken in pieces of BLOCK_K / BLOCK_V, one live at a time."""
    pdl_sync(USE_PDL)
    pid = tl.program_id(0)
    hv = tl.program_id(1)
    n = tl.load(chunk_seq_ptr + pid)
    if n < N:
        dt = k_ptr.dtype.element_ty
        hk = hv // GROUP
        hv_t = hv.to(tl.int64)
        eos = tl.load(cu_ptr + n + 1).to(tl.int32)
        offs_t = tl.load(cu_ptr + n).to(tl.int32) + (pid - tl.load(chunk_cu_ptr + n)) * 64 + tl.arange(0, 64)
        mask_t = offs_t < eos
        offs_t = offs_t.to(tl.int64)
        g = tl.load(g_ptr + offs_t * stride_gt + hv, mask=mask_t, other=0.0).to(tl.float32)
        gc = tl.cumsum(g, axis=0)
        g_last = tl.sum(g, axis=0)  # gc of the chunk's last token (padding adds 0)
        beta = tl.load(beta_ptr + offs_t * stride_bt + hv, mask=mask_t, other=0.0).to(tl.float32)
        q_rows = q_ptr + offs_t[:, None] * stride_qt + hk * stride_qh
        k_rows = k_ptr + offs_t[:, None] * stride_kt + hk * stride_kh
        kk = tl.zeros((64, 64), dtype=tl.float32)
        qk = tl.zeros((64, 64), dtype=tl.float32)
        ssq = tl.zeros((64,), dtype=tl.float32)
        ssk = tl.zeros((64,), dtype=tl.float32)
        for k0 in range(0, Dk, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_tk = mask_t[:, None] & (offs_k < Dk)[None, :]
            kb = tl.load(k_rows + offs_k[None, :], mask=mask_tk, other=0.0)
            qb = tl.load(q_rows + offs_k[None, :], mask=mask_tk, other=0.0)
            kk += _dot(kb, tl.trans(kb), DOT_F32, dt)
            qk += _dot(qb, tl.trans(kb), DOT_F32, dt)
            if L2NORM:
                kf = kb.to(tl.float32)
                qf = qb.to(tl.float32)
                ssk += tl.sum(kf * kf, axis=1)
                ssq += tl.sum(qf * qf, axis=1)
        if L2NORM:
            rk = tl.rsqrt(ssk + 1e-6)
            rq = tl.rsqrt(ssq + 1e-6) * scale
        else:
            rk = tl.full((64,), 1.0, dtype=tl.float32)
            rq = tl.full((64,), 1.0, dtype=tl.float32) * scale
        tl.store(gc_ptr + offs_t * tl.num_programs(1) + hv, gc, mask=mask_t)
        tl.store(qs_ptr + offs_t * tl.num_programs(1) + hv, rq * tl.exp(gc), mask=mask_t)
        tl.store(ks_ptr + offs_t * tl.num_programs(1) + hv, rk * tl.exp(g_last - gc), mask=mask_t)
        rows = tl.arange(0, 64)[:, None]
        cols = tl.arange(0, 64)[None, :]
        rel = gc[:, None] - gc[None, :]
        attn = qk * rq[:, None] * rk[None, :] * tl.exp(tl.where(rows >= cols, rel, float("-inf")))
        tl.store(attn_ptr + (offs_t[:, None] * tl.num_programs(1) + hv_t) * 64 + cols, attn.to(attn_ptr.dtype.element_ty),
                 mask=mask_t[:, None])  # fmt: skip
        a = kk * (rk * beta)[:, None] * rk[None, :] * tl.exp(tl.where(rows > cols, rel, float("-inf")))
        t_inv = _inv_unit_lower(a, 64)
        tk = t_inv * (rk * beta * tl.exp(gc))[None, :]  # w = T diag(beta exp(gc) / |k|) k
        for k0 in range(0, Dk, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_tk = mask_t[:, None] & (offs_k < Dk)[None, :]
            w = _dot(tk, tl.load(k_rows + offs_k[None, :], mask=mask_tk, other=0.0), DOT_F32, dt)
            tl.store(w_ptr + offs_t[:, None] * stride_wt + hv * stride_wh + offs_k[None, :],
                     w.to(w_ptr.dtype.element_ty), mask=mask_tk)  # fmt: skip
        t_inv = t_inv * beta[None, :]
        for v0 in range(0, Dv, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            mask_tv = mask_t[:, None] & (offs_v < Dv)[None, :]
            vb = tl.load(v_ptr + offs_t[:, None] * stride_vt + hv * stride_vh + offs_v[None, :], mask=mask_tv, other=0.0)
            u = _dot(t_inv, vb, DOT_F32, dt)  # T diag(beta) v
            tl.store(u_ptr + offs_t[:, None] * stride_ut + hv * stride_uh + offs_v[None, :],
                     u.to(u_ptr.dtype.element_ty), mask=mask_tv)  # fmt: skip


@triton.jit
def _store_state(state_ptr, slot, hv, offs_k, offs_v, mask_s, s, stride_ss, stride_sh, stride_sk):
    ptrs = state_ptr + slot.to(tl.int64) * stride_ss + hv * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    tl.store(ptrs, s, mask=mask_s)


@triton.jit
def _gdn_chunk_state_kernel(
    q_ptr,  # [T, Hk, Dk]
    k_ptr,  # [T, Hk, Dk]
    w_ptr,  # [T, Hv, Dk]
    u_ptr,  # [T, Hv, Dv]
    gc_ptr,  # [T, Hv] float32
    qs_ptr,  # [T, Hv] float32
    ks_ptr,  # [T, Hv] float32
    attn_ptr,  # [T, Hv, 64]
    cu_ptr,  # [N + 1]
    state_ptr,  # [S, Hv, Dk, Dv] float32
    idx_ptr,  # [N]
    init_ptr,  # [N] bool
    snap_ptr,  # [N] (HAS_SNAP): a second slot for the final state, -1: none
    csnap_ptr,  # [N, C_SNAP] (HAS_CSNAP): a slot for the state after each full chunk, -1: none
    o_ptr,  # [T, Hv, Dv]
    Dk,
    Dv,
    GROUP,
    C_SNAP,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_wt,
    stride_wh,
    stride_ut,
    stride_uh,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_csn,
    stride_ot,
    stride_oh,
    DOT_F32: tl.constexpr,
    HAS_SNAP: tl.constexpr,
    HAS_CSNAP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One sequence, value head and value block through its chunks, the [Dk, BLOCK_V] state in registers."""
    pdl_sync(USE_PDL)
    n = tl.program_id(0)
    hv = tl.program_id(1)
    num_hv = tl.num_programs(1)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < Dk
    mask_v = offs_v < Dv
    mask_s = mask_k[:, None] & mask_v[None, :]
    hk = hv // GROUP
    dt = q_ptr.dtype.element_ty
    bos = tl.load(cu_ptr + n).to(tl.int32)
    eos = tl.load(cu_ptr + n + 1).to(tl.int32)
    slot = tl.load(idx_ptr + n).to(tl.int64)
    s = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)  # the state block [Dk, BLOCK_V]
    if tl.load(init_ptr + n).to(tl.int32) != 0:
        s = tl.load(state_ptr + slot * stride_ss + hv * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :],
                    mask=mask_s, other=0.0)  # fmt: skip
    for c in range(0, tl.cdiv(eos - bos, 64)):
        t0 = bos + c * 64
        offs_t = t0 + tl.arange(0, 64)
        mask_t = offs_t < eos
        mask_tk = mask_t[:, None] & mask_k[None, :]
        mask_tv = mask_t[:, None] & mask_v[None, :]
        u = tl.load(u_ptr + offs_t[:, None] * stride_ut + hv * stride_uh + offs_v[None, :], mask=mask_tv, other=0.0)
        w = tl.load(w_ptr + offs_t[:, None] * stride_wt + hv * stride_wh + offs_k[None, :], mask=mask_tk, other=0.0)
        q = tl.load(q_ptr + offs_t[:, None] * stride_qt + hk * stride_qh + offs_k[None, :], mask=mask_tk, other=0.0)
        v_new = u.to(tl.float32) - _dot(w, s, DOT_F32, dt)  # [64, BLOCK_V]: what the chunk writes
        qsc = tl.load(qs_ptr + offs_t * num_hv + hv, mask=mask_t, other=0.0)
        attn = tl.load(attn_ptr + (offs_t[:, None] * num_hv + hv) * 64 + tl.arange(0, 64)[None, :],
                       mask=mask_t[:, None], other=0.0)  # fmt: skip
        o = _dot(q, s, DOT_F32, dt) * qsc[:, None] + _dot(attn, v_new, DOT_F32, dt)
        tl.store(o_ptr + offs_t[:, None] * stride_ot + hv * stride_oh + offs_v[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=mask_tv)  # fmt: skip
        ksc = tl.load(ks_ptr + offs_t * num_hv + hv, mask=mask_t, other=0.0)
        g_last = tl.load(gc_ptr + (tl.minimum(t0 + 64, eos) - 1).to(tl.int64) * num_hv + hv)
        k = tl.load(k_ptr + offs_t[:, None] * stride_kt + hk * stride_kh + offs_k[None, :], mask=mask_tk, other=0.0)
        s = s * tl.exp(g_last) + _dot(tl.trans(k), v_new * ksc[:, None], DOT_F32, dt)
        if HAS_CSNAP:
            if (c < C_SNAP) & (t0 + 64 <= eos):
                dst = tl.load(csnap_ptr + n * stride_csn + c)
                if dst >= 0:
                    _store_state(state_ptr, dst, hv, offs_k, offs_v, mask_s, s, stride_ss, stride_sh, stride_sk)
    _store_state(state_ptr, slot, hv, offs_k, offs_v, mask_s, s, stride_ss, stride_sh, stride_sk)
    if HAS_SNAP:
        dst = tl.load(snap_ptr + n)
        if dst >= 0:
            _store_state(state_ptr, dst, hv, offs_k, offs_v, mask_s, s, stride_ss, stride_sh, stride_sk)


def _chunk_map(cu_seqlens: torch.Tensor, max_chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first chunk of each sequence [N + 1], sequence of each of max_chunks chunk programs, N past the
    last) from cu_seqlens, on its device (no synchronisation)."""
    cu = cu_seqlens.long()
    chunks = (cu[1:] - cu[:-1] + CHUNK - 1) // CHUNK
    chunk_cu = torch.cat([cu.new_zeros(1), chunks.cumsum(0)])
    ids = torch.arange(max_chunks, device=cu.device)
    chunk_seq = torch.searchsorted(chunk_cu, ids, right=True) - 1
    return chunk_cu.to(torch.int32), chunk_seq.to(torch.int32)


def _state_block_v(dv: int, device: torch.device) -> int:
    """Value columns a state-pass program: 16 keeps the [Dk, 16] state, the chunk's [64, Dk] q, k, w
    tiles and their dot fragments within sm87's registers at Dk = 128 with 8 warps (32 spilled), and
    gives Hv * Dv / 16 programs a sequence (256 for Qwen3.5-4B: every SM of an Orin busy). Hopper
    takes 64 (multi_dot_min_tile)."""
    return max(min(next_pow2(dv), 16), _min_tile(device))


def _wy_block(dot_f32: bool, device: torch.device) -> int:
    """Dk / Dv pieces of the WY pass: 16 (fp32) or 32 fit sm87's registers; Hopper takes 64."""
    return max(16 if dot_f32 else 32, _min_tile(device))


def _min_tile(device: torch.device) -> int:
    return multi_dot_min_tile(device.index or 0) if device.type == "cuda" else 16


def chunk_gated_delta_rule(
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv] float32
    beta: torch.Tensor,  # [T, Hv]
    scale: float | None,
    ssm_state: torch.Tensor,  # [num_slots, Hv, Dk, Dv] float32, updated in place
    state_indices: torch.Tensor,  # [N]
    has_initial_state: torch.Tensor,  # [N] bool
    cu_seqlens: torch.Tensor,  # [N + 1] int32/int64
    use_qk_l2norm: bool = True,
    final_snapshot_indices: torch.Tensor | None = None,  # [N], -1: none
    chunk_snapshot_indices: torch.Tensor | None = None,  # [N, C], -1: none
    out: torch.Tensor | None = None,  # [T, Hv, Dv]
) -> torch.Tensor:
    """Triton chunked GDN prefill (scale None: Dk^-0.5), equal to chunk_gated_delta_rule_ref: reads
    each sequence's initial state from its slot (zeros without has_initial_state), writes its final
    state there and to the snapshot slots. No slot may be both read and written by two sequences."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    assert k.shape == q.shape and v.shape[0] == t and hv % hk == 0, f"Hv ({hv}) must be a multiple of Hk ({hk})"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "head dims must be contiguous"
    assert g.stride(-1) == 1 and beta.stride(-1) == 1, "per-head gates must be contiguous over heads"
    assert ssm_state.dtype == torch.float32 and ssm_state.shape[1:] == (hv, dk, dv), (
        "ssm_state must be [num_slots, Hv, Dk, Dv] float32"
    )
    assert ssm_state.stride(-1) == 1, "ssm_state's Dv must be contiguous"
    assert dk <= 128 and dv <= 128, "the kernels are sized for head dims up to 128 (Qwen3.5's)"
    assert t * max(q.stride(0), k.stride(0), v.stride(0), hv * max(dk, dv, CHUNK)) < 2**31, (
        "token offsets are 32-bit in the state pass"
    )
    csnap = chunk_snapshot_indices
    assert csnap is None or (csnap.dim() == 2 and csnap.stride(1) == 1), "chunk_snapshot_indices: [N, C] rows"
    n = state_indices.shape[0]
    o = torch.empty(v.shape, dtype=q.dtype, device=q.device) if out is None else out
    if n == 0:
        return o
    dot_f32 = dot_in_fp32(q.dtype)
    work_dtype = torch.float32 if dot_f32 else q.dtype
    f32 = {"dtype": torch.float32, "device": q.device}
    gc, qscale, kscale = (torch.empty((t, hv), **f32) for _ in range(3))
    attn = torch.empty((t, hv, CHUNK), dtype=work_dtype, device=q.device)
    w = torch.empty((t, hv, dk), dtype=work_dtype, device=q.device)
    u = torch.empty((t, hv, dv), dtype=work_dtype, device=q.device)
    max_chunks = t // CHUNK + n
    chunk_cu, chunk_seq = _chunk_map(cu_seqlens, max_chunks)
    wy_bk, floor = _wy_block(dot_f32, q.device), _min_tile(q.device)
    _gdn_chunk_wy_kernel[(max_chunks, hv)](
        q, k, v, g, beta, cu_seqlens, chunk_cu, chunk_seq, gc, qscale, kscale, attn, w, u,
        dk**-0.5 if scale is None else scale, n, dk, dv, hv // hk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        L2NORM=use_qk_l2norm, DOT_F32=dot_f32, BLOCK_K=max(min(next_pow2(dk), wy_bk), floor),
        BLOCK_V=max(min(next_pow2(dv), wy_bk), floor), num_warps=8, num_stages=1, **pdl_args(q),
    )  # fmt: skip
    bv = _state_block_v(dv, q.device)
    _gdn_chunk_state_kernel[(n, hv, -(-dv // bv))](
        q, k, w, u, gc, qscale, kscale, attn, cu_seqlens, ssm_state, state_indices, has_initial_state,
        final_snapshot_indices if final_snapshot_indices is not None else state_indices,
        csnap if csnap is not None else state_indices, o, dk, dv, hv // hk, 0 if csnap is None else csnap.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        0 if csnap is None else csnap.stride(0), o.stride(0), o.stride(1),
        DOT_F32=dot_f32, HAS_SNAP=final_snapshot_indices is not None, HAS_CSNAP=csnap is not None,
        BLOCK_K=max(next_pow2(dk), floor), BLOCK_V=bv, num_warps=8, num_stages=1, **pdl_args(q),
    )  # fmt: skip
    return o
