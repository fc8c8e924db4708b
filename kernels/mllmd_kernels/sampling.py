"""gumbel_argmax: seeded sampling of unfiltered rows in one kernel, bit for bit the torch sampler.

Row s samples argmax_c ((x[c] - max(x)) / T + g(k, c)) over the whole vocabulary, where g is the
stateless Gumbel noise of mllmd/engine/sampling/gumbel.py (32-bit lowbias32 hashes of the column
under the row key k, mapped to (0, 1) and through -log(-log(u)) in float64, rounded to float32).
Ties go to the smallest column, as torch.argmax does. One program per row: a pass for the row max,
then a pass that hashes, adds and keeps the running argmax, so the [rows, V] noise and score tensors
the torch path materialises are never written.

The hash runs on uint32 words held in int64 and masked after each multiply, exactly as the torch
code does (products stay below 2^63), so the words are identical on any device.
"""

from __future__ import annotations

import torch

from mllmd_kernels._triton import tl, triton

MASK32 = 0xFFFFFFFF
MIX_MUL1 = 0x21F0AAAD
MIX_MUL2 = 0x735A2D97


def gumbel_argmax_ref(
    logits: torch.Tensor,  # [B, V] float32
    rows: torch.Tensor,  # [S] int64: the logits row of each sampled row
    keys: torch.Tensor,  # [S, 2] int64 row keys (gumbel.row_keys)
    temperatures: torch.Tensor,  # [S] float32 > 0
) -> torch.Tensor:
    """Torch reference, the sampler's own unfiltered path: int64 [S]."""
    from mllmd.engine.sampling.gumbel import gumbel_noise

    x = logits[rows].float()
    z = (x - x.max(dim=-1, keepdim=True).values).div_(temperatures[:, None])
    return (z + gumbel_noise(keys, x.shape[1])).argmax(dim=-1)


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride_l, rows_ptr, keys_ptr, temps_ptr, out_ptr, V, BLOCK: tl.constexpr):
    s = tl.program_id(0)
    base = logits_ptr + tl.load(rows_ptr + s).to(tl.int64) * stride_l
    offs = tl.arange(0, BLOCK)
    row_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    for off in range(0, V, BLOCK):
        x = tl.load(base + off + offs, mask=off + offs < V, other=float("-inf"))
        row_max = tl.maximum(row_max, x)
    m = tl.max(row_max, axis=0)
    t = tl.load(temps_ptr + s)
    k0 = tl.load(keys_ptr + 2 * s)
    k1 = tl.load(keys_ptr + 2 * s + 1)
    best = float("-inf")
    best_idx = 0
    for off in range(0, V, BLOCK):
        cols = off + offs
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=0.0)
        z = tl.math.div_rn(x - m, t)  # correctly rounded, as torch's division
        h = _mix32(_mix32(cols.to(tl.int64) ^ k0) ^ k1)
        u = (h.to(tl.float64) + 0.5) * 2.3283064365386963e-10  # 2^-32, exact
        g = (-tl.log(-tl.log(u))).to(tl.float32)
        score = tl.where(mask, z + g, float("-inf"))
        blk = tl.max(score, axis=0)
        idx = tl.min(tl.where(score == blk, cols, V), axis=0)  # first column holding the block max
        take = blk > best  # strictly: an earlier block keeps ties
        best_idx = tl.where(take, idx, best_idx)
        best = tl.where(take, blk, best)
    tl.store(out_ptr + s, best_idx.to(tl.int64))


def gumbel_argmax(
    logits: torch.Tensor,  # [B, V] float32 (row stride any, columns contiguous)
    rows: torch.Tensor,  # [S] int64
    keys: torch.Tensor,  # [S, 2] int64
    temperatures: torch.Tensor,  # [S] float32
    out: torch.Tensor | None = None,  # [S] int64
) -> torch.Tensor:
    """Triton version of gumbel_argmax_ref (same tokens); no host synchronisation."""
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    keys = keys.contiguous()
    s = rows.numel()
    if out is None:
        out = torch.empty(s, dtype=torch.int64, device=logits.device)
    if s:
        _gumbel_argmax_kernel[(s,)](
            logits, logits.stride(0), rows, keys, temperatures, out, logits.shape[1], BLOCK=1024, num_warps=8
        )
    return out
