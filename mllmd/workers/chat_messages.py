"""OpenAI chat messages -> the messages a Qwen chat template expects (what transformers documents).

Two shapes differ between the OpenAI API and the templates:
- a tool call's `arguments` is a JSON string in the OpenAI API but an object in transformers' chat
  format: Qwen3.5's template iterates over it (`arguments|items`, a TypeError on a string) and Qwen3's
  writes it with `tojson`, so an object is parsed out of the string (as vLLM does). A string that is not
  a JSON object stays as it is.
- a content given as a list of text parts: the Qwen3-VL and Qwen3.5 templates render the list (the
  parts concatenated), Qwen3's renders only a string (a list becomes ''), so a text-only list is joined
  with newlines (vLLM's "string" content format) only for a template that cannot render lists.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from mllmd.messages import ChatPrompt

_PROBE = "mllmd-content-list-probe"


@functools.lru_cache(maxsize=8)
def renders_content_lists(tokenizer: Any, chat_template: str | None) -> bool:
    """Whether the chat template writes the text of a content given as a list of parts (tried once on a
    one-message chat: templates differ in how they read a list, and only rendering shows it)."""
    chat = [{"role": "user", "content": [{"type": "text", "text": _PROBE}]}]
    kwargs = {} if chat_template is None else {"chat_template": chat_template}
    try:
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception:
        return False
    return isinstance(text, str) and _PROBE in text


# the deepest arguments object given to a template as an object: rendering nests one Python frame or
# more a level (Jinja, json.dumps), and 500 levels exceeded the interpreter's recursion limit
MAX_ARGUMENT_DEPTH = 64


def _depth(value: Any) -> int:
    """How deeply containers nest in a decoded JSON value (iterative: the value may be deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def _arguments(args: Any) -> Any:
    """A tool call's arguments as an object where the string holds a JSON object (not too deep)."""
    if not isinstance(args, str):
        return args
    try:
        value = msgspec.json.decode(args)
    except (msgspec.DecodeError, RecursionError, ValueError):
        return args
    return value if isinstance(value, dict) and _depth(value) <= MAX_ARGUMENT_DEPTH else args


def _message(message: dict[str, Any], lists: bool) -> dict[str, Any]:
    out = dict(message)
    content = out.get("content")
    if not lists and isinstance(content, list) and all(p.get("type") == "text" for p in content):
        out["content"] = "\n".join(p["text"] for p in content)
    calls = out.get("tool_calls")
    if calls:
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"].get("arguments"))}}
                             if isinstance(c.get("function"), dict) else c for c in calls]  # fmt: skip
    return out


def template_messages(tokenizer: Any, prompt: ChatPrompt, chat_template: str | None = None) -> ChatPrompt:
    """The prompt with its messages in the chat template's shape (see the module's docstring)."""
    lists = renders_content_lists(tokenizer, chat_template)
    return msgspec.structs.replace(prompt, messages=[_message(m, lists) for m in prompt.messages])
