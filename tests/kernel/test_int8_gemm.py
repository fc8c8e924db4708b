"""int8_gemm (int8 x int8 -> int32 on tensor cores, or the one-row gemv; scales in the epilogue) and
w8a8_gemv (the gemv with the activation quantization fused in) against their torch references.

The int32 accumulation is checked exactly (unit scales, float32 output, against the exact integer
products summed in float64); the epilogue with real scales and bias against int8_gemm_ref; the fused
one-row path bit for bit against int8_quant + int8_gemm; the gate/up gemv with silu_and_mul in its
epilogue bit for bit against int8_gemm + silu_and_mul.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from mllmd_kernels import (
    Int8GemmConfig,
    int8_gemm,
    int8_gemm_ref,
    int8_gemm_silu_mul,
    int8_gemm_silu_mul_amax,
    int8_quant,
    pick_int8_config,
    silu_and_mul,
    silu_and_mul_ref,
    w8a8_linear,
    w8a8_linear_ref,
)
from mllmd_kernels.int8_gemv import w8a8_gemv
from mllmd_kernels.testing import (
    DTYPES,
    DTYPES_WITH_FP32,
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


TMA_CONFIGS = [
    Int8GemmConfig("tma", 16, 32, 32, 2, 1, 4, 2),
    Int8GemmConfig("tma_persistent", 32, 16, 64, 3, 1, 4, 3),
] + ([Int8GemmConfig("tma", 128, 128, 64, 8, 1, 4, 5), Int8GemmConfig("tma_persistent", 128, 256, 128, 8, 1, 8, 3)]
     if on_gpu() else [])  # fmt: skip


@pytest.mark.parametrize("cfg", TMA_CONFIGS, ids=lambda c: f"{c.mode}-m{c.block_m}n{c.block_n}k{c.block_k}")
def test_int8_gemm_tma_tilings_equal_the_pointer_tiling(cfg: Int8GemmConfig) -> None:
    """The Hopper TMA tilings (edges zero-filled by the hardware, K off the block, persistent tile
    walk) give the "gemm" tiling's output bit for bit, and its exact integer sums."""
    from mllmd_kernels.int8_gemm_tma import tma_supported

    m, n, k = (45, 50, 224) if cfg.block_m < 64 else (300, 1000, 4160)
    g = torch.Generator().manual_seed(cfg.block_n + cfg.block_m)
    a, b = _int8(m, k, gen=g), _int8(n, k, gen=g)
    if on_gpu() and not tma_supported(a, b):
        pytest.skip("TMA needs sm90+ and Triton tensor descriptors")
    ones_m, ones_n = torch.ones(m, 1, device=DEVICE), torch.ones(n, 1, device=DEVICE)
    assert torch.equal(int8_gemm(a, b, ones_m, ones_n, torch.float32, config=cfg), _exact_acc(a, b))
    a_scale = (torch.rand(m, 1, generator=g) * 0.05).to(DEVICE)
    b_scale = (torch.rand(n, 1, generator=g) * 1e-3).to(DEVICE)
    bias = randn(n, dtype=torch.bfloat16, device=DEVICE, gen=g)
    pointer = Int8GemmConfig("gemm", cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, 1, cfg.num_warps, 2)
    out = int8_gemm(a, b, a_scale, b_scale, torch.bfloat16, bias, config=cfg)
    assert torch.equal(out, int8_gemm(a, b, a_scale, b_scale, torch.bfloat16, bias, config=pointer))


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


# One row ("gemv"): 50 rows of W (not a multiple of BLOCK_N), K = 232 (not a multiple of BLOCK_K).
GEMV_CONFIGS = [
    Int8GemmConfig("gemv", 1, 16, 32, 1, 1, 4, 1),  # many K steps, masked last step, no split
    Int8GemmConfig("gemv", 1, 16, 32, 1, 3, 4, 1),  # split-K 3: 96 + 96 + 40 columns
    Int8GemmConfig("gemv", 1, 32, 64, 1, 2, 8, 1),  # split-K 2, a partial second split
    Int8GemmConfig("gemv", 1, 8, 256, 1, 1, 2, 1),  # one K step wider than K
    # dp4a: the bytes as int32 words (the interpreter sums the same bytes by shifts)
    Int8GemmConfig("gemv", 1, 16, 64, 1, 3, 4, 1, dp4a=True),  # split 128 + 104 columns, masked words
    Int8GemmConfig("gemv", 1, 32, 64, 1, 1, 4, 1, dp4a=True),
    Int8GemmConfig("gemv", 1, 8, 256, 1, 1, 2, 1, dp4a=True),
]
GEMV_N, GEMV_K = 50, 232


