"""w4a16_config: the W4A16 GEMM's tilings, picked by M (no autotuning), and where a prefill is faster
dequantized + cuBLAS than in the fused kernel.

* "gemv" (M == 1, `w4a16_gemv`): no tensor cores, float32 FMAs on the nibble planes;
* "skinny" (2 <= M <= 64, `w4a16_gemm`): acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile^T on tensor cores
  with W dequantized to the activation dtype (x padded to 16+ rows);
* "gemm" (prefill, `w4a16_gemm`): acc[BLOCK_M, BLOCK_N] = x_tile @ W_tile^T with a GROUP_M swizzle.
"gemv" and "skinny" split K until every SM has a few tiles (`splitk`).
Large M (`prefers_dequant`: 256 rows and up (1,024 on the nibble planes), or 128 where the fused
tiling has too few tiles):
`w4a16_dequantize` writes the weight once in the activation dtype and cuBLAS multiplies; a fused
tile would otherwise dequantize every weight tile once per M tile.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import torch

from mllmd_kernels import knobs
from mllmd_kernels._triton import cdiv, next_pow2, sm_count_for
from mllmd_kernels.splitk import auto_split
from mllmd_kernels.tiling import fit_stages, max_shared_memory


@dataclass(frozen=True)
class W4A16Config:
    mode: str  # "gemv" (M == 1, no tensor cores) | "skinny" (W @ x^T, split-K) | "gemm" (swizzled tiles)
    block_m: int
    block_n: int
    block_k: int  # reduced at launch to a power of two that divides the group size
    group_m: int
    split_k: int
    num_warps: int
    num_stages: int
    sub_steps: int = 1  # "gemv": K steps per loop trip (sub_steps * block_k / 2 contiguous bytes a row)
    # Bench-only probes of the "gemv" tiling (bench_quant's DRAM-locality experiment; never picked):
    tiled_w: bool = False  # w_packed laid out by `tile_words` (each program's K-step tile contiguous)
    load_only: bool = False  # one FMA a word instead of the nibble planes (wrong sums: a bandwidth probe)


def group_block_k(block_k: int, group: int, k: int) -> int:
    """The K step for `group` columns per scale: <= block_k, a power of two >= 16 dividing the group
    (channel-wise: any, K is masked)."""
    if group >= k:  # channel-wise
        return max(16, min(block_k, next_pow2(k)))
    bk = block_k
    while group % bk:
        bk //= 2
    assert bk >= 16, f"group size {group} is not a multiple of 16"
    return bk


@functools.lru_cache(maxsize=1)
def tuned_gemv_configs() -> dict[tuple[int, int], W4A16Config]:
    """One-row tilings by (N, K) from the JSON file `$MLLMD_W4A16_TUNED` names (what
    `bench_quant --sweep w4a16 --w4a16-tuned-out FILE` writes: {"N,K": config fields}); {} unset."""
    path = knobs.w4a16_tuned_path()
    if not path:
        return {}
    with open(path) as f:
        raw = json.load(f)
    out = {}
    for key, fields in raw.items():
        cfg = W4A16Config(**fields)
        if cfg.mode != "gemv" or cfg.block_m != 1:
            raise ValueError(f"{path}: {key}: not a one-row gemv tiling: {fields}")
        if cfg.tiled_w or cfg.load_only:  # bench probes: another weight layout, or wrong sums
            raise ValueError(f"{path}: {key}: tiled_w / load_only are bench probes, not tilings: {fields}")
        n, k = (int(v) for v in key.split(","))
        out[(n, k)] = cfg
    return out


@functools.lru_cache(maxsize=4096)  # a pure function of its arguments, asked on every launch
def pick_w4a16_config(m: int, n: int, k: int, group: int, num_sms: int, smem: int) -> W4A16Config:
    """Tile sizes for x[m, k] @ W[n, k]^T by M (decode / prefill), fitted to shared memory."""
    if m == 1 and (n, k) in tuned_gemv_configs():
        return tuned_gemv_configs()[(n, k)]
    if m == 1:
        # ALU-bound: a K step of 64 rows x 128 columns per program at 2 warps (16 words per thread; the
        # x planes are shared by the rows, the row scale by the words), prefetched 4 steps deep through
        # shared memory; K split until there are about 6 programs per SM. The best of the bench_quant
        # sweep on the Qwen3-8B shapes (NOTES.md).
        bk = group_block_k(256 if group >= k else 128, group, k)
        bn = max(16, min(512, 8192 // bk, next_pow2(n)))
        split = auto_split(cdiv(n, bn), k, bk, num_sms, ctas_per_sm=6, min_blocks=2)
        return W4A16Config("gemv", 1, bn, bk, 1, split, 2, fit_stages(bn * bk // 2, 4, smem))
    if m <= 64:
        bm, bn, bk = max(16, next_pow2(m)), 64, group_block_k(128, group, k)
        split = auto_split(cdiv(n, bn), k, bk, num_sms, ctas_per_sm=2, min_blocks=2)
        return W4A16Config("skinny", bm, bn, bk, 1, split, 4, fit_stages(bm * bk * 2 + bn * bk // 2, 4, smem))
    if m <= 128:
        bm, bn, warps = 64, 128, 4
    else:
        bm, bn, warps = 128, 128, 8
    bk = group_block_k(64, group, k)
    return W4A16Config("gemm", bm, bn, bk, 8, 1, warps, fit_stages(bm * bk * 2 + bn * bk // 2, 4, smem))


# Where dequantizing W once and calling cuBLAS beats the fused "gemm" tiling (`prefers_dequant`): the
# fused kernel dequantizes every weight tile once per M tile, while dequantizing is one pass over the
# weights (N*K/2 bytes read, N*K*2 written). Between the two thresholds the fused tiling wins only
# where it has enough tiles to fill the GPU (bench_quant --m 128 256 512 2048; NOTES.md). On the
# nibble planes (`w4a16_dequant.dequant_mode`) the fused tiling is faster, and with two tiles an SM it
# still beats dequantizing at 512 rows (H100: gate/up 218 against 253 us), not at 2,048 (927 / 666).
DEQUANT_MIN_ROWS = 128  # below: always the fused kernels
DEQUANT_ALWAYS_ROWS = 256  # from here: always dequantize + cuBLAS
DEQUANT_ALWAYS_ROWS_PLANES = 1024  # the same, for the fused tiling on the nibble planes


def prefers_dequant(x: torch.Tensor, n: int, group: int, planes: bool = False) -> bool:
    """x [M, K] @ W[n, K]^T is faster dequantized + cuBLAS than in the fused kernel (on the nibble
    planes where `planes`): from DEQUANT_ALWAYS_ROWS (_PLANES) rows, and from DEQUANT_MIN_ROWS where
    the fused tiling has fewer than two output tiles per SM of x's device."""
    m, k = x.shape
    if m < DEQUANT_MIN_ROWS:
        return False
    if m >= (DEQUANT_ALWAYS_ROWS_PLANES if planes else DEQUANT_ALWAYS_ROWS):
        return True
    sms = sm_count_for(x)
    cfg = pick_w4a16_config(m, n, k, group, sms, max_shared_memory(x))
    return cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n) < 2 * sms


def splitk_counter_len(n: int) -> int:
    """How many split-K counters a layer of N outputs needs: one per output tile of the narrowest
    (16-column) tiling any decode config picks."""
    return cdiv(n, 16)
