"""kv_indices gathers each row's KV slots into one int32 list, exactly, and writes nothing else."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import kv_indices, kv_indices_ref
from mllmd_kernels.testing import kernel_device, on_gpu, skip_reason

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=skip_reason())

CASES = [(4, 64, [1, 7, 64]), (8, 1100, [513, 1, 1024, 3, 1100]), (2, 16, [])]
if on_gpu():
    CASES += [(64, 40960, [40000, 1, 4097] + [128] * 61)]


@pytest.mark.parametrize(("rows", "width", "lens"), CASES)
def test_kv_indices_matches_reference(rows: int, width: int, lens: list[int]) -> None:
    g = torch.Generator().manual_seed(rows * 7 + width)
    table = torch.randint(0, 1 << 30, (rows, width), generator=g).to(DEVICE)
    req = torch.randperm(rows, generator=g)[: len(lens)] if len(lens) <= rows else torch.randint(0, rows, (len(lens),), generator=g)
    req, seq = req.to(DEVICE), torch.tensor(lens, dtype=torch.int64, device=DEVICE)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=DEVICE)
    indptr[1:] = torch.cumsum(seq, 0)
    total = sum(lens)
    out = torch.full((total + 5,), -7, dtype=torch.int32, device=DEVICE)
    kv_indices(table, req, seq, indptr, total, out=out)
    assert torch.equal(out[:total], kv_indices_ref(table, req, seq))
    assert (out[total:] == -7).all(), "wrote past the end"
