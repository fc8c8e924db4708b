"""The daemon answers a fixed set of requests exactly as the tree before issue 30's restructuring did.

See golden_responses.py: the set, the normalisation (ids and times only) and how the record was made.
Logprob values come from the tiny model's real logits on this CPU; everything else is scripted.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from .conftest import short_tmpdir, stop_and_check
from .golden_responses import GOLDEN, collect, start_scripted_daemon

pytestmark = pytest.mark.timeout(300)


def _close(a: Any, b: Any) -> bool:
    """Equal, floats to 1e-5 relative or 2e-5 absolute: a different CPU's vector units may round the
    logits differently, and a logprob is logit - logsumexp, so a few float32 steps of a logsumexp near
    40 (3.8e-6 each) shift every logprob of the row, small ones too (seen: 7.6e-6 on another machine)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-5, abs_tol=2e-5)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


def _parsed(body: Any) -> Any:
    if isinstance(body, list):
        return [e if e == "[DONE]" else json.loads(e) for e in body]
    return json.loads(body)


def test_responses_match_the_recorded_ones(tiny_model: Path) -> None:
    want = json.loads(GOLDEN.read_text())
    d = start_scripted_daemon(tiny_model, short_tmpdir())
    try:
        got = collect(d.base_url)
    finally:
        stop_and_check(d)
    assert list(got) == list(want)
    for name in want:
        assert got[name]["status"] == want[name]["status"], name
        if got[name]["body"] != want[name]["body"]:  # bytes differ: only float rounding may explain it
            assert _close(_parsed(got[name]["body"]), _parsed(want[name]["body"])), (
                f"{name}: the response changed\n got: {got[name]['body']}\nwant: {want[name]['body']}"
            )
