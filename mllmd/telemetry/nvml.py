"""GPU readings from NVML on discrete NVIDIA GPUs (``nvidia-ml-py``, imported as ``pynvml``; optional).

Without ``pynvml``, or when ``nvmlInit`` fails (no driver, no GPU), :meth:`NvmlSource.open`
returns None and there are no GPU metrics. The device is the first of ``CUDA_VISIBLE_DEVICES``
(an index or a ``GPU-...`` UUID), else index 0: the GPU the scheduler worker uses; an empty or
negative ``CUDA_VISIBLE_DEVICES`` (no GPU visible) means no NVML metrics.

Mapping (each query may fail on its own; a failed one leaves its field None):

- ``gpu_utilization``: ``nvmlDeviceGetUtilizationRates().gpu`` / 100
- ``gpu_frequency_hz``: graphics clock (MHz -> Hz), reported as GPC ``0``
- ``memory_utilization`` / ``memory_frequency_hz``: the memory controller's busy time and clock,
  exported as the EMC metrics (the nearest thing a discrete GPU has to Jetson's EMC)
- ``temperature_c``: ``NVML_TEMPERATURE_GPU``, exported as sensor ``gpu``
- ``power_w``: ``nvmlDeviceGetPowerUsage`` (mW -> W), exported as rail ``gpu``
- ``gpu_memory_used_bytes`` / ``gpu_memory_total_bytes``: ``nvmlDeviceGetMemoryInfo`` (for status)

This module never imports torch.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["NvmlSample", "NvmlSource"]

logger = logging.getLogger("mllmd.telemetry")
MHZ = 1_000_000


@dataclass
class NvmlSample:
    """One NVML reading of one GPU; None where the query failed or is unsupported."""

    gpu_utilization: float | None = None
    gpu_frequency_hz: int | None = None
    memory_utilization: float | None = None
    memory_frequency_hz: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    gpu_memory_used_bytes: int | None = None
    gpu_memory_total_bytes: int | None = None


def _import_pynvml() -> Any | None:
    try:
        import pynvml
    except Exception:  # ImportError, or a broken install
        return None
    return pynvml


def _visible_device() -> str | None:
    """First entry of CUDA_VISIBLE_DEVICES; None when unset; "" when it hides every GPU."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    first = value.split(",")[0].strip()
    return "" if first.startswith("-") else first


class NvmlSource:
    """An initialised NVML handle for one GPU."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml = nvml
        self.handle = handle

    @classmethod
    def open(cls, module: Any | None = None) -> NvmlSource | None:
        """Initialise NVML; None when pynvml is missing or has no usable GPU. `module` is for tests."""
        nvml = module if module is not None else _import_pynvml()
        if nvml is None:
            return None
        device = _visible_device()
        if device == "":
            return None  # CUDA_VISIBLE_DEVICES hides every GPU
        try:
            nvml.nvmlInit()
        except Exception as e:
            logger.info("NVML unavailable (%s): no GPU telemetry from NVML", e)
            return None
        try:
            if device is not None and device.startswith(("GPU-", "MIG-")):
                handle = nvml.nvmlDeviceGetHandleByUUID(device)
            else:
                handle = nvml.nvmlDeviceGetHandleByIndex(int(device) if device and device.isdigit() else 0)
        except Exception as e:
            logger.info("NVML has no usable GPU (%s): no GPU telemetry from NVML", e)
            cls._shutdown(nvml)
            return None
        return cls(nvml, handle)

    def _query(self, fn: str, *args: Any) -> Any | None:
        try:
            return getattr(self.nvml, fn)(self.handle, *args)
        except Exception:
            return None

    def sample(self) -> NvmlSample:
        """Query the GPU once."""
        nv = self.nvml
        out = NvmlSample()
        util = self._query("nvmlDeviceGetUtilizationRates")
        if util is not None:
            out.gpu_utilization = min(max(util.gpu / 100.0, 0.0), 1.0)
            out.memory_utilization = min(max(util.memory / 100.0, 0.0), 1.0)
        graphics = self._query("nvmlDeviceGetClockInfo", getattr(nv, "NVML_CLOCK_GRAPHICS", 0))
        if graphics is not None:
            out.gpu_frequency_hz = int(graphics) * MHZ
        mem_clock = self._query("nvmlDeviceGetClockInfo", getattr(nv, "NVML_CLOCK_MEM", 2))
        if mem_clock is not None:
            out.memory_frequency_hz = int(mem_clock) * MHZ
        temp = self._query("nvmlDeviceGetTemperature", getattr(nv, "NVML_TEMPERATURE_GPU", 0))
        if temp is not None:
            out.temperature_c = float(temp)
        milliwatts = self._query("nvmlDeviceGetPowerUsage")
        if milliwatts is not None:
            out.power_w = int(milliwatts) / 1000.0
        mem = self._query("nvmlDeviceGetMemoryInfo")
        if mem is not None:
            out.gpu_memory_used_bytes, out.gpu_memory_total_bytes = int(mem.used), int(mem.total)
        return out

    def close(self) -> None:
        """Release NVML."""
        self._shutdown(self.nvml)

    @staticmethod
    def _shutdown(nvml: Any) -> None:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
