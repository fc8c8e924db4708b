"""kv_indices: the flat KV-slot list of a batch, as paged-attention libraries (FlashInfer) take it.

Row b of the batch owns slots req_to_token[req_pool_indices[b], :seq_lens[b]], written at
out[kv_indptr[b] : kv_indptr[b] + seq_lens[b]] (int32). Built on the device from the request table,
so no host synchronisation: the caller knows the total length from its host-side sequence lengths.
"""

from __future__ import annotations

import torch

from mllmd_kernels._triton import tl, triton


def kv_indices_ref(
    req_to_token: torch.Tensor,  # [R, L] int64
    req_pool_indices: torch.Tensor,  # [B] int64
    seq_lens: torch.Tensor,  # [B] int64
) -> torch.Tensor:
    """Torch reference: int32 [sum(seq_lens)]."""
    rows = [req_to_token[r, :n] for r, n in zip(req_pool_indices.tolist(), seq_lens.tolist())]
    if not rows:
        return torch.empty(0, dtype=torch.int32, device=req_to_token.device)
    return torch.cat(rows).to(torch.int32)


@triton.jit
def _kv_indices_kernel(
    table_ptr, rows_ptr, lens_ptr, indptr_ptr, out_ptr, stride_t, BLOCK: tl.constexpr
):
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b).to(tl.int64)
    n = tl.load(lens_ptr + b)
    start = tl.load(indptr_ptr + b)
    for off in range(0, n, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < n
        slots = tl.load(table_ptr + row * stride_t + offs, mask=mask, other=0)
        tl.store(out_ptr + start + offs, slots.to(tl.int32), mask=mask)


def kv_indices(
    req_to_token: torch.Tensor,  # [R, L] int64
    req_pool_indices: torch.Tensor,  # [B] int64
    seq_lens: torch.Tensor,  # [B] int64
    kv_indptr: torch.Tensor,  # [B + 1] int32/int64 on the device: exclusive prefix sum of seq_lens
    total: int,  # sum(seq_lens), known on the host
    out: torch.Tensor | None = None,  # [>= total] int32
) -> torch.Tensor:
    """Triton gather of each row's KV slots into one int32 list (see the module docstring)."""
    assert req_to_token.stride(1) == 1
    if out is None:
        out = torch.empty(total, dtype=torch.int32, device=req_to_token.device)
    bsz = req_pool_indices.numel()
    if bsz:
        _kv_indices_kernel[(bsz,)](
            req_to_token, req_pool_indices, seq_lens, kv_indptr, out, req_to_token.stride(0), BLOCK=512
        )
    return out
