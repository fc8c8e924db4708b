"""Logit bias and repetition / frequency / presence penalties (applied before temperature).

- logit bias: ``logit[t] += bias[t]``.
- repetition penalty r (vLLM / HF semantics) over the tokens of prompt + output (presence only):
  a positive logit is divided by r, a non-positive one multiplied by r.
- frequency f and presence p (OpenAI semantics) over output tokens only, with c the token's count:
  ``logit -= f * c + p * (c > 0)``.

Penalties touch only the tokens a row has seen, so they are kept sparse: one entry per distinct
(row, token) pair, applied with a gather and a scatter (O(tokens seen), not O(B * V)).
"""

from __future__ import annotations

import torch

from mllmd.engine.device_io import to_device


def unique_tokens(
    token_lists: list[list[int]], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct (list index, token) pairs and their counts: int64 rows [N], cols [N], float32 counts [N].

    Ids outside [0, vocab_size) (padding, -1) are ignored. Pairs come sorted by (row, token).
    """
    rows = torch.tensor([i for i, toks in enumerate(token_lists) for _ in toks], dtype=torch.int64)
    toks = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.int64)
    ok = (toks >= 0) & (toks < vocab_size)
    flat, counts = torch.unique(rows[ok] * vocab_size + toks[ok], return_counts=True)  # [N]
    dev = torch.device(device)
    return (
        to_device(flat // vocab_size, torch.int64, dev),
        to_device(flat % vocab_size, torch.int64, dev),
        to_device(counts, torch.float32, dev),
    )


def apply_logit_bias(
    logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, vals: torch.Tensor
) -> None:
    """In place: logits[rows[i], cols[i]] += vals[i]. logits [B, V] float32; rows/cols/vals [N]."""
    logits.index_put_((rows, cols), vals, accumulate=True)


def apply_repetition_penalty(
    logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, penalty: torch.Tensor
) -> None:
    """In place on distinct (rows, cols) pairs [N] with penalty [N]: x > 0 -> x / r, else x * r."""
    v = logits[rows, cols]  # [N]
    logits[rows, cols] = torch.where(v > 0, v / penalty, v * penalty)


def apply_frequency_presence(
    logits: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    counts: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> None:
    """In place on distinct (rows, cols) pairs [N] with counts c > 0: x -= f * c + p (f, p per pair [N])."""
    v = logits[rows, cols]  # [N]
    logits[rows, cols] = v - (frequency * counts + presence)
