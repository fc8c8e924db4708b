"""Model registry: Hugging Face architecture name -> model class."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "Qwen3ForCausalLM", "Qwen3VLForConditionalGeneration", "Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM",
)

# The first transformers release whose AutoConfig reads each model type (mllmd needs transformers only
# for configs and tokenizers; on Python 3.10, Jetson's, the newest transformers is 5.20).
MIN_TRANSFORMERS = {"qwen3": "4.51", "qwen3_vl": "4.57", "qwen3_5": "5.2"}


def load_hf_config(model_path: str | Path) -> Any:
    """transformers' config of a model folder; ValueError naming the transformers release a model type
    needs where the installed one does not know it (instead of its generic "does not recognize")."""
    import transformers
    from transformers import AutoConfig

    try:
        model_type = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None  # AutoConfig reports the missing or broken file itself
    if isinstance(model_type, str) and model_type in MIN_TRANSFORMERS and model_type not in _known_model_types():
        raise ValueError(
            f"model type {model_type!r} needs transformers >= {MIN_TRANSFORMERS[model_type]}; installed: "
            f"{transformers.__version__} (pip install -U 'transformers>={MIN_TRANSFORMERS[model_type]}')"
        )
    return AutoConfig.from_pretrained(model_path)


def _known_model_types() -> set[str]:
    """The model types the installed transformers has configs for."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return set(CONFIG_MAPPING_NAMES)


def get_model_class(architectures: list[str] | None) -> Any:
    """The model class for a config's `architectures`; ValueError naming them when unsupported."""
    for arch in architectures or []:
        if arch == "Qwen3ForCausalLM":
            from mllmd.models.qwen3 import Qwen3ForCausalLM

            return Qwen3ForCausalLM
        if arch in ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"):
            from mllmd.models.qwen3_5 import Qwen3_5ForConditionalGeneration

            return Qwen3_5ForConditionalGeneration
        if arch == "Qwen3VLForConditionalGeneration":
            from mllmd.models.qwen3_vl import Qwen3VLForConditionalGeneration

            return Qwen3VLForConditionalGeneration
    raise ValueError(
        f"unsupported model architecture {architectures!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
    )
