"""Sampler: penalties, filters, the seeded Gumbel stream, reproducibility, distribution, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from mllmd_kernels.gumbel import (
    gumbel_py,
    mix32,
    mix32_py,
    row_key_py,
    uniform_to_gumbel,
    words_to_uniform,
)

from mllmd.engine.sampling import (
    Sampler,
    SamplingBatchInfo,
    gumbel,
    gumbel_noise,
    hash32,
    hash32_py,
    keep_mask,
    process_logits,
    row_keys,
    uniform,
)
from mllmd.sampling_params import SamplingParams as SP

# ---------------------------------------------------------------- helpers


def build(params, seeds=None, prompts=None, outputs=None, vocab=8, device="cpu") -> SamplingBatchInfo:
    n = len(params)
    return SamplingBatchInfo.build(
        params,
        seeds if seeds is not None else list(range(n)),
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        vocab,
        device,
    )


def chi2_crit(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.719: p = 1e-4)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_stat(counts: np.ndarray, probs: np.ndarray) -> float:
    n = counts.sum()
    m = probs > 0
    exp = n * probs[m]
    return float((((counts[m] - exp) ** 2) / exp).sum())


def ref_keep(z: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Plain reference of the filters on one row of scaled logits (float64)."""
    v = len(z)
    keep = np.ones(v, dtype=bool)
    if 0 < top_k < v:
        kth = sorted(z.tolist(), reverse=True)[top_k - 1]
        keep &= z >= kth
    if top_p < 1.0:
        zz = np.where(keep, z, -np.inf)
        p = np.exp(zz - zz.max())
        p /= p.sum()
        mass, last = 0.0, None
        for t in sorted(range(v), key=lambda i: -zz[i]):
            if mass >= top_p:  # the prefix so far already reaches top_p
                break
            last = zz[t]
            mass += p[t]
        keep &= zz >= last
    if min_p > 0.0:
        p = np.exp(z - z.max())
        keep &= p >= min_p * p.max()
    return keep


def mask_of(z: torch.Tensor, ks, ps, ms, width=None) -> torch.Tensor:
    """keep_mask on rows z (shifted to row max 0) with per-row params (neutral values allowed)."""
    v = z.shape[1]
    z = z - z.max(dim=-1, keepdim=True).values
    top_k = torch.tensor([k if 0 < k < v else v for k in ks], dtype=torch.int64)
    return keep_mask(z, top_k, torch.tensor(ps), torch.tensor(ms), width)


# ---------------------------------------------------------------- the random stream


# (seed, position, column) -> 32-bit word and float32 Gumbel; computed once from the definition in
# gumbel.py. A kernel that reproduces the stream must reproduce these exactly.
KNOWN_ANSWERS = [
    ((0, 0, 0), 3072260283, 0x3F8BF8EC),
    ((0, 0, 1), 2484004872, 0x3F1A2DD2),
    ((1, 0, 0), 2333945606, 0x3EFD2D66),
    ((0, 1, 0), 2703251115, 0x3F452229),
    ((42, 7, 151935), 2715420867, 0x3F47A113),
    ((-1, 3, 5), 1185364298, 0xBE815764),
    ((2**64 + 5, 3, 5), 396923306, 0xBF5E2262),
    ((2**63 + 12345, 100000, 77), 3965424112, 0x4021C829),
    ((123456789, 2**32 + 9, 1000), 364439195, 0xBF6726EE),
]


def f32_bits(x: float) -> int:
    return int(torch.tensor([x], dtype=torch.float32).view(torch.int32).item()) & 0xFFFFFFFF


@pytest.mark.parametrize(("spc", "word", "gbits"), KNOWN_ANSWERS)
def test_hash_known_answers(spc, word, gbits):
    seed, pos, col = spc
    assert hash32_py(seed, pos, col) == word
    assert int(hash32(row_keys([seed], [pos]), torch.tensor([col]))[0]) == word
    assert f32_bits(float(gumbel(row_keys([seed], [pos]), torch.tensor([col]))[0])) == gbits
    assert f32_bits(gumbel_py(seed, pos, col)) == gbits


