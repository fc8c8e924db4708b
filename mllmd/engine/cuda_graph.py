"""CUDA graphs for decode steps: capture once per batch size, pad each step to the next captured size.

A decode step of B requests runs the graph captured for the smallest size S >= B. Each graph reads its
inputs from a static buffer of its own, int64 [6, S], rows: token ids, positions, KV slots, request
rows, sequence lengths and "fill" flags. `stage` fills it with one host-to-device copy of everything
the host knows (the padding rows included) and one device-to-device copy of the KV slots (which the
allocator keeps on the device). The graph's first kernel (mllmd_kernels.decode_inputs) then takes each
flagged row's token from the engine's device-side token buffer (overlap: the previous step's token is
still on the device) and writes each real row's KV slot into the request table, so that between two
steps the device runs only the sampler, the copy of the tokens to the host and these two copies.
Rows B..S-1 are padding: token 0 at position 0, writing its K/V to the reserved pool slot 0 and
attending over one token of request row 0 (reads only), so they change nothing another request can
see. Logits of all S rows come out of the graph; the step uses the first B.

The runner is handed what it uses (the model, the attention backend, the engine's token buffer),
never the model runner. Attention backends whose per-step metadata depends only on shapes (the
Triton backend: the split count is a function of the batch size) need nothing at replay; a backend's
`prepare_replay` refreshes device-side metadata before each replay where it must.
"""

from __future__ import annotations

import bisect
import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch
from mllmd_kernels import decode_inputs, pdl_launches
from mllmd_kernels._triton import use_triton

from mllmd.engine.attention import AttentionBackend
from mllmd.engine.forward_batch import ForwardBatch
from mllmd.engine.model_forward import forward_logits

logger = logging.getLogger(__name__)

# rows of a graph's static inputs
# POSITIONS: each row's token index (its request-table column); ROPE: the position the model rotates it
# by (the same, but for M-RoPE prompts with images: index + the request's delta)
IDS, POSITIONS, LOCS, ROWS, SEQ_LENS, FILL, ROPE, STATE = range(8)  # STATE: hybrid models' state slots
NUM_INPUT_ROWS = 8


def host_inputs(
    input_ids: list[int], positions: list[int], req_pool_indices: list[int], seq_lens: list[int], fill: list[int], size: int,
    rope_positions: list[int] | None = None, state_slots: list[int] | None = None,
) -> list[int]:
    """A graph's [NUM_INPUT_ROWS, size] inputs, flat, for B real rows: padding rows are token 0 at
    position 0 of request row 0, one token long; every KV slot is 0 (the real ones are copied in from
    the device afterwards)."""
    pad = [0] * (size - len(input_ids))
    rope = positions if rope_positions is None else rope_positions
    states = state_slots if state_slots is not None else [0] * len(input_ids)  # padding: the dummy slot 0
    return [
        *input_ids, *pad, *positions, *pad, *[0] * size, *req_pool_indices, *pad, *seq_lens, *[1] * len(pad),
        *fill, *pad, *rope, *pad, *states, *pad,
    ]  # fmt: skip


