"""Host-side cost of launching one quantized / dense linear (no sync): where an eager W8A8 prefill's
CPU time goes. python3 scripts/launch_overhead.py  (CUDA)"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from mllmd_kernels import gemv, int8_quant, rmsnorm
from mllmd_kernels.int8_config import Int8GemmConfig
from mllmd_kernels.int8_gemm import int8_gemm, w8a8_linear
from mllmd_kernels.int8_gemm_tma import tma_supported


def host_us(fn: Callable[[], object], n: int = 200) -> float:
    """Host microseconds per call of fn, the device left to run behind (synchronized only at the end)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return round(host, 1)


def cases(m: int, dev: str = "cuda") -> dict[str, Callable[[], object]]:
    """The ops of one linear layer's step at m rows (Qwen3-8B qkv: N 6144, K 4096)."""
    x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
    w8 = torch.randint(-127, 127, (6144, 4096), device=dev, dtype=torch.int8)
    s8 = torch.rand(6144, 1, device=dev) * 0.01
    wb = torch.randn(6144, 4096, device=dev, dtype=torch.bfloat16)
    q, s = int8_quant(x)
    nw = torch.ones(4096, device=dev, dtype=torch.bfloat16)
    out: dict[str, Callable[[], object]] = {
        "w8a8_linear": lambda: w8a8_linear(x, w8, s8),
        "int8_quant": lambda: int8_quant(x),
        "int8_gemm": lambda: int8_gemm(q, w8, s, s8, torch.bfloat16),
        "F.linear_bf16": lambda: F.linear(x, wb),
        "rmsnorm": lambda: rmsnorm(x, nw, 1e-6),
        "torch.empty": lambda: torch.empty((m, 6144), device=dev, dtype=torch.bfloat16),
    }
    if m == 1:
        out["gemv_bf16"] = lambda: gemv(x, wb)
    if m > 128 and tma_supported(q, w8):  # host-built tensor descriptors on every launch (sm90+)
        cfg = Int8GemmConfig("tma", 128, 128, 64, 8, 1, 4, 5)
        out["int8_gemm_tma"] = lambda: int8_gemm(q, w8, s, s8, torch.bfloat16, config=cfg)
    return out


def main() -> None:
    for m in (1, 128, 2048):
        for name, fn in cases(m).items():
            print(json.dumps({"m": m, "op": name, "host_us_per_call": host_us(fn)}))


if __name__ == "__main__":
    main()
