"""Attention backends behind one interface; `create_attention_backend` picks one by name."""

from __future__ import annotations

from mllmd.engine.attention.base import AttentionBackend


def create_attention_backend(name: str, device_type: str) -> AttentionBackend:
    """Return the backend for `name` ("auto" picks the best available for the device)."""
    if name == "auto":
        name = "torch"
    if name == "torch":
        from mllmd.engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    raise ValueError(f"runtime.attention_backend: {name!r} is not available in this build (available: auto, torch)")


__all__ = ["AttentionBackend", "create_attention_backend"]
