"""Model folders from the real Qwen configs: the shrunken config, the source's extra files, the Qwen
tokenizer, a marker saying the weights are random. The weights themselves come from the caller
(`mllmd.checkpoint.random_weights` for the demo, transformers' model classes for the test checkpoints
of `mllmd.testing.checkpoints`), so the daemon's demo model is built without test code."""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mllmd import knobs
from mllmd.checkpoint.tokenizer import DATA_DIR, build_qwen_tokenizer

MARKER_NAME = "MLLMD_TEST_CHECKPOINT.json"
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding the `mllmd` package
# Extra files copied verbatim from the source folder when present.
COPIED_FILES = ("generation_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
TINY_VISION = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4}


def write_checkpoint_folder(
    out: Path,
    params: dict[str, Any],
    write_weights: Callable[[dict[str, Any], Path], None],
    marker: dict[str, Any],
) -> Path:
    """Fill `out` from the real config of `params["source"]` shrunk to `params` (see `tiny_config`):
    `write_weights(config, out)` writes the weights, then config.json, the source's extra files, the
    tokenizer and `marker` (with the params) go beside them; return `out`."""
    src = find_model_source(params["source"])
    raw = json.loads((src / "config.json").read_text(encoding="utf-8"))
    config = tiny_config(raw, params)
    out.mkdir(parents=True, exist_ok=True)
    write_weights(config, out)
    write_json(out / "config.json", config)
    copy_source_files(src, out)
    build_tokenizer(src, raw, out)
    write_json(out / MARKER_NAME, {**marker, "params": params})
    return out


def shared_models_dir() -> Path:
    """The real model configs: `$MLLMD_SHARED_MODELS`, else `<repo root>/../shared/models`."""
    return knobs.shared_models_dir() or PACKAGE_ROOT.parent / "shared" / "models"


def find_model_source(source: str | os.PathLike[str]) -> Path:
    """Folder of the real config files for `source` (a folder path, or a model name).

    A name is looked up in `$MLLMD_SHARED_MODELS` when set, then in the copies vendored in
    `mllmd/checkpoint/data/` (every model of shared/models), then in `../shared/models`.
    """
    path = Path(source)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    candidates = [DATA_DIR / str(source), shared_models_dir() / str(source)]
    if knobs.shared_models_dir() is not None:
        candidates.reverse()
    for candidate in candidates:
        if (candidate / "config.json").is_file():
            return candidate
    looked = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"no config.json for model source {str(source)!r} (looked in {looked})")


def tiny_config(raw: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The source's config.json dict with the shape overrides of `params` applied (a new dict)."""
    config = copy.deepcopy(raw)
    if "quantization_config" in config:
        raise ValueError("random weights cannot fill a quantized checkpoint; build from the base model")
    text = config.get("text_config", config)
    layers = params["num_hidden_layers"]
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads"):
        text[key] = params[key]
    text["num_key_value_heads"] = params["num_key_value_heads"]
    text["head_dim"] = params["head_dim"]
    if "max_window_layers" in text:
        text["max_window_layers"] = layers
    if "layer_types" in text:
        text["layer_types"] = _hybrid_layer_types(text["layer_types"], layers)
    _shrink_linear_attention(text, params)
    for rope_key in ("rope_scaling", "rope_parameters"):
        if isinstance(text.get(rope_key), dict):
            scale_mrope(text[rope_key], params["head_dim"])
    if isinstance(config.get("vision_config"), dict):
        _shrink_vision(config["vision_config"], params["hidden_size"])
    if params["tie_word_embeddings"] is not None:
        config["tie_word_embeddings"] = text["tie_word_embeddings"] = params["tie_word_embeddings"]
    _set_dtype(config, text, params["dtype"])
    _deep_merge(config, params["extra_overrides"])
    return config


def _hybrid_layer_types(pattern: list[Any], n: int) -> list[Any]:
    """Repeat a per-layer pattern (e.g. Qwen3.5's 3 linear + 1 full attention) over `n` layers.

    Fewer layers than the pattern's period would drop every full-attention layer (2 of Qwen3.5's
    "linear, linear, linear, full"), a model no engine pages KV for: the last layer then takes the
    pattern's full attention, so every kind of the source is still built."""
    types = [pattern[i % len(pattern)] for i in range(n)]
    if n and "full_attention" in pattern and "full_attention" not in types:
        types[-1] = "full_attention"
    return types


def _shrink_linear_attention(text: dict[str, Any], params: dict[str, Any]) -> None:
    """Qwen3.5 Gated DeltaNet layers: key heads = KV heads, value heads = query heads, dim = head_dim."""
    if "linear_num_key_heads" not in text:
        return
    text["linear_num_key_heads"] = params["num_key_value_heads"]
    text["linear_num_value_heads"] = params["num_attention_heads"]
    text["linear_key_head_dim"] = params["head_dim"]
    text["linear_value_head_dim"] = params["head_dim"]


def scale_mrope(rope: dict[str, Any], head_dim: int) -> None:
    """Rescale an M-RoPE `mrope_section` so that it still sums to half the rotary dimension."""
    sections = rope.get("mrope_section")
    if not sections:
        return
    half = int(head_dim * rope.get("partial_rotary_factor", 1.0)) // 2
    exact = [s * half / sum(sections) for s in sections]
    scaled = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: scaled[i] - exact[i])
    for i in by_remainder[: half - sum(scaled)]:
        scaled[i] += 1
    rope["mrope_section"] = scaled


def _shrink_vision(vision: dict[str, Any], text_hidden: int) -> None:
    vision.update(TINY_VISION)
    vision["out_hidden_size"] = text_hidden
    if vision.get("deepstack_visual_indexes"):
        count = min(len(vision["deepstack_visual_indexes"]), TINY_VISION["depth"])
        vision["deepstack_visual_indexes"] = list(range(count))


def _set_dtype(config: dict[str, Any], text: dict[str, Any], dtype: str) -> None:
    found = False
    for target in (config, text):
        for key in ("torch_dtype", "dtype"):
            if key in target:
                target[key] = dtype
                found = True
    if not found:
        config["torch_dtype"] = dtype


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)


def copy_source_files(src: Path, out: Path) -> None:
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    templates = sorted(src.glob("*.jinja"))
    if templates:
        shutil.copyfile(templates[0], out / "chat_template.jinja")


def build_tokenizer(src: Path, raw: dict[str, Any], out: Path) -> None:
    model_type = str(raw.get("model_type", ""))
    vocab = "qwen3_5" if model_type.startswith("qwen3_5") else "qwen3"
    tokenizer_config = src / "tokenizer_config.json"
    templates = sorted(src.glob("*.jinja"))
    build_qwen_tokenizer(
        out,
        tokenizer_config if tokenizer_config.is_file() else None,
        vocab=vocab,
        chat_template=templates[0] if templates else None,
    )


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
