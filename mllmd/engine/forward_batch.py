"""Inputs of one model step: a mixed batch of prefill chunks and decodes (tensors and their host
lengths only: the pools and the attention backend are the runner's, passed where they are needed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mllmd.engine.state_pool import StepSnapshots
from mllmd.models.multimodal import StepImages


@dataclass
class ForwardBatch:
    """Row i of the batch computes tokens [prefix_lens[i], seq_lens[i]) of request slot req_pool_indices[i].

    A decode is an extend of length 1. Tokens of all rows are concatenated in row order.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, or [3, T] (M-RoPE, a step with image prompt tokens)
    out_cache_loc: torch.Tensor  # [T] int64 KV slot of each new token
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, tokens with KV after this step
    extend_lens: torch.Tensor  # [B] int64
    logits_indices: torch.Tensor  # [N] int64 rows of the hidden states that need logits
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    graph_size: int = 0  # > 0: staged in the inputs of the decode CUDA graph of this size (CudaGraphRunner.stage)
    prefill_graph: tuple[int, int, bool] | None = None  # (tokens, rows, fresh): staged in that prefill graph's inputs
    images: StepImages | None = None  # the step's image tokens (vision-language models)
    state_slots: torch.Tensor | None = None  # [B] int64: each row's recurrent-state slot (hybrid models)
    state_snapshots: StepSnapshots | None = None  # prefix-cache snapshots the step takes (hybrid prefill steps)
    # prompt logprobs: (request, first position, count) per row that wants them; their logits follow
    # the sampling rows' in logits_indices, in this order
    prompt_spans: list[tuple[Any, int, int]] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens_cpu)
