"""A Qwen3.5 W4A16 checkpoint made the way RedHatAI's Qwen3.5-9B-quantized.w4a16 is: compressed-tensors
pack-quantized int4, group 128, symmetric, over every Linear except the lm_head, the vision tower and
the Gated DeltaNet layers' projections (the real file's `ignore` list, its names mapped to a tiny
model's layers). It loads with the same layers quantized as named, and its greedy tokens equal
transformers' on the checkpoint decompressed by compressed-tensors (float32, CPU)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from mllmd import LLM, SamplingParams
from mllmd.testing import checkpoints as ck
from mllmd.testing.quantize import decompressed_reference, quantize_checkpoint, redhat_qwen3_5_ignore

REAL = "RedHatAI-Qwen3.5-9B-quantized.w4a16"
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _shape(name: str) -> str:
    return re.sub(r"\d+", "N", name)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = ck.build_tiny_checkpoint(tmp_path_factory.mktemp("q35_base"), "Qwen3.5-0.8B", num_hidden_layers=4,
                                    hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=32, seed=21)  # fmt: skip
    config = json.loads((base / "config.json").read_text())
    return quantize_checkpoint(base, tmp_path_factory.mktemp("q35_w4a16"), "W4A16", ignore=tuple(redhat_qwen3_5_ignore(config)))


def test_the_recipe_is_the_real_checkpoints(checkpoint: Path) -> None:
    real = json.loads((ck.find_model_source(REAL) / "config.json").read_text())["quantization_config"]
    ours = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    # compressed-tensors writes only the names that matched a module: transformers' model has no MTP head
    assert {_shape(n) for n in ours["ignore"]} == {_shape(n) for n in real["ignore"]} - {"re:^mtp.*"}
    want, got = real["config_groups"]["group_0"]["weights"], ours["config_groups"]["group_0"]["weights"]
    for key in ("num_bits", "group_size", "strategy", "symmetric", "type"):
        assert got[key] == want[key], key
    assert ours["format"] == real["format"] == "pack-quantized"


def test_layers_are_quantized_as_named(checkpoint: Path) -> None:
    llm = LLM(str(checkpoint), dtype="float32", device="cpu")
    model = llm.engine.runner.model
    quantized = {n for n, m in model.named_modules() if getattr(m, "quant_method", None) is not None}
    decoder = model.decoder
    assert quantized, "no layer loaded quantized"
    for i, layer in enumerate(decoder.layers):
        prefix = f"model.language_model.layers.{i}"
        assert any(n.startswith(f"{prefix}.mlp") for n in quantized), f"layer {i}'s MLP is not quantized"
        if layer.is_linear:
            assert not any(n.startswith(f"{prefix}.linear_attn") for n in quantized), f"layer {i}'s DeltaNet is"
        else:
            assert any(n.startswith(f"{prefix}.self_attn") for n in quantized), f"layer {i}'s attention is not"
    assert not any(n.startswith("model.visual") or n.startswith("lm_head") for n in quantized)


def test_greedy_tokens_equal_transformers(checkpoint: Path) -> None:
    ref = decompressed_reference(checkpoint)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 150000, (n,), generator=g).tolist() for n in (5, 70, 130)]
    llm = LLM(str(checkpoint), dtype="float32", device="cpu", chunked_prefill_size=64)
    outs = llm.generate(prompts, GREEDY)
    for ids, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            want = ref.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert out.token_ids == want[0, len(ids):].tolist()
