"""Online serving benchmark against any OpenAI-compatible server (mllmd, vLLM, SGLang, llama-server, Ollama).

python -m mllmd.bench.serving --base-url http://127.0.0.1:30000 --dataset random --num-prompts 200 \
    --random-input-len 1024 --random-output-len 128 --request-rate 8 --max-concurrency 32 \
    --result-filename results.jsonl

Requests stream over SSE (`/v1/completions` or `/v1/chat/completions`), so time to first token
(TTFT), time per output token (TPOT: (e2e - ttft) / (output_tokens - 1)), inter-token latency (ITL:
every gap between streamed chunks carrying tokens) and end-to-end latency are measured per request.
Requests arrive as a Poisson process at `--request-rate` (inf: all at once), at most
`--max-concurrency` in flight. `max_tokens` and `ignore_eos: true` control output lengths; output
token counts come from the usage chunk when the server sends one, else from counting chunks.
Failed requests are counted with their error text; they never stop the run. One JSON object per
run is printed and, with `--result-filename`, appended as one line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import resource
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

try:  # aiohttp, not httpx: with 64 streams in flight httpx's pool let new requests out ~15 ms apart
    import aiohttp
except ImportError:  # pragma: no cover - the `bench` extra
    aiohttp = None

from mllmd.bench.serving_datasets import (
    BenchRequest,
    WordPromptBuilder,
    make_prompt_builder,
    random_dataset,
    shared_prefix_dataset,
)

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
MAX_RECORDED_ERRORS = 100
MAX_ERROR_CHARS = 500
DRAIN_TIMEOUT = 5.0  # seconds to read what follows [DONE] (the end of the chunked body)


@dataclass
class RequestResult:
    """What one streamed request measured (times in seconds)."""

    success: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    chunks: int = 0
    usage: bool = False


def poisson_intervals(num: int, rate: float, rng: random.Random) -> list[float]:
    """`num` exponential gaps between arrivals of a Poisson process with `rate` per second (inf: zeros)."""
    if math.isinf(rate):
        return [0.0] * num
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {rate}")
    return [rng.expovariate(rate) for _ in range(num)]


def build_body(req: BenchRequest, endpoint: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """The JSON body of one streaming request."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if not args.no_ignore_eos:
        body["ignore_eos"] = True
    if endpoint == "chat":
        messages = []
        if req.system is not None:
            messages.append({"role": "system", "content": req.system})
        messages.append({"role": "user", "content": req.prompt})
        body["messages"] = messages
    else:
        body["prompt"] = req.prompt
    body.update(args.extra_body or {})
    return body


def _chunk_text(obj: dict[str, Any]) -> str:
    """Generated text carried by one streamed chunk (completions or chat, reasoning included)."""
    parts = []
    for choice in obj.get("choices") or []:
        if "text" in choice:
            parts.append(choice.get("text") or "")
        delta = choice.get("delta") or {}
        for key in ("content", "reasoning_content", "reasoning"):
            parts.append(delta.get(key) or "")
    return "".join(parts)


def _error_text(obj: Any) -> str:
    if isinstance(obj, dict) and "error" in obj:
        err = obj["error"]
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    return json.dumps(obj)[:MAX_ERROR_CHARS]


async def _sse_data(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, bytes]]:
    """(arrival time, payload) of each `data:` line of an SSE body, split here from the raw bytes as
    they arrive (no line-length limit); blank separators, comments and `event:` lines are skipped."""
    pending = b""
    async for chunk in resp.content.iter_any():
        now = time.perf_counter()
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            line = line.strip()
            if line.startswith(b"data:"):
                yield now, line[5:].strip()
    line = pending.strip()
    if line.startswith(b"data:"):
        yield time.perf_counter(), line[5:].strip()


async def _drain(events: AsyncIterator[Any]) -> None:
    async for _ in events:
        pass


