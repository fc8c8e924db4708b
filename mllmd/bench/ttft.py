"""Time to first token by prompt length and weight format: fresh prompts through `LLM.generate`.

python -m mllmd.bench.ttft --model bf16=DIR --model w4a16=DIR2 --input-len 32 128 512 2048 \
    --repeats 5 --baseline hf --result-filename ttft.jsonl

Each repeat sends a prompt of new random tokens (nothing can hit the prefix cache) with max_tokens 1
and times `LLM.generate` from the call to its return: admission, the prefill step(s) and the first
token's sampling, as a chat turn's first token costs in process. One JSON line per (model, length):
the median and every repeat, and on CUDA the floor measured in the same run, the larger of the
weights read once at the device's copy bandwidth and the prompt's matmul FLOPs at the device's
measured bf16 GEMM rate, with `floor_fraction` = floor / median. `host_us` is the host's share (the
wall time less the waits for the device's results) and `host_cpu_us` the thread's CPU time, medians
over the repeats. `--compare-eager [LABEL...]` adds those models (default all) with prefill CUDA graphs off.
`--baseline hf` times transformers' forward of the same prompt on the same weights (not for
quantized checkpoints). Ends with a table (lengths across, models down).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from mllmd import LLM, SamplingParams
from mllmd.bench.one_batch import _sync, measure_copy_bandwidth, random_prompts, weight_bytes_per_step
from mllmd.engine import device_io


def measure_matmul_flops(device: torch.device, n: int = 8192) -> float:
    """bf16 GEMM rate in FLOP/s (an n x n x n product, median of 10)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times)


def parse_model(spec: str) -> tuple[str, str]:
    """"label=path" or a bare path (its folder name is the label)."""
    label, sep, path = spec.partition("=")
    if not sep:
        path, label = spec, spec.rstrip("/").rsplit("/", 1)[-1]
    return label, path


class DeviceWaits:
    """Seconds the host spends waiting for the device's results (PendingFetch.wait, the engine's one
    wait point) while inside the block: the rest of a call's wall time is host work."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> DeviceWaits:
        real = self._real = device_io.PendingFetch.wait

        def timed(fetch: device_io.PendingFetch) -> list[list[Any] | None]:
            t0 = time.perf_counter()
            try:
                return real(fetch)
            finally:
                self.seconds += time.perf_counter() - t0

        device_io.PendingFetch.wait = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        device_io.PendingFetch.wait = self._real  # type: ignore[method-assign]


@dataclass
class FirstToken:
    seconds: float  # from `generate` to its return
    host_seconds: float  # of which the host worked (not waiting for the device)
    cpu_seconds: float  # the calling thread's CPU time


def time_first_token(llm: LLM, ids: list[int]) -> FirstToken:
    """`generate` of one output token: wall time, host time (wall minus the waits for the device) and
    thread CPU time. On the CPU the host time includes the model's arithmetic."""
    device = llm.engine.runner.device
    _sync(device)
    c0 = time.thread_time()
    t0 = time.perf_counter()
    with DeviceWaits() as waits:
        llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    _sync(device)
    wall = time.perf_counter() - t0
    return FirstToken(wall, wall - waits.seconds, time.thread_time() - c0)


def time_hf_first_token(model: Any, ids: list[int], device: torch.device) -> float:
    """transformers: one forward of the prompt and the argmax of its last logits."""
    x = torch.tensor([ids], device=device)
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        int(model(x, logits_to_keep=1).logits[0, -1].argmax())
    _sync(device)
    return time.perf_counter() - t0


