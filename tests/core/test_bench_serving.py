"""The online serving benchmark against a fake OpenAI-compatible streaming server run in-process."""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mllmd.bench.serving import main as serving_main
from mllmd.bench.serving import parse_args, poisson_intervals, run_benchmark
from mllmd.bench.serving_datasets import (
    TokenIdPromptBuilder,
    WordPromptBuilder,
    random_dataset,
    shared_prefix_dataset,
)

MODEL = "fake-model"


@dataclass
class FakeState:
    """Behaviour of the fake server and what it saw."""

    ttft: float = 0.05
    itl: float = 0.02
    tokens_per_chunk: int = 1
    send_usage: bool = True
    fail_every: int = 0
    api_key: str | None = None
    count: int = 0
    active: int = 0
    peak: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)


def make_app(state: FakeState) -> Starlette:
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def generate(request: Request) -> Response:
        if state.api_key and request.headers.get("authorization") != f"Bearer {state.api_key}":
            return JSONResponse({"error": {"message": "bad key", "type": "auth", "code": 401}}, 401)
        body = await request.json()
        state.bodies.append(body)
        state.count += 1
        if state.fail_every and state.count % state.fail_every == 0:
            err = {"message": "injected failure", "type": "server_error", "param": None, "code": 500}
            return JSONResponse({"error": err}, 500)
        chat = request.url.path.endswith("/chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        n_out = int(body["max_tokens"])
        state.active += 1
        state.peak = max(state.peak, state.active)

        def chunk(choice: dict[str, Any], usage: dict[str, int] | None = None) -> str:
            obj = {"id": "x", "object": "chunk", "model": MODEL, "choices": [choice] if choice else []}
            if usage is not None:
                obj["usage"] = usage
            return f"data: {json.dumps(obj)}\n\n"

        async def events() -> Any:
            try:
                if chat:  # a role-only first chunk carries no token and must not count as TTFT
                    yield chunk({"index": 0, "delta": {"role": "assistant"}, "finish_reason": None})
                await asyncio.sleep(state.ttft)
                n_chunks = math.ceil(n_out / state.tokens_per_chunk)
                for i in range(n_chunks):
                    if i:
                        await asyncio.sleep(state.itl)
                    text = "tok " * state.tokens_per_chunk
                    key = {"delta": {"content": text}} if chat else {"text": text}
                    yield chunk({"index": 0, **key, "finish_reason": None})
                if state.send_usage and body.get("stream_options", {}).get("include_usage"):
                    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n_out}
                    yield chunk({}, usage | {"total_tokens": prompt_tokens + n_out})
                yield "data: [DONE]\n\n"
            finally:
                state.active -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/v1/completions", generate, methods=["POST"]),
            Route("/v1/chat/completions", generate, methods=["POST"]),
        ]
    )


class ServerThread:
    """A uvicorn server in a background thread (loopback TCP with an ephemeral port, or a Unix socket)."""

    def __init__(self, state: FakeState, **config: Any) -> None:
        cfg = uvicorn.Config(make_app(state), log_level="warning", lifespan="off", **config)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    @property
    def url(self) -> str:
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeState, str]]:
    """One fake server per module; each test resets its state via `server` below."""
    state = FakeState()
    srv = ServerThread(state, host="127.0.0.1", port=0).start()
    yield state, srv.url
    srv.stop()


@pytest.fixture
def server(fake: tuple[FakeState, str]) -> tuple[FakeState, str]:
    state, url = fake
    fresh = FakeState()
    for name in fresh.__dataclass_fields__:
        setattr(state, name, getattr(fresh, name))
    return state, url


def bench(url: str, *extra: str) -> dict[str, Any]:
    argv = ["--base-url", url, "--warmup-requests", "0", "--random-range-ratio", "1.0", "--seed", "0"]
    args = parse_args(argv + list(extra))
    return asyncio.run(run_benchmark(args))


