"""Qwen3 (dense) for causal LM: pre-norm decoder with QK-norm, RoPE, GQA and a SwiGLU MLP.

Hidden states are flat [T, H]: all tokens of the step, every request concatenated. Attention goes
through the step's attention backend, which reads and writes the paged KV pool.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from mllmd_kernels import gemv, rope, silu_and_mul_int8
from torch import nn

from mllmd import knobs
from mllmd.engine.forward_batch import ForwardBatch
from mllmd.models.layers import (
    Int8Rows,
    Linear,
    MergedLinear,
    NormRows,
    RMSNorm,
    RowsWithAmax,
    SiluAndMul,
    get_rope,
)
from mllmd.models.layers.dispatch import fused_kernels, use_gemv
from mllmd.models.quantization import QuantConfig, UnsupportedQuantization, get_linear_scheme

# The fused RoPE kernel writes the step's K/V into the pool where the pool's dtype is the kernel's
# (no store_cache launch); False leaves the store to the attention backend (tests compare the routes).
ROPE_STORES_KV = True
# W4A16 on the CUDA kernel, one bf16 row (batch-1 decode): the input and post-attention norms run inside
# the qkv and gate/up launches, silu(gate) * up inside gate/up's; False (or MLLMD_W4A16_FUSIONS=0, read
# at import) runs them apart, for comparison.
FUSE_NORM_AND_ACTIVATION = knobs.W4A16_FUSIONS


class Qwen3Attention(nn.Module):
    def __init__(
        self, config: Any, layer_id: int, dtype: torch.dtype, quant: QuantConfig | None = None, prefix: str = ""
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        bias = getattr(config, "attention_bias", False)
        qkv_scheme = get_linear_scheme(quant, f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj")
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
            bias=bias,
            dtype=dtype,
            quant=qkv_scheme,
        )
        o_scheme = get_linear_scheme(quant, f"{prefix}.o_proj")
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias, dtype=dtype, quant=o_scheme)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype)
        self.rotary_emb = get_rope(self.head_dim, config.max_position_embeddings, config)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor | Int8Rows | NormRows, batch: ForwardBatch
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [T, q + 2 kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))  # views into qkv
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        backend = batch.attn_backend
        if fused_kernels(qkv):  # QK-norm and RoPE in one Triton kernel, which also writes k and v to the KV pool
            rot = self.rotary_emb
            k_cache, v_cache, loc = backend.kv_cache_target(self.layer_id, batch)
            stores = ROPE_STORES_KV and k_cache.dtype == torch.promote_types(q.dtype, self.q_norm.weight.dtype)
            q, k = rope(
                positions, q, k, rot.cos_cache, rot.sin_cache,
                self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                kv_cache=(v, k_cache, v_cache, loc) if stores else None,
            )  # fmt: skip
            if stores:
                k = v = None
        else:
            stores = False
            q, k = self.rotary_emb(positions, self.q_norm(q), self.k_norm(k))
        if self.o_proj.takes_amax:  # W8A8 one row: the scale from the attention kernel's max|out| partials
            out, amax = backend.forward_with_amax(q, k, v, self.layer_id, self.scale, batch, kv_stored=stores)
            if amax is not None:
                return self.o_proj(RowsWithAmax(out.reshape(-1, self.q_size), amax))
        else:
            out = backend.forward(q, k, v, self.layer_id, self.scale, batch, kv_stored=stores)  # [T, Hq, D]
        return self.o_proj(out.reshape(-1, self.q_size))


class Qwen3MLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, quant: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        inter = config.intermediate_size
        gate_up_scheme = get_linear_scheme(quant, f"{prefix}.gate_proj", f"{prefix}.up_proj")
        self.gate_up_proj = MergedLinear(
            config.hidden_size, {"gate": inter, "up": inter}, dtype=dtype, quant=gate_up_scheme
        )
        down_scheme = get_linear_scheme(quant, f"{prefix}.down_proj")
        self.down_proj = Linear(inter, config.hidden_size, dtype=dtype, quant=down_scheme)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor | Int8Rows | NormRows) -> torch.Tensor:
        if isinstance(x, Int8Rows) and x.q.shape[0] == 1:
            # W8A8, one row: the gate/up gemv applies silu(gate) * up in its epilogue, and the down
            # gemv quantizes that row itself (no silu_and_mul launch between them).
            return self.down_proj(self.gate_up_proj.forward_silu_mul(x))
        if self.gate_up_proj.fuses_silu_mul and FUSE_NORM_AND_ACTIVATION:
            # W4A16 on the CUDA kernel, one bf16 row: silu(gate) * up in the gate/up launch, and the norm
            # before it too (NormRows); other batches run the separate kernels.
            return self.down_proj(self.gate_up_proj.forward_silu_mul(x))
        if isinstance(x, NormRows):
            x = x.normed()
        h = self.gate_up_proj(x)
        # W8A8 on the GPU: activate and quantize in one launch. Not for one row: silu_and_mul_int8's
        # single program is latency-bound there, and the one-row gemv quantizes its input itself
        # (H200, Qwen3-8B down: silu_and_mul 1.4 + w8a8_gemv 14.8 us against 4.1 + 13.6 us).
        if self.down_proj.takes_int8_input and h.dim() == 2 and h.shape[0] > 1:
            return self.down_proj(Int8Rows(*silu_and_mul_int8(h), h.dtype))
        return self.down_proj(self.act(h))


class Qwen3DecoderLayer(nn.Module):
    def __init__(
        self, config: Any, layer_id: int, dtype: torch.dtype, quant: QuantConfig | None = None, prefix: str = ""
    ) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, layer_id, dtype, quant, f"{prefix}.self_attn")
        self.mlp = Qwen3MLP(config, dtype, quant, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # W8A8 projections on the GPU take their input quantized by the norm's own launch, one row
        # (batch-1 decode) too: the plain int8 gemv then skips the max|x| pass that w8a8_gemv makes in
        # every program (H200, Qwen3-8B shapes: qkv 8.0 against 8.6 us, gate_up 25.1 against 26.3).
        # W4A16 on the CUDA kernel: the projection after each norm applies it in its own launch where it
        # can (one bf16 row), and leaves the residual sum in NormRows.residual_out.
        if self.self_attn.qkv_proj.fuses_norm and FUSE_NORM_AND_ACTIVATION:
            pending = NormRows(hidden, residual, self.input_layernorm)
            hidden = self.self_attn(positions, pending, batch)
            residual = pending.residual_out
        else:
            norm = self.input_layernorm
            if self.self_attn.qkv_proj.takes_int8_input:
                norm = norm.forward_int8
            if residual is None:
                residual = hidden
                normed = norm(hidden)
            else:
                normed, residual = norm(hidden, residual)
            hidden = self.self_attn(positions, normed, batch)
        if self.mlp.gate_up_proj.fuses_norm and FUSE_NORM_AND_ACTIVATION:
            pending = NormRows(hidden, residual, self.post_attention_layernorm)
            out = self.mlp(pending)
            if pending.residual_out is None:
                raise RuntimeError("the MLP did not run the post-attention norm")
            return out, pending.residual_out
        norm = self.post_attention_layernorm
        if self.mlp.gate_up_proj.takes_int8_input:
            norm = norm.forward_int8
        normed, residual = norm(hidden, residual)
        return self.mlp(normed), residual


class Qwen3Model(nn.Module):
    def __init__(
        self, config: Any, dtype: torch.dtype, quant: QuantConfig | None = None, prefix: str = "model"
    ) -> None:
        """`prefix`: the checkpoint's name for this module, which quantization targets match."""
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, i, dtype, quant, f"{prefix}.layers.{i}") for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 decoder + lm_head (tied to the embeddings when the config says so)."""

    # checkpoint sub-name -> (fused parameter, shard)
    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, config: Any, dtype: torch.dtype, quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        lm_head_scheme = get_linear_scheme(quant_config, "lm_head")  # None: kept in the config's ignore list
        if lm_head_scheme is not None and self.tie_word_embeddings:
            raise UnsupportedQuantization(
                "a quantized lm_head tied to the embeddings is not supported (keep lm_head in the config's ignore list)"
            )
        self.model = Qwen3Model(config, dtype, quant_config)
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype=dtype, quant=lm_head_scheme)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The float [V, H] output embedding (tied, or an unquantized lm_head)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, H] of every token of the step."""
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, V] for the given rows only (the positions that sample)."""
        if self.lm_head is not None and self.lm_head.quant_method is not None:  # a quantized lm_head
            return self.lm_head(hidden).float()
        if use_gemv(hidden):  # float32 straight from the kernel (the bf16 values, no copy launch)
            out = hidden.new_empty((hidden.shape[0], self.lm_head_weight.shape[0]), dtype=torch.float32)
            return gemv(hidden, self.lm_head_weight, out=out)
        return torch.matmul(hidden, self.lm_head_weight.t()).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into the (fused) parameters; error on missing or unexpected names.

        Linear layers take their tensors by name (weight, bias, and for quantized layers
        weight_scale, weight_packed, ...); then each prepares its kernel.
        """
        params = dict(self.named_parameters())
        linears = {n: m for n, m in self.named_modules() if isinstance(m, Linear)}
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            module_name, _, attr = name.rpartition(".")
            shard = None
            for sub, (target, s) in self.stacked_params.items():
                if module_name.endswith(f".{sub}"):
                    module_name, shard = module_name[: -len(sub)] + target, s
                    break
            linear = linears.get(module_name)
            if linear is not None:
                try:
                    filled = linear.load_weight(attr, tensor, shard)
                except ValueError as e:
                    raise ValueError(f"weight {name!r}: {e}") from None
                if filled:
                    loaded.add(f"{module_name}.{attr}" + (f":{shard}" if shard else ""))
                continue
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            if params[name].shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
            params[name].data.copy_(tensor)
            loaded.add(name)
        self._check_complete(params, loaded)
        for linear in linears.values():
            linear.process_weights_after_loading()

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for pname in params:
            module = self.get_submodule(pname.rsplit(".", 1)[0])
            if isinstance(module, MergedLinear):
                missing += [f"{pname}:{s}" for s in module.shard_offsets if f"{pname}:{s}" not in loaded]
            elif pname not in loaded:
                missing.append(pname)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
