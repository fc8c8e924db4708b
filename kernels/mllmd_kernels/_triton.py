"""Triton import shim and small helpers shared by the kernel modules.

Every kernel module imports `triton` / `tl` from here so that it still imports (and its torch
reference still works) on machines without Triton: there `jit` returns a stub that raises when a
kernel is launched.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

try:  # pragma: no cover - depends on the environment
    import triton
    import triton.language as tl

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
