"""The Qwen3-VL benchmark runs on the CPU: one JSON line with the tower, prefill and decode figures and
transformers' in the same run, the prompt exactly --input-len tokens, the image's token count equal to
transformers' processor's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mllmd import LLM, SamplingParams
from mllmd.bench import image_case, multimodal, one_batch
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


# --- one_batch's image mode (issue 31: `bench.one_batch --image PATH --prompt TEXT`, pymllm's measures) ---


def _png(tmp_path: Path, size: tuple[int, int] = (100, 75)) -> Path:

    path = tmp_path / "pic.png"
    rgba = multimodal.synthetic_image(*size, seed=2).convert("RGBA")
    rgba.putalpha(200)  # transparency: composited onto white as the daemon does
    rgba.save(path)
    return path


def _one_batch_lines(tmp_path: Path, *args: str) -> list[dict]:
    out = tmp_path / "one_batch.jsonl"
    out.unlink(missing_ok=True)
    one_batch.main([*args, "--output-len", "3", "--device", "cpu", "--dtype", "float32", "--warmup", "0",
                    "--result-filename", str(out)])
    return [json.loads(x) for x in out.read_text().splitlines()]


def test_image_mode_reports_pymllm_measures_on_the_rendered_turn(tiny_vl: Path, tmp_path: Path) -> None:
    pic = _png(tmp_path)
    (line,) = _one_batch_lines(tmp_path, "--model-path", str(tiny_vl), "--image", str(pic), "--prompt", "What is it?")
    llm = LLM(str(tiny_vl), dtype="float32", device="cpu")
    case = image_case.load_case(llm, str(pic), "What is it?")
    assert line["input_len"] == len(case.ids)  # no --input-len: the turn as the template renders it
    assert line["image_tokens"] == case.image.num_tokens == 70
    assert line["image"] == str(pic) and line["prompt"] == "What is it?"
    assert line["vit_prefill_tokens"] == 70 and line["multimodal_prefill_tokens"] == line["input_len"]
    assert line["multimodal_prefill_latency"] == line["prefill_latency"] > 0
    assert line["multimodal_prefill_ms"] == pytest.approx(line["multimodal_prefill_latency"] * 1e3)
    assert line["multimodal_prefill_tps"] == pytest.approx(line["input_len"] / line["prefill_latency"])
    assert line["vit_prefill_tps"] == pytest.approx(70 / line["vit_prefill_latency"])
    assert 0 < line["vit_prefill_ms"] < line["multimodal_prefill_ms"] * 10
    assert line["median_decode_latency"] > 0


def test_image_mode_input_len_counts_image_and_text_and_only_text_moves(tiny_vl: Path, tmp_path: Path) -> None:
    pic = _png(tmp_path)
    lines = _one_batch_lines(tmp_path, "--model-path", str(tiny_vl), "--image", str(pic), "--input-len", "75", "120",
                             "--batch-size", "2")  # fmt: skip
    assert [(x["input_len"], x["batch_size"], x["image_tokens"]) for x in lines] == [(75, 2, 70), (120, 2, 70)]
    assert [x["vit_prefill_tokens"] for x in lines] == [140, 140]  # both prompts' pictures go through the tower
    assert [x["multimodal_prefill_tokens"] for x in lines] == [150, 240]
    with pytest.raises(SystemExit, match="shorter than the image's 70 tokens"):
        _one_batch_lines(tmp_path, "--model-path", str(tiny_vl), "--image", str(pic), "--input-len", "69")


def test_fit_length_keeps_every_image_token(tiny_vl: Path, tmp_path: Path) -> None:
    llm = LLM(str(tiny_vl), dtype="float32", device="cpu")
    case = image_case.load_case(llm, str(_png(tmp_path)), "Describe this image in detail, please.")
    pad_id = case.ids[case.image.start]
    n, start = case.image.num_tokens, case.image.start
    for target in (n, n + 2, start + n + 1, len(case.ids) - 3, len(case.ids), len(case.ids) + 9):
        ids, image = image_case.fit_length(case, target, llm.engine.info.vocab_size, seed=1)
        assert len(ids) == target and image.num_tokens == n, target
        assert ids[image.start : image.end] == [pad_id] * n and ids.count(pad_id) == n, target
        assert image.start == min(start, target - n), target  # the text before the picture is kept first
        if target > len(case.ids):  # filler right after the image: the template's closing text stays last
            tail = case.ids[case.image.end :]
            assert ids[-len(tail) :] == tail and ids[: image.end] == case.ids[: case.image.end]
        elif target >= start + n:  # cut from the end: the prompt's first tokens
            assert ids == case.ids[:target], target
        else:  # even the text before the picture is cut: its first tokens, then the whole picture
            assert ids == case.ids[: target - n] + [pad_id] * n, target
    # the cut prompt runs: the engine finds its image where fit_length says
    ids, image = image_case.fit_length(case, n + 2, llm.engine.info.vocab_size, seed=1)
    out = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), images=[[image]])
    assert len(out[0].token_ids) == 2


def test_fresh_copies_are_new_pictures_to_both_caches(tiny_vl: Path, tmp_path: Path) -> None:
    llm = LLM(str(tiny_vl), dtype="float32", device="cpu")
    image = image_case.load_case(llm, str(_png(tmp_path)), "Hi").image
    copies = image_case.fresh_copies(image, 3)
    assert len({c.content_hash for c in copies} | {image.content_hash}) == 4
    assert len({c.key_id for c in copies}) == 3
    assert all(c.pixels is image.pixels and c.grid_thw == image.grid_thw for c in copies)


def test_image_mode_refusals(tiny_vl: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        one_batch.main(["--model-path", str(tiny_vl), "--prompt", "hi", "--device", "cpu"])
    assert exc.value.code == 2  # argparse: --prompt needs --image
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image at all")
    with pytest.raises(SystemExit, match="not a readable image"):
        one_batch.main(["--model-path", str(tiny_vl), "--image", str(bad), "--device", "cpu"])


def test_image_mode_with_transformers(tiny_vl: Path, tmp_path: Path) -> None:
    pic = _png(tmp_path)
    (line,) = _one_batch_lines(tmp_path, "--model-path", str(tiny_vl), "--image", str(pic), "--input-len", "100",
                               "--baseline", "hf")  # fmt: skip
    for key in ("hf_vit_prefill_ms", "hf_multimodal_prefill_ms", "hf_median_decode_latency"):
        assert line[key] > 0, key
    assert line["hf_multimodal_prefill_ratio"] == pytest.approx(line["hf_multimodal_prefill_ms"] / line["multimodal_prefill_ms"])