def test_random_completions_counts_and_timings(server: tuple[FakeState, str]) -> None:
    state, url = server
    r = bench(url, "--num-prompts", "8", "--random-input-len", "16", "--random-output-len", "6")
    assert (r["completed"], r["failed"], r["errors"]) == (8, 0, [])
    assert r["model"] == MODEL  # discovered from GET /v1/models
    assert r["total_output_tokens"] == 48 and r["usage_reported"] == 8
    assert r["total_input_tokens"] == 8 * 16
    assert len(state.bodies) == 8
    for body in state.bodies:
        assert body["max_tokens"] == 6 and body["ignore_eos"] is True and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert isinstance(body["prompt"], str) and len(body["prompt"].split()) == 16
    # Injected: TTFT 50 ms, 20 ms between chunks. Loose bounds only.
    assert 40 <= r["mean_ttft_ms"] < 2000
    assert 15 <= r["p50_itl_ms"] < 1000
    assert 15 <= r["mean_tpot_ms"] < 1000
    assert r["mean_e2e_latency_ms"] >= 40 + 5 * 15
    assert r["p50_ttft_ms"] <= r["p90_ttft_ms"] <= r["p99_ttft_ms"]
    assert r["request_throughput"] > 0 and r["output_throughput"] > r["request_throughput"]
    assert r["total_token_throughput"] > r["output_throughput"]


def test_output_tokens_from_usage_else_chunks(server: tuple[FakeState, str]) -> None:
    state, url = server
    state.tokens_per_chunk = 2
    state.itl = 0.005
    args = ("--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "6")
    with_usage = bench(url, *args)
    assert with_usage["total_output_tokens"] == 4 * 6  # usage wins over the 3 chunks per request
    state.send_usage = False
    no_usage = bench(url, *args)
    assert no_usage["total_output_tokens"] == 4 * 3 and no_usage["usage_reported"] == 0
    assert no_usage["total_input_tokens"] == 4 * 8  # from the dataset when usage is absent


def test_max_concurrency_respected(server: tuple[FakeState, str]) -> None:
    state, url = server
    state.ttft, state.itl = 0.05, 0.005
    r = bench(url, "--num-prompts", "12", "--random-input-len", "4", "--random-output-len", "2",
              "--max-concurrency", "3")  # fmt: skip
    assert r["completed"] == 12
    assert 2 <= state.peak <= 3
    state.peak = 0
    bench(url, "--num-prompts", "12", "--random-input-len", "4", "--random-output-len", "2")
    assert state.peak > 3  # unbounded, all at once


def test_failures_counted_not_fatal(server: tuple[FakeState, str]) -> None:
    state, url = server
    state.fail_every = 3
    state.ttft = state.itl = 0.001
    r = bench(url, "--num-prompts", "9", "--random-input-len", "4", "--random-output-len", "3")
    assert (r["completed"], r["failed"]) == (6, 3)
    assert r["total_output_tokens"] == 18
    assert len(r["errors"]) == 3
    assert all("HTTP 500" in e["error"] and "injected failure" in e["error"] for e in r["errors"])


def test_unreachable_server_counts_failures() -> None:
    with socket.socket() as s:  # a loopback port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = bench(f"http://127.0.0.1:{port}", "--model", "m", "--num-prompts", "3", "--random-input-len", "4",
              "--random-output-len", "2", "--request-timeout", "5")  # fmt: skip
    assert (r["completed"], r["failed"]) == (0, 3)
    assert all("Connect" in e["error"] for e in r["errors"])
    assert r["mean_ttft_ms"] is None and r["request_throughput"] == 0


def test_chat_shared_prefix(server: tuple[FakeState, str]) -> None:
    state, url = server
    state.ttft, state.itl = 0.04, 0.002
    r = bench(url, "--endpoint", "chat", "--dataset", "shared-prefix", "--num-prompts", "6",
              "--num-groups", "2", "--prefix-len", "32", "--suffix-len", "4", "--random-output-len", "3")  # fmt: skip
    assert (r["completed"], r["failed"]) == (6, 0)
    assert r["mean_ttft_ms"] >= 30  # the role-only chunk sent at once does not count as the first token
    systems = [b["messages"][0]["content"] for b in state.bodies]
    assert all(
        b["messages"][0]["role"] == "system" and b["messages"][1]["role"] == "user" for b in state.bodies
    )
    assert len(set(systems)) == 2 and sorted(systems.count(s) for s in set(systems)) == [3, 3]


