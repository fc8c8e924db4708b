"""Qwen3-VL through the engine: greedy tokens equal transformers' Qwen3VLForConditionalGeneration (fp32, CPU).

A tiny random Qwen3-VL built from the real 2B config (4 vision blocks, deepstack after text layers 0 and
1), prompts made by `LLM.chat` (the tokenizer worker's path: chat template, placeholders expanded,
images resized), and transformers fed the same ids with its own image processor's pixel values. Cases:
text only, an image first / in the middle / last, two images of different sizes, an RGBA PNG, a grey
image, a chunk boundary inside an image, concurrent requests with different images, and preemption.
The engine runs on the CPU here also where CUDA is present, as transformers does: tokens compared
across devices can part at a near-tie (one did on the H200). tests/engine/test_gpu_hybrid.py compares
the two on CUDA.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from mllmd import LLM, SamplingParams
from mllmd.testing import checkpoints as ck
from tests.multimodal.conftest import encode

NEW = 64
IMAGE_PAD = 151655
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ck.build_tiny_checkpoint(
        tmp_path_factory.mktemp("qwen3_vl_engine"), "Qwen3-VL-2B-Instruct", seed=3,
        extra_overrides={"vision_config": {"depth": 4, "deepstack_visual_indexes": [1, 2]}},
    )


@pytest.fixture(scope="module")
def hf(model: Path) -> Any:
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval(), AutoImageProcessor.from_pretrained(model)


@pytest.fixture(scope="module")
def llm(model: Path) -> LLM:
    return LLM(str(model), device="cpu", dtype="float32")


def smooth(width: int, height: int, seed: int) -> Image.Image:
    """A low-frequency picture (random weights make the tower's output depend on it strongly)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    chans = [np.sin(x / (7 + 5 * rng.random()) + rng.random() * 6) + np.cos(y / (9 + 4 * rng.random())) for _ in range(3)]
    return Image.fromarray(((np.stack(chans, -1) + 2) * 63).clip(0, 255).astype(np.uint8))


def part(img: Image.Image, fmt: str = "PNG") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:image/{fmt.lower()};base64," + base64.b64encode(encode(img, fmt)).decode()}}


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def hf_greedy(hf: Any, llm: LLM, messages: list[dict[str, Any]], images: list[Image.Image]) -> list[int]:
    """transformers' greedy tokens for the prompt our chat path builds (its own pixel values)."""
    from mllmd.multimodal.chat import build_vision_prompt
    from mllmd.multimodal.image_io import ImageLimits
    from mllmd.multimodal.prompt import VisionTokenIds

    model, processor = hf
    vision = llm.engine.runner.vision
    if images:
        prompt = build_vision_prompt(llm.tokenizer, messages, {}, vision.preprocess, VisionTokenIds(),
                                     ImageLimits(media_dirs=("/",)))
        ids = prompt.input_ids
        rgb = [_white(im) if im.mode == "RGBA" else im.convert("RGB") for im in images]
        pix = processor(images=rgb, return_tensors="pt")
        extra = {"pixel_values": pix["pixel_values"], "image_grid_thw": pix["image_grid_thw"]}
    else:
        ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        extra = {}
    input_ids = torch.tensor([ids])
    types = (input_ids == IMAGE_PAD).long()
    with torch.no_grad():
        out = model.generate(input_ids, mm_token_type_ids=types, max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, **extra)
    return out[0, len(ids):].tolist()


def _white(im: Image.Image) -> Image.Image:
    """transformers' convert_to_rgb: transparency composited on white."""
    bg = Image.new("RGBA", im.size, (255, 255, 255, 255))
    return Image.alpha_composite(bg, im).convert("RGB")


CASES = {
    "text_only": ([text("Describe the weather on Mars.")], []),
    "image_first": (["A", text("What is in this picture?")], [smooth(64, 48, 1)]),
    "image_middle": ([text("Look at"), "A", text("and tell me the colour.")], [smooth(96, 64, 2)]),
    "image_last": ([text("Here is a photo:"), "A"], [smooth(40, 72, 3)]),
    "two_images": ([text("Compare"), "A", text("with"), "B", text("please.")], [smooth(64, 64, 4), smooth(128, 40, 5)]),
}


def messages_for(parts: list[Any], images: list[Image.Image]) -> list[dict[str, Any]]:
    it = iter(images)
    return [{"role": "user", "content": [part(next(it)) if p in ("A", "B") else p for p in parts]}]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_transformers(case: str, llm: LLM, hf: Any) -> None:
    parts, images = CASES[case]
    messages = messages_for(parts, images)
    want = hf_greedy(hf, llm, messages, images)
    got = llm.chat(messages, GREEDY)[0]
    assert got.token_ids == want
    assert llm.engine.is_idle_and_clean()


def test_rgba_and_grey_images(llm: LLM, hf: Any) -> None:
    rgba = smooth(48, 48, 6).convert("RGBA")
    alpha = np.zeros((48, 48), dtype=np.uint8)
    alpha[8:40, 8:40] = 255
    rgba.putalpha(Image.fromarray(alpha))
    grey = smooth(64, 32, 7).convert("L")
    for image in (rgba, grey):
        messages = messages_for([text("What is this?"), "A"], [image])
        want = hf_greedy(hf, llm, messages, [image if image.mode == "RGBA" else image.convert("RGB")])
        assert llm.chat(messages, GREEDY)[0].token_ids == want


def test_chunk_boundary_inside_an_image_and_concurrent_requests(model: Path, hf: Any, llm: LLM) -> None:
    """Prefill chunks of 7 tokens (image boundaries fall inside chunks and chunks inside images), several
    requests with different images at once, and a KV pool so small that requests get preempted and
    recomputed: each request's tokens equal its own transformers run."""
    convs = [messages_for(*CASES[c]) for c in ("image_first", "image_middle", "two_images", "text_only")]
    wants = [hf_greedy(hf, llm, conv, CASES[c][1]) for conv, c in zip(convs, ("image_first", "image_middle", "two_images", "text_only"))]
    small = LLM(str(model), device="cpu", dtype="float32", chunked_prefill_size=7, max_total_tokens=260)
    outs = small.chat(convs, GREEDY)
    assert [o.token_ids for o in outs] == wants
    assert small.engine.scheduler.stats.preemptions > 0, "the pool was meant to force preemptions"
    assert small.engine.is_idle_and_clean()


def test_prefix_cache_knows_images(llm: LLM) -> None:
    """Same text with image A then image B: B's output is B's cold output (the pad ids alone do not
    match); the same image again hits the cache past the image."""
    a, b = smooth(64, 48, 8), smooth(64, 48, 9)
    conv_a, conv_b = messages_for([text("Caption:"), "A"], [a]), messages_for([text("Caption:"), "A"], [b])
    llm.engine.flush_cache()
    cold_b = llm.chat(conv_b, GREEDY)[0]
    llm.engine.flush_cache()
    llm.chat(conv_a, GREEDY)
    warm_b = llm.chat(conv_b, GREEDY)[0]
    assert warm_b.token_ids == cold_b.token_ids
    image_start = llm.chat(conv_a, SamplingParams(max_tokens=1, temperature=0))[0].prompt_token_ids.index(IMAGE_PAD)
    assert warm_b.cached_tokens <= image_start + 1, "B shared KV past the first image token"
    again = llm.chat(conv_a, GREEDY)[0]
    assert again.cached_tokens > image_start + 10, "the same image again did not hit the prefix cache"


def test_encoder_budget_spreads_images_over_steps(model: Path, hf: Any, llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """scheduler.max_encoder_tokens_per_step=1: no step encodes two images (each is then encoded alone),
    and the outputs are unchanged; an image seen before comes from the encoder cache, even where the
    prefix cache no longer has its KV."""
    from mllmd.engine.vision_runner import VisionRunner

    cases = ("two_images", "image_first", "image_last")
    convs = [messages_for(*CASES[c]) for c in cases]
    wants = [hf_greedy(hf, llm, conv, CASES[c][1]) for conv, c in zip(convs, cases)]
    calls: list[int] = []
    real = VisionRunner.encode
    monkeypatch.setattr(VisionRunner, "encode", lambda self, images: calls.append(len(images)) or real(self, images))
    budgeted = LLM(str(model), device="cpu", dtype="float32", max_encoder_tokens_per_step=1)
    assert [o.token_ids for o in budgeted.chat(convs, GREEDY)] == wants
    assert calls == [1, 1, 1, 1], calls  # four distinct images, one per step
    calls.clear()
    budgeted.engine.flush_cache()  # no prefix hit: the image's rows are needed again
    vision = budgeted.engine.runner.vision
    assert vision is not None
    hits = vision.cache.hits
    assert budgeted.chat(convs[1], GREEDY)[0].token_ids == wants[1]
    assert calls == [] and vision.cache.hits > hits


def test_cached_image_outputs_hold_no_autograd_graph(llm: LLM) -> None:
    """The tower runs while a step is prepared, outside the forward's inference mode: no parameter may
    require grad, or each cached image's rows would keep every activation of its encode alive (beyond
    cache.encoder_cache_mb) and the tower would record a graph on every call."""
    llm.chat(messages_for([text("Caption:"), "A"], [smooth(64, 48, 12)]), SamplingParams(max_tokens=1, temperature=0))
    vision = llm.engine.runner.vision
    assert vision is not None and vision.cache._entries
    assert not any(p.requires_grad for p in llm.engine.runner.model.parameters())
    for embeds, deepstack in vision.cache._entries.values():
        assert embeds.grad_fn is None and all(d.grad_fn is None for d in deepstack)
