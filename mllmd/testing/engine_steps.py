"""Driving an Engine step by step in tests (requests added between steps), and what it returned."""

from __future__ import annotations

from typing import Any


def run_to_end(engine: Any) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Step `engine` until no request is left: (each request's output tokens, each finished request's
    cached prompt tokens), by request id."""
    outs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.finished:
                cached[o.rid] = o.cached_tokens
    return outs, cached
