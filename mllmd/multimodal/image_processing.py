"""Resize a decoded image to the vision tower's grid, as transformers' Qwen2-VL image processor does.

Torch-free (numpy + Pillow): this runs in the tokenizer worker, and what it produces, the resized uint8
picture, is what crosses to the scheduler (3 bytes a pixel, where float32 `pixel_values` would take 32:
4 bytes a value and every value twice for the temporal patch). Normalisation and patch cutting happen on
the device (`mllmd.multimodal.patchify`).

The numbers come from the model's own `preprocessor_config.json` (`VisionPreprocessConfig.from_model_dir`):
Qwen3-VL and Qwen3.5 use patch 16, merge 2 (one LLM token per 32x32 pixels), mean = std = 0.5 and
min/max pixels 65,536 / 16,777,216 (= 16,384 tokens per image). The processor class's defaults (patch 14,
CLIP mean/std, 56*56 / 28*28*1280 pixels) are Qwen2-VL's and would give wrong token counts, so they are
never used; Qwen3-VL's values fill only keys that a file lacks.

The model's 16,384 tokens per image is far more than an edge device should spend on one picture (and
289 MB of float32 pixel_values for a 12 MP photo), so a deployment caps it
(`server.max_image_pixels`, by default `DEFAULT_RESIZE_MAX_PIXELS` = 1,048,576 pixels, at most 1,024
image tokens: a 4000x3000 photo becomes 1152x864, 972 tokens; 640x480 stays 640x480, 300 tokens). The cap only lowers the model's max_pixels; a smaller image keeps its size up
to the model's rounding to multiples of 32 and its min_pixels (30x20 is enlarged to 320x224, 70 tokens).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mllmd.multimodal.image_io import MAX_ASPECT_RATIO, RULE_ASPECT, ImageError

if TYPE_CHECKING:
    from PIL import Image as PILImage

PREPROCESSOR_CONFIG = "preprocessor_config.json"
DEFAULT_RESIZE_MAX_PIXELS = 1024 * 32 * 32  # 1,048,576 pixels: at most 1,024 tokens per image

# Qwen3-VL's preprocessor_config.json values, used only for keys a model's file lacks.
QWEN3_VL_DEFAULTS: dict[str, Any] = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_pixels": 65536,
    "max_pixels": 16777216,
    "image_mean": (0.5, 0.5, 0.5),
    "image_std": (0.5, 0.5, 0.5),
    "rescale_factor": 1 / 255,
}


@dataclass(frozen=True)
class VisionPreprocessConfig:
    """The image processor's numbers for one model (from its preprocessor_config.json)."""

    patch_size: int = QWEN3_VL_DEFAULTS["patch_size"]
    temporal_patch_size: int = QWEN3_VL_DEFAULTS["temporal_patch_size"]
    merge_size: int = QWEN3_VL_DEFAULTS["merge_size"]
    min_pixels: int = QWEN3_VL_DEFAULTS["min_pixels"]
    max_pixels: int = QWEN3_VL_DEFAULTS["max_pixels"]
    image_mean: tuple[float, ...] = QWEN3_VL_DEFAULTS["image_mean"]
    image_std: tuple[float, ...] = QWEN3_VL_DEFAULTS["image_std"]
    rescale_factor: float = QWEN3_VL_DEFAULTS["rescale_factor"]

    def __post_init__(self) -> None:
        object.__setattr__(self, "image_mean", tuple(float(x) for x in self.image_mean))
        object.__setattr__(self, "image_std", tuple(float(x) for x in self.image_std))
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError("image_mean and image_std need 3 values (RGB)")
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1 (got {getattr(self, name)})")

    @property
    def factor(self) -> int:
        """Both sides of a resized image are multiples of this (patch x merge: 32 pixels)."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Values per patch row of pixel_values: 3 x temporal x patch x patch (1,536)."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VisionPreprocessConfig:
        """Read a preprocessor_config dict the way the Qwen2-VL processor does (min/max pixels override size)."""
        size = data.get("size") or {}
        values = dict(QWEN3_VL_DEFAULTS)
        for key in (
            "patch_size",
            "temporal_patch_size",
            "merge_size",
            "image_mean",
            "image_std",
            "rescale_factor",
        ):
            if data.get(key) is not None:
                values[key] = data[key]
        if size.get("shortest_edge") is not None:
            values["min_pixels"] = size["shortest_edge"]
        if size.get("longest_edge") is not None:
            values["max_pixels"] = size["longest_edge"]
        for key in ("min_pixels", "max_pixels"):  # the processor's backward-compatible override
            if data.get(key) is not None:
                values[key] = data[key]
        for key in ("image_mean", "image_std"):
            if isinstance(values[key], (int, float)):
                values[key] = (float(values[key]),) * 3
        return cls(
            patch_size=int(values["patch_size"]),
            temporal_patch_size=int(values["temporal_patch_size"]),
            merge_size=int(values["merge_size"]),
            min_pixels=int(values["min_pixels"]),
            max_pixels=int(values["max_pixels"]),
            image_mean=tuple(values["image_mean"]),
            image_std=tuple(values["image_std"]),
            rescale_factor=float(values["rescale_factor"]),
        )

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str]) -> VisionPreprocessConfig:
        """The config of the model folder `path`; FileNotFoundError when it has no preprocessor_config.json."""
        file = Path(path) / PREPROCESSOR_CONFIG
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing: a vision-language model folder needs it")
        return cls.from_dict(json.loads(file.read_text(encoding="utf-8")))


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen's target size: sides multiples of `factor`, area within [min, max], aspect ratio kept.

    The same arithmetic as transformers' (Python's round-half-even included), so that token counts agree.
    """
    if height < 1 or width < 1:
        raise ImageError(f"image has no pixels ({width}x{height}) (image.decode)", "image.decode")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ImageError(
            f"aspect ratio {ratio:.1f} ({width}x{height}) exceeds {MAX_ASPECT_RATIO} ({RULE_ASPECT})",
            RULE_ASPECT,
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def effective_max_pixels(cfg: VisionPreprocessConfig, max_pixels_cap: int | None) -> int:
    """The model's max_pixels, lowered to the deployment's cap (None: no cap)."""
    if max_pixels_cap is None:
        return cfg.max_pixels
    if max_pixels_cap < cfg.factor * cfg.factor:
        raise ValueError(
            f"max_pixels_cap must be at least {cfg.factor * cfg.factor} (one token), got {max_pixels_cap}"
        )
    return min(cfg.max_pixels, int(max_pixels_cap))


def target_size(
    height: int, width: int, cfg: VisionPreprocessConfig, max_pixels_cap: int | None = None
) -> tuple[int, int]:
    """(height, width) an image of this size is resized to."""
    return smart_resize(height, width, cfg.factor, cfg.min_pixels, effective_max_pixels(cfg, max_pixels_cap))


def grid_thw_for(height: int, width: int, cfg: VisionPreprocessConfig) -> tuple[int, int, int]:
    """Patch grid (t, h, w) of a resized still image (one temporal patch: the frame is duplicated)."""
    return (1, height // cfg.patch_size, width // cfg.patch_size)


def num_image_tokens(grid_thw: Sequence[int], merge_size: int) -> int:
    """LLM tokens of one image: t x h x w patches, merge x merge patches per token."""
    t, h, w = (int(x) for x in grid_thw)
    return t * h * w // (merge_size * merge_size)


def count_image_tokens(
    height: int, width: int, cfg: VisionPreprocessConfig, max_pixels_cap: int | None = None
) -> int:
    """Image tokens for a source image of this size, without touching its pixels."""
    h, w = target_size(height, width, cfg, max_pixels_cap)
    return num_image_tokens(grid_thw_for(h, w, cfg), cfg.merge_size)


def _bicubic(image_module: Any) -> Any:
    """Pillow's bicubic filter: `Image.Resampling` from 9.1, the module constant before (Ubuntu 22.04's 9.0)."""
    return getattr(image_module, "Resampling", image_module).BICUBIC


def resize_for_model(
    img: PILImage.Image, cfg: VisionPreprocessConfig, max_pixels_cap: int | None = None
) -> np.ndarray:
    """The RGB image resized to its grid: uint8 [H, W, 3], C-contiguous.

    The same call as transformers' PIL backend (`Image.resize((w, h), resample=BICUBIC, reducing_gap=None)`
    on the RGB image), so the pixels match it exactly.
    """
    from PIL import Image

    if img.mode != "RGB":
        raise ValueError(
            f"resize_for_model takes an RGB image (image_io.load_image makes one), got {img.mode}"
        )
    height, width = target_size(img.height, img.width, cfg, max_pixels_cap)
    resized = img.resize((width, height), resample=_bicubic(Image), reducing_gap=None)
    return np.array(resized, dtype=np.uint8)  # a writable copy (np.asarray of a PIL image is read-only)


def content_hash(pixels: np.ndarray) -> bytes:
    """128-bit BLAKE2b of the resized pixels and their shape: the image's identity in caches."""
    pixels = np.ascontiguousarray(pixels)
    digest = hashlib.blake2b(digest_size=16, person=b"mllmd-image")
    digest.update(f"{pixels.dtype.str}:{'x'.join(str(d) for d in pixels.shape)};".encode())
    digest.update(pixels.reshape(-1).view(np.uint8).data)
    return digest.digest()


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    """One image ready to cross to the scheduler: resized pixels, its patch grid and its identity."""

    pixels: np.ndarray  # [H, W, 3] uint8, H and W multiples of patch x merge
    grid_thw: tuple[int, int, int]  # (1, H / patch, W / patch)
    num_tokens: int  # LLM tokens: grid product / merge^2
    content_hash: bytes  # 16 bytes, `content_hash(pixels)`

    @property
    def hash_hex(self) -> str:
        return self.content_hash.hex()


def process_image(
    img: PILImage.Image, cfg: VisionPreprocessConfig, max_pixels_cap: int | None = DEFAULT_RESIZE_MAX_PIXELS
) -> ProcessedImage:
    """Resize a decoded RGB image for the model and describe it (grid, token count, hash)."""
    pixels = resize_for_model(img, cfg, max_pixels_cap)
    grid = grid_thw_for(pixels.shape[0], pixels.shape[1], cfg)
    return ProcessedImage(pixels, grid, num_image_tokens(grid, cfg.merge_size), content_hash(pixels))
