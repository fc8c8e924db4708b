"""Qwen3.5's norms: the GDN output's gated RMSNorm and the zero-centred RMSNorm (+ residual), Triton
against the torch references, and the references against transformers' modules bit for bit."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import gated_rmsnorm, gated_rmsnorm_ref, rmsnorm_zero_centred, rmsnorm_zero_centred_ref
from mllmd_kernels.testing import (
    DTYPES_WITH_FP32,
    close_tol,
    kernel_device,
    on_gpu,
    poisoned,
    randn,
    skip_reason,
)

DEVICE = kernel_device()
needs_kernels = pytest.mark.skipif(DEVICE is None, reason=skip_reason())

# [T, H, D]: the GDN output per value head (D = head_v_dim)
GATED_SHAPES = [(3, 4, 32), (7, 2, 128), (1, 16, 128), (5, 3, 48)]
if on_gpu():
    GATED_SHAPES += [(2048, 32, 128), (1, 32, 128), (64, 16, 128)]
NORM_SHAPES = [(1, 64), (7, 100), (3, 5, 256)] + ([(1, 2560), (2048, 4096), (33, 16, 256)] if on_gpu() else [])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize("shape", GATED_SHAPES)
@pytest.mark.parametrize("fp32_weight", [False, True])
def test_gated_rmsnorm_matches_reference(shape: tuple[int, ...], dtype: torch.dtype, fp32_weight: bool) -> None:
    g = torch.Generator().manual_seed(sum(shape) + fp32_weight)
    x = randn(*shape, dtype=dtype, device=DEVICE, gen=g, scale=2.0)
    z = randn(*shape, dtype=dtype, device=DEVICE, gen=g, scale=2.0)
    w = randn(shape[-1], dtype=torch.float32 if fp32_weight else dtype, device=DEVICE, gen=g, scale=0.1) + 1
    out = poisoned(shape, dtype, DEVICE)
    got = gated_rmsnorm(x, z, w, 1e-6, out=out)
    assert got is out and not out.isnan().any(), "some outputs were never written"
    torch.testing.assert_close(got, gated_rmsnorm_ref(x, z, w, 1e-6), **close_tol(dtype))


@needs_kernels
def test_gated_rmsnorm_strided_rows_and_in_place() -> None:
    """The model's o and z come as [T * Hv, Dv] views (z a slice of a wider projection); out may be x."""
    g = torch.Generator().manual_seed(4)
    zx = randn(6, 3 * 64, dtype=torch.bfloat16, device=DEVICE, gen=g)
    z = zx[:, 64:].reshape(6, 2, 64)  # row stride 192 over the first dim
    x = randn(6, 2, 64, dtype=torch.bfloat16, device=DEVICE, gen=g)
    w = randn(64, dtype=torch.bfloat16, device=DEVICE, gen=g) + 1
    expect = gated_rmsnorm_ref(x, z, w, 1e-6)
    gated_rmsnorm(x, z, w, 1e-6, out=x)
    torch.testing.assert_close(x, expect, **close_tol(torch.bfloat16))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_zero_centred_matches_reference(shape: tuple[int, ...], dtype: torch.dtype, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(sum(shape) * 3 + with_residual)
    x = randn(*shape, dtype=dtype, device=DEVICE, gen=g, scale=3.0)
    w = randn(shape[-1], dtype=dtype, device=DEVICE, gen=g, scale=0.3)  # offsets from 1, as stored
    out = poisoned(shape, dtype, DEVICE)
    if with_residual:
        res = randn(*shape, dtype=dtype, device=DEVICE, gen=g)
        res_out = poisoned(shape, dtype, DEVICE)
        got, got_res = rmsnorm_zero_centred(x, w, 1e-6, residual=res, out=out, residual_out=res_out)
        exp, exp_res = rmsnorm_zero_centred_ref(x, w, 1e-6, residual=res)
        assert got_res is res_out
        torch.testing.assert_close(got_res, exp_res, **close_tol(dtype))
    else:
        got = rmsnorm_zero_centred(x, w, 1e-6, out=out)
        exp = rmsnorm_zero_centred_ref(x, w, 1e-6)
    assert got is out and not out.isnan().any(), "some outputs were never written"
    torch.testing.assert_close(got, exp, **close_tol(dtype))


@needs_kernels
def test_rmsnorm_zero_centred_in_place() -> None:
    g = torch.Generator().manual_seed(2)
    x = randn(5, 256, dtype=torch.bfloat16, device=DEVICE, gen=g)
    r = randn(5, 256, dtype=torch.bfloat16, device=DEVICE, gen=g)
    w = randn(256, dtype=torch.bfloat16, device=DEVICE, gen=g, scale=0.2)
    exp, exp_res = rmsnorm_zero_centred_ref(x, w, 1e-6, residual=r)
    rmsnorm_zero_centred(x, w, 1e-6, residual=r, out=x, residual_out=r)
    torch.testing.assert_close(x, exp, **close_tol(torch.bfloat16))
    torch.testing.assert_close(r, exp_res, **close_tol(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_references_are_transformers_modules(dtype: torch.dtype) -> None:
    """gated_rmsnorm_ref is Qwen3_5RMSNormGated and rmsnorm_zero_centred_ref Qwen3_5RMSNorm, bit for bit
    (weights in the model dtype, as loaded)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

    g = torch.Generator().manual_seed(7)
    gated = Qwen3_5RMSNormGated(64, eps=1e-6).to(dtype)
    norm = Qwen3_5RMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        gated.weight.copy_(torch.randn(64, generator=g) * 0.1 + 1)
        norm.weight.copy_(torch.randn(96, generator=g) * 0.3)
    x, z = (torch.randn(10, 64, generator=g).to(dtype) * 2 for _ in range(2))
    y = torch.randn(4, 3, 96, generator=g).to(dtype)
    with torch.no_grad():
        assert torch.equal(gated_rmsnorm_ref(x, z, gated.weight, 1e-6), gated(x, z))
        assert torch.equal(rmsnorm_zero_centred_ref(y, norm.weight, 1e-6), norm(y))
