"""ModelRunner: loads the model, sizes and owns the KV memory, turns a scheduled batch into logits
and samples its tokens (keeping each request slot's sampling state and last token on the device)."""

from __future__ import annotations

import functools
import inspect
import itertools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mllmd.config import EngineConfig
from mllmd.engine.attention import AttentionBackend, create_attention_backend
from mllmd.engine.cuda_graph import CudaGraphRunner, capture_batch_sizes
from mllmd.engine.device_io import to_device, to_device_parts
from mllmd.engine.encoder_cache import EncoderCache
from mllmd.engine.forward_batch import ForwardBatch
from mllmd.engine.memory import KVPool, ReqToTokenPool, TokenToKVPoolAllocator
from mllmd.engine.memory_budget import device_memory, kv_budget_bytes
from mllmd.engine.model_forward import forward_logits
from mllmd.engine.prefill_graph import ImageInputs, PrefillGraphRunner, prefill_image_bytes, token_buckets
from mllmd.engine.request import PLACEHOLDER, Req
from mllmd.engine.sampling import Sampler, SamplerOutput, SamplingStates
from mllmd.engine.sampling.sampler import TokenMask
from mllmd.engine.scheduler import ScheduledBatch
from mllmd.engine.state_pool import (
    SNAPSHOT_CHUNK,
    StatePool,
    StateStep,
    StepSnapshots,
    snapshot_inputs,
    takes_snapshots,
)
from mllmd.engine.vision_graph import VisionGraphs
from mllmd.engine.vision_graph import reserved_bytes as vision_graph_bytes
from mllmd.engine.vision_runner import VisionRunner, mrope_step_positions
from mllmd.models import get_model_class, load_hf_config
from mllmd.models.layers import plan_fusions
from mllmd.models.layers.gated_deltanet import HybridStep
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
    image_token_id: int | None = None  # vision-language models: the token an image's positions hold
    video_token_id: int | None = None  # and a video's (videos are not supported: refused in a prompt)
    spatial_merge_size: int = 2  # patches per image token along each side


