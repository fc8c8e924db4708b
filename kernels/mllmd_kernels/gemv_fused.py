"""gemv_fused: the one-row decode GEMV with the op before it applied to x in the same launch.

At batch-1 decode every projection is a short GEMV, and the small ops between projections (the
RMSNorms before qkv and gate/up, SiLU-and-mul before down, Qwen3.5's gated RMSNorm before the
DeltaNet out_proj) are launches of a microsecond or two each that read one row. Here the GEMV
computes that row itself while it loads x's tiles (`RowPrologue`), so those launches go:

* "rmsnorm" (mllmd_kernels.rmsnorm's numerics) and "rmsnorm_zero_centred" (Qwen3.5's (1 + w) in
  float32): with a residual, s = x + residual (rounded to x's dtype) is normed and program (0, 0)
  writes s to `residual_out`, the decoder's next residual;
* "silu_mul": x is [2K] gate | up and the GEMV's input is silu(gate) * up (activation.py's numerics);
* "gated_rmsnorm": x and the gate z are [K] = groups of `group` (heads); each group is RMS-normed,
  times the weight [group] and silu(z) (gated_rmsnorm.py's numerics).

Every program needs the whole row's statistics for the norms, so it first reads the row once (from
L2: a few KB) for its sum of squares; that sum is reduced in another order than the norm kernels'
own, so a normed element may differ from theirs by one rounding (tests compare within tolerance);
SiLU-and-mul is elementwise and equal bit for bit. One row only (the GEMV's BLOCK_M == 1 path); the
tiling and split-K are gemv's (`pick_gemv_config`), so the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mllmd_kernels._triton import cdiv, pdl_args, pdl_sync, sm_count_for, tl, triton
from mllmd_kernels.activation import _silu_mul, silu_and_mul_ref
from mllmd_kernels.gated_rmsnorm import gated_rmsnorm_ref
from mllmd_kernels.gemv import GemvConfig, gemv_ref, pick_gemv_config, store_row
from mllmd_kernels.rmsnorm import rmsnorm_ref
from mllmd_kernels.rmsnorm_zero_centred import rmsnorm_zero_centred_ref
from mllmd_kernels.splitk import k_splits, splitk_reduce

KINDS = ("rmsnorm", "rmsnorm_zero_centred", "silu_mul", "gated_rmsnorm")
_RMSNORM, _ZERO_CENTRED, _SILU_MUL, _GATED = range(4)


@dataclass
class RowPrologue:
    """The op the GEMV applies to its input row first (see the module docstring for each kind)."""

    kind: str
    weight: torch.Tensor | None = None  # the norm's weight: [K]; gated_rmsnorm: [group]
    eps: float = 1e-6
    residual: torch.Tensor | None = None  # [1, K] (the norms): added to x first
    residual_out: torch.Tensor | None = None  # [1, K], written with x + residual (its own tensor)
    gate: torch.Tensor | None = None  # [1, K] z (gated_rmsnorm)
    group: int = 0  # gated_rmsnorm: elements per normed group (the head size)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown prologue {self.kind!r} (one of {', '.join(KINDS)})")
        if self.kind != "silu_mul" and self.weight is None:
            raise ValueError(f"{self.kind} needs the norm's weight")
        if (self.residual is None) != (self.residual_out is None) or (self.residual is not None and self.kind not in KINDS[:2]):
            raise ValueError("a residual (with its residual_out) goes only with rmsnorm and rmsnorm_zero_centred")
        if self.kind == "gated_rmsnorm" and (self.gate is None or self.group <= 0):
            raise ValueError("gated_rmsnorm needs the gate z and a positive group")

    def input_ref(self, x: torch.Tensor) -> torch.Tensor:
        """Torch reference: the row the GEMV multiplies (and residual_out written, for the norms)."""
        if self.kind == "silu_mul":
            return silu_and_mul_ref(x)
        assert self.weight is not None
        if self.kind == "gated_rmsnorm":
            assert self.gate is not None
            shape = (*x.shape[:-1], x.shape[-1] // self.group, self.group)
            return gated_rmsnorm_ref(x.view(shape), self.gate.reshape(shape), self.weight, self.eps).view(x.shape)
        norm = rmsnorm_ref if self.kind == "rmsnorm" else rmsnorm_zero_centred_ref
        out = norm(x, self.weight, self.eps, self.residual)
        if isinstance(out, tuple):
            assert self.residual_out is not None
            self.residual_out.copy_(out[1])
            return out[0]
        return out


def gemv_fused_ref(x: torch.Tensor, weight: torch.Tensor, prologue: RowPrologue) -> torch.Tensor:
    """Torch reference: gemv_ref(prologue(x), weight)."""
    return gemv_ref(prologue.input_ref(x), weight)


@triton.jit
def _row_rstd(x_ptr, res_ptr, res_out_ptr, K, eps, HAS_RES: tl.constexpr, WRITE_RES, BLOCK_K: tl.constexpr):
    """1 / RMS of the row s = x (+ residual, rounded to its dtype), which a nonzero `WRITE_RES` stores to res_out."""
    offs = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + offs < K
        s = tl.load(x_ptr + k0 + offs, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + k0 + offs, mask=mask, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + k0 + offs, s, mask=mask & (offs * 0 + WRITE_RES != 0))
        sf = s.to(tl.float32)
        acc += sf * sf
    return tl.rsqrt(tl.sum(acc, axis=0) / K + eps)


@triton.jit
def _input_tile(
    x_ptr, res_ptr, z_ptr, nw_ptr, ks, k_mask, K, rstd, eps,
    KIND: tl.constexpr, HAS_RES: tl.constexpr, GROUP: tl.constexpr, ROUND_PRODUCT: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """x's tile at columns `ks` after the prologue, as float32 values of x's dtype."""
    dtype = x_ptr.dtype.element_ty
    if KIND == 2:  # silu_mul: x is gate | up
        g = tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + K + ks, mask=k_mask, other=0.0).to(tl.float32)
        return _silu_mul(g, u, dtype)
    if KIND == 3:  # gated_rmsnorm over groups of GROUP (BLOCK_K and K are multiples of GROUP)
        xg = tl.reshape(tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32), (BLOCK_K // GROUP, GROUP))
        zg = tl.reshape(tl.load(z_ptr + ks, mask=k_mask, other=0.0).to(tl.float32), (BLOCK_K // GROUP, GROUP))
        y = xg * tl.rsqrt(tl.sum(xg * xg, axis=1) / GROUP + eps)[:, None]
        y = y.to(dtype).to(tl.float32) * tl.load(nw_ptr + tl.arange(0, GROUP)).to(tl.float32)[None, :]
        if ROUND_PRODUCT:
            y = y.to(dtype).to(tl.float32)
        return tl.reshape((y * (zg * tl.sigmoid(zg))).to(dtype).to(tl.float32), (BLOCK_K,))
    s = tl.load(x_ptr + ks, mask=k_mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + ks, mask=k_mask, other=0.0)
        s = (s.to(tl.float32) + r.to(tl.float32)).to(dtype)
    w = tl.load(nw_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
    y = s.to(tl.float32) * rstd
    if KIND == 0:  # rmsnorm: rounded to x's dtype, then times the weight, rounded again
        return (w * y.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return (y * (1.0 + w)).to(dtype).to(tl.float32)  # zero-centred: one rounding


@triton.jit
def _gemv_fused_kernel(
    x_ptr,  # [K] ([2K] for silu_mul)
    res_ptr,  # [K] (HAS_RES)
    res_out_ptr,  # [K] (HAS_RES), written by program (0, 0)
    z_ptr,  # [K] (gated_rmsnorm)
    nw_ptr,  # norm weight [K] ([GROUP] for gated_rmsnorm)
    w_ptr,  # [N, K]
    y_ptr,  # [N] (not IS_SPLIT)
    part_ptr,  # [split_k, N] float32 (IS_SPLIT)
    N,
    K,
    stride_wn,
    K_PER_SPLIT,  # multiple of BLOCK_K
    eps,
    KIND: tl.constexpr,
    HAS_RES: tl.constexpr,
    GROUP: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,  # K a multiple of BLOCK_K: the weight loads need no mask
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_n = offs_n < N
    rows_n = tl.where(mask_n, offs_n, 0).to(tl.int64)  # out-of-range rows re-read row 0
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_k * K_PER_SPLIT
    k_len = tl.minimum(K_PER_SPLIT, K - k_start)
    pdl_sync(USE_PDL)
    rstd = 1.0
    if KIND < 2:  # the norms: the whole row's statistics first
        rstd = _row_rstd(x_ptr, res_ptr, res_out_ptr, K, eps, HAS_RES, (pid_n + pid_k == 0).to(tl.int32), BLOCK_K)
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + (k_start + offs_k)[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for it in range(0, tl.cdiv(k_len, BLOCK_K)):
        k_mask = (it * BLOCK_K + offs_k) < k_len
        ks = k_start + it * BLOCK_K + offs_k
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
        x = _input_tile(x_ptr, res_ptr, z_ptr, nw_ptr, ks, k_mask, K, rstd, eps, KIND, HAS_RES, GROUP,
                        ROUND_PRODUCT, BLOCK_K)  # fmt: skip
        acc += w.to(tl.float32) * x[None, :]
        w_ptrs += BLOCK_K
    store_row(acc, x_ptr.dtype.element_ty, y_ptr, part_ptr, offs_n, mask_n, pid_k, N, IS_SPLIT)


def fusable(x: torch.Tensor, weight: torch.Tensor, prologue: RowPrologue) -> bool:
    """Whether gemv_fused takes this row: one K-contiguous row of the weight's 16-bit dtype (the norm
    weight's too), and for gated_rmsnorm K a multiple of the group (a power of two, at most the K tile)."""
    k = weight.shape[1]
    ok = x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1 and x.dtype == weight.dtype
    ok = ok and x.dtype in (torch.bfloat16, torch.float16) and weight.stride(-1) == 1
    ok = ok and x.shape[1] == (2 * k if prologue.kind == "silu_mul" else k)
    ok = ok and (prologue.weight is None or prologue.weight.dtype == x.dtype)  # the norms' rounding
    if prologue.kind == "gated_rmsnorm":
        g = prologue.group
        cfg = pick_gemv_config(1, weight.shape[0], k, sm_count_for(x), x.dtype)
        ok = ok and g & (g - 1) == 0 and k % g == 0 and cfg.block_k % g == 0
    return ok


