"""The recurrent-state pools of hybrid models (Qwen3.5's Gated DeltaNet layers), beside the KV pool.

One slot holds a request's state in every DeltaNet layer: the conv state [conv_dim, K - 1] (model
dtype) and the recurrent state [Hv, Dk, Dv] (float32), 18 MiB a slot for Qwen3.5-0.8B/2B and 48 MiB
for 4B/9B. Each pool is one tensor [layers, slots, ...], so that copying a slot (a prefix-cache
snapshot in or out) is one launch per pool whatever the number of layers. Slot 0 is the dummy that
padded CUDA-graph rows read and write; it is never handed out.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from mllmd_kernels.gated_delta_rule_chunk import CHUNK


class StatePool:
    def __init__(
        self, num_slots: int, num_layers: int, conv_shape: tuple[int, int], ssm_shape: tuple[int, int, int],
        dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        """`num_slots` usable slots (plus the dummy)."""
        self.size = num_slots
        self.conv = torch.zeros((num_layers, num_slots + 1, *conv_shape), dtype=dtype, device=device)
        self.ssm = torch.zeros((num_layers, num_slots + 1, *ssm_shape), dtype=torch.float32, device=device)
        self._free = list(range(num_slots, 0, -1))

    @staticmethod
    def bytes_per_slot(num_layers: int, conv_shape: tuple[int, int], ssm_shape: tuple[int, int, int],
                       dtype: torch.dtype) -> int:  # fmt: skip
        elem = torch.empty((), dtype=dtype).element_size()
        conv = conv_shape[0] * conv_shape[1] * elem
        ssm = ssm_shape[0] * ssm_shape[1] * ssm_shape[2] * 4
        return num_layers * (conv + ssm)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot over all layers (conv + recurrent state)."""
        return (self.conv[:, 0].numel() * self.conv.element_size()) + (self.ssm[:, 0].numel() * self.ssm.element_size())

    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        assert 0 < slot <= self.size and slot not in self._free, f"freeing state slot {slot} twice"
        self._free.append(slot)

    def copy(self, src: int | torch.Tensor, dst: int | torch.Tensor) -> None:
        """Slot(s) dst := src in every layer (ints, or int64 device tensors; stream-ordered, no sync)."""
        self.conv[:, dst] = self.conv[:, src]
        self.ssm[:, dst] = self.ssm[:, src]

    def zero(self, slots: int | torch.Tensor) -> None:
        self.conv[:, slots] = 0
        self.ssm[:, slots] = 0


class StepSnapshots(NamedTuple):
    """Where a prefill step copies states into prefix-cache snapshot slots as it computes (the
    scheduler picks the positions, `Scheduler.snapshot_positions`): after each full 64-token chunk
    that `table` names, counted from each row's first token in the step. `ends` / `slots` name the same
    snapshots by the step's token index each is taken before, for the conv states (padding entries:
    end 0, slot 0, the dummy)."""

    table: torch.Tensor  # [B, C] int64: row b's snapshot slot after chunk c (-1: none)
    ends: torch.Tensor  # [S] int64: the step's token index each snapshot is taken before
    slots: torch.Tensor  # [S] int64


SNAPSHOT_CHUNK = CHUNK  # the chunk kernel's chunk: snapshots fall on its boundaries


class StateStep:
    """One step's view of the pools (mllmd.models.layers.gated_deltanet.RecurrentStep)."""

    __slots__ = ("pool", "decode", "slots", "has_initial_state", "cu_seqlens", "snapshots", "_conv_rows")

    def __init__(self, pool: StatePool, decode: bool, slots: torch.Tensor, extend_lens: torch.Tensor,
                 snapshots: StepSnapshots | None = None) -> None:  # fmt: skip
        self.pool, self.decode, self.slots = pool, decode, slots
        self.snapshots = snapshots
        self._conv_rows: torch.Tensor | None = None
        # every slot holds its request's state (zeroed or copied in at admission): always read it
        self.has_initial_state = torch.ones_like(slots, dtype=torch.bool)
        if decode:
            self.cu_seqlens = slots  # unused by the recurrent kernels
        else:
            self.cu_seqlens = torch.nn.functional.pad(torch.cumsum(extend_lens, 0, dtype=torch.int32), (1, 0))

    def conv_state(self, layer: int) -> torch.Tensor:
        return self.pool.conv[layer]

    def ssm_state(self, layer: int) -> torch.Tensor:
        return self.pool.ssm[layer]

    def snapshot_conv_rows(self, width: int) -> torch.Tensor:
        """Each snapshot's conv-state inputs by token index (RecurrentStep), once a step: every layer
        shares them, and an eager step would otherwise pay three launches a layer for them."""
        if self._conv_rows is None:
            assert self.snapshots is not None
            ends = self.snapshots.ends
            self._conv_rows = (ends[:, None] + torch.arange(1 - width, 0, device=ends.device)).clamp_min(0)
        return self._conv_rows


def snapshot_inputs(
    prefix_lens: list[int], extend_lens: list[int], snapshots: list[list[tuple[int, int]]], columns: int
) -> tuple[list[int], list[int], list[int]]:
    """The host lists of a step's StepSnapshots: the [B, columns] table (flat, -1 where none), and each
    snapshot's token index in the step and slot. `snapshots[b]`: row b's (position, slot) pairs
    (Scheduler.snapshot_positions); those the forward does not take (`taken_in_forward`) are left out."""
    table = [-1] * (len(extend_lens) * columns)
    ends: list[int] = []
    slots: list[int] = []
    start = 0
    for b, (p, n, snaps) in enumerate(zip(prefix_lens, extend_lens, snapshots)):
        for pos, slot in snaps:
            if not taken_in_forward(p, pos):  # the scheduler copies the row's own state there
                continue
            chunks = (pos - p) // SNAPSHOT_CHUNK
            assert 0 < chunks <= min(columns, n // SNAPSHOT_CHUNK), f"snapshot at {pos} of row {b}"
            table[b * columns + chunks - 1] = slot
            ends.append(start + pos - p)
            slots.append(slot)
        start += n
    return table, ends, slots


def taken_in_forward(p: int, pos: int) -> bool:
    """Whether the step's forward takes the snapshot at `pos` of a row that starts at `p` (a whole
    number of chunks into the row); else the scheduler copies the row's own state: at p, before the
    step, or at the row's end, once the step is launched."""
    return pos > p and (pos - p) % SNAPSHOT_CHUNK == 0


def takes_snapshots(prefix_lens: list[int], snapshots: list[list[tuple[int, int]]]) -> bool:
    """Whether a step's forward takes any of its rows' snapshots."""
    return any(taken_in_forward(p, pos) for p, snaps in zip(prefix_lens, snapshots) for pos, _ in snaps)
