"""Response and streaming-chunk builders: plain dicts in exactly the shapes OpenAI sends.

A chat stream is, per choice: a role chunk (``chat_role_chunk``), content chunks
(``chat_chunk`` + ``chat_chunk_choice`` + ``chat_delta``), a finish chunk with an empty delta
(``chat_finish_chunk``); then, with ``stream_options.include_usage``, one ``chat_usage_chunk``
(``choices: []``), and finally ``SSE_DONE``. With include_usage every other chunk carries
``"usage": null``, as OpenAI does. Completions streams work the same way with
``completion_chunk``.

The thinking text (Qwen3 ``<think>``) is the one thing outside OpenAI's schema: it goes into the
message and the delta twice, as ``reasoning_content`` (SGLang, DeepSeek, older vLLM) and ``reasoning``
(vLLM >= 0.10, Ollama, OpenRouter), both only when not None; the ``openai`` client keeps both as extra
fields (``model_extra``).
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SSE_DONE = b"data: [DONE]\n\n"
CHAT_FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter", "function_call")
COMPLETION_FINISH_REASONS = ("stop", "length", "content_filter")
MIN_LOGPROB = -9999.0  # what OpenAI sends for a probability of zero (JSON has no -Infinity)


def sse(data: dict[str, Any]) -> bytes:
    """One server-sent event: ``data: {json}\\n\\n``."""
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def chat_completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(16)


def completion_id() -> str:
    return "cmpl-" + secrets.token_hex(16)


def tool_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def now() -> int:
    """``created``: Unix time in whole seconds."""
    return int(time.time())


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int | None = None
) -> dict[str, Any]:
    """``usage``; ``reasoning_tokens`` (thinking) adds ``completion_tokens_details`` when given."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def _check_finish(reason: str | None, allowed: tuple[str, ...]) -> None:
    if reason is not None and reason not in allowed:
        raise ValueError(f"finish_reason must be one of {allowed} (got {reason!r})")


