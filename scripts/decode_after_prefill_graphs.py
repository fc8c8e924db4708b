"""Batch-64 decode step before and after building prefill graphs, in one process (issue 30's 2%).

python3 scripts/decode_after_prefill_graphs.py MODEL_DIR [--tokens 256] [--eager-first] [--no-heat] [--bisect]

Loads the model without prefill graphs, then times the batch-64 decode step (128 prompt tokens, 32
steps, 3 rounds, median step of each) as loaded, after a 4 GB allocation, after 10 s of large
matmuls and 15 s idle (heat), after capturing a plain matmul graph (those four skipped with
`--no-heat`), after eager prefill steps of every shape the graphs would capture (`--eager-first`: is
it the capture, or the forwards at new shapes?), after building the prefill graphs up to `--tokens`
by hand, once they are deleted, and with the cycle collector off. `--bisect` first captures, one
case each: a graph of one cuBLAS linear at 16 rows (the first MLP's weight), of one Triton RMSNorm
at 16 rows, of the model's whole 16-token step (all kept alive to the end). Each case also times the batch-64 decode graph's replay alone (CUDA events, 20
replays): a change there is on the GPU, a change only in the step is on the host. One JSON line per
case. Needs CUDA.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from mllmd import LLM
from mllmd.bench.one_batch import random_prompts, time_engine
from mllmd.engine.prefill_graph import PrefillGraphRunner, row_buckets, token_buckets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=256, help="the largest prefill graph built by hand")
    ap.add_argument("--eager-first", action="store_true", help="eager steps of the graphs' shapes before the graphs")
    ap.add_argument("--no-heat", action="store_true", help="skip the allocation, matmul, idle and matmul-graph cases")
    ap.add_argument("--bisect", action="store_true", help="graphs of one linear, one RMSNorm, one 16-token step first")
    args = ap.parse_args()
    bs, inl, outl = 64, 128, 32
    llm = LLM(args.model, dtype="bfloat16", max_running_requests=bs, max_total_tokens=bs * (inl + outl) + 16,
              max_prefill_tokens=bs * inl, chunked_prefill_size=0, disable_radix_cache=True, random_seed=1,
              cuda_graph_max_bs=bs, prefill_graph_max_tokens=0)
    runner = llm.engine.runner
    vocab = llm.engine.info.vocab_size
    prompts = random_prompts(bs, inl, vocab, 3)
    time_engine(llm, random_prompts(2, 16, vocab, 1), 4)

    def replay_ms() -> float:
        graph = runner.graph_runner.graphs[bs]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 20

    def measure(case: str) -> None:
        steps = [statistics.median(time_engine(llm, prompts, outl).decode_latencies[2:]) * 1e3 for _ in range(3)]
        replays = [replay_ms() for _ in range(3)]
        print(json.dumps({"case": case, "step_ms": [round(x, 4) for x in steps],
                          "replay_ms": [round(x, 4) for x in replays]}), flush=True)  # fmt: skip

    def capture(run) -> torch.cuda.CUDAGraph:  # type: ignore[no-untyped-def]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            run()
            with torch.cuda.graph(graph, stream=stream):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        return graph

    measure("as loaded")
    if not args.no_heat:
        big = torch.ones(4 << 30, dtype=torch.uint8, device="cuda")
        measure("4 GB allocated")
        del big
        torch.cuda.empty_cache()
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        t0 = time.time()
        while time.time() - t0 < 10:
            a @ a
        torch.cuda.synchronize()
        measure("after 10 s of matmuls")
        time.sleep(15)
        measure("after 15 s idle")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            a @ a
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                a @ a
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        measure("a matmul graph captured")
        del graph, a
    kept = []
    if args.bisect:
        from mllmd_kernels.rmsnorm import rmsnorm

        layer = runner.model.model.layers[0]
        w = layer.mlp.gate_up_proj.weight
        x16 = torch.randn(16, w.shape[1], device="cuda", dtype=w.dtype)
        with torch.inference_mode():
            kept.append(capture(lambda: torch.nn.functional.linear(x16, w)))
            measure("a graph of one cuBLAS linear at 16 rows")
            nw = layer.post_attention_layernorm.weight
            kept.append(capture(lambda: rmsnorm(x16, nw, 1e-6)))
            measure("a graph of one Triton RMSNorm at 16 rows")
        one = PrefillGraphRunner(runner.model, runner.attn_backend, runner.token_buf, 16, 1, runner._graph_plan(),
                                 images=runner._graph_images())  # fmt: skip
        torch.cuda.synchronize()
        kept.append(one)
        measure("the model's 16-token one-row prefill graph")
    if args.eager_first:
        rows = row_buckets(runner._graph_max_bs())
        for t in token_buckets(args.tokens):
            for r in (r for r in rows if r <= t):
                time_engine(llm, random_prompts(r, t // r, vocab, t + r), 1)
        torch.cuda.synchronize()
        measure(f"eager prefill steps of the graphs' shapes up to {args.tokens} tokens")
    pg = PrefillGraphRunner(runner.model, runner.attn_backend, runner.token_buf, args.tokens, runner._graph_max_bs(),
                            runner._graph_plan(), images=runner._graph_images())  # fmt: skip
    torch.cuda.synchronize()
    measure(f"prefill graphs up to {args.tokens} tokens built")
    del pg
    gc.collect()
    torch.cuda.empty_cache()
    measure("prefill graphs deleted")
    time.sleep(15)
    measure("then 15 s idle")
    gc.disable()
    measure("with the cycle collector off")
    gc.enable()


if __name__ == "__main__":
    main()
