"""What a step hands a vision-language decoder besides token ids: the image embeddings of its image tokens."""

from __future__ import annotations

from typing import NamedTuple

import torch


class ImageEmbeds(NamedTuple):
    """The step's image tokens: their rows in the step's flat tokens, the tower's embeddings for them,
    and (Qwen3-VL's deepstack) what is added to those rows after each of the first decoder layers."""

    rows: torch.Tensor  # [M] int64
    embeds: torch.Tensor  # [M, H]
    deepstack: list[torch.Tensor]  # k x [M, H]
