"""bench_one_batch on CPU: the JSON line's fields, the median of repeated prefills, and the profiler
trace of the phase asked for."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from mllmd.bench import one_batch
from mllmd.testing.checkpoints import build_tiny_checkpoint


def test_prefill_repeats_report_the_median_and_profile_the_prefill(tmp_path: Path) -> None:
    model = build_tiny_checkpoint(tmp_path / "m")
    out = tmp_path / "r.jsonl"
    one_batch.main(
        ["--model-path", str(model), "--batch-size", "2", "--input-len", "12", "--output-len", "3",
         "--device", "cpu", "--warmup", "0", "--prefill-repeats", "3", "--profile", str(tmp_path / "prof"),
         "--profile-phase", "prefill", "--result-filename", str(out)]
    )
    line = json.loads(out.read_text().splitlines()[-1])
    assert (line["batch_size"], line["input_len"], line["output_len"]) == (2, 12, 3)
    runs = line["prefill_latencies"]
    assert len(runs) == 3 and line["prefill_latency"] == statistics.median(runs)
    assert line["prefill_throughput"] == 2 * 12 / line["prefill_latency"]
    assert line["median_decode_latency"] > 0 and line["quantization"] is None
    trace = Path(line["profile_trace"])
    assert trace.with_suffix(".txt").read_text()  # the summary tables
    # Exactly one forward (the prefill) ran under the profiler: the decode steps (2 more) did not. Counted
    # from the trace's events (the summary table is cut to its 40 busiest rows, which varies with load).
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e.get("name") == "aten::embedding" for e in events) == 1


def test_hf_baseline_fields_are_ratios_of_the_same_run(tmp_path: Path) -> None:
    model = build_tiny_checkpoint(tmp_path / "m")
    out = tmp_path / "r.jsonl"
    one_batch.main(
        ["--model-path", str(model), "--batch-size", "1", "--input-len", "8", "--output-len", "4",
         "--device", "cpu", "--dtype", "float32", "--warmup", "0", "--baseline", "hf", "--result-filename", str(out)]
    )
    line = json.loads(out.read_text().splitlines()[-1])
    assert line["hf_median_decode_latency"] > 0 and line["hf_prefill_latency"] > 0 and line["hf_cache"] is None
    assert line["hf_ratio"] == line["median_decode_throughput"] / line["hf_decode_throughput"]
    assert line["hf_prefill_ratio"] == line["prefill_throughput"] / (8 / line["hf_prefill_latency"])


def test_decode_floor_counts_weights_kv_and_the_recurrent_state() -> None:
    """The roofline's bytes: the weights once, each sequence's KV at its mean length over the decode
    steps, and each sequence's recurrent state read and written (Qwen3.5's 48 MiB a slot moves twice)."""
    slot = 48 << 20
    assert one_batch.decode_step_bytes(10_000, 100, 0, 1, 128, 64) == 10_000 + (128 + 32) * 100
    assert one_batch.decode_step_bytes(10_000, 100, 2 * slot, 64, 128, 64) == 10_000 + 64 * 160 * 100 + 64 * 2 * slot


def test_state_bytes_of_a_hybrid_model_match_its_pool(tmp_path: Path) -> None:
    from mllmd import LLM

    model = build_tiny_checkpoint(tmp_path / "q35", "Qwen3.5-0.8B", num_hidden_layers=4)  # 3 linear + 1 full
    runner = LLM(str(model), device="cpu", dtype="float32", max_total_tokens=256).engine.runner
    assert runner.state_pool is not None and runner.state_slot_bytes() == runner.state_pool.slot_bytes > 0
