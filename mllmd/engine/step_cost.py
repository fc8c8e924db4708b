"""What a step costs per token it computes, learned from the steps that ran: the scheduler's measure
for `scheduler.max_decode_stall_ms`. Left null (on a GPU), the budget itself is learned too: twice the
time of a decode-only step of the running batch (`stall_budget_s`), so that the cap follows the batch
and the device (a Jetson's decode step is ten times an H200's) and inter-token latency stays near two
decode steps while prompts arrive.

A step that carries a prefill chunk makes every running request wait for it: its next token comes
only after the whole step. With a stall budget set, the scheduler caps a step's tokens while
requests decode. It uses the seconds per token of recent steps that carried prefill work and
computed at least `MIN_OBSERVED_TOKENS` tokens, an exponential average (decode-only steps run as
CUDA graphs at another cost per token, and are not the steps the cap bounds). Counting a step's
fixed cost into the per-token figure over-states it, so the cap errs on the short side. The time is
the device's (CUDA events around the step's input staging and forward, read once the step's tokens
are in: no extra synchronisation) or, on the CPU, the host's wall time.

Where prefill and mixed steps replay CUDA graphs, a step computes its token bucket (prefill_graph's
16, 32, 64, 96, 128, 192, 256, 384, ...), padding included: a step is counted at its bucket's tokens,
and the cap is rounded down to a bucket, so that a capped step pads nothing (a cap of 300 tokens
would otherwise run the 384-token graph, 28% of its work padding, and end later than the budget).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MIN_OBSERVED_TOKENS = 64  # smaller steps are mostly fixed cost: they would inflate the per-token figure
MIN_CAPPED_TOKENS = 32  # the cap never goes below this, so that a long prompt still makes progress
SMOOTHING = 0.25  # weight of the newest step in the average
AUTO_DECODE_STEPS = 2.0  # max_decode_stall_ms null: a step with prefill work may last this many decode steps
DECODE_TIMING_EVERY = 8  # auto: one decode-only step in this many is timed (two events on the stream)


def stall_budget_s(fixed_ms: float | None, decode_step_s: float | None) -> float | None:
    """The step-time budget of the decode stall cap: `fixed_ms` (scheduler.max_decode_stall_ms) when set
    (0: off, no budget), else (null: auto) AUTO_DECODE_STEPS decode-only steps as measured; None (no
    cap) until one was."""
    if fixed_ms is not None:
        return fixed_ms / 1e3 if fixed_ms > 0 else None
    return None if decode_step_s is None else AUTO_DECODE_STEPS * decode_step_s


class StepCostModel:
    def __init__(self, smoothing: float = SMOOTHING, buckets: Sequence[int] = ()) -> None:
        """`buckets`: the token counts of the prefill graphs, ascending (none where steps run eagerly)."""
        self.smoothing = smoothing
        self.buckets = list(buckets)
        self.seconds_per_token: float | None = None  # None until a step large enough was measured
        self.decode_step_s: float | None = None  # a decode-only step of the running batch (auto budget)

    def observe(self, tokens: int, seconds: float) -> None:
        """A step that computed `tokens` tokens (prefill and decode rows alike) took `seconds`."""
        if tokens < MIN_OBSERVED_TOKENS or not seconds > 0:
            return
        self.seconds_per_token = self._average(self.seconds_per_token, seconds / tokens)

    def observe_decode(self, seconds: float) -> None:
        """A step of decode rows only (the running batch, as it is now) took `seconds`."""
        if seconds > 0:
            self.decode_step_s = self._average(self.decode_step_s, seconds)

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def tokens_within(self, budget_s: float) -> int | None:
        """The most tokens a step may compute to end within `budget_s` (at least MIN_CAPPED_TOKENS),
        rounded down to a graph bucket where one fits; None while nothing has been measured (no cap yet)."""
        per = self.seconds_per_token
        if per is None:
            return None
        cap = int(budget_s / per)
        if self.buckets and cap <= self.buckets[-1]:  # past the last bucket steps run eagerly: no padding
            i = bisect.bisect_right(self.buckets, cap)
            cap = self.buckets[i - 1] if i else cap
        return max(MIN_CAPPED_TOKENS, cap)


@dataclass
class StepTimer:
    """The time of one step's forward and sampling: CUDA events, or host wall time on the CPU."""

    tokens: int
    start: torch.cuda.Event | float
    end: torch.cuda.Event | float | None = None
    decode_only: bool = False  # a step of decode rows alone (the auto budget's measure)

    @classmethod
    def begin(cls, tokens: int, device: torch.device, decode_only: bool = False) -> StepTimer:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return cls(tokens, event, decode_only=decode_only)
        return cls(tokens, time.perf_counter(), decode_only=decode_only)

    def stop(self) -> None:
        """After the step's last launch (on the CPU, after its last operation)."""
        if isinstance(self.start, float):
            self.end = time.perf_counter()
        else:
            self.end = torch.cuda.Event(enable_timing=True)
            self.end.record()

    def seconds(self) -> float | None:
        """The step's time, once its tokens have reached the host (the end event has then completed)."""
        if self.end is None:
            return None
        if isinstance(self.start, float):
            assert isinstance(self.end, float)
            return self.end - self.start
        assert isinstance(self.end, torch.cuda.Event)
        return self.start.elapsed_time(self.end) / 1e3
