"""gated_delta_rule_decode: one recurrent Gated DeltaNet step per request, on its slot of the state pool.

The state pool of a GDN layer is `ssm_state [num_slots, Hv, Dk, Dv]` float32 (transformers' layout,
key dimension first: o = S^T q), indexed by the request's slot; slot 0 is the engine's dummy for
padded CUDA-graph rows. One step of the gated delta rule for value head h with key head h // (Hv / Hk)
(q and k are shared by Hv / Hk consecutive value heads, transformers' repeat_interleave):

    q, k <- l2norm(q), l2norm(k) (eps 1e-6, when use_qk_l2norm);  q <- q * scale
    S <- exp(g) * S;  u = beta * (v - S^T k);  S <- S + k u^T;  o = S^T q

in float32 whatever the input dtype; o comes out in q's dtype.

* `fused_recurrent_gated_delta_rule_decode` takes g (log decay, float32) and beta;
* `fused_gdn_gating_decode` takes the raw per-head projections a and b with the layer's A_log and
  dt_bias and forms g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) in the kernel
  (transformers' `Qwen3_5GatedDeltaNet` numerics: beta rounded to b's dtype), which saves the few
  elementwise launches that would compute them per layer and step.

Grid (B, Hv, Dv / BLOCK_V), from the shapes only (CUDA-graph safe, no host synchronisation); each
program reads and writes its [Dk, BLOCK_V] block of the state once. Rows that share a slot (padded
rows at slot 0) race on it: only that slot's state and those rows' outputs are then undefined.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mllmd_kernels._triton import cdiv, next_pow2, pdl_args, pdl_sync, tl, triton

L2NORM_EPS = 1e-6  # transformers' (and fla's) l2norm epsilon


def l2norm_ref(x: torch.Tensor) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + 1e-6) over the last dimension, as transformers' l2norm."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def gdn_gating_ref(
    a: torch.Tensor,  # [..., Hv]
    b: torch.Tensor,  # [..., Hv]
    A_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g float32, beta in b's dtype) from the raw projections, as Qwen3_5GatedDeltaNet.forward."""
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, beta


