"""Log-probabilities of the raw model distribution (before bias, penalties and temperature).

As vLLM's default "raw logprobs": logprob(t) = logit[t] - logsumexp(logits), in float32. The
top-K entries are selected on the logits first (torch.topk) and shifted by the same logsumexp, so
no full [B, V] log_softmax is built.
"""

from __future__ import annotations

import torch


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """logits [B, V] (any float dtype), token_ids [B] -> (logprob [B], top ids [B, K], top logprobs [B, K]).

    Top entries come sorted by descending logprob; they are None when num_top == 0.
    """
    lse = torch.logsumexp(logits.float(), dim=-1)  # [B]
    chosen = logits.gather(1, token_ids[:, None]).squeeze(1).float() - lse  # [B]
    if num_top <= 0:
        return chosen, None, None
    k = min(num_top, logits.shape[-1])
    vals, ids = torch.topk(logits, k, dim=-1)  # [B, K], sorted descending
    return chosen, ids, vals.float() - lse[:, None]
