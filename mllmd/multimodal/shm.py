"""POSIX shared-memory segments for the `default` tensor transport, kept away from the resource tracker.

On Python < 3.13 `SharedMemory` registers every segment it creates or attaches with the process's
resource tracker, which unlinks and warns about whatever is still registered when that process exits:
the attaching process's tracker can delete the creator's segment (CPython gh-82300). So both sides
keep the tracker out (`track=False` from 3.13, unregister at once before) and unlink by name. Segment
names start with `SHM_PREFIX` and the creator's pid, so that a new sender can unlink what a dead one
left (`sweep_orphans`).
"""

from __future__ import annotations

import _posixshmem  # type: ignore[import-not-found]  # CPython's, without stubs
import logging
import os
import sys
from multiprocessing import resource_tracker, shared_memory

logger = logging.getLogger("mllmd.transport")

SHM_PREFIX = "mllmd_"  # every segment's name starts with it, then the creator's pid
SHM_DIR = "/dev/shm"
_TRACK_ARG = sys.version_info >= (3, 13)  # SharedMemory(track=False)


def create(name: str, size: int) -> shared_memory.SharedMemory:
    if _TRACK_ARG:
        return shared_memory.SharedMemory(name, create=True, size=size, track=False)  # type: ignore[call-arg]  # 3.13+
    seg = shared_memory.SharedMemory(name, create=True, size=size)
    resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
    return seg


def attach(name: str) -> shared_memory.SharedMemory:
    if _TRACK_ARG:
        return shared_memory.SharedMemory(name, track=False)  # type: ignore[call-arg]  # 3.13+
    seg = shared_memory.SharedMemory(name)  # registers even to attach (gh-82300)
    resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
    return seg


def unlink(name: str) -> bool:
    """Unlink without telling a tracker (SharedMemory.unlink would unregister a second time). False: gone."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True


def exists(name: str) -> bool:
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
    except FileNotFoundError:
        return False
    os.close(fd)
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def segments(prefix: str = SHM_PREFIX) -> list[str]:
    """Names of the shared-memory segments that start with `prefix` ([] where /dev/shm is not listable)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except OSError:
        return []


def sweep_orphans(prefix: str = SHM_PREFIX) -> list[str]:
    """Unlink the segments whose creator (the pid after `prefix`) is dead: a sender killed before its
    receiver consumed them. Returns their names."""
    swept = []
    for name in segments(prefix):
        pid = name[len(prefix):].split("_", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)) and unlink(name):
            swept.append(name)
    if swept:
        logger.info("unlinked %d shared-memory segment(s) left by dead senders", len(swept))
    return swept


def unlink_all(segments: dict[int, tuple[str, int]]) -> None:
    for name, _ in segments.values():
        unlink(name)
    segments.clear()
