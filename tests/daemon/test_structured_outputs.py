"""Structured outputs through the daemon, with the official openai client, on the tiny random-weight
Qwen3: only real constrained decoding can make such a model write JSON that validates.

response_format json_schema (50 generated schemas, strict and not) and json_object, `.parse()` with a
pydantic model, tool_choice "required" and a named function, streaming equal to non-streaming for a
seed, n > 1, a free request batched beside constrained ones unchanged, and a schema that cannot be
compiled refused with a 400 naming the problem.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.daemon.conftest import DaemonProc, start_daemon, stop_and_check

pytestmark = pytest.mark.timeout(900)

MESSAGES = [{"role": "user", "content": "Describe a thing as JSON."}]


@pytest.fixture(scope="module")
def daemon(tiny_model: Path) -> Iterator[DaemonProc]:
    d = start_daemon(tiny_model, "--server.tool_call_parser", "qwen3")
    yield d
    stop_and_check(d)


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A JSON schema of the kinds clients send: enums, bounded integers, booleans, short strings,
    nested objects, arrays with maxItems, required and optional fields, anyOf."""
    kinds = ["enum", "int", "bool", "str", "anyOf"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(["red", "green", "blue", "cat", "dog", "x y"], rng.randint(1, 4))}
    if kind == "int":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "bool":
        return {"type": "boolean"}
    if kind == "str":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1), {"type": "null"}]}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(1, 3)}
    names = rng.sample(["a", "b", "c", "d", "e", "f"], rng.randint(1, 4))
    props = {n: random_schema(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def schema_format(schema: dict[str, Any], strict: bool) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": strict}}


def test_fifty_generated_schemas_give_output_that_validates(daemon: DaemonProc) -> None:
    rng = random.Random(1234)
    schemas = []
    for _ in range(50):
        s = random_schema(rng)
        if s.get("type") != "object":  # the reply is an object holding the value
            s = {"type": "object", "properties": {"value": s}, "required": ["value"], "additionalProperties": False}
        schemas.append(s)
    client = daemon.openai()

    def ask(i: int) -> tuple[dict[str, Any], Any]:
        reply = client.chat.completions.create(
            model="tiny-qwen3", messages=MESSAGES, max_tokens=96, temperature=0.8, seed=i,
            response_format=schema_format(schemas[i], strict=i % 2 == 0))
        return schemas[i], reply.choices[0]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(len(schemas))))
    stopped = 0
    for schema, choice in results:
        if choice.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(choice.message.content), schema)
    # a random model stops only where the grammar leaves it nothing else: most of these schemas end
    assert stopped >= 40, f"only {stopped} of 50 constrained replies ended"


def test_json_object_holds_even_against_a_bias_for_quotes(daemon: DaemonProc, tokenizer: Any) -> None:
    """A +100 bias on '"' would make a free model write only quotes; the grammar keeps it an object."""
    quote = tokenizer.encode('"', add_special_tokens=False)
    assert len(quote) == 1
    client = daemon.openai()
    free = client.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, max_tokens=8, temperature=0,
                                          logit_bias={str(quote[0]): 100})
    assert free.choices[0].message.content.startswith('""')
    reply = client.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, max_tokens=200, temperature=0.7,
                                           seed=3, n=3, logit_bias={str(quote[0]): 100},
                                           response_format={"type": "json_object"})
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog", "fish"]
    legs: int = pydantic.Field(ge=0, le=8)
    vaccinated: bool


def test_parse_returns_the_pydantic_object(daemon: DaemonProc) -> None:
    client = daemon.openai()
    for seed in range(3):
        completion = client.chat.completions.parse(model="tiny-qwen3", messages=MESSAGES, max_tokens=64,
                                                   temperature=1.0, seed=seed, response_format=Pet)
        pet = completion.choices[0].message.parsed
        assert isinstance(pet, Pet)
        assert 0 <= pet.legs <= 8


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_choice_always_returns_a_valid_call(daemon: DaemonProc, choice: Any) -> None:
    client = daemon.openai()
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in range(4):
        reply = client.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, max_tokens=96, temperature=1.0,
                                               seed=seed, tools=[WEATHER, TIME], tool_choice=choice,
                                               parallel_tool_calls=False)
        c = reply.choices[0]
        assert c.finish_reason == "tool_calls", c.message
        assert c.message.tool_calls and len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0].function
        if isinstance(choice, dict):
            assert call.name == "get_time"
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_streaming_gives_the_text_of_the_whole_reply(daemon: DaemonProc) -> None:
    client = daemon.openai()
    fmt = schema_format({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                                          "k": {"enum": ["a", "b"]}}, "required": ["n", "k"]}, True)
    whole = client.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, max_tokens=48, temperature=1.0,
                                           seed=11, response_format=fmt)
    stream = client.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, max_tokens=48, temperature=1.0,
                                            seed=11, response_format=fmt, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == whole.choices[0].message.content
    assert set(json.loads(text)) == {"n", "k"}


def test_a_free_request_is_unchanged_beside_constrained_ones(daemon: DaemonProc) -> None:
    client = daemon.openai()

    def free() -> str:
        r = client.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, max_tokens=24, temperature=1.0, seed=5)
        return r.choices[0].message.content

    alone = free()

    def constrained(i: int) -> str:
        r = client.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, max_tokens=24, temperature=1.0,
                                           seed=i, response_format={"type": "json_object"})
        return r.choices[0].message.content

    with ThreadPoolExecutor(5) as pool:
        busy = [pool.submit(constrained, i) for i in range(4)]
        beside = pool.submit(free)
        assert beside.result() == alone
        for f in busy:
            assert f.result().startswith("{")


@pytest.mark.parametrize("fmt, problem", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}, "objec"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}}, "missing"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "name"),
    ({"type": "xml"}, "type"),
])
def test_a_schema_that_cannot_be_compiled_is_a_400_naming_it(daemon: DaemonProc, fmt: dict[str, Any],
                                                             problem: str) -> None:
    client = daemon.openai()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, max_tokens=8, response_format=fmt)
    assert problem in str(e.value)
    assert e.value.body["param"].startswith("response_format")
    ok = client.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, max_tokens=4)
    assert ok.choices[0].message.content is not None


def test_a_reply_cut_inside_its_tool_calls_ends_by_length(daemon: DaemonProc) -> None:
    """A reply that max_tokens cuts while it writes its calls finishes "length", not "tool_calls" (a client
    would run a call list that is cut short, and the cut markup is in its content)."""
    client = daemon.openai()
    seen = set()
    for max_tokens in range(16, 80, 4):
        for stream in (False, True):
            reply = client.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, max_tokens=max_tokens,
                                                   temperature=1.0, seed=1, tools=[WEATHER, TIME],
                                                   tool_choice="required", stream=stream,
                                                   stream_options={"include_usage": True} if stream else None)
            if stream:
                chunks = list(reply)
                reasons = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
                calls = [t for ch in chunks for c in ch.choices for t in (c.delta.tool_calls or []) if t.id]
                used = chunks[-1].usage.completion_tokens
            else:
                reasons = [reply.choices[0].finish_reason]
                calls = reply.choices[0].message.tool_calls or []
                used = reply.usage.completion_tokens
            cut = used == max_tokens
            assert reasons == ["length" if cut else "tool_calls"], (max_tokens, stream, used, reasons)
            seen.add((cut, bool(calls)))
    assert (True, True) in seen, seen  # a reply cut after a whole call was met (the random model writes
    # parallel calls until cut; test_forced_tool_choice_always_returns_a_valid_call has replies that end)
