"""Elementwise / row kernels vs their eager torch references: rmsnorm (+residual), rope + QK-norm,
silu_and_mul (and silu_and_mul_int8 against silu + quantization in torch), store_cache (Qwen3-8B widths)."""

from __future__ import annotations

import torch

from mllmd_kernels.activation import silu_and_mul, silu_and_mul_int8, silu_and_mul_int8_ref, silu_and_mul_ref
from mllmd_kernels.bench.common import DEVICE, SMOKE, emit, guarded, num_sets, row, time_calls
from mllmd_kernels.rmsnorm import rmsnorm, rmsnorm_ref
from mllmd_kernels.rope import rope, rope_ref
from mllmd_kernels.store_cache import store_cache_ref, store_cache_triton

HIDDEN, INTER, HQ, HKV, D = 4096, 12288, 32, 8, 128
TOKENS = [1, 64, 2048]
if SMOKE:
    HIDDEN, INTER, HQ, HKV, D, TOKENS = 64, 96, 4, 2, 16, [1, 3]


def _rand(*shape: int, dtype: torch.dtype, sets: int) -> list[torch.Tensor]:
    return [torch.randn(*shape, device=DEVICE, dtype=dtype) for _ in range(sets)]


def _rmsnorm_case(t: int, dtype: torch.dtype, copy_gbps: float) -> None:
    w = torch.randn(HIDDEN, device=DEVICE, dtype=dtype) * 0.1 + 1
    nbytes = 4 * t * HIDDEN * 2 + HIDDEN * 2
    sets = num_sets(nbytes)
    xs, rs = _rand(t, HIDDEN, dtype=dtype, sets=sets), _rand(t, HIDDEN, dtype=dtype, sets=sets)
    outs, routs = _rand(t, HIDDEN, dtype=dtype, sets=sets), _rand(t, HIDDEN, dtype=dtype, sets=sets)
    ours = time_calls(lambda i: rmsnorm(xs[i], w, 1e-6, residual=rs[i], out=outs[i], residual_out=routs[i]), sets)
    ref = time_calls(lambda i: rmsnorm_ref(xs[i], w, 1e-6, residual=rs[i]), sets)
    emit(row("rmsnorm+residual", f"T={t} H={HIDDEN}", dtype, ours, ref, nbytes, copy_gbps))


def _rope_tables(max_position: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's RoPE tables cos / sin [P, D] float32 ("rotate_half" layout: the frequencies twice)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.int64).float(), inv_freq)  # [P, D / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    return emb.cos().to(DEVICE), emb.sin().to(DEVICE)


def _rope_case(t: int, dtype: torch.dtype, copy_gbps: float) -> None:
    cos, sin = _rope_tables(40960, 1_000_000.0)
    qw = torch.randn(D, device=DEVICE, dtype=dtype) * 0.1 + 1
    kw = torch.randn(D, device=DEVICE, dtype=dtype) * 0.1 + 1
    nbytes = 2 * t * (HQ + HKV) * D * 2
    sets = num_sets(nbytes)
    qkvs = _rand(t, (HQ + 2 * HKV) * D, dtype=dtype, sets=sets)
    qs = [x[:, : HQ * D].view(t, HQ, D) for x in qkvs]
    ks = [x[:, HQ * D : (HQ + HKV) * D].view(t, HKV, D) for x in qkvs]
    pos = torch.randint(0, 40960, (t,), device=DEVICE)
    qo, ko = _rand(t, HQ, D, dtype=dtype, sets=sets), _rand(t, HKV, D, dtype=dtype, sets=sets)
    ours = time_calls(lambda i: rope(pos, qs[i], ks[i], cos, sin, qw, kw, 1e-6, q_out=qo[i], k_out=ko[i]), sets)
    ref = time_calls(lambda i: rope_ref(pos, qs[i], ks[i], cos, sin, qw, kw, 1e-6), sets)
    emit(row("rope+qk_norm", f"T={t} Hq={HQ} Hkv={HKV} D={D}", dtype, ours, ref, nbytes, copy_gbps))


def _silu_case(t: int, dtype: torch.dtype, copy_gbps: float) -> None:
    nbytes = 3 * t * INTER * 2
    sets = num_sets(nbytes)
    xs = _rand(t, 2 * INTER, dtype=dtype, sets=sets)
    outs = _rand(t, INTER, dtype=dtype, sets=sets)
    ours = time_calls(lambda i: silu_and_mul(xs[i], out=outs[i]), sets)
    ref = time_calls(lambda i: silu_and_mul_ref(xs[i]), sets)
    emit(row("silu_and_mul", f"T={t} I={INTER}", dtype, ours, ref, nbytes, copy_gbps))
    nbytes = t * INTER * (2 * 2 + 1) + 4 * t  # bf16 gate and up in, int8 and a scale out
    ours = time_calls(lambda i: silu_and_mul_int8(xs[i]), sets)
    ref = time_calls(lambda i: silu_and_mul_int8_ref(xs[i]), sets)
    emit(row("silu_and_mul_int8", f"T={t} I={INTER}", dtype, ours, ref, nbytes, copy_gbps))


def _store_cache_case(t: int, dtype: torch.dtype, copy_gbps: float, kc: torch.Tensor, vc: torch.Tensor) -> None:
    nbytes = 4 * t * HKV * D * 2
    sets = num_sets(nbytes)
    ks, vs = _rand(t, HKV, D, dtype=dtype, sets=sets), _rand(t, HKV, D, dtype=dtype, sets=sets)
    locs = [torch.randperm(kc.shape[0], device=DEVICE)[:t] for _ in range(sets)]
    ours = time_calls(lambda i: store_cache_triton(kc, vc, locs[i], ks[i], vs[i]), sets)
    ref = time_calls(lambda i: store_cache_ref(kc, vc, locs[i], ks[i], vs[i]), sets)
    emit(row("store_cache", f"T={t} Hkv={HKV} D={D}", dtype, ours, ref, nbytes, copy_gbps))


def main(copy_gbps: float, dtype: torch.dtype = torch.bfloat16) -> None:
    for case in (_rmsnorm_case, _rope_case, _silu_case):
        for t in TOKENS:
            guarded(case, t, dtype, copy_gbps)
    slots = 200_000 if not SMOKE else 100
    kc = torch.randn(slots, HKV, D, device=DEVICE, dtype=dtype)
    vc = torch.randn(slots, HKV, D, device=DEVICE, dtype=dtype)
    for t in TOKENS:
        guarded(_store_cache_case, t, dtype, copy_gbps, kc, vc)
