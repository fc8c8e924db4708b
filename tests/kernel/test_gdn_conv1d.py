"""The GDN causal conv1d (varlen prefill with pooled state, and the decode step) against its torch
references, and the references against transformers' `causal_conv1d_fn` / `causal_conv1d_update`."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import (
    causal_conv1d_decode,
    causal_conv1d_decode_ref,
    causal_conv1d_prefill,
    causal_conv1d_prefill_ref,
)
from mllmd_kernels.testing import (
    DTYPES_WITH_FP32,
    close_tol,
    kernel_device,
    on_gpu,
    poisoned,
    randn,
    skip_reason,
)

DEVICE = kernel_device()
K = 4

# (sequence lengths, channels); lengths 1 and 2 are shorter than the K-1 = 3 columns of state
CASES = [([1, 3, 2, 63, 64, 65, 130], 40), ([5], 16), ([2, 1, 1], 300)]
if on_gpu():
    CASES += [([2048], 8192), ([700, 1, 3, 1000, 344], 6144)]


def _pool(num_slots: int, c: int, dtype: torch.dtype, device: str, g: torch.Generator) -> torch.Tensor:
    return randn(num_slots, c, K - 1, dtype=dtype, device=device, gen=g)


def _batch(lens: list[int], device: str, g: torch.Generator, num_slots: int) -> tuple[torch.Tensor, ...]:
    cu = torch.tensor([0] + lens).cumsum(0).to(device=device, dtype=torch.int32)
    slots = (torch.randperm(num_slots - 1, generator=g)[: len(lens)] + 1).to(device)  # slot 0: the dummy
    init = (torch.arange(len(lens)) % 2 == 0).to(device)
    return cu, slots, init


@pytest.mark.skipif(DEVICE is None, reason=skip_reason())
@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize(("lens", "c"), CASES, ids=lambda v: str(v)[:24])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prefill_matches_reference_and_touches_only_its_slots(lens, c, dtype, with_bias) -> None:
    g = torch.Generator().manual_seed(sum(lens) + c + with_bias)
    num_slots = len(lens) + 3
    x = randn(sum(lens), c, dtype=dtype, device=DEVICE, gen=g)
    w = randn(c, K, dtype=dtype, device=DEVICE, gen=g, scale=0.5)
    bias = randn(c, dtype=dtype, device=DEVICE, gen=g) if with_bias else None
    cu, slots, init = _batch(lens, DEVICE, g, num_slots)
    pool = _pool(num_slots, c, dtype, DEVICE, g)
    pool_ref = pool.clone()
    y = poisoned(tuple(x.shape), dtype, DEVICE)
    causal_conv1d_prefill(x, w, bias, cu, pool, slots, init, out=y)
    y_ref = causal_conv1d_prefill_ref(x, w, bias, cu, pool_ref, slots, init)
    assert not y.isnan().any(), "some outputs were never written"
    torch.testing.assert_close(y, y_ref, **close_tol(dtype))
    assert torch.equal(pool, pool_ref), "the new conv states differ (they are copies of inputs or old states)"


@pytest.mark.skipif(DEVICE is None, reason=skip_reason())
@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize("c", [40, 300] + ([8192] if on_gpu() else []))
def test_decode_matches_reference_with_padded_rows(c: int, dtype: torch.dtype) -> None:
    """Rows padded to slot 0 (a CUDA-graph batch) leave every other slot as the reference does."""
    g = torch.Generator().manual_seed(c)
    num_slots = 9
    real = torch.tensor([3, 7, 1, 5])
    slots = torch.cat([real, torch.zeros(3, dtype=torch.long)]).to(DEVICE)
    x = randn(slots.shape[0], c, dtype=dtype, device=DEVICE, gen=g)
    w = randn(c, K, dtype=dtype, device=DEVICE, gen=g, scale=0.5)
    bias = randn(c, dtype=dtype, device=DEVICE, gen=g)
    pool = _pool(num_slots, c, dtype, DEVICE, g)
    pool_ref = pool.clone()
    y = poisoned(tuple(x.shape), dtype, DEVICE)
    causal_conv1d_decode(x, w, bias, pool, slots, out=y)
    y_ref = causal_conv1d_decode_ref(x, w, bias, pool_ref, slots)
    n = real.numel()
    torch.testing.assert_close(y[:n], y_ref[:n], **close_tol(dtype))
    assert torch.equal(pool[1:], pool_ref[1:]), "slots other than the dummy must be exactly the reference's"


@pytest.mark.skipif(DEVICE is None, reason=skip_reason())
def test_prefill_then_decode_equals_one_conv_over_the_whole_sequence() -> None:
    """Chunked prefill (lengths 2, then 1, then 5) and two decode steps = one conv of all 10 tokens."""
    g = torch.Generator().manual_seed(3)
    c = 24
    x = randn(10, c, dtype=torch.float32, device=DEVICE, gen=g)
    w = randn(c, K, dtype=torch.float32, device=DEVICE, gen=g)
    pool = _pool(3, c, torch.float32, DEVICE, g)
    slot = torch.tensor([2], device=DEVICE)
    ys = []
    for i, (a, b) in enumerate([(0, 2), (2, 3), (3, 8)]):
        cu = torch.tensor([0, b - a], dtype=torch.int32, device=DEVICE)
        init = torch.tensor([i > 0], device=DEVICE)
        ys.append(causal_conv1d_prefill(x[a:b], w, None, cu, pool, slot, init))
    for t in (8, 9):
        ys.append(causal_conv1d_decode(x[t : t + 1], w, None, pool, slot))
    whole = causal_conv1d_prefill_ref(x, w, None, torch.tensor([0, 10]), pool.clone(), slot.cpu(), torch.tensor([False]))
    torch.testing.assert_close(torch.cat(ys), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[2], x[7:].t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_references_equal_transformers(dtype: torch.dtype) -> None:
    """The prefill reference with a zero or saved history is transformers' causal_conv1d_fn on the
    history-prefixed inputs (as its cached forward calls it), the decode reference its
    causal_conv1d_update; equal up to the order of the four products (a zero-padded conv against the
    zero-history one)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, causal_conv1d_update

    g = torch.Generator().manual_seed(1)
    c, lens = 12, [5, 2]
    x = torch.randn(sum(lens), c, generator=g).to(dtype)
    w = torch.randn(c, K, generator=g).to(dtype)
    pool = torch.randn(3, c, K - 1, generator=g).to(dtype)
    cu, slots, init = torch.tensor([0, 5, 7]), torch.tensor([1, 2]), torch.tensor([False, True])
    before = pool.clone()
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-5}  # one ulp
    y = causal_conv1d_prefill_ref(x, w, None, cu, pool, slots, init)
    torch.testing.assert_close(y[:5], causal_conv1d_fn(x[None, :5].transpose(1, 2), w, None, "silu")[0].t(), **tol)
    hist = torch.cat([before[2], x[5:].t()], dim=-1)[None]
    torch.testing.assert_close(y[5:], causal_conv1d_fn(hist, w, None, "silu")[0, :, -2:].t(), **tol)
    torch.testing.assert_close(pool[2], hist[0, :, -3:], rtol=0, atol=0)
    xd = torch.randn(2, c, generator=g).to(dtype)
    state = pool[slots].clone()
    yd = causal_conv1d_decode_ref(xd, w, None, pool, slots)
    expect = causal_conv1d_update(xd[:, :, None], state, w, None, "silu")[:, :, 0]
    torch.testing.assert_close(yd, expect, **tol)
    torch.testing.assert_close(pool[slots], state, rtol=0, atol=0)
