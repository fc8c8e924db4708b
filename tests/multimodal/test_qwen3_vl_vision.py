"""The vision tower equals transformers' Qwen3VLVisionModel on the same random weights and patches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mllmd.models.qwen3_vl_vision import (
    VISUAL_PREFIX,
    Qwen3VLVisionModel,
    VisionTowerConfig,
    vision_attention,
)
from mllmd.testing.checkpoints import build_random_model, tiny_config

# A 4-block tower with deepstack after blocks 1 and 2 (the real config: 24 blocks, [5, 11, 17]).
VISION = {"depth": 4, "deepstack_visual_indexes": [1, 2]}


def tiny_params(**overrides: Any) -> dict[str, Any]:
    params = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": None,
        "dtype": "float32",
        "extra_overrides": {"vision_config": VISION},
    }
    return {**params, **overrides}


@pytest.fixture(scope="module")
def hf_model(vl_source: Path) -> Any:
    """A tiny random Qwen3VLForConditionalGeneration from the real 2B config (biases and LayerNorm shifts
    re-drawn too, so that a bias loaded into the wrong place shows)."""
    raw = json.loads((vl_source / "config.json").read_text())
    model = build_random_model(tiny_config(raw, tiny_params()), seed=3)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in model.model.visual.named_parameters():
            if name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return model


@pytest.fixture(scope="module")
def ours(hf_model: Any) -> Qwen3VLVisionModel:
    tower = Qwen3VLVisionModel(hf_model.config.vision_config)
    weights = ((VISUAL_PREFIX + k, v) for k, v in hf_model.model.visual.state_dict().items())
    tower.load_weights(weights)
    return tower.eval()


def run_both(hf_model: Any, ours: Qwen3VLVisionModel, grids: list[list[int]], seed: int) -> None:
    n = sum(t * h * w for t, h, w in grids)
    pixel_values = torch.randn(n, 1536, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = hf_model.model.visual(pixel_values, grid_thw=torch.tensor(grids), return_dict=True)
        embeds, deepstack = ours(pixel_values, grids)
    assert embeds.shape == (n // 4, 64) and len(deepstack) == len(ref.deepstack_features) == 2
    scale = ref.pooler_output.abs().max()
    torch.testing.assert_close(embeds, ref.pooler_output, rtol=1e-5, atol=1e-5 * scale)
    for got, want in zip(deepstack, ref.deepstack_features, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max())


def test_config_of_the_tiny_tower(hf_model: Any) -> None:
    vision = hf_model.config.vision_config
    assert (vision.depth, vision.hidden_size, vision.num_heads, vision.out_hidden_size) == (4, 64, 4, 64)
    assert list(vision.deepstack_visual_indexes) == [1, 2]
    assert (vision.patch_size, vision.temporal_patch_size, vision.num_position_embeddings) == (16, 2, 2304)
    cfg = VisionTowerConfig.from_hf(vision)
    assert cfg.rope_theta == 10000.0 and cfg.hidden_act == "gelu_pytorch_tanh"


def test_two_images_of_different_sizes(hf_model: Any, ours: Qwen3VLVisionModel) -> None:
    run_both(hf_model, ours, [[1, 4, 6], [1, 10, 8]], seed=0)


def test_one_image_alone(hf_model: Any, ours: Qwen3VLVisionModel) -> None:
    run_both(hf_model, ours, [[1, 6, 6]], seed=1)


def test_grids_beyond_the_position_table_and_video_frames(hf_model: Any, ours: Qwen3VLVisionModel) -> None:
    # 2 x 100 patches upsamples the 48-wide table; t=2 is two frames that attend separately.
    run_both(hf_model, ours, [[1, 2, 100], [2, 4, 4], [1, 4, 4], [1, 4, 4]], seed=2)


def test_grids_as_host_list_tensor_or_prepared(ours: Qwen3VLVisionModel) -> None:
    grids = [[1, 4, 6], [1, 2, 2]]
    pixel_values = torch.randn(28, 1536)
    with torch.no_grad():
        a, _ = ours(pixel_values, grids)
        b, _ = ours(pixel_values, torch.tensor(grids))
        prepared = ours.prepare(grids)
        c, _ = ours(pixel_values, prepared)
    assert torch.equal(a, b) and torch.equal(a, c)
    assert (
        prepared.seqlens == [24, 4]
        and prepared.cu_seqlens.tolist() == [0, 24, 28]
        and prepared.max_seqlen == 24
    )
    with pytest.raises(ValueError, match="do not match the grids"):
        ours(pixel_values[:27], grids)
    with pytest.raises(ValueError, match="multiples of 2"):
        ours.prepare([[1, 3, 4]])


def test_attention_stays_inside_each_segment(ours: Qwen3VLVisionModel) -> None:
    inputs = ours.prepare([[1, 2, 2], [1, 2, 4], [1, 2, 2]])
    q, k, v = (torch.randn(16, 4, 16) for _ in range(3))
    out = vision_attention(q, k, v, inputs, 0.25)
    for start, end in ((0, 4), (4, 12), (12, 16)):
        qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))
        expected = torch.softmax(qs @ ks.transpose(1, 2) * 0.25, dim=-1) @ vs
        torch.testing.assert_close(out[start:end], expected.transpose(0, 1), rtol=1e-5, atol=1e-6)


def test_load_weights_names_missing_and_unexpected(hf_model: Any) -> None:
    state = hf_model.model.visual.state_dict()
    tower = Qwen3VLVisionModel(hf_model.config.vision_config)
    partial = [(VISUAL_PREFIX + k, v) for k, v in state.items() if not k.startswith("merger.")]
    with pytest.raises(ValueError, match=r"missing \['model.visual.merger"):
        tower.load_weights(partial)
    extra = [(VISUAL_PREFIX + k, v) for k, v in state.items()] + [
        ("model.language_model.norm.weight", torch.ones(64))
    ]
    with pytest.raises(ValueError, match=r"unexpected \['model.language_model.norm.weight'\]"):
        tower.load_weights(extra)
    wrong = [(VISUAL_PREFIX + k, v[:1] if k == "pos_embed.weight" else v) for k, v in state.items()]
    with pytest.raises(ValueError, match="pos_embed.weight: checkpoint shape"):
        tower.load_weights(wrong)


def test_bfloat16_tower_is_close(hf_model: Any, ours: Qwen3VLVisionModel) -> None:
    tower = Qwen3VLVisionModel(hf_model.config.vision_config, dtype=torch.bfloat16)
    tower.load_weights((VISUAL_PREFIX + k, v) for k, v in hf_model.model.visual.state_dict().items())
    pixel_values = torch.randn(40, 1536, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        low, deep_low = tower(pixel_values, [[1, 4, 10]])
        ref, deep_ref = ours(pixel_values, [[1, 4, 10]])
    assert low.dtype == torch.bfloat16 and len(deep_low) == 2
    rel = (low.float() - ref).norm() / ref.norm()
    assert rel < 0.05, rel


def test_qwen3_5_tower_without_deepstack() -> None:
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    config = Qwen3_5VisionConfig(
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        out_hidden_size=32,
        deepstack_visual_indexes=[],
    )
    torch.manual_seed(0)
    ref_model = Qwen3_5VisionModel._from_config(config).float().eval()
    with torch.no_grad():
        for param in ref_model.parameters():
            param.copy_(torch.randn_like(param) * 0.2)
    tower = Qwen3VLVisionModel(config)
    tower.load_weights((VISUAL_PREFIX + k, v) for k, v in ref_model.state_dict().items())
    grids = [[1, 4, 6], [1, 2, 2]]
    pixel_values = torch.randn(28, 1536)
    with torch.no_grad():
        ref = ref_model(pixel_values, grid_thw=torch.tensor(grids), return_dict=True).pooler_output
        got, deepstack = tower(pixel_values, grids)
    assert deepstack == []
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max())
