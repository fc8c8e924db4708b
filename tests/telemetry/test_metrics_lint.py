"""/metrics as Prometheus's own linter sees it: `promtool check metrics` where it is installed, and
always the pure-Python rules of mllmd.testing.promlint (promtool's, plus parse, duplicate series,
bucket order and no `_created` gauges), over every state the exporter can be in."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import tegrastats_lines
from prometheus_client import CollectorRegistry, Counter, generate_latest

from mllmd.daemon.metrics import Metrics
from mllmd.messages import EngineStats, KVUsage, RequestTiming, StateUsage
from mllmd.telemetry.collector import merge_snapshot
from mllmd.telemetry.procfs import ProcfsSample
from mllmd.telemetry.tegrastats import parse_line
from mllmd.testing.promlint import lint

TEGRA_LINES = sorted(
    n for n in dir(tegrastats_lines) if n.isupper() and isinstance(getattr(tegrastats_lines, n), str)
)


def busy() -> Metrics:
    """A loaded hybrid model after a few requests, a failure, a worker restart and a second load."""
    m = Metrics(workers=("tokenizer", "scheduler", "detokenizer"))
    m.set_model("qwen3.5-2b", "Qwen3_5ForConditionalGeneration", "bfloat16", "w4a16")
    m.set_up(True)
    m.observe_model_load(12.5)
    m.observe_engine_stats(
        EngineStats(
            3,
            1,
            KVUsage(1000, 400, 100, 50),
            10,
            20,
            5,
            2,
            StateUsage(8, 2, 3, 1 << 20),
            [RequestTiming(0.01, 0.2, 1.5)],
        )
    )
    m.on_request_finished("stop", 30, 12, 10, 0.0, 0.2, 1.7, [0.2 + i * 0.1 for i in range(12)])
    m.on_request_finished("length", 5, 4, 0, 0.0, 0.1, 0.5, [0.1, 0.2, 0.3, 0.4])
    m.on_request_failed("aborted")
    m.on_request_failed("rejected")
    m.on_worker_restart("scheduler")
    return m


def states() -> dict[str, Metrics]:
    idle = Metrics(workers=("tokenizer",))
    swapped = busy()
    swapped.set_model("qwen3-0.6b", "Qwen3ForCausalLM", "float32", None)
    out = {"idle": idle, "busy": busy(), "swapped": swapped}
    for name in TEGRA_LINES:
        sample = parse_line(getattr(tegrastats_lines, name))
        if sample is None:
            continue
        m = busy()
        m.set_telemetry(merge_snapshot(ProcfsSample(), None, sample))
        out[f"tegrastats {name}"] = m
    return out


@pytest.mark.parametrize("state", list(states()))
def test_pure_python_lint_is_clean(state: str) -> None:
    body, _ = states()[state].render()
    assert lint(body.decode()) == []


def test_no_created_series() -> None:
    """The text format printed `mllmd_*_created` gauges beside every counter and histogram series."""
    body = busy().render()[0].decode()
    assert "_created" not in body


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool not installed (apt install prometheus)"
)
@pytest.mark.parametrize("state", list(states()))
def test_promtool_check_metrics(state: str) -> None:
    body, _ = states()[state].render()
    done = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=60)
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), (
        done.stdout,
        done.stderr,
    )


def test_the_linter_finds_what_promtool_finds() -> None:
    """The rules bite: each of these texts has the problem named."""
    cases = {
        "# HELP x_requests Requests\n# TYPE x_requests counter\nx_requests 1\n": "'_total' suffix",
        "# TYPE x_up gauge\nx_up 1\n": "no help text",
        "# HELP x_lat_ms Latency\n# TYPE x_lat_ms gauge\nx_lat_ms 1\n": "abbreviated unit",
        "# HELP x_lat_milliseconds L\n# TYPE x_lat_milliseconds gauge\nx_lat_milliseconds 1\n": "base unit 'seconds'",
        "# HELP x_load_percent L\n# TYPE x_load_percent gauge\nx_load_percent 1\n": "base unit 'ratio'",
        "# HELP x_things_total T\n# TYPE x_things_total gauge\nx_things_total 1\n": "non-counter",
        '# HELP x_a A\n# TYPE x_a gauge\nx_a{k="1"} 1\nx_a{k="1"} 2\n': "duplicate series",
        "# HELP x_gauge_value V\n# TYPE x_gauge_value gauge\nx_gauge_value 1\n": "include the type",
    }
    for text, want in cases.items():
        assert any(want in p for p in lint(text)), (text, lint(text))
    registry = CollectorRegistry()
    Counter("x_events", "Events", registry=registry).inc()
    assert any("_created" in p for p in lint(generate_latest(registry).decode()))
