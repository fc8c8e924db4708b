"""Where llmcompressor is installed: its oneshot output equals the test checkpoints tensor for tensor.

llmcompressor pins an older transformers than this project, so it is not a test dependency; the
test checkpoints are made with compressed-tensors directly (conftest.py), and this shows that
they are what users get from `oneshot(recipe=QuantizationModifier(...))`. To run it:
`pip install --no-deps llmcompressor compressed-tensors datasets` in a scratch environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mllmd.models.quantization import parse_quant_config

from .conftest import VARIANTS

pytest.importorskip("llmcompressor", reason="llmcompressor is not installed (optional cross-check)")


def _recipe(name: str) -> Any:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    _base, preset, overrides = VARIANTS[name]
    if not overrides:  # the recipe of issue 7 as users write it
        return QuantizationModifier(targets="Linear", scheme=preset, ignore=["lm_head"])
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"])
    scheme.weights = scheme.weights.model_copy(update=overrides)
    return QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])


@pytest.mark.parametrize("variant", ["w8a8", "w4a16_g128", "w4a16_g32_asym", "w4a16_channel_asym"])
def test_llmcompressor_oneshot_writes_the_same_checkpoint(
    quantized: Any, tiny_bases: dict[str, Path], tmp_path: Path, variant: str
) -> None:
    import json

    from llmcompressor import oneshot
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_bases[VARIANTS[variant][0]], dtype=torch.float32)
    oneshot(model=model, recipe=_recipe(variant))
    model.save_pretrained(tmp_path, save_compressed=True)
    ours = quantized(variant)
    theirs_tensors = load_file(tmp_path / "model.safetensors")
    ours_tensors = load_file(ours / "model.safetensors")
    assert sorted(theirs_tensors) == sorted(ours_tensors)
    for name, t in ours_tensors.items():
        assert torch.equal(t, theirs_tensors[name]), name
    configs = [json.loads((d / "config.json").read_text()) for d in (tmp_path, ours)]
    assert parse_quant_config(configs[0]) == parse_quant_config(configs[1])