async def send_request(client: BenchClient, path: str, body: dict[str, Any]) -> RequestResult:
    """Send one streaming request and time its chunks; any failure is recorded, never raised."""
    res = RequestResult(start=time.perf_counter())
    last = res.start
    first: float | None = None
    end: float | None = None
    try:
        async with client.session.post(client.url(path), json=body) as resp:
            if resp.status != 200:
                text = (await resp.read()).decode(errors="replace")
                try:
                    text = _error_text(json.loads(text))
                except ValueError:
                    pass
                res.error = f"HTTP {resp.status}: {text[:MAX_ERROR_CHARS]}"
                return res
            async with contextlib.aclosing(_sse_data(resp)) as events:
                async for now, data in events:
                    if data == b"[DONE]":
                        end = time.perf_counter()
                        # read to the end of the body, so the connection goes back to the pool: leaving
                        # it unread closes it, and every request would pay for a new connection
                        with contextlib.suppress(Exception):
                            await asyncio.wait_for(_drain(events), DRAIN_TIMEOUT)
                        break
                    obj = json.loads(data)
                    if not isinstance(obj, dict) or obj.get("error"):
                        res.error = f"stream error: {_error_text(obj)[:MAX_ERROR_CHARS]}"
                        return res
                    usage = obj.get("usage")
                    if usage:
                        res.usage = True
                        res.output_tokens = int(usage.get("completion_tokens") or 0)
                        res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    if _chunk_text(obj):
                        res.chunks += 1
                        if first is None:
                            first = now
                        else:
                            res.itl.append(now - last)
                        last = now
        if end is None:  # the body ended without [DONE]
            end = time.perf_counter()
    except Exception as e:  # a failed request is a data point, not a crash
        detail = str(e) or ("timed out" if isinstance(e, asyncio.TimeoutError) else "")
        res.error = f"{type(e).__name__}: {detail}"[:MAX_ERROR_CHARS]
        return res
    res.latency = end - res.start
    if not res.usage:
        res.output_tokens = res.chunks
    if first is None:
        if res.output_tokens == 0:
            res.error = "stream ended without output tokens"
            return res
        first = end  # tokens reported by usage but no text came back (e.g. all special tokens)
    res.ttft = first - res.start
    res.success = True
    return res


def _percentile(sorted_vals: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of an ascending list."""
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def summarize(name: str, values_s: list[float]) -> dict[str, float | None]:
    """mean/p50/p90/p99 in milliseconds of `values_s` (seconds); None when there are none."""
    keys = [f"mean_{name}_ms", f"p50_{name}_ms", f"p90_{name}_ms", f"p99_{name}_ms"]
    if not values_s:
        return dict.fromkeys(keys)
    ms = sorted(v * 1000.0 for v in values_s)
    stats = [sum(ms) / len(ms), _percentile(ms, 50), _percentile(ms, 90), _percentile(ms, 99)]
    return dict(zip(keys, stats))


def compute_metrics(
    requests: list[BenchRequest], results: list[RequestResult], duration: float
) -> dict[str, Any]:
    """Aggregate per-request results into the run's metrics."""
    ok = [(q, r) for q, r in zip(requests, results) if r.success]
    input_tokens = sum(r.prompt_tokens if r.usage and r.prompt_tokens else q.prompt_len for q, r in ok)
    output_tokens = sum(r.output_tokens for _, r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for _, r in ok if r.output_tokens > 1]
    errors = [{"index": i, "error": r.error} for i, r in enumerate(results) if not r.success]
    metrics: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(errors),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_throughput": output_tokens / duration if duration > 0 else None,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration > 0 else None,
        "usage_reported": sum(r.usage for _, r in ok),
    }
    metrics.update(summarize("ttft", [r.ttft for _, r in ok]))
    metrics.update(summarize("tpot", tpots))
    metrics.update(summarize("itl", [gap for _, r in ok for gap in r.itl]))
    metrics.update(summarize("e2e_latency", [r.latency for _, r in ok]))
    metrics["errors"] = errors[:MAX_RECORDED_ERRORS]
    return metrics


@dataclass
class BenchClient:
    """An aiohttp session and the server root that request paths are joined to."""

    session: Any  # aiohttp.ClientSession
    base_url: str

    def url(self, path: str) -> str:
        return self.base_url + path


