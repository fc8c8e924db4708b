"""The serving benchmark's dataset run through the in-process engine (no HTTP, no workers).

python -m mllmd.bench.offline --model-path DIR [the dataset options of mllmd.bench.serving]

Same requests (`--token-ids-prompt` or `--tokenizer`), same `--max-concurrency`, same metrics and
JSON keys as `mllmd.bench.serving`, so the two results show what the multi-process daemon adds:
the `overhead` block compares them when `--serving-result FILE` names a serving result line.
`--engine-arg KEY=VALUE` sets an engine option as the daemon had it (e.g. max_decode_stall_ms=10).
`--cpu-threads N` sets the engine's torch threads: on CPU the daemon's scheduler worker leaves one
core to its other processes by default, so N = cores - 1 compares the two at the same compute.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from typing import Any

from mllmd.bench.serving import RequestResult, build_requests, compute_metrics, parse_args
from mllmd.bench.serving_datasets import BenchRequest


def run_offline(llm: Any, requests: list[BenchRequest], concurrency: int, temperature: float,
                ignore_eos: bool) -> tuple[list[RequestResult], float]:
    """Keep up to `concurrency` requests in the engine; time every token as the engine emits it."""
    from mllmd import SamplingParams

    engine = llm.engine
    todo = deque(enumerate(requests))
    results = [RequestResult() for _ in requests]
    last: dict[str, float] = {}
    in_flight: dict[str, int] = {}
    start = time.perf_counter()
    while todo or in_flight:
        while todo and len(in_flight) < concurrency:
            i, req = todo.popleft()
            ids = req.prompt if isinstance(req.prompt, list) else llm.tokenizer.encode(req.prompt)
            rid = f"offline-{i}"
            params = SamplingParams(max_tokens=req.output_len, temperature=temperature, ignore_eos=ignore_eos)
            results[i].start = time.perf_counter()
            results[i].prompt_tokens = len(ids)
            engine.add_request(rid, ids, params)
            in_flight[rid] = i
        for out in engine.step():
            i = in_flight[out.rid]
            res, now = results[i], time.perf_counter()
            if out.new_token_ids:
                if res.output_tokens == 0:
                    res.ttft = now - res.start
                else:
                    res.itl.append(now - last[out.rid])
                last[out.rid] = now
                res.output_tokens += len(out.new_token_ids)
                res.chunks += 1
            if out.finished:
                res.latency, res.success, res.usage = now - res.start, True, True
                del in_flight[out.rid]
    return results, time.perf_counter() - start


def engine_args(items: list[str]) -> dict[str, Any]:
    """--engine-arg KEY=VALUE items as EngineConfig keywords (VALUE parsed as JSON, else kept a string)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-arg {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--model-path", required=True)
    extra.add_argument("--serving-result", default=None, help="a JSON line from mllmd.bench.serving to compare")
    extra.add_argument(
        "--cpu-threads", type=int, default=None,
        help="torch threads on CPU (default: all cores; the daemon's scheduler worker leaves one core to its other "
             "processes, so pass that number to compare at the same compute)",
    )  # fmt: skip
    extra.add_argument(
        "--engine-arg", action="append", default=[], metavar="KEY=VALUE",
        help="an EngineConfig field for the engine (VALUE as JSON, else a string), e.g. max_decode_stall_ms=10: "
             "to run the engine as the daemon was configured",
    )  # fmt: skip
    ours, rest = extra.parse_known_args(argv)
    args = parse_args(rest)
    from mllmd import LLM

    config: dict[str, Any] = {"max_running_requests": max(args.max_concurrency or 64, 1), **engine_args(ours.engine_arg)}
    if ours.cpu_threads is not None:
        config["cpu_threads"] = ours.cpu_threads
    llm = LLM(ours.model_path, **config)
    requests = build_requests(args)
    run_offline(llm, requests[: args.warmup_requests], 1, args.temperature, not args.no_ignore_eos)
    llm.engine.flush_cache()
    concurrency = args.max_concurrency or len(requests)
    results, duration = run_offline(llm, requests, concurrency, args.temperature, not args.no_ignore_eos)
    result: dict[str, Any] = {"benchmark": "offline", "model_path": ours.model_path, "max_concurrency": concurrency,
                              "cpu_threads": ours.cpu_threads, "num_prompts": len(requests),
                              **compute_metrics(requests, results, duration)}
    if ours.serving_result:
        with open(ours.serving_result, encoding="utf-8") as f:
            serving = json.loads(f.read().strip().splitlines()[-1])
        result["overhead"] = {
            "throughput_ratio": serving["output_throughput"] / result["output_throughput"],
            "added_mean_ttft_ms": serving["mean_ttft_ms"] - result["mean_ttft_ms"],
            "added_p50_ttft_ms": serving["p50_ttft_ms"] - result["p50_ttft_ms"],
            "added_mean_itl_ms": serving["mean_itl_ms"] - result["mean_itl_ms"],
        }
    line = json.dumps(result)
    print(line)
    if args.result_filename:
        with open(args.result_filename, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    return result


if __name__ == "__main__":
    main()
