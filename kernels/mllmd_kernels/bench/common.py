"""Timing helpers: CUDA-graph replay over rotating input sets (so L2 holds none of them), medians."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import torch

from mllmd_kernels import knobs

L2_DEFEAT_BYTES = 512 << 20  # rotate inputs until this many bytes separate two uses of one set
# Smoke mode (MLLMD_BENCH_SMOKE=1): tiny shapes on the CPU under TRITON_INTERPRET=1, to check that
# the benchmark scripts run before spending device time; its numbers mean nothing.
SMOKE = knobs.bench_smoke()
DEVICE = "cpu" if SMOKE else "cuda"

_LOG: TextIO | None = None
ROWS: list[dict[str, Any]] = []


def set_log(f: TextIO | None) -> None:
    global _LOG
    _LOG = f


def emit(row: dict[str, Any]) -> None:
    """Print one JSON line (and keep it for the final table)."""
    line = json.dumps(row, sort_keys=False)
    print(line, flush=True)
    if _LOG is not None:
        _LOG.write(line + "\n")
        _LOG.flush()
    ROWS.append(row)


def guarded(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Run one benchmark case; an exception is reported as a JSON line and the run goes on."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001
        emit({"kernel": getattr(fn, "__name__", "?"), "args": repr(args)[:200], "error": f"{type(exc).__name__}: {exc}"[:500]})
        if not SMOKE:
            torch.cuda.synchronize()


def num_sets(bytes_per_set: int, cap: int = 32) -> int:
    return max(2, min(cap, -(-L2_DEFEAT_BYTES // max(1, bytes_per_set))))


def time_calls(fn: Callable[[int], Any], sets: int, use_graph: bool = True, reps: int = 15) -> float:
    """Median microseconds of one fn(i) call, with fn cycling over `sets` input sets.

    Captures `inner` calls in a CUDA graph and times replays with events (launch gaps as in a
    graph-captured decode step); falls back to timing eager launches if capture fails.
    """
    inner = max(sets, 8)
    if SMOKE:
        fn(0)
        t0 = time.perf_counter()
        for i in range(sets):
            fn(i)
        return (time.perf_counter() - t0) * 1e6 / sets
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(inner):
            fn(i % sets)  # compile / autotune / allocate outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()

    def run_eager() -> None:
        for i in range(inner):
            fn(i % sets)

    runner: Callable[[], None] = run_eager
    if use_graph:
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run_eager()
            runner = graph.replay
        except Exception as exc:  # pragma: no cover - depends on the kernel
            print(f"# graph capture failed ({type(exc).__name__}: {exc}); timing eager launches", file=sys.stderr)
            torch.cuda.synchronize()
    runner()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / inner)
    return statistics.median(times)


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy of 2 GiB, counting bytes read + written (GB/s): the best of an eager
    copy_ (cudaMemcpyAsync, seen at ~4.2 TB/s on an H200), a captured one (a graph memcpy node, which
    can run slower) and an SM copy kernel (x * 1)."""
    n = (1 << 31) // 2 if not SMOKE else 1 << 16
    src = torch.randn(n, device=DEVICE, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    times = [
        time_calls(lambda i: dst.copy_(src), sets=1, use_graph=False, reps=10),
        time_calls(lambda i: dst.copy_(src), sets=1, use_graph=True, reps=10),
        time_calls(lambda i: torch.mul(src, 1, out=dst), sets=1, use_graph=True, reps=10),
    ]
    print(f"# copy 2 GiB: eager {times[0]:.1f} us, graph {times[1]:.1f} us, mul kernel {times[2]:.1f} us", flush=True)
    return 2 * n * 2 / (min(times) * 1e-6) / 1e9


def row(kernel: str, shape: str, dtype: torch.dtype, ours_us: float, torch_us: float, nbytes: int,
        copy_gbps: float, **extra: Any) -> dict[str, Any]:
    gbps = nbytes / (ours_us * 1e-6) / 1e9
    return {
        "kernel": kernel,
        "shape": shape,
        "dtype": str(dtype).replace("torch.", ""),
        "ours_us": round(ours_us, 2),
        "torch_us": round(torch_us, 2),
        "speedup": round(torch_us / ours_us, 3),
        "gbps": round(gbps, 1),
        "torch_gbps": round(nbytes / (torch_us * 1e-6) / 1e9, 1),
        "copy_gbps": round(copy_gbps, 1),
        "frac_copy": round(gbps / copy_gbps, 3),
        **extra,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ["kernel", "shape", "dtype", "ours_us", "torch_us", "speedup", "gbps", "frac_copy"]
    data = [[str(r.get(c, "")) for c in cols] for r in rows if "ours_us" in r]
    widths = [max(len(c), *(len(d[i]) for d in data)) if data else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for d in data:
        print("  ".join(v.ljust(w) for v, w in zip(d, widths)))
