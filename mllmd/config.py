"""Engine configuration: one frozen dataclass, validated with errors that name the key.

The daemon's YAML / environment / command-line layers build the same object (each field carries the
config-file section it lives in as metadata). This module must not import torch.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any, get_args, get_type_hints

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")


class ConfigError(ValueError):
    """A configuration value is invalid; `key` names it (e.g. "scheduler.max_running_requests")."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def _f(section: str, default: Any, doc: str) -> Any:
    return field(default=default, metadata={"section": section, "doc": doc})


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine (scheduler worker or offline `LLM`) needs to run one model."""

    model_path: str = _f("model", "", "model folder (config.json + safetensors + tokenizer)")
    tokenizer_path: str | None = _f("model", None, "tokenizer folder; default: the model folder")
    dtype: str = _f("model", "auto", "auto | float32 | bfloat16 | float16 (auto: the checkpoint's dtype; float32 on CPU)")
    context_length: int | None = _f("model", None, "max tokens per request (prompt + output); default: the model's")
    device: str = _f("runtime", "auto", "auto | cpu | cuda")
    max_running_requests: int = _f("scheduler", 64, "most requests decoding at once")
    max_total_tokens: int | None = _f("scheduler", None, "KV-cache size in tokens; default: sized from memory")
    max_prefill_tokens: int = _f("scheduler", 8192, "token budget of one step (prefill chunks + decodes)")
    overlap_schedule: bool | None = _f(
        "scheduler", None,
        "schedule and launch step N+1 while the device runs step N (tokens are reported one step later); "
        "null: on for CUDA, off on CPU (a CPU step is synchronous: nothing to overlap)",
    )
    chunked_prefill_size: int = _f("scheduler", 2048, "longest prefill chunk of one request per step; 0 disables chunking")
    prefill_wait_ms: float = _f(
        "scheduler", 0.0,
        "while requests decode, a new prompt may wait this long for others to share its prefill step (a step "
        "with a prefill takes longer than a decode step and slows every running request); it never waits once the "
        "waiting prompts fill a prefill chunk or the free request slots; 0: admit at once (on the H200, 20 ms "
        "gained nothing measurable with 64 streams)",
    )
    max_decode_stall_ms: float | None = _f(
        "scheduler", None,
        "while requests decode, cap a step's prefill tokens so that the step is expected to end within this "
        "many ms (its cost per token learned from the steps run so far; where steps replay CUDA graphs, the "
        "cap is a graph's token count, padding included); a new prompt then takes more, "
        "shorter chunks, at least 32 tokens each (needs chunked_prefill_size > 0); null (default): on a GPU, "
        "twice the time of a step of the running decode batch alone, measured as it runs (the chunk adapts to "
        "the batch: a step that carries a prompt lasts about two decode steps), on the CPU off; 0: off "
        "(chunked_prefill_size alone bounds a chunk)",
    )
    max_encoder_tokens_per_step: int = _f(
        "scheduler", 4096,
        "image tokens whose vision-encoder output a step may compute (a prefill chunk that needs more "
        "waits for the next step; an image larger than this is encoded alone in its step)",
    )
    state_slots: int | None = _f(
        "cache", None,
        "hybrid models (Qwen3.5): recurrent-state slots, one per running request plus the prefix cache's "
        "snapshots (18 MiB each for Qwen3.5-0.8B/2B, 48 MiB for 4B/9B); a request waits for a free one; "
        "null: twice scheduler.max_running_requests, fewer where memory is short",
    )
    state_snapshot_interval: int = _f(
        "cache", 512,
        "hybrid models: while a prompt prefills, its recurrent state is kept for the prefix cache near "
        "each multiple of this many tokens (at the 64-token chunk boundary at or before it, or exactly where "
        "a prefill chunk ends there) and before the prompt's last token, where the next turn of a "
        "conversation starts; a shared prefix is reused up to its last such point; 0: only the state at "
        "the end of each request is kept",
    )
    encoder_cache_mb: int = _f(
        "cache", 256,
        "memory for vision-encoder outputs kept by image content, so that an image seen again (a later "
        "chat turn, another request) is not encoded again; least recently used first out",
    )
    disable_radix_cache: bool = _f("cache", False, "turn the prefix cache off")
    attention_backend: str = _f("runtime", "auto", "auto | torch | triton | flashinfer")
    mem_fraction_static: float = _f("runtime", 0.85, "fraction of device memory for weights + KV cache")
    disable_cuda_graph: bool = _f("runtime", False, "run every step and the vision tower eagerly instead of replaying CUDA graphs")
    cuda_graph_max_bs: int = _f(
        "runtime", 64,
        "largest decode batch run as a CUDA graph, and most requests in a prefill or mixed step run as one "
        "(bigger ones run eagerly)",
    )
    prefill_graph_max_tokens: int = _f(
        "runtime", 2048,
        "largest prefill or mixed (prefill + decode) step, in tokens, run as a CUDA graph, padded up to the "
        "next of 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, ... (on the triton attention backend; "
        "steps with image tokens, a prompt's 3-axis M-RoPE positions or prompt logprobs run eagerly); 0: all "
        "such steps run eagerly",
    )
    random_seed: int = _f("runtime", 0, "seed for requests that give none")
    cpu_kv_cache_max_tokens: int = _f("runtime", 131072, "cap on the default KV-cache size on CPU")
    cpu_threads: int | None = _f("runtime", None, "torch threads on CPU; null: all cores (offline), all but one (daemon)")

    def __post_init__(self) -> None:
        validate(self)

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(cls, model_path: str, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments; unknown names are an error naming them."""
        known = {f.name for f in fields(cls)}
        for key in kwargs:
            if key not in known:
                raise ConfigError(key, f"unknown engine option (known: {', '.join(sorted(known))})")
        return cls(model_path=os.fspath(model_path), **kwargs)

    @staticmethod
    def section_of(name: str) -> str:
        return _FIELDS[name].metadata["section"]


