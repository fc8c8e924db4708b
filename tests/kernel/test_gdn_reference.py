"""The Gated DeltaNet torch references against each other and against transformers' own functions
(torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule), so that kernel == reference ==
transformers is one chain. Long-memory decays (exp(g) near 1): a lost or doubled state shows."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import (
    chunk_gated_delta_rule_ref,
    fused_gdn_gating_decode_ref,
    fused_recurrent_gated_delta_rule_decode_ref,
    gated_delta_rule_chunked_ref,
    gated_delta_rule_recurrent_ref,
    gdn_gating_ref,
)

# (length, Hk, Hv, Dk, Dv)
CASES = [(1, 2, 2, 16, 16), (63, 2, 4, 32, 16), (64, 1, 1, 32, 32), (70, 2, 4, 32, 48), (130, 2, 2, 16, 32)]


def _inputs(length: int, hk: int, hv: int, dk: int, dv: int, seed: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(length, hk, dk, generator=g).to(dtype)
    k = torch.randn(length, hk, dk, generator=g).to(dtype)
    v = torch.randn(length, hv, dv, generator=g).to(dtype)
    decay = -(torch.rand(length, hv, generator=g) * 0.049 + 0.001)  # g in [-0.05, -0.001]
    beta = torch.rand(length, hv, generator=g).to(dtype)
    state = torch.randn(hv, dk, dv, generator=g) * 0.5
    return q, k, v, decay, beta, state


@pytest.mark.parametrize(("length", "hk", "hv", "dk", "dv"), CASES)
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_reference_equals_recurrent(length, hk, hv, dk, dv, with_state) -> None:
    q, k, v, g, beta, s0 = _inputs(length, hk, hv, dk, dv, length + hv)
    init = s0 if with_state else None
    o1, f1 = gated_delta_rule_recurrent_ref(q, k, v, g, beta, None, init)
    o2, f2, snaps = gated_delta_rule_chunked_ref(q, k, v, g, beta, None, init)
    torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(f2, f1, rtol=1e-5, atol=1e-5)
    assert snaps.shape == (length // 64, hv, dk, dv)
    for c in range(snaps.shape[0]):  # the state after each full chunk is the recurrent one on that prefix
        n = (c + 1) * 64
        _, fc = gated_delta_rule_recurrent_ref(q[:n], k[:n], v[:n], g[:n], beta[:n], None, init)
        torch.testing.assert_close(snaps[c], fc, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("length", "hk", "hv", "dk", "dv"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_references_equal_transformers(length, hk, hv, dk, dv, dtype) -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    q, k, v, g, beta, s0 = _inputs(length, hk, hv, dk, dv, 3 * length + hk, dtype)
    kw = {"initial_state": s0[None], "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    # the model repeats q and k over the value heads before calling these (older releases' functions
    # take only Hk == Hv), so the same is done here
    qr, kr = (x.repeat_interleave(hv // hk, dim=1)[None] for x in (q, k))
    o_hf, f_hf = torch_chunk_gated_delta_rule(qr, kr, v[None], g[None], beta[None], **kw)
    o, f, _ = gated_delta_rule_chunked_ref(q, k, v, g, beta, None, s0)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}  # bf16 output
    torch.testing.assert_close(o, o_hf[0], **tol)
    torch.testing.assert_close(f, f_hf[0], rtol=1e-5, atol=1e-5)
    o_hf, f_hf = torch_recurrent_gated_delta_rule(qr, kr, v[None], g[None], beta[None], **kw)
    o, f = gated_delta_rule_recurrent_ref(q, k, v, g, beta, None, s0)
    torch.testing.assert_close(o, o_hf[0], **tol)
    torch.testing.assert_close(f, f_hf[0], rtol=1e-5, atol=1e-5)


def test_pool_references_read_and_write_slots() -> None:
    """The varlen pool reference is the per-sequence reference on each slot; slots it does not name keep
    their contents; snapshots land where named; decode continues the prefill's state."""
    hk, hv, dk, dv = 2, 4, 16, 16
    lens = [3, 130, 64]
    parts = [_inputs(n, hk, hv, dk, dv, 11 + i) for i, n in enumerate(lens)]
    q, k, v, g, beta = (torch.cat([p[i] for p in parts]) for i in range(5))
    pool = torch.randn(10, hv, dk, dv)
    pool[4] = parts[1][5]  # the second sequence continues from a saved state
    before = pool.clone()
    slots, init = torch.tensor([2, 4, 6]), torch.tensor([False, True, False])
    cu = torch.tensor([0, 3, 133, 197])
    final_snap = torch.tensor([-1, 8, -1])
    chunk_snap = torch.tensor([[-1, -1], [7, 9], [5, -1]])
    o = chunk_gated_delta_rule_ref(q, k, v, g, beta, None, pool, slots, init, cu, True, final_snap, chunk_snap)
    for n, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        sl = slice(bos, eos)
        s0 = before[4] if n == 1 else None
        on, fn = gated_delta_rule_recurrent_ref(q[sl], k[sl], v[sl], g[sl], beta[sl], None, s0)
        torch.testing.assert_close(o[sl], on, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool[int(slots[n])], fn, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[8], pool[4])  # final snapshot of sequence 1
    _, s64 = gated_delta_rule_recurrent_ref(q[3:67], k[3:67], v[3:67], g[3:67], beta[3:67], None, before[4])
    torch.testing.assert_close(pool[7], s64, rtol=1e-5, atol=1e-5)  # after 64 of its 130 tokens
    torch.testing.assert_close(pool[5], pool[6])  # 64 tokens: the only full chunk is the final state
    for untouched in (0, 1, 3):
        assert torch.equal(pool[untouched], before[untouched])
    # one decode step on slot 4 continues sequence 1
    x = _inputs(1, hk, hv, dk, dv, 99)
    expect, _ = gated_delta_rule_recurrent_ref(x[0], x[1], x[2], x[3], x[4], None, pool[4].clone())
    od = fused_recurrent_gated_delta_rule_decode_ref(x[0], x[1], x[2], x[3], x[4], None, pool, torch.tensor([4]))
    torch.testing.assert_close(od, expect)


def test_gating_reference_is_the_layers_formula() -> None:
    """g and beta as Qwen3_5GatedDeltaNet.forward computes them (bf16 projections, fp32 A_log, bf16
    dt_bias), and the gated decode reference is the plain one on those."""
    gen = torch.Generator().manual_seed(5)
    a, b = (torch.randn(3, 4, generator=gen).to(torch.bfloat16) * 4 for _ in range(2))
    a_log, dt_bias = torch.randn(4, generator=gen), torch.randn(4, generator=gen).to(torch.bfloat16)
    g, beta = gdn_gating_ref(a, b, a_log, dt_bias)
    expect_g = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == torch.bfloat16
    assert torch.equal(g, expect_g) and torch.equal(beta, b.sigmoid())
    q, k = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)
    v = torch.randn(3, 4, 8, generator=gen)
    pool = torch.randn(4, 4, 8, 8, generator=gen)
    pool2 = pool.clone()
    slots = torch.tensor([1, 3, 2])
    o1 = fused_gdn_gating_decode_ref(q, k, v, a, b, a_log, dt_bias, None, pool, slots)
    o2 = fused_recurrent_gated_delta_rule_decode_ref(q, k, v, g, beta, None, pool2, slots)
    assert torch.equal(o1, o2) and torch.equal(pool, pool2)