def gated_delta_rule_recurrent_ref(
    q: torch.Tensor,  # [L, Hk, Dk]
    k: torch.Tensor,  # [L, Hk, Dk]
    v: torch.Tensor,  # [L, Hv, Dv]
    g: torch.Tensor,  # [L, Hv]
    beta: torch.Tensor,  # [L, Hv]
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,  # [Hv, Dk, Dv]
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [L, Hv, Dv] q's dtype, final state [Hv, Dk, Dv] float32
    """One sequence, one token at a time, in float32: the definition the chunked form must equal."""
    out_dtype = q.dtype
    hk, dk = k.shape[1:]
    hv, dv = v.shape[1:]
    scale = dk**-0.5 if scale is None else scale
    q, k = (x.float().repeat_interleave(hv // hk, dim=1) for x in (q, k))  # [L, Hv, Dk]
    if use_qk_l2norm:
        q, k = l2norm_ref(q), l2norm_ref(k)
    q = q * scale
    v, g, beta = v.float(), g.float(), beta.float()
    state = torch.zeros(hv, dk, dv) if initial_state is None else initial_state.float().clone()
    state = state.to(v.device)
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(v.shape[0]):
        state = state * g[t].exp()[:, None, None]
        u = beta[t, :, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k[t]))  # [Hv, Dv]
        state = state + k[t, :, :, None] * u[:, None, :]
        o[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return o.to(out_dtype), state


def _decode_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float | None,
    ssm_state: torch.Tensor, state_indices: torch.Tensor, use_qk_l2norm: bool,
) -> torch.Tensor:  # fmt: skip
    o = torch.empty(v.shape, dtype=q.dtype, device=v.device)
    for row, slot in enumerate(state_indices.tolist()):
        out, state = gated_delta_rule_recurrent_ref(
            q[row : row + 1], k[row : row + 1], v[row : row + 1], g[row : row + 1], beta[row : row + 1], scale,
            ssm_state[slot], use_qk_l2norm,
        )  # fmt: skip
        o[row] = out[0]
        ssm_state[slot] = state
    return o


def fused_recurrent_gated_delta_rule_decode_ref(
    q: torch.Tensor,  # [B, Hk, Dk]
    k: torch.Tensor,  # [B, Hk, Dk]
    v: torch.Tensor,  # [B, Hv, Dv]
    g: torch.Tensor,  # [B, Hv] float32
    beta: torch.Tensor,  # [B, Hv]
    scale: float | None,
    ssm_state: torch.Tensor,  # [num_slots, Hv, Dk, Dv] float32, updated in place
    state_indices: torch.Tensor,  # [B]
    use_qk_l2norm: bool = True,
) -> torch.Tensor:  # [B, Hv, Dv] q's dtype
    """Torch reference: the recurrent step on each row's slot, rows in order."""
    return _decode_ref(q, k, v, g, beta, scale, ssm_state, state_indices, use_qk_l2norm)


def fused_gdn_gating_decode_ref(
    q: torch.Tensor,  # [B, Hk, Dk]
    k: torch.Tensor,  # [B, Hk, Dk]
    v: torch.Tensor,  # [B, Hv, Dv]
    a: torch.Tensor,  # [B, Hv]
    b: torch.Tensor,  # [B, Hv]
    A_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
    scale: float | None,
    ssm_state: torch.Tensor,  # [num_slots, Hv, Dk, Dv] float32, updated in place
    state_indices: torch.Tensor,  # [B]
    use_qk_l2norm: bool = True,
) -> torch.Tensor:  # [B, Hv, Dv] q's dtype
    """Torch reference: gdn_gating_ref, then the recurrent step."""
    g, beta = gdn_gating_ref(a, b, A_log, dt_bias)
    return _decode_ref(q, k, v, g, beta, scale, ssm_state, state_indices, use_qk_l2norm)


@triton.jit
def _gdn_gate(a_ptr, b_ptr, alog_ptr, dtb_ptr, row, hv, stride_ab, stride_bb):
    """g = -exp(A_log) * softplus(a + dt_bias) (softplus linear above 20, as torch's), beta = sigmoid(b)
    rounded to b's dtype; float32 scalars."""
    x = tl.load(a_ptr + row * stride_ab + hv).to(tl.float32) + tl.load(dtb_ptr + hv).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = -tl.exp(tl.load(alog_ptr + hv).to(tl.float32)) * softplus
    braw = tl.load(b_ptr + row * stride_bb + hv)
    beta = tl.sigmoid(braw.to(tl.float32)).to(braw.dtype).to(tl.float32)
    return g, beta


@triton.jit
def _gdn_decode_kernel(
    q_ptr,  # [B, Hk, Dk]
    k_ptr,  # [B, Hk, Dk]
    v_ptr,  # [B, Hv, Dv]
    g_ptr,  # [B, Hv] float32 log decay (GATE: a, the raw projection)
    beta_ptr,  # [B, Hv] (GATE: b, the raw projection)
    alog_ptr,  # [Hv] (GATE)
    dtb_ptr,  # [Hv] (GATE)
    state_ptr,  # [S, Hv, Dk, Dv] float32
    idx_ptr,  # [B]
    o_ptr,  # [B, Hv, Dv]
    scale,
    Dk,
    Dv,
    GROUP,  # Hv // Hk
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_gb,
    stride_betab,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_ob,
    stride_oh,
    L2NORM: tl.constexpr,
    GATE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < Dk
    mask_v = offs_v < Dv
    hk = hv // GROUP
    slot = tl.load(idx_ptr + row).to(tl.int64)
    q = tl.load(q_ptr + row * stride_qb + hk * stride_qh + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * stride_kb + hk * stride_kh + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    if L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    q = q * scale
    v = tl.load(v_ptr + row * stride_vb + hv * stride_vh + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    if GATE:
        g, beta = _gdn_gate(g_ptr, beta_ptr, alog_ptr, dtb_ptr, row, hv, stride_gb, stride_betab)
    else:
        g = tl.load(g_ptr + row * stride_gb + hv).to(tl.float32)
        beta = tl.load(beta_ptr + row * stride_betab + hv).to(tl.float32)
    s_ptrs = state_ptr + slot * stride_ss + hv * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    mask_s = mask_k[:, None] & mask_v[None, :]
    s = tl.load(s_ptrs, mask=mask_s, other=0.0) * tl.exp(g)  # [BLOCK_K, BLOCK_V]
    u = beta * (v - tl.sum(s * k[:, None], axis=0))  # [BLOCK_V]
    s = s + k[:, None] * u[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(s_ptrs, s, mask=mask_s)
    tl.store(o_ptr + row * stride_ob + hv * stride_oh + offs_v, o.to(o_ptr.dtype.element_ty), mask=mask_v)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ssm_state: torch.Tensor) -> None:
    hk, dk = q.shape[-2:]
    hv, dv = v.shape[-2:]
    assert k.shape[-2:] == (hk, dk) and hv % hk == 0, f"Hv ({hv}) must be a multiple of Hk ({hk})"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "head dims must be contiguous"
    assert ssm_state.dtype == torch.float32 and ssm_state.shape[1:] == (hv, dk, dv), (
        "ssm_state must be [num_slots, Hv, Dk, Dv] float32"
    )
    assert ssm_state.stride(-1) == 1, "ssm_state's Dv must be contiguous"


def _block_v(bsz: int, hv: int, dv: int) -> int:
    """Value columns a program: small enough that small batches still fill the GPU with programs."""
    return min(next_pow2(dv), 32 if bsz * hv >= 256 else 16)


def _launch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    alog: torch.Tensor | None, dtb: torch.Tensor | None, scale: float | None, ssm_state: torch.Tensor,
    state_indices: torch.Tensor, use_qk_l2norm: bool, out: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    _check(q, k, v, ssm_state)
    assert g.stride(-1) == 1 and beta.stride(-1) == 1, "per-head gates must be contiguous over heads"
    bsz, hk, dk = q.shape
    hv, dv = v.shape[1:]
    o = torch.empty(v.shape, dtype=q.dtype, device=q.device) if out is None else out
    if bsz == 0:
        return o
    gate = alog is not None
    bv = _block_v(bsz, hv, dv)
    _gdn_decode_kernel[(bsz, hv, cdiv(dv, bv))](
        q, k, v, g, beta, alog if gate else g, dtb if gate else g, ssm_state, state_indices, o,
        dk**-0.5 if scale is None else scale, dk, dv, hv // hk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), o.stride(0), o.stride(1),
        L2NORM=use_qk_l2norm, GATE=gate, BLOCK_K=next_pow2(dk), BLOCK_V=bv,
        num_warps=max(1, min(8, next_pow2(dk) * bv // 512)), **pdl_args(q),
    )  # fmt: skip
    return o


def fused_recurrent_gated_delta_rule_decode(
    q: torch.Tensor,  # [B, Hk, Dk]
    k: torch.Tensor,  # [B, Hk, Dk]
    v: torch.Tensor,  # [B, Hv, Dv]
    g: torch.Tensor,  # [B, Hv] float32
    beta: torch.Tensor,  # [B, Hv]
    scale: float | None,
    ssm_state: torch.Tensor,  # [num_slots, Hv, Dk, Dv] float32, updated in place
    state_indices: torch.Tensor,  # [B]
    use_qk_l2norm: bool = True,
    out: torch.Tensor | None = None,  # [B, Hv, Dv]
) -> torch.Tensor:
    """Triton recurrent step per row on slot state_indices[row] (scale None: Dk^-0.5); equal to
    fused_recurrent_gated_delta_rule_decode_ref for rows with distinct slots."""
    return _launch(q, k, v, g, beta, None, None, scale, ssm_state, state_indices, use_qk_l2norm, out)


def fused_gdn_gating_decode(
    q: torch.Tensor,  # [B, Hk, Dk]
    k: torch.Tensor,  # [B, Hk, Dk]
    v: torch.Tensor,  # [B, Hv, Dv]
    a: torch.Tensor,  # [B, Hv] raw in_proj_a output
    b: torch.Tensor,  # [B, Hv] raw in_proj_b output
    A_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
    scale: float | None,
    ssm_state: torch.Tensor,  # [num_slots, Hv, Dk, Dv] float32, updated in place
    state_indices: torch.Tensor,  # [B]
    use_qk_l2norm: bool = True,
    out: torch.Tensor | None = None,  # [B, Hv, Dv]
) -> torch.Tensor:
    """fused_recurrent_gated_delta_rule_decode with g and beta formed in the kernel from a, b, A_log and
    dt_bias (equal to fused_gdn_gating_decode_ref)."""
    return _launch(q, k, v, a, b, A_log, dt_bias, scale, ssm_state, state_indices, use_qk_l2norm, out)
