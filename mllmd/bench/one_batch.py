"""Latency of one static batch: prefill, then decode steps, through the real engine.

python -m mllmd.bench.one_batch --model-path DIR --batch-size 1 16 --input-len 128 --output-len 64 \
    --baseline hf --result-filename results.jsonl

Appends one JSON line per (batch size, input len, output len) case. With `--baseline hf` the same
case is timed with Hugging Face transformers' `generate` on the same weights in the same run, and
each line carries the ratio (ours / transformers) of decode and prefill throughput.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from mllmd import LLM, SamplingParams


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


def random_prompts(bs: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 150000), (bs, input_len), generator=g).tolist()


def time_engine(llm: LLM, prompts: list[list[int]], output_len: int) -> CaseTiming:
    """Prefill every prompt in one step, then time each decode step."""
    engine = llm.engine
    device = engine.runner.device
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", ids, params)
    _sync(device)
    t0 = time.perf_counter()
    engine.step()
    _sync(device)
    prefill = time.perf_counter() - t0
    decodes = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
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
    ap.add_argument("--input-len", type=int, nargs="+", default=[1024])
    ap.add_argument("--output-len", type=int, nargs="+", default=[16])
    ap.add_argument("--run-name", default="default")
    ap.add_argument("--result-filename", default="result.jsonl")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--baseline", choices=["none", "hf"], default="none")
    ap.add_argument("--hf-cache", default=None, help="transformers cache_implementation (e.g. static)")
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args(argv)

    max_bs = max(args.batch_size)
    max_tokens = max(args.input_len) + max(args.output_len)
    llm = LLM(
        args.model_path,
        dtype=args.dtype,
        device=args.device,
        max_running_requests=max_bs,
        max_total_tokens=max_bs * max_tokens + 16,
        max_prefill_tokens=max_bs * max(args.input_len),
        chunked_prefill_size=0,
        disable_radix_cache=True,
        random_seed=args.seed,
    )
    info = llm.engine.info
    hf_model = None
    if args.baseline == "hf":
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=info.dtype).to(info.device).eval()

    for _ in range(args.warmup):
        warm = random_prompts(min(max_bs, 2), 16, info.vocab_size, args.seed)
        time_engine(llm, warm, 4)
        if hf_model is not None:
            time_hf(hf_model, warm, 4, args.hf_cache)

    for bs, ilen, olen in itertools.product(args.batch_size, args.input_len, args.output_len):
        prompts = random_prompts(bs, ilen, info.vocab_size, args.seed)
        line: dict[str, Any] = {"run_name": args.run_name, "batch_size": bs, "input_len": ilen, "output_len": olen}
        ours = time_engine(llm, prompts, olen).summary(bs, ilen, olen)
        line.update(ours)
        line.update(
            {
                "device": str(info.device),
                "dtype": str(info.dtype).replace("torch.", ""),
                "cuda_graph": False,
                "weight_bytes": info.weight_bytes,
                "threads": torch.get_num_threads(),
            }
        )
        if hf_model is not None:
            hf = time_hf(hf_model, prompts, olen, args.hf_cache).summary(bs, ilen, olen)
            line["hf_prefill_latency"] = hf["prefill_latency"]
            line["hf_median_decode_latency"] = hf["median_decode_latency"]
            line["hf_decode_throughput"] = hf["median_decode_throughput"]
            line["hf_ratio"] = ours["median_decode_throughput"] / hf["median_decode_throughput"]
            line["hf_prefill_ratio"] = ours["prefill_throughput"] / hf["prefill_throughput"]
        text = json.dumps(line)
        print(text, flush=True)
        with open(args.result_filename, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