def plan_step(batch: ForwardBatch, backend: AttentionBackend, states: StatePool | None) -> Any:
    """The step the model takes: the attention step, and for hybrid models the state pools' view."""
    attn = backend.plan(batch)
    if states is None:
        return attn
    assert batch.state_slots is not None
    return HybridStep(attn, StateStep(states, batch.is_decode, batch.state_slots, batch.extend_lens, batch.state_snapshots))


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
    text = getattr(hf_config, "text_config", None)  # a vision-language config keeps the decoder's facts there
    sources: list[Any] = [getattr(hf_config, "eos_token_id", None), getattr(text, "eos_token_id", None)]
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
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu" and config.cpu_threads:
            torch.set_num_threads(config.cpu_threads)
        hf_config = load_hf_config(config.model_path)
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
        # inference only: no parameter records autograd history, also where a module runs outside an
        # inference_mode step (the vision tower runs while a step is prepared; torch's nn.Linear and
        # nn.LayerNorm there made their parameters require grad, and every cached image kept its graph;
        # VisionRunner.encode relies on this)
        self.model.eval().requires_grad_(False)
        plan_fusions(self.model, kv_dtype=dtype)  # the KV pool holds the model's dtype
        text_config = getattr(hf_config, "text_config", hf_config)
        max_ctx = int(getattr(text_config, "max_position_embeddings", 32768))
        context_length = config.context_length or max_ctx
        if context_length > max_ctx:
            raise ValueError(f"model.context_length: {context_length} exceeds the model's limit of {max_ctx}")
        shape = self.model.attention_shape
        # Parameters are the stored weights (int8 / packed int4 + scales for quantized layers);
        # kernels keep derived copies (e.g. the CPU W4A16 dequantized weight) as buffers.
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.info = ModelInfo(
            hf_config=hf_config,
            dtype=dtype,
            device=self.device,
            vocab_size=self.model.vocab_size,
            context_length=context_length,
            eos_token_ids=read_eos_token_ids(config.model_path, hf_config),
            num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            weight_bytes=weight_bytes,
            quantization=quant_config.method if quant_config is not None else None,
            image_token_id=getattr(self.model, "image_token_id", None),
            video_token_id=getattr(hf_config, "video_token_id", None) if hasattr(self.model, "encode_images") else None,
            spatial_merge_size=int(getattr(getattr(hf_config, "vision_config", None), "spatial_merge_size", 2)),
        )
        self.vision: VisionRunner | None = None
        if hasattr(self.model, "encode_images"):
            from mllmd.multimodal.image_processing import VisionPreprocessConfig

            tower_graphs = (VisionGraphs(self.model.visual)
                            if self.device.type == "cuda" and not config.disable_cuda_graph else None)
            self.vision = VisionRunner(self.model, VisionPreprocessConfig.from_model_dir(config.model_path),
                                       EncoderCache(config.encoder_cache_mb << 20), self.device, tower_graphs)
        # hybrid models (Qwen3.5): the Gated DeltaNet layers' recurrent states, beside the KV pool
        self.state_layers = list(getattr(self.model, "state_layers", []))
        self.state_pool: StatePool | None = None
        self.max_total_tokens, state_slots = self._memory_plan()
        if self.state_layers:
            conv_shape, ssm_shape = self.state_layers[0].state_shapes
            self.state_pool = StatePool(state_slots, len(self.state_layers), conv_shape, ssm_shape, dtype, self.device)
            if state_slots < config.max_running_requests:  # each running request holds a slot of its own
                logger.info("max_running_requests %d -> %d: the recurrent-state slots that fit",
                            config.max_running_requests, state_slots)
                config = self.config = config.replace(max_running_requests=state_slots)
        self.req_to_token_pool = ReqToTokenPool(config.max_running_requests, context_length, self.device)
        self.allocator = TokenToKVPoolAllocator(self.max_total_tokens, self.device)
        # last sampled token of each request slot, written on the device by the sampler (overlap)
        self.token_buf = torch.zeros(config.max_running_requests, dtype=torch.int64, device=self.device)
        self.sampling = SamplingStates(config.max_running_requests, self.info.vocab_size, self.device)
        self.sampler = Sampler()
        self.kv_pool = KVPool(
            self.max_total_tokens, self.info.num_layers, self.info.num_kv_heads, self.info.head_dim, dtype, self.device
        )
        self.attn_backend = self._attention_backend(self.kv_pool, self.req_to_token_pool.req_to_token)
        self.graph_runner: CudaGraphRunner | None = None
        self.prefill_graphs: PrefillGraphRunner | None = None
        if self.device.type == "cuda" and not config.disable_cuda_graph:
            if self.attn_backend.supports_cuda_graph:
                if self._prefill_graph_tokens() and self.attn_backend.supports_prefill_graph:
                    self.prefill_graphs = PrefillGraphRunner(
                        self.model, self.attn_backend, self.token_buf, self._prefill_graph_tokens(),
                        self._graph_max_bs(), self._graph_plan(), state_slots=self.state_pool is not None,
                        images=self._graph_images(),
                    )
                # The decode graphs keep a pool of their own, as before the prefill graphs: sharing would
                # save only their few MB of intermediates, and batch-64 decode measured 2.6% slower on
                # the H200 in the tree where they shared (cause not isolated: docs/benchmarks.md)
                self.graph_runner = CudaGraphRunner(
                    self.model, self.attn_backend, self.token_buf, capture_batch_sizes(self._graph_max_bs()),
                    self._graph_plan(),
                )
            else:
                logger.info("%s cannot run in CUDA graphs: decode runs eagerly", type(self.attn_backend).__name__)
        if self.device.type == "cuda":
            self.warm_up()
        logger.info(
            "loaded %s (%s, %s, quantization %s) on %s: weights %.1f MB, KV pool %d tokens%s",
            config.model_path, type(self.model).__name__, dtype, self.info.quantization or "none", self.device,
            weight_bytes / 1e6, self.max_total_tokens,
            f", {state_slots} recurrent-state slots" if self.state_pool is not None else "",
        )

    _kv_budget_detail: str = ""  # the figures behind the CUDA KV budget, for the log and errors

    def state_slot_bytes(self) -> int:
        """Bytes of one request's recurrent state (0 for models without any)."""
        if not self.state_layers:
            return 0
        conv_shape, ssm_shape = self.state_layers[0].state_shapes
        return StatePool.bytes_per_slot(len(self.state_layers), conv_shape, ssm_shape, self.info.dtype)

    def _memory_plan(self) -> tuple[int, int]:
        """(KV tokens, recurrent-state slots): the configured sizes, else what the memory budget leaves
        (see _cuda_kv_budget). Hybrid models: by default twice max_running_requests state slots (the
        running requests' and as many prefix-cache snapshots), at most half of the budget, at least one."""
        cfg = self.config
        per_state = self.state_slot_bytes()
        states = cfg.state_slots or 0
        if cfg.max_total_tokens is not None and (states or not per_state):
            return cfg.max_total_tokens, states
        info = self.info
        per_token = KVPool.bytes_per_token(info.num_layers, info.num_kv_heads, info.head_dim, info.dtype)
        if self.device.type == "cuda":
            budget = self._cuda_kv_budget()
            cap = None
        else:
            budget = _mem_available_bytes() * cfg.mem_fraction_static - info.weight_bytes
            cap = cfg.cpu_kv_cache_max_tokens
        if per_state and not states:
            states = max(1, min(2 * cfg.max_running_requests, int(budget * 0.5 // per_state)))
        if cfg.max_total_tokens is not None:
            return cfg.max_total_tokens, states
        budget -= states * per_state
        tokens = int(budget // per_token)
        if cap is not None:
            tokens = min(tokens, cap)
        if tokens < 2:
            raise RuntimeError(
                f"not enough memory for the KV cache after the weights ({info.weight_bytes / 1e9:.2f} GB) and the "
                f"activations of the largest step: budget {budget / 1e6:.0f} MB; lower scheduler.max_prefill_tokens "
                f"or raise runtime.mem_fraction_static" + (f" ({self._kv_budget_detail})" if self._kv_budget_detail else "")
            )
        return tokens, states

    def _cuda_kv_budget(self) -> float:
        """Bytes for the KV pool on CUDA, from a profile of the largest step.

        The process may hold `mem_fraction_static` of the device memory; from that go the weights
        (already loaded), the measured peak activations of one step of max_prefill_tokens tokens,
        the sampler's workspace at max_running_requests rows, the decode CUDA graphs' outputs and the
        prefill graphs' pool (the measured peak of their largest step).
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
        # fp32 logits, a sort (values + int64 ids), noise; the slots' penalty state (SamplingStates)
        rows = self.config.max_running_requests
        sampler = rows * vocab * 32 + SamplingStates.state_bytes(rows, vocab)
        graphs = 0
        if not self.config.disable_cuda_graph:
            graphs = sum(capture_batch_sizes(self._graph_max_bs())) * vocab * 6 + (64 << 20)
            prefill_graph_tokens = self._prefill_graph_tokens()
            if prefill_graph_tokens:  # their pool holds the activations of the largest one, as profiled
                graphs += self.profile_step_bytes(token_buckets(prefill_graph_tokens)[-1])
                if (images := self._graph_images()) is not None:  # and a vision model's image buffers
                    graphs += prefill_image_bytes(images, token_buckets(prefill_graph_tokens)[-1])
            if self.vision is not None and self.vision.graphs is not None:  # the tower's, per repeated grid
                graphs += vision_graph_bytes(self.model.visual, self.model.visual.dtype, self.info.spatial_merge_size)
        budget = kv_budget_bytes(mem, self.config.mem_fraction_static, activations, sampler, graphs)
        self._kv_budget_detail = (
            f"KV budget {budget / 1e9:.2f} GB: device {mem.total / 1e9:.1f} GB x {self.config.mem_fraction_static:.2f} "
            f"(free now {mem.free / 1e9:.2f} GB), allocated before the pool (weights) {mem.weights / 1e9:.2f} GB, "
            f"step activations {activations / 1e9:.2f} GB, sampler {sampler / 1e9:.2f} GB, CUDA graphs {graphs / 1e9:.2f} GB"
        )
        logger.info("%s", self._kv_budget_detail)
        return budget

    def _attention_backend(self, kv_pool: KVPool, req_to_token: torch.Tensor) -> AttentionBackend:
        shape = self.model.attention_shape
        return create_attention_backend(
            self.config.attention_backend, self.device.type, kv_pool, req_to_token,
            device=self.device, num_qo_heads=shape.num_heads, scale=shape.head_dim**-0.5, dtype=self.info.dtype,
            head_dim=shape.head_dim,
        )

    def _graph_max_bs(self) -> int:
        return min(self.config.max_running_requests, self.config.cuda_graph_max_bs)

    def _prefill_graph_tokens(self) -> int:
        """The largest prefill / mixed step run as a CUDA graph (0: none; the backend must also support
        it: PrefillGraphRunner)."""
        return min(self.config.prefill_graph_max_tokens, self.config.max_prefill_tokens, self.info.context_length)

    def _graph_images(self) -> ImageInputs | None:
        """What the prefill graphs of a vision-language model take of its images (None: a text model)."""
        if self.vision is None:
            return None
        tower = self.model.visual.config
        return ImageInputs(tower.out_hidden_size, len(tower.deepstack_visual_indexes), self.info.dtype)

    def _plan(self, batch: ForwardBatch, backend: AttentionBackend | None = None, states: StatePool | None = None) -> Any:
        """The step the model takes: the attention step, and for hybrid models the state pools' view."""
        return plan_step(batch, backend or self.attn_backend, states or self.state_pool)

    def _graph_plan(self) -> Callable[[ForwardBatch], Any]:
        """`_plan` for the CUDA graph runners, holding the backend and state pool but not the runner:
        a bound method would make runner and graphs a reference cycle, and `del llm` would keep the
        KV pool on the device until Python's cycle collector happened to run."""
        return functools.partial(plan_step, backend=self.attn_backend, states=self.state_pool)

    def _scratch_batch(self, prefix_lens: list[int], extend_lens: list[int]) -> tuple[ForwardBatch, Any]:
        """A batch over a private KV pool, request table (and state pool) with random tokens, and its step:
        for profiling and warm-up. Row i extends prefix_lens[i] cached tokens by extend_lens[i] new
        ones; every row samples."""
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
        )
        states = None
        if self.state_layers:
            conv_shape, ssm_shape = self.state_layers[0].state_shapes
            states = StatePool(len(seq), len(self.state_layers), conv_shape, ssm_shape, info.dtype, dev)
            batch.state_slots = torch.arange(1, len(seq) + 1, dtype=torch.int64, device=dev)
        return batch, self._plan(batch, self._attention_backend(pool, table.req_to_token), states)

    @torch.inference_mode()
    def profile_step_bytes(self, tokens: int | None = None) -> int:
        """Peak bytes a forward of one prompt of `tokens` tokens (default: the largest step) allocates
        beyond the weights (CUDA only)."""
        dev = self.device
        n = tokens or max(1, min(self.config.max_prefill_tokens, self.info.context_length))
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        batch, step = self._scratch_batch([0], [n])
        forward_logits(self.model, batch, step)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del batch, step
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
            forward_logits(self.model, *self._scratch_batch(prefix, extend))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def prepare(self, sched: ScheduledBatch) -> ForwardBatch:
        """Gather the step's flat inputs from the scheduled requests and write its KV slots into the
        request table: a step that a CUDA graph runs is staged into the graph's own inputs
        (CudaGraphRunner.stage for decodes, PrefillGraphRunner.stage for prefill and mixed steps: the
        table write and the in-flight tokens happen inside the graph); any other step takes one staged
        host-to-device copy, a scatter into the table and, for in-flight tokens, a gather from the
        token buffer."""
        input_ids: list[int] = []
        columns: list[int] = []  # each token's index in its request (its request-table column)
        positions: list[int] = []  # where the model rotates it: the index, but for M-RoPE prompts with images
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        fill_rows: list[int] = []  # overlap: input positions whose token is still on the device
        fill_slots: list[int] = []
        prompt_rows: list[int] = []  # prompt logprobs: rows after the sampling rows in logits_indices
        prompt_spans: list[tuple[Req, int, int]] = []
        for req, p, n in zip(sched.reqs, sched.prefix_lens, sched.extend_lens):
            start = len(input_ids)
            if req.params.prompt_logprobs and p < len(req.prompt_ids) - 1:
                # position j's logits give prompt token j + 1's logprob; the last prompt position's are
                # the sampling row's
                end = min(p + n, len(req.prompt_ids) - 1)
                prompt_rows += range(start, start + end - p)
                prompt_spans.append((req, p, end - p))
            input_ids += req.token_ids[p : p + n]
            columns += range(p, p + n)
            positions += range(p + req.mrope_delta, p + n + req.mrope_delta) if req.mrope_delta else range(p, p + n)
            seq_lens.append(p + n)
            if p + n == len(req.token_ids):
                logits_rows.append(len(input_ids) - 1)
            assert req.req_pool_idx is not None, "a scheduled request holds a request slot"
            if input_ids[-1] == PLACEHOLDER:
                fill_rows.append(len(input_ids) - 1)
                fill_slots.append(req.req_pool_idx)
            assert PLACEHOLDER not in input_ids[start:-1], "only a request's last token can be in flight"
        rows = [r.req_pool_idx for r in sched.reqs if r.req_pool_idx is not None]
        logits_rows += prompt_rows
        gr = self.graph_runner
        if (
            gr is not None
            and len(input_ids) == len(sched.reqs) == len(logits_rows)  # decodes, every row samples
            and gr.size_for(len(input_ids)) is not None
        ):
            fill = [int(t == PLACEHOLDER) for t in input_ids]
            ids = [0 if f else t for t, f in zip(input_ids, fill)]
            rope = positions if self.vision is not None else None
            states = [r.state_slot or 0 for r in sched.reqs] if self.state_pool is not None else None
            return gr.stage(ids, columns, rows, seq_lens, fill, sched.out_cache_loc, list(sched.prefix_lens), rope,
                            states)
        # a token's request-table entry is (its request row, its index)
        token_rows = [r for r, n in zip(rows, sched.extend_lens) for _ in range(n)]
        axes = images = None
        if self.vision is not None:  # M-RoPE: three axes where the step has image (or earlier) prompt tokens
            axes = mrope_step_positions(sched.reqs, sched.prefix_lens, sched.extend_lens)
            images = self.vision.step_embeds(sched.reqs, sched.prefix_lens, sched.extend_lens)
        snapshots = sched.snapshots if takes_snapshots(list(sched.prefix_lens), sched.snapshots) else None
        pg = self.prefill_graphs
        shape = self.model.attention_shape
        # Hybrid models keep the graph: an eager step pays the host for every layer, and the dense route
        # it would take speeds up only their few attention layers (Qwen3.5's first token by routing:
        # docs/benchmarks.md)
        if (pg is not None and not prompt_spans
                and (self.state_pool is not None
                     or not self.attn_backend.prefers_eager(list(sched.prefix_lens), list(sched.extend_lens),
                                                            shape.num_heads, shape.head_dim))):  # fmt: skip
            fill = [int(t == PLACEHOLDER) for t in input_ids]
            ids = [0 if f else t for t, f in zip(input_ids, fill)]
            states = [r.state_slot or 0 for r in sched.reqs] if self.state_pool is not None else None
            staged_batch = pg.stage(ids, columns, positions, token_rows, fill, rows, seq_lens, list(sched.prefix_lens),
                                    list(sched.extend_lens), logits_rows, sched.out_cache_loc, states, axes, images,
                                    snapshots=snapshots)
            if staged_batch is not None:
                return staged_batch
        # ids, positions, request rows, seq_lens, extend_lens, logits rows, fills, each token's request row,
        # table columns: one copy
        staged = [input_ids, positions, rows, seq_lens, sched.extend_lens, logits_rows, fill_rows, fill_slots, token_rows]
        if self.state_pool is not None:
            staged.append([r.state_slot or 0 for r in sched.reqs])
        snap_columns = 0
        if snapshots is not None:  # hybrid models: prefix-cache snapshots the step's forward takes
            snap_columns = max(n // SNAPSHOT_CHUNK for n in sched.extend_lens)
            staged += snapshot_inputs(list(sched.prefix_lens), list(sched.extend_lens), snapshots, snap_columns)
        if self.vision is not None:  # positions may differ from the columns (M-RoPE)
            if axes is not None:
                staged[1] = axes  # [3, T], flat
            staged.append(columns)
        parts = to_device_parts(staged, torch.int64, self.device)
        step_snapshots = None
        if snap_columns:
            table, ends, snap_slots = parts[10:13]
            step_snapshots = StepSnapshots(table.view(len(sched.reqs), snap_columns), ends, snap_slots)
        self.req_to_token_pool.req_to_token[parts[8], parts[-1] if self.vision is not None else parts[1]] = sched.out_cache_loc
        if fill_rows:  # gather the in-flight tokens from the device-side per-request buffer
            parts[0][parts[6]] = self.token_buf[parts[7]]
        batch = ForwardBatch(
            input_ids=parts[0],
            positions=parts[1] if len(staged[1]) == len(input_ids) else parts[1].view(3, -1),
            out_cache_loc=sched.out_cache_loc,
            req_pool_indices=parts[2],
            seq_lens=parts[3],
            extend_lens=parts[4],
            logits_indices=parts[5],
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=list(sched.prefix_lens),
            extend_lens_cpu=list(sched.extend_lens),
            images=images,
            state_slots=parts[9] if self.state_pool is not None else None,
            state_snapshots=step_snapshots,
            prompt_spans=prompt_spans,
        )
        return batch

    @torch.inference_mode()
    def sample(self, reqs: list[Req], logits: torch.Tensor, rows: torch.Tensor | None, keep_on_device: bool,
               token_mask: TokenMask | None = None) -> SamplerOutput:
        """The next token of each of `reqs` (row i of logits [B, V] is reqs[i]'s). Each request's
        sampling row is written into its slot's state when it first samples there; the batch then
        reads those rows (`rows`: the slots on the device, if they are already). With `keep_on_device`
        (overlap) each token also lands in the slot's entry of the token buffer, where the next step
        reads tokens still on their way to the host. `token_mask`: the grammar-constrained rows' allowed
        tokens (Sampler)."""
        states = self.sampling
        slots: list[int] = []
        for r in reqs:
            slot = r.req_pool_idx
            assert slot is not None, "a sampling request holds a request slot"
            if states.owner[slot] is not r:
                states.write(slot, r.params, r.seed, r.prompt_ids, r.output_ids, owner=r)
            slots.append(slot)
        info = states.batch(slots, [r.num_output for r in reqs], rows)
        penalised = states.penalised_np[slots]
        if rows is None and (keep_on_device or penalised.any()):
            rows = to_device(slots, torch.int64, self.device)
        # (rows is set above whenever keep_on_device; the test on it tells the type checker so)
        sink = (self.token_buf, rows) if keep_on_device and rows is not None else None
        # the step's logits are read no more once sampled (prompt logprobs were taken before)
        out = self.sampler(logits, info, token_sink=sink, token_mask=token_mask, inplace=True)
        if rows is not None:
            states.record(rows, out.next_token_ids, penalised)
        return out

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the model; float32 logits [N, V] for the rows that sample (empty if none).

        Batches that prepare() staged replay the CUDA graph of their size (padded up): decode graphs
        by batch size, prefill graphs by tokens and rows."""
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.run(batch)
        if batch.prefill_graph is not None:
            assert self.prefill_graphs is not None
            return self.prefill_graphs.run(batch)
        return self.forward_eager(batch)

    @torch.inference_mode()
    def forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        """forward() without graphs: the step's attention planned, then the model."""
        return forward_logits(self.model, batch, self._plan(batch))
