"""Summarize a scheduler step trace (MLLMD_STEP_TRACE): where the scheduler loop's time went.

    python3 scripts/step_trace_summary.py steps.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys


def summarize(lines: list[dict]) -> dict:
    if not lines:
        return {}
    span = lines[-1]["t"] + (lines[-1]["msgs_ms"] + lines[-1]["step_ms"] + lines[-1]["send_ms"]) / 1e3 - lines[0]["t"]
    out: dict = {"iterations": len(lines), "span_s": round(span, 3)}
    for kind, sel in (("decode_only", lambda r: r["prefill"] == 0 and r["decode"] > 0),
                      ("with_prefill", lambda r: r["prefill"] > 0),
                      ("no_compute", lambda r: r["prefill"] == 0 and r["decode"] == 0)):
        rows = [r for r in lines if sel(r)]
        if not rows:
            continue
        steps = [r["step_ms"] for r in rows]
        out[kind] = {
            "n": len(rows),
            "step_ms_sum": round(sum(steps), 1),
            "step_ms_p50": round(statistics.median(steps), 3),
            "step_ms_p90": round(sorted(steps)[int(0.9 * (len(steps) - 1))], 3),
            "msgs_ms_sum": round(sum(r["msgs_ms"] for r in rows), 1),
            "send_ms_sum": round(sum(r["send_ms"] for r in rows), 1),
            "tokens": sum(r["prefill"] + r["decode"] for r in rows),
            "decode_batch_mean": round(statistics.mean(r["decode"] for r in rows), 1),
            "prefill_mean": round(statistics.mean(r["prefill"] for r in rows), 1),
        }
    gaps = [b["t"] - (a["t"] + (a["msgs_ms"] + a["step_ms"] + a["send_ms"]) / 1e3) for a, b in zip(lines, lines[1:])]
    out["untraced_gap_ms_sum"] = round(sum(gaps) * 1e3, 1)
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        rows = [json.loads(x) for x in f if x.strip()]
    print(json.dumps(summarize(rows), indent=1))
