"""Reference attention in plain torch (CPU and tests): gathers K/V through the request-to-token table."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mllmd.engine.attention.base import AttentionBackend, PagedAttentionStep
from mllmd.engine.forward_batch import ForwardBatch


@dataclass
class _DecodeMeta:
    kv_indices: torch.Tensor  # [B, L] KV slot per key position (padded with slot 0)
    mask: torch.Tensor  # [B, 1, 1, L] True where the key is valid


@dataclass
class _ExtendMeta:
    kv_indices: list[torch.Tensor]  # per row [S_i]
    masks: list[torch.Tensor]  # per row [1, 1, E_i, S_i] causal mask with prefix


def _grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hkv, G*E, D] (grouped query heads), k/v [B, Hkv, S, D], mask broadcastable to scores."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [B, Hkv, G*E, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v)


class TorchAttentionBackend(AttentionBackend):
    supports_cuda_graph = False  # reads host-side sequence lengths and request rows every step

    def metadata(self, batch: ForwardBatch) -> _DecodeMeta | _ExtendMeta:
        table = self.req_to_token
        if batch.is_decode:
            max_len = max(batch.seq_lens_cpu)
            kv_indices = table[batch.req_pool_indices, :max_len]  # [B, L]
            ar = torch.arange(max_len, device=kv_indices.device)
            valid = ar[None, :] < batch.seq_lens[:, None]  # [B, L]
            kv_indices = torch.where(valid, kv_indices, torch.zeros_like(kv_indices))
            return _DecodeMeta(kv_indices, valid[:, None, None, :])
        idx_list, masks = [], []
        rows = batch.req_pool_indices.tolist()
        for row, seq_len, prefix_len in zip(rows, batch.seq_lens_cpu, batch.prefix_lens_cpu):
            idx_list.append(table[row, :seq_len])
            q_pos = torch.arange(prefix_len, seq_len, device=table.device)
            k_pos = torch.arange(seq_len, device=table.device)
            masks.append((k_pos[None, :] <= q_pos[:, None])[None, None])  # [1, 1, E, S]
        return _ExtendMeta(idx_list, masks)

    def attend(
        self, step: PagedAttentionStep, layer: int, q: torch.Tensor, scale: float, out_absmax: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._attend(step.batch, step.meta, layer, q, scale), None

    def _attend(
        self, batch: ForwardBatch, meta: _DecodeMeta | _ExtendMeta, layer: int, q: torch.Tensor, scale: float
    ) -> torch.Tensor:
        k_buf, v_buf = self.kv_pool.k_buffer[layer], self.kv_pool.v_buffer[layer]
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv = k_buf.shape[1]
        group = num_heads // num_kv
        if isinstance(meta, _DecodeMeta):
            bsz = q.shape[0]
            flat = meta.kv_indices.view(-1)
            shape = (*meta.kv_indices.shape, num_kv, head_dim)
            kk = k_buf.index_select(0, flat).view(shape).transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
            vv = v_buf.index_select(0, flat).view(shape).transpose(1, 2).to(q.dtype)
            qq = q.view(bsz, num_kv, group, head_dim)  # [B, Hkv, G, D]
            out = _grouped_attention(qq, kk, vv, meta.mask, scale)  # [B, Hkv, G, D]
            return out.reshape(bsz, num_heads, head_dim)
        outs = []
        start = 0
        for kv_idx, mask, n in zip(meta.kv_indices, meta.masks, batch.extend_lens_cpu):
            qi = q[start : start + n]  # [E, Hq, D]
            start += n
            kk = k_buf.index_select(0, kv_idx).transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, Hkv, S, D]
            vv = v_buf.index_select(0, kv_idx).transpose(0, 1).unsqueeze(0).to(q.dtype)
            # [E, Hkv, G, D] -> [1, Hkv, G, E, D]: each kv head sees its G query heads for all E tokens.
            qq = qi.view(n, num_kv, group, head_dim).permute(1, 2, 0, 3).unsqueeze(0)
            scores_mask = mask.unsqueeze(2)  # [1, 1, 1, E, S]
            scores = torch.matmul(qq, kk.unsqueeze(2).transpose(-1, -2)).float() * scale  # [1, Hkv, G, E, S]
            scores = scores.masked_fill(~scores_mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(vv.dtype)
            oi = torch.matmul(probs, vv.unsqueeze(2))  # [1, Hkv, G, E, D]
            outs.append(oi[0].permute(2, 0, 1, 3).reshape(n, num_heads, head_dim))
        return torch.cat(outs, dim=0)