def bench_model(
    label: str, path: str, args: argparse.Namespace, hw: dict[str, float], engine_args: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    llm = LLM(path, dtype=args.dtype, device=args.device, random_seed=args.seed, **(engine_args or {}))
    runner = llm.engine.runner
    vocab = llm.engine.info.vocab_size
    wbytes = weight_bytes_per_step(runner.model)
    n_params = sum(p.numel() for p in runner.model.parameters())
    hf = None
    if args.baseline == "hf":
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=runner.info.dtype).to(runner.device).eval()
    graphs, capture_s = 0, None
    if runner.prefill_graphs is not None:  # (no reference kept: it would keep the engine alive)
        graphs, capture_s = len(runner.prefill_graphs.graphs), round(runner.prefill_graphs.capture_seconds, 2)
    rows = []
    seed = args.seed
    for n in args.input_len:
        for _ in range(args.warmup):
            seed += 1
            time_first_token(llm, random_prompts(1, n, vocab, seed)[0])
        ours: list[FirstToken] = []
        theirs = []
        for _ in range(args.repeats):
            seed += 1
            ids = random_prompts(1, n, vocab, seed)[0]
            ours.append(time_first_token(llm, ids))
            if hf is not None:
                theirs.append(time_hf_first_token(hf, ids, runner.device))
        med = statistics.median(t.seconds for t in ours)
        row: dict[str, Any] = {"run_name": args.run_name, "model": label, "input_len": n, "repeats": args.repeats,
                               "ttft_ms": round(med * 1e3, 3), "ttft_ms_all": [round(t.seconds * 1e3, 3) for t in ours],
                               # host work of the whole first token (admission, prefill step, sampling):
                               # what a slower host (Jetson's cores) pays again
                               "host_us": round(statistics.median(t.host_seconds for t in ours) * 1e6, 1),
                               "host_cpu_us": round(statistics.median(t.cpu_seconds for t in ours) * 1e6, 1),
                               "device": runner.device.type, "weight_bytes": wbytes,
                               "prefill_graphs": graphs, "prefill_graph_capture_s": capture_s}
        if hw:
            floor = max(wbytes / hw["copy_bytes_per_s"], 2 * n_params * n / hw["matmul_flops"])
            row.update(floor_ms=round(floor * 1e3, 3), floor_fraction=round(floor / med, 4))
        if theirs:
            hf_med = statistics.median(theirs)
            row.update(hf_ttft_ms=round(hf_med * 1e3, 3), vs_hf=round(hf_med / med, 3))
        rows.append(row)
        print(json.dumps(row), flush=True)
    del llm, hf, runner
    gc.collect()  # the engine's objects form reference cycles: free its KV pool before the next model loads
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict[str, Any]], lengths: list[int]) -> str:
    """Markdown: models down, prompt lengths across, median TTFT in ms (and the floor, where known)."""
    lines = ["| model | " + " | ".join(f"{n} tokens" for n in lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
    for model in dict.fromkeys(r["model"] for r in rows):
        cells = []
        for n in lengths:
            r = next((r for r in rows if r["model"] == model and r["input_len"] == n), None)
            cells.append("" if r is None else f"{r['ttft_ms']:.1f} ms" + (f" (floor {r['floor_ms']:.1f})" if "floor_ms" in r else ""))
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="label=DIR or DIR (repeat for several formats)")
    ap.add_argument("--input-len", type=int, nargs="+", default=[32, 128, 512, 2048])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2, help="untimed fresh prompts per length first")
    ap.add_argument("--baseline", choices=["none", "hf"], default="none")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--compare-eager", nargs="*", default=None, metavar="LABEL",
                    help="also time these models (none named: every model) with prefill CUDA graphs off "
                         "(label suffix -eager)")
    ap.add_argument("--prefill-graph-max-tokens", type=int, default=None,
                    help="the engine's prefill_graph_max_tokens for every model (default: the engine's own)")
    ap.add_argument("--run-name", default="ttft")
    ap.add_argument("--result-filename", default=None, help="append the JSON lines here")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and args.device != "cpu"
    hw: dict[str, float] = {}
    if cuda:
        dev = torch.device("cuda")
        hw = {"copy_bytes_per_s": measure_copy_bandwidth(dev), "matmul_flops": measure_matmul_flops(dev)}
        print(json.dumps({"run_name": args.run_name, "hardware": {k: round(v) for k, v in hw.items()}}), flush=True)
    rows = []
    for spec in args.model:
        label, path = parse_model(spec)
        graphs = None if args.prefill_graph_max_tokens is None else {"prefill_graph_max_tokens": args.prefill_graph_max_tokens}
        rows += bench_model(label, path, args, hw, graphs)
        if args.compare_eager is not None and (not args.compare_eager or label in args.compare_eager):
            rows += bench_model(f"{label}-eager", path, args, hw, {"prefill_graph_max_tokens": 0})
    if args.result_filename:
        with open(args.result_filename, "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print(table(rows, args.input_len))
    return rows


if __name__ == "__main__":
    main()