def _gemv_id(c: Int8GemmConfig) -> str:
    return f"n{c.block_n}k{c.block_k}s{c.split_k}w{c.num_warps}" + "-dp4a" * c.dp4a


def test_one_row_picks_the_gemv() -> None:
    for n, k in [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (40, 96)]:
        for sms in (132, 16):
            cfg = pick_int8_config(1, n, k, sms, 232448)
            assert cfg.mode == "gemv" and cfg.split_k >= 1 and cfg.block_k >= 16
    assert pick_int8_config(2, 6144, 4096, 132, 232448).mode == "skinny"


def test_long_prefills_pick_tma_only_where_it_runs() -> None:
    """From TMA_MIN_ROWS rows the prefill tiling is the TMA one when the operands allow it (sm90),
    the pointer tiling otherwise and below (Orin, A100, shorter prefills bound by the host)."""
    from mllmd_kernels.int8_config import TMA_MIN_ROWS

    for n, k in [(6144, 4096), (4096, 12288)]:
        assert pick_int8_config(TMA_MIN_ROWS, n, k, 132, 232448, tma=True).mode == "tma"
        assert pick_int8_config(4096, n, k, 132, 232448, tma=False).mode == "gemm"
        assert pick_int8_config(TMA_MIN_ROWS - 1, n, k, 132, 232448, tma=True).mode == "gemm"
        assert pick_int8_config(1, n, k, 132, 232448, tma=True).mode == "gemv"


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize("cfg", GEMV_CONFIGS, ids=_gemv_id)
def test_int8_gemv_explicit_tilings(cfg: Int8GemmConfig, dtype: torch.dtype) -> None:
    """M == 1: exact int32 sums (extreme values included), then the epilogue with bias against the reference."""
    g = torch.Generator().manual_seed(cfg.block_n * 10 + cfg.split_k)
    a, b = _int8(1, GEMV_K, gen=g), _int8(GEMV_N, GEMV_K, gen=g)
    a[0, :7] = -128
    b[3, :] = -128
    out = poisoned((1, GEMV_N), torch.float32, DEVICE)
    ones = torch.ones(GEMV_N, 1, device=DEVICE)
    int8_gemm(a, b, torch.ones(1, 1, device=DEVICE), ones, torch.float32, out=out, config=cfg)
    assert torch.equal(out, _exact_acc(a, b))
    a_scale = (torch.rand(1, 1, generator=g) * 0.05 + 1e-3).to(DEVICE)
    b_scale = (torch.rand(GEMV_N, 1, generator=g) * 1e-3 + 1e-5).to(DEVICE)
    bias = randn(GEMV_N, dtype=dtype, device=DEVICE, gen=g)
    for bi in (None, bias):
        out = poisoned((1, GEMV_N), dtype, DEVICE)
        int8_gemm(a, b, a_scale, b_scale, dtype, bi, out=out, config=cfg)
        assert not out.isnan().any(), "some outputs were never written"
        torch.testing.assert_close(out, int8_gemm_ref(a, b, a_scale, b_scale, dtype, bi), **close_tol(dtype))


