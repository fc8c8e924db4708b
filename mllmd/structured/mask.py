"""Apply packed token bitmasks to a step's logits on their device: a few element-wise ops, no host
synchronisation, the same on CPU, CUDA and Jetson (no kernel of xgrammar's own)."""

from __future__ import annotations

import torch

# bit j of word w allows token 32 * w + j (xgrammar's layout: int32 words, little-endian bits)
_BITS: dict[torch.device, torch.Tensor] = {}


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits [B, V] float (in place): rows[i]'s disallowed tokens become -inf by bitmask [R, W] int32."""
    vocab = logits.shape[1]
    bits = _BITS.get(bitmask.device)
    if bits is None:
        bits = _BITS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]  # [R, W*32] -> [R, V]
    sub = logits.index_select(0, rows)
    sub.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, sub)