def test_mix32_matches_python_and_stays_in_32_bits():
    xs = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF] + list(range(12345, 2**32, 99_991_337))
    got = mix32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [mix32_py(x) for x in xs]
    assert all(0 <= g < 2**32 for g in got)
    # a bijection on a sample: no collisions
    assert len(set(got)) == len(xs)


def test_row_keys_match_python():
    seeds = [0, 1, -7, 2**64 - 1, 2**70 + 3, 99]
    positions = [0, 5, 2**32 + 1, 17, 3, 2**31]
    keys = row_keys(seeds, positions).tolist()
    assert keys == [list(row_key_py(s, p)) for s, p in zip(seeds, positions, strict=True)]


def test_uniform_edges_are_strictly_inside_and_gumbel_finite():
    u = words_to_uniform(torch.tensor([0, 1, 2**31, 2**32 - 2, 2**32 - 1], dtype=torch.int64))
    assert bool(((u > 0) & (u < 1)).all())
    assert u[0] == 0.5 * 2.0**-32 and u[-1] == 1.0 - 0.5 * 2.0**-32
    g = uniform_to_gumbel(u)
    assert g.dtype == torch.float32 and bool(torch.isfinite(g).all())
    assert bool((g[1:] > g[:-1]).all())  # monotone in the word


def test_stream_looks_uniform_and_independent():
    seeds, positions, v = list(range(64)), [0, 1, 2, 1000], 1000
    keys = row_keys([s for s in seeds for _ in positions], [p for _ in seeds for p in positions])
    u = uniform(keys, torch.arange(v)[None, :]).reshape(len(seeds), len(positions), v)  # [S, P, V]
    x = u.numpy()
    assert x.min() > 0.0 and x.max() < 1.0
    n = x.size
    assert abs(x.mean() - 0.5) < 4 * math.sqrt(1 / 12 / n)
    assert abs(x.var() - 1 / 12) < 0.002
    counts = np.histogram(x, bins=128, range=(0, 1))[0]
    assert chi2_stat(counts, np.full(128, 1 / 128)) < chi2_crit(127)
    # neighbouring columns, positions and seeds are uncorrelated
    for a, b in ((x[:, :, 1:], x[:, :, :-1]), (x[:, 1:], x[:, :-1]), (x[1:], x[:-1])):
        r = np.corrcoef(a.ravel(), b.ravel())[0, 1]
        assert abs(r) < 4 / math.sqrt(a.size)
    # every bit of the word is fair
    words = hash32(keys, torch.arange(v)[None, :]).reshape(-1)
    bits = torch.stack([(words >> i) & 1 for i in range(32)]).double().mean(dim=1)
    assert float((bits - 0.5).abs().max()) < 4 * 0.5 / math.sqrt(words.numel())
    g = gumbel(keys, torch.arange(v)[None, :]).double().numpy()
    assert abs(g.mean() - 0.5772156649) < 0.01
    assert abs(g.var() - math.pi**2 / 6) < 0.03


def test_noise_of_a_row_does_not_depend_on_the_batch_or_the_columns_asked():
    keys = row_keys([5, 6, 7, 5], [0, 0, 0, 1])
    dense = gumbel_noise(keys, 3000)  # [4, 3000]
    for i in range(4):
        assert torch.equal(gumbel_noise(keys[i : i + 1], 3000)[0], dense[i])
    cols = torch.tensor([[2999, 0, 17], [5, 5, 1234], [1, 2, 3], [0, 1, 2]])
    assert torch.equal(gumbel(keys, cols), dense.gather(1, cols))
    # a different position (row 3 vs row 0, same seed) gives different noise
    assert not torch.equal(dense[0], dense[3])


# ---------------------------------------------------------------- filters


