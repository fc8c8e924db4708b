"""Weight loading from safetensors: memory-mapped, single file or sharded with an index."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, in index order; error if none or if the index lies."""
    root = Path(model_dir)
    index = root / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (root / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names missing weight files: {', '.join(missing)}")
        return [root / f for f in files]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {root}")
    return files


def iter_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every weight file; tensors are views of the memory-mapped file."""
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
