"""A model folder's config.json and links, checked in the main process before any worker allocates.

A folder may come from anyone: its config.json sizes the tensors the scheduler worker creates before it
reads a weight (vocab_size 10^9 asked the allocator for 256 GB, max_position_embeddings 10^12 for 8 TB
of request table), and a file in it may be a link to anywhere (a generation_config.json linked to
/etc/passwd was read, a tokenizer.json linked outside model.models_dir loaded). So every size must be
a positive integer under a bound far above any real Qwen model, what the sizes imply must fit in
memory (`config_weight_bytes`, a lower bound), and every file of the folder must resolve inside the
folder or a models dir. Each refusal names the key or the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

MAX_CONFIG_BYTES = 1 << 20  # config.json (Qwen3.5's is 3 KB)

# key -> largest value accepted (about 8 to 64 times the largest Qwen3 / Qwen3.5 / Qwen3-VL figure)
TEXT_BOUNDS = {
    "vocab_size": 1 << 21, "hidden_size": 1 << 16, "intermediate_size": 1 << 18, "num_hidden_layers": 1024,
    "num_attention_heads": 1024, "num_key_value_heads": 1024, "head_dim": 1024,
    "max_position_embeddings": 1 << 24, "linear_num_key_heads": 1024, "linear_num_value_heads": 1024,
    "linear_key_head_dim": 1024, "linear_value_head_dim": 1024, "linear_conv_kernel_dim": 64,
}  # fmt: skip
VISION_BOUNDS = {
    "depth": 256, "hidden_size": 1 << 14, "intermediate_size": 1 << 16, "num_heads": 256, "out_hidden_size": 1 << 16,
    "patch_size": 64, "temporal_patch_size": 16, "spatial_merge_size": 16, "in_channels": 16,
    "num_position_embeddings": 1 << 16,
}  # fmt: skip


class ConfigCheckError(ValueError):
    """config.json or a link of the folder is refused; the message names the key or the file."""


def read_config(root: Path) -> dict[str, Any]:
    """config.json as a JSON object, at most MAX_CONFIG_BYTES (FileNotFoundError when absent)."""
    path = root / "config.json"
    with open(path, "rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigCheckError(f"config.json is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(raw)
    except ValueError as e:  # UnicodeDecodeError is one
        raise ConfigCheckError(f"config.json is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConfigCheckError(f"config.json must hold a JSON object (got {type(config).__name__})")
    return config


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's section: `text_config` (Qwen3-VL, Qwen3.5) or the config itself."""
    text = config.get("text_config", config)
    if not isinstance(text, dict):
        raise ConfigCheckError("config.json: 'text_config' must be an object")
    return text


def check_config(config: dict[str, Any]) -> None:
    """Every size present must be an integer in [1, bound]; sections and lists must have their type."""
    archs = config.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ConfigCheckError("config.json: 'architectures' must be a list of strings")
    text = text_config(config)
    _check_sizes(text, TEXT_BOUNDS, "text_config." if text is not config else "")
    kinds = text.get("layer_types")
    if kinds is not None and not (isinstance(kinds, list) and all(isinstance(k, str) for k in kinds)):
        raise ConfigCheckError("config.json: 'layer_types' must be a list of strings")
    vision = config.get("vision_config")
    if vision is not None:
        if not isinstance(vision, dict):
            raise ConfigCheckError("config.json: 'vision_config' must be an object")
        _check_sizes(vision, VISION_BOUNDS, "vision_config.")
    quant = config.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise ConfigCheckError("config.json: 'quantization_config' must be an object")


def _check_sizes(section: dict[str, Any], bounds: dict[str, int], prefix: str) -> None:
    for key, bound in bounds.items():
        v = section.get(key)
        if v is None:
            continue  # transformers' default applies
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= bound:
            raise ConfigCheckError(f"config.json: '{prefix}{key}' must be an integer from 1 to {bound} (got {v!r:.40})")


def config_weight_bytes(config: dict[str, Any]) -> int:
    """A lower bound of the bytes the model's parameters take as config.json sizes them (what the
    scheduler worker allocates before it reads a weight): embeddings, attention and MLP projections,
    the vision tower's blocks; 2 bytes a value (half a byte for a quantized checkpoint)."""
    text = text_config(config)

    def size(section: dict[str, Any], key: str) -> int:
        v = section.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0

    hidden, heads, kv_heads = size(text, "hidden_size"), size(text, "num_attention_heads"), size(text, "num_key_value_heads")
    head_dim = size(text, "head_dim") or (hidden // heads if heads else 0)
    tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    values = size(text, "vocab_size") * hidden * (1 if tied else 2)
    per_layer = 3 * hidden * size(text, "intermediate_size") + hidden * head_dim * (2 * heads + 2 * kv_heads)
    values += size(text, "num_hidden_layers") * per_layer
    vision = config.get("vision_config")
    if isinstance(vision, dict):
        vh = size(vision, "hidden_size")
        values += size(vision, "depth") * (4 * vh * vh + 2 * vh * size(vision, "intermediate_size"))
    return values // 2 if isinstance(config.get("quantization_config"), dict) else values * 2


def context_length(config: dict[str, Any]) -> int | None:
    """max_position_embeddings (checked), or None when the config does not give it."""
    v = text_config(config).get("max_position_embeddings")
    return v if isinstance(v, int) and not isinstance(v, bool) else None



def inside(real: Path, allowed: list[Path]) -> bool:
    """`real` (a resolved path) is one of `allowed` or lies below one."""
    return any(real == a or a in real.parents for a in allowed)


def check_links(root: Path, roots: list[Path] | tuple[Path, ...] = ()) -> None:
    """Every entry of the folder must resolve (links followed) inside it or inside one of `roots`
    (the models dirs): a link to a file elsewhere would have the workers read it."""
    real_root = root.resolve()
    allowed = [real_root, *(Path(r).resolve() for r in roots)]
    for entry in sorted(root.iterdir()):
        if not entry.is_symlink():
            continue
        try:
            real = Path(os.path.realpath(entry, strict=True))
        except (OSError, RuntimeError):
            raise ConfigCheckError(f"{entry.name} is a broken or looping link") from None
        if not inside(real, allowed):
            raise ConfigCheckError(f"{entry.name} is a link to {real}, outside the model folder and "
                                   "model.models_dir: a model folder's files must lie inside them")
