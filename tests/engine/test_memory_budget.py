"""KV-pool sizing on GPUs (pure arithmetic on measured figures) and the CUDA-graph batch sizes."""

from __future__ import annotations

import pytest

from mllmd.engine.cuda_graph import capture_batch_sizes
from mllmd.engine.memory_budget import HEADROOM_BYTES, device_memory, kv_budget_bytes

GB = 10**9


def test_discrete_gpu_budget_is_the_fraction_minus_weights_and_reserves() -> None:
    # the H200 figures logged for Qwen3-8B: 150.1 GB device, 17.89 GB of weights
    mem = device_memory(False, int(17.89 * GB), (int(132 * GB), int(150.1 * GB)), mem_available=10**12, torch_reserved=0)
    assert mem.total == int(150.1 * GB) and mem.free == int(132 * GB)
    budget = kv_budget_bytes(mem, 0.85, activations=int(0.91 * GB), sampler=int(0.31 * GB), graphs=int(0.34 * GB))
    assert budget == pytest.approx(150.1 * GB * 0.85 - 17.89 * GB - 1.56 * GB, rel=1e-6)


def test_integrated_gpu_uses_mem_available_not_cumemgetinfo() -> None:
    """Jetson: cuMemGetInfo says 1 GB free, but the kernel can give 5 GB (page cache, buffers)."""
    mem = device_memory(True, int(2.5 * GB), (1 * GB, 8 * GB), mem_available=5 * GB, torch_reserved=int(2.5 * GB))
    assert mem.free == 5 * GB and mem.total == int(7.5 * GB)
    budget = kv_budget_bytes(mem, 0.85, activations=200 * 10**6, sampler=100 * 10**6, graphs=0)
    assert budget == pytest.approx(7.5 * GB * 0.85 - 2.5 * GB - 0.3 * GB)


def test_budget_never_exceeds_what_is_free() -> None:
    """Another process holds most of the card: the free memory, not the fraction, is the limit."""
    mem = device_memory(False, 2 * GB, (3 * GB, 80 * GB), mem_available=0, torch_reserved=0)
    assert kv_budget_bytes(mem, 0.9, 10**8, 10**8, 0) == 3 * GB - HEADROOM_BYTES - 2 * 10**8


def test_capture_batch_sizes() -> None:
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(7) == [1, 2, 3, 4, 6, 7]
    assert capture_batch_sizes(64) == [1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64]
    sizes = capture_batch_sizes(300)
    assert sizes[-1] == 300 and sizes == sorted(set(sizes))
    for bs in range(1, 301):  # each batch runs in the smallest graph that holds it
        size = min(s for s in sizes if s >= bs)
        assert size <= bs * 4 / 3 or size - bs <= 1
        if bs >= 32:
            assert size <= bs * 1.25


@pytest.mark.parametrize("integrated", [False, True])
def test_blocks_cached_by_torch_count_as_free(integrated: bool) -> None:
    """An engine dropped earlier in the process left 100 GB in torch's caching allocator: the driver
    reports it as used, yet the next engine can take it (it used to get a negative budget)."""
    weights, cached = int(0.16 * GB), 100 * GB
    mem = device_memory(
        integrated, weights, (int(0.3 * GB), int(150 * GB)), mem_available=int(0.3 * GB), torch_reserved=weights + cached
    )
    assert mem.free == int(0.3 * GB) + cached
    assert kv_budget_bytes(mem, 0.85, 10**8, 3 * 10**8, 4 * 10**8) > 80 * GB
