"""CUDA graphs for prefill and mixed (prefill + decode) steps of up to `prefill_graph_max_tokens` tokens.

An eager step of a short prompt is bound by the host: a Qwen3-8B step launches about 400 kernels,
which take longer to issue than the GPU takes to run them. A step of N tokens over B rows (prefill
chunks and decodes, mixed) instead replays the graph captured for the smallest token bucket T >= N
and row bucket R >= B.

Padding: tokens N..T-1 are token 0 with KV slot 0 (the pool's reserved slot), in no row: every op of
the model but attention is per token, so their activations are computed and dropped, and attention
runs per row. Rows B..R-1 extend nothing (extend length 0: the attention kernel's tiles for them exit
at once). The attention kernel's grid is fixed at capture by T (tiles past a row's extend length
exit), so no host value changes between replays. Inputs are staged as for the decode graphs: one
host-to-device copy and one copy of the KV slots; the graph's first kernel (decode_inputs) fills the
tokens still on the device and writes each new token's KV slot into the request table (slot 0, the
padding, writes nothing).

A graph ends with the final hidden states of the R logits rows (rows past the step's sampling rows
read token 0); the lm_head runs after the replay on the step's real rows only, so no graph holds a
[R, vocab] output. The graphs draw on one memory pool (not the decode graphs'), captured largest
first, so their memory is about that of the largest step.

Hybrid models (Qwen3.5) pass each row's recurrent-state slot: the Gated DeltaNet prefill kernels take
the rows from cu_seqlens (built in the graph from the extend lengths), so a padding row is a sequence
of no tokens in the dummy slot 0, and padding tokens, past the last sequence, write only their own
outputs.

Vision-language models (`ImageInputs`): every graph takes 3-axis M-RoPE positions (a text token's
three axes are equal, which rotates it exactly as one axis does) and the step's image embeddings laid
over all T tokens (DenseImageEmbeds: a mask, the embeddings, the deepstack rows, zeros elsewhere), in
buffers the graphs share; `stage` scatters the step's image rows into them on the device. So a prompt
with images, a chunk that ends inside an image and text after images all replay graphs. Not for
prompt logprobs, nor for attention backends that do not plan from device tensors
(`supports_prefill_graph`): those steps run eagerly.

Fresh rows: where the backend has a faster route for one row with no prefix (`fresh_route_pays`: the
Triton backend's SDPA over the row's own K/V, from 1,024 tokens at head_dim 256 and 2,048 x 32 heads
at 128), a second graph of that bucket is captured on it, and only a one-row step with no cached
prefix replays it; every other step's graph attends through the paged kernel, prefix and all.
"""

from __future__ import annotations

import bisect
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from mllmd_kernels import decode_inputs

from mllmd.engine.attention import AttentionBackend
from mllmd.engine.cuda_graph import CudaStepGraph, StepGraph
from mllmd.engine.forward_batch import ForwardBatch
from mllmd.engine.model_forward import forward_hidden
from mllmd.engine.state_pool import SNAPSHOT_CHUNK, StepSnapshots, snapshot_inputs
from mllmd.models.multimodal import DenseImageEmbeds, ImageEmbeds

logger = logging.getLogger(__name__)

# per-token rows of a graph's static inputs: input ids, request-table column, KV slot, request row, fill
# flag (1: the token is the token buffer's entry of its request row), then the RoPE position (the
# column, or column + the request's M-RoPE delta), one row per M-RoPE axis (t, h, w) where there are three
IDS, COLUMNS, LOCS, TOKEN_ROWS, FILL, ROPE = range(6)
# per-row rows: request row, sequence length after the step, extend length, logits row (a token index),
# recurrent-state slot (hybrid models; padding rows: the state pool's dummy slot 0)
ROWS, SEQ_LENS, EXTEND_LENS, LOGIT_ROWS, STATE = range(5)
NUM_ROW_FIELDS = 5

_TOKEN_BUCKETS = [16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]

GraphKey = tuple[int, int, bool]  # (token bucket, row bucket, fresh: one row without a prefix, on its own route)


@dataclass(frozen=True)
class ImageInputs:
    """What a vision-language model's graphs take besides tokens: image embeddings of `hidden` columns
    in `dtype`, with `deepstack` more tensors of them (Qwen3-VL's; 0 for Qwen3.5)."""

    hidden: int
    deepstack: int
    dtype: torch.dtype


