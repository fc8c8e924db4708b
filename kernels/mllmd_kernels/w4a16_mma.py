"""w4a16_mma: the W4A16 GEMM of decode batches and short prefills (M <= 32) as a CUDA kernel on the tensor
cores (`csrc/w4a16_mma.cu`).

The Triton one-row gemv (`w4a16_gemv`) spends float32 instructions on every weight; this kernel
turns two weights into mma.sync operands with one LOP3. It reads the packed words in
`tile_order` (re-laid once at load: a warp's loads are contiguous runs; the Triton W4A16 kernels for
larger M read the same order through their `mma_vec`, so both share one tensor). Each warp walks its
slice of K 256 columns at a time in registers, loading the next stage while it multiplies this one.
One bf16 row (batch-1 decode) multiplies the raw halves 128 + q + 8 and subtracts (136 + zero
point) * sum(x) per group, with x in shared memory in B-fragment order: staged once per CTA where the
launch fuses the norm, else streamed by each warp a stage at a time (its own stages only); fp16 and
several rows subtract the offset from each weight pair (one packed FMA) instead, the pair dequantized
once for up to 4 tiles of 8 rows (M <= 32). For one bf16 row the launch
can also apply the RMSNorm before the layer and silu(gate) * up after a gate/up layer (`NormInput`,
`silu=True`): the decode step then runs no rmsnorm or silu_and_mul kernel beside it.

It is an optional accelerator: the source is compiled once per GPU architecture with the CUDA
toolkit's `nvcc` into a shared library (`cuda_build`: no PyTorch headers, cached under
`cuda_build.cache_dir()`), loaded here with ctypes and launched on the current stream, so CUDA
graphs capture it. Where no nvcc is found,
the build fails or MLLMD_CUDA_KERNELS=0, `unavailable_reason` says why and callers keep the Triton
kernels. sm80+ only (mma.sync bf16 / fp16; Jetson Orin is sm87); PDL on sm90+.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from mllmd_kernels import cuda_build, knobs
from mllmd_kernels._triton import pdl_args, sm_count_for
from mllmd_kernels.rmsnorm import NormInput
from mllmd_kernels.tiling import _smem_per_block

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "w4a16_mma.cu"
ABI_VERSION = 11  # mllmd_w4a16_mma_abi() of a library this module can call
MAX_ROWS = 32  # x rows: up to 4 tiles of the MMA's 8 B columns, each weight pair dequantized once for all
PROBE_MAX_ROWS = 8  # the bench probes run one column tile
MAX_WARPS = 8  # kMaxWarps in the source
STAGE_K = 256  # columns of a warp's loop stage (kStageCols): K must be a multiple
# Warps a launch should give each SM at least (split-K until it does): enough loads in flight; and
# stages a warp should stream at most (a long row is split even when the SMs have warps enough).
MIN_WARPS_PER_SM = 16
MAX_STAGES_PER_WARP = 8


# Kernel variants (kExact ... in the source): EXACT is the kernel; the probes time parts of it (wrong
# sums; bench only): PROBE_LOAD keeps only the weight loads, PROBE_COMPUTE all but the weight loads,
# PROBE_NO_META all but the scales' loads.
EXACT, PROBE_LOAD, PROBE_COMPUTE, PROBE_NO_META = 0, 2, 3, 4
VARIANT_NAMES = {EXACT: "exact", PROBE_LOAD: "probe_load", PROBE_COMPUTE: "probe_compute", PROBE_NO_META: "probe_no_meta"}


@dataclass(frozen=True)
class MmaConfig:
    """How a launch divides the work: `split` warps share a 16-row tile's K (their partials added in
    shared memory, in a fixed order); a CTA has `warps` warps, so it holds warps / split tiles."""

    split: int
    warps: int
    variant: int = EXACT


def mma_layout(k: int, group: int) -> tuple[int, int] | None:
    """(vec, gshift) for K columns in groups of `group` (group >= k: channel-wise), or None where the
    kernel cannot run them: each lane loads `vec` words a row (a chunk of 32 * vec columns must lie in
    one group) and 2**gshift chunks make a group."""
    if k % STAGE_K:
        return None
    if group >= k:
        return 4, 30
    for vec in (4, 2, 1):
        chunk = 32 * vec
        if group % chunk == 0:
            chunks = group // chunk
            if chunks & (chunks - 1):  # a power of two: the kernel masks, it does not divide
                return None
            return vec, chunks.bit_length() - 1
    return None


def _tile_view(w: torch.Tensor, vec: int, tiled: bool) -> torch.Tensor:
    """w [N, K / 8] as 7-D: row-major (tile, half, r, stage, chunk, t, word) or tile order (tile, stage,
    chunk, half, r, t, word); the same permutation maps either to the other."""
    n, kw = w.shape
    if n % 16 or kw % (STAGE_K // 8) or vec not in (1, 2, 4):
        raise ValueError(f"mma tile order needs N % 16 == 0, K % {STAGE_K} == 0 and vec 1 / 2 / 4, got {tuple(w.shape)}, {vec}")
    stages, chunks = kw // (STAGE_K // 8), 8 // vec
    shape = (n // 16, stages, chunks, 2, 8, 4, vec) if tiled else (n // 16, 2, 8, stages, chunks, 4, vec)
    return w.contiguous().view(shape)


def tile_order(w_packed: torch.Tensor, vec: int) -> torch.Tensor:
    """The packed words [N, K / 8] re-laid as the kernel reads them (same shape, contiguous): 16-row
    tile by tile, 256-column stage by stage, and in a stage chunk by chunk (32 * vec columns), rows r
    (0..7) then r + 8, lane (r, t), the lane's `vec` words; `vec` is mma_layout's. A warp's load is
    then one contiguous run. The Triton W4A16 kernels read this order too (their `mma_vec`)."""
    return _tile_view(w_packed, vec, False).permute(0, 3, 4, 1, 2, 5, 6).contiguous().view(w_packed.shape)


def row_order(w_tiled: torch.Tensor, vec: int) -> torch.Tensor:
    """The inverse of tile_order: the checkpoint's row-major words."""
    return _tile_view(w_tiled, vec, True).permute(0, 3, 4, 1, 2, 5, 6).contiguous().view(w_tiled.shape)


