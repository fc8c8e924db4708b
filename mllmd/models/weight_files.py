"""Which safetensors files make up a checkpoint (no torch: the daemon's main process uses it too)."""

from __future__ import annotations

import json
from pathlib import Path

INDEX_NAME = "model.safetensors.index.json"


class WeightFilesError(FileNotFoundError):
    """The checkpoint's weight files are missing or its index is broken; the message says which."""


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, in index order; error if none or if the index lies."""
    root = Path(model_dir)
    index = root / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            weight_map = None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise WeightFilesError(f"{INDEX_NAME} is not a valid safetensors index")
        names = sorted(set(weight_map.values()))
        if any(Path(n).name != n for n in names):  # a shard is a file of the folder, never a path
            raise WeightFilesError(f"{INDEX_NAME} names a shard outside the model folder")
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise WeightFilesError(f"weights are incomplete: {INDEX_NAME} names missing files {', '.join(missing)}")
        return [root / n for n in names]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise WeightFilesError(f"no weights: {root} has no *.safetensors files")
    return files
