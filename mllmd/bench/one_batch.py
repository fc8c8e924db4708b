"""Latency of one static batch: prefill, then decode steps, through the real engine.

python -m mllmd.bench.one_batch --model-path DIR --batch-size 1 16 --input-len 128 --output-len 64 \
    --baseline hf --result-filename results.jsonl

Appends one JSON line per (batch size, input len, output len) case. With `--baseline hf` the same
case is timed with Hugging Face transformers' `generate` on the same weights in the same run (on
CUDA with the static cache unless --hf-cache says otherwise), and each line carries the ratio
(ours / transformers) of decode and prefill throughput.

On CUDA the device copy bandwidth is measured in the same run, and each line carries
`roofline_fraction`: the bytes a decode step must read (the weights it multiplies with, plus the KV
cache of every sequence at its mean length, and for hybrid models each sequence's recurrent state,
read and written) over that bandwidth, divided by the measured median step. `--profile DIR` writes a torch profiler trace of each case's decode steps there (of its
prefill with `--profile-phase prefill`). `--prefill-repeats N` times the prefill N times (one step
each, cache flushed in between) and reports the median.

`--image PATH [--prompt TEXT]` (vision-language models): every prompt of the batch is one chat turn
holding that picture and the question, and the line adds pymllm's `vit_prefill_*` and
`multimodal_prefill_*` measures; `--input-len` then counts image and text tokens together (only text
is padded or cut; left out, the rendered turn's own length). See `mllmd/bench/image_case.py`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mllmd import LLM, SamplingParams
from mllmd.engine.request import EngineImage
from mllmd.multimodal.image_processing import (
    DEFAULT_RESIZE_MAX_PIXELS,
    VisionPreprocessConfig,
    count_image_tokens,
)

DEFAULT_PROMPT = "Describe this image."
# untimed image prefills before the timed ones: the first few after the case's warm-up step still run
# slower, up to twice the settled time (docs/benchmarks.md)
IMAGE_WARM_PREFILLS = 4


@dataclass
class CaseTiming:
    prefill_latency: float
    decode_latencies: list[float]

    def summary(self, bs: int, input_len: int, output_len: int) -> dict[str, float]:
        med = statistics.median(self.decode_latencies) if self.decode_latencies else float("nan")
        total = self.prefill_latency + sum(self.decode_latencies)
        return {
            "prefill_latency": self.prefill_latency,
            "prefill_throughput": bs * input_len / self.prefill_latency,
            "median_decode_latency": med,
            "median_decode_throughput": bs / med,
            "total_latency": total,
            "overall_throughput": bs * (input_len + output_len) / total,
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written), median of 20."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def weight_bytes_per_step(model: Any) -> int:
    """Bytes of parameters a decode step reads in full: all but the embedding table, which only has
    its looked-up rows read, unless it doubles as the (tied) lm_head, and but a vision tower's."""
    skipped = {id(p) for name, m in model.named_modules() if name.split(".")[-1] == "visual" for p in m.parameters()}
    if getattr(model, "lm_head", None) is not None:
        skipped |= {id(m.weight) for name, m in model.named_modules() if name.split(".")[-1] == "embed_tokens"}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skipped)


def decode_step_bytes(weight_bytes: int, kv_per_token: int, state_rw_bytes: int, bs: int, input_len: int,
                      output_len: int) -> float:  # fmt: skip
    """Bytes one decode step must move: the weights, each sequence's KV cache at its mean length over
    the decode steps, and (hybrid models) each sequence's recurrent state read and written."""
    return weight_bytes + bs * (input_len + output_len / 2) * kv_per_token + bs * state_rw_bytes


def random_prompts(bs: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 150000), (bs, input_len), generator=g).tolist()


def image_turn_bound(model_path: str, image_path: str | None, prompt: str) -> int:
    """At most how many tokens the chat turn [picture, prompt] renders to, before the model is loaded
    (to size the KV pool): the picture's tokens at the engine's resize cap, read from the file's header,
    plus one per byte of the prompt and 64 for the template."""
    from PIL import Image

    assert image_path is not None
    try:
        with Image.open(image_path) as im:
            width, height = im.size
    except (OSError, SyntaxError, ValueError) as exc:
        raise SystemExit(f"--image {image_path}: not a readable image ({exc})") from None
    cfg = VisionPreprocessConfig.from_model_dir(model_path)
    return count_image_tokens(height, width, cfg, DEFAULT_RESIZE_MAX_PIXELS) + len(prompt.encode()) + 64


