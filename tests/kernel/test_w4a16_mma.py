"""w4a16_mma (the CUDA tensor-core W4A16 decode kernel) on a GPU, against the float32 reference:
every group layout (32 / 64 / 128 / 256 columns, channel-wise), symmetric and asymmetric, 1..32 rows (1, 2 and 4 column tiles),
bias, bf16 and fp16, the Qwen3-8B shapes; under a CUDA graph with PDL launches. Skips where the
kernel cannot be built (no GPU, no nvcc)."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import pdl_launches, rmsnorm, rmsnorm_ref, silu_and_mul, w4a16_gemm, w4a16_gemm_ref
from mllmd_kernels import w4a16_mma as mma
from mllmd_kernels.testing import DTYPES, poisoned, randn, rel_err

from tests.kernel.test_w4a16_gemm import make_weights


def _reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    return mma.unavailable_reason(torch.device("cuda"))


def _tiled(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The row-major words (as the references read them) in the kernel's tile_order."""
    k = packed.shape[1] * 8
    layout = mma.mma_layout(k, k // scale.shape[1])
    assert layout is not None
    return mma.tile_order(packed, layout[0])


pytestmark = pytest.mark.skipif(_reason() is not None, reason=f"w4a16_mma unavailable: {_reason()}")
DEVICE = "cuda"
# ||out - ref|| / ||ref|| against the exact float32 result: the kernel's weights are exact and its sums
# float32, so only the output's rounding remains (bf16: ~1.1e-3 rms, fp16: ~1.4e-4).
TOL = {torch.bfloat16: 3e-3, torch.float16: 5e-4}

# (N, K, group or None for channel-wise, asymmetric)
SHAPES = [
    (16, 256, 128, False),
    (48, 512, 64, True),
    (32, 768, 32, True),
    (64, 1024, 32, False),
    (32, 1024, 256, True),
    (16, 2048, None, True),
    (80, 256, None, False),
    (6144, 4096, 128, False),  # Qwen3-8B qkv
    (4096, 12288, 128, True),  # down, asymmetric
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 16, 23, 32])
@pytest.mark.parametrize(("n", "k", "group", "asym"), SHAPES)
def test_w4a16_mma_matches_float32_reference(
    n: int, k: int, group: int | None, asym: bool, m: int, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(n * 31 + k + m)
    packed, scale, zp = make_weights(n, k, group, asym, g)
    x = randn(m, k, dtype=dtype, device=DEVICE, gen=g)
    out = poisoned((m, n), dtype, DEVICE)
    mma.w4a16_mma(x, _tiled(packed, scale), scale, zp, out=out)
    torch.cuda.synchronize()
    assert not out.isnan().any(), "some outputs were never written"
    ref = w4a16_gemm_ref(x.float(), packed, scale, zp)
    assert rel_err(out, ref) < TOL[dtype]
    for row in range(m):  # each row on its own: no row may take another's x (a row of 16 outputs has
        # more rounding spread than the whole: bf16's relative rounding reaches 3.9e-3 an output)
        assert rel_err(out[row], ref[row]) < 2 * TOL[dtype]


@pytest.mark.parametrize(("split", "warps"), [(1, 4), (1, 8), (2, 4), (4, 8), (8, 8), (3, 6)])
@pytest.mark.parametrize(("m", "group", "asym"), [(3, 128, True), (1, 128, True), (1, None, False), (1, 256, True), (29, 128, True)])
def test_w4a16_mma_every_launch_config(split: int, warps: int, m: int, group: int | None, asym: bool) -> None:
    """Each way of dividing the work gives the same sums: tiles per CTA (an N that leaves the last CTA
    a tile short), K split over warps (unevenly: 3 parts of 16 stages; 8 parts of 2, both loaded before
    the PDL wait), in both forms (one bf16 row subtracts the offset per group: a split inside a
    channel-wise or 256-column group subtracts it over the part's columns only)."""
    n, k = 16 * 37, 4096
    g = torch.Generator().manual_seed(split * 10 + warps + m)
    packed, scale, zp = make_weights(n, k, group, asym, g)
    x = randn(m, k, dtype=torch.bfloat16, device=DEVICE, gen=g)
    out = poisoned((m, n), torch.bfloat16, DEVICE)
    mma.w4a16_mma(x, _tiled(packed, scale), scale, zp, out=out, config=mma.MmaConfig(split, warps))
    ref = w4a16_gemm_ref(x.float(), packed, scale, zp)
    assert not out.isnan().any() and rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("group", [32, 128, None])
def test_w4a16_mma_offset_form_with_a_large_common_x(group: int | None, asym: bool) -> None:
    """The offset form multiplies 128 + q + 8 and subtracts (136 + zero point) * sum(x): an x whose
    mean dwarfs its spread (sum(x) large, the result small against it) still matches the reference to
    the output's rounding, as the exact form does for the same x in two rows."""
    n, k = 256, 4096
    g = torch.Generator().manual_seed(17 + (group or 0) + asym)
    packed, scale, zp = make_weights(n, k, group, asym, g)
    x = (randn(2, k, dtype=torch.float32, device=DEVICE, gen=g) * 0.05 + 4.0).to(torch.bfloat16)
    x[1] = x[0]
    ref = w4a16_gemm_ref(x[:1].float(), packed, scale, zp)
    one = mma.w4a16_mma(x[:1], _tiled(packed, scale), scale, zp)  # offset form
    two = mma.w4a16_mma(x, _tiled(packed, scale), scale, zp)  # exact form
    assert rel_err(two[:1], ref) < TOL[torch.bfloat16]
    assert rel_err(one, ref) < TOL[torch.bfloat16], (rel_err(one, ref), rel_err(two[:1], ref))


@pytest.mark.parametrize("dtype", DTYPES)
def test_w4a16_mma_bias_and_strided_rows(dtype: torch.dtype) -> None:
    """A bias in x's dtype, x rows with a stride wider than K, and an output with one too."""
    n, k, m = 96, 512, 3
    g = torch.Generator().manual_seed(5)
    packed, scale, zp = make_weights(n, k, 64, True, g)
    xs = randn(m, k + 64, dtype=dtype, device=DEVICE, gen=g)
    x = xs[:, :k]
    bias = randn(n, dtype=dtype, device=DEVICE, gen=g)
    out_buf = poisoned((m, n + 16), dtype, DEVICE)
    out = out_buf[:, :n]
    mma.w4a16_mma(x, _tiled(packed, scale), scale, zp, bias, out=out)
    ref = w4a16_gemm_ref(x.float(), packed, scale, zp, bias.float())
    assert rel_err(out, ref) < TOL[dtype]
    assert out_buf[:, n:].isnan().all(), "wrote past its output columns"


def test_w4a16_mma_equals_triton_gemv_closely() -> None:
    """The CUDA kernel and the Triton one-row gemv (both float32 sums of exact weights) agree to the
    output's rounding on a Qwen3-8B gate/up shape."""
    n, k = 24576, 4096
    g = torch.Generator().manual_seed(11)
    packed, scale, _ = make_weights(n, k, 128, False, g)
    x = randn(1, k, dtype=torch.bfloat16, device=DEVICE, gen=g)
    a = mma.w4a16_mma(x, _tiled(packed, scale), scale)
    b = w4a16_gemm(x, packed, scale)
    assert rel_err(a, b) < 3e-3


@pytest.mark.parametrize("k", [4096, 12288])
def test_w4a16_mma_in_a_cuda_graph_with_pdl(k: int) -> None:
    """Captured (with PDL launches where the GPU has them) after another kernel, replayed on new
    inputs: the same bits as an eager launch. One bf16 row streams x a stage at a time after the
    PDL wait (2 and 6 stages a warp here): every stage must see the x of this replay."""
    n = 4096
    g = torch.Generator().manual_seed(3)
    packed, scale, _ = make_weights(n, k, 128, False, g)
    packed = _tiled(packed, scale)  # before the capture
    x = torch.zeros(1, k, dtype=torch.bfloat16, device=DEVICE)
    src = randn(1, k, dtype=torch.bfloat16, device=DEVICE, gen=g)
    out = torch.empty(1, n, dtype=torch.bfloat16, device=DEVICE)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), pdl_launches():
        for _ in range(2):  # warm-up on the side stream, as capture wants
            torch.mul(src, 2.0, out=x)
            mma.w4a16_mma(x, packed, scale, out=out)
        with torch.cuda.graph(graph, stream=stream):
            torch.mul(src, 2.0, out=x)  # x is written by the kernel just before
            mma.w4a16_mma(x, packed, scale, out=out)
    for _ in range(3):
        src.copy_(randn(1, k, dtype=torch.bfloat16, device=DEVICE, gen=g))
        graph.replay()
        torch.cuda.synchronize()
        eager = mma.w4a16_mma(src * 2.0, packed, scale)
        assert torch.equal(out, eager)


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize(("n", "k", "group", "asym"), [(6144, 4096, 128, False), (96, 2560, 128, True), (48, 1024, None, False)])
def test_w4a16_mma_applies_the_rmsnorm_before_it(n: int, k: int, group: int | None, asym: bool, with_residual: bool) -> None:
    """norm=: the launch takes RMSNorm's input (x + residual, whose rounded sum one CTA writes to
    residual_out, bit for bit torch's), normalizes it as mllmd_kernels.rmsnorm does, and multiplies: the
    product of the reference norm within the output's rounding, and close to the Triton rmsnorm then the
    unfused kernel. K = 2,560 leaves the CTA's threads unequal shares of x."""
    g = torch.Generator().manual_seed(n + k + with_residual)
    packed, scale, zp = make_weights(n, k, group, asym, g)
    x = randn(1, k, dtype=torch.bfloat16, device=DEVICE, gen=g) * 3
    residual = randn(1, k, dtype=torch.bfloat16, device=DEVICE, gen=g) if with_residual else None
    weight = (1 + 0.2 * randn(k, dtype=torch.float32, device=DEVICE, gen=g)).to(torch.bfloat16)
    norm = mma.NormInput(weight, 1e-6, residual, poisoned((1, k), torch.bfloat16, DEVICE) if with_residual else None)
    out = mma.w4a16_mma(x, _tiled(packed, scale), scale, zp, norm=norm)
    ref_in = rmsnorm_ref(x, weight, 1e-6, residual)
    normed = ref_in[0] if with_residual else ref_in
    if with_residual:
        assert torch.equal(norm.residual_out, x + residual)
    ref = w4a16_gemm_ref(normed.float(), packed, scale, zp)
    assert not out.isnan().any() and rel_err(out, ref) < TOL[torch.bfloat16]
    apart = mma.w4a16_mma(rmsnorm(x, weight, 1e-6, residual)[0] if with_residual else rmsnorm(x, weight, 1e-6), _tiled(packed, scale), scale, zp)
    assert rel_err(out, apart) < 1e-3


