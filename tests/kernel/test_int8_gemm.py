"""int8_gemm (int8 x int8 -> int32 on tensor cores, scales in the epilogue) against its torch reference.

The int32 accumulation is checked exactly (unit scales, float32 output, against the exact integer
products summed in float64); the epilogue with real scales and bias against int8_gemm_ref.
"""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import Int8GemmConfig, int8_gemm, int8_gemm_ref, w8a8_linear, w8a8_linear_ref
from mllmd_kernels.testing import (
    DTYPES,
    REL_TOL,
    close_tol,
    kernel_device,
    on_gpu,
    poisoned,
    randn,
    rel_err,
    skip_reason,
)

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=skip_reason())

# (M, N, K): one row, uneven N and K, past 16 rows, the skinny/gemm boundary, a prefill tile and a half.
SMALL = [(1, 40, 96), (5, 72, 200), (17, 33, 130), (64, 24, 64), (130, 70, 256)]
# Qwen3-8B projections (qkv, o, gate_up, down) at decode and prefill sizes; odd N, K off the block.
GPU = [
    (1, 6144, 4096),
    (1, 4096, 12288),
    (7, 24576, 4096),
    (16, 4096, 4096),
    (64, 6144, 4096),
    (100, 4096, 12288),
    (333, 6145, 4104),
    (2048, 6144, 4096),
    (2048, 4096, 12288),
]
SHAPES = SMALL + (GPU if on_gpu() else [])


def _int8(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8).to(DEVICE)


def _exact_acc(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float32(sum_k a b): the exact integer sum (float64 holds it), rounded once as the kernel's
    int32 -> float32 conversion rounds it."""
    return (a.double() @ b.double().t()).float()


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_int8_gemm_accumulates_exactly(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    a, b = _int8(m, k, gen=g), _int8(n, k, gen=g)
    a[0, :] = -128  # the extreme products
    b[0, :] = -128
    out = poisoned((m, n), torch.float32, DEVICE)
    int8_gemm(a, b, torch.ones(m, 1, device=DEVICE), torch.ones(n, 1, device=DEVICE), torch.float32, out=out)
    assert torch.equal(out, _exact_acc(a, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_int8_gemm_epilogue_matches_reference(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(m * 7 + n * 3 + k)
    a, b = _int8(m, k, gen=g), _int8(n, k, gen=g)
    a_scale = (torch.rand(m, 1, generator=g) * 0.05 + 1e-3).to(DEVICE)
    b_scale = (torch.rand(n, 1, generator=g) * 0.01 / k**0.5 + 1e-5).to(DEVICE)
    bias = randn(n, dtype=dtype, device=DEVICE, gen=g) if m % 2 else None
    out = poisoned((m, n), dtype, DEVICE)
    int8_gemm(a, b, a_scale, b_scale, dtype, bias, out=out)
    assert not out.isnan().any(), "some outputs were never written"
    torch.testing.assert_close(out, int8_gemm_ref(a, b, a_scale, b_scale, dtype, bias), **close_tol(dtype))


CONFIGS = [
    Int8GemmConfig("skinny", 16, 16, 32, 1, 3, 4, 2),  # split-K, partial last split, uneven K
    Int8GemmConfig("skinny", 32, 32, 64, 1, 2, 4, 3),
    Int8GemmConfig("skinny", 16, 64, 128, 1, 1, 4, 2),
    Int8GemmConfig("gemm", 16, 32, 32, 2, 1, 4, 2),  # swizzled groups of tiles, partial edge tiles
    Int8GemmConfig("gemm", 32, 16, 64, 3, 1, 4, 3),
]


@pytest.mark.parametrize(
    "cfg", CONFIGS, ids=lambda c: f"{c.mode}-m{c.block_m}n{c.block_n}k{c.block_k}s{c.split_k}"
)
def test_int8_gemm_explicit_tilings(cfg: Int8GemmConfig) -> None:
    """Explicit tilings on a strided a, with bias: exact accumulation, reference epilogue."""
    m = min(cfg.block_m - 3, 13) if cfg.mode == "skinny" else 45
    n, k = 50, 232
    g = torch.Generator().manual_seed(cfg.block_n * 100 + cfg.split_k + cfg.block_m)
    a = _int8(m, k + 16, gen=g)[:, 8 : 8 + k]  # row stride k + 16
    b = _int8(n, k, gen=g)
    ones_m, ones_n = torch.ones(m, 1, device=DEVICE), torch.ones(n, 1, device=DEVICE)
    assert torch.equal(int8_gemm(a, b, ones_m, ones_n, torch.float32, config=cfg), _exact_acc(a, b))
    a_scale = (torch.rand(m, 1, generator=g) * 0.05).to(DEVICE)
    b_scale = (torch.rand(n, 1, generator=g) * 1e-3).to(DEVICE)
    bias = randn(n, dtype=torch.bfloat16, device=DEVICE, gen=g)
    out = int8_gemm(a, b, a_scale, b_scale, torch.bfloat16, bias, config=cfg)
    ref = int8_gemm_ref(a, b, a_scale, b_scale, torch.bfloat16, bias)
    torch.testing.assert_close(out, ref, **close_tol(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 48, 128), (19, 40, 96)] + ([(2048, 4096, 4096)] if on_gpu() else [])
)
def test_w8a8_linear_matches_reference(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    """Activation quantization + GEMM end to end, against the float64-exact reference and float x @ W^T."""
    g = torch.Generator().manual_seed(m + n + k)
    x = randn(m, k, dtype=dtype, device=DEVICE, gen=g)
    w_float = randn(n, k, dtype=torch.float32, device="cpu", gen=g)
    w_scale = w_float.abs().amax(1, keepdim=True) / 127
    w = torch.clamp((w_float / w_scale).round(), -128, 127).to(torch.int8)
    w, w_scale = w.to(DEVICE), w_scale.to(DEVICE)
    out = w8a8_linear(x, w, w_scale)
    torch.testing.assert_close(out, w8a8_linear_ref(x, w, w_scale), **close_tol(dtype))
    dense = x.float() @ (w.float() * w_scale).t()
    assert rel_err(out, dense) < REL_TOL[dtype] + 1e-2  # int8 activations: ~0.5% on Gaussian rows


def test_int8_gemm_empty_batch() -> None:
    b = torch.ones(8, 32, dtype=torch.int8, device=DEVICE)
    a = torch.zeros(0, 32, dtype=torch.int8, device=DEVICE)
    out = int8_gemm(a, b, torch.ones(0, 1, device=DEVICE), torch.ones(8, 1, device=DEVICE), torch.float16)
    assert out.shape == (0, 8)
