"""A tiny Qwen3-VL checkpoint builds from the packaged configs alone, and its tower loads into ours."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mllmd.checkpoint.tokenizer import DATA_DIR
from mllmd.models.qwen3_vl_vision import VISUAL_PREFIX, Qwen3VLVisionModel
from mllmd.multimodal.image_processing import VisionPreprocessConfig
from mllmd.testing import checkpoints as ck

PACKAGED = DATA_DIR / "Qwen3-VL-2B-Instruct"


def test_source_falls_back_to_packaged_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLLMD_SHARED_MODELS", str(tmp_path / "empty"))
    assert ck.find_model_source("Qwen3-VL-2B-Instruct") == PACKAGED


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with pytest.MonkeyPatch.context() as mp:  # build from the packaged files only, as a fresh clone would
        mp.setenv("MLLMD_SHARED_MODELS", str(tmp_path_factory.mktemp("no_shared")))
        return ck.build_tiny_checkpoint(
            tmp_path_factory.mktemp("qwen3_vl"),
            "Qwen3-VL-2B-Instruct",
            extra_overrides={"vision_config": {"depth": 4, "deepstack_visual_indexes": [1, 2]}},
        )


def test_tiny_checkpoint_tower_loads_and_matches(checkpoint: Path) -> None:
    from transformers import AutoModelForImageTextToText

    assert (checkpoint / "preprocessor_config.json").is_file() and (
        checkpoint / "chat_template.jinja"
    ).is_file()
    assert VisionPreprocessConfig.from_model_dir(checkpoint).patch_size == 16
    weights: list[tuple[str, torch.Tensor]] = []
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            weights += [(key, f.get_tensor(key)) for key in f.keys() if key.startswith(VISUAL_PREFIX)]
    assert any(key.endswith("patch_embed.proj.weight") and t.dim() == 5 for key, t in weights)  # the Conv3d
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tower = Qwen3VLVisionModel(model.config.vision_config)
    tower.load_weights(weights)
    grids = [[1, 4, 4], [1, 2, 6]]
    pixel_values = torch.randn(28, 1536, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model.model.visual(pixel_values, grid_thw=torch.tensor(grids), return_dict=True)
        embeds, deepstack = tower(pixel_values, grids)
    torch.testing.assert_close(
        embeds, ref.pooler_output, rtol=1e-5, atol=1e-5 * ref.pooler_output.abs().max()
    )
    assert len(deepstack) == 2
    for got, want in zip(deepstack, ref.deepstack_features, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max())
