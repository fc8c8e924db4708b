"""int8_quant (per-token symmetric int8 activations) against its torch reference, bit for bit."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import int8_quant, int8_quant_ref
from mllmd_kernels.testing import DTYPES_WITH_FP32, kernel_device, on_gpu, randn, skip_reason

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=skip_reason())

# (M, K): one row, uneven K, several rows; on the GPU also the Qwen3-8B widths and a long prefill.
SMALL = [(1, 96), (3, 200), (9, 130)]
GPU = [(1, 4096), (16, 12288), (2048, 4096), (333, 5000)]
SHAPES = SMALL + (GPU if on_gpu() else [])


def _poisoned_outputs(m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.full((m, k), 99, dtype=torch.int8, device=DEVICE)  # a value no row here quantizes to
    s = torch.full((m, 1), float("nan"), dtype=torch.float32, device=DEVICE)
    return q, s


def _check(x: torch.Tensor, **kwargs: int) -> None:
    m, k = x.shape
    q, s = _poisoned_outputs(m, k)
    int8_quant(x, out=q, scale=s, **kwargs)
    q_ref, s_ref = int8_quant_ref(x)
    assert torch.equal(s, s_ref), "scales differ"
    assert torch.equal(q, q_ref), f"{int((q != q_ref).sum())} quantized values differ"


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize(("m", "k"), SHAPES)
def test_int8_quant_matches_reference_exactly(m: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(m * 131 + k)
    # Rows spanning five decades of magnitude, so scales of every size are rounded.
    x = randn(m, k, dtype=torch.float32, device="cpu", gen=g) * torch.logspace(-3, 2, m).view(m, 1)
    _check(x.to(dtype=dtype, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
def test_int8_quant_edge_rows_and_two_pass(dtype: torch.dtype) -> None:
    """A zero row (eps scale), exact half-way ties (round to even), the positive extreme (127), a
    strided x; and the two-pass kernel for rows longer than one block."""
    k = 72
    x = torch.zeros(4, k + 8)
    x[1, :6] = torch.tensor([127.5, 0.5, 1.5, 2.5, -3.5, -127.5])  # scale exactly 1.0: ties
    x[2] = torch.linspace(-1.0, 3.0, k + 8)
    x[3, 5] = -7.0
    xs = x.to(dtype=dtype, device=DEVICE)[:, 4 : 4 + k]  # row stride k + 8
    _check(xs)
    _check(xs, block_k=32)  # 3 blocks per row, the last one partial


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_quant_rows_of_every_magnitude(dtype: torch.dtype) -> None:
    """The quotient x / scale comes from a reciprocal and an fma correction (rows with a scale below
    2**-90 divide instead): equal to torch's correctly rounded division for rows from 1e-39 to 1e30
    in size (1e-39: a scale whose reciprocal overflows; float32 only, as Triton's interpreter widens
    bfloat16 subnormals wrongly), both sides of the switch included, values at exact ties among them."""
    g = torch.Generator().manual_seed(11)
    mags = torch.tensor([1e-37, 1e-33, 1e-29, 2e-26, 1e-24, 1e-20, 1e-9, 1.0, 3e3, 1e12, 1e30])
    if dtype == torch.float32:
        mags = torch.cat([torch.tensor([1e-39]), mags])
    x = randn(len(mags), 1000, dtype=torch.float32, device="cpu", gen=g) * mags.view(-1, 1)
    x[:, 0] = 127.5 * mags  # a row's max: scale = mags exactly where that rounds, ties below
    x[:, 1:9] = torch.tensor([0.5, 1.5, 2.5, -3.5, 126.5, -0.5, 64.5, -127.5]) * mags.view(-1, 1)
    _check(x.to(dtype=dtype, device=DEVICE))


def test_int8_quant_ties_round_to_even() -> None:
    x = torch.tensor([[127.5, 0.5, 1.5, 2.5, -3.5, -127.5, -0.5, 126.5]], device=DEVICE)
    q, s = int8_quant(x)
    assert float(s) == 1.0
    assert q.tolist() == [[127, 0, 2, 2, -4, -128, 0, 126]]


def test_int8_quant_empty() -> None:
    q, s = int8_quant(torch.zeros(0, 64, device=DEVICE))
    assert q.shape == (0, 64) and s.shape == (0, 1)