def _w8a8_inputs(n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = randn(1, k, dtype=dtype, device=DEVICE, gen=g, scale=10.0 ** (seed % 5 - 2))
    w = _int8(n, k, gen=g)
    w_scale = (torch.rand(n, 1, generator=g) * 0.01 / k**0.5 + 1e-4).to(DEVICE)
    bias = randn(n, dtype=dtype, device=DEVICE, gen=g)
    return x, w, w_scale, bias


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize("cfg", [None, *GEMV_CONFIGS], ids=lambda c: "default" if c is None else _gemv_id(c))
def test_w8a8_gemv_fused_quant_is_bit_exact(cfg: Int8GemmConfig | None, dtype: torch.dtype) -> None:
    """One row: the quantization fused into the gemv gives int8_quant + int8_gemm's output bit for bit
    (same tiling), and matches w8a8_linear_ref; with and without bias, into a poisoned buffer."""
    x, w, w_scale, bias = _w8a8_inputs(GEMV_N, GEMV_K, dtype, seed=GEMV_K + (cfg.split_k if cfg else 0))
    for bi in (None, bias):
        out = poisoned((1, GEMV_N), dtype, DEVICE)
        w8a8_gemv(x, w, w_scale, bi, out=out, config=cfg)
        q, s = int8_quant(x)
        assert torch.equal(out, int8_gemm(q, w, s, w_scale, dtype, bi, config=cfg))  # same (default) tiling
        torch.testing.assert_close(out, w8a8_linear_ref(x, w, w_scale, bi), **close_tol(dtype))
        assert torch.equal(w8a8_linear(x, w, w_scale, bi, config=cfg), out)


@pytest.mark.parametrize("scale_bytes", [128, 16384])
def test_w8a8_gemv_fused_quant_edge_rows(monkeypatch: pytest.MonkeyPatch, scale_bytes: int) -> None:
    """A zero row (scale = eps), a single large value, tiny and huge magnitudes; max|x| over several
    chunks of the row (128 bytes: 64 bf16 / 32 fp32 values per chunk) or one; split and unsplit."""
    monkeypatch.setattr(importlib.import_module("mllmd_kernels.int8_gemv"), "GEMV_SCALE_BYTES", scale_bytes)
    n, k = 40, 200
    g = torch.Generator().manual_seed(5)
    w = _int8(n, k, gen=g)
    w_scale = (torch.rand(n, 1, generator=g) * 1e-3 + 1e-5).to(DEVICE)
    rows = [torch.zeros(1, k), torch.zeros(1, k), torch.randn(1, k, generator=g) * 1e-4]
    rows += [torch.randn(1, k, generator=g) * 300]
    rows[1][0, 197] = -3.0  # the max sits in the last chunk
    for x in rows:
        for dtype in (torch.bfloat16, torch.float32):
            xd = x.to(dtype=dtype, device=DEVICE)
            q, s = int8_quant(xd)
            for cfg in (GEMV_CONFIGS[0], GEMV_CONFIGS[1], GEMV_CONFIGS[5]):
                ref = int8_gemm(q, w, s, w_scale, dtype, config=cfg)
                assert torch.equal(w8a8_gemv(xd, w, w_scale, config=cfg), ref)


# silu(gate) * up in the one-row gemv's epilogue: D outputs (not a multiple of BLOCK_N / 2), K off the
# block; the unsplit tilings fuse, the split ones (and more rows) take int8_gemm + silu_and_mul.
SILU_D, SILU_K = 45, 232


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize("cfg", [None, *GEMV_CONFIGS], ids=lambda c: "default" if c is None else _gemv_id(c))
def test_int8_gemm_silu_mul_equals_gemm_then_silu_and_mul(cfg: Int8GemmConfig | None, dtype: torch.dtype) -> None:
    """The gate/up projection of one row with the activation fused: silu_and_mul(int8_gemm(...)) bit
    for bit (the gate and up outputs rounded to the dtype first, as the gemm stores them), every
    output written, and close to the torch references; with and without bias."""
    g = torch.Generator().manual_seed(SILU_D + (cfg.block_n * 10 + cfg.split_k if cfg else 0))
    a, b = _int8(1, SILU_K, gen=g), _int8(2 * SILU_D, SILU_K, gen=g)
    a_scale = (torch.rand(1, 1, generator=g) * 0.05 + 1e-3).to(DEVICE)
    b_scale = (torch.rand(2 * SILU_D, 1, generator=g) * 1e-3 + 1e-5).to(DEVICE)
    bias = randn(2 * SILU_D, dtype=dtype, device=DEVICE, gen=g)
    for bi in (None, bias):
        out = int8_gemm_silu_mul(a, b, a_scale, b_scale, dtype, bi, config=cfg)
        assert out.shape == (1, SILU_D) and out.dtype == dtype and not out.isnan().any()
        h = int8_gemm(a, b, a_scale, b_scale, dtype, bi, config=cfg)
        assert torch.equal(out, silu_and_mul(h))
        ref = silu_and_mul_ref(int8_gemm_ref(a, b, a_scale, b_scale, dtype, bi).float()).to(dtype)
        torch.testing.assert_close(out, ref, **close_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize("cfg", [None, *GEMV_CONFIGS], ids=lambda c: "default" if c is None else _gemv_id(c))
def test_silu_mul_amax_parts_give_the_next_gemv_its_scale_bit_for_bit(cfg: Int8GemmConfig | None, dtype: torch.dtype) -> None:
    """Where the gate/up gemv fuses the activation, it also writes each program's max |output|: their
    max is the row's max|h| exactly, and the down projection's fused quantization, taking its scale
    from them instead of a pass over h, gives w8a8_gemv's bits (every down tiling, split-K too).
    Where the two launches run (split tilings), there are no partials. Control: partials twice as
    large change the result, so the kernel does read them."""
    g = torch.Generator().manual_seed(7 * SILU_D + (cfg.block_n * 10 + cfg.split_k if cfg else 0))
    a, b = _int8(1, SILU_K, gen=g), _int8(2 * SILU_D, SILU_K, gen=g)
    a_scale = (torch.rand(1, 1, generator=g) * 0.05 + 1e-3).to(DEVICE)
    b_scale = (torch.rand(2 * SILU_D, 1, generator=g) * 1e-3 + 1e-5).to(DEVICE)
    h, parts = int8_gemm_silu_mul_amax(a, b, a_scale, b_scale, dtype, config=cfg)
    assert torch.equal(h, int8_gemm_silu_mul(a, b, a_scale, b_scale, dtype, config=cfg))
    if cfg is not None and cfg.split_k > 1:
        assert parts is None, "a split gate/up gemv does not fuse, so it writes no partials"
        return
    assert parts is not None and parts.dtype == torch.float32 and parts.dim() == 1
    assert torch.equal(parts.max(), h.abs().max().float()), "max of the partials = max|h|"
    down = _int8(37, SILU_D, gen=g)
    down_scale = (torch.rand(37, 1, generator=g) * 1e-3 + 1e-5).to(DEVICE)
    for down_cfg in (None, *GEMV_CONFIGS):
        plain = w8a8_gemv(h, down, down_scale, config=down_cfg)
        assert torch.equal(w8a8_gemv(h, down, down_scale, config=down_cfg, amax_parts=parts), plain), down_cfg
    assert not torch.equal(w8a8_gemv(h, down, down_scale, amax_parts=parts * 2), w8a8_gemv(h, down, down_scale))


def test_int8_gemm_silu_mul_fuses_only_unsplit_one_row_gemvs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused epilogue runs for one row with one K split; split gemvs and several rows fall back
    to int8_gemm + silu_and_mul (which a poisoned silu_and_mul would reveal)."""
    gemm_mod = importlib.import_module("mllmd_kernels.int8_gemm")
    calls: list[tuple[int, ...]] = []

    def spy(x: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return silu_and_mul(x)

    monkeypatch.setattr(gemm_mod, "silu_and_mul", spy)
    g = torch.Generator().manual_seed(3)
    b = _int8(2 * SILU_D, SILU_K, gen=g)
    b_scale = torch.full((2 * SILU_D, 1), 1e-4, device=DEVICE)
    for m, cfg in [(1, GEMV_CONFIGS[0]), (1, GEMV_CONFIGS[1]), (3, None), (1, None)]:
        a = _int8(m, SILU_K, gen=g)
        out = int8_gemm_silu_mul(a, b, torch.ones(m, 1, device=DEVICE), b_scale, torch.float32, config=cfg)
        assert out.shape == (m, SILU_D)
    assert calls == [(1, 2 * SILU_D), (3, 2 * SILU_D)]

