"""What a step hands a vision-language decoder besides token ids: the image embeddings of its image tokens.

Two forms with one interface (`merge`, `add_deepstack`), so the model files read the same either way:
`ImageEmbeds` names the image rows (an eager step), `DenseImageEmbeds` holds a row for every token of
the step with a mask (a prefill CUDA graph's static inputs, whose shapes cannot follow the image).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class ImageEmbeds(NamedTuple):
    """The step's image tokens: their rows in the step's flat tokens, the tower's embeddings for them,
    and (Qwen3-VL's deepstack) what is added to those rows after each of the first decoder layers."""

    rows: torch.Tensor  # [M] int64
    embeds: torch.Tensor  # [M, H]
    deepstack: list[torch.Tensor]  # k x [M, H]

    def merge(self, hidden: torch.Tensor) -> torch.Tensor:
        """The token embeddings [T, H] with the image rows replaced by the tower's."""
        return hidden.index_copy(0, self.rows, self.embeds.to(hidden.dtype))

    def add_deepstack(self, hidden: torch.Tensor, layer: int) -> torch.Tensor:
        """hidden after decoder layer `layer` (< len(deepstack)) with that layer's deepstack added at the image rows."""
        return hidden.index_add(0, self.rows, self.deepstack[layer].to(hidden.dtype))


class DenseImageEmbeds(NamedTuple):
    """ImageEmbeds laid out over all T tokens of the step: `mask` marks the image tokens, `embeds`
    holds their rows (other rows: anything), each deepstack tensor theirs and zeros elsewhere (adding
    zero leaves a text token's hidden state as it is)."""

    mask: torch.Tensor  # [T] bool
    embeds: torch.Tensor  # [T, H]
    deepstack: list[torch.Tensor]  # k x [T, H]

    def merge(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.where(self.mask[:, None], self.embeds.to(hidden.dtype), hidden)

    def add_deepstack(self, hidden: torch.Tensor, layer: int) -> torch.Tensor:
        return hidden + self.deepstack[layer].to(hidden.dtype)


StepImages = ImageEmbeds | DenseImageEmbeds  # what a decoder's forward takes as `images`
