"""`mllmd.daemon.metrics.Metrics`: its /metrics text parsed back with prometheus-client's parser."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from mllmd.daemon.metrics import (
    E2E_BUCKETS,
    ITL_BUCKETS,
    LOAD_BUCKETS,
    QUEUE_BUCKETS,
    TTFT_BUCKETS,
    Metrics,
    RequestTimeline,
)
from mllmd.messages import EngineStats, KVUsage, TextOutput
from mllmd.telemetry.collector import TelemetrySnapshot

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = {"model_name": "qwen3-0.6b"}

SERVING = {
    "mllmd_requests_running": "gauge",
    "mllmd_requests_waiting": "gauge",
    "mllmd_kv_cache_usage_ratio": "gauge",
    "mllmd_model_info": "gauge",
    "mllmd_up": "gauge",
    "mllmd_prompt_tokens": "counter",
    "mllmd_generation_tokens": "counter",
    "mllmd_request_success": "counter",
    "mllmd_request_failure": "counter",
    "mllmd_prefix_cache_queries": "counter",
    "mllmd_prefix_cache_hits": "counter",
    "mllmd_preemptions": "counter",
    "mllmd_worker_restarts": "counter",
    "mllmd_time_to_first_token_seconds": "histogram",
    "mllmd_inter_token_latency_seconds": "histogram",
    "mllmd_e2e_request_latency_seconds": "histogram",
    "mllmd_request_prompt_tokens": "histogram",
    "mllmd_request_generation_tokens": "histogram",
    "mllmd_request_queue_time_seconds": "histogram",
    "mllmd_model_load_seconds": "histogram",
    "mllmd_first_token_hop_seconds": "histogram",
}


def parse(metrics: Metrics) -> dict[str, Any]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in parse(metrics).values()
        for s in f.samples
    }


def get(metrics: Metrics, name: str, default: float | None = None, **labels: str) -> float:
    value = samples(metrics).get((name, tuple(sorted(labels.items()))), default)
    if value is None:
        raise KeyError((name, labels))
    return value


def loaded() -> Metrics:
    m = Metrics(workers=("tokenizer", "scheduler", "detokenizer"))
    m.set_model("qwen3-0.6b", "Qwen3ForCausalLM", "bfloat16", None)
    m.set_up(True)
    return m


def stats(running: int = 0, waiting: int = 0, preemptions: int = 0, **kv: int) -> EngineStats:
    usage = KVUsage(**{"total": 1000, "free": 1000, "cached": 0, "evictable": 0, **kv})
    return EngineStats(running, waiting, usage, 0, 0, 0, preemptions)


def output(rid: str = "r", completion_tokens: int = 0, finished: bool = False, finish_reason: str | None = None,
           prompt_tokens: int = 0, cached_tokens: int = 0) -> TextOutput:
    return TextOutput(rid, "", [], finished, finish_reason, None, None, prompt_tokens, completion_tokens, cached_tokens)


def test_every_serving_name_and_type() -> None:
    m = loaded()
    m.observe_engine_stats(stats(running=1, preemptions=1))
    m.on_request_finished("stop", 10, 4, 2, 0.0, 0.1, 0.5, [0.1, 0.2, 0.3, 0.4])
    m.observe_queue_time(0.01)
    m.observe_model_load(3.0)
    m.on_worker_restart("scheduler")
    families = parse(m)
    for name, kind in SERVING.items():
        assert families[name].type == kind, name
    assert all(name.startswith("mllmd_") for name in families)
    for name in ("mllmd_requests_running", "mllmd_kv_cache_usage_ratio", "mllmd_prompt_tokens",
                 "mllmd_time_to_first_token_seconds", "mllmd_model_load_seconds"):
        assert all(s.labels.get("model_name") == "qwen3-0.6b" for s in families[name].samples), name
    assert {s.labels["worker"] for s in families["mllmd_worker_restarts"].samples} == {"tokenizer", "scheduler", "detokenizer"}


def test_own_registry_not_the_global_one() -> None:
    a, b = Metrics(), Metrics()  # two instances do not collide on names
    a.set_up(True)
    assert get(a, "mllmd_up") == 1.0 and get(b, "mllmd_up") == 0.0
    assert REGISTRY.get_sample_value("mllmd_up") is None


def test_model_info_and_up() -> None:
    m = Metrics()
    assert get(m, "mllmd_up") == 0.0
    assert "mllmd_model_info" not in samples_names(m)
    m.set_model("a", "Qwen3ForCausalLM", "bfloat16", "w8a8")
    assert get(m, "mllmd_model_info", model_name="a", architecture="Qwen3ForCausalLM", dtype="bfloat16",
               quantization="w8a8") == 1.0
    m.set_up(True)
    assert get(m, "mllmd_up") == 1.0
    m.observe_engine_stats(stats(running=2))
    m.set_model("b", "Qwen3ForCausalLM", "float16", None)  # swap: only the new model's info remains
    info = [s for s in parse(m)["mllmd_model_info"].samples]
    assert [s.labels["model_name"] for s in info] == ["b"] and info[0].labels["quantization"] == "none"
    assert "mllmd_requests_running" not in samples_names(m)  # the old model's gauges are gone
    m.clear_model()
    m.set_up(False)
    assert "mllmd_model_info" not in samples_names(m)
    assert get(m, "mllmd_up") == 0.0


def samples_names(m: Metrics) -> set[str]:
    return {name for name, _ in samples(m)}


def test_engine_stats_gauges() -> None:
    m = loaded()
    m.observe_engine_stats(stats(running=3, waiting=2, free=600, cached=300, evictable=100))
    assert get(m, "mllmd_requests_running", **MODEL) == 3
    assert get(m, "mllmd_requests_waiting", **MODEL) == 2
    assert get(m, "mllmd_kv_cache_usage_ratio", **MODEL) == pytest.approx(0.3)  # (1000 - 600 - 100) / 1000
    m.observe_engine_stats(stats(running=4, total=0, free=0))  # no KV total (yet): the ratio stays
    assert get(m, "mllmd_requests_running", **MODEL) == 4
    assert get(m, "mllmd_kv_cache_usage_ratio", **MODEL) == pytest.approx(0.3)


def test_engine_stats_without_model_are_ignored() -> None:
    m = Metrics()
    m.observe_engine_stats(stats(running=3, preemptions=5))
    names = samples_names(m)
    assert "mllmd_requests_running" not in names and "mllmd_preemptions_total" not in names


def test_cumulative_counters_grow_and_survive_a_reset() -> None:
    m = loaded()
    m.observe_engine_stats(stats(preemptions=3))
    assert get(m, "mllmd_preemptions_total", **MODEL) == 3
    m.observe_engine_stats(stats(preemptions=5))
    m.observe_engine_stats(stats(preemptions=5))
    assert get(m, "mllmd_preemptions_total", **MODEL) == 5
    m.observe_engine_stats(stats(preemptions=2))  # worker restarted: 2 new preemptions since
    assert get(m, "mllmd_preemptions_total", **MODEL) == 7
    m.observe_engine_stats(stats(preemptions=4))
    assert get(m, "mllmd_preemptions_total", **MODEL) == 9
    m.observe_engine_stats(stats(preemptions=0))
    m.observe_engine_stats(stats(preemptions=1))
    assert get(m, "mllmd_preemptions_total", **MODEL) == 10


def test_counters_move_as_requests_complete() -> None:
    m = loaded()
    m.on_request_finished("stop", 100, 20, 64, 0.0, 0.5, 2.0, None)
    m.on_request_finished("length", 50, 16, 0, 0.0, 0.2, 1.0, None)
    m.on_request_finished("abort", 30, 0, 0, 0.0, None, 0.1, None)
    assert get(m, "mllmd_prompt_tokens_total", **MODEL) == 180
    assert get(m, "mllmd_generation_tokens_total", **MODEL) == 36
    assert get(m, "mllmd_prefix_cache_queries_total", **MODEL) == 180
    assert get(m, "mllmd_prefix_cache_hits_total", **MODEL) == 64
    for reason in ("stop", "length", "abort"):
        assert get(m, "mllmd_request_success_total", finished_reason=reason, **MODEL) == 1
    assert get(m, "mllmd_time_to_first_token_seconds_count", **MODEL) == 2  # the abort had no first token
    assert get(m, "mllmd_e2e_request_latency_seconds_count", **MODEL) == 3


def test_histograms_count_observations() -> None:
    m = loaded()
    m.on_request_finished("stop", 8, 4, 0, 0.0, 0.125, 1.0, [0.125, 0.25, 0.375, 1.0])
    assert get(m, "mllmd_time_to_first_token_seconds_bucket", le="0.15", **MODEL) == 1
    assert get(m, "mllmd_time_to_first_token_seconds_bucket", le="0.1", **MODEL) == 0
    assert get(m, "mllmd_time_to_first_token_seconds_sum", **MODEL) == pytest.approx(0.125)
    assert get(m, "mllmd_inter_token_latency_seconds_count", **MODEL) == 3
    assert get(m, "mllmd_inter_token_latency_seconds_bucket", le="0.15", **MODEL) == 2
    assert get(m, "mllmd_inter_token_latency_seconds_bucket", le="0.1", **MODEL) == 0
    assert get(m, "mllmd_inter_token_latency_seconds_sum", **MODEL) == pytest.approx(0.875)
    assert get(m, "mllmd_e2e_request_latency_seconds_bucket", le="1.0", **MODEL) == 1
    for seconds in (0.002, 0.02, 0.3):
        m.observe_queue_time(seconds)
    m.observe_queue_time(-1.0)  # nonsense: ignored
    assert get(m, "mllmd_request_queue_time_seconds_count", **MODEL) == 3
    assert get(m, "mllmd_request_queue_time_seconds_bucket", le="0.025", **MODEL) == 2
    m.observe_model_load(42.0)
    m.observe_model_load(7.0, model_name="other")
    assert get(m, "mllmd_model_load_seconds_count", **MODEL) == 1
    assert get(m, "mllmd_model_load_seconds_bucket", le="60.0", **MODEL) == 1
    assert get(m, "mllmd_model_load_seconds_count", model_name="other") == 1


def test_bucket_edges_suit_edge_devices() -> None:
    for buckets in (TTFT_BUCKETS, ITL_BUCKETS, E2E_BUCKETS, QUEUE_BUCKETS, LOAD_BUCKETS):
        assert list(buckets) == sorted(set(buckets))
    assert TTFT_BUCKETS[0] <= 0.005 and TTFT_BUCKETS[-1] >= 300
    assert ITL_BUCKETS[0] <= 0.005 and ITL_BUCKETS[-1] >= 5
    assert E2E_BUCKETS[-1] >= 1800
    assert QUEUE_BUCKETS[0] <= 0.001 and QUEUE_BUCKETS[-1] >= 300
    assert LOAD_BUCKETS[-1] >= 1800


def test_worker_restarts() -> None:
    m = Metrics(workers=("scheduler",))
    assert get(m, "mllmd_worker_restarts_total", worker="scheduler") == 0
    m.on_worker_restart("scheduler")
    m.on_worker_restart("scheduler")
    m.on_worker_restart("tokenizer")
    assert get(m, "mllmd_worker_restarts_total", worker="scheduler") == 2
    assert get(m, "mllmd_worker_restarts_total", worker="tokenizer") == 1


def test_timeline_spreads_batched_deliveries() -> None:
    tl = RequestTimeline(arrival=0.0)
    tl.add(output(prompt_tokens=9, cached_tokens=4, completion_tokens=1), 0.5)
    tl.add(output(prompt_tokens=9, cached_tokens=4, completion_tokens=1), 0.55)  # text only, no new token
    tl.add(output(prompt_tokens=9, cached_tokens=4, completion_tokens=3), 0.7)
    tl.add(output(prompt_tokens=9, cached_tokens=4, completion_tokens=4), 0.8)
    assert tl.first_token == 0.5
    assert tl.token_times == pytest.approx([0.5, 0.6, 0.7, 0.8])
    assert (tl.prompt_tokens, tl.cached_tokens, tl.completion_tokens) == (9, 4, 4)


def test_on_output_observes_finished_requests() -> None:
    m = loaded()
    base = {"rid": "r1", "prompt_tokens": 12, "cached_tokens": 8}
    m.on_output("r1", output(**base, completion_tokens=1), arrival=100.0, now=100.3)
    m.on_output("r1", output(**base, completion_tokens=2), arrival=100.0, now=100.35)
    # present from the start (at 0), counted once the request has finished
    assert get(m, "mllmd_request_success_total", finished_reason="length", **MODEL) == 0
    m.on_output("r1", output(**base, completion_tokens=3, finished=True, finish_reason="length"),
                arrival=100.0, now=100.4)
    assert get(m, "mllmd_request_success_total", finished_reason="length", **MODEL) == 1
    assert get(m, "mllmd_generation_tokens_total", **MODEL) == 3
    assert get(m, "mllmd_prefix_cache_hits_total", **MODEL) == 8
    assert get(m, "mllmd_time_to_first_token_seconds_sum", **MODEL) == pytest.approx(0.3)
    assert get(m, "mllmd_inter_token_latency_seconds_count", **MODEL) == 2
    assert get(m, "mllmd_e2e_request_latency_seconds_sum", **MODEL) == pytest.approx(0.4)
    assert get(m, "mllmd_request_prompt_tokens_sum", **MODEL) == 12
    assert get(m, "mllmd_request_generation_tokens_bucket", le="5.0", **MODEL) == 1
    assert get(m, "mllmd_request_generation_tokens_bucket", le="2.0", **MODEL) == 0
    m.on_output("r2", output("r2", completion_tokens=1), arrival=0.0, now=1.0)
    m.forget("r2")
    assert not m._timelines


def test_requests_of_a_model_being_swapped_out_count_under_its_own_name() -> None:
    """During a hot swap the old model finishes its requests while the new one is loaded: they are the
    old model's, not the new one's."""
    m = loaded()
    m.set_model("new-model", "Qwen3ForCausalLM", "bfloat16", None)
    m.on_output("r1", output("r1", completion_tokens=1, prompt_tokens=5, finished=True, finish_reason="stop"),
                arrival=0.0, now=1.0, model_name="qwen3-0.6b")
    m.on_request_failed("aborted", 2, model_name="qwen3-0.6b")
    assert get(m, "mllmd_request_success_total", finished_reason="stop", **MODEL) == 1
    assert get(m, "mllmd_prompt_tokens_total", **MODEL) == 5
    assert get(m, "mllmd_request_failure_total", reason="aborted", **MODEL) == 2
    new = {"model_name": "new-model"}
    assert get(m, "mllmd_request_success_total", finished_reason="stop", **new) == 0
    assert get(m, "mllmd_request_failure_total", reason="aborted", **new) == 0
    m.on_request_failed("rejected")  # no name: the loaded model
    assert get(m, "mllmd_request_failure_total", reason="rejected", **new) == 1


def test_telemetry_absent_means_omitted() -> None:
    m = loaded()
    names = samples_names(m)
    assert not any(n.startswith(("mllmd_memory", "mllmd_cpu", "mllmd_gpu", "mllmd_power", "mllmd_temperature")) for n in names)
    m.set_telemetry(TelemetrySnapshot(memory_used_bytes=10, memory_total_bytes=20, cpu_online={0: True, 1: False},
                                      cpu_utilization={0: 0.25}, temperatures_c={"cpu": 40.5}))
    s = samples(m)
    assert s[("mllmd_memory_used_bytes", ())] == 10
    assert s[("mllmd_cpu_online", (("core", "1"),))] == 0.0
    assert s[("mllmd_cpu_utilization_ratio", (("core", "0"),))] == 0.25
    assert ("mllmd_cpu_utilization_ratio", (("core", "1"),)) not in s
    assert s[("mllmd_temperature_celsius", (("sensor", "cpu"),))] == 40.5
    names = samples_names(m)
    for absent in ("mllmd_swap_used_bytes", "mllmd_gpu_utilization_ratio", "mllmd_gpu_frequency_hertz",
                   "mllmd_emc_utilization_ratio", "mllmd_emc_frequency_hertz", "mllmd_power_watts",
                   "mllmd_power_average_watts", "mllmd_cpu_frequency_hertz"):
        assert absent not in names
    m.set_telemetry(TelemetrySnapshot(gpu_utilization=0.0, gpu_frequency_hz={0: 0, 2: 305_000_000},
                                      power_watts={"VDD_IN": 5.0}, power_average_watts={"VDD_IN": 4.5}))
    s = samples(m)
    assert s[("mllmd_gpu_utilization_ratio", ())] == 0.0  # a real zero reading is reported
    assert s[("mllmd_gpu_frequency_hertz", (("gpc", "2"),))] == 305_000_000
    assert s[("mllmd_power_average_watts", (("rail", "VDD_IN"),))] == 4.5
    assert "mllmd_memory_used_bytes" not in samples_names(m)
    m.set_telemetry(None)
    assert "mllmd_gpu_utilization_ratio" not in samples_names(m)


def test_main_process_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import mllmd.daemon.metrics, mllmd.telemetry.collector, mllmd.telemetry.procfs\n"
        "import mllmd.telemetry.nvml, mllmd.telemetry.tegrastats_source\n"
        "from mllmd.telemetry.collector import TelemetryCollector\n"
        "from mllmd.daemon.metrics import Metrics\n"
        "m = Metrics(); c = TelemetryCollector({'interval': 0.05, 'tegrastats_path': ''},"
        " on_snapshot=m.set_telemetry); c.start(); c.stop(); m.render()\n"
        "bad = sorted(k for k in sys.modules if k == 'torch' or k.startswith('torch.'))\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_series_exist_from_the_start_and_timings_are_observed() -> None:
    from mllmd.messages import RequestTiming

    m = loaded()
    for name in ("mllmd_preemptions_total", "mllmd_prompt_tokens_total", "mllmd_generation_tokens_total",
                 "mllmd_prefix_cache_queries_total", "mllmd_prefix_cache_hits_total"):
        assert get(m, name, **MODEL) == 0, name
    assert get(m, "mllmd_request_success_total", finished_reason="stop", **MODEL) == 0
    assert get(m, "mllmd_request_queue_time_seconds_count", **MODEL) == 0
    m.observe_timings([RequestTiming(0.25, 0.5, 2.0), RequestTiming(-1.0, 0.1, 0.2)])
    assert get(m, "mllmd_request_queue_time_seconds_count", **MODEL) == 1  # a negative time is skipped
    assert get(m, "mllmd_request_queue_time_seconds_sum", **MODEL) == pytest.approx(0.25)
    assert get(m, "mllmd_request_prefill_time_seconds_sum", **MODEL) == pytest.approx(0.6)
    assert get(m, "mllmd_request_decode_time_seconds_count", **MODEL) == 2


def test_first_token_hops_from_the_processes_stamps() -> None:
    """Each hop is the time between two stamps; a token prompt (no tokenizer hop) charges main -> the
    scheduler to to_scheduler; the hops add up to submission -> main's receipt."""
    from mllmd.daemon.metrics import FIRST_TOKEN_HOPS, first_token_hops
    from mllmd.messages import FirstTokenTimes

    t = FirstTokenTimes(10.0, 10.002, 10.003, 10.010, 10.050, 10.051)
    hops = first_token_hops(t, 10.0515)
    assert list(hops) == list(FIRST_TOKEN_HOPS[1:-1])  # not http_in and to_client, which main times itself
    want = {"tokenize": 0.002, "to_scheduler": 0.001, "queue": 0.007, "prefill": 0.040, "detokenize": 0.001,
            "to_main": 0.0005}
    assert hops == pytest.approx(want)
    assert sum(hops.values()) == pytest.approx(0.0515)
    direct = first_token_hops(FirstTokenTimes(10.0, None, 10.001, 10.002, 10.005, 10.006), 10.007)
    assert "tokenize" not in direct and direct["to_scheduler"] == pytest.approx(0.001)


