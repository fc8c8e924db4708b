"""Every environment variable the mllmd package reads, in one place, each with its default.

Switches for debugging and comparisons (`MLLMD_*`), the folders systemd hands the service, the
cache folder and mllmctl's admin key. (CUDA_VISIBLE_DEVICES, read by the NVML telemetry to find
the GPU the engine sees, is CUDA's own.) The kernel library has its own (`mllmd_kernels.knobs`). Values that the per-step code
consults are read once, when this module is imported; the others each time they are asked for.
A torch-free leaf: the main process imports it.
"""

from __future__ import annotations

import os
from pathlib import Path


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


# MLLMD_DISABLE_FUSED_KERNELS=1 (default 0): the model layers run plain torch ops instead of the Triton
# RMSNorm / RoPE / SiLU-and-mul / GEMV kernels, for comparisons and for bisecting a numerical difference.
DISABLE_FUSED_KERNELS = _flag("MLLMD_DISABLE_FUSED_KERNELS", False)

# MLLMD_W4A16_FUSIONS=0 (default 1): W4A16 on the CUDA decode kernel runs the RMSNorm before its qkv and
# gate/up projections and the SiLU-and-mul after gate/up in launches of their own, for A/B comparisons.
W4A16_FUSIONS = _flag("MLLMD_W4A16_FUSIONS", True)

# MLLMD_GEMV_FUSIONS=1 (default 0): at batch-1 decode the dense projections' one-row GEMV applies the
# RMSNorm, SiLU-and-mul or gated RMSNorm before it (mllmd_kernels.gemv_fused) instead of running them
# in launches of their own. Off by default: it measured slower on the H200 (docs/benchmarks.md;
# kernels/mllmd_kernels/NOTES.md, gemv_fused).
GEMV_FUSIONS = _flag("MLLMD_GEMV_FUSIONS", False)


def step_trace_path() -> str | None:
    """MLLMD_STEP_TRACE=FILE (default unset): the scheduler worker appends one JSON line per loop
    iteration that did work (scripts/step_trace_summary.py reads it)."""
    return os.environ.get("MLLMD_STEP_TRACE") or None


def cache_dir() -> Path:
    """MLLMD_CACHE_DIR=DIR (default ~/.cache/mllmd): mllmd's cache folder. The demo model, the
    converted Qwen tokenizers, `mllmd demo`'s Unix socket (mllmd-demo.sock) and its state folder (state/)
    live there."""
    env = os.environ.get("MLLMD_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "mllmd"


def state_dir() -> Path:
    """$STATE_DIRECTORY (set by systemd's StateDirectory=; the first entry), default /var/lib/mllmd:
    where the daemon records the active model (`mllmd demo` sets it to cache_dir() / "state" if unset)."""
    return Path((os.environ.get("STATE_DIRECTORY") or "/var/lib/mllmd").split(":")[0])


def runtime_dir() -> Path | None:
    """$RUNTIME_DIRECTORY (systemd's RuntimeDirectory=; the first entry), default unset (then /tmp):
    where each loaded model's ipc:// sockets go."""
    value = os.environ.get("RUNTIME_DIRECTORY")
    return Path(value.split(":")[0]) if value else None


def notify_socket() -> str | None:
    """$NOTIFY_SOCKET (set by systemd for Type=notify): sd_notify messages go there when set."""
    return os.environ.get("NOTIFY_SOCKET") or None


def watchdog_usec() -> int | None:
    """$WATCHDOG_USEC (set by systemd's WatchdogSec=): the daemon pings twice per interval."""
    value = os.environ.get("WATCHDOG_USEC")
    return int(value) if value and value.isdigit() else None


def shared_models_dir() -> Path | None:
    """MLLMD_SHARED_MODELS=DIR (tests and the checkpoint builder; default unset): real model configs
    to build random-weight checkpoints from, looked at before the vendored copies."""
    return Path(os.environ["MLLMD_SHARED_MODELS"]) if os.environ.get("MLLMD_SHARED_MODELS") else None


def admin_key() -> str | None:
    """MLLMD_ADMIN_KEY (default unset): mllmctl's --admin-key for --url (the admin API over TCP), kept
    off the command line (and out of `ps`)."""
    return os.environ.get("MLLMD_ADMIN_KEY") or None
