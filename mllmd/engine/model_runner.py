"""ModelRunner: loads the model, sizes and owns the KV memory, turns a scheduled batch into logits."""

from __future__ import annotations

import inspect
import itertools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mllmd.config import EngineConfig
from mllmd.engine.attention import AttentionBackend, create_attention_backend
from mllmd.engine.cuda_graph import CudaGraphRunner, capture_batch_sizes
from mllmd.engine.device_io import to_device_parts
from mllmd.engine.forward_batch import ForwardBatch
from mllmd.engine.memory import KVPool, ReqToTokenPool, TokenToKVPoolAllocator
from mllmd.engine.memory_budget import device_memory, kv_budget_bytes
from mllmd.engine.request import PLACEHOLDER
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
        # last sampled token of each request slot, written on the device by the sampler (overlap)
        self.token_buf = torch.zeros(config.max_running_requests, dtype=torch.int64, device=self.device)
        self.kv_pool = KVPool(
            self.max_total_tokens, self.info.num_layers, self.info.num_kv_heads, self.info.head_dim, dtype, self.device
        )
        self.attn_backend = self._attention_backend()
        self.graph_runner: CudaGraphRunner | None = None
        if self.device.type == "cuda" and not config.disable_cuda_graph:
            if self.attn_backend.supports_cuda_graph:
                self.graph_runner = CudaGraphRunner(self, capture_batch_sizes(self._graph_max_bs()))
            else:
                logger.info("%s cannot run in CUDA graphs: decode runs eagerly", type(self.attn_backend).__name__)
        if self.device.type == "cuda":
            self.warm_up()
        logger.info(
            "loaded %s (%s, %s, quantization %s) on %s: weights %.1f MB, KV pool %d tokens",
            config.model_path, type(self.model).__name__, dtype, self.info.quantization or "none", self.device,
            weight_bytes / 1e6, self.max_total_tokens,
        )

    _kv_budget_detail: str = ""  # the figures behind the CUDA KV budget, for the log and errors

    def _kv_pool_size(self) -> int:
        """KV tokens: the configured size, else what the memory budget leaves (see _cuda_kv_budget)."""
        if self.config.max_total_tokens is not None:
            return self.config.max_total_tokens
        info = self.info
        per_token = KVPool.bytes_per_token(info.num_layers, info.num_kv_heads, info.head_dim, info.dtype)
        if self.device.type == "cuda":
            budget = self._cuda_kv_budget()
            cap = None
        else:
            budget = _mem_available_bytes() * self.config.mem_fraction_static - info.weight_bytes
            cap = self.config.cpu_kv_cache_max_tokens
        tokens = int(budget // per_token)
        if cap is not None:
            tokens = min(tokens, cap)
        if tokens < 2:
            raise RuntimeError(
                f"not enough memory for the KV cache after the weights ({info.weight_bytes / 1e9:.2f} GB) and the "
                f"activations of the largest step: budget {budget / 1e6:.0f} MB; lower scheduler.max_prefill_tokens "
                f"or raise runtime.mem_fraction_static" + (f" ({self._kv_budget_detail})" if self._kv_budget_detail else "")
            )
        return tokens

    def _cuda_kv_budget(self) -> float:
        """Bytes for the KV pool on CUDA, from a profile of the largest step.

        The process may hold `mem_fraction_static` of the device memory; from that go the weights
        (already loaded), the measured peak activations of one step of max_prefill_tokens tokens,
        the sampler's workspace at max_running_requests rows and the decode CUDA graphs' outputs.
        On integrated GPUs (Jetson: CPU and GPU share DRAM) the memory there is to take is the
        kernel's MemAvailable, which cuMemGetInfo does not report faithfully.
        """
        dev = self.device
        props = torch.cuda.get_device_properties(dev)
        mem = device_memory(
            bool(getattr(props, "is_integrated", False)),
            torch.cuda.memory_allocated(dev),  # the weights
            torch.cuda.mem_get_info(dev),
            _mem_available_bytes(),
            torch.cuda.memory_reserved(dev),
        )
        activations = self.profile_step_bytes()
        vocab = self.info.vocab_size
        sampler = self.config.max_running_requests * vocab * 32  # fp32 logits, a sort (values + int64 ids), noise
        graphs = 0
        if not self.config.disable_cuda_graph:
            graphs = sum(capture_batch_sizes(self._graph_max_bs())) * vocab * 6 + (64 << 20)
        budget = kv_budget_bytes(mem, self.config.mem_fraction_static, activations, sampler, graphs)
        self._kv_budget_detail = (
            f"KV budget {budget / 1e9:.2f} GB: device {mem.total / 1e9:.1f} GB x {self.config.mem_fraction_static:.2f} "
            f"(free now {mem.free / 1e9:.2f} GB), allocated before the pool (weights) {mem.weights / 1e9:.2f} GB, "
            f"step activations {activations / 1e9:.2f} GB, sampler {sampler / 1e9:.2f} GB, CUDA graphs {graphs / 1e9:.2f} GB"
        )
        logger.info("%s", self._kv_budget_detail)
        return budget

    def _attention_backend(self) -> AttentionBackend:
        attn = self.model.model.layers[0].self_attn
        return create_attention_backend(
            self.config.attention_backend, self.device.type,
            device=self.device, num_qo_heads=attn.num_heads, scale=attn.scale, dtype=self.info.dtype,
            head_dim=attn.head_dim,
        )

    def _graph_max_bs(self) -> int:
        return min(self.config.max_running_requests, self.config.cuda_graph_max_bs)

    def _scratch_batch(self, prefix_lens: list[int], extend_lens: list[int]) -> ForwardBatch:
        """A batch over a private KV pool and request table (random tokens): for profiling and warm-up.
        Row i extends prefix_lens[i] cached tokens by extend_lens[i] new ones; every row samples."""
        dev, info = self.device, self.info
        seq = [p + n for p, n in zip(prefix_lens, extend_lens)]
        total = sum(seq)
        pool = KVPool(total, info.num_layers, info.num_kv_heads, info.head_dim, info.dtype, dev)
        table = ReqToTokenPool(len(seq), max(seq), dev)
        slots = torch.arange(1, total + 1, dtype=torch.int64, device=dev)  # slot 0 is the pool's reserved one
        new_locs, positions, start = [], [], 0
        for r, (p, n) in enumerate(zip(prefix_lens, extend_lens)):
            table.req_to_token[r, : p + n] = slots[start : start + p + n]
            new_locs.append(slots[start + p : start + p + n])
            positions.append(torch.arange(p, p + n, dtype=torch.int64, device=dev))
            start += p + n
        rows, seq_t, ext, logit_rows = to_device_parts(
            [list(range(len(seq))), seq, extend_lens, [x - 1 for x in itertools.accumulate(extend_lens)]],
            torch.int64, dev,
        )
        batch = ForwardBatch(
            input_ids=torch.randint(0, info.vocab_size, (sum(extend_lens),), device=dev),
            positions=torch.cat(positions),
            out_cache_loc=torch.cat(new_locs),
            req_pool_indices=rows,
            seq_lens=seq_t,
            extend_lens=ext,
            logits_indices=logit_rows,
            seq_lens_cpu=seq,
            prefix_lens_cpu=list(prefix_lens),
            extend_lens_cpu=list(extend_lens),
            req_to_token_pool=table,
            kv_pool=pool,
            attn_backend=self._attention_backend(),
        )
        batch.attn_backend.init_forward_metadata(batch)
        return batch

    @torch.inference_mode()
    def profile_step_bytes(self) -> int:
        """Peak bytes a forward of the largest step allocates beyond the weights (CUDA only)."""
        dev = self.device
        n = max(1, min(self.config.max_prefill_tokens, self.info.context_length))
        batch = self._scratch_batch([0], [n])
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        self.forward_eager(batch)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del batch
        torch.cuda.empty_cache()
        return int(peak)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile, before the first request, the kernel variants that prefill and mixed steps use.

        Triton compiles a kernel once per set of tile sizes, and tile sizes follow the step's shape
        (the attention's query block follows the longest new sequence, quantized GEMMs pick tiles by
        row count). Compiled in the middle of serving, each costs a step of 0.1 s or more, on every
        request running then. Decode shapes are compiled by the CUDA graph capture.
        """
        cap = max(1, min(self.config.max_prefill_tokens, self.info.context_length))
        shapes = [([0], [n]) for n in (2, 24, 48, 96, 200, 400, 1000) if n <= cap]
        if cap >= 40:
            shapes.append(([7, 0, 30], [1, 5, 33]))  # decodes beside prefill chunks, one with a prefix
        for prefix, extend in shapes:
            self.forward_eager(self._scratch_batch(prefix, extend))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def prepare(self, sched: ScheduledBatch) -> ForwardBatch:
        """Gather the step's flat inputs from the scheduled requests and write its KV slots into the
        request table: a decode step that a CUDA graph runs is staged into the graph's own inputs
        (CudaGraphRunner.stage: the table write and the in-flight tokens happen inside the graph);
        any other step takes one staged host-to-device copy, a scatter into the table and, for
        in-flight tokens, a gather from the token buffer."""
        input_ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        fill_rows: list[int] = []  # overlap: input positions whose token is still on the device
        fill_slots: list[int] = []
        for req, p, n in zip(sched.reqs, sched.prefix_lens, sched.extend_lens):
            start = len(input_ids)
            input_ids += req.token_ids[p : p + n]
            positions += range(p, p + n)
            seq_lens.append(p + n)
            if p + n == len(req.token_ids):
                logits_rows.append(len(input_ids) - 1)
            if input_ids[-1] == PLACEHOLDER:
                fill_rows.append(len(input_ids) - 1)
                fill_slots.append(req.req_pool_idx)
            assert PLACEHOLDER not in input_ids[start:-1], "only a request's last token can be in flight"
        rows = [r.req_pool_idx for r in sched.reqs]
        gr = self.graph_runner
        if (
            gr is not None
            and len(input_ids) == len(sched.reqs) == len(logits_rows)  # decodes, every row samples
            and gr.size_for(len(input_ids)) is not None
        ):
            fill = [int(t == PLACEHOLDER) for t in input_ids]
            ids = [0 if f else t for t, f in zip(input_ids, fill)]
            return gr.stage(ids, positions, rows, seq_lens, fill, sched.out_cache_loc, list(sched.prefix_lens))
        # ids, positions, request rows, seq_lens, extend_lens, logits rows, fills, each token's request row:
        # one copy; a token's request-table entry is (its request row, its position)
        token_rows = [r for r, n in zip(rows, sched.extend_lens) for _ in range(n)]
        parts = to_device_parts(
            [input_ids, positions, rows, seq_lens, sched.extend_lens, logits_rows, fill_rows, fill_slots, token_rows],
            torch.int64,
            self.device,
        )
        self.req_to_token_pool.req_to_token[parts[8], parts[1]] = sched.out_cache_loc
        if fill_rows:  # gather the in-flight tokens from the device-side per-request buffer
            parts[0][parts[6]] = self.token_buf[parts[7]]
        batch = ForwardBatch(
            input_ids=parts[0],
            positions=parts[1],
            out_cache_loc=sched.out_cache_loc,
            req_pool_indices=parts[2],
            seq_lens=parts[3],
            extend_lens=parts[4],
            logits_indices=parts[5],
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=list(sched.prefix_lens),
            extend_lens_cpu=list(sched.extend_lens),
            req_to_token_pool=self.req_to_token_pool,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
        )
        self.attn_backend.init_forward_metadata(batch)  # this batch runs eagerly
        return batch

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the model; float32 logits [N, V] for the rows that sample (empty if none).

        Decode batches that prepare() staged replay the CUDA graph of their size (padded up)."""
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.run(batch)
        return self.forward_eager(batch)

    @torch.inference_mode()
    def forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        """forward() without graphs (also what the graphs capture)."""
        hidden = self.model(batch.input_ids, batch.positions, batch)
        if batch.logits_indices.numel() == 0:
            return hidden.new_empty((0, self.info.vocab_size), dtype=torch.float32)
        if batch.is_decode and batch.logits_indices.numel() == batch.num_tokens:
            return self.model.compute_logits(hidden)  # every row samples: no gather
        return self.model.compute_logits(hidden[batch.logits_indices])
