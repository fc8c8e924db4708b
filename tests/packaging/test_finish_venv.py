"""packaging/debian/finish-venv's tidy step on a fake virtual environment (no build, no root): what
lintian warned about in the built package is gone, and nothing a runtime reads is touched."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def finish_venv() -> ModuleType:
    path = REPO / "packaging/debian/finish-venv"
    loader = importlib.machinery.SourceFileLoader("finish_venv", str(path))
    spec = importlib.util.spec_from_loader("finish_venv", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_tidy_drops_build_sources_and_vcs_files_and_fixes_bare_python_shebangs(tmp_path: Path) -> None:
    site = tmp_path / "lib/python3.11/site-packages"
    backtrace = site / "tvm_ffi/3rdparty/libbacktrace"
    backtrace.mkdir(parents=True)
    (backtrace / "configure").write_text("#! /bin/sh\necho $RANDOM\n")  # lintian: script-not-executable
    dlpack = site / "tvm_ffi/3rdparty/dlpack/include/dlpack"
    dlpack.mkdir(parents=True)
    (dlpack / "dlpack.h").write_text("/* kept: a header tvm_ffi compiles against */\n")
    (site / "tvm_ffi/.gitignore").write_text("build/\n")  # lintian: package-contains-vcs-control-file
    (site / "prometheus_client").mkdir()
    bare = site / "prometheus_client/__init__.py"
    bare.write_text("#!/usr/bin/env python\n\nfrom . import x\n")  # lintian: unusual-interpreter python
    versioned = site / "prometheus_client/ok.py"
    versioned.write_text("#!/usr/bin/env python3\nx = 1\n")
    plain = site / "prometheus_client/plain.py"
    plain.write_text("x = '#!/usr/bin/env python'\n")

    finish_venv().tidy(tmp_path / "lib")

    assert not backtrace.exists()
    assert (dlpack / "dlpack.h").exists()
    assert not (site / "tvm_ffi/.gitignore").exists()
    assert bare.read_text() == "#!/usr/bin/python3\n\nfrom . import x\n"  # same line count
    assert versioned.read_text() == "#!/usr/bin/env python3\nx = 1\n"
    assert plain.read_text() == "x = '#!/usr/bin/env python'\n"
