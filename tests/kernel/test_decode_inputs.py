"""decode_inputs fills in-flight tokens from the token buffer and writes each real row's KV slot."""

from __future__ import annotations

import pytest
import torch
from mllmd_kernels import decode_inputs, decode_inputs_ref
from mllmd_kernels.testing import kernel_device, skip_reason

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=skip_reason())


def _case(s: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(400, generator=g)[:s]
    rows[-1] = 0  # a padding row: request row 0, position 0, slot 0, no fill
    pos = torch.randint(0, 30, (s,), generator=g)
    pos[-1] = 0
    loc = torch.randint(1, 1000, (s,), generator=g)
    loc[-1] = 0
    fill = (torch.arange(s) % 3 != 0).long()
    fill[-1] = 0
    t = {
        "input_ids": torch.randint(0, 500, (s,), generator=g),
        "positions": pos,
        "out_cache_loc": loc,
        "req_pool_indices": rows,
        "fill": fill,
        "token_buf": torch.randint(0, 500, (400,), generator=g),
        "req_to_token": torch.randint(0, 1000, (400, 32), generator=g),
    }
    return {k: v.to(DEVICE) for k, v in t.items()}


@pytest.mark.parametrize("s", [1, 5, 64, 300])
def test_decode_inputs_matches_reference(s: int) -> None:
    got = _case(s, s)
    want = {k: v.clone() for k, v in got.items()}
    decode_inputs(**got)
    decode_inputs_ref(**want)
    for k in ("input_ids", "req_to_token", "token_buf", "positions"):
        assert torch.equal(got[k], want[k]), k
    before = _case(s, s)
    # the padding row wrote nothing: row 0's entry 0 is untouched unless a real row owns it
    owned = bool(((got["req_pool_indices"][:-1] == 0) & (got["positions"][:-1] == 0)).any())
    if not owned:
        assert int(got["req_to_token"][0, 0]) == int(before["req_to_token"][0, 0])
    filled = got["fill"] != 0
    assert torch.equal(got["input_ids"][filled], got["token_buf"][got["req_pool_indices"][filled]])
    assert torch.equal(got["input_ids"][~filled], before["input_ids"][~filled])
    real = got["out_cache_loc"] != 0
    assert torch.equal(got["req_to_token"][got["req_pool_indices"][real], got["positions"][real]], got["out_cache_loc"][real])