def test_cli_result_file_token_ids_and_api_key(
    server: tuple[FakeState, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state, url = server
    state.api_key = "secret-key"
    state.ttft = state.itl = 0.001
    out = tmp_path / "results.jsonl"
    argv = ["--base-url", url, "--api-key", "secret-key", "--num-prompts", "3", "--random-input-len", "10",
            "--random-output-len", "4", "--random-range-ratio", "1", "--token-ids-prompt",
            "--request-rate", "50", "--result-filename", str(out)]  # fmt: skip
    timeline = tmp_path / "requests.jsonl"
    serving_main([*argv, "--save-requests", str(timeline)])
    serving_main(argv)
    per_request = [json.loads(x) for x in timeline.read_text().splitlines()]
    assert [r["index"] for r in per_request] == [0, 1, 2]
    assert all(r["error"] is None and r["output_tokens"] == 4 and 0 < r["ttft_s"] <= r["latency_s"] for r in per_request)
    assert per_request[0]["start"] <= per_request[1]["start"] <= per_request[2]["start"]  # 50 req/s: in order
    lines = out.read_text().splitlines()
    assert len(lines) == 2
    result = json.loads(lines[0])
    printed = capsys.readouterr().out
    assert json.loads(printed.strip().splitlines()[-1]).keys() == result.keys()
    assert "secret-key" not in out.read_text() and "secret-key" not in printed
    expected = {"completed", "failed", "duration_s", "request_throughput", "output_throughput",
                "total_token_throughput", "total_input_tokens", "total_output_tokens", "errors", "settings",
                "model", "endpoint", "dataset", "request_rate", "max_concurrency"}  # fmt: skip
    expected |= {
        f"{s}_{m}_ms" for s in ("mean", "p50", "p90", "p99") for m in ("ttft", "tpot", "itl", "e2e_latency")
    }
    assert expected <= result.keys()
    assert result["completed"] == 3 and result["total_input_tokens"] == 30 and result["request_rate"] == 50
    assert result["settings"]["token_ids_prompt"] is True and result["settings"]["api_key_set"] is True
    # 1 warm-up + 3 timed requests per run; prompts are lists of ints of the exact length.
    assert len(state.bodies) == 8
    assert all(isinstance(b["prompt"], list) and len(b["prompt"]) == 10 for b in state.bodies)
    assert all(isinstance(t, int) for t in state.bodies[0]["prompt"])


def test_unix_socket(tmp_path: Path) -> None:
    state = FakeState(ttft=0.001, itl=0.001)
    sock = str(tmp_path / "fake.sock")
    srv = ServerThread(state, uds=sock).start()
    try:
        r = bench("http://localhost", "--unix-socket", sock, "--num-prompts", "3", "--random-input-len", "4",
                  "--random-output-len", "2")  # fmt: skip
    finally:
        srv.stop()
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (3, 0, 6)


def test_token_ids_prompt_needs_completions() -> None:
    args = parse_args(["--endpoint", "chat", "--token-ids-prompt", "--num-prompts", "1"])
    with pytest.raises(ValueError, match="completions"):
        asyncio.run(run_benchmark(args))


def test_shared_prefix_dataset_structure() -> None:
    builder = TokenIdPromptBuilder(5000)
    reqs = shared_prefix_dataset(builder, num_prompts=12, num_groups=3, prefix_len=20, suffix_len=5,
                                 output_len=8, range_ratio=1.0, seed=7)  # fmt: skip
    groups: dict[int, list[list[int]]] = defaultdict(list)
    for q in reqs:
        assert q.group is not None and isinstance(q.prompt, list)
        assert len(q.prompt) == q.prompt_len == 25 and q.output_len == 8
        assert all(1000 <= t < 5000 for t in q.prompt)
        groups[q.group].append(q.prompt)
    assert sorted(len(g) for g in groups.values()) == [4, 4, 4]
    prefixes = {g: {tuple(p[:20]) for p in ps} for g, ps in groups.items()}
    assert all(len(p) == 1 for p in prefixes.values())  # one prefix per group
    assert len(set().union(*prefixes.values())) == 3  # distinct across groups
    assert len({tuple(p[20:]) for ps in groups.values() for p in ps}) == 12  # suffixes differ
    assert [q.group for q in reqs] != sorted(q.group for q in reqs) or len(reqs) < 3  # shuffled
    again = shared_prefix_dataset(builder, 12, 3, 20, 5, 8, 1.0, seed=7)
    assert [q.prompt for q in again] == [q.prompt for q in reqs]  # seeded

    chat = shared_prefix_dataset(WordPromptBuilder(), 6, 2, 10, 3, 4, 1.0, seed=0, chat=True)
    for q in chat:
        assert q.system is not None and len(q.system.split()) == 10 and len(str(q.prompt).split()) == 3
        assert q.prompt_len == 13
    assert len({q.system for q in chat}) == 2


def test_random_dataset_lengths() -> None:
    builder = TokenIdPromptBuilder(5000)
    reqs = random_dataset(builder, num_prompts=200, input_len=100, output_len=40, range_ratio=0.5, seed=3)
    assert all(50 <= q.prompt_len <= 100 and len(q.prompt) == q.prompt_len for q in reqs)
    assert all(20 <= q.output_len <= 40 for q in reqs)
    assert len({q.prompt_len for q in reqs}) > 10
    fixed = random_dataset(WordPromptBuilder(), 5, 12, 7, 1.0, seed=3)
    assert all(q.prompt_len == 12 and q.output_len == 7 for q in fixed)


def test_tokenizer_prompts(tmp_path: Path) -> None:
    """With a local tokenizer, prompts are decoded random ids of the asked length in that tokenizer."""
    pytest.importorskip("transformers")
    from mllmd.bench.serving_datasets import TokenizerPromptBuilder, make_prompt_builder
    from mllmd.checkpoint.tokenizer import build_qwen_tokenizer

    builder = make_prompt_builder(str(build_qwen_tokenizer(tmp_path / "tok")), token_ids=False)
    assert isinstance(builder, TokenizerPromptBuilder)
    reqs = random_dataset(builder, num_prompts=10, input_len=64, output_len=4, range_ratio=0.5, seed=0)
    for q in reqs:
        assert isinstance(q.prompt, str)
        assert 32 <= q.prompt_len <= 64
        assert len(builder.tokenizer.encode(q.prompt, add_special_tokens=False)) == q.prompt_len
    assert builder.ids.vocab_size == builder.tokenizer.vocab_size
    sample = set(builder.ids.piece(2000, random.Random(0)))
    assert not sample & set(builder.tokenizer.all_special_ids)
    with pytest.raises(ValueError, match="local folder"):
        make_prompt_builder(str(tmp_path / "missing"), token_ids=False)


def test_poisson_intervals() -> None:
    rate = 20.0
    gaps = poisson_intervals(20000, rate, random.Random(0))
    assert all(g >= 0 for g in gaps)
    assert abs(sum(gaps) / len(gaps) - 1 / rate) < 0.05 / rate
    assert gaps == poisson_intervals(20000, rate, random.Random(0))
    assert gaps != poisson_intervals(20000, rate, random.Random(1))
    assert poisson_intervals(5, math.inf, random.Random(0)) == [0.0] * 5


def test_hop_breakdown_is_the_mean_over_the_run() -> None:
    from mllmd.bench.serving import hop_breakdown

    before = {"queue": (2.0, 0.010), "prefill": (2.0, 0.100)}
    after = {"queue": (6.0, 0.030), "prefill": (6.0, 0.300), "to_main": (4.0, 0.004)}
    assert hop_breakdown(before, after) == {"queue": 5.0, "prefill": 50.0, "to_main": 1.0}
    assert hop_breakdown(None, after) is None and hop_breakdown(before, before) is None


def test_prefix_hit_rate_is_the_runs_share_of_cached_prompt_tokens() -> None:
    from mllmd.bench.serving import ServerCounters, prefix_hit_rate

    before = ServerCounters({"prefill": (2.0, 0.1)}, (1000.0, 200.0))
    after = ServerCounters({"prefill": (4.0, 0.3)}, (1400.0, 500.0))
    assert prefix_hit_rate(before, after) == 0.75
    assert prefix_hit_rate(before, before) is None and prefix_hit_rate(None, after) is None
    assert prefix_hit_rate(before, ServerCounters({}, None)) is None  # a server without the counters


def test_no_hops_from_a_server_without_them(server: tuple[FakeState, str]) -> None:
    _, url = server
    result = serving_main(["--base-url", url, "--num-prompts", "2", "--random-input-len", "4",
                           "--random-output-len", "2", "--token-ids-prompt"])
    assert "first_token_hops_ms" not in result


def test_offline_engine_args_parse_json_values_and_name_a_bad_one() -> None:
    from mllmd.bench.offline import engine_args

    assert engine_args(["max_decode_stall_ms=10", "disable_cuda_graph=true", "attention_backend=triton"]) == {
        "max_decode_stall_ms": 10, "disable_cuda_graph": True, "attention_backend": "triton"}
    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        engine_args(["max_decode_stall_ms"])
