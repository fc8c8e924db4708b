"""mllmd's kernel library: each kernel sits beside its torch reference (used on CPU and in tests).

Every module imports without Triton (the references and `store_cache` keep working on CPU) and
without mllmd; the Triton wrappers need `triton_available()` (CUDA + Triton), or TRITON_INTERPRET=1
with CPU tensors for development. One op per module:

  rmsnorm, rope, activation (silu_and_mul, sigmoid_gate), store_cache, kv_indices, decode_inputs, decode_attention,
  extend_attention, sampling (gumbel_argmax, greedy_argmax; gumbel: the seeded noise they reproduce),
  gemv (bf16/fp16 decode GEMV), gemv_fused (the one-row GEMV with the norm / SiLU-and-mul before it),
  int8_quant;
  W8A8: int8_config (tilings), int8_gemv (one row), int8_gemm (tensor cores; the references),
  int8_gemm_tma (sm90 prefill);
  W4A16: w4a16_dequant (the int4 format, its references, dequantize), w4a16_config (tilings),
  w4a16_gemv (one row), w4a16_gemm (tensor cores), w4a16_mma (the CUDA decode kernel's binding and
  weight layout; csrc/w4a16_mma.cu);
  shared: splitk (split-K), tiling (GEMM tile helpers), cuda_build (nvcc, the library cache),
  _triton (the Triton import shim, PDL), knobs (the MLLMD_* environment switches), testing (test
  helpers), bench/ (micro-benchmarks).
NOTES.md holds the kernels' lab log: the variants tried and their figures.
"""

from mllmd_kernels._triton import HAS_TRITON, interpreting, pdl_launches, triton_available, triton_runnable
from mllmd_kernels.activation import (
    sigmoid_gate,
    sigmoid_gate_ref,
    silu_and_mul,
    silu_and_mul_int8,
    silu_and_mul_int8_ref,
    silu_and_mul_ref,
)
from mllmd_kernels.decode_attention import decode_attention, decode_attention_ref, decode_num_splits
from mllmd_kernels.decode_inputs import decode_inputs, decode_inputs_ref
from mllmd_kernels.extend_attention import extend_attention, extend_attention_ref
from mllmd_kernels.gemv import GemvConfig, gemv, gemv_ref, pick_gemv_config
from mllmd_kernels.int8_config import Int8GemmConfig, pick_int8_config
from mllmd_kernels.int8_gemm import (
    int8_gemm,
    int8_gemm_ref,
    int8_gemm_silu_mul,
    int8_gemm_silu_mul_amax,
    w8a8_linear,
    w8a8_linear_ref,
)
from mllmd_kernels.int8_quant import int8_quant, int8_quant_ref
from mllmd_kernels.kv_indices import kv_indices, kv_indices_ref
from mllmd_kernels.rmsnorm import rmsnorm, rmsnorm_int8, rmsnorm_int8_ref, rmsnorm_ref
from mllmd_kernels.rope import rope, rope_fp32_ref, rope_ref
from mllmd_kernels.sampling import (
    GreedyWorkspace,
    greedy_argmax,
    greedy_argmax_ref,
    gumbel_argmax,
    gumbel_argmax_ref,
)
from mllmd_kernels.store_cache import store_cache, store_cache_ref, store_cache_triton
from mllmd_kernels.w4a16_config import W4A16Config, pick_w4a16_config, prefers_dequant, splitk_counter_len
from mllmd_kernels.w4a16_dequant import (
    DEQUANT_F32,
    SCALE_DTYPES,
    dequant_mode,
    dequantize_int4_ref,
    pack_int4_ref,
    scales_exact_in,
    unpack_int4_ref,
    w4a16_dequantize,
)
from mllmd_kernels.w4a16_gemm import w4a16_gemm, w4a16_gemm_ref

# isort: split
# Gated DeltaNet (Qwen3.5) kernels.
from mllmd_kernels.causal_conv1d import (
    causal_conv1d_decode,
    causal_conv1d_decode_ref,
    causal_conv1d_prefill,
    causal_conv1d_prefill_ref,
)
from mllmd_kernels.gated_delta_rule_chunk import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_ref,
    gated_delta_rule_chunked_ref,
)
from mllmd_kernels.gated_delta_rule_decode import (
    fused_gdn_gating_decode,
    fused_gdn_gating_decode_ref,
    fused_recurrent_gated_delta_rule_decode,
    fused_recurrent_gated_delta_rule_decode_ref,
    gated_delta_rule_recurrent_ref,
    gdn_gating_ref,
)
from mllmd_kernels.gated_rmsnorm import gated_rmsnorm, gated_rmsnorm_ref
from mllmd_kernels.rmsnorm_zero_centred import rmsnorm_zero_centred, rmsnorm_zero_centred_ref

__all__ = [
    "pdl_launches",
    "HAS_TRITON",
    "GemvConfig",
    "Int8GemmConfig",
    "DEQUANT_F32",
    "SCALE_DTYPES",
    "W4A16Config",
    "decode_attention",
    "decode_inputs",
    "decode_inputs_ref",
    "decode_attention_ref",
    "decode_num_splits",
    "dequant_mode",
    "dequantize_int4_ref",
    "extend_attention",
    "extend_attention_ref",
    "gemv",
    "gemv_ref",
    "GreedyWorkspace",
    "greedy_argmax",
    "greedy_argmax_ref",
    "gumbel_argmax",
    "gumbel_argmax_ref",
    "int8_gemm",
    "int8_gemm_ref",
    "int8_gemm_silu_mul",
    "int8_gemm_silu_mul_amax",
    "int8_quant",
    "int8_quant_ref",
    "interpreting",
    "kv_indices",
    "kv_indices_ref",
    "pack_int4_ref",
    "pick_gemv_config",
    "pick_int8_config",
    "pick_w4a16_config",
    "prefers_dequant",
    "splitk_counter_len",
    "rmsnorm",
    "rmsnorm_int8",
    "rmsnorm_int8_ref",
    "rmsnorm_ref",
    "rope",
    "rope_fp32_ref",
    "rope_ref",
    "sigmoid_gate",
    "sigmoid_gate_ref",
    "silu_and_mul",
    "silu_and_mul_int8",
    "silu_and_mul_int8_ref",
    "silu_and_mul_ref",
    "scales_exact_in",
    "store_cache",
    "store_cache_ref",
    "store_cache_triton",
    "triton_available",
    "triton_runnable",
    "unpack_int4_ref",
    "w4a16_dequantize",
    "w4a16_gemm",
    "w4a16_gemm_ref",
    "w8a8_linear",
    "w8a8_linear_ref",
    "causal_conv1d_decode",
    "causal_conv1d_decode_ref",
    "causal_conv1d_prefill",
    "causal_conv1d_prefill_ref",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_ref",
    "gated_delta_rule_chunked_ref",
    "fused_gdn_gating_decode",
    "fused_gdn_gating_decode_ref",
    "fused_recurrent_gated_delta_rule_decode",
    "fused_recurrent_gated_delta_rule_decode_ref",
    "gated_delta_rule_recurrent_ref",
    "gdn_gating_ref",
    "gated_rmsnorm",
    "gated_rmsnorm_ref",
    "rmsnorm_zero_centred",
    "rmsnorm_zero_centred_ref",
]
