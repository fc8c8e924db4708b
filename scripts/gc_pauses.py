"""Python's garbage-collection pauses in each mllmd process while it serves (mllmd/heap.py's figure).

Starts the daemon on MODEL with a `sitecustomize` that times every collection in every process, waits
for /health, sends N chat completions (16 at a time, half streamed), stops the daemon, and prints one
JSON line a process: its collections by generation after start-up (count, total and longest ms), the
objects a collection still visits and the frozen ones (collections at exit left out). Run it from the tree to measure:

    python scripts/gc_pauses.py /path/to/model --requests 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HOOK = '''
import gc, json, os, sys, time
_rows, _t = [], [0.0]
def _dump():
    cut = os.environ["MLLMD_GC_PROBE_DIR"] + "/serving"
    if not os.path.exists(cut):
        return
    since = os.path.getmtime(cut)
    done = os.environ["MLLMD_GC_PROBE_DIR"] + "/done"
    until = os.path.getmtime(done) if os.path.exists(done) else float("inf")  # not the collections at exit
    row = {"process": " ".join(sys.argv[:2]).rsplit("/", 1)[-1], "pid": os.getpid(),
           "visited_objects": len(gc.get_objects()), "frozen_objects": gc.get_freeze_count()}
    for g in (0, 1, 2):
        s = [d for gen, d, w in _rows if gen == g and since < w < until]
        row[f"gen{g}"] = {"n": len(s), "total_ms": round(sum(s) * 1e3, 2), "max_ms": round(max(s, default=0) * 1e3, 2)}
    with open(os.environ["MLLMD_GC_PROBE_DIR"] + f"/gc-{os.getpid()}.json", "w") as f:
        json.dump(row, f)
def _cb(phase, info):
    if phase == "start":
        _t[0] = time.perf_counter()
    else:
        _rows.append((info["generation"], time.perf_counter() - _t[0], time.time()))
        _dump()
gc.callbacks.append(_cb)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _load(base: str, n: int, concurrency: int) -> float:
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            body = {"messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 16, "stream": i % 2 == 0}
            async with sem:
                if body["stream"]:
                    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                        async for _ in r.aiter_lines():
                            pass
                else:
                    (await c.post("/v1/chat/completions", json=body)).raise_for_status()

        t = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "sitecustomize.py").write_text(HOOK)
        port = _free_port()
        env = {**os.environ, "MLLMD_GC_PROBE_DIR": tmp, "STATE_DIRECTORY": tmp,
               "PYTHONPATH": os.pathsep.join([tmp, os.getcwd(), os.path.join(os.getcwd(), "kernels"),
                                              os.environ.get("PYTHONPATH", "")])}
        daemon = subprocess.Popen([sys.executable, "-m", "mllmd.cli", "--config", "/dev/null", "--model.path", args.model,
                                   "--server.port", str(port), "--server.unix_socket", ""], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        try:
            for _ in range(300):
                try:
                    if httpx.get(base + "/health", timeout=2).json().get("state") == "ready":
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            else:
                raise SystemExit("the daemon did not become ready")
            Path(tmp, "serving").touch()
            seconds = asyncio.run(_load(base, args.requests, args.concurrency))
            Path(tmp, "done").touch()
            time.sleep(0.05)
        finally:
            daemon.terminate()
            daemon.wait(60)
        print(json.dumps({"requests": args.requests, "seconds": round(seconds, 1)}))
        for f in sorted(Path(tmp).glob("gc-*.json")):
            print(f.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
