"""The daemon's built-in demo model: a tiny Qwen3-shaped checkpoint with random weights.

It lets a fresh install answer API calls before any real model is present. Its output is
meaningless by construction; the README.md inside says so.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mllmd.checkpoint.folder import MARKER_NAME, write_checkpoint_folder
from mllmd.checkpoint.random_weights import init_summary, save_random_qwen3_weights
from mllmd.knobs import cache_dir as default_cache_dir

DEMO_MODEL_NAME = "mllmd-demo-random-weights"
DEMO_SOURCE = "Qwen3-0.6B"
DEMO_SHAPE: dict[str, Any] = {
    "num_hidden_layers": 4,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "dtype": "bfloat16",
    "seed": 0,
}

README = f"""# {DEMO_MODEL_NAME}

THIS MODEL HAS RANDOM WEIGHTS. Its output is meaningless text.

It is the built-in demo model of mllmd: a tiny checkpoint with the architecture, vocabulary,
tokenizer and chat template of Qwen3-0.6B ({DEMO_SHAPE["num_hidden_layers"]} layers, hidden size
{DEMO_SHAPE["hidden_size"]}, {DEMO_SHAPE["dtype"]}), whose weights were drawn at random. It exists only
so that you can try the API (chat completions, streaming, metrics, admin commands) right after
installing, without downloading anything. It has not been trained on anything and knows nothing.

To serve a real model, load its folder: `mllmctl load-model /path/to/model`.
"""


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """Return the demo model folder under `cache_dir` (default: the mllmd cache), building it once.

    The build goes to a temporary folder beside the target and is renamed into place, so a
    half-built model is never visible and concurrent callers end up with the same folder.
    """
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "models"
    target = base / DEMO_MODEL_NAME
    if is_current_demo(target):
        return target
    base.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}.", dir=base))
    try:
        _build_demo(staging)
        (staging / "README.md").write_text(README, encoding="utf-8")
        _move_into_place(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _build_demo(out: Path) -> None:
    """The demo's folder: Qwen3-0.6B's config at DEMO_SHAPE, weights drawn with torch alone (they are
    the bytes `mllmd.testing.checkpoints.build_tiny_checkpoint` writes for the same shape)."""
    params: dict[str, Any] = {
        "source": DEMO_SOURCE,
        "tie_word_embeddings": None,
        "max_shard_size": None,
        "extra_overrides": {},
        **DEMO_SHAPE,
    }

    def write_weights(config: dict[str, Any], folder: Path) -> None:
        save_random_qwen3_weights(config, folder, seed=DEMO_SHAPE["seed"], dtype=DEMO_SHAPE["dtype"])

    marker = {"weights": "random", "builder": "mllmd.demo", "init": init_summary()}
    write_checkpoint_folder(out, params, write_weights, marker)


def is_current_demo(path: Path) -> bool:
    """True if `path` holds a complete demo model built with the current parameters."""
    try:
        marker = json.loads((path / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    params = marker.get("params", {})
    expected = {"source": DEMO_SOURCE, **DEMO_SHAPE}
    return marker.get("weights") == "random" and all(params.get(k) == v for k, v in expected.items())


def _move_into_place(staging: Path, target: Path) -> None:
    """Rename `staging` to `target`, replacing a stale target; a concurrent winner is kept."""
    if target.exists() and not is_current_demo(target):
        stale = Path(tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}.stale.", dir=target.parent))
        try:
            os.replace(target, stale / "old")
        except OSError:
            pass  # another process moved it first
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(staging, target)
    except OSError:
        if not is_current_demo(target):  # lost a race to a different, broken build
            raise


if __name__ == "__main__":
    print(ensure_demo_model())
