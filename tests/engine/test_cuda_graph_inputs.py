"""The decode graphs' staged inputs (CPU): the host layout of CudaGraphRunner.stage, and the torch
completion used without Triton, which must leave what the graph's decode_inputs kernel leaves."""

from __future__ import annotations

import torch
from mllmd_kernels import decode_inputs_ref

from mllmd.engine.cuda_graph import (
    FILL,
    IDS,
    LOCS,
    NUM_INPUT_ROWS,
    POSITIONS,
    ROWS,
    SEQ_LENS,
    complete_inputs_eagerly,
    host_inputs,
)


def _staged(size: int) -> torch.Tensor:
    # three real rows: the first and last tokens in flight (fill), the middle one known
    host = host_inputs([0, 812, 0], [9, 4, 17], [5, 2, 7], [10, 5, 18], [1, 0, 1], size)
    buf = torch.tensor(host, dtype=torch.int64).view(NUM_INPUT_ROWS, size)
    buf[LOCS, :3] = torch.tensor([301, 302, 303])  # the device copy of the KV slots
    return buf


def test_host_inputs_layout_and_padding() -> None:
    buf = _staged(4)
    assert buf[IDS].tolist() == [0, 812, 0, 0]
    assert buf[POSITIONS].tolist() == [9, 4, 17, 0]
    assert buf[LOCS].tolist() == [301, 302, 303, 0]  # padding: the reserved slot 0
    assert buf[ROWS].tolist() == [5, 2, 7, 0]
    assert buf[SEQ_LENS].tolist() == [10, 5, 18, 1]  # padding attends over one token
    assert buf[FILL].tolist() == [1, 0, 1, 0]
    assert len(host_inputs([1], [0], [0], [1], [0], 1)) == NUM_INPUT_ROWS


def test_eager_completion_equals_the_graph_kernel() -> None:
    token_buf = torch.arange(100, 120)
    table = torch.full((8, 20), -1, dtype=torch.int64)
    table_k = table.clone()
    a, b = _staged(4), _staged(4)
    complete_inputs_eagerly(a, 3, token_buf, table)
    decode_inputs_ref(b[IDS], b[POSITIONS], b[LOCS], b[ROWS], b[FILL], token_buf, table_k)  # all 4 rows
    assert torch.equal(a, b) and torch.equal(table, table_k)
    assert a[IDS].tolist() == [105, 812, 107, 0]  # in-flight tokens from the buffer, by request row
    assert table[5, 9] == 301 and table[2, 4] == 302 and table[7, 17] == 303
    assert int((table != -1).sum()) == 3  # the padding row (slot 0) wrote nothing
