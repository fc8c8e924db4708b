"""Device side of image preprocessing: normalise resized uint8 pixels and cut them into the tower's patches.

What crosses from the tokenizer worker is the resized uint8 image (`image_processing.ProcessedImage`);
this turns it, on whatever device holds it, into the rows the vision tower takes, equal to transformers'
`Qwen2VLImageProcessorPil` output for the same image:

  * normalisation through a 256-entry table per channel, built with the processor's own arithmetic
    (`uint8 -> float64 * rescale_factor -> float32`, then `(x - mean) / std` in float32), so the values
    are bit-identical to it and cost one gather;
  * patch order (merge-block major): for each 2x2 block of patches in raster order, its 4 patches in
    raster order; each patch flattened as (channel, time, row, column) with the still frame repeated
    `temporal_patch_size` times: [num_patches, 3 * 2 * 16 * 16 = 1536].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mllmd.multimodal.image_processing import VisionPreprocessConfig

_LUTS: dict[tuple[VisionPreprocessConfig, str, torch.dtype], torch.Tensor] = {}


def normalize_lut(
    cfg: VisionPreprocessConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[256, 3] table: row v, column c = the normalised value of channel c at uint8 value v (cached)."""
    device = torch.device(device)
    key = (cfg, str(device), dtype)
    lut = _LUTS.get(key)
    if lut is None:
        levels = (torch.arange(256, dtype=torch.float64) * cfg.rescale_factor).to(torch.float32)  # [256]
        mean = torch.tensor(cfg.image_mean, dtype=torch.float32)  # [3]
        std = torch.tensor(cfg.image_std, dtype=torch.float32)
        lut = ((levels[:, None] - mean) / std).to(device=device, dtype=dtype).contiguous()  # [256, 3]
        _LUTS[key] = lut
    return lut


def patchify(
    pixels: torch.Tensor, cfg: VisionPreprocessConfig, *, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """uint8 [H, W, 3] -> (pixel_values [H/p * W/p, 3 * t * p * p] in `dtype`, grid_thw (1, H/p, W/p)).

    H and W must be multiples of patch x merge (what `resize_for_model` produces). The grid comes from the
    shape, so nothing is read back from the device.
    """
    if pixels.dtype != torch.uint8 or pixels.dim() != 3 or pixels.shape[2] != 3:
        raise ValueError(f"patchify takes uint8 [H, W, 3] pixels, got {pixels.dtype} {tuple(pixels.shape)}")
    height, width = int(pixels.shape[0]), int(pixels.shape[1])
    if height % cfg.factor or width % cfg.factor:
        raise ValueError(f"image {width}x{height} is not a multiple of {cfg.factor} on both sides")
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = height // p, width // p
    lut = normalize_lut(cfg, pixels.device, dtype)
    values = torch.gather(lut, 0, pixels.reshape(-1, 3).long())  # [H * W, 3]
    x = values.view(gh // m, m, p, gw // m, m, p, 3)  # rows: (block, in-block, pixel); same for columns
    x = x.permute(0, 3, 1, 4, 6, 2, 5)  # [gh/m, gw/m, m, m, C, p, p]
    x = x.unsqueeze(5).expand(gh // m, gw // m, m, m, 3, t, p, p)  # the still frame repeated in time
    return x.reshape(gh * gw, 3 * t * p * p), (1, gh, gw)


def patchify_images(
    images: Sequence[torch.Tensor], cfg: VisionPreprocessConfig, *, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Several images for one tower call: concatenated pixel_values and their grids, in order."""
    if not images:
        raise ValueError("patchify_images needs at least one image")
    parts = [patchify(image, cfg, dtype=dtype) for image in images]
    return torch.cat([values for values, _ in parts]), [grid for _, grid in parts]
