"""gemv (decode GEMV / skinny GEMM) against x.float() @ W.float().T on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import GemvConfig, gemv, gemv_ref
from mllmd_kernels.testing import (
    DTYPES_WITH_FP32,
    REL_TOL,
    kernel_device,
    on_gpu,
    poisoned,
    randn,
    rel_err,
    skip_reason,
)

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=skip_reason())

# (M, N, K): one row, uneven N and K, a few rows, past 16 rows, the largest batch.
SMALL = [(1, 40, 96), (1, 72, 200), (2, 24, 64), (5, 48, 128), (8, 20, 72), (17, 33, 130), (64, 40, 64)]
GPU = [(1, 4096, 4096), (1, 6144, 4096), (4, 4096, 12288), (16, 24576, 4096), (33, 4096, 4096), (64, 6144, 4096)]
SHAPES = SMALL + (GPU if on_gpu() else [])


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_gemv_matches_reference(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    x = randn(m, k, dtype=dtype, device=DEVICE, gen=g)
    w = randn(n, k, dtype=dtype, device=DEVICE, gen=g, scale=k**-0.5)
    out = poisoned((m, n), dtype, DEVICE)
    gemv(x, w, out=out)
    assert not out.isnan().any(), "some outputs were never written"
    assert rel_err(out, gemv_ref(x.float(), w.float())) < REL_TOL[dtype]


CONFIGS = [
    GemvConfig(block_m=1, block_n=8, block_k=32, split_k=3, num_warps=4, num_stages=1),
    GemvConfig(block_m=1, block_n=16, block_k=64, split_k=1, num_warps=4, num_stages=2),
    GemvConfig(block_m=4, block_n=4, block_k=64, split_k=2, num_warps=4, num_stages=1),
    GemvConfig(block_m=8, block_n=8, block_k=32, split_k=1, num_warps=4, num_stages=1),
    GemvConfig(block_m=16, block_n=16, block_k=32, split_k=2, num_warps=4, num_stages=2),
    GemvConfig(block_m=64, block_n=32, block_k=64, split_k=4, num_warps=4, num_stages=3),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"m{c.block_m}n{c.block_n}k{c.block_k}s{c.split_k}")
def test_gemv_split_k_and_tiles(cfg: GemvConfig, dtype: torch.dtype) -> None:
    """Explicit tilings, split-K included (uneven K, partial last split), on a strided x."""
    m = 1 if cfg.block_m == 1 else min(cfg.block_m - 1, 13)
    n, k = 50, 232
    g = torch.Generator().manual_seed(cfg.block_n * 100 + cfg.split_k)
    x = randn(m, k + 8, dtype=dtype, device=DEVICE, gen=g)[:, 4 : 4 + k]  # row stride k + 8
    w = randn(n, k, dtype=dtype, device=DEVICE, gen=g, scale=k**-0.5)
    out = gemv(x, w, config=cfg)
    assert out.shape == (m, n) and not out.isnan().any()
    assert rel_err(out, gemv_ref(x.float(), w.float())) < REL_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"m{c.block_m}n{c.block_n}k{c.block_k}s{c.split_k}")
def test_gemv_float32_out_is_the_rounded_output(cfg: GemvConfig, dtype: torch.dtype) -> None:
    """A float32 `out` (the decode step's logits) holds exactly gemv(x, w).float(): the same values,
    rounded to x's dtype, without a copy launch; every tiling, split-K included."""
    m = 1 if cfg.block_m == 1 else min(cfg.block_m - 1, 13)
    n, k = 50, 232
    g = torch.Generator().manual_seed(cfg.block_n * 100 + cfg.split_k + 7)
    x = randn(m, k, dtype=dtype, device=DEVICE, gen=g)
    w = randn(n, k, dtype=dtype, device=DEVICE, gen=g, scale=k**-0.5)
    out = poisoned((m, n), torch.float32, DEVICE)
    assert gemv(x, w, out=out, config=cfg) is out
    assert torch.equal(out, gemv(x, w, config=cfg).float())
    assert torch.equal(out, out.to(dtype).float()), "values must be representable in x's dtype"