_FIELDS = {f.name: f for f in fields(EngineConfig)}


def _key(name: str) -> str:
    return f"{_FIELDS[name].metadata['section']}.{name}"


def _check_type(cfg: EngineConfig, name: str, hint: Any) -> None:
    value = getattr(cfg, name)
    args = get_args(hint) or (hint,)
    if value is None:
        if type(None) not in args:
            raise ConfigError(_key(name), "must not be null")
        return
    base = next(a for a in args if a is not type(None))
    if base is bool:
        ok, want = isinstance(value, bool), "a boolean"
    elif base is int:
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif base is float:
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    else:
        ok, want = isinstance(value, str), "a string"
    if not ok:
        raise ConfigError(_key(name), f"must be {want}, got {value!r}")


def validate(cfg: EngineConfig) -> None:
    """Raise ConfigError for the first bad value."""
    hints = get_type_hints(EngineConfig)
    for f in fields(cfg):
        _check_type(cfg, f.name, hints[f.name])

    def choice(name: str, allowed: tuple[str, ...]) -> None:
        if getattr(cfg, name) not in allowed:
            raise ConfigError(_key(name), f"must be one of {', '.join(allowed)}; got {getattr(cfg, name)!r}")

    def at_least(name: str, low: int) -> None:
        v = getattr(cfg, name)
        if v is not None and v < low:
            raise ConfigError(_key(name), f"must be >= {low}; got {v}")

    choice("dtype", DTYPES)
    choice("device", DEVICES)
    choice("attention_backend", ATTENTION_BACKENDS)
    at_least("context_length", 2)
    at_least("max_running_requests", 1)
    at_least("max_total_tokens", 2)
    at_least("max_prefill_tokens", 1)
    at_least("chunked_prefill_size", 0)
    at_least("prefill_wait_ms", 0)
    at_least("max_decode_stall_ms", 0)
    at_least("cpu_kv_cache_max_tokens", 2)
    at_least("cpu_threads", 1)
    at_least("cuda_graph_max_bs", 1)
    at_least("prefill_graph_max_tokens", 0)
    at_least("max_encoder_tokens_per_step", 1)
    at_least("encoder_cache_mb", 0)
    at_least("state_slots", 1)
    at_least("state_snapshot_interval", 0)
    if not 0.0 < cfg.mem_fraction_static < 1.0:
        raise ConfigError(_key("mem_fraction_static"), f"must be in (0, 1); got {cfg.mem_fraction_static}")
