"""Triton import shim and small helpers shared by the kernel modules.

Every kernel module imports `triton` / `tl` from here so that it still imports (and its torch
reference still works) on machines without Triton: there `jit` returns a stub that raises when a
kernel is launched.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

import torch

from mllmd_kernels import knobs

try:  # pragma: no cover - depends on the environment
    import triton
    import triton.language as tl

    # the CUDA math library: expf as torch's CUDA kernels compute it (tl.exp is ex2.approx)
    from triton.language.extra import libdevice

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

    class _MissingKernel:
        def __init__(self, fn: Any) -> None:
            self.fn = fn

        def __getitem__(self, grid: Any) -> Any:
            raise RuntimeError(f"{self.fn.__name__}: Triton is not installed")

    class _MissingTriton:
        """Enough of `triton` for the modules to import: @triton.jit and triton.cdiv."""

        @staticmethod
        def jit(fn: Any = None, **_kwargs: Any) -> Any:
            return _MissingKernel(fn) if fn is not None else _MissingKernel

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(0, int(n) - 1).bit_length()

    triton = _MissingTriton()  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    libdevice = None  # type: ignore[assignment]


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """CUDA is present and Triton imports: the GPU kernels can run."""
    return HAS_TRITON and torch.cuda.is_available()


def triton_runnable(t: torch.Tensor) -> bool:
    """Kernels can run on tensors like `t`: on CUDA with Triton, or anywhere under the interpreter."""
    if not HAS_TRITON:
        return False
    return t.is_cuda or (interpreting() and t.device.type == "cpu")


def use_triton(t: torch.Tensor) -> bool:
    """Default dispatch: Triton for CUDA tensors when available (never the slow interpreter)."""
    return HAS_TRITON and t.is_cuda


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether tl.dot operands must be upcast to fp32 (fp32 data, or the interpreter, whose bf16
    arithmetic is wrong in Triton 3.x); fp32 dots then run with input_precision="ieee"."""
    return dtype == torch.float32 or interpreting()


