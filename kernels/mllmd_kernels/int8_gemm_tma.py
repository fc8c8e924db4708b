"""int8_gemm_tma: the prefill int8 GEMM with its operand tiles fetched by TMA (sm90 and newer only).

The same product as `int8_gemm`'s "gemm" tiling (int8 a [M, K] x int8 b [N, K] -> int32, then
(acc * a_scale) * b_scale (+ bias) in float32, one rounding): only the loads differ. Each K step asks
the Tensor Memory Accelerator for an [BLOCK_M, BLOCK_K] tile of a and an [BLOCK_N, BLOCK_K] tile of b
through host-built descriptors (`triton.tools.tensor_descriptor.TensorDescriptor`); the hardware
computes the addresses and zero-fills past the edges, so the warps only issue wgmma. "tma" runs one
output tile per program (GROUP_M swizzle as in int8_gemm); "tma_persistent" launches one program per
SM that walks the tiles in the same swizzled order.

Picked by int8_gemm from TMA_MIN_ROWS (1,024) rows on where `tma_supported` ("tma", 128x128x64, 4
warps, 5 stages); "tma_persistent" only by explicit configs and bench_quant's sweep. It makes long
prefills faster; every launch encodes two tensor maps on the host, which is why shorter prefills,
bound by the host, keep the pointer tiling (the figures: NOTES.md).

Hopper-only, so never the default path on Orin (sm87): `tma_supported` is False below compute
capability 9.0, on Triton builds without tensor descriptors, and for operands TMA cannot address
(row strides not a multiple of 16 bytes).
"""

from __future__ import annotations

import functools

import torch

from mllmd_kernels._triton import HAS_TRITON, cdiv, tl, triton
from mllmd_kernels.int8_config import TMA_MODES, Int8GemmConfig
from mllmd_kernels.int8_gemm import _store_scaled_tile
from mllmd_kernels.tiling import swizzled_tile_start

try:  # Triton >= 3.3 on the host side
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - old Triton (Orin's 3.0), or no Triton
    TensorDescriptor = None

__all__ = ["TMA_MODES", "int8_gemm_tma", "tma_supported"]


@functools.lru_cache(maxsize=8)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def tma_supported(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The TMA kernels can run on these operands: CUDA sm90+, Triton with tensor descriptors,
    16-byte aligned bases and row strides."""
    if not HAS_TRITON or TensorDescriptor is None or not (a.is_cuda and b.is_cuda):
        return False
    if _capability(a.device.index or 0) < (9, 0):
        return False
    return all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 for t in (a, b))


@triton.jit
def _tma_tile(
    a_desc, b_desc, as_ptr, bs_ptr, bias_ptr, c_ptr, off_m, off_n, M, N, K, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """One output tile: K steps of TMA loads and int8 MMAs, then the scaled epilogue."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([off_m, k0])
        b = b_desc.load([off_n, k0])
        acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    _store_scaled_tile(acc, offs_m, offs_n, M, N, as_ptr, bs_ptr, bias_ptr, c_ptr, stride_cm, HAS_BIAS)


@triton.jit
def _int8_gemm_tma_kernel(
    a_desc, b_desc, as_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    off_m, off_n = swizzled_tile_start(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    _tma_tile(a_desc, b_desc, as_ptr, bs_ptr, bias_ptr, c_ptr, off_m, off_n, M, N, K, stride_cm,
              BLOCK_M, BLOCK_N, BLOCK_K, HAS_BIAS)  # fmt: skip


@triton.jit
def _int8_gemm_tma_persistent_kernel(
    a_desc, b_desc, as_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        off_m, off_n = swizzled_tile_start(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        _tma_tile(a_desc, b_desc, as_ptr, bs_ptr, bias_ptr, c_ptr, off_m, off_n, M, N, K, stride_cm,
                  BLOCK_M, BLOCK_N, BLOCK_K, HAS_BIAS)  # fmt: skip


def int8_gemm_tma(
    a: torch.Tensor,  # [M, K] int8
    b: torch.Tensor,  # [N, K] int8
    a_scale: torch.Tensor,  # [M] float32
    b_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,
    out: torch.Tensor,  # [M, N]
    cfg: Int8GemmConfig,
    num_sms: int,
) -> torch.Tensor:
    """Launch the "tma" / "tma_persistent" tiling (callers check `tma_supported` first)."""
    assert cfg.mode in TMA_MODES, cfg.mode
    m, k = a.shape
    n = b.shape[0]
    a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
    b_desc = TensorDescriptor.from_tensor(b, [cfg.block_n, cfg.block_k])
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    persistent = cfg.mode == "tma_persistent"
    kernel = _int8_gemm_tma_persistent_kernel if persistent else _int8_gemm_tma_kernel
    has_bias = bias is not None
    kernel[(min(tiles, num_sms) if persistent else tiles,)](
        a_desc, b_desc, a_scale, b_scale, bias if has_bias else b_scale, out, m, n, k, out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, HAS_BIAS=has_bias,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
