"""CUDA graphs for decode steps: capture once per batch size, pad each step to the next captured size.

A decode step of B requests runs the graph captured for the smallest size S >= B. The graph reads
its inputs from static buffers (token ids, positions, KV slots, request rows, sequence lengths) that
the step fills with one device-to-device copy; rows B..S-1 are padding: token 0 at position 0,
writing its K/V to the reserved pool slot 0 and attending over one token of request row 0 (reads
only), so they change nothing another request can see. Logits of all S rows come out of the graph;
the step uses the first B.

Attention backends whose per-step metadata depends only on shapes (the Triton backend: the split
count is a function of the batch size) need nothing at replay; a backend may define
`prepare_replay(batch)` to refresh device-side metadata before each replay.
"""

from __future__ import annotations

import bisect
import logging
import weakref
from typing import TYPE_CHECKING

import torch
from mllmd_kernels import pdl_launches

from mllmd.engine.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from mllmd.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1-4, 6, 8, every 4 to 32, every 8 to 64, every 16 to 256 (then max_bs): a padded step computes at
    most a third more rows than it needs (9 rows run as 12), and at most a quarter from 32 rows on."""
    sizes = [1, 2, 3, 4, 6, 8] + list(range(12, 33, 4)) + list(range(40, 65, 8)) + list(range(80, 257, 16))
    out = [s for s in sizes if s < max_bs]
    return out + [max_bs]


class CudaGraphRunner:
    """Captures decode for each size in `batch_sizes`; `run(batch)` replays the fitting one."""

    def __init__(self, runner: ModelRunner, batch_sizes: list[int]) -> None:
        # A weak reference: the runner owns this object, and a cycle would keep the model, the KV pool
        # and the graphs' memory alive after the engine is dropped, until the garbage collector ran.
        self.runner = weakref.proxy(runner)
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        dev = runner.device
        n = self.max_bs
        i64 = {"dtype": torch.int64, "device": dev}
        # one static buffer, rows: input_ids, positions, out_cache_loc, req_pool_indices, seq_lens
        self.static = torch.zeros((5, n), **i64)
        self.static[4].fill_(1)
        self.ones = torch.ones(n, **i64)
        self.arange = torch.arange(n, **i64)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        self._capture_all()

    def _batch(self, bs: int) -> ForwardBatch:
        r = self.runner
        s = self.static
        return ForwardBatch(
            input_ids=s[0, :bs],
            positions=s[1, :bs],
            out_cache_loc=s[2, :bs],
            req_pool_indices=s[3, :bs],
            seq_lens=s[4, :bs],
            extend_lens=self.ones[:bs],
            logits_indices=self.arange[:bs],
            seq_lens_cpu=[1] * bs,
            prefix_lens_cpu=[0] * bs,
            extend_lens_cpu=[1] * bs,
            req_to_token_pool=r.req_to_token_pool,
            kv_pool=r.kv_pool,
            attn_backend=r.attn_backend,
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        stream = torch.cuda.Stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream())
        with pdl_launches():  # on sm90: kernels overlap their start with the previous kernel's tail
            self._capture_on(stream)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize(self.runner.device)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.batch_sizes)

    def _capture_on(self, stream: torch.cuda.Stream) -> None:
        for bs in reversed(self.batch_sizes):  # largest first: smaller graphs reuse its pool memory
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: Triton compiles, cuBLAS picks its algorithms
                    self.runner.forward_eager(self._decode_batch(bs))
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                # Metadata is built inside the capture: every buffer the graph touches (the attention
                # backend's split-KV scratch included) must come from the graph's private pool. A
                # buffer left over from the warm-up would go back to the caching allocator when the
                # warm-up batch dies, and every replay would then write into whatever reused it.
                self.logits[bs] = self.runner.forward_eager(self._decode_batch(bs))
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph

    def _decode_batch(self, bs: int) -> ForwardBatch:
        batch = self._batch(bs)
        self.runner.attn_backend.init_forward_metadata(batch)
        return batch

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.is_decode and 0 < batch.batch_size <= self.max_bs

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, V] float32 of a decode batch, by graph replay."""
        bs = batch.batch_size
        size = self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]
        s = self.static
        if bs < size:  # padding rows (see the module docstring)
            s[:, bs:size].zero_()
            s[4, bs:size].fill_(1)
        torch.stack(
            [batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_pool_indices, batch.seq_lens],
            out=s[:, :bs],
        )
        prepare = getattr(self.runner.attn_backend, "prepare_replay", None)
        if prepare is not None:
            prepare(self._batch(size))
        self.graphs[size].replay()
        return self.logits[size][:bs]
