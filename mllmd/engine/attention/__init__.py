"""Attention backends behind one interface; `create_attention_backend` picks one by name."""

from __future__ import annotations

from mllmd.engine.attention.base import AttentionBackend


def _triton_usable(device_type: str) -> bool:
    """Triton kernels run on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (development only)."""
    from mllmd_kernels import HAS_TRITON, interpreting

    return HAS_TRITON and (device_type == "cuda" or (device_type == "cpu" and interpreting()))


def create_attention_backend(name: str, device_type: str) -> AttentionBackend:
    """Return the backend for `name` ("auto": triton on CUDA when Triton is installed, else torch)."""
    if name == "auto":
        name = "triton" if device_type == "cuda" and _triton_usable(device_type) else "torch"
    if name == "torch":
        from mllmd.engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        if not _triton_usable(device_type):
            raise ValueError(
                f"runtime.attention_backend: 'triton' needs a CUDA device and the triton package "
                f"(device is {device_type!r})"
            )
        from mllmd.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(
        f"runtime.attention_backend: {name!r} is not available in this build (available: auto, torch, triton)"
    )


__all__ = ["AttentionBackend", "create_attention_backend"]
