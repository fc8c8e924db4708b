"""Quantized tiny Qwen3 checkpoints, made by compressed-tensors itself and built once per session.

`mllmd.testing.quantize.quantize_checkpoint` does what llmcompressor's data-free `oneshot` does, with
compressed-tensors' own functions (see that module). llmcompressor itself pins an older transformers
than this project runs, so it is not a test dependency; test_llmcompressor.py shows, where it is
installed, that it writes the same tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mllmd.testing.quantize import quantize_checkpoint

# Shapes whose in_features (128 hidden, 128 q, 256 intermediate) are multiples of every group size.
TINY_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2}

# name -> (base checkpoint, compressed-tensors preset scheme, overrides of its weight args)
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "w8a8": ("untied", "W8A8", {}),
    "w4a16_g128": ("untied", "W4A16", {}),
    "w4a16_g64": ("tied", "W4A16", {"group_size": 64}),
    "w4a16_g32_asym": ("tied", "W4A16_ASYM", {"group_size": 32}),
    "w4a16_channel_asym": ("tied", "W4A16_ASYM", {"strategy": "channel", "group_size": None}),
    "w4a16_g128_bf16_scales": ("untied", "W4A16", {}),
}
# Scales stored in another dtype than the base's (float32 here): what llmcompressor writes for a bf16 model.
SCALE_DTYPES: dict[str, str] = {"w4a16_g128_bf16_scales": "bfloat16"}
# Variants whose lm_head is quantized too (made without ignore=["lm_head"]); not in VARIANTS.
LM_HEAD_VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "w4a16_g128_lm_head": ("untied", "W4A16", {}),
    "w8a8_lm_head": ("untied", "W8A8", {}),
}
W4A16_VARIANTS = [v for v in VARIANTS if v.startswith("w4a16")]


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
            base, preset, overrides = VARIANTS[name] if name in VARIANTS else LM_HEAD_VARIANTS[name]
            cache[name] = quantize_checkpoint(tiny_bases[base], tmp_path_factory.mktemp(f"q_{name}"), preset, overrides,
                                              scale_dtype=SCALE_DTYPES.get(name, "model"),
                                              ignore=() if name in LM_HEAD_VARIANTS else ("lm_head",))  # fmt: skip
        return cache[name]

    return get
