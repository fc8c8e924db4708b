"""Logit bias and repetition / frequency / presence penalties (applied before temperature).

- logit bias: ``logit[t] += bias[t]``.
- repetition penalty r (vLLM / HF semantics) over the tokens of prompt + output (presence only):
  a positive logit is divided by r, a non-positive one multiplied by r.
- frequency f and presence p (OpenAI semantics) over output tokens only, with c the token's count:
  ``logit -= f * c + p * (c > 0)``.

The penalised rows' prompt masks and output counts come from SamplingStates (kept on the device per
request slot), so applying them is a few dense ops over those rows; untouched entries keep their
values exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mllmd.engine.sampling.states import SamplingBatchInfo


def apply_logit_bias(
    logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, vals: torch.Tensor
) -> None:
    """In place: logits[rows[i], cols[i]] += vals[i]. logits [B, V] float32; rows/cols/vals [N]."""
    logits.index_put_((rows, cols), vals, accumulate=True)


def apply_repetition_penalty(
    x: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """x [P, V] float32 of the penalised rows, seen [P, V] bool (prompt or output token), penalty [P, 1]:
    seen entries x > 0 -> x / r, else x * r; returns the new rows."""
    return torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)


def apply_frequency_presence(
    x: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor
) -> torch.Tensor:
    """x [P, V] float32, counts [P, V] int32 of the output tokens, frequency / presence [P, 1]:
    entries with c > 0 -> x - (f * c + p); returns the new rows."""
    c = counts.to(torch.float32)
    return torch.where(counts > 0, x - (frequency * c + presence), x)


def apply_penalties(x: torch.Tensor, info: SamplingBatchInfo) -> None:
    """In place on float32 logits x [B, V]: the repetition, then frequency / presence penalties of the
    batch's penalised rows, from their slots' prompt masks and output counts.

    On an accelerator: dense ops over the penalised rows (no host sync, cost O(P * V) on the device).
    On the CPU: per row, only the entries the row has seen (found with nonzero), as the same formulas
    (so both give the same values)."""
    counts, mask = info.output_counts, info.prompt_mask
    assert counts is not None and info.penalty_idx is not None and info.penalty_slots is not None
    rep, freq, pres = info.repetition, info.frequency, info.presence
    if x.device.type != "cpu":
        rows = x[info.penalty_idx]  # [P, V]
        row_counts = counts[info.penalty_slots]  # [P, V]
        if rep is not None:
            assert mask is not None
            rows = apply_repetition_penalty(rows, mask[info.penalty_slots] | (row_counts > 0), rep)
        if freq is not None:
            assert pres is not None
            rows = apply_frequency_presence(rows, row_counts, freq, pres)
        x[info.penalty_idx] = rows
        return
    for j, (row, slot) in enumerate(info.penalty_rows_cpu):
        c = counts[slot]  # [V]
        if rep is not None and float(rep[j, 0]) != 1.0:
            assert mask is not None
            cols = torch.nonzero(mask[slot] | (c > 0)).squeeze(1)
            v = x[row, cols]
            x[row, cols] = torch.where(v > 0, v / rep[j], v * rep[j])
        if freq is not None and pres is not None and (float(freq[j, 0]) != 0.0 or float(pres[j, 0]) != 0.0):
            cols = torch.nonzero(c).squeeze(1)
            x[row, cols] = x[row, cols] - (freq[j] * c[cols].to(torch.float32) + pres[j])
