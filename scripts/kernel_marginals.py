"""Where a profiled step's GPU time goes, kernel by kernel, when kernels overlap (PDL).

With programmatic dependent launch a kernel starts while the one before it still runs, so the
profiler's durations overlap and their sum overstates the step. Here kernels are taken in the order
they end; each is charged only the time from the previous kernel's end (or its own start, if later)
to its own end: its "marginal" time. The rest of the span is "idle": the gaps between one kernel's end
and the next one's start, which on one stream (a decode step) is time with no kernel running (the
host between launches, copies). Marginals plus idle add up to the span exactly.

    python -m mllmd.bench.one_batch ... --profile DIR      # writes DIR/trace-*.json
    python3 scripts/kernel_marginals.py DIR/trace-bs1-in128-out9.json --steps 8
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class KernelCost:
    calls: int = 0
    marginal_us: float = 0.0  # time this kernel added to the span
    duration_us: float = 0.0  # the profiler's own durations (overlapping under PDL)


@dataclass
class Marginals:
    span_us: float
    idle_us: float
    kernels: dict[str, KernelCost] = field(default_factory=dict)


def kernel_events(trace: dict | list) -> list[dict]:
    """The GPU kernel events of a chrome trace (torch.profiler's export_chrome_trace)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("cat") == "kernel" and "dur" in e]


def marginals(events: list[dict]) -> Marginals:
    """Charge each kernel the span it adds after the kernels that ended before it."""
    ks = sorted(events, key=lambda e: e["ts"] + e["dur"])
    if not ks:
        return Marginals(0.0, 0.0)
    first = min(e["ts"] for e in ks)
    out = Marginals(span_us=ks[-1]["ts"] + ks[-1]["dur"] - first, idle_us=0.0)
    costs: dict[str, KernelCost] = defaultdict(KernelCost)
    prev_end = first
    for e in ks:
        start, end = e["ts"], e["ts"] + e["dur"]
        out.idle_us += max(0.0, start - prev_end)
        charged = end - max(start, prev_end)
        c = costs[e["name"]]
        c.calls += 1
        c.marginal_us += charged
        c.duration_us += e["dur"]
        prev_end = end
    out.kernels = dict(costs)
    return out


def report(m: Marginals, steps: int, top: int = 30, width: int = 90) -> str:
    """A table per step: marginal us, calls, marginal and profiler duration per call."""
    lines = [
        f"span {m.span_us / steps:.1f} us/step = kernels {(m.span_us - m.idle_us) / steps:.1f} + idle {m.idle_us / steps:.1f}",
        f"{'us/step':>9} {'calls/step':>10} {'marg/call':>9} {'dur/call':>9}  kernel",
    ]
    for name, c in sorted(m.kernels.items(), key=lambda kv: -kv[1].marginal_us)[:top]:
        lines.append(
            f"{c.marginal_us / steps:9.1f} {c.calls / steps:10.1f} {c.marginal_us / c.calls:9.2f} "
            f"{c.duration_us / c.calls:9.2f}  {name[:width]}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="chrome trace JSON from one_batch --profile")
    ap.add_argument("--steps", type=int, default=1, help="decode steps in the trace (tables are per step)")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    with open(args.trace) as f:
        m = marginals(kernel_events(json.load(f)))
    print(report(m, max(1, args.steps), args.top))


if __name__ == "__main__":
    main()