# ---------------------------------------------------------------------------------------------
# Logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token, its logprob and the most likely alternatives at its position.

    ``raw`` is the token's bytes when it is not valid UTF-8 alone (a byte-level BPE piece of a
    multi-byte character); by default ``token.encode()``; each alternative is (text, logprob, its
    bytes or None for ``text.encode()``). ``logprob`` None (the first prompt token under
    completions' ``echo``) is sent as null.
    """

    token: str
    logprob: float | None
    top_logprobs: Sequence[tuple[str, float, bytes | None]] = field(default_factory=tuple)
    raw: bytes | None = None

    @property
    def token_bytes(self) -> list[int]:
        return _bytes_of(self.token, self.raw)


def _bytes_of(token: str, raw: bytes | None) -> list[int]:
    return list(raw if raw is not None else token.encode("utf-8", "surrogatepass"))


def _lp(x: float | None) -> float:
    """A JSON-safe logprob: -inf and nan become MIN_LOGPROB."""
    if x is None or math.isnan(x):
        return MIN_LOGPROB
    return max(float(x), MIN_LOGPROB)


def chat_logprobs(tokens: Sequence[TokenLogprob]) -> dict[str, Any]:
    """``choices[].logprobs`` of a chat completion or chunk."""
    content = [
        {
            "token": t.token,
            "logprob": _lp(t.logprob),
            "bytes": t.token_bytes,
            "top_logprobs": [
                {"token": tok, "logprob": _lp(lp), "bytes": _bytes_of(tok, raw)}
                for tok, lp, raw in t.top_logprobs
            ],
        }
        for t in tokens
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(tokens: Sequence[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
    """``choices[].logprobs`` of a completion; ``text_offset`` is where the first token starts in
    the returned text (the echoed prompt counts; in a stream, the length sent so far)."""
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t.token)
    return {
        "tokens": [t.token for t in tokens],
        "token_logprobs": [None if t.logprob is None else _lp(t.logprob) for t in tokens],
        "top_logprobs": [
            None if t.logprob is None else {tok: _lp(lp) for tok, lp, _ in t.top_logprobs} for t in tokens
        ],
        "text_offset": offsets,
    }


# ---------------------------------------------------------------------------------------------
# Chat


def chat_message(
    content: str | None,
    tool_calls: Sequence[dict[str, Any]] | None = None,
    reasoning_content: str | None = None,
) -> dict[str, Any]:
    """``choices[].message``; ``tool_calls`` are ``{"id", "type": "function", "function": {...}}``."""
    msg: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if tool_calls:
        msg["tool_calls"] = list(tool_calls)
    if reasoning_content is not None:  # both names: SGLang / DeepSeek clients read one, vLLM / Ollama the other
        msg["reasoning_content"] = reasoning_content
        msg["reasoning"] = reasoning_content
    return msg


def chat_choice(
    index: int, message: dict[str, Any], finish_reason: str, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One entry of ``choices`` in a chat completion."""
    _check_finish(finish_reason, CHAT_FINISH_REASONS)
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_completion(
    id: str, model: str, created: int, choices: Sequence[dict[str, Any]], usage: dict[str, Any] | None
) -> dict[str, Any]:
    """A whole (non-streamed) chat completion."""
    return {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": list(choices),
        "usage": usage,
    }


def chat_delta(
    content: str | None = None,
    *,
    role: str | None = None,
    reasoning_content: str | None = None,
    tool_calls: Sequence[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``choices[].delta``: only the fields that are set (an empty dict for the finish chunk)."""
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if reasoning_content is not None:
        delta["reasoning_content"] = reasoning_content
        delta["reasoning"] = reasoning_content
    if tool_calls:
        delta["tool_calls"] = list(tool_calls)
    return delta


def chat_chunk_choice(
    index: int,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One entry of ``choices`` in a chat chunk."""
    _check_finish(finish_reason, CHAT_FINISH_REASONS)
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk(
    id: str,
    model: str,
    created: int,
    choices: Sequence[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    include_usage: bool = False,
) -> dict[str, Any]:
    """A streamed chat chunk; it has a ``usage`` key when ``usage`` is given or include_usage."""
    out: dict[str, Any] = {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": list(choices),
    }
    if include_usage or usage is not None:
        out["usage"] = usage
    return out


def chat_role_chunk(
    id: str, model: str, created: int, index: int = 0, include_usage: bool = False
) -> dict[str, Any]:
    """The first chunk of a choice: ``delta: {"role": "assistant", "content": ""}``."""
    choice = chat_chunk_choice(index, chat_delta("", role="assistant"))
    return chat_chunk(id, model, created, [choice], include_usage=include_usage)


def chat_finish_chunk(
    id: str, model: str, created: int, index: int, finish_reason: str, include_usage: bool = False,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The last chunk of a choice: an empty delta and its finish_reason (and the logprobs of final tokens
    that have no text, such as the end-of-turn token)."""
    choice = chat_chunk_choice(index, {}, finish_reason, logprobs)
    return chat_chunk(id, model, created, [choice], include_usage=include_usage)


def chat_usage_chunk(id: str, model: str, created: int, usage: dict[str, Any]) -> dict[str, Any]:
    """The final chunk under ``stream_options.include_usage``: ``choices: []`` and the usage."""
    return chat_chunk(id, model, created, [], usage=usage)


# ---------------------------------------------------------------------------------------------
# Completions


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One entry of ``choices`` in a completion or completion chunk (finish_reason None while
    streaming: OpenAI streams null although the SDK's type declares it required)."""
    _check_finish(finish_reason, COMPLETION_FINISH_REASONS)
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion(
    id: str, model: str, created: int, choices: Sequence[dict[str, Any]], usage: dict[str, Any] | None
) -> dict[str, Any]:
    """A whole (non-streamed) completion."""
    return {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": list(choices),
        "usage": usage,
    }


def completion_chunk(
    id: str,
    model: str,
    created: int,
    choices: Sequence[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    include_usage: bool = False,
) -> dict[str, Any]:
    """A streamed completion chunk (same object type as a completion); the usage-only final chunk
    has ``choices: []``."""
    out = completion(id, model, created, choices, usage)
    if not include_usage and usage is None:
        del out["usage"]
    return out


# ---------------------------------------------------------------------------------------------
# Models


def model_card(id: str, created: int, owned_by: str = "mllmd") -> dict[str, Any]:
    """One entry of /v1/models (also the body of /v1/models/{id})."""
    return {"id": id, "object": "model", "created": created, "owned_by": owned_by}


def models_list(ids: Sequence[str], created: int, owned_by: str = "mllmd") -> dict[str, Any]:
    """The body of /v1/models."""
    return {"object": "list", "data": [model_card(i, created, owned_by) for i in ids]}
