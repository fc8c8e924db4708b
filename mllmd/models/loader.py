"""Weight loading from safetensors: memory-mapped, single file or sharded with an index."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from mllmd.models.weight_files import INDEX_NAME, weight_files

__all__ = ["INDEX_NAME", "iter_weights", "weight_files"]


def iter_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every weight file; tensors are views of the memory-mapped file."""
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
