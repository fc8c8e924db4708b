"""The torch-only Qwen3 weights (the demo's: transformers 5 has no model classes below torch 2.6) are
the very tensors the transformers-built test checkpoint holds, and the demo built from them serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from mllmd import LLM, SamplingParams
from mllmd.checkpoint.random_weights import qwen3_weight_layout, random_qwen3_weights
from mllmd.demo import DEMO_SHAPE, DEMO_SOURCE, ensure_demo_model
from mllmd.testing import checkpoints as ck


@pytest.mark.parametrize(("tied", "dtype"), [(True, "float32"), (False, "float32"), (True, "bfloat16")])
def test_torch_only_weights_are_the_transformers_builds(tmp_path: Path, tied: bool, dtype: str) -> None:
    out = ck.build_tiny_checkpoint(tmp_path, "Qwen3-0.6B", num_hidden_layers=3, tie_word_embeddings=tied,
                                   dtype=dtype, seed=7)
    built = load_file(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    drawn = random_qwen3_weights(config, seed=7, dtype=dtype)
    assert sorted(drawn) == sorted(built)
    for name, tensor in built.items():
        assert drawn[name].dtype == tensor.dtype and torch.equal(drawn[name], tensor), name
    assert ("lm_head.weight" in drawn) is not tied


def test_a_different_seed_draws_different_weights() -> None:
    config = json.loads((ck.find_model_source("Qwen3-0.6B") / "config.json").read_text())
    config.update(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)
    a, b = random_qwen3_weights(config, seed=0), random_qwen3_weights(config, seed=1)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], b["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.parametrize(("source", "tied"), [("Qwen3-8B", False), ("Qwen3-0.6B", True)])
def test_the_full_size_layout_is_transformers_own(source: str, tied: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """mllmd.bench.random_checkpoint takes Qwen3's names and shapes from qwen3_weight_layout where
    transformers has no model classes: the same list, in the same order, as its model on the meta device."""
    from mllmd.bench import random_checkpoint as rc

    config = json.loads((ck.find_model_source(source) / "config.json").read_text())
    assert bool(config.get("tie_word_embeddings")) is tied
    expected = rc.parameter_shapes(config)  # transformers' own (its model classes are here)
    monkeypatch.setattr(rc, "hf_model_classes_available", lambda: False)
    monkeypatch.setattr(rc, "_meta_model", None)  # not used any more
    drawn = rc.parameter_shapes(config)
    assert drawn == expected
    assert ("lm_head.weight" in dict(drawn)) is not tied  # transformers lists a tied lm_head under the embedding


def test_other_architectures_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'qwen3_5'"):
        qwen3_weight_layout({"model_type": "qwen3_5"})
    with pytest.raises(ValueError, match="attention_bias"):
        qwen3_weight_layout({"model_type": "qwen3", "attention_bias": True})


def test_the_demo_is_built_without_transformers_model_classes_and_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_model_classes(*args: object, **kwargs: object) -> None:
        raise AssertionError("transformers' model classes were used")

    with monkeypatch.context() as patched:  # the demo never draws its weights through transformers
        patched.setattr(ck, "build_random_model", no_model_classes)
        patched.setattr(transformers, "AutoModelForCausalLM", no_model_classes)
        demo = ensure_demo_model(tmp_path / "demo")
    params = {k: v for k, v in DEMO_SHAPE.items()}
    reference = ck.build_tiny_checkpoint(tmp_path / "reference", DEMO_SOURCE, **params)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "generation_config.json"):
        assert (demo / name).read_bytes() == (reference / name).read_bytes(), name
    marker = json.loads((demo / ck.MARKER_NAME).read_text())
    assert marker["weights"] == "random" and marker["builder"] == "mllmd.demo"
    assert marker["params"] == json.loads((reference / ck.MARKER_NAME).read_text())["params"]
    llm = LLM(str(demo), device="cpu", max_total_tokens=128)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
