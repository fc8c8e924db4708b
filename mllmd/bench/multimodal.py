"""Qwen3-VL: one image's prefill and the decode after it, through the real engine, against transformers.

python -m mllmd.bench.multimodal --model-path DIR --image-size 1000x750 --input-len 2048 --output-len 64 \
    --repeats 5 --baseline hf --result-filename vl.jsonl

The prompt is one chat turn holding one synthetic picture, then random text tokens up to `--input-len`.
Each repeat draws a new picture, so the encoder cache never hits, and the prefix cache is off. One JSON
line holds the medians:
- `vit_prefill_ms`: the vision tower alone on the image (upload, patchify on the device, encode). Every
  picture has the same size, so from the warm-up on its grid replays the tower's CUDA graph
  (`vit_graph_replays` counts them); `vit_eager_ms` is the same tower call without the graphs, as a
  grid not seen before runs.
- `prefill_ms` / `prefill_tokens_per_s`: the whole prompt's first step. This is the tower plus the
  decoder's prefill of every token, as a fresh image request pays it.
- `median_decode_latency`: the batch-1 decode step after the image.
- On CUDA, `roofline_fraction`: the weights a decode step reads (not the tower's) plus the KV cache at
  its mean length, over the copy bandwidth measured in the same run, divided by that step.

With `--baseline hf` the same ids and image go to transformers' Qwen3-VL on the same weights. It uses
pixel values from its own image processor. The timings are its vision tower (`get_image_features`),
one forward of the prompt, and the per-step cost of `generate`. The `hf_*` ratios are ours over theirs
in throughput.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from mllmd import LLM
from mllmd.bench.one_batch import (
    _Profiler,
    _sync,
    decode_step_bytes,
    measure_copy_bandwidth,
    random_prompts,
    time_engine,
    time_prefill,
    weight_bytes_per_step,
)
from mllmd.engine.request import EngineImage


def synthetic_image(width: int, height: int, seed: int) -> Image.Image:
    """A smooth RGB picture. With random weights the tower's output follows the content, so each seed
    gives a different encoder-cache key."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    chans = [np.sin(x / (17 + 9 * rng.random()) + rng.random() * 6) + np.cos(y / (13 + 7 * rng.random())) for _ in range(3)]
    return Image.fromarray(((np.stack(chans, -1) + 2) * 63).clip(0, 255).astype(np.uint8))


def image_prompt(llm: LLM, image: Image.Image, input_len: int, seed: int) -> tuple[list[int], list[EngineImage]]:
    """A chat turn with `image` and a short question, padded with random text tokens after the image
    (before the template's closing tokens) to `input_len` tokens in all."""
    conv = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Describe it."}]}]
    ids, images = llm.chat_prompt(conv)
    assert images, "the chat path found no image"
    pad = input_len - len(ids)
    if pad < 0:
        raise SystemExit(f"--input-len {input_len} is shorter than the image prompt alone ({len(ids)} tokens)")
    tail = len(ids) - images[-1].start - images[-1].num_tokens  # text after the image stays last
    filler = random_prompts(1, pad, llm.engine.info.vocab_size, seed)[0] if pad else []
    return ids[: len(ids) - tail] + filler + ids[len(ids) - tail :], images


def time_vit(llm: LLM, images: list[EngineImage], *, eager: bool = False) -> float:
    """Seconds for one vision-tower call over `images` (not cached: VisionRunner.encode bypasses the
    cache). `eager`: without the tower's CUDA graphs, as an image of a grid not seen before runs."""
    vision = llm.engine.runner.vision
    assert vision is not None
    device = llm.engine.runner.device
    graphs, vision.graphs = vision.graphs, (None if eager else vision.graphs)
    try:
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():  # as transformers' tower is timed
            vision.encode(images)
        _sync(device)
    finally:
        vision.graphs = graphs
    return time.perf_counter() - t0


