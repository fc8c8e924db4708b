"""A fixed set of OpenAI / native requests against the scripted daemon, with their responses normalised.

The architecture work of issue 30 must not change a byte the daemon sends. `collect` runs the set
against a daemon (the tiny random-weight model, the scripted sampler below, the qwen3 reasoning and
tool parsers) and returns every response as text with the fields that differ from run to run
(ids, creation times, tool-call ids) replaced by placeholders. `tests/daemon/data/golden_responses.json`
holds what the tree before that work answered (recorded with
`python -m tests.daemon.golden_responses --record`); `test_golden_responses.py` compares.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import httpx

GOLDEN = Path(__file__).parent / "data" / "golden_responses.json"

ANSWER = "<think>\nThe user says hi.\nSo I greet them.\n</think>\n\nHello! How can I help? \u00e9\u4f60\u597d"
TOOL = (
    '<think>\nI should call a tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris"}}\n</tool_call>'
)
PLAIN = "The quick brown fox jumps over the lazy dog. Then it rests."
SCRIPTS = [ANSWER, TOOL, PLAIN]
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]
HI = [{"role": "user", "content": "Hi there"}]
MODEL = "tiny-qwen3"

# (name, route, body): sent one at a time, in this order (the scripted sampler hands out scripts in turn:
# request k gets SCRIPTS[k % 3], so the order is part of the set).
REQUESTS: list[tuple[str, str, dict[str, Any]]] = [
    ("chat", "/v1/chat/completions", {"model": MODEL, "messages": HI, "seed": 1}),
    ("chat_tools", "/v1/chat/completions", {"model": MODEL, "messages": HI, "tools": TOOLS, "seed": 2}),
    ("chat_logprobs", "/v1/chat/completions",
     {"model": MODEL, "messages": HI, "seed": 3, "logprobs": True, "top_logprobs": 2, "max_tokens": 6}),
    ("chat_stream", "/v1/chat/completions",
     {"model": MODEL, "messages": HI, "seed": 4, "stream": True, "stream_options": {"include_usage": True}}),
    ("chat_stream_tools", "/v1/chat/completions",
     {"model": MODEL, "messages": HI, "tools": TOOLS, "seed": 5, "stream": True}),
    ("chat_stream_plain_logprobs", "/v1/chat/completions",
     {"model": MODEL, "messages": HI, "seed": 6, "stream": True, "logprobs": True, "top_logprobs": 1, "max_tokens": 4}),
    ("chat_n2", "/v1/chat/completions", {"model": MODEL, "messages": HI, "seed": 7, "n": 2}),
    ("chat_stop", "/v1/chat/completions", {"model": MODEL, "messages": HI, "seed": 9, "stop": ["lazy"]}),
    ("completion", "/v1/completions",
     {"model": MODEL, "prompt": "Once upon", "seed": 10, "max_tokens": 8, "logprobs": 2, "echo": True}),
    ("completion_stream", "/v1/completions",
     {"model": MODEL, "prompt": "Once upon", "seed": 11, "max_tokens": 8, "stream": True,
      "stream_options": {"include_usage": True}}),
    ("completion_ids_stop", "/v1/completions",
     {"model": MODEL, "prompt": [1, 2, 3, 4], "seed": 12, "max_tokens": 30, "stop": "rests"}),
    ("generate", "/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 5, "seed": 13}}),
    ("generate_stream", "/generate",
     {"text": "Hello", "stream": True, "sampling_params": {"max_new_tokens": 5, "seed": 14}}),
    ("bad_temperature", "/v1/chat/completions", {"model": MODEL, "messages": HI, "temperature": 9}),
    ("unknown_model", "/v1/chat/completions", {"model": "nope", "messages": HI}),
    ("bad_message", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}),
]

_ID_FIELDS = re.compile(r'"(id)": "(chatcmpl|cmpl|call)-?_?[0-9A-Za-z]+"')
_CREATED = re.compile(r'"created": \d+')
_GEN_ID = re.compile(r'"id": "[0-9a-f]{8}-\d+\.\d+"')


def normalise(text: str) -> str:
    """Replace what differs from run to run (ids, times) with placeholders."""
    text = _ID_FIELDS.sub(lambda m: f'"{m.group(1)}": "{m.group(2)}-ID"', text)
    text = _CREATED.sub('"created": 0', text)
    return _GEN_ID.sub('"id": "RID"', text)


def _canonical(body: bytes) -> str:
    """A JSON body re-serialised with the daemon's own separators, so the comparison sees every value."""
    return json.dumps(json.loads(body), ensure_ascii=False)


def collect(base_url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Send REQUESTS in order; name -> {"status", "body"} (a stream's body is its list of events)."""
    out: dict[str, Any] = {}
    with httpx.Client(base_url=base_url, timeout=120.0, headers=headers or {}) as client:
        for name, route, body in REQUESTS:
            r = client.post(route, json=body)
            if body.get("stream") and r.status_code == 200:
                events = [line[len("data: "):] for line in r.text.split("\n\n") if line.startswith("data: ")]
                shown = [e if e == "[DONE]" else normalise(_canonical(e.encode())) for e in events]
                out[name] = {"status": r.status_code, "body": shown}
            else:
                out[name] = {"status": r.status_code, "body": normalise(_canonical(r.content))}
    return out


def start_scripted_daemon(model_path: Path, workdir: Path) -> Any:
    from tests.daemon.conftest import start_daemon

    script = workdir / "script.json"
    script.write_text(json.dumps(SCRIPTS))
    return start_daemon(model_path, "--server.reasoning_parser", "qwen3", "--server.tool_call_parser", "qwen3",
                        env={"MLLMD_TESTING_SCRIPT": str(script)})


def main(argv: list[str]) -> int:
    """--record: build the tiny model, run the set, write GOLDEN."""
    import tempfile

    from mllmd.testing.checkpoints import build_tiny_checkpoint
    from tests.daemon.conftest import stop_and_check

    if argv != ["--record"]:
        print("usage: python -m tests.daemon.golden_responses --record", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(build_tiny_checkpoint(Path(tmp) / MODEL, "Qwen3-0.6B"))
        d = start_scripted_daemon(model, Path(tmp))
        try:
            got = collect(d.base_url)
        finally:
            stop_and_check(d)
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(got, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {GOLDEN} ({len(got)} responses)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
