"""The Qwen3-VL benchmark runs on the CPU: one JSON line with the tower, prefill and decode figures and
transformers' in the same run, the prompt exactly --input-len tokens, the image's token count equal to
transformers' processor's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mllmd import LLM
from mllmd.bench import multimodal
from mllmd.testing import checkpoints as ck


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ck.build_tiny_checkpoint(
        tmp_path_factory.mktemp("bench_vl"), "Qwen3-VL-2B-Instruct", seed=5,
        extra_overrides={"vision_config": {"depth": 2, "deepstack_visual_indexes": [0, 1]}},
    )


def test_bench_line_with_transformers(tiny_vl: Path, tmp_path: Path) -> None:
    out = tmp_path / "vl.jsonl"
    line = multimodal.main(["--model-path", str(tiny_vl), "--image-size", "100x75", "--input-len", "120",
                            "--output-len", "4", "--repeats", "1", "--baseline", "hf", "--device", "cpu",
                            "--dtype", "float32", "--result-filename", str(out)])
    assert json.loads(out.read_text()) == line
    assert line["input_len"] == 120 and line["image_tokens"] == line["hf_image_tokens"] == 70  # scaled up to the minimum size
    for key in ("vit_prefill_ms", "prefill_ms", "prefill_tokens_per_s", "median_decode_latency",
                "hf_vit_prefill_ms", "hf_prefill_ms", "hf_median_decode_latency"):
        assert line[key] > 0, key
    assert line["hf_prefill_ratio"] == pytest.approx(line["hf_prefill_ms"] / line["prefill_ms"])
    assert "roofline_fraction" not in line  # no device figures on the CPU


def test_prompt_padding_keeps_the_image_and_the_template_tail(tiny_vl: Path) -> None:
    llm = LLM(str(tiny_vl), dtype="float32", device="cpu")
    pic = multimodal.synthetic_image(64, 64, 1)
    plain, plain_images = llm.chat_prompt([{"role": "user", "content": [{"type": "image", "image": pic},
                                                                         {"type": "text", "text": "Describe it."}]}])
    ids, images = multimodal.image_prompt(llm, pic, len(plain) + 10, seed=3)
    assert len(ids) == len(plain) + 10
    image = images[0]
    assert (image.start, image.num_tokens) == (plain_images[0].start, plain_images[0].num_tokens)
    tail = len(plain) - image.start - image.num_tokens
    assert ids[: image.start + image.num_tokens] == plain[: image.start + image.num_tokens]
    assert ids[-tail:] == plain[-tail:]
    with pytest.raises(SystemExit, match="shorter than the image prompt"):
        multimodal.image_prompt(llm, pic, len(plain) - 1, seed=3)


def test_profile_writes_the_tower_prefill_and_decode_tables(tiny_vl: Path, tmp_path: Path) -> None:
    prof = tmp_path / "prof"
    multimodal.main(["--model-path", str(tiny_vl), "--image-size", "100x75", "--input-len", "120", "--output-len", "4",
                     "--repeats", "1", "--device", "cpu", "--dtype", "float32", "--profile", str(prof)])
    for name in ("vit", "prefill", "decode"):
        table = (prof / f"{name}.txt").read_text()
        assert "aten::" in table, name  # a CPU op table of that phase
    assert "aten::conv3d" in (prof / "vit.txt").read_text() or "aten::linear" in (prof / "vit.txt").read_text()
