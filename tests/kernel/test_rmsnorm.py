"""rmsnorm (+ fused residual add) against the torch module's numerics on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import rmsnorm, rmsnorm_ref
from mllmd_kernels.testing import (
    DTYPES_WITH_FP32,
    close_tol,
    kernel_device,
    on_gpu,
    poisoned,
    randn,
    skip_reason,
)

from mllmd.models.layers.norm import RMSNorm

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=skip_reason())

SHAPES = [(1, 64), (7, 100), (3, 5, 128)] + ([(1, 4096), (256, 4096), (33, 8, 128), (5, 5120)] if on_gpu() else [])


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_matches_reference(shape: tuple[int, ...], dtype: torch.dtype, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(sum(shape) * 13 + with_residual)
    h = shape[-1]
    x = randn(*shape, dtype=dtype, device=DEVICE, gen=g, scale=3.0)
    w = randn(h, dtype=dtype, device=DEVICE, gen=g, scale=0.1) + 1
    eps = 1e-6
    out = poisoned(shape, dtype, DEVICE)
    if with_residual:
        res = randn(*shape, dtype=dtype, device=DEVICE, gen=g)
        res_out = poisoned(shape, dtype, DEVICE)
        got, got_res = rmsnorm(x, w, eps, residual=res, out=out, residual_out=res_out)
        exp, exp_res = rmsnorm_ref(x, w, eps, residual=res)
        assert got is out and got_res is res_out and not res_out.isnan().any()
        torch.testing.assert_close(got_res, exp_res, **close_tol(dtype))
    else:
        got = rmsnorm(x, w, eps, out=out)
        exp = rmsnorm_ref(x, w, eps)
    assert not out.isnan().any(), "some outputs were never written"
    torch.testing.assert_close(got, exp, **close_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_is_the_model_layer(dtype: torch.dtype) -> None:
    """rmsnorm_ref is the same function as the model's RMSNorm module (both call forms)."""
    g = torch.Generator().manual_seed(5)
    layer = RMSNorm(96, eps=1e-6, dtype=dtype)
    layer.weight.data.copy_(torch.randn(96, generator=g))
    x, r = torch.randn(4, 96, generator=g).to(dtype), torch.randn(4, 96, generator=g).to(dtype)
    torch.testing.assert_close(rmsnorm_ref(x, layer.weight, 1e-6), layer(x), rtol=0, atol=0)
    a, b = rmsnorm_ref(x, layer.weight, 1e-6, residual=r)
    c, d = layer(x, r)
    torch.testing.assert_close(a, c, rtol=0, atol=0)
    torch.testing.assert_close(b, d, rtol=0, atol=0)


def test_rmsnorm_in_place() -> None:
    """out / residual_out may alias the inputs (how a decoder layer would call it)."""
    g = torch.Generator().manual_seed(9)
    x = randn(6, 256, dtype=torch.bfloat16, device=DEVICE, gen=g)
    r = randn(6, 256, dtype=torch.bfloat16, device=DEVICE, gen=g)
    w = randn(256, dtype=torch.bfloat16, device=DEVICE, gen=g)
    exp, exp_res = rmsnorm_ref(x, w, 1e-6, residual=r)
    rmsnorm(x, w, 1e-6, residual=r, out=x, residual_out=r)
    torch.testing.assert_close(x, exp, **close_tol(torch.bfloat16))
    torch.testing.assert_close(r, exp_res, **close_tol(torch.bfloat16))