def complete_inputs_eagerly(buf: torch.Tensor, bs: int, token_buf: torch.Tensor, req_to_token: torch.Tensor) -> None:
    """mllmd_kernels.decode_inputs with torch ops, for CUDA without Triton (before the replay): the B
    real rows only, and no host synchronisation (no boolean indexing)."""
    rows = buf[ROWS, :bs]
    buf[IDS, :bs] = torch.where(buf[FILL, :bs] != 0, token_buf[rows], buf[IDS, :bs])
    req_to_token[rows, buf[POSITIONS, :bs]] = buf[LOCS, :bs]


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1-4, 6, 8, every 4 to 32, every 8 to 64, every 16 to 256 (then max_bs): a padded step computes at
    most a third more rows than it needs (9 rows run as 12), and at most a quarter from 32 rows on."""
    sizes = [1, 2, 3, 4, 6, 8] + list(range(12, 33, 4)) + list(range(40, 65, 8)) + list(range(80, 257, 16))
    out = [s for s in sizes if s < max_bs]
    return out + [max_bs]


class StepGraph(Protocol):
    """A recorded step: `capture(run)` records `run` once and returns its output tensor; each
    `replay()` reruns it on the same memory (the output tensor is refreshed in place). `pool`: the
    memory pool the next capture may share (None where there is none)."""

    pool: Any

    def capture(self, run: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> None: ...


class CudaStepGraph:
    """A CUDA graph over a shared memory pool: `run` is warmed up twice on `stream` (Triton compiles,
    cuBLAS picks its algorithms), then captured. Every buffer `run` allocates comes from the pool,
    its metadata included: a buffer left over from the warm-up would go back to the caching allocator
    and every replay would write into whatever reused it."""

    def __init__(self, stream: torch.cuda.Stream, pool: Any) -> None:
        self.stream, self.pool = stream, pool
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                run()
        self.stream.synchronize()
        with torch.cuda.graph(self.graph, pool=self.pool, stream=self.stream):
            out = run()
        self.pool = self.graph.pool()
        return out

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphRunner:
    """Captures decode for each size in `batch_sizes`; `run(batch)` replays the fitting one."""

    def __init__(
        self, model: Any, backend: AttentionBackend, token_buf: torch.Tensor, batch_sizes: list[int],
        plan: Callable[[ForwardBatch], Any] | None = None,
    ) -> None:  # fmt: skip
        """`token_buf` [R] int64: each request row's last sampled token (the engine's, on the device);
        `plan(batch)`: the step the model takes (default: the backend's attention step)."""
        self.model = model
        self.backend = backend
        self.plan = plan or backend.plan
        self.token_buf = token_buf
        self.req_to_token = backend.req_to_token
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        self.device = dev = token_buf.device
        n = self.max_bs
        i64 = torch.int64
        # per size S: rows input_ids, positions, out_cache_loc, req_pool_indices, seq_lens, fill
        self.inputs = {s: torch.zeros((NUM_INPUT_ROWS, s), dtype=i64, device=dev) for s in self.batch_sizes}
        for buf in self.inputs.values():
            buf[SEQ_LENS].fill_(1)
        # Without Triton the two input fixes run eagerly before the replay (torch ops, see stage).
        self.fused_inputs = use_triton(self.inputs[n])
        self.ones = torch.ones(n, dtype=i64, device=dev)
        self.arange = torch.arange(n, dtype=i64, device=dev)
        self.graphs: dict[int, CudaStepGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.steps: dict[int, Any] = {}  # each graph's model step, as captured
        self.pool: Any = None  # the graphs' memory pool, made by the first capture
        self._capture_all()

    def _batch(self, size: int, bs: int | None = None) -> ForwardBatch:
        """The first `bs` rows (default all) of size `size`'s static inputs, as a decode batch."""
        s = self.inputs[size]
        bs = size if bs is None else bs
        return ForwardBatch(
            input_ids=s[IDS, :bs],
            positions=s[ROPE, :bs],
            out_cache_loc=s[LOCS, :bs],
            req_pool_indices=s[ROWS, :bs],
            seq_lens=s[SEQ_LENS, :bs],
            extend_lens=self.ones[:bs],
            logits_indices=self.arange[:bs],
            seq_lens_cpu=[1] * bs,
            prefix_lens_cpu=[0] * bs,
            extend_lens_cpu=[1] * bs,
            graph_size=size,
            state_slots=s[STATE, :bs],
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream())
        # The static inputs hold zeros here (no fill, slot 0): the warm-up and capture runs write no
        # table entry and no request's KV.
        with pdl_launches():  # on sm90: kernels overlap their start with the previous kernel's tail
            for bs in reversed(self.batch_sizes):  # largest first: smaller graphs reuse its pool memory
                graph = CudaStepGraph(stream, self.pool)
                self.logits[bs] = graph.capture(functools.partial(self._step, bs))
                self.pool = graph.pool
                self.graphs[bs] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize(self.device)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.batch_sizes)

    def _step(self, size: int) -> torch.Tensor:
        """What a graph runs: complete the inputs (fused), then the decode forward of all `size` rows."""
        batch = self._batch(size)
        step = self.steps[size] = self.plan(batch)
        if self.fused_inputs:
            s = self.inputs[size]
            decode_inputs(s[IDS], s[POSITIONS], s[LOCS], s[ROWS], s[FILL], self.token_buf, self.req_to_token)
        return forward_logits(self.model, batch, step)

    def size_for(self, bs: int) -> int | None:
        """The captured size that runs `bs` rows, or None when none does."""
        if not 0 < bs <= self.max_bs:
            return None
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]

    def can_run(self, batch: ForwardBatch) -> bool:
        """Whether `batch` was staged here (decodes of a captured size whose every row samples: the
        graph's logits are all its rows'); any other batch runs eagerly."""
        return batch.graph_size > 0

    def stage(
        self,
        input_ids: list[int],  # a row's token, or anything where fill is set
        positions: list[int],
        req_pool_indices: list[int],
        seq_lens: list[int],
        fill: list[int],  # 1: the row's token is the token buffer's entry of its request row
        out_cache_loc: torch.Tensor,  # [B] int64 on the device
        prefix_lens: list[int],
        rope_positions: list[int] | None = None,  # where they differ from `positions` (M-RoPE)
        state_slots: list[int] | None = None,  # hybrid models
    ) -> ForwardBatch:
        """Write a decode step of B rows (every row samples) into the inputs of the graph that runs it:
        one host-to-device copy (padding included) and one copy of the KV slots. The returned batch's
        tensors are views of those inputs, valid until the next stage of the same size."""
        bs = len(input_ids)
        size = self.size_for(bs)
        assert size is not None, f"no decode graph for {bs} rows"
        host = host_inputs(input_ids, positions, req_pool_indices, seq_lens, fill, size, rope_positions, state_slots)
        buf = self.inputs[size]
        buf.copy_(torch.tensor(host, dtype=torch.int64, pin_memory=True).view(NUM_INPUT_ROWS, size), non_blocking=True)
        buf[LOCS, :bs].copy_(out_cache_loc)
        batch = self._batch(size, bs)
        batch.seq_lens_cpu = list(seq_lens)
        batch.prefix_lens_cpu = list(prefix_lens)
        if not self.fused_inputs:
            complete_inputs_eagerly(buf, bs, self.token_buf, self.req_to_token)
        return batch

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, V] float32 of a staged decode batch, by graph replay."""
        size = batch.graph_size
        assert size > 0, "only a batch from stage() replays a graph"
        step = self.steps[size]
        self.backend.prepare_replay(getattr(step, "attention", step))
        self.graphs[size].replay()
        return self.logits[size][: batch.batch_size]
