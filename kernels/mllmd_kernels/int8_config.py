"""int8_config: the W8A8 GEMM's tilings, picked by M (decode / mid / prefill), no autotuning.

* "gemv" (M == 1, `int8_gemv`): no tensor cores; 16 weight rows x 1024 or 2048 columns per program
  (about two or more programs per SM on the Qwen3-8B projections without splitting K), four byte
  products a word in one `dp4a`;
* "skinny" (M <= 64, `int8_gemm`): acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile^T (the weight fills the
  64-row MMA side, x is padded to 16+ rows);
* "gemm" (prefill, `int8_gemm`): acc[BLOCK_M, BLOCK_N] = x_tile @ W_tile^T with a GROUP_M swizzle over
  output tiles; 64x128x128 up to 128 rows, 128x128x64 with 4 warps above (the fastest of the sweep on
  an H200, 80 KB of shared memory for its 5 stages: fits Orin and A100 too);
* "tma" / "tma_persistent" (`int8_gemm_tma`): the "gemm" product with TMA loads, sm90+ only.
"gemv" and "skinny" split K where there are too few tiles for the SMs (`splitk`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from mllmd_kernels import knobs
from mllmd_kernels._triton import cdiv, next_pow2
from mllmd_kernels.splitk import auto_split
from mllmd_kernels.tiling import fit_stages

# From this many rows on, sm90 (where `tma_supported`) runs the prefill GEMM with TMA loads
# (int8_gemm_tma, "tma" 128x128x64), which is faster on long prefills. Not below: each TMA launch
# encodes two tensor maps on the host, a cost that a shorter prefill, bound by the host, would pay in
# full (the figures: NOTES.md). MLLMD_INT8_TMA_MIN_ROWS overrides it (a diagnostic: a large value
# turns the TMA tiling off).
TMA_MIN_ROWS = knobs.int8_tma_min_rows()
TMA_MODES = ("tma", "tma_persistent")


@dataclass(frozen=True)
class Int8GemmConfig:
    mode: str  # "gemv" (M == 1, no tensor cores) | "skinny" (W as the MMA's 64-row side; M <= 64) | "gemm"
    # | "tma" / "tma_persistent" (the "gemm" product with TMA loads: sm90+ only, int8_gemm_tma; "tma" is
    # picked from TMA_MIN_ROWS rows where tma_supported)
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    split_k: int
    num_warps: int
    num_stages: int  # "gemv": 1 (its loads feed no tl.dot; more warps hide the latency instead)
    dp4a: bool = False  # "gemv": four byte products a word in one instruction (dp4a, sm61+; needs K % 4 == 0)


@functools.lru_cache(maxsize=4096)  # a pure function of its arguments, asked on every launch
def pick_int8_config(m: int, n: int, k: int, num_sms: int, smem: int, tma: bool = False) -> Int8GemmConfig:
    """Tile sizes for a[m, k] @ b[n, k]^T by M (decode / mid / prefill), fitted to shared memory;
    `tma`: the operands can be fetched by TMA (`tma_supported`), taken from TMA_MIN_ROWS rows on."""
    if m == 1:
        # 16 weight rows per program (w8a8_gemv quantizes each x slice once per program), 128 bytes of
        # weights per thread and K step; 8 warps on 2048 columns where there are fewer than two tiles
        # per SM (o, down on an H200), K split only where that still leaves too few programs.
        bn = 16
        tiles = cdiv(n, bn)
        bk, warps = (1024, 4) if tiles >= 2 * num_sms else (2048, 8)
        bk = min(bk, max(16, next_pow2(k)))
        warps = max(1, min(warps, bn * bk // 512))  # >= 16 columns (one 16-byte load) per thread
        split = auto_split(tiles, k, bk, num_sms, ctas_per_sm=2, min_blocks=2)
        # dp4a: faster on all four Qwen3-8B projections in the one-row sweep (bench_quant --m 1 --sweep int8)
        return Int8GemmConfig("gemv", 1, bn, bk, 1, split, warps, 1, dp4a=True)
    if m <= 64:
        bm = max(16, next_pow2(m))
        bn, bk = 64, (256 if bm <= 32 else 128)
        stages = fit_stages((bm + bn) * bk, 4, smem)
        split = auto_split(cdiv(n, bn), k, bk, num_sms)
        return Int8GemmConfig("skinny", bm, bn, bk, 1, split, 4, stages)
    if tma and m >= TMA_MIN_ROWS:
        return Int8GemmConfig("tma", 128, 128, 64, 8, 1, 4, fit_stages((128 + 128) * 64, 5, smem))
    if m <= 128:
        bm, bn, bk, warps, stages = 64, 128, 128, 4, 4
    else:
        # The fastest of 20 tilings on all four Qwen3-8B shapes at M = 2,048 (bench_quant --m 2048
        # --sweep; NOTES.md); its 80 KB of shared memory fits sm87 too.
        bm, bn, bk, warps, stages = 128, 128, 64, 4, 5
    return Int8GemmConfig("gemm", bm, bn, bk, 8, 1, warps, fit_stages((bm + bn) * bk, stages, smem))
