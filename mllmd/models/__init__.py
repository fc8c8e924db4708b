"""Model registry: Hugging Face architecture name -> model class."""

from __future__ import annotations

from typing import Any

SUPPORTED_ARCHITECTURES = (
    "Qwen3ForCausalLM", "Qwen3VLForConditionalGeneration", "Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM",
)


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
