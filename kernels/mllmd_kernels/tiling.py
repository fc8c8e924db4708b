"""tiling: what the int8 and W4A16 GEMM kernels share about their tiles: the shared memory a tiling
may take, the swizzled order of a prefill's output tiles, a decode program's rows and K range, and
a decode K step's loads."""

from __future__ import annotations

import functools

import torch

from mllmd_kernels._triton import tl, triton


@functools.lru_cache(maxsize=8)
def _smem_per_block(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    optin = int(getattr(props, "shared_memory_per_block_optin", 0) or 0)  # torch >= 2.7; else by capability
    if optin:
        return optin
    # By compute capability: sm90 227 KB, sm80/sm87 (A100, Orin) 163 KB, other consumer parts 99 KB.
    return {(9, 0): 232448, (8, 0): 166912, (8, 7): 166912}.get((props.major, props.minor), 101376)


def max_shared_memory(t: torch.Tensor) -> int:
    """Opt-in shared memory per block on t's device (bytes); generous for the CPU interpreter."""
    return _smem_per_block(t.device.index or 0) if t.is_cuda else 232448


def fit_stages(stage_bytes: int, want: int, smem: int, reserve: int = 8192) -> int:
    """The most pipeline stages (<= want, >= 1) whose buffers fit in `smem` bytes."""
    return max(1, min(want, (smem - reserve) // max(1, stage_bytes)))


@triton.jit
def swizzled_tile_start(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """First row and column of output tile number `tile` of a GEMM, tiles swizzled in groups of
    GROUP_M rows of tiles (so the weight tiles of neighbouring programs are shared in L2)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_in_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (tile // num_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % num_in_group) % group_size_m
    pid_n = (tile % num_in_group) // group_size_m
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@triton.jit
def swizzled_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile (swizzled_tile_start): offs_m, offs_n, and the row indices as
    int64 with rows past the end wrapped around (read, never stored)."""
    start_m, start_n = swizzled_tile_start(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, (offs_m % M).to(tl.int64), (offs_n % N).to(tl.int64)


@triton.jit
def n_tile_k_split(N, K, K_PER_SPLIT, BLOCK_N: tl.constexpr):
    """This program's output rows (axis 0: BLOCK_N of N; rows past N re-read row 0 and are never
    stored) and its K range (axis 1: one split of K_PER_SPLIT columns): offs_n, mask_n, the row
    indices as int64, k_start, k_len."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = tl.where(mask_n, offs_n, 0).to(tl.int64)
    k_start = tl.program_id(1) * K_PER_SPLIT
    return offs_n, mask_n, rows, k_start, tl.minimum(K_PER_SPLIT, K - k_start)


@triton.jit
def k_step_loads(a_ptrs, b_ptrs, a_mask, b_mask, EVEN_K: tl.constexpr):
    """One K step of a decode kernel: the activations (cached) and the weight tile (streamed,
    evict-first); past the end of K (unless EVEN_K) masked to 0, which adds nothing to the sums."""
    if EVEN_K:
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs, eviction_policy="evict_first")
    else:
        a = tl.load(a_ptrs, mask=a_mask, other=0)
        b = tl.load(b_ptrs, mask=b_mask, other=0, eviction_policy="evict_first")
    return a, b
