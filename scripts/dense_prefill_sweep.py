"""Fresh-prompt attention: the paged extend kernel against gather + SDPA (the Triton backend's dense
route), by prompt length and head shape, one JSON line per case (us per layer: eager launches timed by
`mllmd_kernels.bench.common.time_calls`, median of 20). Sets `dense_pays` in
mllmd/engine/attention/triton_backend.py.

    python scripts/dense_prefill_sweep.py [--lens 256 512 1024 2048 4096]
"""

from __future__ import annotations

import argparse
import json

import torch
from mllmd_kernels import extend_attention
from mllmd_kernels.bench.common import time_calls

from mllmd.engine.attention.triton_backend import dense_causal_attention

SHAPES = {"qwen3-8b": (32, 8, 128), "qwen3-vl-2b": (16, 8, 128), "qwen3.5-9b": (16, 4, 256)}


def case(name: str, hq: int, hkv: int, d: int, n: int) -> dict[str, object]:
    dev = torch.device("cuda")
    k_buf = torch.randn(n + 1, hkv, d, device=dev, dtype=torch.bfloat16)
    v_buf = torch.randn_like(k_buf)
    slots = torch.randperm(n, device=dev) + 1
    table = slots[None].clone()
    q = torch.randn(n, hq, d, device=dev, dtype=torch.bfloat16)
    lens, rows = torch.tensor([n], device=dev), torch.zeros(1, dtype=torch.int64, device=dev)
    scale = d**-0.5

    def paged() -> torch.Tensor:
        return extend_attention(q, k_buf, v_buf, table, rows, lens, lens, rows, n, scale)

    def dense() -> torch.Tensor:
        return dense_causal_attention(q, k_buf, v_buf, slots, [(0, n)], scale)

    # eager launches: the dense route's gather and SDPA run eagerly in the engine too
    paged_us, dense_us = (time_calls(lambda i, f=f: f(), 1, use_graph=False, reps=20) for f in (paged, dense))
    a, b = paged().float(), dense().float()
    flops = 4 * hq * d * n * (n + 1) // 2
    return {"case": "dense_prefill", "shape": name, "tokens": n, "paged_us": round(paged_us, 1),
            "dense_us": round(dense_us, 1), "speedup": round(paged_us / dense_us, 2),
            "paged_tflops": round(flops / paged_us / 1e6, 1), "dense_tflops": round(flops / dense_us / 1e6, 1),
            "rel_diff": float((a - b).norm() / b.norm())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    args = ap.parse_args()
    for name, (hq, hkv, d) in SHAPES.items():
        for n in args.lens:
            print(json.dumps(case(name, hq, hkv, d, n)), flush=True)


if __name__ == "__main__":
    main()