def gemv_fused(
    x: torch.Tensor,  # [1, K] ([1, 2K] gate | up for silu_mul)
    weight: torch.Tensor,  # [N, K]
    prologue: RowPrologue,
    out: torch.Tensor | None = None,  # [1, N]
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """gemv(prologue(x), weight) in one launch (plus gemv's split-K reduce), equal to gemv_fused_ref
    within the norms' rounding; writes prologue.residual_out where it has a residual."""
    assert fusable(x, weight, prologue), "gemv_fused takes one K-contiguous 16-bit row (see fusable)"
    n, k = weight.shape
    if out is None:
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    cfg = config or pick_gemv_config(1, n, k, sm_count_for(x), x.dtype)
    assert cfg.block_m == 1, "gemv_fused runs gemv's one-row tiling"
    k_per_split, split = k_splits(k, cfg.split_k, cfg.block_k)
    part = out if split == 1 else torch.empty((split, 1, n), dtype=torch.float32, device=x.device)
    p = prologue
    res = p.residual if p.residual is not None else x
    res_out = p.residual_out if p.residual_out is not None else x
    if p.residual is not None:
        assert res.shape == x.shape and res_out.shape == x.shape and res.stride(-1) == 1 and res_out.is_contiguous()
        assert res_out.data_ptr() not in (x.data_ptr(), res.data_ptr()), "residual_out must be a tensor of its own"
    z = p.gate if p.gate is not None else x
    assert z.stride(-1) == 1
    nw = p.weight if p.weight is not None else x
    _gemv_fused_kernel[(cdiv(n, cfg.block_n), split)](
        x, res, res_out, z, nw, weight, out, part, n, k, weight.stride(0), k_per_split, p.eps,
        KIND=KINDS.index(p.kind), HAS_RES=p.residual is not None, GROUP=max(p.group, 1), ROUND_PRODUCT=True,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IS_SPLIT=split > 1, EVEN_K=k % cfg.block_k == 0, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_args(x),
    )  # fmt: skip
    if split > 1:
        splitk_reduce(part, out, round_to=x.dtype)
    return out
