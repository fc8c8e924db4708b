"""The import rules of DESIGN.md, checked on the source: imports point down the layering, the leaves
stay leaves, production code never imports test doubles, and the main process never imports torch.

Layers, lowest first: mllmd_kernels <- models <- engine <- workers <- daemon. `config`,
`sampling_params` and `messages` are torch-free leaves that anything may import. Every import counts
(inside functions too), except those under `if TYPE_CHECKING:`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LEAVES = {"mllmd.config", "mllmd.sampling_params", "mllmd.messages", "mllmd.knobs", "mllmd.logfmt", "mllmd.heap"}

# package -> the mllmd packages its modules may import (besides itself and the leaves)
ALLOWED: dict[str, set[str]] = {
    "mllmd": {"mllmd.entrypoints"},  # the root package: lazy re-exports
    "mllmd_kernels": set(),
    "mllmd.config": set(),
    "mllmd.sampling_params": set(),
    "mllmd.knobs": set(),
    "mllmd.logfmt": set(),
    "mllmd.heap": set(),
    "mllmd.messages": set(),
    "mllmd.detokenizer": set(),
    "mllmd.telemetry": set(),
    "mllmd.openai": set(),
    "mllmd.multimodal": set(),
    "mllmd.structured": set(),  # grammars of structured outputs (xgrammar, imported lazily)
    "mllmd.models": {"mllmd_kernels", "mllmd.multimodal"},
    "mllmd.engine": {"mllmd_kernels", "mllmd.models", "mllmd.multimodal", "mllmd.structured"},
    "mllmd.entrypoints": {"mllmd_kernels", "mllmd.models", "mllmd.engine", "mllmd.detokenizer", "mllmd.multimodal"},
    "mllmd.workers": {"mllmd_kernels", "mllmd.models", "mllmd.engine", "mllmd.detokenizer", "mllmd.multimodal",
                      "mllmd.structured"},
    "mllmd.daemon": {"mllmd.workers", "mllmd.openai", "mllmd.telemetry", "mllmd.models", "mllmd.multimodal",
                     "mllmd.structured"},
    "mllmd.checkpoint": set(),  # model folders from the vendored configs; random weights with torch alone
    "mllmd.demo": {"mllmd.checkpoint"},
    "mllmd.cli": {"mllmd.daemon", "mllmd.demo"},
    "mllmd.ctl": {"mllmd.daemon"},  # reads the daemon's configuration to find its socket
    "mllmd.bench": {"mllmd.entrypoints", "mllmd.engine", "mllmd.models", "mllmd_kernels", "mllmd.testing", "mllmd.checkpoint",
                    "mllmd.openai", "mllmd.multimodal"},  # multimodal: one_batch --image decodes a picture file
    "mllmd.testing": {"mllmd.engine", "mllmd.models", "mllmd_kernels", "mllmd.entrypoints", "mllmd.checkpoint"},
}
# Modules of the main process (the one systemd watches): never torch, at import time.
MAIN_PROCESS = ["mllmd.cli", "mllmd.ctl", "mllmd.daemon.main", "mllmd.daemon.http_app", "mllmd.daemon.admin",
                "mllmd.daemon.model_slot", "mllmd.daemon.metrics", "mllmd.openai.serving", "mllmd.openai.protocol",
                "mllmd.openai.responses_api", "mllmd.openai.responses_output"]
ML_STACK = ("torch", "transformers", "triton", "numpy", "safetensors")


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO / "kernels" if path.is_relative_to(REPO / "kernels") else REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    files = [*(REPO / "mllmd").rglob("*.py"), *(REPO / "kernels" / "mllmd_kernels").rglob("*.py")]
    return {_module_name(p): p for p in files}


def _package(module: str) -> str:
    """The layer a module belongs to: mllmd_kernels, or mllmd.<first part>."""
    parts = module.split(".")
    if parts[0] == "mllmd_kernels":
        return "mllmd_kernels"
    return ".".join(parts[:2]) if len(parts) > 1 else "mllmd"


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, module: str, top_level_only: bool) -> set[str]:
    """Absolute names of the modules `path` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    is_pkg = path.name == "__init__.py"

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = module.split(".") if is_pkg else module.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join([*pkg, base] if base else pkg)
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import submodule`
            if top_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            for field in ("body", "orelse", "finalbody", "handlers"):
                child = getattr(node, field, None)
                if isinstance(child, list) and child and isinstance(child[0], (ast.stmt, ast.ExceptHandler)):
                    visit(child)  # type: ignore[arg-type]

    visit(tree.body)
    return out


@cache
def _graph(top_level_only: bool) -> dict[str, set[str]]:
    return {m: _imports(p, m, top_level_only) for m, p in _sources().items()}


def test_imports_point_down_the_layering() -> None:
    bad = []
    sources = _sources()
    for module, imports in _graph(False).items():
        own = _package(module)
        allowed = ALLOWED.get(own)
        assert allowed is not None, f"{module}: package {own} has no place in the layering (add it to ALLOWED)"
        for name in imports:
            if not name.startswith(("mllmd.", "mllmd_kernels")):
                continue
            while name not in sources and "." in name:  # `from pkg import name`: name is no module
                name = name.rpartition(".")[0]
            if name == "mllmd":
                continue  # the root package only re-exports, lazily (LLM, SamplingParams, __version__)
            target = _package(name)
            if target == own:
                continue
            if target in LEAVES:
                if own in LEAVES and (own, target) != ("mllmd.messages", "mllmd.sampling_params"):
                    bad.append(f"{module} -> {name} (a leaf imports another leaf)")
                continue
            if target not in allowed:
                bad.append(f"{module} -> {name}")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(set(bad)))


def test_leaves_and_the_main_process_import_no_ml_stack() -> None:
    graph = _graph(True)
    sources = _sources()

    def closure(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            for name in graph.get(m, ()):
                if name in sources:
                    todo.append(name)
                else:
                    seen.add(name)
        return seen

    for leaf in ["mllmd.config", "mllmd.sampling_params", "mllmd.messages", *MAIN_PROCESS]:
        reached = {n.split(".")[0] for n in closure(leaf)}
        assert not reached & set(ML_STACK), f"{leaf} imports {sorted(reached & set(ML_STACK))} at import time"


def test_main_process_modules_import_without_torch() -> None:
    """The same at run time: importing every main-process module loads neither torch nor transformers."""
    code = (
        "import sys\n"
        f"for m in {MAIN_PROCESS!r}: __import__(m)\n"
        f"bad = [m for m in {list(ML_STACK)!r} if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
