"""Placeholder expansion equals transformers' Qwen3VLProcessor on a real chat, and the torch-free modules stay so."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from mllmd.checkpoint.tokenizer import build_qwen_tokenizer
from mllmd.models.mrope import mrope_positions
from mllmd.multimodal.image_io import ImageError, ImageLimits, load_images
from mllmd.multimodal.image_processing import VisionPreprocessConfig, process_image
from mllmd.multimodal.patchify import patchify_images
from mllmd.multimodal.prompt import VisionTokenIds, count_placeholders, expand_image_placeholders
from tests.multimodal.conftest import encode, random_rgb

START, PAD, END = 151652, 151655, 151653


@pytest.fixture(scope="module")
def tokenizer(vl_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The real Qwen3 tokenizer (the VL vocabulary is Qwen3's) with Qwen3-VL's chat template."""
    from transformers import AutoTokenizer

    out = build_qwen_tokenizer(
        tmp_path_factory.mktemp("vl_tok"), chat_template=next(vl_source.glob("*.jinja"))
    )
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def processor(vl_source: Path, tokenizer: Any) -> Any:
    """transformers' Qwen3VLProcessor, built offline: its video processor needs torchvision, which this
    environment lacks, so the subclass accepts none (images never touch it)."""
    from transformers import AutoImageProcessor
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    class ImageOnlyProcessor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    image_processor = AutoImageProcessor.from_pretrained(vl_source)
    return ImageOnlyProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=tokenizer.chat_template,
    )


def data_url(data: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_two_image_chat_equals_the_processor(vl_source: Path, tokenizer: Any, processor: Any) -> None:
    pictures = [encode(random_rgb(640, 480), "PNG"), encode(random_rgb(30, 20, seed=1), "PNG")]
    messages = [
        {"role": "system", "content": "You are terse."},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(pictures[0])}},
                {"type": "text", "text": "Compare this one"},
                {"type": "image_url", "image_url": {"url": data_url(pictures[1])}},
                {"type": "text", "text": "with that one."},
            ],
        },
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    ref = processor(text=[text], images=[Image.open(io.BytesIO(p)) for p in pictures], return_tensors="pt")

    # our path: tokenizer worker (decode, resize, expand), then the device (patchify)
    cfg = VisionPreprocessConfig.from_model_dir(vl_source)
    images = [
        process_image(im, cfg, None) for im in load_images([data_url(p) for p in pictures], ImageLimits())
    ]
    assert [im.num_tokens for im in images] == [300, 70]
    ids = tokenizer(text)["input_ids"]
    assert count_placeholders(ids) == 2
    expanded = expand_image_placeholders(ids, [im.num_tokens for im in images])
    assert expanded.input_ids == ref["input_ids"][0].tolist()
    assert expanded.token_types == ref["mm_token_type_ids"][0].tolist()
    starts = [s for s, _ in expanded.image_spans]
    assert [e - s for s, e in expanded.image_spans] == [300, 70]
    assert all(
        expanded.input_ids[s - 1] == START and expanded.input_ids[e] == END for s, e in expanded.image_spans
    )
    assert starts[0] < starts[1]

    values, grids = patchify_images([torch.from_numpy(im.pixels) for im in images], cfg)
    assert [list(g) for g in grids] == ref["image_grid_thw"].tolist()
    torch.testing.assert_close(values, ref["pixel_values"], rtol=0, atol=1e-6)
    positions, delta = mrope_positions(expanded.token_types, grids, cfg.merge_size)
    assert positions.shape == (3, len(expanded.input_ids)) and delta < 0


def test_placeholder_mismatches_are_refused() -> None:
    ids = [1, START, PAD, END, 2, START, PAD, END]
    with pytest.raises(ImageError) as info:
        expand_image_placeholders(ids, [4])
    assert (
        info.value.rule == "image.placeholders"
        and "2 image placeholders but the request carries 1" in str(info.value)
    )
    with pytest.raises(ImageError, match="not between"):
        expand_image_placeholders([1, PAD, END], [4])  # a pad typed by the user, outside the markers
    with pytest.raises(ImageError, match="video"):
        expand_image_placeholders([START, 151656, END], [])
    out = expand_image_placeholders(ids, [1, 3])
    assert out.input_ids == [1, START, PAD, END, 2, START, PAD, PAD, PAD, END]
    assert out.token_types == [0, 0, 1, 0, 0, 0, 1, 1, 1, 0] and out.image_spans == [(2, 3), (6, 9)]
    assert expand_image_placeholders([5, 6], []).input_ids == [5, 6]


def test_token_ids_from_the_config(vl_source: Path) -> None:
    import json

    config = json.loads((vl_source / "config.json").read_text())
    assert VisionTokenIds.from_config(config) == VisionTokenIds()


def test_tokenizer_side_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import mllmd.multimodal.image_io, mllmd.multimodal.image_processing, mllmd.multimodal.prompt\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=root, env={"PYTHONPATH": str(root), "PATH": ""}
    )
