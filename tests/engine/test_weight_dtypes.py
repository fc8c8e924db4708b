"""A checkpoint tensor of the wrong kind is refused at load, naming the tensor.

Before: a float weight stored with an integer dtype (a header saying I32 for q_proj.weight) was
converted by copy_ and the model loaded, answering garbage; only integers stored as floats were refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mllmd.models.layers.linear import Linear
from mllmd.models.weights import load_weights


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(4))
        self.proj = Linear(4, 4, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool])
@pytest.mark.parametrize("name", ["norm.weight", "proj.weight"])
def test_integer_tensors_into_float_weights_are_refused(name: str, dtype: torch.dtype) -> None:
    good = {"norm.weight": torch.ones(4), "proj.weight": torch.ones(4, 4)}
    weights = good | {name: good[name].to(dtype)}
    with pytest.raises(ValueError, match=rf"{name}.* is torch\.{str(dtype)[6:]}, expected a floating-point tensor"):
        load_weights(_Tiny(), weights.items(), {})


def test_other_float_dtypes_still_load() -> None:
    """A bfloat16 tensor in a float32 model is converted, as transformers does."""
    model = _Tiny()
    load_weights(model, {"norm.weight": torch.full((4,), 2.0, dtype=torch.bfloat16),
                         "proj.weight": torch.ones(4, 4, dtype=torch.float16)}.items(), {})
    assert model.norm.weight.dtype == torch.float32 and float(model.norm.weight[0]) == 2.0
