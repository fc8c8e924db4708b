"""The sampler's kernels: gumbel_argmax (seeded sampling of unfiltered rows in one kernel, bit for bit
the torch sampler) and greedy_argmax (an all-greedy batch's tokens in one launch).

gumbel_argmax: row s samples argmax_c ((x[c] - max(x)) / T + g(k, c)) over the whole vocabulary, where g is the
stateless Gumbel noise of `gumbel` (32-bit lowbias32 hashes of the column
under the row key k, mapped to (0, 1) and through -log(-log(u)) in float64, rounded to float32).
Ties go to the smallest column, as torch.argmax does. One program per row: a pass for the row max,
then a pass that hashes, adds and keeps the running argmax, so the [rows, V] noise and score tensors
the torch path materialises are never written. With `floors` (a filtered row: top-k, top-p, min-p keep
the tokens whose scaled logit z is at least some threshold, filters.py) only the columns with
z >= floor[s] compete: the sampler's filtered path, without its [rows, V] candidate and noise tensors.

The hash runs on uint32 words held in int64 and masked after each multiply, exactly as the torch
code does (products stay below 2^63), so the words are identical on any device.

greedy_argmax: torch's argmax over a [B, 151936] row is a memset and a two-pass reduction, then the
engine scatters the tokens into its device-side token buffer (a host-to-device copy of the rows and an
index_put): four operations between decode steps. Here 4,096-column chunks each find their first
maximum, and the last chunk of a row to finish (an arrival counter) picks the row's token and also
writes it into that buffer: one launch.
"""

from __future__ import annotations

import torch

from mllmd_kernels._triton import cdiv, next_pow2, tl, triton
from mllmd_kernels.gumbel import gumbel_noise


def gumbel_argmax_ref(
    logits: torch.Tensor,  # [B, V] float32
    rows: torch.Tensor,  # [S] int64: the logits row of each sampled row
    keys: torch.Tensor,  # [S, 2] int64 row keys (gumbel.row_keys)
    temperatures: torch.Tensor,  # [S] float32 > 0
    floors: torch.Tensor | None = None,  # [S] float32: only columns with z >= floor compete
) -> torch.Tensor:
    """Torch reference, the sampler's own unfiltered path (with floors: the filtered one's candidates):
    int64 [S]."""
    x = logits[rows].float()
    z = (x - x.max(dim=-1, keepdim=True).values).div_(temperatures[:, None])
    score = z + gumbel_noise(keys, x.shape[1])
    if floors is not None:
        score = torch.where(z >= floors[:, None], score, float("-inf"))
    return score.argmax(dim=-1)


@triton.jit
def _mix32(x):
    """gumbel.mix32 on uint32 words held in int64 (the same multipliers, masked the same way)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride_l, rows_ptr, keys_ptr, temps_ptr, floors_ptr, out_ptr, V,
                          HAS_FLOOR: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.program_id(0)
    base = logits_ptr + tl.load(rows_ptr + s).to(tl.int64) * stride_l
    offs = tl.arange(0, BLOCK)
    row_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    for off in range(0, V, BLOCK):
        x = tl.load(base + off + offs, mask=off + offs < V, other=float("-inf"))
        row_max = tl.maximum(row_max, x)
    m = tl.max(row_max, axis=0)
    t = tl.load(temps_ptr + s)
    k0 = tl.load(keys_ptr + 2 * s)
    k1 = tl.load(keys_ptr + 2 * s + 1)
    floor = float("-inf")  # no floor: every column competes
    if HAS_FLOOR:
        floor = tl.load(floors_ptr + s)
    best = float("-inf")
    best_idx = 0
    for off in range(0, V, BLOCK):
        cols = off + offs
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=0.0)
        z = tl.math.div_rn(x - m, t)  # correctly rounded, as torch's division
        h = _mix32(_mix32(cols.to(tl.int64) ^ k0) ^ k1)
        u = (h.to(tl.float64) + 0.5) * 2.3283064365386963e-10  # 2^-32, exact
        g = (-tl.log(-tl.log(u))).to(tl.float32)
        score = tl.where(mask & (z >= floor), z + g, float("-inf"))
        blk = tl.max(score, axis=0)
        idx = tl.min(tl.where(score == blk, cols, V), axis=0)  # first column holding the block max
        take = blk > best  # strictly: an earlier block keeps ties
        best_idx = tl.where(take, idx, best_idx)
        best = tl.where(take, blk, best)
    tl.store(out_ptr + s, best_idx.to(tl.int64))


def gumbel_argmax(
    logits: torch.Tensor,  # [B, V] float32 (row stride any, columns contiguous)
    rows: torch.Tensor,  # [S] int64
    keys: torch.Tensor,  # [S, 2] int64
    temperatures: torch.Tensor,  # [S] float32
    out: torch.Tensor | None = None,  # [S] int64
    floors: torch.Tensor | None = None,  # [S] float32: only columns with z >= floor compete
) -> torch.Tensor:
    """Triton version of gumbel_argmax_ref (same tokens); no host synchronisation. A floor must keep
    the row's top column (floor <= 0: z's maximum is 0)."""
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    keys = keys.contiguous()
    s = rows.numel()
    if out is None:
        out = torch.empty(s, dtype=torch.int64, device=logits.device)
    if s:
        _gumbel_argmax_kernel[(s,)](
            logits, logits.stride(0), rows, keys, temperatures, temperatures if floors is None else floors, out,
            logits.shape[1], HAS_FLOOR=floors is not None, BLOCK=1024, num_warps=8,
        )
    return out


def greedy_argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """Torch reference: each row's first index of its largest value, int64 [B]."""
    return logits.float().argmax(dim=-1)


