"""ModelRunner: loads the model, sizes and owns the KV memory, turns a scheduled batch into logits."""

from __future__ import annotations

import inspect
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mllmd.config import EngineConfig
from mllmd.engine.attention import create_attention_backend
from mllmd.engine.forward_batch import ForwardBatch
from mllmd.engine.memory import KVPool, ReqToTokenPool, TokenToKVPoolAllocator
from mllmd.engine.scheduler import ScheduledBatch
from mllmd.models import get_model_class
from mllmd.models.loader import iter_weights
from mllmd.models.quantization import parse_quant_config

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelInfo:
    """Facts about the loaded model that the rest of the engine needs."""

    hf_config: Any
    dtype: torch.dtype
    device: torch.device
    vocab_size: int
    context_length: int
    eos_token_ids: list[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    weight_bytes: int  # bytes of the stored weights (quantized tensors as stored, not dequantized copies)
    quantization: str | None = None  # "w8a8" | "w4a16" (compressed-tensors) | None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("runtime.device: cuda was asked for but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    """auto: float32 on CPU; on GPU the checkpoint's bf16/fp16 (bf16 if it says float32)."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    ckpt = ckpt if isinstance(ckpt, torch.dtype) else _DTYPES.get(str(ckpt), torch.bfloat16)
    return ckpt if ckpt in (torch.bfloat16, torch.float16) else torch.bfloat16


def read_eos_token_ids(model_path: str, hf_config: Any) -> list[int]:
    """EOS ids from config.json and generation_config.json (as transformers' generate uses them)."""
    ids: list[int] = []
    sources: list[Any] = [getattr(hf_config, "eos_token_id", None)]
    gen = Path(model_path) / "generation_config.json"
    if gen.is_file():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for src in sources:
        for t in src if isinstance(src, list) else [src]:
            if isinstance(t, int) and t not in ids:
                ids.append(t)
    return ids


def _mem_available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoConfig

        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu" and config.cpu_threads:
            torch.set_num_threads(config.cpu_threads)
        hf_config = AutoConfig.from_pretrained(config.model_path)
        dtype = resolve_dtype(config.dtype, hf_config, self.device)
        model_cls = get_model_class(getattr(hf_config, "architectures", None))
        quant_config = parse_quant_config(hf_config)  # None, or UnsupportedQuantization naming the scheme
        model_kwargs: dict[str, Any] = {}
        if quant_config is not None:
            if "quant_config" not in inspect.signature(model_cls).parameters:
                raise ValueError(f"{model_cls.__name__} cannot load quantized ({quant_config.method}) checkpoints yet")
            model_kwargs["quant_config"] = quant_config
        with torch.device(self.device):
            self.model = model_cls(hf_config, dtype, **model_kwargs)
        self.model.load_weights(iter_weights(config.model_path))
        self.model.eval()
        max_ctx = int(getattr(hf_config, "max_position_embeddings", 32768))
        context_length = config.context_length or max_ctx
        if context_length > max_ctx:
            raise ValueError(f"model.context_length: {context_length} exceeds the model's limit of {max_ctx}")
        attn = self.model.model.layers[0].self_attn
        # Parameters are the stored weights (int8 / packed int4 + scales for quantized layers);
        # kernels keep derived copies (e.g. the CPU W4A16 dequantized weight) as buffers.
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.info = ModelInfo(
            hf_config=hf_config,
            dtype=dtype,
            device=self.device,
            vocab_size=int(hf_config.vocab_size),
            context_length=context_length,
            eos_token_ids=read_eos_token_ids(config.model_path, hf_config),
            num_layers=int(hf_config.num_hidden_layers),
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            weight_bytes=weight_bytes,
            quantization=quant_config.method if quant_config is not None else None,
        )
        self.max_total_tokens = self._kv_pool_size()
        self.req_to_token_pool = ReqToTokenPool(config.max_running_requests, context_length, self.device)
        self.allocator = TokenToKVPoolAllocator(self.max_total_tokens, self.device)
        self.kv_pool = KVPool(
            self.max_total_tokens, self.info.num_layers, self.info.num_kv_heads, self.info.head_dim, dtype, self.device
        )
        self.attn_backend = create_attention_backend(config.attention_backend, self.device.type)
        logger.info(
            "loaded %s (%s, %s, quantization %s) on %s: weights %.1f MB, KV pool %d tokens",
            config.model_path, type(self.model).__name__, dtype, self.info.quantization or "none", self.device,
            weight_bytes / 1e6, self.max_total_tokens,
        )

    def _kv_pool_size(self) -> int:
        """KV tokens: the configured size, else what the memory budget left after the weights allows."""
        if self.config.max_total_tokens is not None:
            return self.config.max_total_tokens
        info = self.info
        per_token = KVPool.bytes_per_token(info.num_layers, info.num_kv_heads, info.head_dim, info.dtype)
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = free * self.config.mem_fraction_static
            cap = None
        else:
            budget = _mem_available_bytes() * self.config.mem_fraction_static - info.weight_bytes
            cap = self.config.cpu_kv_cache_max_tokens
        tokens = int(budget // per_token)
        if cap is not None:
            tokens = min(tokens, cap)
        if tokens < 2:
            raise RuntimeError("not enough memory for the KV cache after loading the weights")
        return tokens

    def prepare(self, sched: ScheduledBatch) -> ForwardBatch:
        """Gather the step's flat inputs from the scheduled requests."""
        input_ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        for req, p, n in zip(sched.reqs, sched.prefix_lens, sched.extend_lens):
            input_ids += req.token_ids[p : p + n]
            positions += range(p, p + n)
            seq_lens.append(p + n)
            if p + n == len(req.token_ids):
                logits_rows.append(len(input_ids) - 1)
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            out_cache_loc=sched.out_cache_loc,
            req_pool_indices=torch.tensor([r.req_pool_idx for r in sched.reqs], dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            extend_lens=torch.tensor(sched.extend_lens, dtype=torch.int64, device=dev),
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=dev),
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=list(sched.prefix_lens),
            extend_lens_cpu=list(sched.extend_lens),
            req_to_token_pool=self.req_to_token_pool,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
        )
        self.attn_backend.init_forward_metadata(batch)
        return batch

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the model; float32 logits [N, V] for the rows that sample (empty if none)."""
        hidden = self.model(batch.input_ids, batch.positions, batch)
        if batch.logits_indices.numel() == 0:
            return hidden.new_empty((0, self.info.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[batch.logits_indices])