def test_top_k_keeps_ties_at_the_boundary():
    z = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0, -1.0]])
    assert mask_of(z, [2], [1.0], [0.0]).tolist() == [[True, True, True, True, False, False]]
    assert mask_of(z, [1], [1.0], [0.0]).tolist() == [[True, False, False, False, False, False]]
    assert mask_of(z, [5], [1.0], [0.0]).tolist() == [[True] * 5 + [False]]
    for k in (0, -1, 6, 100):  # disabled
        assert mask_of(z, [k], [1.0], [0.0]).all()


def test_top_p_smallest_prefix_reaching_p_with_ties_and_edges():
    z = torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1]]).log()
    assert mask_of(z, [0], [0.3], [0.0]).tolist() == [[True, False, False, False, False]]
    # mass before the first 0.2 is 0.4 < 0.5: it is kept, and its tie with it
    assert mask_of(z, [0], [0.5], [0.0]).tolist() == [[True, True, True, False, False]]
    assert mask_of(z, [0], [0.7], [0.0]).tolist() == [[True, True, True, False, False]]
    assert mask_of(z, [0], [0.85], [0.0]).tolist() == [[True, True, True, True, True]]
    assert mask_of(z, [0], [1e-6], [0.0]).tolist() == [[True, False, False, False, False]]
    assert mask_of(z, [0], [1.0], [0.0]).all()  # top_p = 1 keeps everything
    tied_top = torch.tensor([[1.0, 1.0, 0.0]])
    assert mask_of(tied_top, [0], [0.01], [0.0]).tolist() == [[True, True, False]]
    with_inf = torch.tensor([[0.0, -1.0, float("-inf")]])
    assert mask_of(with_inf, [0], [1.0], [0.0]).all()


def test_top_p_renormalises_over_top_k():
    # probs 0.5, 0.3, 0.2 -> top-2 renormalised 0.625, 0.375; top_p 0.6 keeps only the first
    z = torch.tensor([[0.5, 0.3, 0.2]]).log()
    assert mask_of(z, [2], [0.6], [0.0]).tolist() == [[True, False, False]]
    assert mask_of(z, [0], [0.6], [0.0]).tolist() == [[True, True, False]]


def test_min_p_relative_to_max():
    z = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]).log()
    # min_p 0.15: drop prob < 0.075
    assert mask_of(z, [0], [1.0], [0.15]).tolist() == [[True, True, True, False, False]]
    assert mask_of(z, [0], [1.0], [1.0]).tolist() == [[True, False, False, False, False]]
    assert mask_of(z, [0], [1.0], [0.0]).all()


@pytest.mark.parametrize("width", [None, 1, 3, 40])
def test_filters_match_reference_on_random_rows(width):
    gen = torch.Generator().manual_seed(1)
    v, rows = 200, 48
    z = torch.randn(rows, v, generator=gen) * torch.linspace(0.3, 6.0, rows)[:, None]
    z[3, 10:20] = z[3, 5]  # a block of ties
    ks = [int(x) for x in torch.randint(-2, 60, (rows,), generator=gen)]
    ps = [float(x) for x in torch.rand(rows, generator=gen) * 1.1]
    ps = [1.0 if p > 1.0 else max(p, 1e-3) for p in ps]
    ms = [float(x) if x < 0.3 else 0.0 for x in torch.rand(rows, generator=gen) * 0.6]
    got = mask_of(z, ks, ps, ms, width)
    zs = (z - z.max(dim=-1, keepdim=True).values).double().numpy()
    for i in range(rows):
        assert got[i].numpy().tolist() == ref_keep(zs[i], ks[i], ps[i], ms[i]).tolist(), i


# ---------------------------------------------------------------- penalties and bias


