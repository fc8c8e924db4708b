"""greedy_argmax picks torch.argmax's tokens (first index on ties) in one launch, and fills the sink."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import GreedyWorkspace, greedy_argmax, greedy_argmax_ref
from mllmd_kernels.sampling import GREEDY_BLOCK
from mllmd_kernels.testing import kernel_device, on_gpu, skip_reason

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=skip_reason())

# (rows, vocab): one chunk, a partial last chunk, Qwen3's vocabulary on the GPU
CASES = [(1, 1000), (3, 3 * GREEDY_BLOCK + 17)]
if on_gpu():
    CASES += [(1, 151936), (64, 151936)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "vocab"), CASES)
def test_greedy_argmax_equals_torch_argmax(rows: int, vocab: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows * vocab)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype).to(DEVICE)
    cross = vocab > GREEDY_BLOCK and rows > 1
    if cross:  # a tie across chunks: the earlier column wins
        logits[0, GREEDY_BLOCK + 5] = logits[0, vocab - 1] = logits[0].max() + 1
    logits[-1, 3] = logits[-1, 2] = logits[-1].max() + 1  # a tie within a chunk (the last row)
    ws = GreedyWorkspace(rows + 2, vocab, DEVICE)
    for _ in range(2):  # the counters are back to zero after a launch: a second one is right too
        out = greedy_argmax(logits, ws)
        assert torch.equal(out, greedy_argmax_ref(logits)), (out, greedy_argmax_ref(logits))
    assert torch.equal(ws.counters, torch.zeros_like(ws.counters))
    if cross:
        assert int(out[0]) == GREEDY_BLOCK + 5
    assert int(out[-1]) == 2


def test_greedy_argmax_writes_the_sink_rows() -> None:
    """Row b's token also lands at sink[rows[b]] (the engine's token buffer); nothing else changes."""
    vocab, rows = 2 * GREEDY_BLOCK + 9, 4
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    buf = torch.full((10,), -7, dtype=torch.int64, device=DEVICE)
    where = torch.tensor([6, 0, 9, 2], dtype=torch.int64, device=DEVICE)
    out = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)
    greedy_argmax(logits, GreedyWorkspace(rows, vocab, DEVICE), out=out, sink=(buf, where))
    want = greedy_argmax_ref(logits)
    assert torch.equal(out, want)
    expect = torch.full((10,), -7, dtype=torch.int64)
    expect[where.cpu()] = want.cpu()
    assert torch.equal(buf.cpu(), expect)


def test_greedy_argmax_edge_rows() -> None:
    """An all -inf row takes column 0, as torch does; a NaN counts as the largest value."""
    vocab = GREEDY_BLOCK + 100
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    logits[0] = float("-inf")
    logits[1, GREEDY_BLOCK + 50] = float("nan")
    out = greedy_argmax(logits, GreedyWorkspace(3, vocab, DEVICE))
    assert out.tolist()[:2] == [0, GREEDY_BLOCK + 50]
    assert out.tolist() == torch.argmax(logits, dim=-1).tolist()


def test_greedy_workspace_refuses_a_larger_batch() -> None:
    ws = GreedyWorkspace(2, 1000, DEVICE)
    with pytest.raises(AssertionError, match="workspace"):
        greedy_argmax(torch.zeros(3, 1000, device=DEVICE), ws)
