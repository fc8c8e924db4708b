"""`one_batch --image PATH --prompt TEXT`: a static batch of one real picture and a question.

The measures are the ones pymllm's `bench_one_batch` names, so that its figures and ours line up:
- `vit_prefill_*`: the vision tower alone on every image of the batch (upload, patchify on the device,
  encode), `vit_prefill_tokens` the image tokens it produces;
- `multimodal_prefill_*`: the whole first step, tower plus the decoder's prefill of every token, as a
  fresh image request pays it.

`--input-len` counts image tokens and text tokens together; only text is padded or cut (`fit_length`).
Each copy of the image gets a content hash of its own (`fresh_copies`), so the encoder cache never
answers for a timed step and every request of a batch runs the tower, as distinct pictures would.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from pathlib import Path
from typing import Any

from mllmd import LLM
from mllmd.bench.multimodal import time_vit
from mllmd.bench.one_batch import random_prompts
from mllmd.engine.request import EngineImage
from mllmd.multimodal.image_io import ImageError, decode_image


@dataclasses.dataclass
class ImageCase:
    """One picture's chat turn: its prompt ids, its image over its run of tokens, and the picture."""

    path: str
    prompt: str
    ids: list[int]
    image: EngineImage
    picture: Any  # PIL image, for transformers' processor


def load_case(llm: LLM, path: str, prompt: str) -> ImageCase:
    """The picture decoded as the daemon decodes it (EXIF turn, transparency onto white) and the chat
    turn [image, prompt] rendered with the model's template."""
    if llm.engine.runner.vision is None:
        raise SystemExit("--image: the model is not a vision-language model (it has no vision tower)")
    try:
        picture = decode_image(Path(path).read_bytes(), llm.image_limits, where=f"--image {path}: ")
    except OSError as exc:
        raise SystemExit(f"--image {path}: {exc.strerror or exc}") from None
    except ImageError as exc:
        raise SystemExit(str(exc)) from None
    conv = [
        {"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": prompt}]}
    ]
    ids, images = llm.chat_prompt(conv)
    assert images is not None and len(images) == 1, "one image part makes one image"
    return ImageCase(path, prompt, ids, images[0], picture)


def fit_length(
    case: ImageCase, target: int | None, vocab_size: int, seed: int
) -> tuple[list[int], EngineImage]:
    """The prompt at `target` tokens in all (None: as rendered). The image's tokens are all kept; the text
    is cut from the end, or random text tokens are put right after the image (the text that follows it
    stays last, as the template closes the turn)."""
    ids, image = case.ids, case.image
    if target is None or target == len(ids):
        return list(ids), image
    if target < image.num_tokens:
        raise SystemExit(f"--input-len {target} is shorter than the image's {image.num_tokens} tokens")
    if target > len(ids):
        filler = random_prompts(1, target - len(ids), vocab_size, seed)[0]
        return ids[: image.end] + filler + ids[image.end :], image
    text_budget = target - image.num_tokens
    before = min(image.start, text_budget)  # text is kept in order: what precedes the image first
    after = text_budget - before
    fitted = ids[:before] + ids[image.start : image.end] + ids[image.end : image.end + after]
    return fitted, dataclasses.replace(image, start=before)


def fresh_copies(image: EngineImage, n: int) -> list[EngineImage]:
    """`n` copies that the encoder cache and the prefix cache take for different pictures."""
    return [
        dataclasses.replace(image, content_hash=os.urandom(len(image.content_hash) or 16)) for _ in range(n)
    ]


def median_vit(llm: LLM, image: EngineImage, batch_size: int, repeats: int = 3) -> float:
    return statistics.median(time_vit(llm, fresh_copies(image, batch_size)) for _ in range(repeats))


def pymllm_metrics(prefill_latency: float, vit_latency: float, batch_size: int, input_len: int,
                   image_tokens: int) -> dict[str, Any]:  # fmt: skip
    """The `multimodal_prefill_*` and `vit_prefill_*` fields of pymllm's bench_one_batch line."""
    tokens, vit_tokens = batch_size * input_len, batch_size * image_tokens
    return {
        "multimodal_prefill_latency": prefill_latency,
        "multimodal_prefill_ms": prefill_latency * 1e3,
        "multimodal_prefill_tokens": tokens,
        "multimodal_prefill_throughput": tokens / prefill_latency,
        "multimodal_prefill_tps": tokens / prefill_latency,
        "vit_prefill_latency": vit_latency,
        "vit_prefill_ms": vit_latency * 1e3,
        "vit_prefill_tokens": vit_tokens,
        "vit_prefill_throughput": vit_tokens / vit_latency,
        "vit_prefill_tps": vit_tokens / vit_latency,
    }


def hf_figures(
    hf: Any, ids: list[int], case: ImageCase, output_len: int, image_tokens: int
) -> dict[str, float]:
    """transformers' tower, first step and decode step on the same ids and picture (batch 1)."""
    if hf.image_tokens(case.picture) != image_tokens:
        raise SystemExit(
            f"--baseline hf: transformers' processor makes {hf.image_tokens(case.picture)} tokens of "
            f"{case.path}, ours {image_tokens} (a picture above the server's resize cap?)"
        )
    inputs = hf.inputs(ids, case.picture)
    hf.time_prefill(inputs)  # untimed: the shapes' first run
    return {
        "hf_vit_prefill_ms": hf.time_vit(inputs) * 1e3,
        "hf_multimodal_prefill_ms": hf.time_prefill(inputs) * 1e3,
        "hf_median_decode_latency": hf.time_decode_step(inputs, output_len),
    }