def test_penalties_change_logits_exactly_as_specified():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0], [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    params = [
        SP(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SP(temperature=0),
    ]
    info = build(params, prompts=[[0, 1], [0, 1]], outputs=[[2, 2, 3], [2, 2, 3]], vocab=6)
    before = logits.clone()
    x = process_logits(logits, info)
    # rep 2 on seen {0,1,2,3}: 2/2, -1*2, 0.5/2, 3/2; then counts {2: 2, 3: 1}: -(0.5c + 0.25)
    assert x[0].tolist() == [1.0, -2.0, 0.25 - 1.25, 1.5 - 0.75, -2.0, 0.0]
    assert torch.equal(x[1], logits[1])  # a row without penalties is untouched
    assert torch.equal(logits, before)  # the input is never modified


def test_presence_and_frequency_only_count_output_tokens():
    logits = torch.zeros(1, 4)
    info = build(
        [SP(presence_penalty=1.0, frequency_penalty=-0.5)], prompts=[[0, 0, 1]], outputs=[[1, 3, 3]], vocab=4
    )
    x = process_logits(logits, info)
    assert x[0].tolist() == [0.0, -1.0 + 0.5, 0.0, -1.0 + 1.0]


def test_bias_is_applied_before_repetition_penalty():
    logits = torch.tensor([[1.0, 1.0, 1.0]])
    info = build([SP(logit_bias={0: 3.0, 2: -3.0}, repetition_penalty=2.0)], outputs=[[0, 2]], vocab=3)
    x = process_logits(logits, info)
    assert x[0].tolist() == [4.0 / 2.0, 1.0, -2.0 * 2.0]


def test_logit_bias_forces_and_forbids():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=gen) * 3
    top = logits.argmax(dim=-1)
    forced = [SP(temperature=1.0, logit_bias={7: 100.0}) for _ in range(64)]
    out = Sampler()(logits, build(forced, vocab=50))
    assert out.next_token_ids.tolist() == [7] * 64
    banned = [SP(temperature=t, logit_bias={int(top[i]): -100.0}) for i, t in enumerate([0.0, 1.0] * 32)]
    out = Sampler()(logits, build(banned, vocab=50))
    assert not bool((out.next_token_ids == top).any())
    greedy_banned = [SP(temperature=0.0, logit_bias={int(top[i]): -100.0}) for i in range(64)]
    out = Sampler()(logits, build(greedy_banned, vocab=50))
    second = logits.topk(2, dim=-1).indices[:, 1]
    assert torch.equal(out.next_token_ids, second)


def test_bias_outside_vocab_and_ragged_inputs_are_rejected():
    with pytest.raises(ValueError, match="logit_bias"):
        build([SP(logit_bias={9: 1.0})], vocab=8)
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingBatchInfo.build([SP()], [1, 2], [[]], [[]], 8)


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(16, 1000, generator=gen) * 4).to(dtype)
    info = build([SP(temperature=0.0, seed=i) for i in range(16)], vocab=1000)
    assert info.num_sampled == 0 and not info.needs_processing  # the fast path
    out = Sampler()(logits, info)
    assert out.next_token_ids.dtype == torch.int64
    assert torch.equal(out.next_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None and out.top_logprob_ids is None and out.top_logprobs is None


def test_greedy_ties_take_the_first_index_and_greedy_with_penalties_uses_them():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert Sampler()(logits, build([SP(temperature=0)], vocab=4)).next_token_ids.tolist() == [1]
    info = build([SP(temperature=0, presence_penalty=0.5)], outputs=[[1]], vocab=4)
    assert Sampler()(logits, info).next_token_ids.tolist() == [2]


def test_tiny_temperature_is_argmax_without_nans():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 300, generator=gen)
    for kw in ({}, {"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}):
        info = build([SP(temperature=1e-6, **kw) for _ in range(8)], vocab=300)
        assert torch.equal(Sampler()(logits, info).next_token_ids, logits.argmax(dim=-1))


# ---------------------------------------------------------------- seeded sampling


ROW_VARIANTS = [
    SP(temperature=1.0),
    SP(temperature=0.7, top_p=0.9),
    SP(temperature=1.3, top_k=20),
    SP(temperature=0.9, min_p=0.05),
    SP(temperature=1.0, top_k=50, top_p=0.8, min_p=0.01, repetition_penalty=1.3),
    SP(temperature=0.8, frequency_penalty=0.7, presence_penalty=0.3, logit_bias={3: 2.0}),
    SP(temperature=0.0, frequency_penalty=0.5),
    SP(temperature=0.0),
]


@pytest.mark.parametrize("width", [None, 4])
def test_each_row_samples_as_if_alone(width):
    """Same seed + same logits + same position => same token, whatever else is in the batch."""
    gen = torch.Generator().manual_seed(5)
    v, n = 3000, 48
    logits = torch.randn(n, v, generator=gen) * torch.linspace(0.5, 5.0, n)[:, None]
    params = [ROW_VARIANTS[i % len(ROW_VARIANTS)] for i in range(n)]
    seeds = [1000 + 7 * i for i in range(n)]
    prompts = [[int(t) for t in torch.randint(0, v, (20,), generator=gen)] for _ in range(n)]
    outputs = [[int(t) for t in torch.randint(0, v, (i % 9,), generator=gen)] for i in range(n)]
    sampler = Sampler(prefix_width=width)
    batched = sampler(logits, build(params, seeds, prompts, outputs, v)).next_token_ids
    perm = torch.randperm(n, generator=gen).tolist()
    shuffled = sampler(
        logits[perm],
        build(
            [params[i] for i in perm],
            [seeds[i] for i in perm],
            [prompts[i] for i in perm],
            [outputs[i] for i in perm],
            v,
        ),
    ).next_token_ids
    for i in range(n):
        alone = sampler(logits[i : i + 1], build([params[i]], [seeds[i]], [prompts[i]], [outputs[i]], v))
        assert int(alone.next_token_ids[0]) == int(batched[i]), i
    assert torch.equal(shuffled, batched[perm])
    # and again: the same call reproduces exactly
    assert torch.equal(sampler(logits, build(params, seeds, prompts, outputs, v)).next_token_ids, batched)


def test_prefix_and_full_sort_paths_sample_the_same_tokens():
    gen = torch.Generator().manual_seed(6)
    v, n = 5000, 64
    logits = torch.randn(n, v, generator=gen) * torch.linspace(0.5, 8.0, n)[:, None]
    params = [
        SP(temperature=1.0, top_p=0.95, top_k=[0, 3, 700, 2000][i % 4], min_p=[0, 0.02][i % 2])
        for i in range(n)
    ]
    info = build(params, vocab=v)
    ref = Sampler(prefix_width=v)(logits, info).next_token_ids
    for width in (1, 16, 1024):
        assert torch.equal(Sampler(prefix_width=width)(logits, info).next_token_ids, ref)


def test_filtered_sampling_is_gumbel_max_over_the_kept_set():
    """Reference: dense argmax of (z + g) with filtered tokens at -inf."""
    gen = torch.Generator().manual_seed(7)
    v, n = 400, 32
    logits = torch.randn(n, v, generator=gen) * 3
    params = [
        SP(temperature=0.6 + 0.05 * i, top_k=(i % 5) * 10, top_p=0.5 + 0.015 * i, min_p=0.002 * i)
        for i in range(n)
    ]
    info = build(params, seeds=[11 * i for i in range(n)], vocab=v)
    got = Sampler(prefix_width=8)(logits, info).next_token_ids
    t = torch.tensor([p.temperature for p in params])[:, None]
    z = (logits - logits.max(dim=-1, keepdim=True).values) / t
    keep = mask_of(z, [p.top_k for p in params], [p.top_p for p in params], [p.min_p for p in params])
    assert info.keys is not None
    ref = torch.where(keep, z + gumbel_noise(info.keys, v), float("-inf")).argmax(dim=-1)
    assert torch.equal(got, ref)


def test_different_seeds_and_positions_give_different_samples():
    v = 1000
    logits = torch.zeros(1, v)
    by_seed = {int(Sampler()(logits, build([SP()], [s], vocab=v)).next_token_ids[0]) for s in range(32)}
    assert len(by_seed) >= 28
    outs = [[0] * p for p in range(32)]
    by_pos = Sampler()(logits.expand(32, v), build([SP()] * 32, [9] * 32, None, outs, v)).next_token_ids
    assert len(set(by_pos.tolist())) >= 28


LOGITS8 = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({"temperature": 1.0}, torch.softmax(LOGITS8, 0)),
        ({"temperature": 0.5}, torch.softmax(LOGITS8 / 0.5, 0)),
        ({"temperature": 1.0, "top_k": 3}, torch.softmax(LOGITS8[:3], 0)),
        # probs .405 .245 .149 .090 .055 ...: top_p 0.7 keeps 3 (mass before the 4th is .80)
        ({"temperature": 1.0, "top_p": 0.7}, None),
        ({"temperature": 1.0, "min_p": 0.1}, None),
    ],
)
def test_empirical_distribution_matches_softmax(kw, expected):
    n = 20000
    v = LOGITS8.numel()
    sp = SP(**kw)
    info = build([sp] * n, seeds=list(range(n)), vocab=v)
    toks = Sampler(prefix_width=2)(LOGITS8.expand(n, v), info).next_token_ids
    z = (LOGITS8 / sp.temperature).double().numpy()
    kept = ref_keep(z - z.max(), sp.top_k, sp.top_p, sp.min_p)
    probs = np.where(kept, np.exp(z - z.max()), 0.0)
    probs /= probs.sum()
    if expected is not None:
        np.testing.assert_allclose(probs[: expected.numel()], expected.double().numpy(), atol=1e-6)
    counts = np.bincount(toks.numpy(), minlength=v).astype(np.float64)
    assert counts[~kept].sum() == 0  # never a filtered token
    assert chi2_stat(counts, probs) < chi2_crit(int(kept.sum()) - 1)
    assert np.abs(counts / n - probs).max() < 0.015


