"""How many bytes the KV pool may take on a GPU: a pure function of measured memory figures.

Discrete GPUs report their own memory through cuMemGetInfo. On integrated GPUs (Jetson: CPU and GPU
share DRAM) cuMemGetInfo does not account for what the OS can reclaim, so the memory this process can
still take is the kernel's MemAvailable, and the device's total is that plus what torch already holds.
"""

from __future__ import annotations

from dataclasses import dataclass

HEADROOM_BYTES = 256 << 20  # left free for the CUDA context, cuBLAS workspaces, Triton, fragmentation


@dataclass(frozen=True)
class DeviceMemory:
    total: int  # bytes the device has (integrated: MemAvailable + what torch holds)
    free: int  # bytes still free now
    weights: int  # bytes the loaded weights hold


def device_memory(
    integrated: bool, weights: int, mem_get_info: tuple[int, int], mem_available: int, torch_reserved: int
) -> DeviceMemory:
    """Figures for `kv_budget_bytes`; mem_get_info is (free, total) as torch.cuda.mem_get_info gives it,
    `weights` what torch has allocated (the loaded weights), `torch_reserved` what its caching
    allocator holds. Blocks the allocator holds unused (left by an engine dropped earlier in the same
    process) are free to this process although the driver counts them as used."""
    cached = max(0, torch_reserved - weights)
    if integrated:
        return DeviceMemory(total=mem_available + torch_reserved, free=mem_available + cached, weights=weights)
    free, total = mem_get_info
    return DeviceMemory(total=total, free=free + cached, weights=weights)


def kv_budget_bytes(mem: DeviceMemory, fraction: float, activations: int, sampler: int, graphs: int) -> float:
    """The process may hold `fraction` of the device: take the weights (already loaded), the peak
    activations of the largest step, the sampler's workspace and the CUDA graphs' memory from it;
    never plan past what is actually free (minus a headroom)."""
    reserve = activations + sampler + graphs
    return min(mem.total * fraction - mem.weights, mem.free - HEADROOM_BYTES) - reserve
