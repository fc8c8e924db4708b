"""Where a served request waits before the scheduler has it: client send -> main's submit -> the
scheduler's receipt, from a bench.serving request timeline (--save-requests) and the daemon's step
trace (MLLMD_STEP_TRACE), both on the machine's monotonic clock.

    python3 scripts/serving_timeline.py requests.jsonl steps.jsonl

Requests and submits are matched in time order (the i-th request sent with the i-th submit), which
holds while main forwards requests in the order they arrive.
"""

from __future__ import annotations

import json
import sys


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))] if s else float("nan")


def lags(requests: list[dict], steps: list[dict]) -> dict:
    """Percentiles (ms) of client->main and main->scheduler delays, plus how many were matched."""
    starts = sorted(r["start"] for r in requests)
    received = sorted((sub, row["t"] + row["msgs_ms"] / 1e3) for row in steps for sub in row.get("submitted", []))
    # the scheduler's receipt of a message lies within its iteration's message phase: bound by its end
    n = min(len(starts), len(received))  # warm-up requests reach main before the timed ones: drop them
    starts, received = starts[-n:], received[-n:]
    client_to_main = [(received[i][0] - starts[i]) * 1e3 for i in range(n)]
    main_to_sched = [max(0.0, (rcv - sub) * 1e3) for sub, rcv in received]
    out = {"matched": n}
    for name, vals in (("client_to_main_ms", client_to_main), ("main_to_scheduler_ms", main_to_sched)):
        out[name] = {f"p{int(q * 100)}": round(_pct(vals, q), 2) for q in (0.5, 0.9, 0.99)}
        out[name]["max"] = round(max(vals), 2) if vals else float("nan")
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        reqs = [json.loads(x) for x in f if x.strip()]
    with open(sys.argv[2]) as f:
        rows = [json.loads(x) for x in f if x.strip()]
    print(json.dumps(lags(reqs, rows)))
