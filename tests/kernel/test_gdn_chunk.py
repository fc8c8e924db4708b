"""chunk_gated_delta_rule (Triton, varlen, pooled states) against its torch reference on fresh random
inputs with long-memory decays (g in [-0.05, -0.001]: a lost state shows): outputs, the final states
in the named slots, snapshots, every other slot untouched, and chunked prefill that continues from a
slot equal to one pass. Small shapes under the interpreter; GPU-sized cases only on CUDA."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_ref,
    fused_recurrent_gated_delta_rule_decode,
    gated_delta_rule_recurrent_ref,
)
from mllmd_kernels.testing import (
    DTYPES_WITH_FP32,
    kernel_device,
    on_gpu,
    poisoned,
    randn,
    rel_err,
    skip_reason,
)

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=skip_reason())

# ||out - ref|| / ||ref|| against the float32 reference on the same (rounded) inputs. On the GPU the
# 16-bit path runs bf16/fp16 dots and keeps w, u and the chunk attention in 16 bits; the interpreter
# computes in float32, so there only the outputs' rounding counts.
TOL = {torch.float32: 1e-4 if on_gpu() else 2e-5, torch.float16: 1e-2, torch.bfloat16: 2.5e-2}
STATE_TOL = {torch.float32: 1e-4 if on_gpu() else 2e-5, torch.float16: 1e-2, torch.bfloat16: 2.5e-2}

LENS = [1, 3, 63, 64, 65, 130]  # around the chunk length
# (lengths, Hk, Hv, Dk, Dv)
CASES = [(LENS, 2, 2, 32, 32), (LENS, 2, 4, 32, 32), ([70, 3], 1, 2, 128, 128)]
if on_gpu():
    CASES += [([2048], 16, 32, 128, 128), ([700, 1, 3, 1000, 344], 16, 32, 128, 128), ([129, 64, 1], 16, 16, 128, 128)]


def _batch(lens, hk, hv, dk, dv, dtype, seed, extra_slots=4):
    """Inputs, a pool with random states, each sequence's slot (never 0) and has_initial_state (every
    other one); the slots of sequences without one hold NaN (they must not be read)."""
    g = torch.Generator().manual_seed(seed)
    t, n = sum(lens), len(lens)
    q = randn(t, hk, dk, dtype=dtype, device=DEVICE, gen=g)
    k = randn(t, hk, dk, dtype=dtype, device=DEVICE, gen=g)
    v = randn(t, hv, dv, dtype=dtype, device=DEVICE, gen=g)
    decay = (-(torch.rand(t, hv, generator=g) * 0.049 + 0.001)).to(DEVICE)
    beta = torch.rand(t, hv, generator=g).to(dtype=dtype, device=DEVICE)
    pool = randn(n + extra_slots, hv, dk, dv, dtype=torch.float32, device=DEVICE, gen=g, scale=0.3)
    slots = (torch.randperm(n + extra_slots - 1, generator=g)[:n] + 1).to(DEVICE)
    init = (torch.arange(n) % 2 == 1).to(DEVICE)
    pool[slots[~init]] = float("nan")
    cu = torch.tensor([0] + lens).cumsum(0).to(device=DEVICE, dtype=torch.int32)
    return q, k, v, decay, beta, pool, slots, init, cu


@pytest.mark.parametrize("dtype", DTYPES_WITH_FP32)
@pytest.mark.parametrize(("lens", "hk", "hv", "dk", "dv"), CASES, ids=lambda x: str(x)[:16])
def test_chunk_matches_reference(lens, hk, hv, dk, dv, dtype) -> None:
    q, k, v, g, beta, pool, slots, init, cu = _batch(lens, hk, hv, dk, dv, dtype, sum(lens) + hv + dk)
    before = pool.clone()
    out = poisoned(tuple(v.shape), dtype, DEVICE)
    got = chunk_gated_delta_rule(q, k, v, g, beta, None, pool, slots, init, cu, out=out)
    ref_pool = before.clone()
    ref = chunk_gated_delta_rule_ref(q, k, v, g, beta, None, ref_pool, slots, init, cu)
    assert got is out and not out.isnan().any(), "some outputs were never written (or a NaN slot was read)"
    assert rel_err(got, ref) < TOL[dtype], rel_err(got, ref)
    assert rel_err(pool[slots], ref_pool[slots]) < STATE_TOL[dtype], rel_err(pool[slots], ref_pool[slots])
    others = torch.ones(pool.shape[0], dtype=torch.bool, device=DEVICE)
    others[slots] = False
    assert torch.equal(pool[others], before[others]), "a slot no sequence names was written"


def test_snapshots_land_in_their_slots() -> None:
    """chunk_snapshot_indices: the state after each named full chunk; final_snapshot_indices: a copy of
    the final state; -1 writes nothing, nor does a column past a sequence's full chunks."""
    lens = [130, 64, 5]
    q, k, v, g, beta, pool, slots, init, cu = _batch(lens, 2, 4, 32, 32, torch.float32, 3, extra_slots=10)
    free = [s for s in range(1, pool.shape[0]) if s not in slots.tolist()]
    chunk_snap = torch.tensor([[free[0], free[1], free[2]], [-1, free[3], -1], [free[4], -1, -1]], device=DEVICE)
    final_snap = torch.tensor([free[5], -1, free[6]], device=DEVICE)
    before = pool.clone()
    chunk_gated_delta_rule(q, k, v, g, beta, None, pool, slots, init, cu, True, final_snap, chunk_snap)
    ref_pool = before.clone()
    chunk_gated_delta_rule_ref(q, k, v, g, beta, None, ref_pool, slots, init, cu, True, final_snap, chunk_snap)
    written = [free[0], free[1], free[5], free[6]] + slots.tolist()  # 130 tokens: two full chunks
    for s in written:
        assert rel_err(pool[s], ref_pool[s]) < 2e-5, s
    torch.testing.assert_close(pool[free[5]], pool[int(slots[0])], rtol=0, atol=0)
    for s in (free[2], free[3], free[4], free[7]):  # beyond the full chunks, or never named
        assert torch.equal(pool[s], before[s]), s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_prefill_and_decode_continue_one_pass(dtype: torch.dtype) -> None:
    """A request prefilled as 64 + 81 tokens (the second chunk in a mixed batch beside a new request),
    then decoded for two steps, gives the outputs and state of one recurrent pass over all 147 tokens."""
    hk, hv, dk, dv = 2, 4, 32, 32
    q, k, v, g, beta, pool, _, _, _ = _batch([147], hk, hv, dk, dv, dtype, 21, extra_slots=4)
    nq, nk, nv, ng, nb, *_ = _batch([30], hk, hv, dk, dv, dtype, 22)
    slot, other = 3, 1
    i32 = {"dtype": torch.int32, "device": DEVICE}
    outs = [chunk_gated_delta_rule(q[:64], k[:64], v[:64], g[:64], beta[:64], None, pool,
                                   torch.tensor([slot], device=DEVICE), torch.tensor([False], device=DEVICE),
                                   torch.tensor([0, 64], **i32))]  # fmt: skip
    cat = [torch.cat([x[64:145], y]) for x, y in ((q, nq), (k, nk), (v, nv), (g, ng), (beta, nb))]
    mixed = chunk_gated_delta_rule(*cat, None, pool, torch.tensor([slot, other], device=DEVICE),
                                   torch.tensor([True, False], device=DEVICE), torch.tensor([0, 81, 111], **i32))  # fmt: skip
    outs.append(mixed[:81])
    for t in (145, 146):
        sl = slice(t, t + 1)
        outs.append(fused_recurrent_gated_delta_rule_decode(q[sl], k[sl], v[sl], g[sl], beta[sl], None, pool,
                                                            torch.tensor([slot], device=DEVICE)))  # fmt: skip
    expect, state = gated_delta_rule_recurrent_ref(q, k, v, g, beta)
    assert rel_err(torch.cat(outs), expect) < TOL[dtype]
    assert rel_err(pool[slot], state) < STATE_TOL[dtype]
    new_out, new_state = gated_delta_rule_recurrent_ref(nq, nk, nv, ng, nb)
    assert rel_err(mixed[81:], new_out) < TOL[dtype] and rel_err(pool[other], new_state) < STATE_TOL[dtype]


def test_empty_batch_and_scale() -> None:
    """No sequences: nothing launched; an explicit scale is the one used (no l2 norm: q scaled as given)."""
    q, k, v, g, beta, pool, slots, init, cu = _batch([5, 70], 1, 1, 16, 16, torch.float32, 8)
    before = pool.clone()
    empty = torch.zeros(0, dtype=torch.long, device=DEVICE)
    chunk_gated_delta_rule(q[:0], k[:0], v[:0], g[:0], beta[:0], None, pool, empty, empty.bool(), cu[:1])
    assert torch.equal(pool.nan_to_num(), before.nan_to_num())
    got = chunk_gated_delta_rule(q, k, v, g, beta, 0.3, pool, slots, init, cu, use_qk_l2norm=False)
    ref_pool = before.clone()
    ref = chunk_gated_delta_rule_ref(q, k, v, g, beta, 0.3, ref_pool, slots, init, cu, use_qk_l2norm=False)
    assert rel_err(got, ref) < 2e-5 and rel_err(pool[slots], ref_pool[slots]) < 2e-5
