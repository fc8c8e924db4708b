"""A chat with images -> token ids with each image's pad tokens expanded, and the processed images.

What the tokenizer worker (and the offline `LLM.chat`) does for a vision-language model: load each
image part in message order (`image_url` parts: data URLs, allowed local paths, allowed remote URLs;
or an `image` part holding a PIL image, offline), resize it for the model, render the chat template
(one `<|vision_start|><|image_pad|><|vision_end|>` per image), tokenize, and repeat each image's pad
token for its number of tokens. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mllmd.multimodal.image_io import ImageLimits, check_image_count, load_image
from mllmd.multimodal.image_processing import (
    DEFAULT_RESIZE_MAX_PIXELS,
    ProcessedImage,
    VisionPreprocessConfig,
    process_image,
)
from mllmd.multimodal.prompt import VisionTokenIds, expand_image_placeholders


@dataclass(frozen=True)
class VisionPrompt:
    input_ids: list[int]
    images: list[ProcessedImage]
    image_spans: list[tuple[int, int]]  # [start, end) of each image's tokens in input_ids
    text: str  # the rendered template


def image_parts(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The image parts of a chat, in the order the chat template renders their placeholders."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            out += [part for part in content if isinstance(part, dict) and part.get("type") in ("image_url", "image")]
    return out


LOW_DETAIL_MAX_PIXELS = 512 * 512  # an image_url with "detail": "low": at most 256 tokens (OpenAI's low is 512x512)


def part_max_pixels(part: dict[str, Any], max_image_pixels: int | None) -> int | None:
    """The resize cap of one image part: `detail: "low"` lowers it to LOW_DETAIL_MAX_PIXELS; "high" and
    "auto" keep the deployment's."""
    url = part.get("image_url")
    if isinstance(url, dict) and url.get("detail") == "low":
        return LOW_DETAIL_MAX_PIXELS if max_image_pixels is None else min(max_image_pixels, LOW_DETAIL_MAX_PIXELS)
    return max_image_pixels


def load_part(part: dict[str, Any], limits: ImageLimits, index: int) -> Any:
    """A decoded RGB PIL image for one image part."""
    if part.get("type") == "image":
        from mllmd.multimodal.image_io import to_rgb

        return to_rgb(part["image"])
    return load_image(part["image_url"]["url"], limits, index=index)


def build_vision_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    template_kwargs: dict[str, Any],
    preprocess: VisionPreprocessConfig,
    tokens: VisionTokenIds,
    limits: ImageLimits,
    max_image_pixels: int | None = DEFAULT_RESIZE_MAX_PIXELS,
) -> VisionPrompt:
    """Images loaded, checked and resized (ImageError naming the rule), then the prompt built around them."""
    images = load_images(messages, preprocess, limits, max_image_pixels)
    return prompt_with_images(tokenizer, messages, template_kwargs, images, tokens)


def load_images(
    messages: list[dict[str, Any]],
    preprocess: VisionPreprocessConfig,
    limits: ImageLimits,
    max_image_pixels: int | None = DEFAULT_RESIZE_MAX_PIXELS,
) -> list[ProcessedImage]:
    """The chat's images loaded, checked and resized, in order (ImageError naming the rule). Touches
    no tokenizer: it may run on a thread of its own."""
    parts = image_parts(messages)
    check_image_count(len(parts), limits)
    return [process_image(load_part(part, limits, i + 1), preprocess, part_max_pixels(part, max_image_pixels))
            for i, part in enumerate(parts)]


def prompt_with_images(
    tokenizer: Any, messages: list[dict[str, Any]], template_kwargs: dict[str, Any], images: list[ProcessedImage],
    tokens: VisionTokenIds, encode: Callable[[str], list[int]] | None = None,
) -> VisionPrompt:
    """The chat templated and tokenized (by `encode` if given, e.g. one that refuses a text far over the
    context early), each image placeholder expanded to its image's tokens."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    ids = encode(text) if encode is not None else tokenizer.encode(text, add_special_tokens=False)
    prompt = expand_image_placeholders(ids, [im.num_tokens for im in images], tokens)
    return VisionPrompt(prompt.input_ids, images, prompt.image_spans, text)
