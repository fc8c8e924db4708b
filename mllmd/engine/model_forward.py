"""One forward of the model over a step: what the runner runs eagerly and what the CUDA graphs capture."""

from __future__ import annotations

from typing import Any

import torch

from mllmd.engine.forward_batch import ForwardBatch
from mllmd.models.layers import AttentionStep


def forward_hidden(model: Any, batch: ForwardBatch, step: AttentionStep) -> torch.Tensor:
    """The final (normed) hidden states [T, H] of every token of `batch`."""
    if batch.images is not None:
        return model(batch.input_ids, batch.positions, step, batch.images)
    return model(batch.input_ids, batch.positions, step)


def forward_logits(model: Any, batch: ForwardBatch, step: AttentionStep) -> torch.Tensor:
    """float32 logits [N, V] for the rows of `batch` that sample (empty when none does)."""
    hidden = forward_hidden(model, batch, step)
    if batch.logits_indices.numel() == 0:
        return hidden.new_empty((0, model.vocab_size), dtype=torch.float32)
    if batch.is_decode and batch.logits_indices.numel() == batch.num_tokens:
        return model.compute_logits(hidden)  # every row samples: no gather
    return model.compute_logits(hidden[batch.logits_indices])
