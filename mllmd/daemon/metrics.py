"""Prometheus metrics of the daemon (``/metrics``): serving metrics plus device telemetry.

:class:`Metrics` owns its own ``CollectorRegistry`` (never the process-global one) and renders the
prometheus-client text format. Names are ``mllmd_*`` in base units; serving metrics carry the label
``model_name``.

Serving metrics
    gauges (from the scheduler's stats) ``mllmd_requests_running``, ``mllmd_requests_waiting``,
    ``mllmd_kv_cache_usage_ratio``, and for hybrid models ``mllmd_state_cache_usage_ratio`` (recurrent-
    state slots held by requests) and ``mllmd_state_cache_snapshots``; ``mllmd_model_info{model_name,architecture,dtype,quantization}``
    (1 for the loaded model only), ``mllmd_up`` (1 when ready); counters
    ``mllmd_prompt_tokens_total``, ``mllmd_generation_tokens_total`` (per finished request, from its
    usage, as SGLang counts them), ``mllmd_request_success_total{finished_reason}``,
    ``mllmd_request_failure_total{reason}`` (requests that ended without a finish reason: ``aborted``, the
    client left or an administrator aborted it; ``rejected``, a worker refused it as invalid, e.g. a
    prompt over the context; ``error``, a worker failed or was lost),
    ``mllmd_prefix_cache_queries_total`` / ``mllmd_prefix_cache_hits_total`` (prompt tokens looked
    up / found in the prefix cache), ``mllmd_preemptions_total`` (from the scheduler's cumulative
    count), ``mllmd_worker_restarts_total{worker}`` (no model label).

KV usage is ``(total - free - evictable) / total``: slots held by requests (or by cache entries
they lock), the way vLLM counts it; unlocked prefix-cache entries are free for the taking.

Histogram buckets (seconds), for edge devices where prefill of a long prompt can take minutes and a
decode step 10-200 ms:

- ``mllmd_time_to_first_token_seconds``: 5 ms .. 5 min (``TTFT_BUCKETS``)
- ``mllmd_inter_token_latency_seconds``: 2.5 ms .. 10 s (``ITL_BUCKETS``)
- ``mllmd_e2e_request_latency_seconds``: 50 ms .. 1 h (``E2E_BUCKETS``)
- ``mllmd_request_queue_time_seconds``: 1 ms .. 10 min (``QUEUE_BUCKETS``), arrival in the scheduler
  worker to the step that first scheduled the request
- ``mllmd_request_prefill_time_seconds``: that step to the first output token (``TTFT_BUCKETS``)
- ``mllmd_request_decode_time_seconds``: first token to finish (``E2E_BUCKETS``)
- ``mllmd_model_load_seconds``: 0.5 s .. 1 h (``LOAD_BUCKETS``)
- ``mllmd_request_prompt_tokens`` / ``mllmd_request_generation_tokens``: tokens of each finished
  request's prompt / output, 1 .. 200,000 (``TOKEN_BUCKETS``)
- ``mllmd_first_token_hop_seconds{hop}``: 0.1 ms .. 5 min (``HOP_BUCKETS``), a new request's way to
  its first token in ``FIRST_TOKEN_HOPS`` (from the processes' stamps, ``FirstTokenTimes``)

The three phase histograms come from the scheduler worker (``EngineStats.timings``, per finished
request). Every serving metric labelled by model is present from the moment a model is set: its
counters at 0 (``mllmd_request_success_total`` for the reasons ``stop`` and ``length``,
``mllmd_request_failure_total`` for its three reasons), its
histograms empty, so that rate() and absent() queries work before the first request.

Counters and histograms carry no ``_created`` series (the text format would print each as a gauge
family of its own).

Device telemetry comes from the newest :class:`~mllmd.telemetry.collector.TelemetrySnapshot` given
to :meth:`Metrics.set_telemetry`, through a custom collector that yields only what the snapshot
has: a reading whose source is absent has no sample at all (never 0).

This module runs in the daemon's main process: no torch.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mllmd.messages import EngineStats, FirstTokenTimes, KVUsage, RequestTiming, TextOutput

if TYPE_CHECKING:
    from mllmd.telemetry.collector import TelemetrySnapshot

__all__ = [
    "E2E_BUCKETS",
    "ITL_BUCKETS",
    "LOAD_BUCKETS",
    "QUEUE_BUCKETS",
    "TTFT_BUCKETS",
    "Metrics",
    "RequestTimeline",
]

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS = (0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
               0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0,
               1800.0, 3600.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                 300.0, 600.0)
# tokens of one request's prompt / output (vLLM's 1-2-5 series up to the longest context mllmd serves)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)
LOAD_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 180.0, 300.0, 600.0, 900.0, 1800.0, 3600.0)
HOP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
               5.0, 10.0, 30.0, 60.0, 300.0)
# A new request's way to its first token, in order: the HTTP request in main (from the app receiving
# it, its body read, parsed and validated, to its hand-over; `Metrics.on_hop`), then
# (FirstTokenTimes) main -> tokenizer worker (tokenization and the chat template included), ->
# scheduler worker, waiting for admission, the admitting step to the step that gave the first
# token, -> detokenizer (its text), -> main; then, for a stream, main to its first SSE event handed to
# the server (`to_client`).
FIRST_TOKEN_HOPS = ("http_in", "tokenize", "to_scheduler", "queue", "prefill", "detokenize", "to_main", "to_client")


def first_token_hops(times: FirstTokenTimes, received: float) -> dict[str, float]:
    """Seconds of each hop (FIRST_TOKEN_HOPS) of a first output that main received at `received` (the
    same clock); a hop with no reading (no tokenizer for a token prompt) is left out, and its time
    counts in the next hop."""
    points = [("tokenize", times.tokenized), ("to_scheduler", times.arrived), ("queue", times.admitted),
              ("prefill", times.first_token), ("detokenize", times.detokenized), ("to_main", received)]
    hops, last = {}, times.submitted
    for hop, at in points:
        if at is not None:
            hops[hop] = at - last
            last = at
    return hops

MODEL = ("model_name",)
# Cumulative scheduler counters (EngineStats field) -> counter attribute of Metrics.
ENGINE_COUNTERS = {"preemptions": "preemptions"}
MAX_TRACKED_REQUESTS = 16384
FINISH_REASONS = ("stop", "length")  # the mllmd_request_success_total series present from the start
FAILURE_REASONS = ("aborted", "rejected", "error")  # mllmd_request_failure_total's


@dataclass
class RequestTimeline:
    """Times (one clock, e.g. time.monotonic) and usage of one request, built from its output items.

    Items carry cumulative `completion_tokens`; a delivery that adds k tokens after the previous
    one spreads their times evenly over the gap, so inter-token latencies add up to decode time.
    """

    arrival: float
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, item: TextOutput, now: float) -> None:
        """Record one output item received at `now`."""
        self.prompt_tokens = item.prompt_tokens
        self.cached_tokens = item.cached_tokens
        total = item.completion_tokens
        new = total - self.completion_tokens
        if new <= 0:
            return
        if self.first_token is None:
            self.first_token = now
            self.token_times.extend([now] * new)
        else:
            prev = self.token_times[-1] if self.token_times else self.first_token
            self.token_times.extend(prev + (now - prev) * (i + 1) / new for i in range(new))
        self.completion_tokens = total


def _finite(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


class _TelemetryExport(Collector):
    """Yields the device gauges present in the newest snapshot, nothing else."""

    def __init__(self) -> None:
        self.snapshot: TelemetrySnapshot | None = None

    def describe(self) -> list[Metric]:
        return []  # names vary with the sources; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:
            return
        yield from _scalar("mllmd_memory_used_bytes", "Memory in use (MemTotal - MemAvailable, or tegrastats RAM used)", s.memory_used_bytes)
        yield from _scalar("mllmd_memory_total_bytes", "Total memory", s.memory_total_bytes)
        yield from _scalar("mllmd_swap_used_bytes", "Swap in use", s.swap_used_bytes)
        yield from _scalar("mllmd_swap_total_bytes", "Total swap", s.swap_total_bytes)
        yield from _labelled("mllmd_cpu_utilization_ratio", "CPU core busy fraction (0..1)", "core", s.cpu_utilization)
        yield from _labelled("mllmd_cpu_frequency_hertz", "CPU core clock", "core", s.cpu_frequency_hz)
        yield from _labelled("mllmd_cpu_online", "1 when the CPU core is online", "core",
                             {k: float(v) for k, v in s.cpu_online.items()})
        yield from _scalar("mllmd_gpu_utilization_ratio", "GPU busy fraction (0..1)", s.gpu_utilization)
        yield from _scalar("mllmd_gpu_memory_used_bytes", "GPU memory in use, all processes (NVML; a discrete GPU's own memory)",
                           s.gpu_memory_used_bytes)
        yield from _scalar("mllmd_gpu_memory_total_bytes", "GPU memory (NVML)", s.gpu_memory_total_bytes)
        yield from _labelled("mllmd_gpu_frequency_hertz", "GPU clock per GPC", "gpc", s.gpu_frequency_hz)
        yield from _scalar("mllmd_emc_utilization_ratio", "External memory controller busy fraction (0..1)", s.emc_utilization)
        yield from _scalar("mllmd_emc_frequency_hertz", "External memory controller clock", s.emc_frequency_hz)
        yield from _labelled("mllmd_temperature_celsius", "Temperature per sensor", "sensor", s.temperatures_c)
        yield from _labelled("mllmd_power_watts", "Power per rail (current)", "rail", s.power_watts)
        yield from _labelled("mllmd_power_average_watts", "Power per rail (running average)", "rail", s.power_average_watts)


class _WithoutCreated(Collector):
    """The registry's families minus their `_created` samples: the text format would print each as a
    gauge family of its own (`mllmd_prompt_tokens_created`), one more series per counter and histogram
    series that no query wants (vLLM turns them off too). Per registry, unlike prometheus-client's
    process-wide disable_created_metrics()."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if family.type in ("counter", "histogram", "summary", "gaugehistogram"):
                family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


