"""Triton attention backend: paged decode (split-KV) and extend (prefill with cached prefix) kernels.

Per-step metadata is built on the device from the batch's tensors (no host synchronisation); the
only host values used are the batch size and max(extend_lens_cpu), which the scheduler already knows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from mllmd_kernels import decode_attention, decode_num_splits, extend_attention
from mllmd_kernels._triton import sm_count_for

from mllmd.engine.attention.base import AttentionBackend
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
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.is_decode:
            kv_heads = batch.kv_pool.k_buffer[0].shape[1]
            splits = decode_num_splits(batch.batch_size, kv_heads, sm_count_for(batch.seq_lens))
            batch.attn_metadata = _DecodeMeta(splits)
            return
        qo_start = torch.cumsum(batch.extend_lens, dim=0) - batch.extend_lens  # [B]
        batch.attn_metadata = _ExtendMeta(qo_start, max(batch.extend_lens_cpu, default=0))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int, scale: float,
        batch: ForwardBatch, kv_stored: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        return self._forward(q, k, v, layer_id, scale, batch, kv_stored, amax=False)[0]

    def forward_with_amax(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int, scale: float,
        batch: ForwardBatch, kv_stored: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        return self._forward(q, k, v, layer_id, scale, batch, kv_stored, amax=True)

    def _forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int, scale: float,
        batch: ForwardBatch, kv_stored: bool, amax: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        self.store_kv(layer_id, batch, k, v, kv_stored)
        pool = batch.kv_pool
        k_buf, v_buf = pool.k_buffer[layer_id], pool.v_buffer[layer_id]
        table = batch.req_to_token_pool.req_to_token
        meta = batch.attn_metadata
        if q.dtype != k_buf.dtype:
            q = q.to(k_buf.dtype)
        if isinstance(meta, _DecodeMeta):
            bsz, hq, d = q.shape
            if meta.mid_o is None:
                meta.mid_o = torch.empty((bsz, hq, meta.num_splits, d), dtype=torch.float32, device=q.device)
                meta.mid_lse = torch.empty((bsz, hq, meta.num_splits), dtype=torch.float32, device=q.device)
            out_amax = None
            if amax and bsz == 1:
                if meta.out_amax is None:
                    meta.out_amax = torch.empty(hq, dtype=torch.float32, device=q.device)
                out_amax = meta.out_amax
            out = decode_attention(
                q, k_buf, v_buf, table, batch.req_pool_indices, batch.seq_lens, scale,
                num_splits=meta.num_splits, mid_o=meta.mid_o, mid_lse=meta.mid_lse, out_amax=out_amax,
            )
            return out, out_amax
        out = extend_attention(
            q, k_buf, v_buf, table, batch.req_pool_indices, batch.seq_lens, batch.extend_lens,
            meta.qo_start, meta.max_extend_len, scale,
        )
        return out, None
