"""silu_and_mul against silu(gate) * up in torch on fresh random inputs; silu_and_mul_int8 against
int8_quant(silu_and_mul(x)) bit for bit, and against the torch reference; sigmoid_gate (Qwen3.5's
attention output gate) against torch bit for bit on a GPU."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import (
    int8_quant,
    int8_quant_ref,
    sigmoid_gate,
    sigmoid_gate_ref,
    silu_and_mul,
    silu_and_mul_int8,
    silu_and_mul_int8_ref,
    silu_and_mul_ref,
)
from mllmd_kernels.int8_quant import ONE_PASS_MAX_K
from mllmd_kernels.testing import (
    DTYPES_WITH_FP32,
    close_tol,
    kernel_device,
    on_gpu,
    poisoned,
    randn,
    skip_reason,
)

from mllmd.models.layers.activation import SiluAndMul, output_gate

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


INT8_SHAPES = [(1, 64), (7, 200), (3, 2 * 1000)] + ([(1, 24576), (300, 24576), (2048, 24576)] if on_gpu() else [])


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize("shape", INT8_SHAPES)
def test_silu_and_mul_int8_equals_the_two_kernels(shape: tuple[int, int], dtype: torch.dtype) -> None:
    """One launch gives what silu_and_mul then int8_quant give, bit for bit (the model's W8A8 down
    projection sees the same input either way); every row written, scales of several sizes."""
    g = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    rows = torch.logspace(-2, 1, shape[0]).view(-1, 1)  # rows of different magnitude: different scales
    x = (randn(*shape, dtype=torch.float32, device="cpu", gen=g, scale=2.0) * rows).to(dtype=dtype, device=DEVICE)
    q, s = silu_and_mul_int8(x)
    assert q.shape == (shape[0], shape[1] // 2) and q.dtype == torch.int8
    assert s.shape == (shape[0], 1) and s.dtype == torch.float32 and not s.isnan().any()
    q2, s2 = int8_quant(silu_and_mul(x))
    assert torch.equal(s, s2), "scales differ from int8_quant(silu_and_mul(x))"
    assert torch.equal(q, q2), f"{int((q != q2).sum())} quantized values differ"
    q3, s3 = int8_quant_ref(silu_and_mul(x))  # the quantization itself as torch divides
    assert torch.equal(s, s3) and torch.equal(q, q3), "the quantization differs from torch's"
    q_ref, s_ref = silu_and_mul_int8_ref(x)
    torch.testing.assert_close(s, s_ref, rtol=2e-2 if dtype != torch.float32 else 1e-5, atol=0)
    assert int((q.int() - q_ref.int()).abs().max()) <= 1 + (dtype != torch.float32) * 2


def test_silu_and_mul_int8_strided_zero_and_wide_rows() -> None:
    """A strided x, an all-zero row (scale float32 eps, q 0), and rows wider than one register pass
    (the two-kernel fallback)."""
    x = torch.zeros(3, 2 * 96 + 32)
    x[1, :96] = torch.linspace(-4, 4, 96)
    x[1, 96:192] = 1.5
    x[2] = torch.linspace(-3, 3, x.shape[1])
    xs = x.to(device=DEVICE, dtype=torch.bfloat16)[:, :192]  # row stride 224
    q, s = silu_and_mul_int8(xs)
    assert float(s[0]) == torch.finfo(torch.float32).eps and not q[0].any()
    q2, s2 = int8_quant(silu_and_mul(xs))
    assert torch.equal(q, q2) and torch.equal(s, s2)
    d = ONE_PASS_MAX_K + 16
    wide = torch.randn(2, 2 * d, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    qw, sw = silu_and_mul_int8(wide)
    qw2, sw2 = int8_quant(silu_and_mul(wide))
    assert qw.shape == (2, d) and torch.equal(qw, qw2) and torch.equal(sw, sw2)


# (tokens, heads, head_dim)
GATE_SHAPES = [(1, 4, 32), (5, 8, 256), (3, 3, 40)] + ([(1, 8, 256), (2048, 16, 256), (7, 32, 128)] if on_gpu() else [])


def _gate_exact(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit on a GPU (expf from CUDA's math library, as torch's kernel); the interpreter's exp
    is numpy's and its float32 -> bfloat16 cast truncates: close there."""
    if on_gpu():
        assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} differ"
    else:
        torch.testing.assert_close(got, want, **close_tol(got.dtype))


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize("shape", GATE_SHAPES)
def test_sigmoid_gate_matches_torch(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    """The gate as Qwen3.5 has it: the second half of each head's [query | gate] slice of the fused qkv
    output (row stride the qkv width, head stride 2 * D); x the attention output [T, H * D]."""
    t, h, d = shape
    g = torch.Generator().manual_seed(sum(shape))
    qkv = randn(t, 2 * h * d + 4 * d, dtype=dtype, device=DEVICE, gen=g, scale=4.0)
    gate = qkv[:, : 2 * h * d].view(t, h, 2 * d)[..., d:]
    x = randn(t, h * d, dtype=dtype, device=DEVICE, gen=g, scale=2.0)
    out = poisoned((t, h * d), dtype, DEVICE)
    got = sigmoid_gate(x, gate, out=out)
    assert got is out and not out.isnan().any(), "some outputs were never written"
    want = x * torch.sigmoid(gate.reshape(t, h * d))
    _gate_exact(got, want)
    assert torch.equal(sigmoid_gate_ref(x, gate), want)
    # the model's helper: the kernel on CUDA, torch elsewhere (exactly)
    assert torch.equal(output_gate(x, gate), got if x.is_cuda else want)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy, at -inf
@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
def test_sigmoid_gate_every_value_and_in_place(dtype: torch.dtype) -> None:
    """Gates over the whole useful range (every 16-bit value of the dtype in (-90, 90), zeros, ±inf),
    a 2-D gate, and out = x."""
    if dtype == torch.float32:
        gates = torch.cat([torch.linspace(-90, 90, 1 << 16), torch.randn(1 << 14) * 1e-3])
    else:
        bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
        gates = bits.view(dtype).float()
        gates = gates[gates.isfinite() & (gates.abs() < 90)]
    gates = torch.cat([gates, torch.tensor([0.0, -0.0, float("inf"), float("-inf")])])
    n = gates.numel() // 64 * 64
    gate = gates[:n].to(dtype).view(-1, 64).to(DEVICE)
    x = randn(*gate.shape, dtype=dtype, device=DEVICE, gen=torch.Generator().manual_seed(2), scale=3.0)
    want = x * torch.sigmoid(gate)
    _gate_exact(sigmoid_gate(x, gate), want)
    sigmoid_gate(x, gate, out=x)
    _gate_exact(x, want)
