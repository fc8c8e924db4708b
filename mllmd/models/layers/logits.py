"""float32 logits from the final hidden states, for the rows that sample."""

from __future__ import annotations

import torch
from mllmd_kernels import gemv

from mllmd.models.layers.dispatch import use_gemv
from mllmd.models.layers.linear import Linear


def compute_logits(hidden: torch.Tensor, lm_head: Linear | None, embed_weight: torch.Tensor) -> torch.Tensor:
    """hidden [N, H] -> float32 [N, V] through `lm_head`, or the embeddings when they are tied (None).

    A quantized head runs its kernel; one row on the GPU takes the GEMV straight to float32 (the bf16
    values, no copy launch); otherwise a matmul, then float32."""
    if lm_head is not None and lm_head.quant_method is not None:
        return lm_head(hidden).float()
    weight = embed_weight if lm_head is None else lm_head.weight  # [V, H]
    if use_gemv(hidden):
        out = hidden.new_empty((hidden.shape[0], weight.shape[0]), dtype=torch.float32)
        return gemv(hidden, weight, out=out)
    return torch.matmul(hidden, weight.t()).float()
