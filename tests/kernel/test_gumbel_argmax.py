"""gumbel_argmax picks exactly the tokens of the torch sampler's unfiltered seeded path."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import gumbel_argmax, gumbel_argmax_ref
from mllmd_kernels.gumbel import row_keys
from mllmd_kernels.testing import kernel_device, on_gpu, skip_reason

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=skip_reason())

CASES = [(3, 2000, [0.7, 1.0, 1.6]), (5, 3001, [0.05, 2.0, 1.0, 0.3, 1.2])]
if on_gpu():
    CASES += [(64, 151936, [0.6 + 0.02 * i for i in range(64)])]


@pytest.mark.parametrize(("rows", "vocab", "temps"), CASES)
def test_gumbel_argmax_equals_the_torch_sampler(rows: int, vocab: int, temps: list[float]) -> None:
    g = torch.Generator().manual_seed(rows * vocab)
    logits = (torch.randn(rows + 2, vocab, generator=g) * 3).to(DEVICE)
    logits[0, 7] = logits[0, 11] = logits[0].max() + 3  # two dominant columns: the noise decides
    which = torch.arange(rows, device=DEVICE).flip(0)  # rows are gathered, not taken in order
    keys = row_keys([1000 + i for i in range(rows)], [i * 3 for i in range(rows)]).to(DEVICE)
    t = torch.tensor(temps, dtype=torch.float32, device=DEVICE)
    out = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)
    gumbel_argmax(logits, which, keys, t, out=out)
    assert torch.equal(out, gumbel_argmax_ref(logits, which, keys, t))
    assert out.min() >= 0 and out.max() < vocab
