"""gemv vs cuBLAS (torch.nn.functional.linear) on the Qwen3-8B projection shapes, batch 1..64.

`--sweep-m 1 16 64` also times a list of tilings per (shape, M) and prints the best one (to tune
`pick_gemv_config`). `--config DIR/config.json ...` takes the projection shapes of those models
instead (Qwen3, Qwen3-VL, Qwen3.5: the smaller models' K = 2,048 projections tile differently).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mllmd_kernels._triton import next_pow2, num_sms
from mllmd_kernels.bench.common import (
    DEVICE,
    SMOKE,
    copy_bandwidth_gbps,
    emit,
    guarded,
    num_sets,
    row,
    time_calls,
)
from mllmd_kernels.gemv import GemvConfig, gemv, pick_gemv_config, with_auto_split
from mllmd_kernels.splitk import k_splits

# Qwen3-8B: hidden 4096, 32 q heads / 8 kv heads of 128, intermediate 12288, vocab 151936.
SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (24576, 4096),
    "down": (4096, 12288),
    "lm_head": (151936, 4096),
}
if SMOKE:
    SHAPES = {"qkv": (96, 64), "down": (64, 192)}


def config_shapes(path: str) -> dict[str, tuple[int, int]]:
    """The dense decode projections (N, K) of one model's config.json, named `model:projection`."""
    cfg = json.loads(Path(path).read_text())
    t = cfg.get("text_config", cfg)
    name = Path(path).parent.name or "model"
    h, heads, kv = t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"]
    d = t.get("head_dim") or h // heads
    hybrid = "layer_types" in t
    shapes = {
        "qkv": ((2 if hybrid else 1) * heads * d + 2 * kv * d, h),  # Qwen3.5: q_proj holds [query | gate]
        "o": (h, heads * d),
        "gate_up": (2 * t["intermediate_size"], h),
        "down": (h, t["intermediate_size"]),
        "lm_head": (t["vocab_size"], h),
    }
    if hybrid:  # the Gated DeltaNet layers' fused input projection (q|k|v, z, b, a) and output projection
        kd = t["linear_num_key_heads"] * t["linear_key_head_dim"]
        vd = t["linear_num_value_heads"] * t["linear_value_head_dim"]
        shapes["gdn_in"] = (2 * kd + 2 * vd + 2 * t["linear_num_value_heads"], h)
        shapes["gdn_out"] = (h, vd)
    return {f"{name}:{k}": v for k, v in shapes.items()}


def candidates(m: int) -> list[GemvConfig]:
    """Tilings to sweep (split-K is then derived per shape, and 1 is always tried too)."""
    bm = next_pow2(m)
    if m == 1:
        c = [GemvConfig(1, bn, bk, 1, w, st) for bn, bk, w, st in [
            (2, 2048, 4, 1), (4, 1024, 4, 1), (4, 2048, 8, 1), (8, 512, 4, 1), (8, 1024, 4, 1), (8, 1024, 8, 1),
            (16, 512, 4, 1), (16, 512, 8, 1), (16, 256, 4, 2), (8, 512, 4, 3), (32, 256, 4, 1), (16, 1024, 8, 1),
            (4, 2048, 4, 1), (2, 1024, 2, 1), (4, 512, 2, 1), (8, 256, 2, 2), (8, 256, 4, 3), (16, 256, 8, 3),
            (32, 128, 4, 3), (8, 1024, 8, 2)]]
        return c
    fma = [GemvConfig(bm, bn, bk, 1, w, 1) for bn, bk, w in [
        (2, 256, 4), (2, 512, 4), (2, 1024, 4), (4, 256, 4), (4, 512, 4), (4, 1024, 8), (8, 256, 4), (8, 512, 4),
        (2, 512, 8), (4, 256, 8), (16, 256, 8)] if bm <= 8 and bm * bn * bk <= 64 * 32 * w]  # <= 64 accumulators a thread
    if m <= 16:
        dot = [(64, 128, 4, 4), (32, 256, 4, 3), (64, 64, 4, 5)] + ([(64, 128, 8, 3), (32, 128, 4, 4)] if m == 16 else [])
        return fma + [GemvConfig(max(16, bm), bn, bk, 1, w, st) for bn, bk, w, st in dot]
    return [GemvConfig(bm, bn, bk, 1, w, st) for bn, bk, w, st in [
        (16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 64, 4, 5), (128, 64, 4, 4),
        (64, 128, 8, 3)]]