@contextlib.asynccontextmanager
async def make_client(args: argparse.Namespace) -> AsyncIterator[BenchClient]:
    """A session for `--base-url` (over `--unix-socket` when given) with no connection cap."""
    if aiohttp is None:
        raise RuntimeError("mllmd.bench.serving needs aiohttp: pip install 'mllmd[bench]'")
    connector = (aiohttp.UnixConnector(path=args.unix_socket, limit=0) if args.unix_socket
                 else aiohttp.TCPConnector(limit=0))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.request_timeout, connect=min(args.request_timeout or 60.0, 60.0))
    async with aiohttp.ClientSession(connector=connector, headers=headers, timeout=timeout) as session:
        yield BenchClient(session, args.base_url.rstrip("/"))


async def discover_model(client: BenchClient) -> str:
    """The first model id that GET /v1/models lists."""
    try:
        async with client.session.get(client.url("/v1/models")) as resp:
            resp.raise_for_status()
            listing = await resp.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        raise RuntimeError(
            f"GET {client.url('/v1/models')} failed ({type(e).__name__}: {e}); is the server up? --model skips this"
        ) from e
    data = (listing.get("data") if isinstance(listing, dict) else None) or []
    if not data:
        raise RuntimeError("GET /v1/models lists no model; pass --model")
    return str(data[0]["id"])


HOP_METRIC = "mllmd_first_token_hop_seconds"


PREFIX_QUERIES, PREFIX_HITS = "mllmd_prefix_cache_queries_total", "mllmd_prefix_cache_hits_total"


@dataclass(frozen=True)
class ServerCounters:
    """mllmd's counters that a run reads before and after itself, from GET /metrics (every model summed)."""

    hops: dict[str, tuple[float, float]]  # first-token hop -> (count, sum in seconds)
    prefix_cache: tuple[float, float] | None  # prompt tokens (looked up, found in the prefix cache)


async def scrape_counters(client: BenchClient) -> ServerCounters | None:
    """The first-token hop histogram and the prefix-cache counters; None where the server has no
    such metrics (another server, or /metrics refused)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with client.session.get(client.url("/metrics")) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
        families = list(text_string_to_metric_families(text))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None
    hops: dict[str, list[float]] = {}
    prefix: list[float] | None = None
    for family in families:
        for sample in family.samples:
            if sample.name in (f"{HOP_METRIC}_count", f"{HOP_METRIC}_sum") and "hop" in sample.labels:
                slot = hops.setdefault(sample.labels["hop"], [0.0, 0.0])
                slot[0 if sample.name.endswith("_count") else 1] += sample.value
            elif sample.name in (PREFIX_QUERIES, PREFIX_HITS):
                prefix = prefix or [0.0, 0.0]
                prefix[0 if sample.name == PREFIX_QUERIES else 1] += sample.value
    if not hops and prefix is None:
        return None
    return ServerCounters({hop: (c, t) for hop, (c, t) in hops.items()}, (prefix[0], prefix[1]) if prefix else None)


def prefix_hit_rate(before: ServerCounters | None, after: ServerCounters | None) -> float | None:
    """The share of the run's prompt tokens that the server found in its prefix cache (a run that
    repeats an earlier run's prompts measures decode, not prefill: compare runs at equal rates)."""
    if before is None or after is None or after.prefix_cache is None:
        return None
    q0, h0 = before.prefix_cache or (0.0, 0.0)
    q1, h1 = after.prefix_cache
    return round((h1 - h0) / (q1 - q0), 4) if q1 > q0 else None


def hop_breakdown(before: dict[str, tuple[float, float]] | None,
                  after: dict[str, tuple[float, float]] | None) -> dict[str, float] | None:
    """Mean milliseconds of each first-token hop over the requests that reached their first token
    between the two scrapes (hops in the server's order)."""
    if not before or not after:
        return None
    out = {}
    for hop, (count, total) in after.items():
        c0, t0 = before.get(hop, (0.0, 0.0))
        if count > c0:
            out[hop] = round((total - t0) / (count - c0) * 1e3, 3)
    return out or None


