"""rmsnorm (+ fused residual add) against the torch module's numerics on fresh random inputs;
rmsnorm_int8 against int8_quant(rmsnorm(...)) bit for bit and against its torch reference."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import int8_quant, rmsnorm, rmsnorm_int8, rmsnorm_int8_ref, rmsnorm_ref
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


INT8_SHAPES = [(1, 64), (9, 100), (4, 256)] + ([(1, 4096), (2048, 4096), (300, 5120)] if on_gpu() else [])


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize("shape", INT8_SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_int8_equals_rmsnorm_then_int8_quant(shape: tuple[int, int], dtype: torch.dtype, with_residual: bool) -> None:
    """One launch gives what rmsnorm then int8_quant give, bit for bit (a W8A8 projection sees the same
    int8 rows either way), and the same new residual; rows of different magnitudes, every row written."""
    g = torch.Generator().manual_seed(shape[0] * 31 + shape[1] + with_residual)
    rows = torch.logspace(-2, 2, shape[0]).view(-1, 1)
    x = (randn(*shape, dtype=torch.float32, device="cpu", gen=g) * rows).to(dtype=dtype, device=DEVICE)
    w = randn(shape[1], dtype=dtype, device=DEVICE, gen=g, scale=0.1) + 1
    res = randn(*shape, dtype=dtype, device=DEVICE, gen=g) if with_residual else None
    got = rmsnorm_int8(x, w, 1e-6, res)
    plain = rmsnorm(x, w, 1e-6, res)
    normed = plain[0] if with_residual else plain
    q2, s2 = int8_quant(normed)
    q, s = got[0], got[1]
    assert q.dtype == torch.int8 and q.shape == shape and s.shape == (shape[0], 1) and not s.isnan().any()
    if not on_gpu():  # the interpreter sums in one order whatever the layout
        assert torch.equal(s, s2), "scales differ from int8_quant(rmsnorm(...))"
        assert torch.equal(q, q2), f"{int((q != q2).sum())} quantized values differ"
    else:
        # Not bit for bit on the H200 (Triton 3.6): 1 in 7 rows of 2,048 x 4,096 fp32 had a scale one
        # unit in the last place apart, and a few q values differed by 1 at fp16 with equal scales.
        # With 16-byte-aligned rows Triton gives the quantizing variant 16 elements per thread (its
        # int8 store) against 4 (fp32) or 8 (16-bit) for plain rmsnorm, so the sum of squares adds in
        # another order. The model feeds its W8A8 projections from rmsnorm_int8 at every row count.
        # At fp32 a last-bit difference of rstd reaches the normed values, their max and the scale
        # (max / 127.5). On the H200, at 2,048 x 4,096 and 300 x 5,120, a bound of 1 unit in the last
        # place failed and so did one of 2 (some rows further apart); 4 passed. Allowed here: 4.
        ulps = (s - s2).abs() / (torch.finfo(torch.float32).eps * torch.exp2(torch.floor(torch.log2(s2.abs()))))
        assert float(ulps.max()) <= 4, f"scales up to {float(ulps.max())} units in the last place apart"
        assert int((q.int() - q2.int()).abs().max()) <= 1 and int((q != q2).sum()) <= max(1, q.numel() // 1000)
    if with_residual:
        assert torch.equal(got[2], plain[1]), "the new residual differs"
    ref = rmsnorm_int8_ref(x, w, 1e-6, res)
    torch.testing.assert_close(s, ref[1], rtol=2e-2 if dtype != torch.float32 else 1e-5, atol=0)
    assert int((q.int() - ref[0].int()).abs().max()) <= (1 if dtype == torch.float32 else 3)


def test_rmsnorm_int8_strided_and_zero_rows() -> None:
    x = torch.zeros(3, 80)
    x[1, :64] = torch.linspace(-2, 2, 64)
    x[2] = 5.0
    xs = x.to(device=DEVICE, dtype=torch.bfloat16)[:, :64]  # row stride 80
    w = torch.ones(64, dtype=torch.bfloat16, device=DEVICE)
    q, s = rmsnorm_int8(xs, w, 1e-6)
    assert float(s[0]) == torch.finfo(torch.float32).eps and not q[0].any()
    q2, s2 = int8_quant(rmsnorm(xs, w, 1e-6))
    assert torch.equal(q, q2) and torch.equal(s, s2)
    q3, s3, r3 = rmsnorm_int8(xs, w, 1e-6, xs)  # residual = x: the rows doubled
    q4, s4 = int8_quant(rmsnorm(xs * 2, w, 1e-6))
    assert torch.equal(r3, xs * 2) and torch.equal(q3, q4) and torch.equal(s3, s4)
