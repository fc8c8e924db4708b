"""Images in a step: the vision encoder's outputs for the image tokens a step computes, and their
M-RoPE positions.

A prefill chunk may cover all, part (a chunk boundary inside an image) or none of an image's tokens;
whatever it covers takes its rows of that image's encoder output. Outputs come from the encoder cache
(keyed by image content) or from one tower call for every image of the step that is not cached: the
uint8 pixels go up, are normalised and cut into patches on the device (`patchify`), then encoded
(replaying a CUDA graph when the same grids came before: `vision_graph`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mllmd.engine.device_io import to_device
from mllmd.engine.encoder_cache import EncoderCache, Entry
from mllmd.engine.request import EngineImage, Req
from mllmd.engine.vision_graph import VisionGraphs
from mllmd.models.multimodal import ImageEmbeds
from mllmd.multimodal.image_processing import VisionPreprocessConfig
from mllmd.multimodal.patchify import patchify_images


class VisionRunner:
    def __init__(self, model: Any, preprocess: VisionPreprocessConfig, cache: EncoderCache, device: torch.device,
                 graphs: VisionGraphs | None = None) -> None:
        self.model = model
        self.graphs = graphs  # CUDA graphs per repeated grid (None: every call eager)
        self.preprocess = preprocess
        self.cache = cache
        self.device = device
        self.images_encoded = 0

    def encode(self, images: Sequence[EngineImage]) -> dict[bytes, Entry]:
        """The tower's outputs for `images` (distinct contents), split per image, in one tower call."""
        pixels = [_on_device(image.pixels, self.device) for image in images]
        values, grids = patchify_images(pixels, self.preprocess, dtype=self.model.visual.dtype)
        replayed = self.graphs.run(values, grids) if self.graphs is not None else None
        embeds, deepstack = replayed if replayed is not None else self.model.encode_images(values, grids)
        sizes = [image.num_tokens for image in images]
        if embeds.shape[0] != sum(sizes):
            raise RuntimeError(f"the vision tower gave {embeds.shape[0]} rows for {sum(sizes)} image tokens")
        out: dict[bytes, Entry] = {}
        for i, (image, e) in enumerate(zip(images, embeds.split(sizes))):
            out[image.content_hash] = (e, [d.split(sizes)[i] for d in deepstack])
        self.images_encoded += len(images)
        return out

    def step_embeds(self, reqs: Sequence[Req], prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> ImageEmbeds | None:
        """The image rows of a step whose row i computes reqs[i].token_ids[prefix_lens[i] : + extend_lens[i]]
        (tokens concatenated in row order); None when the step covers no image token."""
        covered: list[tuple[int, EngineImage, int, int]] = []  # (first step row, image, from, to) within the image
        base = 0
        for req, p, n in zip(reqs, prefix_lens, extend_lens):
            for image in req.images:
                lo, hi = max(image.start, p), min(image.end, p + n)
                if lo < hi:
                    covered.append((base + lo - p, image, lo - image.start, hi - image.start))
            base += n
        if not covered:
            return None
        needed = {image.content_hash: image for _, image, _, _ in covered}
        self.cache.pin(set(needed))
        try:
            entries = {h: e for h in needed if (e := self.cache.get(h)) is not None}
            missing = [image for h, image in needed.items() if h not in entries]
            if missing:
                fresh = self.encode(missing)
                for h, entry in fresh.items():
                    self.cache.put(h, entry)
                entries.update(fresh)
        finally:
            self.cache.unpin()
        rows = np.concatenate([np.arange(r, r + hi - lo, dtype=np.int64) for r, _, lo, hi in covered])
        embeds = torch.cat([entries[image.content_hash][0][lo:hi] for _, image, lo, hi in covered])
        depth = len(entries[covered[0][1].content_hash][1])
        deepstack = [torch.cat([entries[image.content_hash][1][k][lo:hi] for _, image, lo, hi in covered])
                     for k in range(depth)]  # fmt: skip
        return ImageEmbeds(to_device(rows, torch.int64, self.device), embeds, deepstack)

    def uncached_tokens(self, image: EngineImage) -> int:
        """Encoder work (tokens) that computing any of this image's rows would cost now."""
        return 0 if image.content_hash in self.cache else image.num_tokens


def mrope_step_positions(reqs: Sequence[Req], prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> list[int] | None:
    """[3, T] positions of a step, flattened row by row (T, H, W), when some row computes prompt tokens of
    a prompt with images whose axes are not all index + delta (an image, or text before an image); None
    when every token sits at its index + its request's delta on all three axes (text after the last
    image, decodes: one row of positions serves, and a decode step may run as a decode CUDA graph)."""
    if not any(r.mrope_positions is not None and p < r.mrope_positions.shape[1] for r, p in zip(reqs, prefix_lens)):
        return None  # no prompt token of a prompt with images (decodes, text prompts): nothing to read
    axes: list[list[int]] = [[], [], []]
    shifted = False  # some token off index + delta: the three axes are needed
    for req, p, n in zip(reqs, prefix_lens, extend_lens):
        pos = req.mrope_positions
        upto = min(p + n, pos.shape[1]) if pos is not None else 0
        tail = range(max(p, upto) + req.mrope_delta, p + n + req.mrope_delta)  # past the prompt's table
        prompt = pos[:, p:upto].tolist() if p < upto else [[], [], []]
        shifted = shifted or any(axis != list(range(p + req.mrope_delta, upto + req.mrope_delta)) for axis in prompt)
        for a in range(3):
            axes[a] += prompt[a]
            axes[a] += tail
    return axes[0] + axes[1] + axes[2] if shifted else None


def _on_device(pixels: Any, device: torch.device) -> torch.Tensor:
    if isinstance(pixels, np.ndarray):
        pixels = torch.from_numpy(np.ascontiguousarray(pixels))
    return pixels if pixels.device == device else to_device(pixels, torch.uint8, device)
