"""Triton attention backend: paged decode (split-KV) and extend (prefill with cached prefix) kernels.

Per-step metadata is built on the device from the batch's tensors (no host synchronisation); the
only host values used are the batch size and max(extend_lens_cpu), which the scheduler already knows.

Long prompts with no cached prefix (every row of an eager step starts at position 0 and is long
enough for `dense_pays`) attend through torch's SDPA (FlashAttention / cuDNN) over their own K/V,
gathered from the pool in order: the paged extend kernel's indirect loads run it at about a third of
the tensor cores' rate there, and a gather of one layer's K/V costs a few microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from mllmd_kernels import decode_attention, decode_num_splits, extend_attention
from mllmd_kernels._triton import sm_count_for

from mllmd.engine.attention.base import AttentionBackend, PagedAttentionStep
from mllmd.engine.forward_batch import ForwardBatch


@dataclass
class _DecodeMeta:
    num_splits: int
    mid_o: torch.Tensor | None = None  # [B, Hq, splits, D] fp32, allocated by the first layer, reused
    mid_lse: torch.Tensor | None = None  # [B, Hq, splits] fp32
    out_amax: torch.Tensor | None = None  # [Hq] fp32 (one row): each head's max |output|, reused likewise


@dataclass
class _ExtendMeta:
    qo_start: torch.Tensor  # [B] int64 first query row of each batch row
    max_extend_len: int
    dense_rows: list[tuple[int, int]] | None = None  # (first token, tokens) per row, if SDPA may pay
    dense_min_tokens: int = 0  # the shortest of dense_rows (attend() asks dense_pays with it)


# When SDPA beats the paged extend kernel (H200 sweep, scripts/dense_prefill_sweep.py, docs/benchmarks.md):
# never below 1,024 tokens a row; at head_dim <= 128 only from 65,536 tokens x query heads (8B's 32 heads
# win from 2,048 tokens, VL-2B's 16 only from 4,096); at head_dim 256 (Qwen3.5) from 1,024 tokens.
DENSE_PREFILL_MIN_TOKENS = 1024
DENSE_PREFILL_MIN_HEAD_TOKENS = 65536
# SDPA's fast kernels take these; float32 keeps the extend kernel (SDPA would fall back to its math path).
DENSE_PREFILL_DTYPES = (torch.bfloat16, torch.float16)
# enable_gqa is torch >= 2.5 (Jetson's torch 2.4 repeats the KV heads instead).
_SDPA_GQA = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def dense_pays(tokens: int, q_heads: int, head_dim: int) -> bool:
    """Whether SDPA over gathered K/V is faster than the paged extend kernel for fresh rows of at least
    `tokens` tokens."""
    if tokens < DENSE_PREFILL_MIN_TOKENS:
        return False
    return head_dim > 128 or tokens * q_heads >= DENSE_PREFILL_MIN_HEAD_TOKENS


def _fresh_long_rows(prefix_lens: list[int], extend_lens: list[int], dtype: torch.dtype) -> bool:
    """Every row starts at position 0 with enough tokens that SDPA may pay, in a dtype its fast kernels
    take."""
    return (dtype in DENSE_PREFILL_DTYPES and bool(extend_lens) and not any(prefix_lens)
            and min(extend_lens) >= DENSE_PREFILL_MIN_TOKENS)  # fmt: skip


def _dense_rows(batch: ForwardBatch, dtype: torch.dtype) -> list[tuple[int, int]] | None:
    """The rows of an eager prefill step (or of a prefill graph's fresh-row variant) that all start at
    position 0 with enough tokens that SDPA may pay (attend() decides with the layer's head counts)."""
    graph = batch.prefill_graph  # a prefill graph's step: only its fresh-row variant takes the route
    if (batch.graph_size or (graph is not None and not graph[2])
            or not _fresh_long_rows(batch.prefix_lens_cpu, batch.extend_lens_cpu, dtype)):  # fmt: skip
        return None
    rows, start = [], 0
    for n in batch.extend_lens_cpu:
        rows.append((start, n))
        start += n
    return rows


def dense_causal_attention(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
    rows: list[tuple[int, int]], scale: float,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of each row's tokens over themselves: q [T, Hq, D], K/V read from the pool at
    `slots` [T] (the step's own slots, in token order) -> out [T, Hq, D]."""
    hq, hkv = q.shape[1], k_buf.shape[1]
    out = q.new_empty(q.shape) if len(rows) > 1 else None
    for start, n in rows:
        idx = slots[start : start + n]
        k = k_buf.index_select(0, idx).transpose(0, 1)  # [Hkv, n, D]
        v = v_buf.index_select(0, idx).transpose(0, 1)
        qh = q[start : start + n].transpose(0, 1)  # [Hq, n, D]
        if _SDPA_GQA:
            o = F.scaled_dot_product_attention(qh[None], k[None], v[None], is_causal=True, scale=scale,
                                               enable_gqa=hq != hkv)[0]  # fmt: skip
        else:
            group = hq // hkv
            o = F.scaled_dot_product_attention(qh[None], k.repeat_interleave(group, 0)[None],
                                               v.repeat_interleave(group, 0)[None], is_causal=True, scale=scale)[0]  # fmt: skip
        if out is None:
            return o.transpose(0, 1)
        out[start : start + n] = o.transpose(0, 1)
    assert out is not None
    return out


class TritonAttentionBackend(AttentionBackend):
    # the extend kernel's grid follows max_extend_len only (the padded bucket's at capture): tiles past
    # a row's extend length exit, a row of length 0 computes nothing
    supports_prefill_graph = True

    def fresh_route_pays(self, tokens: int, q_heads: int, head_dim: int) -> bool:
        """SDPA over a fresh row's own K/V (the dense route) where it beats the paged kernel."""
        return _fresh_long_rows([0], [tokens], self.kv_pool.k_buffer[0].dtype) and dense_pays(tokens, q_heads, head_dim)

    def prefers_eager(self, prefix_lens: list[int], extend_lens: list[int], q_heads: int, head_dim: int) -> bool:
        """Steps of several fresh prompts for which the dense SDPA route (eager only: one fresh row takes
        it in its graph's fresh-row variant) saves more than a graph would: at head_dim 256, where the
        sweep measured SDPA at 1.4-2.4x the paged kernel from 1,024 tokens (2,048: 149 against 355 us a
        layer). At head_dim 128 SDPA saves at most 10% of attention (8B, 2,048 tokens: 138 against 154
        us) and the graph wins (W8A8 8B 2,048 tokens: 34.8 ms in a graph, 47.0 eager), so those steps
        keep the graph. (Hybrid models never ask: model_runner.)"""
        return (head_dim > 128 and len(extend_lens) > 1
                and _fresh_long_rows(prefix_lens, extend_lens, self.kv_pool.k_buffer[0].dtype)
                and dense_pays(min(extend_lens), q_heads, head_dim))  # fmt: skip

    def metadata(self, batch: ForwardBatch) -> _DecodeMeta | _ExtendMeta:
        if batch.is_decode:
            kv_heads = self.kv_pool.k_buffer[0].shape[1]
            return _DecodeMeta(decode_num_splits(batch.batch_size, kv_heads, sm_count_for(batch.seq_lens)))
        qo_start = torch.cumsum(batch.extend_lens, dim=0) - batch.extend_lens  # [B]
        dense = _dense_rows(batch, self.kv_pool.k_buffer[0].dtype)
        shortest = min(n for _, n in dense) if dense else 0
        return _ExtendMeta(qo_start, max(batch.extend_lens_cpu, default=0), dense, shortest)

    def attend(
        self, step: PagedAttentionStep, layer: int, q: torch.Tensor, scale: float, out_absmax: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, meta = step.batch, step.meta
        k_buf, v_buf = self.kv_pool.k_buffer[layer], self.kv_pool.v_buffer[layer]
        if q.dtype != k_buf.dtype:
            q = q.to(k_buf.dtype)
        if isinstance(meta, _DecodeMeta):
            bsz, hq, d = q.shape
            if meta.mid_o is None:
                meta.mid_o = torch.empty((bsz, hq, meta.num_splits, d), dtype=torch.float32, device=q.device)
                meta.mid_lse = torch.empty((bsz, hq, meta.num_splits), dtype=torch.float32, device=q.device)
            out_amax = None
            if out_absmax and bsz == 1:
                if meta.out_amax is None:
                    meta.out_amax = torch.empty(hq, dtype=torch.float32, device=q.device)
                out_amax = meta.out_amax
            out = decode_attention(
                q, k_buf, v_buf, self.req_to_token, batch.req_pool_indices, batch.seq_lens, scale,
                num_splits=meta.num_splits, mid_o=meta.mid_o, mid_lse=meta.mid_lse, out_amax=out_amax,
            )
            return out, out_amax
        if meta.dense_rows is not None and dense_pays(meta.dense_min_tokens, q.shape[1], q.shape[2]):
            return dense_causal_attention(q, k_buf, v_buf, batch.out_cache_loc, meta.dense_rows, scale), None
        out = extend_attention(
            q, k_buf, v_buf, self.req_to_token, batch.req_pool_indices, batch.seq_lens, batch.extend_lens,
            meta.qo_start, meta.max_extend_len, scale,
        )
        return out, None
