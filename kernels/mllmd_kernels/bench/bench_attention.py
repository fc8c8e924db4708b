"""Paged decode and extend attention vs the torch path the engine uses today (gather through the
request-to-token table, then matmul/softmax or SDPA). Qwen3-8B heads: 32 q / 8 kv, head_dim 128."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mllmd_kernels.bench.common import DEVICE, SMOKE, emit, guarded, num_sets, row, time_calls
from mllmd_kernels.decode_attention import decode_attention, decode_attention_ref
from mllmd_kernels.extend_attention import extend_attention, extend_attention_ref

HQ, HKV, D = 32, 8, 128
DECODE_CASES = [(1, 128), (1, 4096), (1, 32768), (8, 1024), (64, 128), (64, 1024), (64, 4096)]
EXTEND_CASES = [(0, 2048), (4096, 512), (0, 128)]
if SMOKE:
    HQ, HKV, D = 4, 2, 16
    DECODE_CASES, EXTEND_CASES = [(1, 40), (3, 20)], [(0, 64), (30, 9)]


def _pool(total: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.randn(total + 1, HKV, D, device=DEVICE, dtype=dtype)
    v = torch.randn(total + 1, HKV, D, device=DEVICE, dtype=dtype)
    return k, v


def _table(lens: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's slots scattered over the pool (as after many allocations and frees)."""
    total = sum(lens)
    perm = torch.randperm(total, device=DEVICE) + 1
    table = torch.zeros(len(lens), width, dtype=torch.int64, device=DEVICE)
    start = 0
    for r, n in enumerate(lens):
        table[r, :n] = perm[start : start + n]
        start += n
    return table, torch.arange(len(lens), device=DEVICE)


