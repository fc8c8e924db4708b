"""Quantized tiny Qwen3 checkpoints, made by compressed-tensors itself and built once per session.

`quantize_checkpoint` does what llmcompressor's `oneshot(recipe=QuantizationModifier(scheme=...,
targets="Linear", ignore=["lm_head"]))` does for these data-free schemes, with compressed-tensors'
own functions: attach the preset scheme (`apply_quantization_config`), compute each weight's scale
and zero point from its min/max per channel or per group (llmcompressor's default
"memoryless_minmax" weight observer) with `calculate_qparams`, then `ModelCompressor` compresses
(int8 / packed int4) and writes the `quantization_config`. llmcompressor itself pins an older
transformers than this project runs, so it is not a test dependency; test_llmcompressor.py shows,
where it is installed, that it writes the same tensors.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

# Shapes whose in_features (128 hidden, 128 q, 256 intermediate) are multiples of every group size.
TINY_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2}

# name -> (base checkpoint, compressed-tensors preset scheme, overrides of its weight args)
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "w8a8": ("untied", "W8A8", {}),
    "w4a16_g128": ("untied", "W4A16", {}),
    "w4a16_g64": ("tied", "W4A16", {"group_size": 64}),
    "w4a16_g32_asym": ("tied", "W4A16_ASYM", {"group_size": 32}),
    "w4a16_channel_asym": ("tied", "W4A16_ASYM", {"strategy": "channel", "group_size": None}),
}
W4A16_VARIANTS = [v for v in VARIANTS if v.startswith("w4a16")]
_SKIPPED_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")


def quantize_checkpoint(
    base: Path, out: Path, preset: str, weight_overrides: dict[str, Any] | None = None, ignore: tuple[str, ...] = ("lm_head",)
) -> Path:
    """Quantize the float checkpoint `base` with compressed-tensors and save it compressed in `out`."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if weight_overrides:
        scheme.weights = scheme.weights.model_copy(update=weight_overrides)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)))
    with torch.no_grad():
        for module in model.modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            w = module.weight
            observed = w.unflatten(-1, (-1, args.group_size)) if args.strategy == "group" else w.unsqueeze(-2)
            scale, zero_point = calculate_qparams(observed.amin(-1), observed.amax(-1), args)  # [N, G]
            module.weight_scale.copy_(scale)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero_point)
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    copy_tokenizer_files(base, out)
    return out


def copy_tokenizer_files(base: Path, out: Path) -> None:
    for f in base.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in _SKIPPED_FILES:
            shutil.copy(f, out / f.name)


@pytest.fixture(scope="session")
def tiny_bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Float32 random-weight Qwen3 checkpoints: "untied" (separate lm_head) and "tied"."""
    from mllmd.testing.checkpoints import build_tiny_checkpoint

    return {
        "untied": build_tiny_checkpoint(
            tmp_path_factory.mktemp("q_base_untied"), "Qwen3-0.6B", tie_word_embeddings=False, seed=11, **TINY_SHAPE
        ),
        "tied": build_tiny_checkpoint(
            tmp_path_factory.mktemp("q_base_tied"), "Qwen3-0.6B", tie_word_embeddings=True, seed=12, **TINY_SHAPE
        ),
    }


@pytest.fixture(scope="session")
def quantized(tmp_path_factory: pytest.TempPathFactory, tiny_bases: dict[str, Path]) -> Any:
    """quantized(name) -> folder of VARIANTS[name], built on first use."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            base, preset, overrides = VARIANTS[name]
            cache[name] = quantize_checkpoint(tiny_bases[base], tmp_path_factory.mktemp(f"q_{name}"), preset, overrides)
        return cache[name]

    return get
