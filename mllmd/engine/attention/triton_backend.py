"""Triton attention backend: paged decode (split-KV) and extend (prefill with cached prefix) kernels.

Per-step metadata is built on the device from the batch's tensors (no host synchronisation); the
only host values used are the batch size and max(extend_lens_cpu), which the scheduler already knows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
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


class TritonAttentionBackend(AttentionBackend):
    # the extend kernel's grid follows max_extend_len only (the padded bucket's at capture): tiles past
    # a row's extend length exit, a row of length 0 computes nothing
    supports_prefill_graph = True

    def metadata(self, batch: ForwardBatch) -> _DecodeMeta | _ExtendMeta:
        if batch.is_decode:
            kv_heads = self.kv_pool.k_buffer[0].shape[1]
            return _DecodeMeta(decode_num_splits(batch.batch_size, kv_heads, sm_count_for(batch.seq_lens)))
        qo_start = torch.cumsum(batch.extend_lens, dim=0) - batch.extend_lens  # [B]
        return _ExtendMeta(qo_start, max(batch.extend_lens_cpu, default=0))

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
        out = extend_attention(
            q, k_buf, v_buf, self.req_to_token, batch.req_pool_indices, batch.seq_lens, batch.extend_lens,
            meta.qo_start, meta.max_extend_len, scale,
        )
        return out, None
