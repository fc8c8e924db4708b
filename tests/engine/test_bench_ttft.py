"""The time-to-first-token benchmark runs on the CPU and reports one JSON line per model and length,
with transformers' figure on the same prompts, and the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mllmd.bench import ttft


def test_ttft_bench_lines_and_table(qwen3_tied: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ttft.jsonl"
    rows = ttft.main(["--model", f"tiny={qwen3_tied}", "--input-len", "8", "24", "--repeats", "2", "--warmup", "1",
                      "--baseline", "hf", "--device", "cpu", "--result-filename", str(out)])
    assert [(r["model"], r["input_len"]) for r in rows] == [("tiny", 8), ("tiny", 24)]
    for r in rows:
        assert len(r["ttft_ms_all"]) == 2 and r["ttft_ms"] > 0 and r["hf_ttft_ms"] > 0
        assert r["vs_hf"] == pytest.approx(r["hf_ttft_ms"] / r["ttft_ms"], rel=0.01)
        assert "floor_ms" not in r  # no device figures on the CPU
        assert 0 < r["host_us"] <= max(r["ttft_ms_all"]) * 1e3 and r["host_cpu_us"] > 0
    assert [json.loads(line)["input_len"] for line in out.read_text().splitlines()] == [8, 24]
    printed = capsys.readouterr().out
    assert "| tiny | " in printed and "8 tokens" in printed


def test_model_labels() -> None:
    assert ttft.parse_model("w4a16=/m/q") == ("w4a16", "/m/q")
    assert ttft.parse_model("/models/Qwen3-8B/") == ("Qwen3-8B", "/models/Qwen3-8B/")


def test_host_time_leaves_out_the_waits_for_the_device(qwen3_tied: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every PendingFetch.wait inside generate is charged to the device, not the host: with each wait
    made 50 ms longer, the wall time grows by that and the host time does not take it."""
    import time

    from mllmd import LLM
    from mllmd.engine import device_io

    llm = LLM(str(qwen3_tied), device="cpu")
    real, calls = device_io.PendingFetch.wait, []

    def slow(fetch: device_io.PendingFetch) -> list:
        calls.append(1)
        time.sleep(0.05)
        return real(fetch)

    monkeypatch.setattr(device_io.PendingFetch, "wait", slow)
    t = ttft.time_first_token(llm, list(range(100, 120)))
    assert calls, "the engine fetched no result through PendingFetch"
    assert t.seconds >= 0.05 * len(calls) and 0 <= t.host_seconds <= t.seconds - 0.05 * len(calls)
    assert device_io.PendingFetch.wait is slow  # the timer put the patched method back


def test_compare_eager_adds_the_named_models_without_prefill_graphs(qwen3_tied: Path) -> None:
    rows = ttft.main(["--model", f"a={qwen3_tied}", "--model", f"b={qwen3_tied}", "--compare-eager", "a",
                      "--input-len", "8", "--repeats", "1", "--warmup", "0", "--device", "cpu"])
    assert [r["model"] for r in rows] == ["a", "a-eager", "b"]
    assert all(r["prefill_graphs"] == 0 for r in rows)  # none on the CPU; -eager has them off everywhere
