"""One launch of each batch-1 decode GEMV on the Qwen3-8B projection shapes, for Nsight Compute.

    ncu --clock-control none --kernel-name regex:gemv --section SpeedOfLight --section WarpStateStats \
        python3 scripts/ncu_gemv.py [--kinds w4a16 int8 bf16] [--shapes qkv o gate_up down]

(`gpu_acceptance.sh ncu` runs it so.) Each kernel is launched twice with fresh weights and only the
second launch is meant to be read (the first compiles it). No timing here: bench_quant times them;
this gives ncu the launches to read the stall reasons and the memory throughput of. Under
MLLMD_BENCH_SMOKE=1 TRITON_INTERPRET=1 it runs tiny shapes on the CPU (a check that it runs)."""

from __future__ import annotations

import argparse

import torch
from mllmd_kernels import gemv, splitk_counter_len, w4a16_gemm
from mllmd_kernels.bench.common import DEVICE, SMOKE
from mllmd_kernels.int8_gemm import int8_gemm
from mllmd_kernels.int8_quant import int8_quant

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
GROUP = 128
if SMOKE:
    SHAPES, GROUP = {name: (n // 64, k // 32) for name, (n, k) in SHAPES.items()}, 32


def launch(kind: str, n: int, k: int) -> None:
    """Two launches of one kind of one-row GEMM (random weights, fresh each time)."""
    x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
    for _ in range(2):
        if kind == "w4a16":
            w = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), device=DEVICE, dtype=torch.int32)
            s = (torch.rand(k // GROUP, n, device=DEVICE) * 1e-3 + 1e-4).t()
            counters = torch.zeros(splitk_counter_len(n), dtype=torch.int32, device=DEVICE)
            w4a16_gemm(x, w, s, splitk_counters=counters)
        elif kind == "int8":
            w8 = torch.randint(-127, 128, (n, k), device=DEVICE, dtype=torch.int8)
            q, qs = int8_quant(x)
            int8_gemm(q, w8, qs, torch.rand(n, 1, device=DEVICE) * 1e-3, torch.bfloat16)
        else:
            gemv(x, torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16))
        if not SMOKE:
            torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kinds", nargs="+", default=["w4a16", "int8", "bf16"], choices=["w4a16", "int8", "bf16"])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = p.parse_args()
    for kind in args.kinds:
        for name in args.shapes:
            print(f"# {kind} {name} {SHAPES[name]}", flush=True)
            launch(kind, *SHAPES[name])


if __name__ == "__main__":
    main()
