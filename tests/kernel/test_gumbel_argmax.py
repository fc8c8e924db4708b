"""gumbel_argmax picks exactly the tokens of the torch sampler's seeded paths: unfiltered, and with a floor
on the scaled logits (the filtered rows' candidates)."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import gumbel_argmax, gumbel_argmax_ref
from mllmd_kernels.gumbel import row_keys
from mllmd_kernels.testing import kernel_device, on_gpu, skip_reason

import mllmd.engine.sampling.sampler as sampler_module
from mllmd.engine.sampling import Sampler
from mllmd.engine.sampling.states import SamplingBatchInfo
from mllmd.sampling_params import SamplingParams as SP

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=skip_reason())

CASES = [(3, 2000, [0.7, 1.0, 1.6]), (5, 3001, [0.05, 2.0, 1.0, 0.3, 1.2])]
if on_gpu():
    CASES += [(64, 151936, [0.6 + 0.02 * i for i in range(64)])]


@pytest.mark.parametrize(("rows", "vocab", "temps"), CASES)
def test_gumbel_argmax_equals_the_torch_sampler(rows: int, vocab: int, temps: list[float]) -> None:
    g = torch.Generator().manual_seed(rows * vocab)
    logits = (torch.randn(rows + 2, vocab, generator=g) * 3).to(DEVICE)
    logits[0, 7] = logits[0, 11] = logits[0].max() + 3  # two dominant columns: the noise decides
    which = torch.arange(rows, device=DEVICE).flip(0)  # rows are gathered, not taken in order
    keys = row_keys([1000 + i for i in range(rows)], [i * 3 for i in range(rows)]).to(DEVICE)
    t = torch.tensor(temps, dtype=torch.float32, device=DEVICE)
    out = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)
    gumbel_argmax(logits, which, keys, t, out=out)
    assert torch.equal(out, gumbel_argmax_ref(logits, which, keys, t))
    assert out.min() >= 0 and out.max() < vocab


@pytest.mark.parametrize(("rows", "vocab", "temps"), CASES)
def test_gumbel_argmax_with_floors_samples_only_the_candidates(rows: int, vocab: int, temps: list[float]) -> None:
    """Each row's floor keeps the tokens whose scaled logit z = (x - max) / T is at least it: the token
    equals the reference's and lies among them; a floor of 0 keeps the top token alone; -inf is no floor."""
    g = torch.Generator().manual_seed(rows + vocab)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(DEVICE)
    which = torch.arange(rows, device=DEVICE)
    keys = row_keys([7 * i for i in range(rows)], [i for i in range(rows)]).to(DEVICE)
    t = torch.tensor(temps, dtype=torch.float32, device=DEVICE)
    z = (logits - logits.max(dim=-1, keepdim=True).values) / t[:, None]
    floors = torch.sort(z, dim=-1, descending=True).values[:, 20].clone()  # about 21 candidates a row
    floors[0] = 0.0
    if rows > 2:
        floors[2] = float("-inf")
    out = gumbel_argmax(logits, which, keys, t, floors=floors)
    assert torch.equal(out, gumbel_argmax_ref(logits, which, keys, t, floors))
    assert bool((z.gather(1, out[:, None]).squeeze(1) >= floors).all())
    assert int(out[0]) == int(logits[0].argmax())
    if rows > 2:
        assert int(out[2]) == int(gumbel_argmax(logits, which[2:3], keys[2:3], t[2:3])[0])


@pytest.mark.parametrize("width", [8, 3000])
def test_the_samplers_fused_path_equals_its_torch_path(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    """The CUDA sampler's one-kernel path (gumbel_argmax; a filtered row with its floor) picks the torch
    path's tokens for rows of every kind: plain, top-p, top-k, min-p, all three with penalties, bias,
    greedy; a tie at the top of a row. The floors come from a full sort (width = V) or from sorted
    prefixes widened row by row (8)."""
    variants = [SP(temperature=1.0), SP(temperature=0.7, top_p=0.9), SP(temperature=1.3, top_k=20),
                SP(temperature=0.9, min_p=0.05), SP(temperature=1.0, top_k=50, top_p=0.8, min_p=0.01, repetition_penalty=1.3),
                SP(temperature=0.8, frequency_penalty=0.7, presence_penalty=0.3, logit_bias={3: 2.0}),
                SP(temperature=0.0, frequency_penalty=0.5), SP(temperature=0.0)]  # fmt: skip
    g = torch.Generator().manual_seed(9)
    v, n = 3000, 24
    logits = torch.randn(n, v, generator=g) * 3
    logits[0, 5] = logits[0, 9] = logits[0].max() + 2
    params = [variants[i % len(variants)] for i in range(n)]
    args = (params, list(range(n)), [[1, 2]] * n, [[i, i + 1] for i in range(n)], v)
    want = Sampler(prefix_width=v)(logits, SamplingBatchInfo.build(*args, "cpu")).next_token_ids
    monkeypatch.setattr(sampler_module, "use_triton", lambda x: True)  # the CUDA path, on DEVICE
    got = Sampler(prefix_width=width)(logits.to(DEVICE), SamplingBatchInfo.build(*args, DEVICE), inplace=True)
    got = got.next_token_ids
    assert torch.equal(got.cpu(), want)