GREEDY_BLOCK = 4096  # columns a program reduces (bf16: 8 KB); Qwen3's 151,936 columns are 38 programs a row


class GreedyWorkspace:
    """Scratch of greedy_argmax: per-(row, chunk) partial maxima and per-row arrival counters (zero
    between launches: the last program of a row resets its counter). One per device and stream."""

    def __init__(self, rows: int, vocab_size: int, device: torch.device | str) -> None:
        self.rows, self.vocab_size = rows, vocab_size
        self.chunks = cdiv(vocab_size, GREEDY_BLOCK)
        self.values = torch.empty(rows * self.chunks, dtype=torch.float32, device=device)
        self.indices = torch.empty(rows * self.chunks, dtype=torch.int32, device=device)
        self.counters = torch.zeros(rows, dtype=torch.int32, device=device)

    def fits(self, rows: int, vocab_size: int, device: torch.device) -> bool:
        return rows <= self.rows and vocab_size == self.vocab_size and self.counters.device == device


@triton.jit
def _greedy_argmax_kernel(
    logits_ptr,  # [B, V], columns contiguous
    stride_l,
    V,
    val_ptr,  # [B * CHUNKS] float32 partial maxima
    idx_ptr,  # [B * CHUNKS] int32 their first columns
    count_ptr,  # [B] int32 arrival counters, 0 between launches
    out_ptr,  # [B] int64 tokens
    sink_ptr,  # int64 buffer that also receives row b's token at sink_rows[b] (HAS_SINK)
    sink_rows_ptr,  # [B] int64
    CHUNKS,
    BLOCK: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    HAS_SINK: tl.constexpr,
):
    """Program (c, b) finds the first maximum of row b's chunk c; the row's last program to arrive
    takes the first maximum over the chunks in chunk order (whichever program is last) and writes the
    token. The barrier and the acq_rel atomic publish a program's partial before it counts."""
    c = tl.program_id(0)
    b = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + b.to(tl.int64) * stride_l + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN counts as the largest value, as in torch.max
    m = tl.max(x, axis=0)
    first = tl.min(tl.where(x == m, cols, V), axis=0)  # an all -inf chunk still has an in-range column
    tl.store(val_ptr + b * CHUNKS + c, m)
    tl.store(idx_ptr + b * CHUNKS + c, first)
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + b, 1, sem="acq_rel")
    if arrived == CHUNKS - 1:
        offs = tl.arange(0, CHUNKS_P2)
        ok = offs < CHUNKS
        vals = tl.load(val_ptr + b * CHUNKS + offs, mask=ok, other=float("-inf"), cache_modifier=".cg")
        idxs = tl.load(idx_ptr + b * CHUNKS + offs, mask=ok, other=V, cache_modifier=".cg")
        best = tl.max(vals, axis=0)
        tok = tl.min(tl.where(vals == best, idxs, V), axis=0).to(tl.int64)
        tl.store(out_ptr + b, tok)
        if HAS_SINK:
            tl.store(sink_ptr + tl.load(sink_rows_ptr + b), tok)
        tl.atomic_xchg(count_ptr + b, 0)


def greedy_argmax(
    logits: torch.Tensor,  # [B, V] float32 / bf16 / fp16, columns contiguous
    workspace: GreedyWorkspace,
    out: torch.Tensor | None = None,  # [B] int64
    sink: tuple[torch.Tensor, torch.Tensor] | None = None,  # (buffer int64, rows int64 [B])
) -> torch.Tensor:
    """Each row's first index of its largest value (torch.argmax's tokens; a NaN counts as the largest,
    as in torch.max, though an earlier +inf would win here) in one launch, with no host synchronisation;
    with `sink`, row b's token is also written to sink[0][sink[1][b]] (the engine's device-side token
    buffer), saving a scatter launch."""
    b, v = logits.shape
    assert logits.stride(1) == 1, "greedy_argmax needs contiguous columns"
    assert workspace.fits(b, v, logits.device), "workspace too small for this batch or another vocabulary"
    if out is None:
        out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    buf, rows = sink if sink is not None else (out, out)
    if sink is not None:
        assert buf.dtype == torch.int64 and rows.dtype == torch.int64 and rows.numel() == b
    chunks = workspace.chunks
    _greedy_argmax_kernel[(chunks, b)](
        logits, logits.stride(0), v, workspace.values, workspace.indices, workspace.counters, out, buf, rows,
        chunks, BLOCK=GREEDY_BLOCK, CHUNKS_P2=next_pow2(chunks), HAS_SINK=sink is not None,
        num_warps=4,
    )
    return out
