"""Host time per decode step at a given batch with mixed sampling parameters (one JSON line).

    python3 scripts/host_step_time.py MODEL_DIR [--batch 64] [--steps 64] [--device cpu|cuda] [--plain]

Runs `--batch` requests through the engine, each with its own sampling parameters (temperatures,
top-p / top-k / min-p, repetition / frequency / presence penalties, seeds, a logit bias; `--plain`:
all greedy), and times every step once all requests decode. A step's host time is its wall time
minus the time the host waited for the device's tokens (PendingFetch.wait): what the scheduler,
input staging, sampler preparation and launches cost the CPU (on the CPU device, the model and the
sampler's arithmetic too); the thread's CPU time is reported beside it. Uses only the offline API and
PendingFetch, so the same script measures an older tree (PYTHONPATH=old/tree:old/tree/kernels).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--plain", action="store_true", help="all requests greedy (no bias, no penalties)")
    ap.add_argument("--run-name", default="")
    args = ap.parse_args()

    from mllmd import LLM, SamplingParams
    from mllmd.engine import device_io

    waited = [0.0]
    real_wait = device_io.PendingFetch.wait

    def timed_wait(self):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return real_wait(self)
        finally:
            waited[0] += time.perf_counter() - t0

    device_io.PendingFetch.wait = timed_wait  # type: ignore[method-assign]
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_running_requests=max(args.batch, 8),
              chunked_prefill_size=0)
    engine = llm.engine
    total = args.steps + 4

    def params(i: int) -> SamplingParams:
        if args.plain:
            return SamplingParams(max_tokens=total, temperature=0.0, ignore_eos=True)
        kinds = [
            dict(temperature=0.0),
            dict(temperature=0.7, top_p=0.9, seed=i),
            dict(temperature=1.0, top_k=40, seed=i),
            dict(temperature=0.8, min_p=0.05),
            dict(temperature=0.9, repetition_penalty=1.1, seed=i),
            dict(temperature=0.6, frequency_penalty=0.5, presence_penalty=0.3),
            dict(temperature=1.2, top_p=0.95, top_k=50, logit_bias={11: 2.0, 13: -5.0}),
            dict(temperature=0.0, repetition_penalty=1.05),
        ]
        return SamplingParams(max_tokens=total, ignore_eos=True, **kinds[i % len(kinds)])

    for i in range(args.batch):
        engine.add_request(f"r{i}", [100 + (7 * i + j) % 5000 for j in range(16)], params(i))
    times, waits, cpu = [], [], []
    while engine.has_unfinished():
        w0 = waited[0]
        c0 = time.thread_time()
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        dc = time.thread_time() - c0
        running = engine.scheduler.running
        if len(running) == args.batch and all(len(r.token_ids) - r.kv_len <= 1 for r in running):
            times.append(dt)
            waits.append(waited[0] - w0)
            cpu.append(dc)
    host = [t - w for t, w in zip(times, waits)][4:]  # past the first decode steps (warm-up)
    print(json.dumps({
        "run_name": args.run_name, "batch_size": args.batch, "mixed_sampling": not args.plain,
        "device": args.device, "steps_timed": len(host),
        "median_host_us_per_step": round(statistics.median(host) * 1e6, 1),
        "mean_host_us_per_step": round(statistics.fmean(host) * 1e6, 1),
        "median_step_us": round(statistics.median(times[4:]) * 1e6, 1),
        # CPU time of the stepping thread (on a busy machine the wall times above include waits for a
        # core; on CUDA this includes any spinning in the event wait)
        "median_thread_cpu_us_per_step": round(statistics.median(cpu[4:]) * 1e6, 1),
    }))


if __name__ == "__main__":
    main()