def supports(m: int, n: int, k: int, group: int, dtype: torch.dtype) -> bool:
    """This kernel computes x[m, k] @ W[n, k]^T in `dtype` with `group` columns per scale."""
    return 1 <= m <= MAX_ROWS and n % 16 == 0 and dtype in (torch.bfloat16, torch.float16) and mma_layout(k, group) is not None


def valid_config(cfg: MmaConfig, k: int, group: int, silu: bool = False) -> bool:
    """cfg divides the launch: warps a multiple of split (and with silu, tiles a CTA in pairs)."""
    ok = mma_layout(k, group) is not None and 1 <= cfg.warps <= MAX_WARPS and cfg.split >= 1 and cfg.warps % cfg.split == 0
    return ok and (not silu or (cfg.warps // cfg.split) % 2 == 0)


def norm_fusable(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """The launch can apply this RMSNorm to x itself: one bf16 row (the offset form stages it), a bf16
    weight of K, and rows on 16 bytes."""
    k = x.shape[-1]
    return (
        x.dim() == 2 and x.shape[0] == 1 and x.dtype == torch.bfloat16 and x.stride(1) == 1 and _aligned(x, 16)
        and weight.dtype == torch.bfloat16 and weight.is_contiguous() and weight.numel() == k and _aligned(weight, 16)
        and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
                                  and _aligned(residual, 16)))
    )  # fmt: skip


def offset_form(m: int, dtype: torch.dtype) -> bool:
    """The kernel subtracts the weights' offset from the group sums (x staged in shared memory): one
    bf16 row. fp16 (whose offset is 8x bf16's against the same float32 sums) and several rows subtract
    it from each weight pair."""
    return m == 1 and dtype == torch.bfloat16


def column_tiles(m: int) -> int:
    """Tiles of 8 x rows (the MMA's B columns) a launch of m rows runs: 1, 2 or 4."""
    return 1 if m <= 8 else 2 if m <= 16 else 4


def smem_bytes(m: int, k: int, vec: int, warps: int, dtype: torch.dtype) -> int:
    """Shared memory a launch needs (mllmd_w4a16_mma_smem in the source): the warps' split-K partials
    (16 x 8 floats a column tile each), and in the offset form x (K halves) with its float32 sum per chunk
    of 32 * vec columns, or with vec 4 each warp's two 512-byte stage buffers (the streamed form) if that
    is more."""
    staged, streamed = 2 * k + (k // (32 * vec)) * 4, warps * 1024 if vec == 4 else 0
    x_bytes = max(staged, streamed) if offset_form(m, dtype) else 0
    return warps * 16 * 8 * column_tiles(m) * 4 + x_bytes


@functools.lru_cache(maxsize=1)
def tuned_configs() -> dict[tuple[int, int], MmaConfig]:
    """Launch configs by (N, K) from the JSON file $MLLMD_W4A16_MMA_TUNED names ({"N,K": [split, warps]},
    what `bench_quant --sweep w4a16_mma` prints as the best per shape); {} when unset."""
    path = knobs.w4a16_mma_tuned_path()
    if not path:
        return {}
    with open(path) as f:
        raw = json.load(f)
    return {tuple(int(v) for v in key.split(",")): MmaConfig(*fields[:2]) for key, fields in raw.items()}  # type: ignore[misc]


def pick_config(n: int, k: int, group: int, num_sms: int, silu: bool = False, rows: int = 1) -> MmaConfig:
    """CTAs of MAX_WARPS warps; K split over the fewest warps (a power of two up to 8, each warp keeping
    two stages or more) that give every SM MIN_WARPS_PER_SM warps and no warp more than
    MAX_STAGES_PER_WARP stages. On the H200's Qwen3-8B shapes these are the bench_quant sweep's picks
    (qkv / o / down split 8, gate_up 2: NOTES.md). With silu a CTA holds its tiles in pairs (split at most
    warps / 2). Several column tiles (rows > 8: each warp has that many times the MMAs) want half the
    warps an SM with no cap on a warp's stages, and CTAs of at least 4 warps holding one tile each (the
    sweep's picks at 16 and 32 rows:
    qkv split 4 on 4 warps, o and down 8 on 8, gate_up 1 on 4). $MLLMD_W4A16_MMA_TUNED's launches, swept
    at one row, apply up to PROBE_MAX_ROWS rows."""
    tuned = tuned_configs().get((n, k)) if rows <= PROBE_MAX_ROWS else None
    if tuned is not None and valid_config(tuned, k, group, silu):
        return tuned
    tiles, stages = n // 16, k // STAGE_K
    multi = column_tiles(rows) > 1
    min_warps = MIN_WARPS_PER_SM // 2 if multi else MIN_WARPS_PER_SM
    split = 1
    while (
        split < MAX_WARPS
        and stages >= 4 * split
        and (tiles * split < min_warps * num_sms or (not multi and stages > MAX_STAGES_PER_WARP * split))
    ):
        split *= 2
    if silu:
        split = min(split, MAX_WARPS // 2)
    return MmaConfig(split, max(4, split) if multi else MAX_WARPS)


class _Library:
    """The loaded shared library's entry points."""

    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        if self.lib.mllmd_w4a16_mma_abi() != ABI_VERSION:
            raise RuntimeError(f"{path}: ABI {self.lib.mllmd_w4a16_mma_abi()}, expected {ABI_VERSION}")
        fn = self.lib.mllmd_w4a16_mma
        fn.argtypes = (
            [ctypes.c_void_p] * 6 + [ctypes.c_int] * 13 + [ctypes.c_void_p] * 3 + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
        )
        fn.restype = ctypes.c_int
        self.launch = fn
        self.lib.mllmd_cuda_error_string.argtypes = [ctypes.c_int]
        self.lib.mllmd_cuda_error_string.restype = ctypes.c_char_p

    def error(self, code: int) -> str:
        return self.lib.mllmd_cuda_error_string(code).decode()


_REASONS: dict[str, str] = {}


@functools.lru_cache(maxsize=8)
def _library_for(arch: str) -> _Library | None:
    if not knobs.cuda_kernels_enabled():
        _REASONS[arch] = "turned off by MLLMD_CUDA_KERNELS"
        return None
    nvcc = cuda_build.find_nvcc()
    if nvcc is None:
        _REASONS[arch] = "no nvcc found (set CUDA_HOME or MLLMD_NVCC)"
        return None
    try:
        return _Library(cuda_build.build(SOURCE, nvcc, arch))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _REASONS[arch] = f"build failed: {e}"
        logger.warning("W4A16 CUDA kernel unavailable for sm_%s, using the Triton kernels: %s", arch, e)
        return None


def _arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}"


def unavailable_reason(device: torch.device) -> str | None:
    """None if the kernel runs on `device` (building it on first use), else why not."""
    if device.type != "cuda":
        return f"needs a CUDA device (got {device.type})"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "needs sm80+ (mma.sync bf16)"
    arch = _arch(device)
    return None if _library_for(arch) is not None else _REASONS.get(arch, "unavailable")


def _smem_limit(device_index: int) -> int:
    return _smem_per_block(device_index)  # torch < 2.7 has no shared_memory_per_block_optin: by capability


def fits(m: int, k: int, group: int, dtype: torch.dtype, device: torch.device) -> bool:
    """A launch of up to MAX_WARPS warps for these shapes fits the device's shared memory per block
    (the offset form stages x, which grows with K: a very long row, or a GPU with less shared memory,
    keeps the Triton kernels)."""
    layout = mma_layout(k, group)
    return layout is not None and smem_bytes(m, k, layout[0], MAX_WARPS, dtype) <= _smem_limit(device.index or 0)


def aligned(x: torch.Tensor) -> bool:
    """x's rows start on 16 bytes (the kernel reads x in 16-byte vectors)."""
    return _aligned(x, 16)


def _aligned(t: torch.Tensor, nbytes: int) -> bool:
    """t's start and row stride are multiples of nbytes (the kernel's vector loads and copies)."""
    return t.data_ptr() % nbytes == 0 and (t.dim() < 2 or t.shape[0] == 1 or (t.stride(0) * t.element_size()) % nbytes == 0)


def w4a16_mma(
    x: torch.Tensor,  # [M, K] bf16 / fp16, M <= 32, unit last stride
    w_packed: torch.Tensor,  # [N, K / 8] int32 in tile_order(w, mma_layout(K, group)[0]), contiguous
    w_scale: torch.Tensor,  # [N, G] float32 stored G-major: strides (1, N) (or [N, 1])
    w_zero_point: torch.Tensor | None = None,  # [N, G] int8, G-major like w_scale
    bias: torch.Tensor | None = None,  # [N] x.dtype, contiguous
    out: torch.Tensor | None = None,  # [M, N] (silu: [M, N / 2]) x.dtype, unit last stride
    config: MmaConfig | None = None,
    norm: NormInput | None = None,
    silu: bool = False,
) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) on the tensor cores, W's words in `tile_order`; callers check
    `supports` and `unavailable_reason` first. Float32 sums; each group's sum is scaled once.

    Fusions, for one bf16 row (the offset form): `norm` makes x the input of that RMSNorm
    (`norm_fusable`), and `silu` returns silu(y[:, :N / 2]) * y[:, N / 2:] (a gate/up layer), each
    rounded as the separate kernels round."""
    m, k = x.shape
    n, kw = w_packed.shape
    groups = w_scale.shape[1]
    group = k // groups
    layout = mma_layout(k, group)
    if not supports(m, n, k, group, x.dtype) or layout is None:
        raise ValueError(f"w4a16_mma cannot run M={m} N={n} K={k} group={group} {x.dtype}")
    if x.stride(1) != 1 or not w_packed.is_contiguous() or w_packed.dtype != torch.int32 or kw != k // 8:
        raise ValueError("w4a16_mma needs K-contiguous x and contiguous int32 w_packed [N, K / 8] (in tile_order)")
    if w_scale.dtype != torch.float32 or w_scale.shape[0] != n or w_scale.stride(0) != 1 or (
        groups > 1 and w_scale.stride(1) != n
    ):
        raise ValueError(f"w4a16_mma needs float32 scales [N, G] stored G-major, got {w_scale.dtype} strides {w_scale.stride()}")
    if w_zero_point is not None and (
        w_zero_point.dtype != torch.int8 or w_zero_point.stride() != w_scale.stride() or w_zero_point.shape != w_scale.shape
    ):
        raise ValueError("w4a16_mma needs int8 zero points laid out as the scales")
    vec, gshift = layout
    if not (_aligned(x, 16) and _aligned(w_packed, 4 * vec) and (w_zero_point is None or w_zero_point.data_ptr() % 4 == 0)):
        raise ValueError(f"w4a16_mma needs x rows on 16 bytes and weight rows on {4 * vec} bytes")
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous() or bias.numel() != n):
        raise ValueError("w4a16_mma needs a contiguous bias [N] in x's dtype")
    if silu and n % 32:
        raise ValueError(f"w4a16_mma: silu needs N a multiple of 32 (two halves of 16-row tiles), got {n}")
    if silu and not offset_form(m, x.dtype):
        raise ValueError(f"w4a16_mma: silu is fused for one bf16 row only, got {m} rows of {x.dtype}")
    residual = residual_out = None
    if norm is not None:
        if not norm_fusable(x, norm.weight, norm.residual):
            raise ValueError("w4a16_mma: a fused RMSNorm needs one bf16 row on 16 bytes and a contiguous bf16 weight of K")
        residual, residual_out = norm.residual, norm.residual_out
        if residual is not None:
            if residual_out is None:
                residual_out = norm.residual_out = torch.empty_like(x)
            if (residual_out.shape != x.shape or residual_out.dtype != x.dtype or not _aligned(residual_out, 16)
                    or residual_out.data_ptr() in (x.data_ptr(), residual.data_ptr())):  # fmt: skip
                raise ValueError("w4a16_mma: residual_out must be a [1, K] bf16 tensor of its own, on 16 bytes")
    n_out = n // 2 if silu else n
    if out is None:
        out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    if out.shape != (m, n_out) or out.stride(1) != 1 or out.dtype != x.dtype:
        raise ValueError(f"w4a16_mma: out must be [M, {'N / 2' if silu else 'N'}] in x's dtype with a unit last stride")
    lib = _library_for(_arch(x.device))
    if lib is None:
        raise RuntimeError(f"w4a16_mma is unavailable: {unavailable_reason(x.device)}")
    cfg = config or pick_config(n, k, group, sm_count_for(x), silu, m)
    if not valid_config(cfg, k, group, silu):
        raise ValueError(f"w4a16_mma: {cfg} does not fit K={k} group={group}" + (" with silu" if silu else ""))
    smem = smem_bytes(m, k, vec, cfg.warps, x.dtype)
    if smem > _smem_limit(x.device.index or 0):
        raise ValueError(f"w4a16_mma: {cfg} at K={k} needs {smem} bytes of shared memory a block, more than the GPU has")
    if cfg.variant != EXACT and (x.dtype != torch.bfloat16 or layout[0] != 4 or w_zero_point is not None
                                 or m > PROBE_MAX_ROWS):  # fmt: skip
        raise ValueError(f"w4a16_mma: the probes are built for bf16, groups of 128+ columns, symmetric, up to {PROBE_MAX_ROWS} rows")
    use_pdl = 1 if pdl_args(x).get("USE_PDL") else 0
    ptr = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
    err = lib.launch(
        x.data_ptr(), w_packed.data_ptr(), w_scale.data_ptr(), ptr(w_zero_point), ptr(bias), out.data_ptr(),
        m, n, k, w_packed.stride(0), x.stride(0), out.stride(0), vec, gshift, cfg.split,
        cfg.warps, cfg.variant, 1 if x.dtype == torch.bfloat16 else 0, use_pdl,
        ptr(residual), ptr(norm.weight) if norm is not None else None, ptr(residual_out),
        float(norm.eps) if norm is not None else 0.0, 1 if silu else 0,
        torch.cuda.current_stream(x.device).cuda_stream,
    )  # fmt: skip
    if err:
        raise RuntimeError(f"w4a16_mma launch failed: {lib.error(err)}")
    return out
