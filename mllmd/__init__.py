"""mllmd: an LLM serving appliance for edge GPUs.

`LLM` and `SamplingParams` are imported lazily so that the daemon's main process, which imports
`mllmd`, never pulls in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from mllmd.entrypoints.llm import LLM
    from mllmd.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from mllmd.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from mllmd.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'mllmd' has no attribute {name!r}")
