"""Extend (prefill with cached prefix) attention against an fp32 torch reference on fresh random pools."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import extend_attention, extend_attention_ref
from mllmd_kernels.testing import (
    DTYPES_WITH_FP32,
    REL_TOL,
    kernel_device,
    make_paged_kv,
    on_gpu,
    poisoned,
    randn,
    rel_err,
    skip_reason,
)

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=skip_reason())

# (prefix_lens, extend_lens, Hq, Hkv, head_dim): no prefix, a long prefix, decode rows (extend 1),
# extends longer and shorter than a query block.
CASES = [
    ([0], [20], 4, 2, 16),
    ([0, 40, 7, 90], [9, 1, 33, 1], 4, 2, 16),
    ([13, 0], [70, 5], 6, 3, 32),
    ([100], [1], 2, 1, 24),
]
if on_gpu():
    CASES += [
        ([0], [2048], 32, 8, 128),
        ([1500, 0, 33, 4000], [200, 700, 1, 64], 32, 8, 128),
        ([7] * 16, [7] * 16, 16, 8, 128),
        ([0, 300], [1100, 70], 16, 4, 256),  # Qwen3.5's heads: the 64 x 64 tiles on Hopper
    ]


def _check(prefix, extend, hq, hkv, d, dtype, seed, tiles=None) -> None:
    """extend_attention on fresh random pools (poisoned output) against the fp32 reference."""
    g = torch.Generator().manual_seed(seed)
    seq = [p + e for p, e in zip(prefix, extend)]
    k_buf, v_buf, table, rows = make_paged_kv(seq, hkv, d, dtype, DEVICE, g)
    t = sum(extend)
    q = randn(t, hq, d, dtype=dtype, device=DEVICE, gen=g)
    seq_lens = torch.tensor(seq, device=DEVICE)
    ext = torch.tensor(extend, device=DEVICE)
    qo_start = torch.cumsum(ext, 0) - ext
    scale = d**-0.5
    out = poisoned((t, hq, d), dtype, DEVICE)
    extend_attention(q, k_buf, v_buf, table, rows, seq_lens, ext, qo_start, max(extend), scale, out=out, tiles=tiles)
    assert not out.isnan().any(), "some outputs were never written"
    ref = extend_attention_ref(q, k_buf.float(), v_buf.float(), table, rows, seq_lens, ext, scale)
    assert rel_err(out, ref) < REL_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize(("prefix", "extend", "hq", "hkv", "d"), CASES, ids=lambda v: str(v)[:20])
def test_extend_attention_matches_reference(prefix, extend, hq, hkv, d, dtype) -> None:
    _check(prefix, extend, hq, hkv, d, dtype, sum(prefix) * 3 + sum(extend) + d)


@pytest.mark.parametrize("tiles", [(16, 32, 4, 2), (32, 16, 4, 2), (64, 16, 4, 1)], ids=str)
def test_extend_attention_tilings_agree(tiles) -> None:
    """Query and key blocks of different sizes split the unmasked and masked key ranges at different
    places (a block boundary inside a prefix, a query block wider than a key block and narrower):
    every tiling gives the reference's output."""
    _check([0, 37, 5, 70], [50, 29, 1, 18], 4, 2, 16, torch.float32, 7, tiles)