def test_sampler_known_answer():
    """End-to-end pin of the stream + filters: changing either changes these tokens."""
    v = 16
    logits = (torch.arange(v).float() / 4).expand(4, v)
    params = [SP(), SP(temperature=0.7, top_p=0.8), SP(top_k=4), SP(min_p=0.3, temperature=1.5)]
    info = build(params, [1234, 1234, 99, 2**40], None, [[], [1, 2], [], [3]], v)
    for width in (None, 2):
        assert Sampler(prefix_width=width)(logits, info).next_token_ids.tolist() == [12, 13, 13, 12]


def test_logits_shape_must_match_the_batch():
    info = build([SP(), SP()], vocab=8)
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(2, 9), info)
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(3, 8), info)


# ---------------------------------------------------------------- logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_log_softmax(dtype):
    gen = torch.Generator().manual_seed(8)
    logits = (torch.randn(6, 500, generator=gen) * 3).to(dtype)
    params = [
        SP(temperature=0.0, logprobs=True),
        SP(temperature=1.0, top_logprobs=5, repetition_penalty=1.5, logit_bias={1: 5.0}),
        SP(temperature=0.7, top_p=0.8, top_logprobs=2),
        SP(temperature=0.0),
        SP(temperature=2.0, top_k=3, logprobs=True),
        SP(temperature=1.0, frequency_penalty=1.0),
    ]
    out = Sampler()(logits, build(params, outputs=[[1, 2, 3]] * 6, vocab=500))
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs is not None and out.top_logprobs is not None and out.top_logprob_ids is not None
    assert out.logprobs.dtype == torch.float32 and out.top_logprobs.dtype == torch.float32
    assert out.top_logprob_ids.dtype == torch.int64 and out.top_logprob_ids.shape == (6, 5)
    torch.testing.assert_close(
        out.logprobs, ref.gather(1, out.next_token_ids[:, None])[:, 0], atol=1e-5, rtol=0
    )
    torch.testing.assert_close(out.top_logprobs, ref.gather(1, out.top_logprob_ids), atol=1e-5, rtol=0)
    assert bool((out.top_logprobs[:, 1:] <= out.top_logprobs[:, :-1]).all())
    assert torch.equal(out.top_logprob_ids, ref.topk(5, dim=-1).indices)