def test_first_output_with_stamps_observes_every_hop() -> None:
    import time

    from mllmd.daemon.metrics import FIRST_TOKEN_HOPS
    from mllmd.messages import FirstTokenTimes

    m = loaded()
    for hop in FIRST_TOKEN_HOPS:  # there from the start, empty
        assert get(m, "mllmd_first_token_hop_seconds_count", hop=hop, **MODEL) == 0
    now = time.perf_counter()
    first = TextOutput("r", "", [1], False, None, None, None, 3, 1, 0,
                       first_times=FirstTokenTimes(now - 0.5, now - 0.4, now - 0.3, now - 0.2, now - 0.1, now - 0.05))
    m.on_hop("http_in", 0.002)  # at hand-over, before any output
    m.on_hop("http_in", -1.0)  # a clock step back is not a hop
    m.on_hop("to_client", 0.0003)  # a stream's first event sent
    m.on_output("r", first, arrival=0.0, now=1.0)
    m.on_output("r", output("r", completion_tokens=2), arrival=0.0, now=1.1)  # later outputs carry none
    assert get(m, "mllmd_first_token_hop_seconds_sum", hop="http_in", **MODEL) == pytest.approx(0.002)
    for hop in FIRST_TOKEN_HOPS:
        assert get(m, "mllmd_first_token_hop_seconds_count", hop=hop, **MODEL) == 1, hop
    assert get(m, "mllmd_first_token_hop_seconds_sum", hop="prefill", **MODEL) == pytest.approx(0.1)
    assert get(m, "mllmd_first_token_hop_seconds_sum", hop="to_main", **MODEL) >= 0.05
