"""Daemon-like load on the offline engine (staggered arrivals: mixed prefill + decode steps, padded
decode graphs, radix cache): run each variant in a subprocess and report ok / the error.

    python3 scripts/gpu_mixed_batches.py MODEL_DIR [variant ...]
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time

VARIANTS = {
    "graphs": {"disable_cuda_graph": False},
    "no_graph": {},
    "graphs_no_radix": {"disable_cuda_graph": False, "disable_radix_cache": True},
    "torch_attn": {"attention_backend": "torch"},
    "no_graph_no_radix": {"disable_radix_cache": True},
}


def run_one(model: str, kw: dict) -> None:
    import random

    from mllmd import SamplingParams
    from mllmd.config import EngineConfig
    from mllmd.engine.engine import Engine

    # prefill_wait_ms 0: the batches depend on the step count only, so the variants' tokens compare
    engine = Engine(EngineConfig.from_kwargs(model, max_running_requests=64, prefill_wait_ms=0.0, **kw))
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 150000) for _ in range(256)] for _ in range(160)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    t0, steps, done, i = time.time(), 0, 0, 0
    digest = hashlib.sha256()
    while i < len(prompts) or engine.has_unfinished():
        for _ in range(min(8, len(prompts) - i)):
            if len(engine.reqs) < 64:
                engine.add_request(f"r{i}", prompts[i], params)
                i += 1
        for out in engine.step():
            done += out.finished
            digest.update(f"{out.rid}:{out.new_token_ids};".encode())
        steps += 1
    print(json.dumps({"finished": done, "steps": steps, "seconds": round(time.time() - t0, 2),
                      "tokens_sha256": digest.hexdigest()[:16]}))


if __name__ == "__main__":
    if sys.argv[1] == "--one":
        run_one(sys.argv[2], json.loads(sys.argv[3]))
        sys.exit(0)
    model = sys.argv[1]
    for name in sys.argv[2:] or list(VARIANTS):
        p = subprocess.run(
            [sys.executable, __file__, "--one", model, json.dumps(VARIANTS[name])],
            capture_output=True, text=True, timeout=240,
        )
        tail = (p.stdout + p.stderr).strip().splitlines()
        err = [ln for ln in tail if "Error" in ln or "error" in ln or "File " in ln][-12:]
        print(f"== {name}: rc={p.returncode}", tail[-1] if p.returncode == 0 else "\n".join(err), flush=True)