@functools.lru_cache(maxsize=8)
def num_sms(device_index: int = 0) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H200, 16 on Orin AGX)."""
    if not torch.cuda.is_available():
        return 16
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count_for(t: torch.Tensor) -> int:
    return num_sms(t.device.index or 0) if t.is_cuda else 16


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids on the host: plain integer math (newer Triton wraps triton.cdiv
    as a constexpr function, a few microseconds a call on every launch)."""
    return -(-a // b)


# Programmatic dependent launch (PDL, sm90+): a kernel launched with Triton's `launch_pdl` may start
# while the previous kernel in the stream is still running; it must wait for that kernel's results
# (`griddepcontrol.wait`) before it reads or writes global memory. Every kernel with a USE_PDL
# constexpr calls `pdl_sync` before its first global access (the exceptions: the int8 gemv's L2
# prefetch of its weights, below, which no kernel writes, and the early reads below) and takes its
# launch arguments from `pdl_args`, which sets USE_PDL and launch_pdl together: a PDL launch without
# the wait would race.
#
# Early reads: `pdl_sync` lets the next kernel launch only after its own wait, so when a kernel starts,
# every kernel before the one just before it has finished. Before its wait a kernel may therefore read
# what that one kernel does not write, and write nothing. The RoPE kernel reads the positions, slots,
# cos/sin rows and norm weights there (the qkv projection before it writes only qkv), decode
# attention's stage 1 the lengths, request rows and its first tile of slots (RoPE before it writes
# q and the step's K/V), stage 2 the lengths; tests/kernel/test_pdl.py checks the PTX. (What PDL and
# the early reads gained: NOTES.md.)
# The launch overlaps a kernel's start (launch, block scheduling, address setup) with the tail of the
# one before it, which a batch-1 decode step of ~400 short kernels pays once per kernel.
#
# `griddepcontrol.wait` orders a kernel after the *kernels* before it; whether a PDL launch right after
# a copy or a memset (a host-to-device `.to("cuda")`) waits for it is not verified here. So kernels
# launch with PDL only inside `pdl_launches()`, which the decode CUDA graphs' warm-up and capture
# enter: there every kernel of the step follows another kernel (the embedding comes first).
_NO_PDL: dict[str, bool] = {"USE_PDL": False}
_WITH_PDL: dict[str, bool] = {"USE_PDL": True, "launch_pdl": True}
_pdl_depth = 0  # open pdl_launches() scopes (the engine launches from one thread)


@contextlib.contextmanager
def pdl_launches() -> Iterator[None]:
    """Within: kernels launch with PDL where `pdl_supported`. Only for code whose kernels each follow
    another kernel in the stream, never a copy or a memset (see above)."""
    global _pdl_depth
    _pdl_depth += 1
    try:
        yield
    finally:
        _pdl_depth -= 1


@functools.lru_cache(maxsize=8)
def pdl_supported(device_index: int) -> bool:
    """The device is sm90+ and this Triton launches with PDL (its `launch_pdl` option: Triton 3.4+);
    MLLMD_PDL=0 (read once per process) turns it off for comparison."""
    if not HAS_TRITON or not knobs.pdl_enabled():
        return False
    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - not an NVIDIA build
        return False
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return "launch_pdl" in fields


@functools.lru_cache(maxsize=8)
def multi_dot_min_tile(device_index: int) -> int:
    """Smallest M/N/K a dot may have in a kernel of several dots on this device: 64 on Hopper (sm90),
    whose wgmma lowering in Triton 3.4-3.6 reads shared memory out of bounds, or corrupts it, for 16-
    and 32-wide tiles when two or more dots share a kernel (an illegal address in the GDN chunk kernels
    at Dk = 128 on an H200; pytorch/helion#1905 and flash-linear-attention#826 describe the same);
    16 elsewhere (sm87's mma.sync has no such limit, and its registers want the small tiles)."""
    if not torch.cuda.is_available() or interpreting():
        return 16
    return 64 if torch.cuda.get_device_capability(device_index)[0] == 9 else 16


def pdl_args(t: torch.Tensor) -> dict[str, bool]:
    """Launch keyword arguments for a kernel with a USE_PDL constexpr, on `t`'s device: PDL inside
    `pdl_launches()` on a GPU that supports it, else none."""
    if not _pdl_depth or not (HAS_TRITON and t.is_cuda) or interpreting():
        return _NO_PDL
    return _WITH_PDL if pdl_supported(t.device.index or 0) else _NO_PDL


# Weight prefetch before the PDL wait: a one-row GEMV's CTAs start while the kernel before it runs
# (above), and its weights are memory no kernel of the step writes, so they may be read before
# `griddepcontrol.wait`. `prefetch_tile_l2` asks L2 for the lines of each program's first weight
# tile there; the loads after the wait then hit L2. Used by the int8 gemv only: the same prefetch made
# the bf16 and W4A16 gemvs' decode steps slower, and two K steps' tiles were slower than one (NOTES.md).


@triton.jit
def prefetch_l2(ptrs, mask):
    """`prefetch.global.L2` of the line at each of `ptrs` where `mask` (no data reaches registers)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def prefetch_tile_l2(base, rows, mask_rows, stride_row, col0, n_cols, TILE: tl.constexpr, STEP: tl.constexpr):
    """prefetch_l2 of columns [col0, col0 + min(TILE, n_cols)) of the given rows of a row-major
    matrix at `base`: one address every STEP elements (STEP elements = one 128-byte line)."""
    cols = tl.arange(0, TILE // STEP) * STEP
    prefetch_l2(base + rows[:, None] * stride_row + (col0 + cols)[None, :], mask_rows[:, None] & (cols < n_cols)[None, :])


@triton.jit
def pdl_sync(USE_PDL: tl.constexpr):
    """With USE_PDL: wait until the previous kernel's writes are visible, then let the next kernel
    launch (it waits in turn). Without: nothing (Triton < 3.4, pre-Hopper GPUs, the interpreter)."""
    if USE_PDL:  # PTX 7.8 (sm90); written here, not tl.extra.cuda's, which Triton 3.0 lacks
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )

