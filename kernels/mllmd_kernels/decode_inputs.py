"""decode_inputs: the first kernel of a decode (or prefill) CUDA graph, which completes the step's inputs in place.

With overlap scheduling a decode's input token is usually still on the device (the previous step
sampled it into the engine's token buffer, one entry per request row), and every decode writes its
new KV slot into the request table. Done by the host these were five operations between steps (two
host-to-device copies, a gather, a scatter into the ids, a scatter into the table); here, for each
row b of a staged step:

* fill[b] != 0: input_ids[b] = token_buf[req_pool_indices[b]];
* out_cache_loc[b] != 0: req_to_token[req_pool_indices[b], positions[b]] = out_cache_loc[b]. Slot 0 is
  the KV pool's reserved slot, never a request's, so a padding row (slot 0) writes nothing.
"""

from __future__ import annotations

import torch

from mllmd_kernels._triton import cdiv, next_pow2, tl, triton


def decode_inputs_ref(
    input_ids: torch.Tensor,  # [S] int64, updated in place
    positions: torch.Tensor,  # [S] int64
    out_cache_loc: torch.Tensor,  # [S] int64
    req_pool_indices: torch.Tensor,  # [S] int64
    fill: torch.Tensor,  # [S] int64, nonzero: the token is token_buf[req_pool_indices]
    token_buf: torch.Tensor,  # [R] int64
    req_to_token: torch.Tensor,  # [R, L] int64, updated in place
) -> None:
    """Torch reference (see the module docstring)."""
    take = fill != 0
    input_ids[take] = token_buf[req_pool_indices[take]]
    real = out_cache_loc != 0
    req_to_token[req_pool_indices[real], positions[real]] = out_cache_loc[real]


@triton.jit
def _decode_inputs_kernel(
    ids_ptr, pos_ptr, loc_ptr, rows_ptr, fill_ptr, token_buf_ptr, table_ptr, stride_t, S, BLOCK: tl.constexpr
):
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = b < S
    row = tl.load(rows_ptr + b, mask=ok, other=0)
    take = ok & (tl.load(fill_ptr + b, mask=ok, other=0) != 0)
    tok = tl.load(token_buf_ptr + row, mask=take, other=0)
    tl.store(ids_ptr + b, tok, mask=take)
    loc = tl.load(loc_ptr + b, mask=ok, other=0)
    pos = tl.load(pos_ptr + b, mask=ok, other=0)
    tl.store(table_ptr + row * stride_t + pos, loc, mask=ok & (loc != 0))


def decode_inputs(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    req_pool_indices: torch.Tensor,
    fill: torch.Tensor,
    token_buf: torch.Tensor,
    req_to_token: torch.Tensor,
) -> None:
    """Triton version of decode_inputs_ref: one launch, no host synchronisation (graph-capturable)."""
    s = input_ids.numel()
    for t in (input_ids, positions, out_cache_loc, req_pool_indices, fill, token_buf, req_to_token):
        assert t.dtype == torch.int64 and t.stride(-1) == 1, "decode_inputs takes contiguous int64 tensors"
    assert positions.numel() == out_cache_loc.numel() == req_pool_indices.numel() == fill.numel() == s
    if s == 0:
        return
    block = min(256, next_pow2(s))
    _decode_inputs_kernel[(cdiv(s, block),)](
        input_ids, positions, out_cache_loc, req_pool_indices, fill, token_buf, req_to_token,
        req_to_token.stride(0), s, BLOCK=block, num_warps=1 if block <= 64 else 4,
    )