def _scalar(name: str, doc: str, value: float | int | None) -> Iterator[Metric]:
    v = _finite(value) if value is not None else None
    if v is not None:
        yield GaugeMetricFamily(name, doc, value=v)


def _labelled(name: str, doc: str, label: str, values: Mapping[Any, float | int]) -> Iterator[Metric]:
    samples = [(str(k), f) for k, v in values.items() if (f := _finite(v)) is not None]
    if not samples:
        return
    family = GaugeMetricFamily(name, doc, labels=[label])
    for key, v in samples:
        family.add_metric([key], v)
    yield family


class Metrics:
    """The daemon's metrics; see the module docstring for names and meanings."""

    def __init__(self, workers: Sequence[str] = ()) -> None:
        """`workers`: names whose restart counters start at 0 (e.g. tokenizer, scheduler, detokenizer)."""
        self.registry = r = CollectorRegistry(auto_describe=False)
        self.requests_running = Gauge("mllmd_requests_running", "Requests running in the scheduler", MODEL, registry=r)
        self.requests_waiting = Gauge("mllmd_requests_waiting", "Requests waiting for the scheduler", MODEL, registry=r)
        self.kv_cache_usage = Gauge("mllmd_kv_cache_usage_ratio", "KV cache slots in use (0..1)", MODEL, registry=r)
        self.state_cache_usage = Gauge("mllmd_state_cache_usage_ratio",
                                       "Recurrent-state slots held by requests (0..1; hybrid models only)", MODEL, registry=r)
        self.state_snapshots = Gauge("mllmd_state_cache_snapshots",
                                     "Recurrent-state slots held as prefix-cache snapshots (hybrid models only)", MODEL, registry=r)
        self.model_info = Gauge("mllmd_model_info", "The loaded model (value 1)",
                                ("model_name", "architecture", "dtype", "quantization"), registry=r)
        self.up = Gauge("mllmd_up", "1 when the daemon is ready to serve", registry=r)
        self.prompt_tokens = Counter("mllmd_prompt_tokens_total", "Prompt tokens of finished requests", MODEL, registry=r)
        self.generation_tokens = Counter("mllmd_generation_tokens_total", "Generated tokens of finished requests", MODEL, registry=r)
        self.request_success = Counter("mllmd_request_success_total", "Finished requests by finish reason",
                                       ("model_name", "finished_reason"), registry=r)
        self.request_failure = Counter("mllmd_request_failure_total",
                                       "Requests that ended without a finish reason: aborted, rejected or error",
                                       (*MODEL, "reason"), registry=r)
        self.prefix_cache_queries = Counter("mllmd_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache", MODEL, registry=r)
        self.prefix_cache_hits = Counter("mllmd_prefix_cache_hits_total", "Prompt tokens found in the prefix cache", MODEL, registry=r)
        self.preemptions = Counter("mllmd_preemptions_total", "Requests preempted (recomputed) for lack of KV cache", MODEL, registry=r)
        self.worker_restarts = Counter("mllmd_worker_restarts_total", "Worker restarts", ("worker",), registry=r)
        self.ttft = Histogram("mllmd_time_to_first_token_seconds", "Time to first token", MODEL, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("mllmd_inter_token_latency_seconds", "Time between output tokens", MODEL, buckets=ITL_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram("mllmd_request_prompt_tokens", "Prompt tokens of each finished request",
                                               MODEL, buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("mllmd_request_generation_tokens",
                                                   "Generated tokens of each finished request", MODEL,
                                                   buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("mllmd_e2e_request_latency_seconds", "Request latency, arrival to finish", MODEL, buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("mllmd_request_queue_time_seconds", "Time waiting for the scheduler", MODEL, buckets=QUEUE_BUCKETS, registry=r)
        self.prefill_time = Histogram("mllmd_request_prefill_time_seconds", "Time from admission to the first token",
                                      MODEL, buckets=TTFT_BUCKETS, registry=r)
        self.decode_time = Histogram("mllmd_request_decode_time_seconds", "Time from the first token to finish",
                                     MODEL, buckets=E2E_BUCKETS, registry=r)
        self.first_token_hop = Histogram("mllmd_first_token_hop_seconds",
                                         "A new request's way to its first token, hop by hop (FIRST_TOKEN_HOPS)",
                                         ("model_name", "hop"), buckets=HOP_BUCKETS, registry=r)
        self.model_load = Histogram("mllmd_model_load_seconds", "Model load time, start to ready", MODEL, buckets=LOAD_BUCKETS, registry=r)
        self._telemetry = _TelemetryExport()
        r.register(self._telemetry)
        self._export = CollectorRegistry(auto_describe=False)
        self._export.register(_WithoutCreated(r))
        self.up.set(0)
        for worker in workers:
            self.worker_restarts.labels(worker)
        self.model_name: str | None = None
        self._engine_last: dict[str, int] = {}
        self._timelines: OrderedDict[str, RequestTimeline] = OrderedDict()
        self._lock = threading.Lock()

    # ---- model and state -----------------------------------------------------------------------
    def set_model(self, name: str, architecture: str | None, dtype: str | None, quantization: str | None) -> None:
        """The loaded model: `mllmd_model_info` for it alone; serving gauges start afresh."""
        with self._lock:
            self._clear_model_locked()
            self.model_name = name
            self.model_info.labels(name, architecture or "unknown", dtype or "unknown", quantization or "none").set(1)
            self._zero_series(name)

    def _zero_series(self, name: str) -> None:
        """Create the model's labelled series (counters at 0, empty histograms), so that they are there
        before the first request."""
        for metric in (self.prompt_tokens, self.generation_tokens, self.prefix_cache_queries, self.prefix_cache_hits,
                       self.preemptions, self.ttft, self.itl, self.e2e, self.queue_time, self.prefill_time,
                       self.decode_time, self.request_prompt_tokens, self.request_generation_tokens):
            metric.labels(name)
        for reason in FINISH_REASONS:
            self.request_success.labels(name, reason)
        for reason in FAILURE_REASONS:
            self.request_failure.labels(name, reason)
        for hop in FIRST_TOKEN_HOPS:
            self.first_token_hop.labels(name, hop)

    def clear_model(self) -> None:
        """No model: drop `mllmd_model_info` and the serving gauges (counters keep their totals)."""
        with self._lock:
            self._clear_model_locked()
            self.model_name = None

    def _clear_model_locked(self) -> None:
        self.model_info.clear()
        for gauge in (self.requests_running, self.requests_waiting, self.kv_cache_usage, self.state_cache_usage,
                      self.state_snapshots):
            gauge.clear()
        self._engine_last.clear()  # a new scheduler worker counts from zero

    def set_up(self, ready: bool) -> None:
        """`mllmd_up` = 1 while the daemon is ready."""
        self.up.set(1 if ready else 0)

    # ---- scheduler stats -----------------------------------------------------------------------
    def observe_engine_stats(self, stats: EngineStats) -> None:
        """The scheduler worker's periodic stats: gauges, and counter increments from cumulative counts.

        A cumulative count lower than the last one means the worker restarted and counts from zero
        again: its new value is all new work and becomes the new base (counters never go down).
        Ignored while no model is set.
        """
        with self._lock:
            name = self.model_name
            if name is None:
                return
            self.requests_running.labels(name).set(stats.running)
            self.requests_waiting.labels(name).set(stats.waiting)
            ratio = _kv_usage(stats.kv)
            if ratio is not None:
                self.kv_cache_usage.labels(name).set(ratio)
            st = stats.states
            if st is not None and st.total > 0:
                self.state_cache_usage.labels(name).set((st.total - st.free - st.snapshots) / st.total)
                self.state_snapshots.labels(name).set(st.snapshots)
            for key, attr in ENGINE_COUNTERS.items():
                value = getattr(stats, key)
                if value < 0:
                    continue
                last = self._engine_last.get(key, 0)
                delta = value - last if value >= last else value
                self._engine_last[key] = value
                if delta > 0:
                    getattr(self, attr).labels(name).inc(delta)

    # ---- requests ------------------------------------------------------------------------------
    def on_request_finished(
        self,
        finish_reason: str | None,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        arrival: float | None,
        first_token: float | None,
        finished: float | None,
        token_times: Sequence[float] | None = None,
        *,
        model_name: str | None = None,
    ) -> None:
        """One finished request: tokens, finish reason, prefix-cache lookups, TTFT, ITL and E2E.

        Times are seconds on one clock (e.g. time.monotonic); None skips what needs it. `token_times`
        holds the arrival of each output token (first included); ITL is their successive gaps.
        `model_name` defaults to the loaded model.
        """
        name = model_name or self.model_name or ""
        self.request_success.labels(name, finish_reason or "unknown").inc()
        self.prompt_tokens.labels(name).inc(max(prompt_tokens, 0))
        self.generation_tokens.labels(name).inc(max(completion_tokens, 0))
        self.prefix_cache_queries.labels(name).inc(max(prompt_tokens, 0))
        self.prefix_cache_hits.labels(name).inc(min(max(cached_tokens, 0), max(prompt_tokens, 0)))
        self.request_prompt_tokens.labels(name).observe(max(prompt_tokens, 0))
        self.request_generation_tokens.labels(name).observe(max(completion_tokens, 0))
        if arrival is not None and first_token is not None and first_token >= arrival:
            self.ttft.labels(name).observe(first_token - arrival)
        if arrival is not None and finished is not None and finished >= arrival:
            self.e2e.labels(name).observe(finished - arrival)
        if token_times:
            itl = self.itl.labels(name)
            for prev, cur in zip(token_times, token_times[1:]):
                if cur >= prev:
                    itl.observe(cur - prev)

    def on_request_failed(self, reason: str, count: int = 1, *, model_name: str | None = None) -> None:
        """`count` requests ended without a finish reason (one of FAILURE_REASONS)."""
        if count > 0:
            self.request_failure.labels(model_name or self.model_name or "", reason).inc(count)

    def on_hop(self, hop: str, seconds: float, *, model_name: str | None = None) -> None:
        """A hop main times itself: `http_in` (the HTTP app receiving a request to its hand-over to the
        workers) and `to_client` (a stream's first output in main to its first event sent)."""
        if seconds >= 0 and math.isfinite(seconds):
            self.first_token_hop.labels(model_name or self.model_name or "", hop).observe(seconds)

    def on_output(self, rid: str, item: TextOutput, arrival: float, now: float | None = None, *,
                  model_name: str | None = None) -> None:
        """Feed every output item of a request (from the detokenizer); on its finished item the
        request is observed with :meth:`on_request_finished`. `arrival` uses `now`'s clock
        (time.monotonic by default); `model_name`, that of the model serving it (default: the loaded
        one; during a swap the old model still finishes its requests)."""
        now = time.monotonic() if now is None else now
        if item.first_times is not None:
            name = model_name or self.model_name or ""
            for hop, seconds in first_token_hops(item.first_times, time.perf_counter()).items():
                if seconds >= 0 and math.isfinite(seconds):
                    self.first_token_hop.labels(name, hop).observe(seconds)
        with self._lock:
            tl = self._timelines.get(rid)
            if tl is None:
                tl = self._timelines[rid] = RequestTimeline(arrival)
                while len(self._timelines) > MAX_TRACKED_REQUESTS:
                    self._timelines.popitem(last=False)
            tl.add(item, now)
            if item.finished:
                del self._timelines[rid]
        if item.finished:
            self.on_request_finished(item.finish_reason or "stop", tl.prompt_tokens, tl.completion_tokens,
                                     tl.cached_tokens, tl.arrival, tl.first_token, now, tl.token_times,
                                     model_name=model_name)

    @property
    def num_tracked(self) -> int:
        """Requests whose timeline is kept (until their finished item, or forget)."""
        return len(self._timelines)

    def forget(self, rid: str) -> None:
        """Drop a request that ended without a finished item (error, worker lost, client abort)."""
        with self._lock:
            self._timelines.pop(rid, None)

    def observe_queue_time(self, seconds: float, model_name: str | None = None) -> None:
        """Time one request waited before the scheduler admitted it."""
        if seconds >= 0:
            self.queue_time.labels(model_name or self.model_name or "").observe(seconds)

    def observe_timings(self, timings: Sequence[RequestTiming], model_name: str | None = None) -> None:
        """Queue, prefill and decode time of requests the scheduler worker finished."""
        if not timings:
            return
        name = model_name or self.model_name or ""
        queue, prefill, decode = self.queue_time.labels(name), self.prefill_time.labels(name), self.decode_time.labels(name)
        for t in timings:
            for hist, value in ((queue, t.queue), (prefill, t.prefill), (decode, t.decode)):
                if value >= 0 and math.isfinite(value):
                    hist.observe(value)

    def on_worker_restart(self, worker: str) -> None:
        """A worker was restarted."""
        self.worker_restarts.labels(worker).inc()

    def observe_model_load(self, seconds: float, model_name: str | None = None) -> None:
        """A model finished loading after `seconds`."""
        if seconds >= 0:
            self.model_load.labels(model_name or self.model_name or "").observe(seconds)

    # ---- telemetry and output ------------------------------------------------------------------
    def set_telemetry(self, snapshot: TelemetrySnapshot | None) -> None:
        """The newest device snapshot (thread-safe: one reference swap); None removes the gauges."""
        self._telemetry.snapshot = snapshot

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text format, without `_created` series."""
        return generate_latest(self._export), CONTENT_TYPE_LATEST


def _kv_usage(kv: KVUsage) -> float | None:
    """(total - free - evictable) / total, clamped to 0..1; None without a usable total."""
    if kv.total <= 0:
        return None
    return min(max((kv.total - kv.free - kv.evictable) / kv.total, 0.0), 1.0)
