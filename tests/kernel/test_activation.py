"""silu_and_mul against silu(gate) * up in torch on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import silu_and_mul, silu_and_mul_ref
from mllmd_kernels.testing import (
    DTYPES_WITH_FP32,
    close_tol,
    kernel_device,
    on_gpu,
    poisoned,
    randn,
    skip_reason,
)

from mllmd.models.layers.activation import SiluAndMul

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=skip_reason())

SHAPES = [(1, 64), (5, 200), (2, 3, 96)] + ([(1, 24576), (129, 24576), (64, 6144)] if on_gpu() else [])


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize("shape", SHAPES)
def test_silu_and_mul_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = randn(*shape, dtype=dtype, device=DEVICE, gen=g, scale=2.0)
    out = poisoned((*shape[:-1], shape[-1] // 2), dtype, DEVICE)
    got = silu_and_mul(x, out=out)
    assert got is out and not out.isnan().any(), "some outputs were never written"
    torch.testing.assert_close(got, silu_and_mul_ref(x), **close_tol(dtype))
    # the model's module: the Triton kernel on CUDA, the reference elsewhere (exactly)
    torch.testing.assert_close(SiluAndMul()(x), got if x.is_cuda else silu_and_mul_ref(x), rtol=0, atol=0)


def test_silu_and_mul_strided_input() -> None:
    g = torch.Generator().manual_seed(3)
    x = randn(4, 160, dtype=torch.bfloat16, device=DEVICE, gen=g)[:, :128]  # row stride 160
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **close_tol(torch.bfloat16))
