"""Which tensor transport the daemon uses: a start-up probe of CUDA IPC between two processes, and
the requested mode resolved against it (integrated GPUs such as Jetson's report legacy CUDA IPC as
unsupported, so they are not tried; one line is logged when the mode falls back)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import msgspec
import numpy as np

from mllmd.messages import CudaIpcTensor, TensorHandle
from mllmd.multimodal.transport import MODES, TensorReceiver, TensorSender

TEGRA_MARKERS = ("/etc/nv_tegra_release", "/sys/module/tegra_fuse")


def _tegra() -> bool:
    return any(os.path.exists(p) for p in TEGRA_MARKERS)


def probe_cuda_ipc(device: str = "cuda:0", timeout: float = 120.0) -> str | None:
    """None when CUDA IPC works between two processes on `device`, else why not. A Tegra device
    (Jetson) is reported without trying: its legacy CUDA IPC is unsupported. Otherwise a child process
    checks for CUDA and an integrated GPU, then sends a tensor by cuda_ipc to a grandchild that checks
    its bytes; the caller never initialises CUDA itself. `timeout` bounds the whole round trip."""
    if _tegra():
        return "Tegra (Jetson) integrated GPU: legacy CUDA IPC is unsupported"
    cmd = [sys.executable, "-m", "mllmd.multimodal.transport_probe", "probe", str(device), str(timeout)]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 10)
    except subprocess.TimeoutExpired:
        return f"the CUDA IPC probe did not finish in {timeout:g} s"
    lines = run.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])["reason"]
    except (IndexError, ValueError, KeyError, TypeError):
        tail = (run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1]
        return f"the CUDA IPC probe failed: {tail}"


def resolve_mode(requested: str, probe_reason: str | None) -> tuple[str, str | None]:
    """The mode to use and the line to log when it is not the requested one (probe_reason: what
    probe_cuda_ipc said; unused for `default`)."""
    if requested not in MODES:
        raise ValueError(f"tensor transport mode must be one of {', '.join(MODES)}, not {requested!r}")
    if requested == "default" or probe_reason is None:
        return requested, None
    return "default", (f"ipc.tensor_transport_mode {requested}: CUDA IPC is unavailable ({probe_reason}); "
                       "using default (CPU shared memory)")


_PROBE_BYTES = (1 << 20) + 3


def _probe_pattern() -> np.ndarray:
    return (np.arange(_PROBE_BYTES, dtype=np.int64) % 251).astype(np.uint8)


def _probe_sender(device: str, timeout: float) -> str | None:
    deadline = time.monotonic() + timeout
    import torch

    if not torch.cuda.is_available():
        return "CUDA is not available"
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"{device} is not a CUDA device"
    props = torch.cuda.get_device_properties(dev.index or 0)
    if getattr(props, "is_integrated", False):
        return f"{props.name} is an integrated GPU: legacy CUDA IPC is unsupported"
    with TensorSender("cuda_ipc", dev, sweep=False) as sender:
        handle = sender.send(_probe_pattern())
        if not isinstance(handle, CudaIpcTensor):
            return f"could not export a CUDA tensor ({sender.fallback_reason})"
        cmd = [sys.executable, "-m", "mllmd.multimodal.transport_probe", "probe-receive", device]
        try:
            run = subprocess.run(cmd, input=msgspec.msgpack.encode(handle), capture_output=True,
                                 timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return f"the receiving process did not finish in {timeout:g} s"
        if run.returncode != 0 or run.stdout.strip() != b"ok":
            tail = (run.stderr.decode(errors="replace").strip().splitlines() or [run.stdout.decode(errors="replace")])
            return f"the receiving process could not read the tensor: {tail[-1].strip()}"
    return None


def _probe_receiver(device: str) -> None:
    import torch

    handle = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=TensorHandle)
    receiver = TensorReceiver()
    got = receiver.receive(handle, device)
    torch.cuda.synchronize()
    ok = torch.equal(got.cpu(), torch.from_numpy(_probe_pattern()))
    receiver.close()
    sys.stdout.write("ok" if ok else "the bytes differ")


def _main(argv: list[str]) -> None:
    if argv[:1] == ["probe"] and len(argv) == 3:
        try:
            reason = _probe_sender(argv[1], float(argv[2]))
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
        print(json.dumps({"reason": reason}))
    elif argv[:1] == ["probe-receive"] and len(argv) == 2:
        _probe_receiver(argv[1])
    else:
        raise SystemExit("usage: python -m mllmd.multimodal.transport_probe probe DEVICE TIMEOUT")


if __name__ == "__main__":
    _main(sys.argv[1:])