@pytest.mark.parametrize(("split", "warps"), [(None, None), (1, 8), (2, 4)])
@pytest.mark.parametrize(
    ("n", "k", "group", "asym", "bias"),
    [(2 * 16 * 37, 1024, 128, True, True), (24576, 4096, 128, False, False), (1024, 2048, 32, False, False)],
)
def test_w4a16_mma_applies_silu_and_mul_after_it(
    n: int, k: int, group: int | None, asym: bool, bias: bool, split: int | None, warps: int | None
) -> None:
    """silu=True on a gate/up layer (one bf16 row): y [1, N / 2] = silu(gate) * up, as the unfused
    kernel followed by silu_and_mul computes it, for CTAs of 2, 4 and 8 tiles (the last CTA holding
    fewer gate/up pairs than the others)."""
    m = 1
    config = mma.MmaConfig(split, warps) if split is not None else None
    g = torch.Generator().manual_seed(n + m)
    packed, scale, zp = make_weights(n, k, group, asym, g)
    x = randn(m, k, dtype=torch.bfloat16, device=DEVICE, gen=g)
    b = randn(n, dtype=torch.bfloat16, device=DEVICE, gen=g) if bias else None
    out = poisoned((m, n // 2), torch.bfloat16, DEVICE)
    mma.w4a16_mma(x, _tiled(packed, scale), scale, zp, b, out=out, silu=True, config=config)
    apart = silu_and_mul(mma.w4a16_mma(x, _tiled(packed, scale), scale, zp, b))
    full = w4a16_gemm_ref(x.float(), packed, scale, zp, b.float() if bias else None)
    ref = torch.nn.functional.silu(full[:, : n // 2]) * full[:, n // 2 :]
    assert not out.isnan().any()
    assert rel_err(out, apart) < 1e-3
    assert rel_err(out, ref) < 5e-3


def test_w4a16_mma_norm_and_silu_in_one_launch() -> None:
    """Both fusions together (the post-attention norm into gate/up): as rmsnorm, the kernel, silu_and_mul."""
    n, k = 2048, 1024
    g = torch.Generator().manual_seed(23)
    packed, scale, _ = make_weights(n, k, 128, False, g)
    x, residual = (randn(1, k, dtype=torch.bfloat16, device=DEVICE, gen=g) for _ in range(2))
    weight = torch.ones(k, dtype=torch.bfloat16, device=DEVICE)
    norm = mma.NormInput(weight, 1e-6, residual)
    out = mma.w4a16_mma(x, _tiled(packed, scale), scale, norm=norm, silu=True)
    normed, res = rmsnorm(x, weight, 1e-6, residual)
    apart = silu_and_mul(mma.w4a16_mma(normed, _tiled(packed, scale), scale))
    assert torch.equal(norm.residual_out, res)
    assert out.shape == (1, n // 2) and rel_err(out, apart) < 1e-3


def test_w4a16_mma_refuses_fusions_it_cannot_run() -> None:
    """Each refusal names what is wrong: the norm or silu for several rows, residual_out aliasing the
    norm's input, silu with an odd N / 16 or a CTA of unpaired tiles."""
    g = torch.Generator().manual_seed(2)
    packed, scale, _ = make_weights(64, 512, 128, False, g)
    weight = torch.ones(512, dtype=torch.bfloat16, device=DEVICE)
    x2 = randn(2, 512, dtype=torch.bfloat16, device=DEVICE, gen=g)
    with pytest.raises(ValueError, match="one bf16 row"):
        mma.w4a16_mma(x2, _tiled(packed, scale), scale, norm=mma.NormInput(weight, 1e-6))
    with pytest.raises(ValueError, match="one bf16 row"):
        mma.w4a16_mma(x2, _tiled(packed, scale), scale, silu=True)
    x, r = x2[:1].clone(), x2[1:].clone()
    with pytest.raises(ValueError, match="residual_out"):
        mma.w4a16_mma(x, _tiled(packed, scale), scale, norm=mma.NormInput(weight, 1e-6, r, r))
    odd_packed, odd_scale, _ = make_weights(48, 512, 128, False, g)
    with pytest.raises(ValueError, match="multiple of 32"):
        mma.w4a16_mma(x, _tiled(odd_packed, odd_scale), odd_scale, silu=True)
    with pytest.raises(ValueError, match="with silu"):
        mma.w4a16_mma(x, _tiled(packed, scale), scale, silu=True, config=mma.MmaConfig(8, 8))