def prefill_image_bytes(images: ImageInputs, max_tokens: int) -> int:
    """Device memory of the image buffers the graphs of steps up to `max_tokens` tokens share."""
    size = torch.empty((), dtype=images.dtype).element_size()
    return max_tokens * (1 + (1 + images.deepstack) * images.hidden * size)


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, 96, 128, 192, 256, 384, 512, ... below `max_tokens`, then `max_tokens` rounded up to
    a multiple of 16: a step computes at most twice its tokens below 64 (where a step costs the same
    at any count: the weights are read once), and at most half again as many from 64 up."""
    if max_tokens <= 0:
        return []
    last = -(-max_tokens // 16) * 16  # each per-token field of the flat inputs starts 16-byte aligned
    return [t for t in _TOKEN_BUCKETS if t < last] + [last]


def row_buckets(max_rows: int) -> list[int]:
    """1, 4, 16, 64, 256, ... below `max_rows`, then `max_rows`: padded rows cost an attention tile that
    exits at once and a logits row, so few buckets do."""
    out = [r for r in (1, 4, 16, 64, 256, 1024) if r < max_rows]
    return out + [max_rows]


class PrefillGraphRunner:
    """Captures a step for each (token bucket, row bucket); `stage` writes a step into the fitting
    graph's inputs and `run` replays it."""

    def __init__(
        self, model: Any, backend: AttentionBackend, token_buf: torch.Tensor, max_tokens: int, max_rows: int,
        plan: Callable[[ForwardBatch], Any] | None = None, new_graph: Callable[[Any], StepGraph] | None = None,
        state_slots: bool = False, images: ImageInputs | None = None,
    ) -> None:  # fmt: skip
        """`token_buf` [R] int64: each request row's last sampled token (the engine's, on the device);
        `plan(batch)`: the step the model takes (default: the backend's attention step); `state_slots`:
        batches carry each row's recurrent-state slot (hybrid models); `images`: the model takes
        image embeddings and 3-axis positions (vision-language models);
        `new_graph(pool)`: a StepGraph drawing on `pool` (default: CudaStepGraph on a side stream;
        tests inject one that reruns the step eagerly)."""
        self.model = model
        self.plan = plan or backend.plan
        self.with_state_slots = state_slots
        self.token_buf = token_buf
        self.req_to_token = backend.req_to_token
        self.device = dev = token_buf.device
        self.token_sizes = token_buckets(max_tokens)
        self.row_sizes = row_buckets(max_rows)
        # (tokens, rows) with rows <= tokens: a row holds at least one token; graphs of one fresh row too
        # where the backend's route for it differs (they share the inputs of their (tokens, 1) bucket)
        self.keys = [(t, r) for t in self.token_sizes for r in self.row_sizes if r <= t]
        shape = model.attention_shape
        fresh = [(t, 1, True) for t in self.token_sizes if backend.fresh_route_pays(t, shape.num_heads, shape.head_dim)]
        self.graph_keys: list[GraphKey] = [(t, r, False) for t, r in self.keys] + fresh
        self.axes = 3 if images is not None else 1  # RoPE position rows
        self.token_fields = ROPE + self.axes
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        for t, r in self.keys:
            self.inputs[(t, r)] = torch.zeros(self.token_fields * t + NUM_ROW_FIELDS * _padded(r)
                                              + self._snapshot_fields(t, r), dtype=torch.int64, device=dev)
        # image embeddings over the largest step's tokens, shared by the graphs (which replay one at a
        # time); rows [0, image_dirty) may hold the last image step's mask and deepstack rows
        self.images = images
        self.image_dirty = 0
        if images is not None:
            t_max = self.token_sizes[-1]
            self.image_mask = torch.zeros(t_max, dtype=torch.bool, device=dev)
            self.image_embeds = torch.zeros((t_max, images.hidden), dtype=images.dtype, device=dev)
            self.image_deepstack = [torch.zeros_like(self.image_embeds) for _ in range(images.deepstack)]
        self.hidden: dict[GraphKey, torch.Tensor] = {}
        self.graphs: dict[GraphKey, StepGraph] = {}
        self.pool: Any = None
        stream = None
        if new_graph is None:
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            new_graph = lambda pool: CudaStepGraph(stream, pool)  # noqa: E731
        start = time.perf_counter()
        with torch.inference_mode():
            for key in sorted(self.graph_keys, reverse=True):  # largest first: the smaller steps reuse its memory
                graph = new_graph(self.pool)
                self.hidden[key] = graph.capture(functools.partial(self._step, key))
                self.pool = graph.pool
                self.graphs[key] = graph
        if stream is not None:
            torch.cuda.current_stream(dev).wait_stream(stream)
            torch.cuda.synchronize(dev)
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d prefill CUDA graphs (tokens %s x rows %s, %d of one fresh row) in %.1f s",
                    len(self.graph_keys), self.token_sizes, self.row_sizes, len(fresh), self.capture_seconds)

    def _snapshot_fields(self, t: int, r: int) -> int:
        """Hybrid models: a graph's inputs end with the prefix-cache snapshots its step takes (at most
        one a whole chunk of its tokens: T / 64): a [R, T / 64] table, then the snapshots' token
        indices and slots (StepSnapshots); none for graphs of fewer than 64 tokens."""
        c = t // SNAPSHOT_CHUNK if self.with_state_slots else 0
        return _padded(r * c) + 2 * _padded(c) if c else 0

    def _views(self, key: GraphKey) -> tuple[torch.Tensor, torch.Tensor]:
        """A graph's static inputs as [token_fields, T] and [NUM_ROW_FIELDS, R]."""
        t, r, _ = key
        flat = self.inputs[(t, r)]
        split = self.token_fields * t
        rows = flat[split : split + NUM_ROW_FIELDS * _padded(r)].view(NUM_ROW_FIELDS, _padded(r))[:, :r]
        return flat[:split].view(self.token_fields, t), rows

    def _snapshot_views(self, key: GraphKey) -> StepSnapshots | None:
        t, r, _ = key
        if not self._snapshot_fields(t, r):
            return None
        c = t // SNAPSHOT_CHUNK
        flat = self.inputs[(t, r)][self.token_fields * t + NUM_ROW_FIELDS * _padded(r) :]
        ends_at = _padded(r * c)
        return StepSnapshots(flat[: r * c].view(r, c), flat[ends_at : ends_at + c],
                             flat[ends_at + _padded(c) : ends_at + _padded(c) + c])  # fmt: skip

    def _batch(self, key: GraphKey, num_tokens: int, num_rows: int, num_logits: int) -> ForwardBatch:
        """The first tokens, rows and logits rows of a graph's static inputs, as a batch; the host
        lengths are the captured step's (one row of all T tokens) until `stage` sets the real ones."""
        t, r, _ = key
        tok, rows = self._views(key)
        images = None
        if self.images is not None:
            images = DenseImageEmbeds(self.image_mask[:num_tokens], self.image_embeds[:num_tokens],
                                      [d[:num_tokens] for d in self.image_deepstack])  # fmt: skip
        return ForwardBatch(
            input_ids=tok[IDS, :num_tokens],
            positions=tok[ROPE, :num_tokens] if self.axes == 1 else tok[ROPE:, :num_tokens],
            out_cache_loc=tok[LOCS, :num_tokens],
            req_pool_indices=rows[ROWS, :num_rows],
            seq_lens=rows[SEQ_LENS, :num_rows],
            extend_lens=rows[EXTEND_LENS, :num_rows],
            logits_indices=rows[LOGIT_ROWS, :num_logits],
            seq_lens_cpu=[t] + [0] * (r - 1),
            prefix_lens_cpu=[0] * r,
            extend_lens_cpu=[t] + [0] * (r - 1),  # the attention grid covers T queries per row
            state_slots=rows[STATE, :num_rows] if self.with_state_slots else None,
            state_snapshots=self._snapshot_views(key),
            images=images,
            prefill_graph=key,
        )

    def _step(self, key: GraphKey) -> torch.Tensor:
        """What a graph runs: complete the inputs, then the model over all T tokens; the final hidden
        states [R, H] of the logits rows."""
        t, r, _ = key
        batch = self._batch(key, t, r, r)
        tok, _ = self._views(key)
        decode_inputs(tok[IDS], tok[COLUMNS], tok[LOCS], tok[TOKEN_ROWS], tok[FILL], self.token_buf, self.req_to_token)
        hidden = forward_hidden(self.model, batch, self.plan(batch))
        return hidden[batch.logits_indices]

    def key_for(self, num_tokens: int, num_rows: int) -> tuple[int, int] | None:
        """The (tokens, rows) bucket whose graph runs such a step, or None when none does."""
        if not (0 < num_tokens <= self.token_sizes[-1] and 0 < num_rows <= self.row_sizes[-1]):
            return None
        t = self.token_sizes[bisect.bisect_left(self.token_sizes, num_tokens)]
        r = self.row_sizes[bisect.bisect_left(self.row_sizes, num_rows)]
        return (t, r) if (t, r, False) in self.graphs else None

    def stage(
        self,
        input_ids: list[int],  # each token, or anything where fill is set
        columns: list[int],  # each token's index in its request (its request-table column)
        positions: list[int],  # each token's RoPE position (one axis: index + M-RoPE delta, if any)
        token_rows: list[int],  # each token's request row
        fill: list[int],  # 1: the token is the token buffer's entry of its request row
        req_pool_indices: list[int],  # per row
        seq_lens: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        logits_rows: list[int],  # the tokens that sample, in sampling order (at most one per row)
        out_cache_loc: torch.Tensor,  # [N] int64 on the device
        state_slots: list[int] | None = None,  # per row (hybrid models)
        axes: list[int] | None = None,  # M-RoPE [3, N] positions, flat, where they are not all `positions`
        images: ImageEmbeds | None = None,  # the step's image rows (vision-language models)
        snapshots: list[list[tuple[int, int]]] | None = None,  # per row (hybrid models: ScheduledBatch.snapshots)
    ) -> ForwardBatch | None:
        """Write the step into the inputs of the graph that runs it (None: no graph does). The batch's
        tensors are views of those inputs, valid until the next stage of the same bucket."""
        n, b = len(input_ids), len(req_pool_indices)
        key = self.key_for(n, b)
        if key is None or len(logits_rows) > b or ((axes is not None or images is not None) and self.images is None):
            return None
        t, r = key
        gkey = (t, r, b == 1 and not prefix_lens[0] and (t, 1, True) in self.graphs)
        snapshot_host: list[int] = []
        if self._snapshot_fields(t, r):  # every graph of 64 tokens or more takes them (none: -1 and padding)
            c = t // SNAPSHOT_CHUNK
            table, ends, slots = snapshot_inputs(prefix_lens, extend_lens, snapshots or [[]] * b, c)
            pad_s = [0] * (_padded(c) - len(ends))
            snapshot_host = [*table, *[-1] * (_padded(r * c) - len(table)), *ends, *pad_s, *slots, *pad_s]
        elif snapshots:
            return None  # a step of fewer than 64 tokens takes no snapshot (none can be asked of it)
        pad_t, pad_r = [0] * (t - n), [0] * (_padded(r) - b)
        rope = positions * self.axes if axes is None else axes  # a text token: three equal axes
        host = [
            *input_ids, *pad_t, *columns, *pad_t, *[0] * t, *token_rows, *pad_t, *fill, *pad_t,
            *(x for a in range(self.axes) for x in (*rope[a * n : (a + 1) * n], *pad_t)),
            *req_pool_indices, *pad_r, *seq_lens, *pad_r, *extend_lens, *pad_r,
            *logits_rows, *[0] * (_padded(r) - len(logits_rows)), *(state_slots or [0] * b), *pad_r,
            *snapshot_host,
        ]  # fmt: skip
        if self.images is not None:
            self._stage_images(images, n)
        flat = self.inputs[key]
        if flat.is_cuda:
            flat.copy_(torch.tensor(host, dtype=torch.int64, pin_memory=True), non_blocking=True)
        else:
            flat.copy_(torch.tensor(host, dtype=torch.int64))
        tok, _ = self._views(gkey)
        tok[LOCS, :n].copy_(out_cache_loc)
        batch = self._batch(gkey, n, b, len(logits_rows))
        batch.seq_lens_cpu, batch.prefix_lens_cpu, batch.extend_lens_cpu = list(seq_lens), list(prefix_lens), list(extend_lens)
        return batch

    def _stage_images(self, images: ImageEmbeds | None, num_tokens: int) -> None:
        """Scatter the step's image rows into the shared image buffers (device ops, in stream order
        after the last replay), clearing the last image step's rows first."""
        if self.image_dirty:
            self.image_mask[: self.image_dirty].zero_()
            for d in self.image_deepstack:
                d[: self.image_dirty].zero_()
            self.image_dirty = 0
        if images is None:
            return
        if len(images.deepstack) != len(self.image_deepstack):
            raise RuntimeError(f"{len(images.deepstack)} deepstack tensors for a graph of {len(self.image_deepstack)}")
        self.image_mask.index_fill_(0, images.rows, True)
        self.image_embeds.index_copy_(0, images.rows, images.embeds.to(self.image_embeds.dtype))
        for buf, rows in zip(self.image_deepstack, images.deepstack):
            buf.index_copy_(0, images.rows, rows.to(buf.dtype))
        self.image_dirty = num_tokens

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [N, V] of a staged batch's sampling rows: the graph's replay, then the lm_head
        on those rows."""
        key = batch.prefill_graph
        assert key is not None, "only a batch from stage() replays a prefill graph"
        self.graphs[key].replay()
        n = batch.logits_indices.numel()
        if n == 0:
            return self.hidden[key].new_empty((0, self.model.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(self.hidden[key][:n])


def _padded(rows: int) -> int:
    """Rows rounded up to an even count: each per-row field of the flat inputs starts 16-byte aligned
    (Triton specialises kernels on pointer alignment)."""
    return rows + rows % 2
