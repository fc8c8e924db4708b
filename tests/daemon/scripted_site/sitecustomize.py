"""Test-only: scripted model output in the daemon's scheduler worker, injected from outside.

tests/daemon/conftest.py puts this folder on the daemon's PYTHONPATH when a test sets
MLLMD_TESTING_SCRIPT (see mllmd/testing/scripted.py). In the process that imports the engine (the
scheduler worker) the Engine class is wrapped as its module loads: once built, its sampler is
replaced by the ScriptedSampler. Production code knows nothing of this.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Any

ENGINE_MODULE = "mllmd.engine.engine"


def _wrap(engine_cls: Any) -> None:
    init = engine_cls.__init__

    def scripted_init(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        init(self, config, *args, **kwargs)
        from mllmd.testing.scripted import install_from_env

        install_from_env(self, config.tokenizer_path or config.model_path)

    engine_cls.__init__ = scripted_init


class _WrapEngineOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != ENGINE_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module: Any) -> None:
            exec_module(module)
            _wrap(module.Engine)

        spec.loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
        return spec


if os.environ.get("MLLMD_TESTING_SCRIPT"):
    sys.meta_path.insert(0, _WrapEngineOnImport())
