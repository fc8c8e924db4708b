"""quantization_config parsing: the supported schemes, targets / ignore matching, refusals that name the scheme."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from mllmd.models.quantization import W4A16, W8A8, LinearScheme, UnsupportedQuantization, parse_quant_config
from mllmd.testing.checkpoints import find_model_source

REDHAT_W4A16 = find_model_source("RedHatAI-Qwen3.5-9B-quantized.w4a16") / "config.json"


def ct_config(preset: str, fmt: str | None = None, ignore: list[str] | None = None, **weight_overrides: Any) -> dict:
    """A config.json `quantization_config`, written by compressed-tensors from one of its presets."""
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"])
    if weight_overrides:
        scheme.weights = scheme.weights.model_copy(update=weight_overrides)
    if fmt is not None:
        scheme.format = CompressionFormat(fmt)
    extra = {"format": fmt} if fmt is not None else {}
    cfg = QuantizationConfig(
        config_groups={"group_0": scheme}, ignore=ignore or ["lm_head"], quantization_status="compressed", **extra
    )
    return {"quantization_config": {"quant_method": "compressed-tensors", **cfg.model_dump(mode="json")}}


def _config_of(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def test_unquantized_config_parses_to_none() -> None:
    assert parse_quant_config({"architectures": ["Qwen3ForCausalLM"]}) is None


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("w8a8", LinearScheme(W8A8, 8, "channel", None, True)),
        ("w4a16_g128", LinearScheme(W4A16, 4, "group", 128, True)),
        ("w4a16_g64", LinearScheme(W4A16, 4, "group", 64, True)),
        ("w4a16_g32_asym", LinearScheme(W4A16, 4, "group", 32, False)),
        ("w4a16_channel_asym", LinearScheme(W4A16, 4, "channel", None, False)),
    ],
)
def test_tool_written_configs_parse(quantized: Any, name: str, expected: LinearScheme) -> None:
    cfg = parse_quant_config(_config_of(quantized(name)))
    assert cfg is not None and cfg.method == expected.method
    assert cfg.scheme_for(["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"]) == expected
    assert cfg.scheme_for(["model.layers.1.mlp.down_proj"]) == expected
    assert cfg.scheme_for(["lm_head"]) is None  # ignore: ["lm_head"]


def test_transformers_config_object_parses(quantized: Any) -> None:
    from transformers import AutoConfig

    cfg = parse_quant_config(AutoConfig.from_pretrained(quantized("w8a8")))
    assert cfg is not None and cfg.method == W8A8


def test_targets_and_ignore_match_like_compressed_tensors() -> None:
    raw = ct_config("W4A16", fmt="pack-quantized", ignore=["lm_head", "re:.*mlp\\.down_proj$", "model.layers.1.self_attn.o_proj"])
    raw["quantization_config"]["config_groups"]["group_0"]["targets"] = ["re:.*self_attn\\.(q|k|v|o)_proj$", "re:.*mlp.*"]
    cfg = parse_quant_config(raw)
    assert cfg is not None
    assert cfg.scheme_for(["model.layers.1.self_attn.q_proj"]) is not None
    assert cfg.scheme_for(["model.layers.0.self_attn.o_proj"]) is not None
    assert cfg.scheme_for(["model.layers.1.self_attn.o_proj"]) is None  # exact-name ignore
    assert cfg.scheme_for(["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]) is not None
    assert cfg.scheme_for(["model.layers.0.mlp.down_proj"]) is None  # regex ignore
    assert cfg.scheme_for(["lm_head"]) is None  # not targeted (and ignored)
    with pytest.raises(UnsupportedQuantization, match="mixes quantization schemes"):
        cfg.scheme_for(["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj"])


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        (lambda: ct_config("FP8_DYNAMIC", fmt="float-quantized"), "'float-quantized'"),
        (lambda: ct_config("FP8", fmt="float-quantized"), "float8"),
        (lambda: ct_config("NVFP4", fmt="nvfp4-pack-quantized"), "'nvfp4-pack-quantized'"),
        (lambda: ct_config("W8A16", fmt="pack-quantized"), "int8 (group 128, symmetric) weights"),
        (lambda: ct_config("W4A8", fmt="int-quantized"), "int4"),
        (lambda: ct_config("W8A8", fmt="int-quantized", strategy="tensor"), "int8 (tensor, symmetric) weights"),
        (lambda: ct_config("W4A16", fmt="pack-quantized", actorder="group"), "activation ordering 'group'"),
        (lambda: ct_config("W4A16", fmt="pack-quantized", type="float"), "float4"),
        (lambda: {"quantization_config": {"quant_method": "gptq", "bits": 4}}, "'gptq'"),
        (lambda: {"quantization_config": {"quant_method": "awq", "bits": 4}}, "'awq'"),
    ],
)
def test_unsupported_schemes_are_refused_by_name(raw: Any, named: str) -> None:
    with pytest.raises(UnsupportedQuantization) as err:
        parse_quant_config(raw())
    assert named in str(err.value)


@pytest.mark.parametrize(
    ("qc", "named"),
    [
        ([], "must be a JSON object, not list"),
        ("w4a16", "must be a JSON object, not str"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": ["group_0"]},
         "config_groups must map group names to objects"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": None}},
         "config_groups must map group names to objects"),
    ],
)
def test_malformed_quantization_configs_are_refused_by_what_is_wrong(qc: Any, named: str) -> None:
    """A hand-edited config.json gets an UnsupportedQuantization that says what is wrong, not a TypeError."""
    with pytest.raises(UnsupportedQuantization, match=named):
        parse_quant_config({"quantization_config": qc})


def test_a_single_target_string_is_one_target() -> None:
    """`targets: "Linear"` (a string where compressed-tensors writes a list) targets the class, not its letters."""
    raw = ct_config("W4A16", fmt="pack-quantized")
    raw["quantization_config"]["config_groups"]["group_0"]["targets"] = "Linear"
    cfg = parse_quant_config(raw)
    assert cfg is not None and cfg.groups[0].targets == ("Linear",)
    assert cfg.scheme_for(["model.layers.0.mlp.down_proj"]) is not None


def test_static_activation_scales_are_refused(quantized: Any) -> None:
    raw = _config_of(quantized("w8a8"))
    acts = raw["quantization_config"]["config_groups"]["group_0"]["input_activations"]
    acts.update(strategy="tensor", dynamic=False)
    with pytest.raises(UnsupportedQuantization, match=r"int8 \(tensor, symmetric\) activations"):
        parse_quant_config(raw)


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("kv_cache_scheme", {"num_bits": 8, "type": "float", "strategy": "tensor"}, "KV cache"),
        ("sparsity_config", {"format": "sparse-24-bitmask"}, "sparse-24-bitmask"),
        ("transform_config", {"config_groups": {"u": {}}}, "transform"),
        ("quantization_status", "frozen", "'frozen'"),
    ],
)
def test_other_unsupported_features_are_refused(quantized: Any, key: str, value: Any, named: str) -> None:
    raw = _config_of(quantized("w4a16_g128"))
    raw["quantization_config"][key] = value
    with pytest.raises(UnsupportedQuantization, match=named):
        parse_quant_config(raw)


def test_mixed_precision_is_refused(quantized: Any) -> None:
    raw = _config_of(quantized("w4a16_g128"))
    w8a8 = ct_config("W8A8", fmt="int-quantized")["quantization_config"]["config_groups"]["group_0"]
    groups = raw["quantization_config"]["config_groups"]
    groups["group_1"] = {**copy.deepcopy(w8a8), "targets": ["re:.*down_proj$"]}
    raw["quantization_config"]["format"] = "mixed-precision"
    with pytest.raises(UnsupportedQuantization, match="mixed-precision"):
        parse_quant_config(raw)


def test_real_qwen3_5_w4a16_config_parses_and_ignores_the_right_modules() -> None:
    raw = json.loads(REDHAT_W4A16.read_text())
    cfg = parse_quant_config(raw)
    assert cfg is not None and cfg.method == W4A16
    group128 = LinearScheme(W4A16, 4, "group", 128, True)
    layer_types = raw["text_config"]["layer_types"]
    for i, kind in enumerate(layer_types):
        lm = f"model.language_model.layers.{i}"
        assert cfg.scheme_for([f"{lm}.mlp.{p}" for p in ("gate_proj", "up_proj")]) == group128
        assert cfg.scheme_for([f"{lm}.mlp.down_proj"]) == group128
        if kind == "full_attention":
            qkv = [f"{lm}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
            assert cfg.scheme_for(qkv) == group128 and cfg.scheme_for([f"{lm}.self_attn.o_proj"]) == group128
        else:  # Gated DeltaNet projections stay in full precision
            for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
                assert cfg.scheme_for([f"{lm}.linear_attn.{p}"]) is None, (i, p)
    depth = raw["vision_config"]["depth"]
    for i in range(depth):
        for p in ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2"):
            assert cfg.scheme_for([f"model.visual.blocks.{i}.{p}"]) is None
    assert cfg.scheme_for(["model.visual.merger.linear_fc1"]) is None
    assert cfg.scheme_for(["lm_head"]) is None
    assert cfg.scheme_for(["mtp.layers.0.mlp.gate_proj"]) is None  # "re:^mtp.*"
    assert cfg.scheme_for(["mtp.fc"]) is None
