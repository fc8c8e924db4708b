"""The sampler: penalties, filters, seeded Gumbel-max sampling and logprobs."""

from __future__ import annotations

from mllmd_kernels.gumbel import gumbel, gumbel_noise, hash32, hash32_py, row_keys, uniform

from mllmd.engine.sampling.filters import keep_mask, select_candidates
from mllmd.engine.sampling.logprobs import compute_logprobs
from mllmd.engine.sampling.sampler import Sampler, SamplerOutput, process_logits
from mllmd.engine.sampling.states import SamplingBatchInfo, SamplingStates, uses_output_penalties

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingBatchInfo",
    "SamplingStates",
    "compute_logprobs",
    "gumbel",
    "gumbel_noise",
    "hash32",
    "hash32_py",
    "keep_mask",
    "process_logits",
    "row_keys",
    "select_candidates",
    "uniform",
    "uses_output_penalties",
]
