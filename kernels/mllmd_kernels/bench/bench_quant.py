"""Quantized GEMMs on the Qwen3-8B projection shapes: W8A8 (int8_quant + int8_gemm) and W4A16 (group
128) against bf16 F.linear (cuBLAS) and torch._int_mm (cuBLASLt int8, the activations already int8).

    python3 -m mllmd_kernels.bench.bench_quant --out DIR [--m 1 16 64 2048] [--shapes qkv o]
        [--sweep [int8 w4a16]]

One JSON line per (kernel, shape, M): us (median of CUDA-graph replays over rotating weight sets,
so L2 holds none of them), TOPS / TFLOPS, GB/s of weight bytes read (int8: N*K, int4: N*K/2 plus
the scales; bf16: 2*N*K), speedup over bf16, and rel_err of one output against the kernel's torch
reference (`w8a8_linear_ref`: exact integer sums; `w4a16_gemm_ref`: dequantize + float32 matmul).
Kernels: "w8a8" = per-token quantization + int8 GEMM (what a W8A8 layer runs), "int8_gemm" = the GEMM
alone on int8 activations (compare with "int_mm"), "w4a16" (split-K reduced inside the launch with
counters, as a W4A16 layer does; `us_reduce_launch`: the same with the separate reduce launch),
"bf16", up to M = 32 "w4a16_mma" (the CUDA tensor-core kernel, where nvcc builds it) and from M = 2
"w4a16_tile_order" (the Triton tiling on that kernel's word order, as a layer holds the words), from M = 65
"w4a16_dequant_cublas", and at M = 1 on gate_up "int8_gemm_silu_mul" (the
gemv with silu(gate) * up in its epilogue; `us_two_launches`: int8_gemm then silu_and_mul).
`--sweep` also times a list of tilings per case (on sm90 the int8 list includes the TMA tilings of
int8_gemm_tma; at M = 1 each gemv tiling with and without dp4a, for the GEMM on int8 rows and
for the one-row w8a8_gemv with the quantization fused in) and prints the best (to tune pick_int8_config / pick_w4a16_config;
every W4A16 candidate's output is checked against the reference). At M = 1 the w4a16 sweep also emits
"w4a16_probe" lines (PROBE_TILINGS with load_only / tiled_w), and `--w4a16-tuned-out FILE` writes the
best one-row tiling per shape in MLLMD_W4A16_TUNED's format. Under
MLLMD_BENCH_SMOKE=1 TRITON_INTERPRET=1 it runs tiny shapes on the CPU (numbers meaningless).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from mllmd_kernels import w4a16_mma as mma
from mllmd_kernels._triton import num_sms
from mllmd_kernels.activation import silu_and_mul
from mllmd_kernels.bench.common import (
    DEVICE,
    SMOKE,
    copy_bandwidth_gbps,
    emit,
    guarded,
    num_sets,
    print_table,
    set_log,
    time_calls,
)
from mllmd_kernels.int8_config import Int8GemmConfig, pick_int8_config
from mllmd_kernels.int8_gemm import int8_gemm, int8_gemm_silu_mul, w8a8_linear, w8a8_linear_ref
from mllmd_kernels.int8_gemm_tma import TMA_MODES, tma_supported
from mllmd_kernels.int8_gemv import w8a8_gemv
from mllmd_kernels.int8_quant import int8_quant
from mllmd_kernels.rmsnorm import rmsnorm
from mllmd_kernels.splitk import auto_split
from mllmd_kernels.tiling import max_shared_memory
from mllmd_kernels.w4a16_config import W4A16Config, pick_w4a16_config, splitk_counter_len
from mllmd_kernels.w4a16_dequant import w4a16_dequantize
from mllmd_kernels.w4a16_gemm import w4a16_gemm, w4a16_gemm_ref
from mllmd_kernels.w4a16_gemv import tile_words

# Qwen3-8B: hidden 4096, 32 q heads / 8 kv heads of 128, intermediate 12288.
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
MS = [1, 16, 64, 128, 256, 2048]  # 128 and 256: either side of DEQUANT_MIN_ROWS (W4A16)
GROUP = 128
TMA_OK = False  # set in main: the Hopper TMA tilings are swept only where they run
if SMOKE:
    SHAPES, MS, GROUP = {"qkv": (96, 256), "down": (64, 384)}, [1, 5, 40], 64


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    return round(float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)), 6)


def _line(kernel: str, name: str, m: int, n: int, k: int, us: float, bf16_us: float | None, wbytes: int,
          copy_gbps: float, **extra: Any) -> dict[str, Any]:  # fmt: skip
    ops = 2 * m * n * k / (us * 1e-6) / 1e12
    gbps = wbytes / (us * 1e-6) / 1e9
    out = {"kernel": kernel, "shape": f"{name} M={m} N={n} K={k}", "dtype": "bfloat16", "us": round(us, 2),
           "tops" if kernel in ("w8a8", "int8_gemm", "int_mm") else "tflops": round(ops, 1),
           "weight_gbps": round(gbps, 1), "frac_copy": round(gbps / copy_gbps, 3)}  # fmt: skip
    if bf16_us is not None:  # print_table's columns: ours against cuBLAS bf16
        out.update(
            ours_us=round(us, 2),
            torch_us=round(bf16_us, 2),
            speedup=round(bf16_us / us, 3),
            gbps=round(gbps, 1),
        )
    return {**out, **extra}


def _int8_candidates(m: int, n: int, k: int) -> list[Int8GemmConfig]:
    sms = num_sms()
    if m <= 64:
        bm = max(16, 1 << (m - 1).bit_length())
        out = []
        if m == 1:  # the gemv: (block_n, block_k, warps, stages), K split for ~2 and ~4 programs per SM.
            # (16, 2048, 4) and (16, 4096, 8) put every warp along K: on int8 rows their dp4a loop has no
            # shared-memory exchange of the activation words (Triton 3.6 sm_90 PTX: no bar.sync in the
            # loop, against two a K step for (16, 1024, 4), the default for qkv and gate_up).
            for bn, bk, warps, stages in [(16, 1024, 4, 1), (16, 2048, 8, 1), (32, 512, 4, 1), (8, 1024, 4, 1),
                                          (32, 1024, 8, 1), (16, 1024, 4, 3), (16, 2048, 4, 1),
                                          (16, 4096, 8, 1)]:  # fmt: skip
                tiles = -(-n // bn)
                splits = {1, auto_split(tiles, k, bk, sms, 2, 2), auto_split(tiles, k, bk, sms, 4, 2)}
                out += [Int8GemmConfig("gemv", 1, bn, bk, 1, s, warps, stages, dp4a=d)
                        for s in sorted(splits) for d in (False, True)]  # fmt: skip
        for bn, bk, warps, stages in [(64, 256, 4, 4), (32, 256, 4, 4), (64, 128, 4, 4), (128, 128, 4, 3),
                                      (128, 256, 8, 3), (64, 512, 4, 3), (32, 512, 4, 3)]:  # fmt: skip
            for split in sorted(
                {1, auto_split(-(-n // bn), k, bk, sms), auto_split(-(-n // bn), k, bk, sms, 4)}
            ):
                out.append(Int8GemmConfig("skinny", bm, bn, bk, 1, split, warps, stages))
        return out
    tma = [Int8GemmConfig(mode, bm, bn, bk, 8, 1, w, st) for mode in TMA_MODES for bm, bn, bk, w, st in [
        (128, 128, 64, 4, 5), (128, 256, 64, 8, 4), (128, 256, 128, 8, 3), (256, 128, 64, 8, 4),
        (128, 128, 128, 4, 4), (128, 128, 128, 8, 4)]] if TMA_OK else []  # fmt: skip
    return tma + [Int8GemmConfig("gemm", bm, bn, bk, gm, 1, w, st) for bm, bn, bk, gm, w, st in [
        (128, 256, 128, 8, 8, 3), (128, 128, 128, 8, 8, 4), (128, 128, 128, 8, 4, 4), (128, 256, 64, 8, 8, 4),
        (256, 128, 128, 8, 8, 3), (128, 128, 64, 8, 4, 5), (64, 128, 128, 8, 4, 4), (64, 256, 128, 8, 4, 3),
        (128, 256, 128, 8, 8, 4), (256, 128, 64, 8, 8, 4), (128, 256, 64, 8, 8, 5), (128, 128, 256, 8, 8, 3),
        (128, 256, 128, 4, 8, 3), (128, 256, 128, 16, 8, 3), (256, 128, 128, 8, 8, 4), (128, 128, 128, 8, 8, 5)]]  # fmt: skip


def _w4a16_candidates(m: int, n: int, k: int) -> list[W4A16Config]:
    sms = num_sms()
    out = []
    if m == 1:  # the gemv: (block_n, block_k, warps, stages, sub_steps); sub_steps * 64 contiguous bytes
        # a row per loop trip (DRAM locality) at the same registers; K split for ~4-16 programs per SM
        # stages 1: no shared-memory pipeline, the trip's words loaded straight into registers (as the
        # int8 gemv does). Tilings of 256 weights a thread per step are not in the list: no faster on
        # any shape, and the model step slower with their picks (these sweeps' figures: NOTES.md)
        for bn, bk, warps, stages, sub in [
            (64, 128, 2, 4, 1), (64, 128, 2, 3, 2), (16, 128, 2, 1, 8), (16, 128, 2, 1, 16), (32, 128, 2, 1, 4),
            (32, 128, 2, 1, 8), (64, 128, 2, 1, 2), (64, 128, 2, 1, 4), (16, 128, 1, 1, 8), (32, 128, 4, 1, 8),
            (64, 128, 4, 1, 4), (16, 128, 2, 2, 8), (64, 128, 2, 1, 1), (32, 128, 1, 1, 4)]:  # fmt: skip
            tiles = -(-n // bn)
            splits = {auto_split(tiles, k, bk * sub, sms, c, 2) for c in (2, 4, 8, 16)}
            out += [W4A16Config("gemv", 1, bn, bk, 1, s, warps, stages, sub) for s in sorted(splits)]
        return out
    if m <= 64:
        bm = max(16, 1 << (m - 1).bit_length())
        for bn, bk, warps, stages in [(64, 128, 4, 4), (32, 128, 4, 4), (128, 128, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3),
                                 (128, 128, 8, 3), (256, 64, 8, 3)]:
            tiles = -(-n // bn)
            splits = {1} | {auto_split(tiles, k, bk, sms, c, 2) for c in (2, 4, 8, 16)}
            out += [W4A16Config("skinny", bm, bn, bk, 1, s, warps, stages) for s in sorted(splits)]
        return out
    return [W4A16Config("gemm", bm, bn, bk, 8, 1, w, st) for bm, bn, bk, w, st in [
        (64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3), (64, 256, 64, 4, 3),
        (128, 64, 64, 4, 4), (64, 64, 128, 4, 4), (128, 128, 32, 4, 4), (256, 128, 64, 8, 3), (128, 128, 64, 4, 5)]]  # fmt: skip


def _sweep(kernel: str, name: str, m: int, default_us: float, default_cfg: Any, cands: list[Any],
           run: Callable[[int, Any], Any], sets: int,
           check: Callable[[torch.Tensor], float] | None = None) -> dict[str, Any]:  # fmt: skip
    best = (default_us, default_cfg)
    for c in cands:
        try:
            t = time_calls(lambda i, c=c: run(i, c), sets, reps=7)
        except Exception as exc:  # noqa: BLE001 - a tiling that does not compile or fit is skipped
            print(f"# {kernel} {name} M={m} {c}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        line = {"kernel": f"{kernel}_sweep", "name": name, "M": m, "config": c.__dict__, "us": round(t, 2)}
        if check is not None:  # every candidate's output against the reference: a fast wrong tiling cannot win
            line["rel_err"] = check(run(0, c))
            if line["rel_err"] > 2e-2:
                emit({**line, "error": "wrong output"})
                continue
        emit(line)
        if t < best[0]:
            best = (t, c)
    return {"best_us": round(best[0], 2), "best_config": best[1].__dict__}


def _shape(name: str, ms: list[int], copy_gbps: float, sweep: list[str]) -> None:
    """Random weights of each kind for one projection (rotating sets), then every M."""
    n, k = SHAPES[name]
    g = torch.Generator(device=DEVICE).manual_seed(n + k)
    sets16, sets8, sets4 = num_sets(n * k * 2, cap=16), num_sets(n * k, cap=32), num_sets(n * k // 2, cap=32)
    w: dict[str, Any] = {
        "w16": [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16, generator=g) * k**-0.5 for _ in range(sets16)],
        "w8": [torch.randint(-127, 128, (n, k), device=DEVICE, dtype=torch.int8, generator=g) for _ in range(sets8)],
        "s8": [torch.rand(n, 1, device=DEVICE, generator=g) * 1e-3 / k**0.5 + 1e-5 for _ in range(sets8)],
        # any int32 is a valid word of eight int4 values; scales column-major as TritonW4A16Kernel keeps them
        "w4": [torch.randint(-(2**31), 2**31 - 1, (n, k // 8), device=DEVICE, dtype=torch.int32, generator=g)
               for _ in range(sets4)],
        "s4": [(torch.rand(k // GROUP, n, device=DEVICE, generator=g) * 0.02 / k**0.5 + 1e-4).t()
               for _ in range(sets4)],
    }  # fmt: skip
    for m in ms:
        guarded(_case, name, m, w, g, copy_gbps, sweep)


def _case(name: str, m: int, w: dict[str, Any], g: torch.Generator, copy_gbps: float, sweep: list[str]) -> None:
    w16, w8, s8, w4, s4 = w["w16"], w["w8"], w["s8"], w["w4"], w["s4"]
    sets16, sets8, sets4 = len(w16), len(w8), len(w4)
    n, k = w16[0].shape
    bf = torch.bfloat16
    sms, smem = num_sms(), max_shared_memory(w8[0])
    sets = max(sets16, sets8, sets4)
    xs = [torch.randn(m, k, device=DEVICE, dtype=bf, generator=g) for _ in range(sets)]
    qx = [int8_quant(x) for x in xs]
    t16 = time_calls(lambda i: F.linear(xs[i], w16[i % sets16]), sets)
    emit(_line("bf16", name, m, n, k, t16, t16, n * k * 2, copy_gbps))

    cfg8 = pick_int8_config(m, n, k, sms, smem)
    err = _rel(w8a8_linear(xs[0], w8[0], s8[0]), w8a8_linear_ref(xs[0], w8[0], s8[0]))
    t = time_calls(lambda i: w8a8_linear(xs[i], w8[i % sets8], s8[i % sets8]), sets)
    extra = {}
    if m == 1 and "int8" in sweep:  # the fused one-row launch (what w8a8_linear runs for qkv, gate_up)

        def fused(i: int, c: Int8GemmConfig | None = None) -> torch.Tensor:
            return w8a8_gemv(xs[i], w8[i % sets8], s8[i % sets8], config=c)

        extra = _sweep("w8a8_gemv", name, m, time_calls(fused, sets), cfg8, [c for c in _int8_candidates(1, n, k) if c.mode == "gemv"], fused, sets)
    emit(_line("w8a8", name, m, n, k, t, t16, n * k, copy_gbps, rel_err=err, config=cfg8.__dict__, **extra))

    if m == 1 and name == "gate_up":  # silu(gate) * up in the gemv's epilogue against a second launch
        t_sep = time_calls(lambda i: silu_and_mul(int8_gemm(qx[i][0], w8[i % sets8], qx[i][1], s8[i % sets8], bf)), sets)
        t_fused = time_calls(lambda i: int8_gemm_silu_mul(qx[i][0], w8[i % sets8], qx[i][1], s8[i % sets8], bf), sets)
        emit(_line("int8_gemm_silu_mul", name, m, n, k, t_fused, t16, n * k, copy_gbps, us_two_launches=round(t_sep, 2)))

    def gemm8(i: int, c: Int8GemmConfig | None = None) -> torch.Tensor:
        return int8_gemm(qx[i][0], w8[i % sets8], qx[i][1], s8[i % sets8], bf, config=c)

    t = time_calls(gemm8, sets)
    extra = _sweep("int8_gemm", name, m, t, cfg8, _int8_candidates(m, n, k), gemm8, sets) if "int8" in sweep else {}
    emit(_line("int8_gemm", name, m, n, k, t, t16, n * k, copy_gbps, config=cfg8.__dict__, **extra))
    if m > 16 and not SMOKE:  # cuBLASLt int8 needs M > 16
        t = time_calls(lambda i: torch._int_mm(qx[i][0], w8[i % sets8].t()), sets)
        emit(_line("int_mm", name, m, n, k, t, t16, n * k, copy_gbps))

    counters = torch.zeros(splitk_counter_len(n), dtype=torch.int32, device=DEVICE)  # as a W4A16 layer has

    def gemm4(i: int, c: W4A16Config | None = None, serial: bool = True) -> torch.Tensor:
        return w4a16_gemm(xs[i], w4[i % sets4], s4[i % sets4], config=c, splitk_counters=counters if serial else None)

    cfg4 = pick_w4a16_config(m, n, k, GROUP, sms, smem)
    ref4 = w4a16_gemm_ref(xs[0], w4[0], s4[0])
    err = _rel(gemm4(0), ref4)
    t = time_calls(gemm4, sets)
    extra = (_sweep("w4a16", name, m, t, cfg4, _w4a16_candidates(m, n, k), gemm4, sets, lambda out: _rel(out, ref4))
             if "w4a16" in sweep else {})  # fmt: skip
    if cfg4.split_k > 1:  # the same launch with the partials added by a second launch, for comparison
        extra["us_reduce_launch"] = round(time_calls(lambda i: gemm4(i, serial=False), sets), 2)
    w4_bytes = n * k // 2 + n * (k // GROUP) * 4
    if m == 1 and "w4a16" in sweep:
        _w4a16_probes(name, n, k, xs, w4, s4, counters, sets, copy_gbps, w4_bytes)
    emit(_line("w4a16", name, m, n, k, t, t16, w4_bytes, copy_gbps, rel_err=err, group=GROUP, config=cfg4.__dict__,
               **extra))  # fmt: skip
    have_mma = DEVICE == "cuda" and mma.unavailable_reason(xs[0].device) is None
    if have_mma:  # the weights in the CUDA kernel's tile order, as a layer holds them
        vec = mma.mma_layout(k, GROUP)[0]  # type: ignore[index]
        w4t = [mma.tile_order(w, vec) for w in w4]
    if have_mma and m > 1:  # the Triton tiling on those words
        t = time_calls(lambda i: w4a16_gemm(xs[i], w4t[i % sets4], s4[i % sets4], splitk_counters=counters, mma_vec=vec),
                       sets)  # fmt: skip
        emit(_line("w4a16_tile_order", name, m, n, k, t, t16, n * k // 2 + n * (k // GROUP) * 4, copy_gbps))
    if m > 1:  # the tensor-core tilings on the nibble planes (scales that are bf16 values, as a checkpoint's)
        s4x = [s.to(bf).float() for s in s4]
        ref4x = w4a16_gemm_ref(xs[0], w4[0], s4x[0])

        def planes(i: int, c: W4A16Config | None = None) -> torch.Tensor:
            return w4a16_gemm(xs[i], w4[i % sets4], s4x[i % sets4], config=c, splitk_counters=counters,
                              exact_scales=True)  # fmt: skip

        err = _rel(planes(0), ref4x)
        t = time_calls(planes, sets)
        extra = (_sweep("w4a16_planes", name, m, t, cfg4, _w4a16_candidates(m, n, k), planes, sets,
                        lambda out: _rel(out, ref4x)) if "w4a16_planes" in sweep else {})  # fmt: skip
        emit(_line("w4a16_planes", name, m, n, k, t, t16, w4_bytes, copy_gbps, rel_err=err, group=GROUP,
                   config=cfg4.__dict__, **extra))  # fmt: skip
        if have_mma:
            t = time_calls(lambda i: w4a16_gemm(xs[i], w4t[i % sets4], s4x[i % sets4], splitk_counters=counters,
                                                mma_vec=vec, exact_scales=True), sets)  # fmt: skip
            emit(_line("w4a16_planes_tile_order", name, m, n, k, t, t16, w4_bytes, copy_gbps))
    if m <= mma.MAX_ROWS and have_mma:  # the CUDA tensor-core kernel (what CudaW4A16Kernel runs up to mma.MAX_ROWS rows)

        def run_mma(i: int, c: mma.MmaConfig | None = None) -> torch.Tensor:
            return mma.w4a16_mma(xs[i], w4t[i % sets4], s4[i % sets4], config=c)

        cfg_mma = mma.pick_config(n, k, GROUP, sms, rows=m)
        err = _rel(run_mma(0), ref4)
        t = time_calls(run_mma, sets)
        extra: dict[str, Any] = {}
        if "w4a16_mma" in sweep:
            cands = [mma.MmaConfig(sp, wa) for sp in (1, 2, 4, 8) for wa in (2, 4, 8)
                     if wa % sp == 0 and mma.valid_config(mma.MmaConfig(sp, wa), k, GROUP)]  # fmt: skip
            extra = _sweep("w4a16_mma", name, m, t, cfg_mma, cands, run_mma, sets, lambda out: _rel(out, ref4))
            for v in (mma.VARIANT_NAMES if m <= mma.PROBE_MAX_ROWS else [mma.EXACT]):  # the default split, parts left out
                c = mma.MmaConfig(cfg_mma.split, cfg_mma.warps, v)
                tp = time_calls(lambda i, c=c: run_mma(i, c), sets)
                emit(_line("w4a16_mma_probe", name, m, n, k, tp, None, w4_bytes, copy_gbps, variant=mma.VARIANT_NAMES[v],
                           config=c.__dict__))  # fmt: skip
        emit(_line("w4a16_mma", name, m, n, k, t, t16, w4_bytes, copy_gbps, rel_err=err, group=GROUP,
                   config=cfg_mma.__dict__, **extra))  # fmt: skip
        if m == 1 and name in ("qkv", "gate_up"):
            _w4a16_mma_fusions(name, n, k, xs, w4t, s4, sets, copy_gbps, w4_bytes)
    if m > 64:  # dequantize + cuBLAS (what TritonW4A16Kernel runs from DEQUANT_MIN_ROWS rows on), to compare

        def dq4(i: int) -> torch.Tensor:
            return torch.nn.functional.linear(xs[i], w4a16_dequantize(w4[i % sets4], s4[i % sets4], None, k, xs[i].dtype))

        err = _rel(dq4(0), w4a16_gemm_ref(xs[0], w4[0], s4[0]))
        t = time_calls(dq4, sets)
        emit(_line("w4a16_dequant_cublas", name, m, n, k, t, t16, w4_bytes, copy_gbps, rel_err=err, group=GROUP))


def _w4a16_mma_fusions(name: str, n: int, k: int, xs: list[torch.Tensor], w4: list[torch.Tensor],
                       s4: list[torch.Tensor], sets: int, copy_gbps: float, w4_bytes: int) -> None:  # fmt: skip
    """One row: the layer's RMSNorm (and on gate/up silu(gate) * up) in the w4a16_mma launch, against
    the separate rmsnorm / silu_and_mul launches the model runs without the fusions (w4: tile order)."""
    g = torch.Generator(device=DEVICE).manual_seed(k)
    res = [torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16, generator=g) for _ in range(sets)]
    weight = torch.rand(k, device=DEVICE, generator=g).to(torch.bfloat16) + 0.5
    silu = name == "gate_up"
    w4n, s4n = len(w4), len(s4)

    def fused(i: int) -> torch.Tensor:
        norm = mma.NormInput(weight, 1e-6, res[i])
        return mma.w4a16_mma(xs[i], w4[i % w4n], s4[i % s4n], norm=norm, silu=silu)

    def apart(i: int) -> torch.Tensor:
        normed, _ = rmsnorm(xs[i], weight, 1e-6, res[i])
        out = mma.w4a16_mma(normed, w4[i % w4n], s4[i % s4n])
        return silu_and_mul(out) if silu else out

    t_fused, t_apart = time_calls(fused, sets), time_calls(apart, sets)
    emit(_line("w4a16_mma_fused", name, 1, n, k, t_fused, None, w4_bytes, copy_gbps, us_apart=round(t_apart, 2),
               fused="rmsnorm + silu_and_mul" if silu else "rmsnorm"))  # fmt: skip


# The one-row gemv's limit, probed (bench only): each tiling as it runs, with `load_only` (the same
# loads, one FMA a word: what the loads alone cost), with `tiled_w` (each program's K-step tile
# contiguous in memory: DRAM locality), and with both.
PROBE_TILINGS = [(64, 128, 2, 4, 1), (16, 128, 2, 1, 8), (32, 128, 2, 1, 4), (64, 128, 2, 1, 2)]


def _w4a16_probes(name: str, n: int, k: int, xs: list[torch.Tensor], w4: list[torch.Tensor], s4: list[torch.Tensor],
                  counters: torch.Tensor, sets: int, copy_gbps: float, w4_bytes: int) -> None:  # fmt: skip
    sms, sets4 = num_sms(), len(w4)
    tiled: dict[int, list[torch.Tensor]] = {}
    for bn, bk, warps, stages, sub in PROBE_TILINGS:
        if bn not in tiled:
            tiled[bn] = [tile_words(w, bn, bk) for w in w4]
        split = auto_split(-(-n // bn), k, bk * sub, sms, 6, 2)
        for tw, lo in [(False, False), (False, True), (True, False), (True, True)]:
            c = W4A16Config("gemv", 1, bn, bk, 1, split, warps, stages, sub, tiled_w=tw, load_only=lo)
            ws = tiled[bn] if tw else w4

            def run(i: int, c: W4A16Config = c, ws: list[torch.Tensor] = ws) -> torch.Tensor:
                return w4a16_gemm(xs[i], ws[i % sets4], s4[i % sets4], config=c, splitk_counters=counters)

            t = time_calls(run, sets)
            emit(_line("w4a16_probe", name, 1, n, k, t, None, w4_bytes, copy_gbps, config=c.__dict__))
        if not SMOKE:
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--m", type=int, nargs="+", default=MS)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--sweep", nargs="*", choices=["int8", "w4a16", "w4a16_planes", "w4a16_mma"], default=None,
                   help="also time a list of tilings per case (of these kernels; all when none named)")
    p.add_argument("--w4a16-tuned-out", default=None,
                   help="write the W4A16 sweep's best one-row tiling per (N, K) here (MLLMD_W4A16_TUNED's format)")
    args = p.parse_args(argv)
    sweep = [] if args.sweep is None else (args.sweep or ["int8", "w4a16", "w4a16_mma"])
    global TMA_OK
    if not SMOKE:
        probe = torch.zeros(16, 16, dtype=torch.int8, device=DEVICE)
        TMA_OK = tma_supported(probe, probe)
    if not SMOKE and not torch.cuda.is_available():
        raise SystemExit("bench_quant needs CUDA (or MLLMD_BENCH_SMOKE=1 TRITON_INTERPRET=1)")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    with open(os.path.join(args.out, "bench_quant.jsonl"), "w") as log:
        set_log(log)
        copy = copy_bandwidth_gbps()
        import triton

        device = "cpu (smoke)" if SMOKE else torch.cuda.get_device_name()
        emit({"kernel": "env", "device": device, "torch": torch.__version__, "triton": triton.__version__,
              "copy_gbps": round(copy, 1), "sms": num_sms()})  # fmt: skip
        for name in args.shapes:
            guarded(_shape, name, args.m, copy, sweep)
            if not SMOKE:
                torch.cuda.empty_cache()
            print(f"# {name} done at {time.time() - t0:.0f}s", flush=True)
        set_log(None)
    from mllmd_kernels.bench.common import ROWS

    sweeps = [r for r in ROWS if "best_config" in r]
    if sweeps:
        print("# sweeps: best tiling per case")
        for r in sweeps:
            print(json.dumps({k: r[k] for k in ("kernel", "shape", "us", "best_us", "best_config")}))
    dims = {r["shape"]: dict(f.split("=") for f in r["shape"].split()[1:]) for r in sweeps}
    if args.w4a16_tuned_out:
        best = {f"{dims[r['shape']]['N']},{dims[r['shape']]['K']}": r["best_config"] for r in sweeps
                if r["kernel"] == "w4a16" and dims[r["shape"]]["M"] == "1" and r["best_config"]["mode"] == "gemv"}  # fmt: skip
        with open(args.w4a16_tuned_out, "w") as f:
            json.dump(best, f, indent=1)
        print(f"# W4A16 one-row tilings for {len(best)} shapes -> {args.w4a16_tuned_out}")
    mma_best = {f"{dims[r['shape']]['N']},{dims[r['shape']]['K']}": list(r["best_config"].values())[:2] for r in sweeps
                if r["kernel"] == "w4a16_mma" and dims[r["shape"]]["M"] == "1"} if sweeps else {}  # fmt: skip
    if mma_best:  # MLLMD_W4A16_MMA_TUNED's format
        print("# w4a16_mma best one-row configs: " + json.dumps(mma_best))
    print_table([r for r in ROWS if r.get("kernel") != "bf16"])
    print(f"# total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
