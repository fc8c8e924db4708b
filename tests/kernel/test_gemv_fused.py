"""gemv_fused (the one-row GEMV with RMSNorm / zero-centred RMSNorm / SiLU-and-mul / gated RMSNorm
applied to x in its launch) against its torch reference and against the unfused kernels, on fresh
random inputs."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import GemvConfig, gemv, rmsnorm, silu_and_mul
from mllmd_kernels.gemv_fused import RowPrologue, fusable, gemv_fused, gemv_fused_ref
from mllmd_kernels.testing import REL_TOL, kernel_device, on_gpu, poisoned, randn, rel_err, skip_reason

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=skip_reason())

DTYPES = [torch.bfloat16, torch.float16]
# (N, K): uneven N, K below and above one K tile, K not a multiple of the tile; on a GPU the 2B and
# 8B projections (hidden 2048 / 4096 into qkv and gate/up; 6,144 / 12,288 into down).
SMALL = [(40, 96), (72, 256), (33, 1280)]
GPU = [(4096, 2048), (12288, 2048), (2048, 6144), (6144, 4096), (4096, 12288)]
SHAPES = SMALL + (GPU if on_gpu() else [])
SPLIT_CONFIGS = [
    GemvConfig(block_m=1, block_n=8, block_k=64, split_k=3, num_warps=4, num_stages=1),
    GemvConfig(block_m=1, block_n=4, block_k=128, split_k=2, num_warps=4, num_stages=1),
]


def _prologue(kind: str, k: int, dtype: torch.dtype, g: torch.Generator, residual: bool, group: int = 32
              ) -> tuple[torch.Tensor, RowPrologue]:  # fmt: skip
    """x and a prologue of `kind` over K = k (x is [1, 2k] for silu_mul)."""
    x = randn(1, 2 * k if kind == "silu_mul" else k, dtype=dtype, device=DEVICE, gen=g, scale=2.0)
    if kind == "silu_mul":
        return x, RowPrologue(kind)
    if kind == "gated_rmsnorm":
        z = randn(1, k, dtype=dtype, device=DEVICE, gen=g, scale=2.0)
        w = randn(group, dtype=dtype, device=DEVICE, gen=g)
        return x, RowPrologue(kind, w, 1e-6, gate=z, group=group)
    w = randn(k, dtype=dtype, device=DEVICE, gen=g, scale=0.5)
    if kind == "rmsnorm":
        w = w + 1.0
    if not residual:
        return x, RowPrologue(kind, w, 1e-6)
    r = randn(1, k, dtype=dtype, device=DEVICE, gen=g, scale=2.0)
    return x, RowPrologue(kind, w, 1e-6, residual=r, residual_out=poisoned((1, k), dtype, DEVICE))


KINDS = [("rmsnorm", False), ("rmsnorm", True), ("rmsnorm_zero_centred", False), ("rmsnorm_zero_centred", True),
         ("silu_mul", False), ("gated_rmsnorm", False)]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize(("kind", "residual"), KINDS, ids=[f"{k}{'+res' if r else ''}" for k, r in KINDS])
def test_gemv_fused_matches_reference(kind: str, residual: bool, n: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n * 31 + k + len(kind))
    group = 128 if k % 128 == 0 else 32
    x, pro = _prologue(kind, k, dtype, g, residual, group)
    w = randn(n, k, dtype=dtype, device=DEVICE, gen=g, scale=k**-0.5)
    assert fusable(x, w, pro)
    out = poisoned((1, n), dtype, DEVICE)
    gemv_fused(x, w, pro, out=out)
    assert not out.isnan().any(), "some outputs were never written"
    got_residual = pro.residual_out.clone() if pro.residual_out is not None else None
    want = gemv_fused_ref(x, w, pro)  # (writes the reference's residual_out)
    assert rel_err(out, want) < REL_TOL[dtype]
    if got_residual is not None:  # every element of x + residual, rounded as the norm kernels round it
        assert pro.residual is not None and pro.weight is not None
        assert torch.equal(got_residual, rmsnorm(x, pro.weight, pro.eps, pro.residual)[1])


@pytest.mark.parametrize("cfg", SPLIT_CONFIGS, ids=lambda c: f"n{c.block_n}k{c.block_k}s{c.split_k}")
@pytest.mark.parametrize(("kind", "residual"), KINDS, ids=[f"{k}{'+res' if r else ''}" for k, r in KINDS])
def test_gemv_fused_split_k_equals_the_unfused_kernels(kind: str, residual: bool, cfg: GemvConfig) -> None:
    """Split-K (a short last split) and other tiles: the same outputs as the op's own kernel followed by
    gemv with the same tiling (SiLU-and-mul bit for bit: it is elementwise, and both GEMVs sum the same
    products in the same order)."""
    n, k = 50, 320
    g = torch.Generator().manual_seed(cfg.block_k + cfg.split_k + len(kind))
    x, pro = _prologue(kind, k, torch.bfloat16, g, residual)
    w = randn(n, k, dtype=torch.bfloat16, device=DEVICE, gen=g, scale=k**-0.5)
    out = gemv_fused(x, w, pro, config=cfg)
    if kind == "silu_mul":
        assert torch.equal(out, gemv(silu_and_mul(x), w, config=cfg))
        return
    unfused = gemv(pro.input_ref(x), w, config=cfg)
    assert rel_err(out, unfused) < REL_TOL[torch.bfloat16]


def test_the_norm_really_runs() -> None:
    """Each norm changes the result (a prologue that skipped it would fail the tests above as well as this)."""
    g = torch.Generator().manual_seed(5)
    x, pro = _prologue("rmsnorm", 256, torch.bfloat16, g, residual=True)
    w = randn(24, 256, dtype=torch.bfloat16, device=DEVICE, gen=g, scale=256**-0.5)
    fused = gemv_fused(x, w, pro)
    assert pro.residual is not None
    assert rel_err(fused, gemv(x + pro.residual, w)) > 0.1


def test_fusable_refuses_what_the_kernel_does_not_take() -> None:
    g = torch.Generator().manual_seed(1)
    x, pro = _prologue("rmsnorm", 64, torch.bfloat16, g, residual=False)
    w = randn(8, 64, dtype=torch.bfloat16, device=DEVICE, gen=g)
    assert fusable(x, w, pro)
    assert not fusable(torch.cat([x, x]), w, pro), "two rows"
    assert not fusable(x.float(), w.float(), pro), "float32"
    assert not fusable(x[:, :32], w, pro), "K mismatch"
    xs, silu = _prologue("silu_mul", 64, torch.bfloat16, g, residual=False)
    assert fusable(xs, w, silu) and not fusable(x, w, silu), "silu_mul takes gate | up: 2K"
    xg, gated = _prologue("gated_rmsnorm", 64, torch.bfloat16, g, residual=False, group=24)
    assert not fusable(xg, w, gated), "a group that is not a power of two"
    with pytest.raises(ValueError, match="residual"):
        RowPrologue("silu_mul", residual=x, residual_out=x.clone())
    with pytest.raises(ValueError, match="unknown prologue"):
        RowPrologue("layernorm", x)
