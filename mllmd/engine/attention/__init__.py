"""Attention backends behind one interface; `create_attention_backend` picks one by name."""

from __future__ import annotations

from typing import Any

import torch

from mllmd.engine.attention.base import AttentionBackend, PagedAttentionStep
from mllmd.engine.memory import KVPool


def _triton_usable(device_type: str) -> bool:
    """Triton kernels run on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (development only)."""
    from mllmd_kernels import HAS_TRITON, interpreting

    return HAS_TRITON and (device_type == "cuda" or (device_type == "cpu" and interpreting()))


def create_attention_backend(
    name: str,
    device_type: str,
    kv_pool: KVPool,
    req_to_token: torch.Tensor,
    *,
    device: Any = None,
    num_qo_heads: int | None = None,
    scale: float | None = None,
    dtype: Any = None,
    head_dim: int | None = None,
) -> AttentionBackend:
    """The backend for `name` ("auto": triton on CUDA when Triton is installed, else torch) over `kv_pool`
    and the request-to-token table.

    `auto` does not pick flashinfer: it has no decode CUDA graphs yet, and without them a decode step
    pays the launch of every kernel (triton with graphs: 4.4 ms per Qwen3-8B batch-1 step on an H200).
    The keyword arguments (the model's attention geometry) are what the flashinfer backend plans with.
    """
    if name == "auto":
        name = "triton" if device_type == "cuda" and _triton_usable(device_type) else "torch"
    if name == "torch":
        from mllmd.engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(kv_pool, req_to_token)
    if name == "triton":
        if not _triton_usable(device_type):
            raise ValueError(
                f"runtime.attention_backend: 'triton' needs a CUDA device and the triton package "
                f"(device is {device_type!r})"
            )
        from mllmd.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(kv_pool, req_to_token)
    if name == "flashinfer":
        from mllmd.engine.attention.flashinfer_backend import (
            FlashInferAttentionBackend,
            flashinfer_importable,
        )

        if device_type != "cuda" or not flashinfer_importable():
            raise ValueError(
                "runtime.attention_backend: 'flashinfer' needs a CUDA device and the flashinfer-python package "
                "(pip install 'mllmd[gpu]')"
            )
        if num_qo_heads is None or scale is None or dtype is None:
            raise ValueError("the flashinfer backend needs the model's num_qo_heads, scale and dtype")
        return FlashInferAttentionBackend(kv_pool, req_to_token, device, num_qo_heads, scale, dtype, head_dim)
    raise ValueError(
        f"runtime.attention_backend: {name!r} is not available (choose auto, torch, triton or flashinfer)"
    )


__all__ = ["AttentionBackend", "PagedAttentionStep", "create_attention_backend"]
