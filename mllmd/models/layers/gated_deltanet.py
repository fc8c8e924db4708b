"""The Gated DeltaNet layer of Qwen3.5 (linear attention with a recurrent state per request).

Per token: the input projections (q|k|v, z, b, a: one fused projection here), a causal depthwise
conv1d of width K over q|k|v with SiLU (its state: the last K-1 inputs), L2-normalised q and k (q
scaled), beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), the gated delta rule on a float32
state [Hv, Dk, Dv] (keys repeated when there are more value heads than key heads), a gated RMSNorm
with silu(z), the output projection.

States live in the engine's pools, one slot per request, which the step's `RecurrentStep` names: a
prefill (or mixed) step runs the chunked rule over each sequence of the step (cu_seqlens) from its
slot's state and writes the final state back; a decode step runs one recurrent update per row.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
from mllmd_kernels import (
    causal_conv1d_decode,
    causal_conv1d_decode_ref,
    causal_conv1d_prefill,
    causal_conv1d_prefill_ref,
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_ref,
    fused_gdn_gating_decode,
    fused_gdn_gating_decode_ref,
    gated_rmsnorm,
    gated_rmsnorm_ref,
    gdn_gating_ref,
)
from torch import nn

from mllmd.models.layers.dispatch import fused_kernels
from mllmd.models.layers.fused_inputs import GatedNormRows
from mllmd.models.layers.linear import Linear, MergedLinear, row_prologue
from mllmd.models.quantization import QuantConfig, get_linear_scheme


class ChunkSnapshots(Protocol):
    """Prefix-cache snapshots a prefill step takes as it computes (none on decode steps): the states
    after whole 64-token chunks of a row, copied into other slots of the pools."""

    @property
    def table(self) -> torch.Tensor:
        """[B, C] int64: the slot of row b's state after its first (c + 1) * 64 tokens (-1: none)."""
        ...

    @property
    def ends(self) -> torch.Tensor:
        """[S] int64: the same snapshots by the step's token index each is taken before."""
        ...

    @property
    def slots(self) -> torch.Tensor:
        """[S] int64: their slots (padding: end 0, slot 0, the dummy)."""
        ...


class RecurrentStep(Protocol):
    """One step's view of the recurrent-state pools (what the engine prepared)."""

    decode: bool  # every row is one token of a running sequence: the recurrent kernels
    slots: torch.Tensor  # [B] int64: each row's state slot (0: a padding row's dummy)
    has_initial_state: torch.Tensor  # [B] bool
    cu_seqlens: torch.Tensor  # [B + 1] int32: the rows' token ranges (prefill and mixed steps)

    @property
    def snapshots(self) -> ChunkSnapshots | None:
        """The prefix-cache snapshots the step takes (prefill steps of hybrid models; else None)."""
        ...

    def conv_state(self, layer: int) -> torch.Tensor:
        """[S, conv_dim, K - 1] in the model dtype."""
        ...

    def snapshot_conv_rows(self, width: int) -> torch.Tensor:
        """[S, width - 1] int64: the step's token index of each snapshot's conv-state inputs (the
        width - 1 before its position, oldest first, clamped at 0); built once a step for all layers."""
        ...

    def ssm_state(self, layer: int) -> torch.Tensor:
        """[S, Hv, Dk, Dv] float32."""
        ...


class HybridStep(NamedTuple):
    """A hybrid model's step: attention over the KV pool (`AttentionStep`) and the state pools."""

    attention: Any
    states: RecurrentStep


class _Conv1dWeight(nn.Module):
    """Holds the depthwise conv's weight as the checkpoint names it (conv1d.weight [C, 1, K])."""

    def __init__(self, channels: int, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width, dtype=dtype), requires_grad=False)