def test_logprobs_only_chosen_when_no_top():
    logits = torch.randn(2, 30)
    out = Sampler()(logits, build([SP(logprobs=True), SP()], vocab=30))
    assert out.logprobs is not None and out.logprobs.shape == (2,)
    assert out.top_logprob_ids is None and out.top_logprobs is None


# ---------------------------------------------------------------- batch info


def test_batch_info_builds_only_what_is_used():
    info = build([SP(temperature=0.0), SP(temperature=1.0)], vocab=8)
    assert info.num_greedy == 1 and info.num_sampled == 1 and info.num_filtered == 0
    assert info.penalty_idx is None and info.output_counts is None and info.bias_rows is None
    assert not info.needs_processing
    assert info.top_k is None and info.top_p is None and info.min_p is None
    assert info.keys is not None and info.keys.shape == (1, 2)
    assert not info.want_logprobs and info.num_top_logprobs == 0
    params = [SP(top_p=0.5), SP(repetition_penalty=1.1), SP(presence_penalty=1.0, top_logprobs=3)]
    prompts = [[1, 1], [3, 3, 5], [4]]
    outputs = [[1], [5, 7, -1], [7, 7, 2]]
    info = build(params, prompts=prompts, outputs=outputs, vocab=8)
    assert info.top_p is not None and info.top_p.tolist() == [0.5] and info.top_k is None
    # the penalised rows' state: output counts (ids outside the vocabulary ignored) and prompt tokens
    assert info.penalty_idx is not None and info.penalty_idx.tolist() == [1, 2]
    assert info.output_counts is not None and info.penalty_slots is not None and info.prompt_mask is not None
    assert info.output_counts[info.penalty_slots].tolist() == [[0, 0, 0, 0, 0, 1, 0, 1], [0, 0, 1, 0, 0, 0, 0, 2]]
    assert info.prompt_mask[info.penalty_slots].int().tolist() == [[0, 0, 0, 1, 0, 1, 0, 0], [0, 0, 0, 0, 1, 0, 0, 0]]
    assert info.repetition is not None and info.repetition.flatten().tolist() == pytest.approx([1.1, 1.0])
    assert info.frequency is not None and info.presence is not None and info.presence.flatten().tolist() == [0.0, 1.0]
    assert info.positions == [1, 3, 3] and info.num_top_logprobs == 3 and info.want_logprobs


