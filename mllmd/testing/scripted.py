"""Test-only: a sampler that emits scripted tokens instead of sampling, to test output parsing.

When a daemon test sets ``MLLMD_TESTING_SCRIPT=/path/to/file.json``, tests/daemon/scripted_site's
sitecustomize replaces the scheduler worker's ``engine.runner.sampler`` with a ``ScriptedSampler`` built
from that file (production code never looks this module up): a JSON list whose
entries are token-id lists, or strings tokenized with the model's tokenizer (special tokens such as
``<think>`` and ``<tool_call>`` are recognised). Request k (in order of first sampling) emits script
``k % len(scripts)`` token by token, then an EOS token (forever, should the request ignore EOS).

Requests are told apart by their sampling seed (each request's seed is drawn at random by the engine
unless the client sets one), and a row at output position 0 starts a new request: so clients that
use this must not send the same seed twice at once. Logprobs, when asked for, are those of the real
logits at the scripted token.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from mllmd.engine.sampling import SamplerOutput, SamplingBatchInfo, compute_logprobs
from mllmd.engine.sampling.sampler import TokenSink, fill_token_sink

ENV_VAR = "MLLMD_TESTING_SCRIPT"
MAX_TRACKED = 4096  # requests remembered (oldest forgotten first)


def load_scripts(path: str | os.PathLike[str], tokenizer: Any | None = None) -> list[list[int]]:
    """The scripts in `path` as token-id lists (strings need `tokenizer`)."""
    raw = json.loads(Path(path).read_text())
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{ENV_VAR}: {path} must hold a non-empty JSON list")
    scripts: list[list[int]] = []
    for i, entry in enumerate(raw):
        if isinstance(entry, str):
            if tokenizer is None:
                raise ValueError(f"{ENV_VAR}: entry {i} is a string but no tokenizer was given")
            scripts.append(list(tokenizer.encode(entry, add_special_tokens=False)))
        elif isinstance(entry, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in entry):
            scripts.append(list(entry))
        else:
            raise ValueError(f"{ENV_VAR}: entry {i} must be a string or a list of token ids")
    return scripts


class ScriptedSampler:
    """Drop-in for `Sampler`: row i gets the next token of its request's script, then `eos_id`."""

    def __init__(self, scripts: list[list[int]], eos_id: int) -> None:
        self.scripts = scripts
        self.eos_id = eos_id
        self.next_index = 0
        self.assigned: OrderedDict[int, int] = OrderedDict()  # seed -> script index

    def _script_for(self, seed: int, position: int) -> list[int]:
        if position == 0 or seed not in self.assigned:
            self.assigned.pop(seed, None)
            self.assigned[seed] = self.next_index % len(self.scripts)
            self.next_index += 1
            while len(self.assigned) > MAX_TRACKED:
                self.assigned.popitem(last=False)
        return self.scripts[self.assigned[seed]]

    def __call__(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        token_sink: TokenSink | None = None,
        token_mask: Any = None,
        inplace: bool = False,
    ) -> SamplerOutput:
        """The scripted tokens (a grammar's token_mask does not apply: the script decides; the logits are
        only read, whatever `inplace` allows)."""
        ids = []
        for seed, pos in zip(info.seeds, info.positions):
            script = self._script_for(seed, pos)
            ids.append(script[pos] if pos < len(script) else self.eos_id)
        tokens = torch.tensor(ids, dtype=torch.int64, device=logits.device)  # [B]
        fill_token_sink(token_sink, tokens)  # as Sampler: the engine's device-side token buffer (overlap)
        if not info.want_logprobs:
            return SamplerOutput(tokens, None, None, None)
        lp, top_ids, top_lp = compute_logprobs(logits, tokens, info.num_top_logprobs)
        return SamplerOutput(tokens, lp, top_ids, top_lp)


def install_from_env(engine: Any, tokenizer_path: str) -> None:
    """Replace `engine.runner.sampler` when MLLMD_TESTING_SCRIPT is set (tests/daemon/scripted_site calls this)."""
    path = os.environ.get(ENV_VAR)
    if not path:
        return
    from transformers import AutoTokenizer

    scripts = load_scripts(path, AutoTokenizer.from_pretrained(tokenizer_path))
    eos = engine.info.eos_token_ids[0] if engine.info.eos_token_ids else 0
    engine.runner.sampler = ScriptedSampler(scripts, eos)
