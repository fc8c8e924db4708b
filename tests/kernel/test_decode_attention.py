"""Paged GQA decode attention (split-KV) against an fp32 torch reference on fresh random pools."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import decode_attention, decode_attention_ref
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


# (seq_lens, Hq, Hkv, head_dim, num_splits or None)
CASES = [
    ([1, 37, 100], 4, 2, 16, None),
    ([5, 64, 65, 130], 8, 1, 32, 3),
    ([200], 2, 2, 24, 8),
    ([70, 1], 4, 4, 64, 1),
]
if on_gpu():
    CASES += [
        ([4000], 32, 8, 128, None),
        ([int(x) for x in torch.randint(1, 1200, (64,), generator=torch.Generator().manual_seed(0))], 32, 8, 128, None),
        ([1, 128, 513, 2048, 77, 9, 1000, 300], 16, 8, 128, None),
        ([33000, 5], 64, 4, 128, 16),
    ]


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize(("seq_lens", "hq", "hkv", "d", "splits"), CASES, ids=lambda v: str(v)[:20])
def test_decode_attention_matches_reference(seq_lens, hq, hkv, d, splits, dtype) -> None:
    g = torch.Generator().manual_seed(sum(seq_lens) + hq * 7 + d)
    k_buf, v_buf, table, rows = make_paged_kv(seq_lens, hkv, d, dtype, DEVICE, g)
    bsz = len(seq_lens)
    q = randn(bsz, hq, d, dtype=dtype, device=DEVICE, gen=g)
    lens = torch.tensor(seq_lens, device=DEVICE)
    scale = d**-0.5
    out = poisoned((bsz, hq, d), dtype, DEVICE)
    decode_attention(q, k_buf, v_buf, table, rows, lens, scale, out=out, num_splits=splits)
    assert not out.isnan().any(), "some outputs were never written"
    ref = decode_attention_ref(q, k_buf.float(), v_buf.float(), table, rows, lens, scale)
    assert rel_err(out, ref) < REL_TOL[dtype]


def test_decode_attention_padded_rows_give_zeros() -> None:
    """A padded batch row (seq_len 0, request slot 0) writes zeros, never NaN (CUDA-graph padding)."""
    g = torch.Generator().manual_seed(11)
    k_buf, v_buf, table, rows = make_paged_kv([50, 3], 2, 16, torch.float16, DEVICE, g)
    rows = torch.cat([rows, torch.zeros(1, dtype=rows.dtype, device=DEVICE)])
    lens = torch.tensor([50, 3, 0], device=DEVICE)
    q = randn(3, 4, 16, dtype=torch.float16, device=DEVICE, gen=g)
    out = decode_attention(q, k_buf, v_buf, table, rows, lens, 0.25, out=poisoned((3, 4, 16), torch.float16, DEVICE))
    assert (out[2] == 0).all() and not out.isnan().any()
    ref = decode_attention_ref(q[:2], k_buf.float(), v_buf.float(), table, rows[:2], lens[:2], 0.25)
    assert rel_err(out[:2], ref) < REL_TOL[torch.float16]


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
def test_decode_attention_writes_each_heads_max_output(dtype: torch.dtype) -> None:
    """With out_amax, each (request, head) program also stores max |output| of the values it wrote
    (what a W8A8 o projection takes its scale from): exactly out.abs().amax over head_dim, zeros for
    a padded row; the output itself is the same bits as without."""
    g = torch.Generator().manual_seed(21)
    seq_lens = [130, 7, 0]
    k_buf, v_buf, table, rows = make_paged_kv(seq_lens[:2], 2, 24, dtype, DEVICE, g)
    rows = torch.cat([rows, torch.zeros(1, dtype=rows.dtype, device=DEVICE)])
    q = randn(3, 4, 24, dtype=dtype, device=DEVICE, gen=g, scale=4.0)
    lens = torch.tensor(seq_lens, device=DEVICE)
    amax = poisoned((12,), torch.float32, DEVICE)
    out = decode_attention(q, k_buf, v_buf, table, rows, lens, 0.3, num_splits=4, out_amax=amax)
    assert torch.equal(out, decode_attention(q, k_buf, v_buf, table, rows, lens, 0.3, num_splits=4))
    assert torch.equal(amax, out.float().abs().amax(-1).reshape(12))
    assert (amax[8:] == 0).all() and (amax[:8] > 0).all()