def test_states_rows_are_written_once_and_record_sampled_tokens():
    """A slot's row is what a step reads; record() counts sampled tokens for penalised rows only, so a
    later step sees them without rebuilding anything; rewriting a slot starts its counts afresh."""
    from mllmd.engine.sampling import SamplingStates

    states = SamplingStates(4, 8, torch.device("cpu"))
    states.write(2, SP(frequency_penalty=1.0, seed=5), 5, [1], [3])
    states.write(0, SP(temperature=0.0), 9, [2], [])
    info = states.batch([2, 0], [1, 0])
    assert info.penalty_idx is not None and info.penalty_idx.tolist() == [0]
    assert info.seeds == [5, 9] and info.num_greedy == 1 and info.greedy_idx is not None
    assert info.greedy_idx.tolist() == [1]
    states.record(torch.tensor([2, 0]), torch.tensor([3, 4]), states.penalised_np[[2, 0]])
    assert states.output_counts is not None
    assert states.output_counts[2].tolist() == [0, 0, 0, 2, 0, 0, 0, 0]
    assert states.output_counts[0].tolist() == [0] * 8  # not penalised: not counted
    x = process_logits(torch.zeros(2, 8), states.batch([2, 0], [2, 0]))
    assert x[0].tolist() == [0, 0, 0, -2.0, 0, 0, 0, 0] and x[1].tolist() == [0.0] * 8
    states.write(2, SP(frequency_penalty=1.0), 1, [], [6])
    assert states.output_counts[2].tolist() == [0, 0, 0, 0, 0, 0, 1, 0]


