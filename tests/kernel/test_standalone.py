"""mllmd_kernels stands alone: every one of its modules imports in a fresh interpreter where the
`mllmd` package cannot be imported (and, as the library promises, where Triton cannot either), and
no module imports `mllmd` anywhere, a function's own imports included."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import mllmd_kernels
import pytest

_SCRIPT = r"""
import importlib, importlib.abc, pkgutil, sys

BLOCKED = set(sys.argv[1].split(","))


class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked by the test: {name}")
        return None


sys.meta_path.insert(0, Blocker())
import mllmd_kernels

names = ["mllmd_kernels"] + [m.name for m in pkgutil.walk_packages(mllmd_kernels.__path__, "mllmd_kernels.")]
for name in names:
    importlib.import_module(name)
leaked = sorted(n for n in sys.modules if n.split(".")[0] in BLOCKED)
assert not leaked, leaked
print(len(names))
"""


def _modules() -> list[str]:
    root = Path(mllmd_kernels.__file__).parent
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.py"))


@pytest.mark.parametrize("blocked", ["mllmd", "mllmd,triton"])
def test_every_module_imports_without(blocked: str) -> None:
    kernels_root = str(Path(mllmd_kernels.__file__).parents[1])
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, blocked],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=kernels_root,
        env={**os.environ, "PYTHONPATH": kernels_root},  # this checkout's mllmd_kernels, and no mllmd
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[-1]) == len(_modules()), (proc.stdout, _modules())


def test_no_module_imports_mllmd_even_lazily() -> None:
    root = Path(mllmd_kernels.__file__).parent
    found = []
    for rel in _modules():
        for node in ast.walk(ast.parse((root / rel).read_text(), rel)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            found += [f"{rel}:{node.lineno} {n}" for n in names if n.split(".")[0] == "mllmd"]
    assert not found, found
