"""CUDA graphs of the vision tower, one per image grid that comes back.

An eager tower call is bound by the host: Qwen3-VL-2B's tower launches about 300 kernels for one
image, and on the H200 a 1000x750 image took 13 ms for 6.6 ms of kernels (docs/benchmarks.md). Edge
inputs repeat their grid (a camera, a scanner at one resolution), so a grid seen a second time is
captured and later calls with that grid replay it.

Only the pixels change between calls with one grid: the rotary angles, position-table taps and
attention segments (`VisionInputs`) depend on the grid alone, so each graph keeps its own, built
once. The graphs share one memory pool and run one at a time on the step's stream, so one graph's
scratch may be another's; the outputs are therefore copied out right after each replay (they go to
the encoder cache, which outlives the next replay). Bounded: at most `MAX_GRAPHS` graphs (least
recently used dropped), of at most `MAX_PATCHES` patches each; larger calls run eagerly. The memory
plan reserves `reserved_bytes` for them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

MAX_GRAPHS = 4  # grids kept captured at once
MAX_PATCHES = 4096  # patches per captured call: 1,024 image tokens (a 1024x1024 picture at merge 2)
_SEEN = 64  # grids remembered as seen once

Grids = tuple[tuple[int, int, int], ...]


@dataclass
class _TowerGraph:
    graph: torch.cuda.CUDAGraph
    pixels: torch.Tensor  # static input [patches, patch_dim]
    inputs: Any  # VisionInputs of the grid, kept alive for the replays
    embeds: torch.Tensor  # static outputs
    deepstack: list[torch.Tensor]


class VisionGraphs:
    """Captures `visual(pixels, inputs)` per grid on its second call, replays it from the third."""

    def __init__(self, visual: Any) -> None:
        self.visual = visual
        self.pool: Any = None  # the graphs' shared memory pool, made at the first capture
        self.graphs: OrderedDict[Grids, _TowerGraph] = OrderedDict()
        self.seen: OrderedDict[Grids, None] = OrderedDict()
        self.replays = 0
        self.captures = 0
        self.failed = False  # a capture raised once: no more tries

    def run(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """The tower's outputs for these pixels through a graph, or None: run it eagerly (a grid seen for
        the first time, or too large to keep a graph for)."""
        with torch.inference_mode():  # the static tensors are inference tensors, whoever calls
            return self._run(pixels, tuple(grids))

    def _run(self, pixels: torch.Tensor, key: Grids) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        entry = self.graphs.get(key)
        if entry is None:
            if self.failed or pixels.shape[0] > MAX_PATCHES or not self._seen_before(key):
                return None
            try:
                entry = self._capture(key, pixels)
            except RuntimeError:  # an op this torch cannot capture: the tower stays eager, requests go on
                logger.exception("vision tower: CUDA graph capture failed; the tower runs eagerly from now on")
                self.failed = True
                return None
        self.graphs.move_to_end(key)
        entry.pixels.copy_(pixels)
        entry.graph.replay()
        self.replays += 1
        return entry.embeds.clone(), [d.clone() for d in entry.deepstack]

    def _seen_before(self, key: Grids) -> bool:
        if key in self.seen:
            return True
        self.seen[key] = None
        if len(self.seen) > _SEEN:
            self.seen.popitem(last=False)
        return False

    def _capture(self, key: Grids, pixels: torch.Tensor) -> _TowerGraph:
        """The grid's first eager call already compiled and planned every kernel at these shapes."""
        while len(self.graphs) >= MAX_GRAPHS:
            self.graphs.popitem(last=False)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        inputs = self.visual.prepare(list(key), pixels.device)
        static = pixels.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):  # synchronises first: `prepare`'s uploads have landed
            embeds, deepstack = self.visual(static, inputs)
        self.graphs[key] = entry = _TowerGraph(graph, static, inputs, embeds, list(deepstack))
        self.captures += 1
        logger.info("vision tower: captured a CUDA graph for grids %s (%d patches)", list(key), pixels.shape[0])
        return entry


def reserved_bytes(visual: Any, dtype: torch.dtype, merge: int) -> int:
    """Memory the tower graphs may hold: the pool (about one eager call's activations at MAX_PATCHES,
    measured by running one) plus each graph's static input and outputs."""
    cfg = visual.config
    side = int(MAX_PATCHES**0.5) // merge * merge
    patches = side * side
    dev = visual.inv_freq.device
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    with torch.inference_mode():
        out = visual(torch.zeros(patches, cfg.patch_dim, dtype=dtype, device=dev), [(1, side, side)])
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    del out
    torch.cuda.empty_cache()
    size = torch.empty((), dtype=dtype).element_size()
    tokens = MAX_PATCHES // (merge * merge)
    per_graph = MAX_PATCHES * cfg.patch_dim * size + tokens * cfg.out_hidden_size * size * (1 + len(cfg.deepstack_visual_indexes))
    return int(peak) + MAX_GRAPHS * per_graph
