"""Staged host-to-device copies: values intact, every part 16-byte aligned (Triton specializes on it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mllmd.engine.device_io import to_device, to_device_parts

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
def test_parts_keep_values_and_start_aligned(device: str, dtype: torch.dtype) -> None:
    parts = [[1, 2, 3], [], [4], [5, 6, 7, 8, 9], [10, 11]]
    out = to_device_parts(parts, dtype, device)
    assert [t.tolist() for t in out] == [[dtype.is_floating_point and float(x) or x for x in p] for p in parts]
    base = out[0].data_ptr()
    for t in out:
        assert t.dtype == dtype and t.device.type == device
        assert (t.data_ptr() - base) % 16 == 0


@pytest.mark.parametrize("device", DEVICES)
def test_to_device_takes_lists_arrays_and_tensors(device: str) -> None:
    """Every kind of host data the engine stages (the vision runner's image rows are a numpy array, which
    torch.tensor(..., pin_memory=True) refuses on CUDA) arrives with its values and the asked dtype."""
    want = [3, 1, 4, 1, 5]
    for data in (want, np.array(want, dtype=np.int64), np.array(want, dtype=np.int32)[::-1][::-1], torch.tensor(want)):
        t = to_device(data, torch.int64, device)
        assert t.tolist() == want and t.dtype == torch.int64 and t.device.type == device