class HFVision:
    """transformers' Qwen3-VL on the same weights, fed our prompt ids and its own processor's pixels."""

    def __init__(self, path: str, dtype: torch.dtype, device: torch.device, image_token_id: int) -> None:
        from transformers import AutoImageProcessor, AutoModelForImageTextToText

        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).to(device).eval()
        self.processor = AutoImageProcessor.from_pretrained(path)
        self.device, self.dtype, self.image_token_id = device, dtype, image_token_id

    def inputs(self, ids: list[int], image: Image.Image) -> dict[str, torch.Tensor]:
        pix = self.processor(images=[image], return_tensors="pt")
        x = torch.tensor([ids], device=self.device)
        return {"input_ids": x, "attention_mask": torch.ones_like(x), "mm_token_type_ids": (x == self.image_token_id).long(),
                "pixel_values": pix["pixel_values"].to(self.device, self.dtype), "image_grid_thw": pix["image_grid_thw"].to(self.device)}

    def image_tokens(self, image: Image.Image) -> int:
        grid = self.processor(images=[image], return_tensors="pt")["image_grid_thw"][0]
        return int(grid.prod()) // self.processor.merge_size**2

    def _timed(self, fn: Any) -> float:
        _sync(self.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            fn()
        _sync(self.device)
        return time.perf_counter() - t0

    def time_vit(self, inputs: dict[str, torch.Tensor]) -> float:
        return self._timed(lambda: self.model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]))

    def time_prefill(self, inputs: dict[str, torch.Tensor]) -> float:
        return self._timed(lambda: self.model(**inputs, logits_to_keep=1))

    def time_decode_step(self, inputs: dict[str, torch.Tensor], output_len: int) -> float:
        """(generate of output_len tokens - generate of 1) / (output_len - 1)."""
        kw = {"do_sample": False, "pad_token_id": 0}
        one = self._timed(lambda: self.model.generate(**inputs, max_new_tokens=1, min_new_tokens=1, **kw))
        full = self._timed(lambda: self.model.generate(**inputs, max_new_tokens=output_len, min_new_tokens=output_len, **kw))
        return max(full - one, 1e-9) / max(output_len - 1, 1)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--image-size", default="1000x750", help="WIDTHxHEIGHT of the synthetic picture")
    ap.add_argument("--input-len", type=int, default=2048, help="prompt tokens in all, the image's included")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline", choices=["none", "hf"], default="none")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--run-name", default="multimodal")
    ap.add_argument("--result-filename", default=None, help="append the JSON line here")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="after the timed repeats, profile one more case's tower, prefill and decode steps into DIR")
    args = ap.parse_args(argv)
    width, height = (int(v) for v in args.image_size.lower().split("x"))
    llm = LLM(args.model_path, dtype=args.dtype, device=args.device, max_running_requests=1,
              max_total_tokens=args.input_len + args.output_len + 16, max_prefill_tokens=args.input_len,
              chunked_prefill_size=0, disable_radix_cache=True, random_seed=args.seed,
              max_encoder_tokens_per_step=args.input_len)
    info, runner = llm.engine.info, llm.engine.runner
    if runner.vision is None:
        raise SystemExit(f"{args.model_path} is not a vision-language model")
    image_token_id = int(info.hf_config.image_token_id)
    hf = HFVision(args.model_path, info.dtype, info.device, image_token_id) if args.baseline == "hf" else None

    cases = [image_prompt(llm, (pic := synthetic_image(width, height, args.seed + r)), args.input_len, args.seed + r) + (pic,)
             for r in range(args.repeats + 1)]  # the first is the untimed warm-up: Triton compiles, cuBLAS picks
    vit, vit_eager, prefill, decode, hf_vit, hf_prefill, hf_decode = [], [], [], [], [], [], []
    for r, (ids, images, pic) in enumerate(cases):
        ve = time_vit(llm, images[:1], eager=True)
        v = time_vit(llm, images[:1])
        p = time_prefill(llm, [ids], [images])
        d = statistics.median(time_engine(llm, [ids], args.output_len, images=[images]).decode_latencies)
        if hf is not None:
            inputs = hf.inputs(ids, pic)
            hv, hp, hd = hf.time_vit(inputs), hf.time_prefill(inputs), hf.time_decode_step(inputs, args.output_len)
        if r == 0:
            continue
        vit.append(v), vit_eager.append(ve), prefill.append(p), decode.append(d)
        if hf is not None:
            hf_vit.append(hv), hf_prefill.append(hp), hf_decode.append(hd)

    if args.profile:  # a fresh picture, so the tower runs inside the profiled prefill too
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        ids_p, images_p = image_prompt(llm, synthetic_image(width, height, args.seed - 1), args.input_len, args.seed - 1)
        with _Profiler(str(Path(args.profile) / "vit.json"), info.device):
            time_vit(llm, images_p[:1])
        with _Profiler(str(Path(args.profile) / "prefill.json"), info.device):
            time_prefill(llm, [ids_p], [images_p])
        time_engine(llm, [ids_p], min(args.output_len, 8), str(Path(args.profile) / "decode.json"), "decode", images=[images_p])

    ids, images, pic = cases[0]
    step = statistics.median(decode)
    line: dict[str, Any] = {
        "run_name": args.run_name, "image_size": [width, height], "image_tokens": images[0].num_tokens,
        "input_len": len(ids), "output_len": args.output_len, "repeats": args.repeats,
        "vit_prefill_ms": statistics.median(vit) * 1e3, "vit_eager_ms": statistics.median(vit_eager) * 1e3,
        "vit_graph_replays": runner.vision.graphs.replays if runner.vision.graphs is not None else 0,
        "prefill_ms": statistics.median(prefill) * 1e3,
        "prefill_tokens_per_s": len(ids) / statistics.median(prefill), "median_decode_latency": step,
        "device": str(info.device), "dtype": str(info.dtype).replace("torch.", ""),
        "cuda_graph": runner.graph_runner is not None, "weight_bytes_per_step": weight_bytes_per_step(runner.model),
    }
    if info.device.type == "cuda":
        bandwidth = measure_copy_bandwidth(info.device)
        kv_per_token = runner.kv_pool.bytes_per_token(info.num_layers, info.num_kv_heads, info.head_dim, info.dtype)
        floor = decode_step_bytes(line["weight_bytes_per_step"], kv_per_token, 0, 1, len(ids), args.output_len) / bandwidth
        line.update(copy_bandwidth_gbps=bandwidth / 1e9, roofline_step_latency=floor, roofline_fraction=floor / step)
    if hf is not None:
        line.update(
            hf_image_tokens=hf.image_tokens(pic), hf_vit_prefill_ms=statistics.median(hf_vit) * 1e3,
            hf_prefill_ms=statistics.median(hf_prefill) * 1e3, hf_median_decode_latency=statistics.median(hf_decode),
            hf_vit_ratio=statistics.median(hf_vit) / statistics.median(vit),
            hf_prefill_ratio=statistics.median(hf_prefill) / statistics.median(prefill),
            hf_decode_ratio=statistics.median(hf_decode) / step,
        )
    text = json.dumps(line)
    print(text, flush=True)
    if args.result_filename:
        with open(args.result_filename, "a", encoding="utf-8") as f:
            f.write(text + "\n")
    return line


if __name__ == "__main__":
    main()
