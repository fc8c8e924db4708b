"""Fuzz tests of the OpenAI request parsers: no body makes them raise anything but a 400.

Feeds `parse_chat_request`, `parse_completion_request` and `parse_generate_request` arbitrary JSON
and valid bodies with a few fields (anywhere in the tree) replaced by arbitrary JSON, and checks
that each either parses into a request whose `SamplingParams` validate or raises an `APIError` 400
with a short, JSON-clean message; also that the strategies reach the success path at all and cover
every native sampling key.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mllmd.openai.errors import APIError
from mllmd.openai.protocol import (
    GENERATE_SAMPLING_KEYS,
    MAX_N,
    UNSUPPORTED_CHAT_FIELDS,
    parse_chat_request,
    parse_completion_request,
    parse_generate_request,
)

# ---------------------------------------------------------------------------------------------
# Fuzz: arbitrary JSON never raises anything but APIError. Bodies are either arbitrary JSON or
# built from valid field values with a few fields (anywhere in the tree) replaced by arbitrary JSON,
# so that the parsers' success paths and every check along them are reached.

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.sampled_from(["text", "image_url", "function", "user", "assistant", "tool", "auto", "none", "1"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


nonempty = st.text(min_size=1, max_size=8)
token_ids = st.lists(st.integers(0, 1000), min_size=1, max_size=5)
part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}),
    st.fixed_dictionaries(
        {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": nonempty})}
    ),
)
tool_call = st.fixed_dictionaries(
    {
        "id": nonempty,
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": nonempty, "arguments": st.just("{}")}),
    }
)
message = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user"]),
            "content": st.text(max_size=8) | st.lists(part, max_size=3),
        },
        optional={"name": nonempty},
    ),
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "content": st.none() | st.text(max_size=8)},
        optional={"tool_calls": st.lists(tool_call, max_size=2), "reasoning_content": st.text(max_size=8)},
    ),
    st.fixed_dictionaries(
        {"role": st.just("tool"), "content": st.text(max_size=8), "tool_call_id": nonempty}
    ),
)
tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.just("f")},
            optional={"description": st.text(), "parameters": st.just({"type": "object"})},
        ),
    }
)
SAMPLING = {
    "stop": nonempty | st.lists(nonempty, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 1000), max_size=3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1, exclude_min=True),
    "top_k": st.integers(-1, 100),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 5),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "logit_bias": st.dictionaries(st.integers(0, 1000).map(str), st.floats(-100, 100), max_size=3),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
}
OPENAI_COMMON = {
    **SAMPLING,
    "model": st.text(max_size=8),
    "n": st.integers(1, MAX_N),
    "max_tokens": st.integers(1, 10**6),
    "user": json_values,
    "unknown_extra": json_values,
}
streaming = st.one_of(
    st.fixed_dictionaries({"stream": st.booleans()}),
    st.fixed_dictionaries(
        {"stream": st.just(True), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})}
    ),
)
CHAT = {
    **OPENAI_COMMON,
    "max_completion_tokens": st.integers(1, 10**6),
    "logprobs": st.just(True),
    "top_logprobs": st.integers(0, 20),
    "tools": st.lists(tool, min_size=1, max_size=1),
    "tool_choice": st.sampled_from(
        ["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]
    ),
    "chat_template_kwargs": st.fixed_dictionaries({}, optional={"enable_thinking": st.booleans()}),
    "response_format": st.just({"type": "text"}),
    "parallel_tool_calls": st.booleans(),
}
COMPLETION = {**OPENAI_COMMON, "echo": st.booleans(), "logprobs": st.integers(0, 5), "suffix": st.just("")}
GENERATE = {
    "return_logprob": st.just(True),
    "top_logprobs_num": st.integers(0, 20),
    "sampling_params": st.fixed_dictionaries(
        {}, optional={**SAMPLING, "max_new_tokens": st.integers(1, 10**6)}
    ),
}
ALL_KEYS = sorted({*CHAT, *COMPLETION, *GENERATE, "messages", "prompt", "text", "input_ids", "rid", "stream",
                   "stream_options", "best_of", *UNSUPPORTED_CHAT_FIELDS, *GENERATE_SAMPLING_KEYS})  # fmt: skip


def _locations(v: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    if isinstance(v, (dict, list)):
        for k in list(v) if isinstance(v, dict) else range(len(v)):
            out.append((v, k))
            _locations(v[k], out)
    return out


def _mutate(args: tuple[Any, list[tuple[int, str | None, Any]]]) -> Any:
    """Replace a value anywhere in the tree, or set a (possibly unsupported) top-level key."""
    body, mutations = args
    for pick, key, value in mutations:
        if key is not None and isinstance(body, dict):
            body[key] = value
            continue
        locs = _locations(body, [])
        if locs:
            container, k = locs[pick % len(locs)]
            container[k] = value
    return body


def _bodies(*parts: st.SearchStrategy) -> st.SearchStrategy:
    """Arbitrary JSON, or a valid body (the union of ``parts``) with 0-2 mutations."""
    valid = st.tuples(*parts).map(lambda ds: {k: v for d in ds for k, v in d.items()})
    mutation = st.tuples(st.integers(0, 10**6), st.none() | st.sampled_from(ALL_KEYS), json_values)
    return json_values | st.tuples(valid, st.lists(mutation, max_size=2)).map(_mutate)


CHAT_BODIES = _bodies(
    st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=3)}, optional=CHAT), streaming
)
COMPLETION_BODIES = _bodies(
    st.fixed_dictionaries(
        {
            "prompt": nonempty
            | st.lists(nonempty, min_size=1, max_size=3)
            | token_ids
            | st.lists(token_ids, min_size=1, max_size=2)
        },
        optional=COMPLETION,
    ),
    streaming,
)
GENERATE_BODIES = _bodies(
    st.one_of(
        st.fixed_dictionaries({"text": nonempty}, optional={"rid": nonempty}),
        st.fixed_dictionaries({"input_ids": token_ids}, optional={"rid": nonempty}),
        st.fixed_dictionaries(
            {"text": st.lists(nonempty, min_size=2, max_size=2)}, optional={"rid": st.just(["a", "b"])}
        ),
        st.fixed_dictionaries({"input_ids": st.lists(token_ids, min_size=1, max_size=3)}),
    ),
    st.fixed_dictionaries({}, optional=GENERATE),
    streaming,
)


def _never_crashes(parse, body: Any) -> bool:
    """Parse and map to SamplingParams; only APIError 400 may escape. True when it parsed."""
    try:
        req = parse(body)
    except APIError as e:
        assert e.status == 400 and isinstance(e.message, str) and len(e.message) < 1000
        json.dumps(e.to_dict())
        return False
    for default in (None, 0, 1, 4096):
        try:
            sp = req.sampling_params(default)
        except APIError as e:
            assert e.status == 400
            continue
        sp.validate()
        assert sp.max_tokens >= 1 and math.isfinite(sp.temperature)
    return True


FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize(
    ("parse", "bodies"),
    [
        (parse_chat_request, CHAT_BODIES),
        (parse_completion_request, COMPLETION_BODIES),
        (parse_generate_request, GENERATE_BODIES),
    ],
    ids=["chat", "completion", "generate"],
)
def test_fuzz_parsers(parse, bodies: st.SearchStrategy) -> None:
    parsed = []

    @FUZZ
    @given(bodies)
    def run(body: Any) -> None:
        parsed.append(_never_crashes(parse, body))

    run()
    assert set(SAMPLING) | {"max_new_tokens"} == set(GENERATE_SAMPLING_KEYS)
    assert any(parsed), "the fuzzer never produced a valid request: its strategies are off"
