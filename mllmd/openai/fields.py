"""Typed access to the fields of a JSON request body: each getter checks the type and range and
raises the OpenAI-shaped 400 that names the field by its full path (`messages[2].content[0].text`)."""

from __future__ import annotations

import math
from typing import Any, overload

from mllmd.openai.errors import APIError, bad_request

MAX_INT = (1 << 31) - 1  # token ids, max_tokens, top_k




def show(v: Any) -> str:
    """A short description of a bad value for an error message (never huge, never raises)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return repr(v) if v.bit_length() < 128 else "a very large integer"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return repr(v) if len(v) <= 40 else repr(v[:40]) + "..."
    kinds: dict[type, str] = {list: "an array", dict: "an object"}
    return kinds.get(type(v), type(v).__name__)


def describe_range(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    if hi is None:
        return f"{'>' if lo_open else '>='} {lo}"
    return f"in {'(' if lo_open else '['}{lo}, {hi}]"


def as_int(v: Any, p: str, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, float) and v.is_integer():  # 10.0 from a lax client (is_integer is False for inf/nan)
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"'{p}' must be an integer (got {show(v)})", p)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad_request(f"'{p}' must be an integer {describe_range(lo, hi)} (got {show(v)})", p)
    return v


def as_float(v: Any, p: str, lo: float, hi: float, lo_open: bool = False) -> float:
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or (isinstance(v, float) and not math.isfinite(v))
    ):
        raise bad_request(f"'{p}' must be a finite number (got {show(v)})", p)
    if v < lo or v > hi or (lo_open and v == lo):  # compare before float(): huge ints would overflow
        raise bad_request(f"'{p}' must be a number {describe_range(lo, hi, lo_open)} (got {show(v)})", p)
    return float(v)


def as_str(v: Any, p: str, allow_empty: bool = True) -> str:
    if not isinstance(v, str):
        raise bad_request(f"'{p}' must be a string (got {show(v)})", p)
    if not v and not allow_empty:
        raise bad_request(f"'{p}' must not be empty", p)
    return v


def as_token_ids(v: Any, p: str, allow_empty: bool = False) -> list[int]:
    if not isinstance(v, list):
        raise bad_request(f"'{p}' must be an array of token ids (got {show(v)})", p)
    if not v:
        if not allow_empty:
            raise bad_request(f"'{p}' must not be empty", p)
        return []
    # Fast path (C speed, for prompts of a million ids): plain ints within range need no copy.
    if set(map(type, v)) == {int} and min(v) >= 0 and max(v) <= MAX_INT:
        return v
    return [as_int(t, f"{p}[{i}]", 0, MAX_INT) for i, t in enumerate(v)]


class JsonFields:
    """Typed access to one JSON object's fields; errors name the field by its full path."""

    def __init__(self, value: Any, path: str = "", what: str = "The request body") -> None:
        if not isinstance(value, dict):
            name = f"'{path}'" if path else what
            raise bad_request(f"{name} must be a JSON object (got {show(value)})", path or None)
        self.d: dict[str, Any] = value
        self.path = path

    def param(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def err(self, key: str, why: str) -> APIError:
        p = self.param(key)
        return bad_request(f"'{p}' {why}", p)

    def raw(self, key: str, required: bool = False) -> Any:
        v = self.d.get(key)
        if v is None and required:
            raise self.err(key, "is required")
        return v

    def get_bool(self, key: str, default: bool) -> bool:
        v = self.d.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self.err(key, f"must be a boolean (got {show(v)})")
        return v

    @overload
    def get_int(self, key: str, default: int, lo: int | None = None, hi: int | None = None) -> int: ...
    @overload
    def get_int(self, key: str, default: None, lo: int | None = None, hi: int | None = None) -> int | None: ...
    def get_int(
        self, key: str, default: int | None, lo: int | None = None, hi: int | None = None
    ) -> int | None:
        v = self.d.get(key)
        return default if v is None else as_int(v, self.param(key), lo, hi)

    def get_float(self, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
        v = self.d.get(key)
        return default if v is None else as_float(v, self.param(key), lo, hi, lo_open)

    def get_str(self, key: str, required: bool = False, allow_empty: bool = True) -> str | None:
        v = self.raw(key, required)
        return None if v is None else as_str(v, self.param(key), allow_empty)

    def get_obj(self, key: str, required: bool = False) -> JsonFields | None:
        v = self.raw(key, required)
        return None if v is None else JsonFields(v, self.param(key))

    def get_list(self, key: str, required: bool = False) -> list[Any] | None:
        v = self.raw(key, required)
        if v is not None and not isinstance(v, list):
            raise self.err(key, f"must be an array (got {show(v)})")
        return v

    def refuse(self, unsupported: dict[str, str]) -> None:
        for key, why in unsupported.items():
            if self.d.get(key) is not None:
                raise self.err(key, why)