def _torch_decode(q, k_buf, v_buf, kv_idx, mask, scale):  # the torch backend's decode path
    bsz = q.shape[0]
    shape = (*kv_idx.shape, HKV, D)
    kk = k_buf.index_select(0, kv_idx.view(-1)).view(shape).transpose(1, 2)  # [B, Hkv, L, D]
    vv = v_buf.index_select(0, kv_idx.view(-1)).view(shape).transpose(1, 2)
    qq = q.view(bsz, HKV, HQ // HKV, D)
    scores = torch.matmul(qq, kk.transpose(-1, -2)).float() * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(vv.dtype)
    return torch.matmul(probs, vv)


SWEEP_DECODE = [(1, 4096), (64, 1024), (1, 32768)] if not SMOKE else DECODE_CASES[:1]


def _decode_case(bsz: int, ctx: int, dtype: torch.dtype, copy_gbps: float, sweep: bool) -> None:
    scale = D**-0.5
    lens = [ctx] * bsz
    kv_bytes = 2 * bsz * ctx * HKV * D * 2
    sets = num_sets(kv_bytes, cap=8)
    pools = [_pool(bsz * ctx, dtype) for _ in range(sets)]
    table, rows = _table(lens, ctx)
    seq = torch.tensor(lens, device=DEVICE)
    qs = [torch.randn(bsz, HQ, D, device=DEVICE, dtype=dtype) for _ in range(sets)]
    outs = [torch.empty(bsz, HQ, D, device=DEVICE, dtype=dtype) for _ in range(sets)]
    ref = decode_attention_ref(qs[0][:1], pools[0][0], pools[0][1], table, rows[:1], seq[:1], scale)
    got = decode_attention(qs[0], pools[0][0], pools[0][1], table, rows, seq, scale)[:1]
    err = float((got.float() - ref.float()).norm() / ref.float().norm())
    kv_idx = table[:, :ctx]
    mask = (torch.arange(ctx, device=DEVICE)[None, :] < seq[:, None])[:, None, None, :]

    def ours_fn(i: int, **tiles: int) -> torch.Tensor:
        return decode_attention(qs[i], pools[i][0], pools[i][1], table, rows, seq, scale, out=outs[i], **tiles)

    ours = time_calls(ours_fn, sets)
    base = time_calls(lambda i: _torch_decode(qs[i], pools[i][0], pools[i][1], kv_idx, mask, scale), sets)
    extra: dict[str, object] = {}
    if sweep:
        best = (ours, "default")
        for bn, warps, stages in [(32, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2), (32, 2, 3)]:
            t = time_calls(lambda i, bn=bn, w=warps, st=stages: ours_fn(i, block_n=bn, num_warps=w, num_stages=st),
                           sets, reps=7)
            emit({"kernel": "decode_sweep", "B": bsz, "ctx": ctx, "block_n": bn, "num_warps": warps,
                  "num_stages": stages, "us": round(t, 2)})
            if t < best[0]:
                best = (t, f"block_n={bn} warps={warps} stages={stages}")
        extra = {"best_us": round(best[0], 2), "best_config": best[1]}
    emit(row("decode_attention", f"B={bsz} ctx={ctx} Hq={HQ} Hkv={HKV} D={D}", dtype, ours, base,
             kv_bytes + bsz * ctx * 8, copy_gbps, rel_err_vs_fp32=round(err, 5), **extra))


def bench_decode(dtype: torch.dtype, copy_gbps: float, sweep: bool = False) -> None:
    for bsz, ctx in DECODE_CASES:
        guarded(_decode_case, bsz, ctx, dtype, copy_gbps, sweep and (bsz, ctx) in SWEEP_DECODE)
        torch.cuda.empty_cache()


def _extend_case(prefix: int, ext: int, dtype: torch.dtype, copy_gbps: float, sweep: bool) -> None:
    scale = D**-0.5
    n = prefix + ext
    k_buf, v_buf = _pool(n, dtype)
    table, rows = _table([n], n)
    seq, extl = torch.tensor([n], device=DEVICE), torch.tensor([ext], device=DEVICE)
    qo = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    q = torch.randn(ext, HQ, D, device=DEVICE, dtype=dtype)
    out = torch.empty_like(q)
    got = extend_attention(q, k_buf, v_buf, table, rows, seq, extl, qo, ext, scale)
    ref = extend_attention_ref(q, k_buf, v_buf, table, rows, seq, extl, scale)
    err = float((got.float() - ref.float()).norm() / ref.float().norm())
    idx = table[0, :n]
    q_pos = torch.arange(prefix, n, device=DEVICE)
    mask = torch.arange(n, device=DEVICE)[None, :] <= q_pos[:, None]  # [E, S]

    def torch_extend(_i: int) -> torch.Tensor:
        kk = k_buf.index_select(0, idx).transpose(0, 1).repeat_interleave(HQ // HKV, 0)  # [Hq, S, D]
        vv = v_buf.index_select(0, idx).transpose(0, 1).repeat_interleave(HQ // HKV, 0)
        qq = q.transpose(0, 1)  # [Hq, E, D]
        if prefix == 0:
            return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale)
        return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)

    def ours_fn(_i: int, tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
        return extend_attention(q, k_buf, v_buf, table, rows, seq, extl, qo, ext, scale, out=out, tiles=tiles)

    ours = time_calls(ours_fn, 1)
    base = time_calls(torch_extend, 1)
    visible = ext * prefix + ext * (ext + 1) // 2
    flops = 4 * HQ * D * visible
    r = row("extend_attention", f"prefix={prefix} extend={ext} Hq={HQ} Hkv={HKV} D={D}", dtype, ours, base,
            2 * n * HKV * D * 2 + 2 * ext * HQ * D * 2, copy_gbps, rel_err_vs_fp32=round(err, 5),
            tflops=round(flops / (ours * 1e-6) / 1e12, 1), torch_tflops=round(flops / (base * 1e-6) / 1e12, 1))
    if sweep:
        best = (ours, "default")
        for tiles in [(128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 2), (128, 32, 4, 2), (64, 32, 4, 3),
                      (128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 4, 2), (64, 64, 8, 2), (32, 64, 4, 2)]:
            t = time_calls(lambda i, t_=tiles: ours_fn(i, t_), 1, reps=7)
            emit({"kernel": "extend_sweep", "prefix": prefix, "extend": ext, "tiles": tiles, "us": round(t, 2)})
            if t < best[0]:
                best = (t, str(tiles))
        r.update(best_us=round(best[0], 2), best_config=best[1])
    emit(r)


def bench_extend(dtype: torch.dtype, copy_gbps: float, sweep: bool = False) -> None:
    for prefix, ext in EXTEND_CASES:
        guarded(_extend_case, prefix, ext, dtype, copy_gbps, sweep and (prefix, ext) == EXTEND_CASES[0])
        torch.cuda.empty_cache()


def main(copy_gbps: float, dtype: torch.dtype = torch.bfloat16, sweep: bool = False) -> None:
    bench_decode(dtype, copy_gbps, sweep)
    bench_extend(dtype, copy_gbps, sweep)