class _Profiler:
    """torch.profiler around a phase; writes a chrome trace and a kernel / CPU summary table."""

    def __init__(self, path: str | None, device: torch.device) -> None:
        self.path, self.device, self.prof = path, device, None

    def __enter__(self) -> _Profiler:
        if self.path is not None:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.prof is None:
            return
        prof, path = self.prof, self.path
        prof.__exit__(None, None, None)
        prof.export_chrome_trace(path)
        sort = "cuda_time_total" if self.device.type == "cuda" else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70)
        table_cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
        Path(path).with_suffix(".txt").write_text(table + "\n\n" + table_cpu)


Images = list[list[EngineImage] | None]  # per prompt: its images over their runs of image tokens


def pictures(image: EngineImage | None, bs: int) -> Images | None:
    """Image mode: one new copy of the picture per prompt (a content hash of its own, so neither cache
    answers for it); text mode: None."""
    if image is None:
        return None
    from mllmd.bench.image_case import fresh_copies

    return [[c] for c in fresh_copies(image, bs)]


def _add_requests(llm: LLM, prompts: list[list[int]], max_tokens: int, images: Images | None = None) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        llm.engine.add_request(f"bench-{time.monotonic_ns()}-{i}", ids, params, images[i] if images else None)


def time_prefill(llm: LLM, prompts: list[list[int]], images: Images | None = None) -> float:
    """One prefill step of every prompt (one output token each), then the cache is flushed."""
    engine = llm.engine
    _add_requests(llm, prompts, 1, images)
    _sync(engine.runner.device)
    t0 = time.perf_counter()
    engine.step()
    _sync(engine.runner.device)
    elapsed = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    engine.flush_cache()
    return elapsed


def time_engine(
    llm: LLM,
    prompts: list[list[int]],
    output_len: int,
    profile_path: str | None = None,
    profile_phase: str = "decode",
    images: Images | None = None,
) -> CaseTiming:
    """Prefill every prompt in one step, then time each decode step (optionally under the profiler)."""
    engine = llm.engine
    device = engine.runner.device
    _add_requests(llm, prompts, output_len, images)
    _sync(device)
    with _Profiler(profile_path if profile_phase == "prefill" else None, device):
        t0 = time.perf_counter()
        engine.step()
        _sync(device)
        prefill = time.perf_counter() - t0
    decodes = []
    overlap = engine.overlap
    with _Profiler(profile_path if profile_phase == "decode" else None, device):
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            if not overlap:  # with overlap a step returns once the previous step's tokens are in
                _sync(device)
            decodes.append(time.perf_counter() - t0)
    engine.flush_cache()
    return CaseTiming(prefill, decodes)