def _case(name: str, m: int, weights: list[torch.Tensor], g: torch.Generator, sweep: bool, copy_gbps: float) -> None:
    n, k = weights[0].shape
    dtype, sets, sms = weights[0].dtype, len(weights), num_sms()
    elt = weights[0].element_size()
    xs = [torch.randn(m, k, device=DEVICE, dtype=dtype, generator=g) for _ in range(sets)]
    outs = [torch.empty(m, n, device=DEVICE, dtype=dtype) for _ in range(sets)]
    ref = F.linear(xs[0], weights[0]).float()
    err = float((gemv(xs[0], weights[0]).float() - ref).norm() / ref.norm())
    nbytes = (n * k + m * k + m * n) * elt
    t_torch = time_calls(lambda i: F.linear(xs[i], weights[i]), sets)
    t_ours = time_calls(lambda i: gemv(xs[i], weights[i], out=outs[i]), sets)
    cfg = pick_gemv_config(m, n, k, sms)
    extra: dict[str, Any] = {"name": name, "M": m, "rel_err_vs_cublas": round(err, 5), "config": cfg.__dict__}
    if sweep:
        best = (t_ours, cfg)
        for cand in candidates(m):
            auto = with_auto_split(cand, n, k, sms)
            for split in sorted({auto.split_k, 1} | ({2, 4} if m == 1 else set())):
                if k_splits(k, split, cand.block_k)[1] != split:
                    continue
                c = GemvConfig(cand.block_m, cand.block_n, cand.block_k, split, cand.num_warps, cand.num_stages)
                try:
                    t = time_calls(lambda i, c=c: gemv(xs[i], weights[i], out=outs[i], config=c), sets, reps=7)
                except Exception as exc:  # noqa: BLE001 - a tiling that does not compile is skipped
                    print(f"# {name} M={m} {c}: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                emit({"kernel": "gemv_sweep", "name": name, "M": m, "dtype": str(dtype)[6:], "config": c.__dict__,
                      "us": round(t, 2)})
                if t < best[0]:
                    best = (t, c)
        extra.update(best_us=round(best[0], 2), best_config=best[1].__dict__)
    emit(row("gemv", f"{name} M={m} N={n} K={k}", dtype, t_ours, t_torch, nbytes, copy_gbps, **extra))


def bench(ms: list[int], dtypes: list[torch.dtype], sweep_ms: list[int], copy_gbps: float,
          shapes: dict[str, tuple[int, int]]) -> None:
    for name, (n, k) in shapes.items():
        for dtype in dtypes:
            sets = num_sets(n * k * torch.empty((), dtype=dtype).element_size(), cap=16)
            g = torch.Generator(device=DEVICE).manual_seed(n + k)
            weights = [torch.randn(n, k, device=DEVICE, dtype=dtype, generator=g) * k**-0.5 for _ in range(sets)]
            for m in ms:
                guarded(_case, name, m, weights, g, m in sweep_ms, copy_gbps)
            del weights
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--dtype", nargs="+", default=["bfloat16"])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--config", nargs="*", default=[], help="models' config.json: their shapes instead of Qwen3-8B's")
    p.add_argument("--sweep-m", type=int, nargs="*", default=[], help="batch sizes to sweep tilings for")
    args = p.parse_args(argv)
    dtypes = [getattr(torch, d) for d in args.dtype]
    shapes = {name: SHAPES[name] for name in args.shapes}
    if args.config:
        shapes = {name: nk for path in args.config for name, nk in config_shapes(path).items()}
    bench(args.m, dtypes, args.sweep_m, copy_bandwidth_gbps(), shapes)


if __name__ == "__main__":
    main()
