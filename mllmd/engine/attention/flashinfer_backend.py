"""FlashInfer attention backend: paged decode and paged prefill-with-prefix (used when importable).

The KV pool is token-level (page size 1): each layer's [S, Hkv, D] buffer is FlashInfer's NHD paged
cache viewed as [S, 1, Hkv, D]. Per step (not per layer) the backend builds the flat KV-slot list on
the device (`mllmd_kernels.kv_indices`) and plans the wrapper from host-side lengths the scheduler
already has, so planning never waits for the GPU; every layer then only runs the planned kernel.

FlashInfer computes in fp16/bf16 only; float32 models use the triton backend. Decode CUDA graphs are
not wired for this backend yet (`supports_cuda_graph = False`): its plan must run before each replay
with fixed-size buffers per captured batch size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from mllmd_kernels import kv_indices

from mllmd.engine.attention.base import AttentionBackend, PagedAttentionStep
from mllmd.engine.forward_batch import ForwardBatch
from mllmd.engine.memory import KVPool

WORKSPACE_BYTES = 256 << 20
HEAD_DIMS = (64, 128, 256)  # what FlashInfer's prefill kernels are built for (0.6.x)


def flashinfer_importable() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA/JIT environment
        return False
    return True


@dataclass
class _Meta:
    wrapper: Any  # the planned decode or prefill wrapper
    decode: bool


class FlashInferAttentionBackend(AttentionBackend):
    supports_cuda_graph = False

    def __init__(
        self, kv_pool: KVPool, req_to_token: torch.Tensor, device: torch.device, num_qo_heads: int, scale: float,
        dtype: torch.dtype, head_dim: int | None = None,
    ) -> None:  # fmt: skip
        import flashinfer

        super().__init__(kv_pool, req_to_token)
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"runtime.attention_backend: flashinfer computes in float16 or bfloat16, not {dtype}; use triton"
            )
        if head_dim is not None and head_dim not in HEAD_DIMS:
            raise ValueError(
                f"runtime.attention_backend: flashinfer has no kernels for head_dim {head_dim} "
                f"(it has {', '.join(map(str, HEAD_DIMS))}); use triton"
            )
        self.device = device
        self.num_qo_heads = num_qo_heads
        self.scale = scale
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")

    def metadata(self, batch: ForwardBatch) -> _Meta:
        pool = self.kv_pool
        _, hkv, d = pool.k_buffer[0].shape
        seq_lens = batch.seq_lens_cpu
        bsz = len(seq_lens)
        kv_indptr_host = torch.zeros(bsz + 1, dtype=torch.int32)
        kv_indptr_host[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int32), 0)
        total = int(sum(seq_lens))
        kv_indptr_dev = torch.zeros(bsz + 1, dtype=torch.int32, device=self.device)
        kv_indptr_dev[1:] = torch.cumsum(batch.seq_lens, 0)
        indices = kv_indices(self.req_to_token, batch.req_pool_indices, batch.seq_lens,
                             kv_indptr_dev, total)
        last_page_len = torch.ones(bsz, dtype=torch.int32)
        num_qo_heads = self.num_qo_heads
        if batch.is_decode:
            self._decode.plan(
                kv_indptr_host, indices, last_page_len, num_qo_heads, hkv, d, 1,
                q_data_type=pool.dtype, kv_data_type=pool.dtype, sm_scale=self.scale,
            )
            return _Meta(self._decode, True)
        qo_indptr_host = torch.zeros(bsz + 1, dtype=torch.int32)
        qo_indptr_host[1:] = torch.cumsum(torch.tensor(batch.extend_lens_cpu, dtype=torch.int32), 0)
        self._prefill.plan(
            qo_indptr_host, kv_indptr_host, indices, last_page_len, num_qo_heads, hkv, d, 1,
            causal=True, q_data_type=pool.dtype, kv_data_type=pool.dtype, sm_scale=self.scale,
        )
        return _Meta(self._prefill, False)

    def attend(
        self, step: PagedAttentionStep, layer: int, q: torch.Tensor, scale: float, out_absmax: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pool = self.kv_pool
        k_cache = pool.k_buffer[layer].unsqueeze(1)  # [S, page=1, Hkv, D]
        v_cache = pool.v_buffer[layer].unsqueeze(1)
        if q.dtype != pool.dtype:
            q = q.to(pool.dtype)
        return step.meta.wrapper.run(q.contiguous(), (k_cache, v_cache)), None