def build_requests(args: argparse.Namespace) -> list[BenchRequest]:
    """The dataset that the CLI options describe."""
    if args.token_ids_prompt and args.endpoint != "completions":
        raise ValueError("--token-ids-prompt needs --endpoint completions (chat messages are text)")
    builder = make_prompt_builder(args.tokenizer, args.token_ids_prompt, args.vocab_size)
    if isinstance(builder, WordPromptBuilder):
        print(
            "note: no --tokenizer given; prompts are random words and input lengths are approximate "
            "(about one token per word)",
            file=sys.stderr,
        )
    if args.dataset == "random":
        return random_dataset(
            builder, args.num_prompts, args.random_input_len, args.random_output_len,
            args.random_range_ratio, args.seed,
        )  # fmt: skip
    return shared_prefix_dataset(
        builder, args.num_prompts, args.num_groups, args.prefix_len, args.suffix_len,
        args.random_output_len, args.random_range_ratio, args.seed, chat=args.endpoint == "chat",
    )  # fmt: skip


def settings(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """The run's settings as recorded in the result (never the API key)."""
    out = {
        k: v
        for k, v in vars(args).items()
        if k not in ("api_key", "result_filename", "extra_body", "request_rate")
    }
    out["model"] = model
    out["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    out["extra_body"] = args.extra_body
    out["api_key_set"] = bool(args.api_key)
    return out


async def run_benchmark(
    args: argparse.Namespace, requests: list[BenchRequest] | None = None
) -> dict[str, Any]:
    """Run one benchmark and return its result object."""
    if requests is None:
        requests = build_requests(args)
    path = ENDPOINT_PATHS[args.endpoint]
    async with make_client(args) as client:
        model = args.model or await discover_model(client)
        for i in range(min(args.warmup_requests, len(requests))):
            warm = await send_request(client, path, build_body(requests[i], args.endpoint, model, args))
            if not warm.success:
                print(f"warning: warm-up request failed: {warm.error}", file=sys.stderr)

        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def one(req: BenchRequest) -> RequestResult:
            body = build_body(req, args.endpoint, model, args)
            if sem is None:
                return await send_request(client, path, body)
            async with sem:
                return await send_request(client, path, body)

        gaps = poisson_intervals(len(requests), args.request_rate, random.Random(args.seed))
        counters_before = await scrape_counters(client)  # mllmd's first-token hops and prefix cache, around the run
        tasks: list[asyncio.Task[RequestResult]] = []
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        arrival = 0.0
        for req, gap in zip(requests, gaps):  # the first request goes at once, then Poisson gaps
            delay = start + arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
            arrival += gap
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        counters_after = await scrape_counters(client)
        hops = hop_breakdown(counters_before and counters_before.hops, counters_after and counters_after.hops)
        hit_rate = prefix_hit_rate(counters_before, counters_after)

    result: dict[str, Any] = {
        "benchmark": "serving",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model": model,
        "dataset": args.dataset,
        "num_prompts": len(requests),
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency,
    }
    result.update(compute_metrics(requests, results, duration))
    # the client's own CPU time over the run: near duration_s means the client, not the server, set the pace
    result["client_cpu_s"] = round(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 3)
    if hit_rate is not None:  # the prompt tokens the server did not prefill (earlier runs' prompts)
        result["prefix_cache_hit_rate"] = hit_rate
    if hops is not None:  # mean ms of each hop of a new request to its first token (an mllmd server)
        result["first_token_hops_ms"] = hops
    result["settings"] = settings(args, model)
    if getattr(args, "save_requests", None):
        save_request_timeline(args.save_requests, results)
    return result


def save_request_timeline(path: str, results: list[RequestResult]) -> None:
    """One JSON line per request: when it was sent (time.perf_counter(), the monotonic clock that
    the daemon's MLLMD_STEP_TRACE uses too, so the two line up), its TTFT and latency, tokens, error."""
    with open(path, "w", encoding="utf-8") as f:
        for i, r in enumerate(results):
            f.write(json.dumps({
                "index": i, "start": round(r.start, 6), "ttft_s": round(r.ttft, 6) if r.success else None,
                "latency_s": round(r.latency, 6) if r.success else None, "output_tokens": r.output_tokens,
                "error": r.error or None,
            }) + "\n")


def format_report(result: dict[str, Any]) -> str:
    """A short human-readable table of the result."""

    def fmt(v: Any) -> str:
        return "n/a" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)

    rows = [
        ("Endpoint", f"{result['base_url']} ({result['endpoint']})"),
        ("Model", result["model"]),
        ("Completed / failed", f"{result['completed']} / {result['failed']}"),
        ("Duration (s)", fmt(result["duration_s"])),
        ("Input / output tokens", f"{result['total_input_tokens']} / {result['total_output_tokens']}"),
        ("Request throughput (req/s)", fmt(result["request_throughput"])),
        ("Output throughput (tok/s)", fmt(result["output_throughput"])),
        ("Total token throughput (tok/s)", fmt(result["total_token_throughput"])),
    ]
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e_latency", "E2E")):
        stats = " / ".join(fmt(result[f"{s}_{name}_ms"]) for s in ("mean", "p50", "p90", "p99"))
        rows.append((f"{label} mean/p50/p90/p99 (ms)", stats))
    if result.get("prefix_cache_hit_rate") is not None:
        rows.append(("Prefix-cache hit rate (prompt tokens)", fmt(result["prefix_cache_hit_rate"])))
    if result.get("first_token_hops_ms"):
        rows.append(("First-token hops, mean (ms)", " / ".join(f"{hop} {ms:.2f}" for hop, ms in result["first_token_hops_ms"].items())))
    width = max(len(k) for k, _ in rows)
    lines = ["=" * 20 + " Serving Benchmark Result " + "=" * 20]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    for err in result["errors"][:5]:
        lines.append(f"error (request {err['index']}): {err['error']}")
    return "\n".join(lines)


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--extra-body must be a JSON object")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m mllmd.bench.serving",
        description="Online serving benchmark against an OpenAI-compatible server.",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="server root (without /v1)")
    p.add_argument("--unix-socket", default=None, help="connect over this Unix domain socket")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--model", default=None, help="default: the first id from GET /v1/models")
    p.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="completions")
    p.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128, help="max_tokens (both datasets)")
    p.add_argument(
        "--random-range-ratio", type=float, default=0.0,
        help="lengths uniform in [max(1, int(len * ratio)), len]; 1.0 gives fixed lengths",
    )  # fmt: skip
    p.add_argument("--num-groups", type=int, default=8, help="shared-prefix: number of distinct prefixes")
    p.add_argument("--prefix-len", type=int, default=2048, help="shared-prefix: prefix tokens")
    p.add_argument("--suffix-len", type=int, default=128, help="shared-prefix: per-request suffix tokens")
    p.add_argument("--tokenizer", default=None, help="local tokenizer folder for exact prompt lengths")
    p.add_argument(
        "--token-ids-prompt", action="store_true",
        help="send prompts as lists of token ids (completions only; exact lengths)",
    )  # fmt: skip
    p.add_argument("--vocab-size", type=int, default=None, help="upper bound of random token ids")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos: true")
    p.add_argument("--extra-body", type=_json_object, default=None, help="JSON object merged into each body")
    p.add_argument("--warmup-requests", type=int, default=1, help="sent before timing starts")
    p.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")
    p.add_argument("--result-filename", default=None, help="append the result as one JSON line")
    p.add_argument("--save-requests", default=None, metavar="FILE",
                   help="write one JSON line per request: send time, TTFT, latency, tokens, error")
    args = p.parse_args(argv)
    if args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    try:
        result = asyncio.run(run_benchmark(args))
    except (ValueError, RuntimeError, OSError) as e:
        raise SystemExit(f"error: {e}") from e
    line = json.dumps(result)
    print(format_report(result))
    print(line)
    if args.result_filename:
        with open(args.result_filename, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    return result


if __name__ == "__main__":
    main()