def time_hf(model: Any, prompts: list[list[int]], output_len: int, cache_impl: str | None) -> CaseTiming:
    """transformers generate: prefill = a 1-token generate; decode step = the rest averaged."""
    device = next(model.parameters()).device
    x = torch.tensor(prompts, device=device)
    mask = torch.ones_like(x)
    kw: dict[str, Any] = {"do_sample": False, "attention_mask": mask, "pad_token_id": 0}
    if cache_impl:
        kw["cache_implementation"] = cache_impl

    def run(n: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
        _sync(device)
        return time.perf_counter() - t0

    prefill = run(1)
    total = run(output_len)
    per_step = max(total - prefill, 1e-9) / max(output_len - 1, 1)
    return CaseTiming(prefill, [per_step] * max(output_len - 1, 1))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--batch-size", type=int, nargs="+", default=[1])
    ap.add_argument("--input-len", type=int, nargs="+", default=None,
                    help="prompt tokens (default 1024; with --image, the rendered turn's own length)")
    ap.add_argument("--output-len", type=int, nargs="+", default=[16])
    ap.add_argument("--run-name", default="default")
    ap.add_argument("--result-filename", default="result.jsonl")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--baseline", choices=["none", "hf"], default="none")
    ap.add_argument("--hf-cache", default=None, help="transformers cache_implementation: static (default on CUDA) or default (the dynamic cache)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--prefill-graph-max-tokens", type=int, default=None,
                    help="runtime.prefill_graph_max_tokens (default: the config's; 0: prefill steps run eagerly)")
    ap.add_argument(
        "--overlap", choices=["auto", "on", "off"], default="auto",
        help="scheduler.overlap_schedule: launch step N+1 before N's tokens arrive (auto: on for CUDA)",
    )
    ap.add_argument("--profile", default=None, metavar="DIR", help="write a torch profiler trace per case here")
    ap.add_argument("--profile-phase", choices=["decode", "prefill"], default="decode", help="what --profile records")
    ap.add_argument("--prefill-repeats", type=int, default=1, help="time the prefill this many times; report the median")
    ap.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size (default: exactly what the cases need)")
    ap.add_argument("--image", default=None, metavar="PATH", help="image mode: one picture in every prompt (VL models)")
    ap.add_argument("--prompt", default=None, help=f"image mode: the question after the picture (default: {DEFAULT_PROMPT!r})")
    args = ap.parse_args(argv)
    if args.prompt is not None and args.image is None:
        ap.error("--prompt needs --image")
    if args.image is not None and args.baseline == "hf" and max(args.batch_size) > 1:
        ap.error("--baseline hf with --image times batch size 1 only")
    input_lens: list[int | None] = list(args.input_len) if args.input_len else [None if args.image else 1024]

    max_bs = max(args.batch_size)
    max_tokens = max(n if n is not None else image_turn_bound(args.model_path, args.image, args.prompt or DEFAULT_PROMPT)
                     for n in input_lens) + max(args.output_len)
    llm = LLM(
        args.model_path,
        dtype=args.dtype,
        device=args.device,
        max_running_requests=max_bs,
        max_total_tokens=args.max_total_tokens or max_bs * max_tokens + 16,
        max_prefill_tokens=max_bs * (max_tokens - max(args.output_len)),
        **({"max_encoder_tokens_per_step": max_bs * max_tokens} if args.image else {}),
        chunked_prefill_size=0,
        disable_radix_cache=True,
        random_seed=args.seed,
        attention_backend=args.attention_backend,
        disable_cuda_graph=args.disable_cuda_graph,
        overlap_schedule={"auto": None, "on": True, "off": False}[args.overlap],
        cuda_graph_max_bs=max(max_bs, 1),
        **({} if args.prefill_graph_max_tokens is None else {"prefill_graph_max_tokens": args.prefill_graph_max_tokens}),
    )
    info = llm.engine.info
    runner = llm.engine.runner
    is_cuda = info.device.type == "cuda"
    bandwidth = measure_copy_bandwidth(info.device) if is_cuda else None
    step_weight_bytes = weight_bytes_per_step(runner.model)
    kv_per_token = runner.kv_pool.bytes_per_token(info.num_layers, info.num_kv_heads, info.head_dim, info.dtype)
    state_rw_bytes = 2 * runner.state_slot_bytes()  # hybrid models: each sequence's state, read and written
    hf_cache = args.hf_cache or ("static" if is_cuda else None)
    if hf_cache == "default":  # transformers' dynamic cache
        hf_cache = None
    hf_model = hf_vision = case = None
    if args.image is not None:
        from mllmd.bench import image_case

        case = image_case.load_case(llm, args.image, args.prompt or DEFAULT_PROMPT)
        if args.baseline == "hf":
            from mllmd.bench.multimodal import HFVision

            hf_vision = HFVision(args.model_path, info.dtype, info.device, int(info.hf_config.image_token_id))
    elif args.baseline == "hf":
        from mllmd.testing.checkpoints import hf_model_class

        config = json.loads((Path(args.model_path) / "config.json").read_text(encoding="utf-8"))
        hf_model = hf_model_class(config).from_pretrained(args.model_path, dtype=info.dtype).to(info.device).eval()

    for _ in range(args.warmup):
        warm = random_prompts(min(max_bs, 2), 16, info.vocab_size, args.seed)
        time_engine(llm, warm, 4)
        if hf_model is not None:
            time_hf(hf_model, warm, 4, hf_cache)

    for bs, want_len, olen in itertools.product(args.batch_size, input_lens, args.output_len):
        image: EngineImage | None = None
        if case is not None:
            ids, image = image_case.fit_length(case, want_len, info.vocab_size, args.seed)
            prompts, ilen = [ids] * bs, len(ids)
        else:
            ilen = int(want_len or 1024)
            prompts = random_prompts(bs, ilen, info.vocab_size, args.seed)
        if is_cuda:  # the case's own shapes once, untimed: Triton compiles, cuBLAS picks its kernels
            warm = prompts if image is not None else random_prompts(bs, ilen, info.vocab_size, args.seed + 1)
            time_engine(llm, warm, 2, images=pictures(image, bs))
            for _ in range(IMAGE_WARM_PREFILLS if image is not None else 0):  # image prefills settle slowly
                time_prefill(llm, prompts, pictures(image, bs))
        line: dict[str, Any] = {"run_name": args.run_name, "batch_size": bs, "input_len": ilen, "output_len": olen}
        trace = None
        if args.profile:
            Path(args.profile).mkdir(parents=True, exist_ok=True)
            trace = str(Path(args.profile) / f"trace-bs{bs}-in{ilen}-out{olen}.json")
        timing = time_engine(llm, prompts, olen, trace, args.profile_phase, images=pictures(image, bs))
        if args.prefill_repeats > 1:
            runs = [timing.prefill_latency]
            runs += [time_prefill(llm, prompts, pictures(image, bs)) for _ in range(args.prefill_repeats - 1)]
            timing.prefill_latency = statistics.median(runs)
            line["prefill_latencies"] = runs
        ours = timing.summary(bs, ilen, olen)
        line.update(ours)
        if case is not None and image is not None:
            vit = image_case.median_vit(llm, image, bs)
            line.update(image=case.path, prompt=case.prompt, image_tokens=image.num_tokens)
            line.update(image_case.pymllm_metrics(timing.prefill_latency, vit, bs, ilen, image.num_tokens))
            if hf_vision is not None:
                hf_vl = image_case.hf_figures(hf_vision, ids, case, olen, image.num_tokens)
                line.update(hf_vl)
                line["hf_multimodal_prefill_ratio"] = hf_vl["hf_multimodal_prefill_ms"] / line["multimodal_prefill_ms"]
                line["hf_vit_ratio"] = hf_vl["hf_vit_prefill_ms"] / line["vit_prefill_ms"]
                line["hf_ratio"] = hf_vl["hf_median_decode_latency"] / ours["median_decode_latency"]
        line.update(
            {
                "device": str(info.device),
                "dtype": str(info.dtype).replace("torch.", ""),
                "attention_backend": type(runner.attn_backend).__name__,
                "cuda_graph": runner.graph_runner is not None,
                "prefill_graphs": len(runner.prefill_graphs.graphs) if runner.prefill_graphs is not None else 0,
                "overlap_schedule": llm.engine.overlap,
                "quantization": info.quantization,
                "weight_bytes": info.weight_bytes,
                "weight_bytes_per_step": step_weight_bytes,
                "threads": torch.get_num_threads(),
            }
        )
        if bandwidth is not None:
            kv_bytes = bs * (ilen + olen / 2) * kv_per_token  # mean context over the decode steps
            floor = decode_step_bytes(step_weight_bytes, kv_per_token, state_rw_bytes, bs, ilen, olen) / bandwidth
            line["copy_bandwidth_gbps"] = bandwidth / 1e9
            line["kv_bytes_per_step"] = int(kv_bytes)
            if state_rw_bytes:
                line["state_bytes_per_step"] = bs * state_rw_bytes
            line["roofline_step_latency"] = floor
            line["roofline_fraction"] = floor / ours["median_decode_latency"]
        if trace is not None:
            line["profile_trace"] = trace
        if hf_model is not None:
            if is_cuda:  # the case's shapes once, untimed: with the static cache transformers compiles here
                time_hf(hf_model, prompts, olen, hf_cache)
            hf = time_hf(hf_model, prompts, olen, hf_cache).summary(bs, ilen, olen)
            line["hf_prefill_latency"] = hf["prefill_latency"]
            line["hf_median_decode_latency"] = hf["median_decode_latency"]
            line["hf_decode_throughput"] = hf["median_decode_throughput"]
            line["hf_ratio"] = ours["median_decode_throughput"] / hf["median_decode_throughput"]
            line["hf_prefill_ratio"] = ours["prefill_throughput"] / hf["prefill_throughput"]
            line["hf_cache"] = hf_cache
        text = json.dumps(line)
        print(text, flush=True)
        with open(args.result_filename, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
