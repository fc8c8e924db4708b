"""The recurrent GDN decode step (Triton; with g/beta, or with the gating folded in) against its torch
references on a CUDA-graph-like batch: padded rows at the dummy slot 0, every other slot exactly as
the reference leaves it, and repeated steps equal to one recurrent pass."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import (
    fused_gdn_gating_decode,
    fused_gdn_gating_decode_ref,
    fused_recurrent_gated_delta_rule_decode,
    fused_recurrent_gated_delta_rule_decode_ref,
    gated_delta_rule_recurrent_ref,
)
from mllmd_kernels.testing import (
    DTYPES_WITH_FP32,
    interpreting,
    kernel_device,
    on_gpu,
    poisoned,
    randn,
    rel_err,
    skip_reason,
)

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=skip_reason())

# One step in float32 either way: only the 16-bit output's rounding (and, folded gating, beta's
# rounding to b's dtype, which the interpreter truncates instead of rounding) differ.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}

# (real rows, padded rows, Hk, Hv, Dk, Dv)
CASES = [(4, 3, 2, 2, 32, 32), (3, 1, 2, 4, 32, 64), (1, 0, 1, 2, 128, 128), (5, 2, 2, 4, 16, 48)]
if on_gpu():
    CASES += [(1, 0, 16, 32, 128, 128), (48, 16, 16, 32, 128, 128), (200, 56, 16, 16, 128, 128)]


def _step(rows: int, pad: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    b = rows + pad
    q = randn(b, hk, dk, dtype=dtype, device=DEVICE, gen=g)
    k = randn(b, hk, dk, dtype=dtype, device=DEVICE, gen=g)
    v = randn(b, hv, dv, dtype=dtype, device=DEVICE, gen=g)
    a = randn(b, hv, dtype=dtype, device=DEVICE, gen=g)
    bb = randn(b, hv, dtype=dtype, device=DEVICE, gen=g)
    a_log = (torch.rand(hv, generator=g) * 0.049 + 0.001).log().to(DEVICE)  # exp(g) near 1: long memory
    dt_bias = randn(hv, dtype=dtype, device=DEVICE, gen=g)
    pool = randn(rows + 3, hv, dk, dv, dtype=torch.float32, device=DEVICE, gen=g, scale=0.3)
    real = torch.randperm(rows + 2, generator=g)[:rows] + 1
    slots = torch.cat([real, torch.zeros(pad, dtype=torch.long)]).to(DEVICE)  # padded rows: slot 0
    return q, k, v, a, bb, a_log, dt_bias, pool, slots


def _gates(a, b, a_log, dt_bias):
    return -a_log.exp() * torch.nn.functional.softplus(a.float() + dt_bias.float()), b.sigmoid()


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize(("rows", "pad", "hk", "hv", "dk", "dv"), CASES)
@pytest.mark.parametrize("fold_gating", [False, True])
def test_decode_matches_reference(rows, pad, hk, hv, dk, dv, dtype, fold_gating) -> None:
    q, k, v, a, b, a_log, dt_bias, pool, slots = _step(rows, pad, hk, hv, dk, dv, dtype, rows * 7 + hv + dk)
    ref_pool = pool.clone()
    out = poisoned(tuple(v.shape), dtype, DEVICE)
    if fold_gating:
        fused_gdn_gating_decode(q, k, v, a, b, a_log, dt_bias, None, pool, slots, out=out)
        ref = fused_gdn_gating_decode_ref(q, k, v, a, b, a_log, dt_bias, None, ref_pool, slots)
    else:
        g, beta = _gates(a, b, a_log, dt_bias)
        fused_recurrent_gated_delta_rule_decode(q, k, v, g, beta, None, pool, slots, out=out)
        ref = fused_recurrent_gated_delta_rule_decode_ref(q, k, v, g, beta, None, ref_pool, slots)
    assert not out.isnan().any(), "some outputs were never written"
    tol = TOL[dtype] * (2 if fold_gating and interpreting() else 1)
    assert rel_err(out[:rows], ref[:rows]) < tol
    # slot 0 is the dummy (padded rows race there); every other slot, named or not, is the reference's
    assert rel_err(pool[1:], ref_pool[1:]) < (1e-6 if dtype == torch.float32 or not fold_gating else tol)
    unnamed = torch.ones(pool.shape[0], dtype=torch.bool, device=DEVICE)
    unnamed[slots] = False
    assert torch.equal(pool[unnamed], ref_pool[unnamed])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_steps_equal_one_recurrent_pass(dtype: torch.dtype) -> None:
    """Nine steps of two requests in one batch (plus a padded row) = the recurrent reference over each."""
    hk, hv, dk, dv, steps = 2, 4, 32, 32, 9
    gen = torch.Generator().manual_seed(17)
    q = randn(steps, 3, hk, dk, dtype=dtype, device=DEVICE, gen=gen)
    k = randn(steps, 3, hk, dk, dtype=dtype, device=DEVICE, gen=gen)
    v = randn(steps, 3, hv, dv, dtype=dtype, device=DEVICE, gen=gen)
    g = (-(torch.rand(steps, 3, hv, generator=gen) * 0.049 + 0.001)).to(DEVICE)
    beta = torch.rand(steps, 3, hv, generator=gen).to(dtype=dtype, device=DEVICE)
    pool = randn(4, hv, dk, dv, dtype=torch.float32, device=DEVICE, gen=gen, scale=0.3)
    start = pool.clone()
    slots = torch.tensor([2, 3, 0], device=DEVICE)
    outs = torch.stack([fused_recurrent_gated_delta_rule_decode(q[t], k[t], v[t], g[t], beta[t], None, pool, slots)
                        for t in range(steps)])  # fmt: skip
    for row, slot in ((0, 2), (1, 3)):
        expect, state = gated_delta_rule_recurrent_ref(q[:, row], k[:, row], v[:, row], g[:, row], beta[:, row], None,
                                                       start[slot])  # fmt: skip
        assert rel_err(outs[:, row], expect) < TOL[dtype]
        assert rel_err(pool[slot], state) < 1e-5
    assert torch.equal(pool[1], start[1])