class _GatedNormWeight(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps


class GatedDeltaNet(nn.Module):
    # checkpoint sub-name -> (fused projection, shard)
    stacked_params = {
        "in_proj_qkv": ("in_proj", "qkv"),
        "in_proj_z": ("in_proj", "z"),
        "in_proj_b": ("in_proj", "b"),
        "in_proj_a": ("in_proj", "a"),
    }

    def __init__(self, config: Any, state_layer: int, dtype: torch.dtype, quant: QuantConfig | None = None,
                 prefix: str = "") -> None:  # fmt: skip
        super().__init__()
        self.state_layer = state_layer  # this layer's index in the state pools
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_width = config.linear_conv_kernel_dim
        hidden = config.hidden_size
        names = [f"{prefix}.in_proj_{s}" for s in ("qkv", "z", "b", "a")]
        self.in_proj = MergedLinear(
            hidden, {"qkv": self.conv_dim, "z": self.value_dim, "b": self.num_v_heads, "a": self.num_v_heads},
            dtype=dtype, quant=get_linear_scheme(quant, *names),
        )
        self.conv1d = _Conv1dWeight(self.conv_dim, self.conv_width, dtype)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads, dtype=dtype), requires_grad=False)
        self.norm = _GatedNormWeight(self.head_v_dim, config.rms_norm_eps, dtype)
        self.out_proj = Linear(self.value_dim, hidden, dtype=dtype, quant=get_linear_scheme(quant, f"{prefix}.out_proj"))
        self.norm_in_out_proj = False  # set by the fusion plan: a dense out_proj's GEMV applies the gated norm

    @property
    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """(conv state [conv_dim, K - 1], recurrent state [Hv, Dk, Dv]) of one request."""
        return (self.conv_dim, self.conv_width - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def forward(self, x: Any, states: RecurrentStep) -> torch.Tensor:
        """x [T, H] (or rows whose norm in_proj applies in its launch: fusion.py) -> [T, H]."""
        proj = self.in_proj(x)  # [T, conv_dim + Hv * Dv + 2 Hv]
        t = proj.shape[0]
        mixed, z, b, a = proj.split([self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1)
        weight = self.conv1d.weight.squeeze(1)  # [C, K]
        conv_state, ssm_state = states.conv_state(self.state_layer), states.ssm_state(self.state_layer)
        fast = fused_kernels(proj)
        if states.decode:
            conv = causal_conv1d_decode if fast else causal_conv1d_decode_ref
            y = conv(mixed, weight, None, conv_state, states.slots)
        else:
            conv = causal_conv1d_prefill if fast else causal_conv1d_prefill_ref
            y = conv(mixed, weight, None, states.cu_seqlens, conv_state, states.slots, states.has_initial_state)
            snaps = states.snapshots
            if snaps is not None:  # a snapshot's conv state: the K - 1 inputs before its position
                before = states.snapshot_conv_rows(self.conv_width)  # [S, K - 1]
                conv_state[snaps.slots] = mixed[before].transpose(1, 2).to(conv_state.dtype)
        q, k, v = y.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.unflatten(-1, (self.num_k_heads, self.head_k_dim))
        k = k.unflatten(-1, (self.num_k_heads, self.head_k_dim))
        v = v.unflatten(-1, (self.num_v_heads, self.head_v_dim))
        if states.decode:
            rule = fused_gdn_gating_decode if fast else fused_gdn_gating_decode_ref
            o = rule(q, k, v, a, b, self.A_log, self.dt_bias, None, ssm_state, states.slots)
        else:
            g, beta = gdn_gating_ref(a, b, self.A_log, self.dt_bias)
            rule = chunk_gated_delta_rule if fast else chunk_gated_delta_rule_ref
            snapshot_table = None if states.snapshots is None else states.snapshots.table
            o = rule(q, k, v, g, beta, None, ssm_state, states.slots, states.has_initial_state, states.cu_seqlens,
                     chunk_snapshot_indices=snapshot_table)
        if self.norm_in_out_proj:  # one row: the gated norm in out_proj's launch (the fusion plan's route)
            pending = GatedNormRows(o.reshape(t, self.value_dim), z, self.norm.weight, self.norm.eps, self.head_v_dim)
            if self.out_proj.takes_rows(pending.x, row_prologue(pending)[1]):
                return self.out_proj(pending)
        norm = gated_rmsnorm if fast else gated_rmsnorm_ref
        o = norm(o, z.reshape(t, self.num_v_heads, self.head_v_dim), self.norm.weight, self.norm.eps)  # [T, Hv, Dv]
        return self.out_proj(o.reshape(t, self.value_dim))
