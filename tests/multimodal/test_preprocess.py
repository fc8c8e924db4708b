"""Resize (tokenizer side) + patchify (device side) equal transformers' Qwen2-VL PIL image processor."""

from __future__ import annotations

import io
import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from mllmd.multimodal.image_io import ImageError, ImageLimits, decode_image
from mllmd.multimodal.image_processing import (
    DEFAULT_RESIZE_MAX_PIXELS,
    VisionPreprocessConfig,
    content_hash,
    count_image_tokens,
    num_image_tokens,
    process_image,
    resize_for_model,
    smart_resize,
)
from mllmd.multimodal.patchify import normalize_lut, patchify, patchify_images
from tests.multimodal.conftest import encode, random_rgb


@pytest.fixture(scope="module")
def cfg(vl_source: Path) -> VisionPreprocessConfig:
    return VisionPreprocessConfig.from_model_dir(vl_source)


@pytest.fixture(scope="module")
def hf_processor(vl_source: Path) -> Any:
    """What AutoImageProcessor makes of the real preprocessor_config.json (the PIL backend here)."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(vl_source)


def ours(data: bytes, cfg: VisionPreprocessConfig, cap: int | None = None) -> tuple[torch.Tensor, list[int]]:
    image = decode_image(data, ImageLimits())
    pixels = torch.from_numpy(resize_for_model(image, cfg, cap))
    values, grid = patchify(pixels, cfg)
    return values, list(grid)


def theirs(data: bytes, processor: Any, **kwargs: Any) -> tuple[torch.Tensor, list[int]]:
    out = processor(images=[Image.open(io.BytesIO(data))], return_tensors="pt", **kwargs)
    return out["pixel_values"], out["image_grid_thw"][0].tolist()


def test_config_is_read_from_the_model_folder(cfg: VisionPreprocessConfig, hf_processor: Any) -> None:
    assert (cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size) == (16, 2, 2)
    assert (cfg.min_pixels, cfg.max_pixels) == (65536, 16777216)
    assert cfg.image_mean == cfg.image_std == (0.5, 0.5, 0.5)
    assert cfg.factor == 32 and cfg.patch_dim == 1536
    assert (hf_processor.size.shortest_edge, hf_processor.size.longest_edge) == (
        cfg.min_pixels,
        cfg.max_pixels,
    )
    assert cfg.rescale_factor == hf_processor.rescale_factor


def test_config_fallbacks_and_overrides(tmp_path: Path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 14, "image_mean": 0.25}))
    partial = VisionPreprocessConfig.from_model_dir(tmp_path)
    assert partial.patch_size == 14 and partial.image_mean == (0.25,) * 3
    assert (partial.merge_size, partial.min_pixels, partial.image_std) == (2, 65536, (0.5, 0.5, 0.5))
    legacy = VisionPreprocessConfig.from_dict(
        {"size": {"shortest_edge": 10, "longest_edge": 20}, "max_pixels": 99}
    )
    assert (legacy.min_pixels, legacy.max_pixels) == (
        10,
        99,
    )  # top-level min/max_pixels win, as in transformers
    with pytest.raises(FileNotFoundError, match="preprocessor_config.json"):
        VisionPreprocessConfig.from_model_dir(tmp_path / "nowhere")


def test_smart_resize_matches_transformers() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    rng = random.Random(0)
    sizes = [
        (480, 640),
        (20, 30),
        (1, 1),
        (1, 200),
        (4000, 3000),
        (16, 3200),
        (31, 33),
        (48, 80),
        (16 * 3, 16 * 5),
    ]
    sizes += [(rng.randint(1, 5000), rng.randint(1, 5000)) for _ in range(300)]
    for h, w in sizes:
        if max(h, w) / min(h, w) > 200:
            continue
        for lo, hi in ((65536, 16777216), (65536, DEFAULT_RESIZE_MAX_PIXELS), (3136, 12845056)):
            assert smart_resize(h, w, 32, lo, hi) == hf_smart_resize(h, w, 32, lo, hi), (h, w, lo, hi)
    with pytest.raises(ImageError) as info:
        smart_resize(10, 2011, 32, 65536, 16777216)
    assert info.value.rule == "image.aspect_ratio"


def test_known_token_counts(cfg: VisionPreprocessConfig, hf_processor: Any) -> None:
    assert count_image_tokens(480, 640, cfg) == 300  # 640x480 -> grid 1x30x40
    assert count_image_tokens(20, 30, cfg) == 70  # 30x20 is enlarged to grid 1x14x20
    assert num_image_tokens((1, 30, 40), 2) == 300
    for h, w in ((480, 640), (20, 30), (4000, 3000), (333, 517)):
        patches = hf_processor.get_number_of_image_patches(h, w)
        assert count_image_tokens(h, w, cfg) == patches // 4
    capped = count_image_tokens(3000, 4000, cfg, DEFAULT_RESIZE_MAX_PIXELS)
    assert capped == 972 and capped <= DEFAULT_RESIZE_MAX_PIXELS // (32 * 32)


def test_cap_validation(cfg: VisionPreprocessConfig) -> None:
    with pytest.raises(ValueError, match="max_pixels_cap"):
        count_image_tokens(480, 640, cfg, 1000)


def _rgba_png() -> bytes:
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, (45, 70, 4), dtype=np.uint8)
    pixels[:10, :, 3] = 0
    return encode(Image.fromarray(pixels, "RGBA"), "PNG")


def _palette_png() -> bytes:
    rng = np.random.default_rng(2)
    image = Image.fromarray(rng.integers(0, 16, (50, 61), dtype=np.uint8), "P")
    image.putpalette(list(rng.integers(0, 256, 768, dtype=np.uint8)))
    return encode(image, "PNG", transparency=3)


CASES = {
    "640x480": lambda: encode(random_rgb(640, 480), "PNG"),
    "333x517": lambda: encode(random_rgb(333, 517, seed=3), "PNG"),
    "jpeg-1000x750": lambda: encode(random_rgb(1000, 750, seed=4), "JPEG"),
    "rgba": _rgba_png,
    "grey": lambda: encode(
        Image.fromarray(np.random.default_rng(5).integers(0, 256, (64, 90), np.uint8), "L"), "PNG"
    ),
    "palette-transparent": _palette_png,
    "tiny-30x20": lambda: encode(random_rgb(30, 20, seed=6), "PNG"),
    "wide-3000x16": lambda: encode(random_rgb(3000, 16, seed=7), "PNG"),
    "tall-20x3900": lambda: encode(random_rgb(20, 3900, seed=8), "PNG"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pixel_values_equal_the_processor(case: str, cfg: VisionPreprocessConfig, hf_processor: Any) -> None:
    data = CASES[case]()
    values, grid = ours(data, cfg)
    ref_values, ref_grid = theirs(data, hf_processor)
    assert grid == ref_grid
    assert values.dtype == torch.float32 and values.shape == ref_values.shape
    torch.testing.assert_close(values, ref_values, rtol=0, atol=1e-6)


def test_capped_resize_equals_the_processor_with_that_max(
    cfg: VisionPreprocessConfig, hf_processor: Any
) -> None:
    data = encode(random_rgb(1600, 1200, seed=9), "PNG")
    cap = 200_000
    values, grid = ours(data, cfg, cap)
    ref_values, ref_grid = theirs(
        data, hf_processor, size={"shortest_edge": cfg.min_pixels, "longest_edge": cap}
    )
    assert grid == ref_grid and grid[1] * grid[2] * 256 <= cap
    torch.testing.assert_close(values, ref_values, rtol=0, atol=1e-6)


def test_counts_match_the_processed_grid(cfg: VisionPreprocessConfig) -> None:
    image = decode_image(encode(random_rgb(640, 480), "PNG"), ImageLimits())
    processed = process_image(image, cfg)
    assert processed.grid_thw == (1, 30, 40) and processed.num_tokens == 300
    assert processed.pixels.shape == (480, 640, 3) and processed.pixels.dtype == np.uint8
    assert processed.pixels.flags.writeable and processed.pixels.flags.c_contiguous
    big = process_image(random_rgb(2000, 1500), cfg)  # default cap: 1 MP
    assert big.num_tokens <= DEFAULT_RESIZE_MAX_PIXELS // 1024 and big.num_tokens == count_image_tokens(
        1500, 2000, cfg, DEFAULT_RESIZE_MAX_PIXELS
    )


def test_content_hash_covers_pixels_and_shape(cfg: VisionPreprocessConfig) -> None:
    a = process_image(random_rgb(64, 64), cfg)
    again = process_image(random_rgb(64, 64), cfg)
    assert len(a.content_hash) == 16 and a.content_hash == again.content_hash and len(a.hash_hex) == 32
    changed = a.pixels.copy()
    changed[3, 5, 1] ^= 1
    assert content_hash(changed) != a.content_hash
    flat = a.pixels.reshape(a.pixels.shape[0] // 2, a.pixels.shape[1] * 2, 3)  # same bytes, other shape
    assert content_hash(flat) != a.content_hash


def test_patchify_layout_and_batching(cfg: VisionPreprocessConfig) -> None:
    pixels = torch.randint(0, 256, (64, 96, 3), dtype=torch.uint8)
    values, grid = patchify(pixels, cfg)
    assert grid == (1, 4, 6) and values.shape == (24, 1536)
    # patch 1 is the second patch of the first 2x2 block: rows 0..15, columns 16..31; time doubled
    lut = normalize_lut(cfg)
    patch = lut[pixels[:16, 16:32].long(), torch.arange(3)].permute(2, 0, 1)  # [C, 16, 16]
    assert torch.equal(values[1].view(3, 2, 16, 16), patch[:, None].expand(3, 2, 16, 16))
    assert torch.equal(
        values[2].view(3, 2, 16, 16)[:, 0], lut[pixels[16:32, :16].long(), torch.arange(3)].permute(2, 0, 1)
    )
    both, grids = patchify_images([pixels, pixels[:32, :32]], cfg)
    assert grids == [(1, 4, 6), (1, 2, 2)] and both.shape == (28, 1536)
    assert patchify(pixels, cfg, dtype=torch.bfloat16)[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="multiple of 32"):
        patchify(pixels[:40], cfg)
    with pytest.raises(ValueError, match="uint8"):
        patchify(pixels.float(), cfg)


def test_lut_matches_the_processor_arithmetic(cfg: VisionPreprocessConfig) -> None:
    levels = np.arange(256, dtype=np.uint8).astype(np.float64) * cfg.rescale_factor
    expected = (levels.astype(np.float32)[:, None] - np.float32(0.5)) / np.float32(0.5)
    assert np.array_equal(normalize_lut(cfg).numpy(), np.repeat(expected, 3, axis=1))
    assert math.isclose(float(normalize_lut(cfg)[255, 0]), 1.0) and float(normalize_lut(cfg)[0, 2]) == -1.0
