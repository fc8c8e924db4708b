"""Image placeholders in a tokenized prompt: one `<|image_pad|>` per image becomes that image's token count.

The chat template writes `<|vision_start|><|image_pad|><|vision_end|>` once per image, in message order;
the processor repeats the pad to t * h * w / merge^2 copies (transformers' `Qwen3VLProcessor` does it on the
text before tokenizing; doing it on the ids gives the same ids, since the pad is a special token that
the tokenizer never merges with its neighbours). Torch-free: this runs in the tokenizer worker.

A prompt whose placeholders do not match its images is refused (`ImageError`, rule "image.placeholders"):
a different count (user text can contain the special strings), a pad outside `start pad end`, or
video placeholders (not supported yet).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mllmd.multimodal.image_io import ImageError

RULE_PLACEHOLDERS = "image.placeholders"
TEXT_TOKEN, IMAGE_TOKEN = 0, 1


@dataclass(frozen=True)
class VisionTokenIds:
    """The special token ids of a Qwen-VL vocabulary (defaults: Qwen3-VL's)."""

    image_pad: int = 151655
    video_pad: int = 151656
    vision_start: int = 151652
    vision_end: int = 151653

    @classmethod
    def from_config(cls, config: Any) -> VisionTokenIds:
        """From a model's config.json dict or config object (image_token_id, vision_start_token_id, ...)."""

        def get(key: str, default: int) -> int:
            value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
            return int(value) if value is not None else default

        base = cls()
        return cls(
            image_pad=get("image_token_id", base.image_pad),
            video_pad=get("video_token_id", base.video_pad),
            vision_start=get("vision_start_token_id", base.vision_start),
            vision_end=get("vision_end_token_id", base.vision_end),
        )


@dataclass(frozen=True)
class MultimodalPrompt:
    """A prompt with its image placeholders expanded."""

    input_ids: list[int]
    token_types: list[int]  # per token: 0 text, 1 image (transformers' mm_token_type_ids)
    image_spans: list[tuple[int, int]]  # [start, end) of each image's pad tokens, in image order


def count_placeholders(ids: Sequence[int], tokens: VisionTokenIds = VisionTokenIds()) -> int:
    """How many images a tokenized chat asks for (its image pad tokens, before expansion)."""
    return sum(1 for token in ids if token == tokens.image_pad)


def expand_image_placeholders(
    ids: Sequence[int], tokens_per_image: Sequence[int], tokens: VisionTokenIds = VisionTokenIds()
) -> MultimodalPrompt:
    """Repeat the i-th image's pad `tokens_per_image[i]` times; ImageError if placeholders and images disagree."""
    found = count_placeholders(ids, tokens)
    if found != len(tokens_per_image):
        raise ImageError(
            f"the prompt has {found} image placeholders but the request carries {len(tokens_per_image)} images "
            f"({RULE_PLACEHOLDERS})",
            RULE_PLACEHOLDERS,
        )
    if tokens.video_pad in ids:
        raise ImageError(f"video placeholders are not supported ({RULE_PLACEHOLDERS})", RULE_PLACEHOLDERS)
    out: list[int] = []
    types: list[int] = []
    spans: list[tuple[int, int]] = []
    image = 0
    for i, token in enumerate(ids):
        if token != tokens.image_pad:
            out.append(token)
            types.append(TEXT_TOKEN)
            continue
        before = ids[i - 1] if i > 0 else None
        after = ids[i + 1] if i + 1 < len(ids) else None
        if before != tokens.vision_start or after != tokens.vision_end:
            raise ImageError(
                f"image placeholder {image + 1} is not between <|vision_start|> and <|vision_end|> "
                f"({RULE_PLACEHOLDERS})",
                RULE_PLACEHOLDERS,
            )
        count = int(tokens_per_image[image])
        if count < 1:
            raise ValueError(f"image {image + 1} has {count} tokens")
        spans.append((len(out), len(out) + count))
        out.extend([tokens.image_pad] * count)
        types.extend([IMAGE_TOKEN] * count)
        image += 1
    return MultimodalPrompt(out, types, spans)
