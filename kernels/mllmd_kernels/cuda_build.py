"""cuda_build: the CUDA kernels' build system: find nvcc, compile a `csrc/*.cu` source into a shared
library once per GPU architecture, and keep it in a cache shared by every process.

The sources include no PyTorch headers and link the CUDA runtime statically, so a library needs only
the driver; its Python binding (ctypes) sits beside the kernel's other host code (`w4a16_mma`). A
library's file name carries a hash of the source, the compiler's version and the architecture, so a
changed source or toolkit builds anew and never loads a stale library. Where no nvcc is found or the
build fails, the binding reports why and callers keep the Triton kernels.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from mllmd_kernels import knobs

logger = logging.getLogger(__name__)

BUILD_TIMEOUT_S = 600


def find_nvcc() -> str | None:
    """The CUDA compiler: $MLLMD_NVCC, $CUDA_HOME/bin/nvcc, nvcc on PATH, /usr/local/cuda/bin/nvcc."""
    candidates = [knobs.nvcc()]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def cache_dir() -> Path:
    """Where built libraries are kept: $MLLMD_KERNEL_CACHE, else $XDG_CACHE_HOME/mllmd/cuda (the
    systemd unit sets XDG_CACHE_HOME=/var/cache/mllmd), else ~/.cache/mllmd/cuda."""
    if knobs.kernel_cache():
        return Path(knobs.kernel_cache())
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mllmd" / "cuda"


def build_command(source: Path, nvcc: str, arch: str, out: str) -> list[str]:
    """nvcc arguments that build `source` for sm_`arch` into the shared library `out` (the CUDA runtime
    linked statically; a toolkit from PyPI's nvidia-cuda-* wheels keeps it in ../lib, not lib64)."""
    cmd = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", f"-gencode=arch=compute_{arch},code=sm_{arch}"]
    lib = Path(nvcc).resolve().parent.parent / "lib"
    if (lib / "libcudart_static.a").is_file():
        cmd.append(f"-L{lib}")
    return cmd + ["-o", out, str(source)]


def _nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout


def library_path(source: Path, nvcc: str, arch: str) -> Path:
    """The cached library for this source, compiler and architecture."""
    key = hashlib.sha256(source.read_bytes() + _nvcc_version(nvcc).encode() + arch.encode()).hexdigest()[:16]
    return cache_dir() / f"{source.stem}_sm{arch}_{key}.so"


def build(source: Path, nvcc: str, arch: str) -> Path:
    """Compile `source` for sm_`arch` unless cached; atomic (a temporary file renamed into place)."""
    path = library_path(source, nvcc, arch)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    os.close(fd)
    try:
        logger.info("building %s for sm_%s with %s (once per GPU kind)", source.name, arch, nvcc)
        proc = subprocess.run(build_command(source, nvcc, arch, tmp), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
