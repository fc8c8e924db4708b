"""Host-side cost of launching one quantized / dense linear (no sync): where an eager W8A8 prefill's
CPU time goes. python3 scripts/launch_overhead.py  (CUDA)"""

from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F
from mllmd_kernels import gemv, int8_quant, rmsnorm
from mllmd_kernels.int8_gemm import int8_gemm, w8a8_linear


def host_us(fn, n: int = 200) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return round(host, 1)


def main() -> None:
    dev = "cuda"
    for m in (1, 128, 2048):
        x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
        w8 = torch.randint(-127, 127, (6144, 4096), device=dev, dtype=torch.int8)
        s8 = torch.rand(6144, 1, device=dev) * 0.01
        wb = torch.randn(6144, 4096, device=dev, dtype=torch.bfloat16)
        q, s = int8_quant(x)
        nw = torch.ones(4096, device=dev, dtype=torch.bfloat16)
        cases = {
            "w8a8_linear": lambda: w8a8_linear(x, w8, s8),
            "int8_quant": lambda: int8_quant(x),
            "int8_gemm": lambda: int8_gemm(q, w8, s, s8, torch.bfloat16),
            "F.linear_bf16": lambda: F.linear(x, wb),
            "rmsnorm": lambda: rmsnorm(x, nw, 1e-6),
            "torch.empty": lambda: torch.empty((m, 6144), device=dev, dtype=torch.bfloat16),
        }
        if m == 1:
            cases["gemv_bf16"] = lambda: gemv(x, wb)
        for name, fn in cases.items():
            print(json.dumps({"m": m, "op": name, "host_us_per_call": host_us(fn)}))


if __name__ == "__main__":
    main()
