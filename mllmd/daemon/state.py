"""The record of the active model ($STATE_DIRECTORY/active-model.json): a restart loads it again.

Written atomically: a temporary file in the same folder, fsync, rename over the record, fsync of the
folder, so that a crash or a power cut leaves the old record or the new one, never a torn one. A
write that fails raises StateError, and the admin load or unload it belongs to fails with it (a load
reported as done that a restart would not repeat is worse than a refused one). Reading is defensive:
whatever the file holds (not JSON, not an object, wrong types, a folder, garbage), `read_record`
returns no record and says why; the daemon then boots `model.path`.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STATE_FILE = "active-model.json"
MAX_RECORD_BYTES = 1 << 20


class StateError(Exception):
    """The record cannot be written; the message names the folder and the system's reason."""


@dataclass(frozen=True)
class Record:
    path: str | None  # None: no model (unloaded on purpose)
    overrides: dict[str, Any] = field(default_factory=dict)
    # model.path when this was written: if the configuration names another model later, the operator
    # changed it on purpose and that wins over the record.
    boot_default: str | None = None

    def to_json(self) -> str:
        return json.dumps({"path": self.path, "overrides": self.overrides, "boot_default": self.boot_default})


def read_record(folder: Path) -> tuple[Record | None, str | None]:
    """(the record, None), or (None, why it cannot be used); (None, None) when there is none."""
    f = folder / STATE_FILE
    try:
        if not f.exists() and not f.is_symlink():
            return None, None
        with open(f, "rb") as fh:
            raw = fh.read(MAX_RECORD_BYTES + 1)
    except (OSError, ValueError) as e:
        return None, f"cannot read it: {getattr(e, 'strerror', None) or e}"
    if len(raw) > MAX_RECORD_BYTES:
        return None, f"it is larger than {MAX_RECORD_BYTES} bytes"
    try:
        rec = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return None, "it is not valid JSON"
    if not isinstance(rec, dict):
        return None, f"it holds a JSON {type(rec).__name__}, not an object"
    path, overrides, default = rec.get("path"), rec.get("overrides") or {}, rec.get("boot_default")
    if path is not None and (not isinstance(path, str) or not path or "\0" in path):
        return None, f"its path is not a folder path (got {json.dumps(path)[:80]})"
    if not isinstance(overrides, dict):
        return None, f"its overrides are not an object (got {json.dumps(overrides)[:80]})"
    if default is not None and not isinstance(default, str):
        return None, "its boot_default is not a path"
    return Record(path, dict(overrides), default), None


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_record(folder: Path, record: Record) -> None:
    """Replace the record atomically and durably; StateError if any step fails (the old record stays)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=STATE_FILE + ".", suffix=".tmp", dir=folder)
    except OSError as e:
        raise StateError(f"cannot record the active model in {folder}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(record.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / STATE_FILE)
        _fsync_dir(folder)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise StateError(f"cannot record the active model in {folder / STATE_FILE}: {e.strerror or e}") from None


def probe(folder: Path) -> None:
    """Check, before a load, that the record could be written (the folder exists or can be made, a file
    can be created, written and synced there); StateError if not."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=STATE_FILE + ".", suffix=".probe", dir=folder)
    except OSError as e:
        raise StateError(f"cannot record the active model in {folder}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(" " * 512)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise StateError(f"cannot record the active model in {folder}: {e.strerror or e}") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    target = folder / STATE_FILE
    if target.is_dir():
        raise StateError(f"cannot record the active model: {target} is a folder")
