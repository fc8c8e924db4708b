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
    assert [json.loads(line)["input_len"] for line in out.read_text().splitlines()] == [8, 24]
    printed = capsys.readouterr().out
    assert "| tiny | " in printed and "8 tokens" in printed


def test_model_labels() -> None:
    assert ttft.parse_model("w4a16=/m/q") == ("w4a16", "/m/q")
    assert ttft.parse_model("/models/Qwen3-8B/") == ("Qwen3-8B", "/models/Qwen3-8B/")
