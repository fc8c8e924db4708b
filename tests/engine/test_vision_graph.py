"""VisionGraphs' bookkeeping on any device: which calls capture, replay or stay eager, the LRU bound,
and a capture that raises leaving the tower eager instead of failing requests. The capture itself is a
stand-in here; tests/engine/test_gpu_hybrid.py replays real graphs against the eager tower on CUDA."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mllmd.engine import vision_graph
from mllmd.engine.vision_graph import VisionGraphs


class _Replay:
    """A captured call's stand-in: replay() writes the static input's sum into the static output."""

    def __init__(self, pixels: torch.Tensor, embeds: torch.Tensor) -> None:
        self.pixels, self.embeds = pixels, embeds

    def replay(self) -> None:
        self.embeds.fill_(float(self.pixels.sum()))


class _Graphs(VisionGraphs):
    def __init__(self, fail: bool = False) -> None:
        super().__init__(visual=None)
        self.fail = fail
        self.tries = 0

    def _capture(self, key: Any, pixels: torch.Tensor) -> Any:
        self.tries += 1
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        while len(self.graphs) >= vision_graph.MAX_GRAPHS:
            self.graphs.popitem(last=False)
        static, embeds = pixels.clone(), torch.zeros(2)
        entry = vision_graph._TowerGraph(_Replay(static, embeds), static, None, embeds, [])  # type: ignore[arg-type]
        self.graphs[key] = entry
        self.captures += 1
        return entry


def _pixels(value: float, patches: int = 8) -> torch.Tensor:
    return torch.full((patches, 3), value)


def test_a_grid_is_captured_on_its_second_call_and_replayed_with_new_pixels() -> None:
    g = _Graphs()
    grid = [(1, 2, 4)]
    assert g.run(_pixels(1.0), grid) is None  # first sight: eager
    first = g.run(_pixels(1.0), grid)
    second = g.run(_pixels(2.0), grid)
    assert first is not None and second is not None
    assert first[0].tolist() == [24.0, 24.0] and second[0].tolist() == [48.0, 48.0]
    assert first[0].tolist() == [24.0, 24.0], "each replay's outputs are a copy, not the static buffer"
    assert (g.captures, g.replays) == (1, 2)


def test_large_calls_stay_eager_and_at_most_max_graphs_are_kept() -> None:
    g = _Graphs()
    big = _pixels(1.0, vision_graph.MAX_PATCHES + 1)
    assert g.run(big, [(1, 1, big.shape[0])]) is None and g.run(big, [(1, 1, big.shape[0])]) is None
    assert g.tries == 0
    grids = [[(1, 2, 2 * (i + 1))] for i in range(vision_graph.MAX_GRAPHS + 1)]
    for grid in grids:
        g.run(_pixels(1.0), grid)
        assert g.run(_pixels(1.0), grid) is not None
    assert len(g.graphs) == vision_graph.MAX_GRAPHS
    assert tuple(grids[0]) not in g.graphs, "the least recently used grid went first"


def test_a_capture_that_raises_leaves_the_tower_eager(caplog: pytest.LogCaptureFixture) -> None:
    g = _Graphs(fail=True)
    grid = [(1, 2, 4)]
    assert g.run(_pixels(1.0), grid) is None
    assert g.run(_pixels(1.0), grid) is None  # the capture raised: eager, no error for the request
    assert g.failed and g.tries == 1
    assert "capture failed" in caplog.text
    assert g.run(_pixels(1.0), grid) is None and g.run(_pixels(1.0), [(1, 4, 4)]) is None
    assert g.tries == 1, "no capture is tried again"