# ---------------------------------------------------------------- CUDA parity


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    keys = row_keys([0, 1, 2**40 + 3, -5], [0, 9, 3, 2**20])
    cpu = gumbel_noise(keys, 151936)
    assert torch.equal(gumbel_noise(keys.cuda(), 151936).cpu(), cpu)
    words = torch.randint(0, 2**32, (1 << 22,), dtype=torch.int64)
    assert torch.equal(
        uniform_to_gumbel(words_to_uniform(words.cuda())).cpu(), uniform_to_gumbel(words_to_uniform(words))
    )
    gen = torch.Generator().manual_seed(9)
    v, n = 2000, 32
    logits = torch.randn(n, v, generator=gen) * 3
    params = [ROW_VARIANTS[i % len(ROW_VARIANTS)] for i in range(n)]
    outputs = [[i, i + 1] for i in range(n)]
    want = Sampler()(logits, build(params, None, None, outputs, v)).next_token_ids
    got = Sampler()(logits.cuda(), build(params, None, None, outputs, v, "cuda")).next_token_ids
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_all_greedy_batch_equals_cpu_and_fills_the_sink():
    """The one-launch greedy path (greedy_argmax) picks the CPU sampler's tokens on Qwen3's vocabulary,
    from bf16 and float32 logits, and writes them into the token buffer; batches grow the workspace."""
    gen = torch.Generator().manual_seed(11)
    for n in (1, 5, 40):
        logits = torch.randn(n, 151936, generator=gen) * 3
        params = [SP(temperature=0.0)] * n
        want = Sampler()(logits, build(params, vocab=151936)).next_token_ids
        sampler = Sampler()
        for dt in (torch.float32, torch.bfloat16):
            x = logits.to(dt)
            buf = torch.full((64,), -1, dtype=torch.int64, device="cuda")
            rows = torch.arange(n, dtype=torch.int64, device="cuda").flip(0) + 3
            got = sampler(x.cuda(), build(params, vocab=151936, device="cuda"), token_sink=(buf, rows))
            assert torch.equal(got.next_token_ids.cpu(), Sampler()(x, build(params, vocab=151936)).next_token_ids)
            assert torch.equal(buf[rows].cpu(), got.next_token_ids.cpu())
            if dt == torch.float32:
                assert torch.equal(got.next_token_ids.cpu(), want)


@pytest.mark.parametrize("greedy", [True, False])
def test_token_sink_receives_every_row_token(greedy: bool) -> None:
    """token_sink (buffer, rows): row i's token lands in buffer[rows[i]], greedy or sampled."""
    v, n = 50, 4
    logits = torch.randn(n, v, generator=torch.Generator().manual_seed(4)) * 2
    params = [SP(temperature=0.0 if greedy else 0.8, seed=i) for i in range(n)]
    buf = torch.full((9,), -1, dtype=torch.int64)
    rows = torch.tensor([7, 1, 4, 0])
    out = Sampler()(logits, build(params, vocab=v), token_sink=(buf, rows)).next_token_ids
    assert torch.equal(out, Sampler()(logits, build(params, vocab=v)).next_token_ids)
    want = torch.full((9,), -1, dtype=torch.int64)
    want[rows] = out
    assert torch.equal(buf, want)


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_inplace_sampling_gives_the_same_tokens_and_spares_logprob_logits(with_logprobs: bool) -> None:
    """inplace=True (the runner's logits, read no more) picks the same tokens and logprobs as a copy;
    with logprobs wanted the logits stay as given (the logprobs are the raw logits')."""
    gen = torch.Generator().manual_seed(4)
    v, n = 600, 16
    logits = torch.randn(n, v, generator=gen) * 3
    params = [ROW_VARIANTS[i % len(ROW_VARIANTS)] for i in range(n)]
    if with_logprobs:
        params = [SP(**{**p.__dict__, "logprobs": True, "top_logprobs": 2}) for p in params]
    outputs = [[i, i + 1, 3] for i in range(n)]
    want = Sampler()(logits, build(params, None, None, outputs, v))
    given = logits.clone()
    got = Sampler()(given, build(params, None, None, outputs, v), inplace=True)
    assert torch.equal(got.next_token_ids, want.next_token_ids)
    if with_logprobs:
        assert torch.equal(given, logits) and torch.equal(got.logprobs, want.logprobs)
    else:
        assert not torch.equal(given, logits)  # bias and penalties went into the caller's tensor

