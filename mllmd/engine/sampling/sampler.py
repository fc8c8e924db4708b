"""The sampler: one call per engine step on the logits of the rows that need a token.

Processing, on a float32 copy of the logits (the input is modified only where the caller allows it,
`inplace`, and no logprobs are asked for):

0. structured outputs: a grammar-constrained row's disallowed tokens are set to -inf (token_mask).
1. logit bias; repetition penalty (prompt + output tokens); frequency / presence penalties
   (output tokens) — see penalties.py.
2. Greedy rows (temperature 0): argmax of those logits (first index on ties); no noise.
3. Sampled rows: ``z = (logits - max) / T``; top-k, top-p, min-p keep a candidate set (filters.py);
   the token is the Gumbel-max ``argmax(z + g)`` over the candidates (smallest id on ties), with g
   from the stateless stream of (seed, output position, token id) (mllmd_kernels/gumbel.py). A seeded row thus
   samples the same token whatever the batch holds.
4. Logprobs of the raw logits as given (logprobs.py).

Fast paths: an all-greedy batch without bias or penalties is a bare argmax (on CUDA one Triton launch,
mllmd_kernels.greedy_argmax, which also fills the engine's token buffer); on CUDA the sampled rows go
through one Triton kernel (mllmd_kernels.gumbel_argmax: the same tokens, without the [rows, V] noise and
score tensors), a filtered row with the smallest scaled logit its filters keep as its floor (the kept
set is every token at or above it, filters.py); each group of rows is gathered from the logits once;
penalty tensors exist
only when some row uses them; noise is drawn only for sampled rows, and for filtered rows only for
their candidates. On CPU the filters look at a top-256 prefix first (no full sort in the usual
case); on other devices they sort, which needs no device-to-host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from mllmd_kernels import GreedyWorkspace, greedy_argmax, gumbel_argmax
from mllmd_kernels._triton import use_triton
from mllmd_kernels.gumbel import add_gumbel_noise_, gumbel

from mllmd.engine.sampling.filters import select_candidates
from mllmd.engine.sampling.logprobs import compute_logprobs
from mllmd.engine.sampling.penalties import apply_logit_bias, apply_penalties
from mllmd.engine.sampling.states import SamplingBatchInfo
from mllmd.structured.mask import apply_token_bitmask

# Sorted prefix examined by the filters before a full sort (CPU); see filters.select_candidates.
CPU_PREFIX_WIDTH = 256


# (bitmask [R, W] int32, rows [R] int64), on the logits' device: row rows[i] may take only the tokens
# whose bits are set in bitmask[i] (structured outputs; mllmd/structured/mask.py)
TokenMask = tuple[torch.Tensor, torch.Tensor]

# (buffer, rows): also write row i's token to buffer[rows[i]] (the engine's device-side token buffer)
TokenSink = tuple[torch.Tensor, torch.Tensor]


def fill_token_sink(sink: TokenSink | None, tokens: torch.Tensor) -> None:
    """buffer[rows] = tokens, for a sampler path that did not write the sink itself."""
    if sink is not None:
        sink[0][sink[1]] = tokens


@dataclass
class SamplerOutput:
    """Per-row results; top entries have K columns for every row (slice to each request's own)."""

    next_token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, raw logprob of the chosen token
    top_logprob_ids: torch.Tensor | None  # [B, K] int64, K = max top_logprobs in the batch
    top_logprobs: torch.Tensor | None  # [B, K] float32, descending


def _take(x: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    return x if idx is None else x[idx]


def _compose(outer: torch.Tensor | None, inner: torch.Tensor | None) -> torch.Tensor | None:
    """The rows outer[inner] (None: all rows, in order, at either level)."""
    if inner is None:
        return outer
    return inner if outer is None else outer[inner]


def _scaled(x: torch.Tensor, rows: torch.Tensor | None, temperatures: torch.Tensor) -> torch.Tensor:
    """(x[rows] - row max) / T as a new [R, V] float32 tensor (row max 0); x is not modified."""
    if rows is None:
        z = x - x.max(dim=-1, keepdim=True).values
    else:
        z = x[rows]  # a copy of its own
        z.sub_(z.max(dim=-1, keepdim=True).values)
    return z.div_(temperatures[:, None])


def _put(x: torch.Tensor, idx: torch.Tensor | None, val: torch.Tensor) -> torch.Tensor:
    """x[idx] = val (idx None: all rows); returns x, or val itself when it replaces all of x."""
    if idx is None:
        return val
    x[idx] = val
    return x


def gumbel_max_candidates(
    vals: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """argmax over kept candidates of vals + g(id): vals/ids/keep [N, W], keys [N, 2] -> ids [N].

    Ties go to the smallest vocabulary id, as torch.argmax does on a dense row.
    """
    scores = torch.where(keep, vals + gumbel(keys, ids), float("-inf"))  # [N, W]
    best = scores.max(dim=-1, keepdim=True).values  # [N, 1]
    big = torch.iinfo(torch.int64).max
    return torch.where(scores == best, ids, big).min(dim=-1).values


def process_logits(logits: torch.Tensor, info: SamplingBatchInfo, inplace: bool = False) -> torch.Tensor:
    """float32 logits [B, V] with bias and penalties applied (a copy when anything applies, unless
    `inplace`: the input itself, when it is float32, is modified then)."""
    x = logits.float()
    if not info.needs_processing:
        return x  # only read from here on
    if x is logits and not inplace:
        x = x.clone()
    if info.bias_rows is not None:
        assert info.bias_cols is not None and info.bias_vals is not None
        apply_logit_bias(x, info.bias_rows, info.bias_cols, info.bias_vals)
    if info.penalty_idx is not None:
        apply_penalties(x, info)
    return x


class Sampler:
    """Picks the next token of each row; see the module docstring for the exact semantics.

    prefix_width: how many top tokens per row the filters examine before falling back to a full
    sort (None: 256 on CPU, a full sort elsewhere, which needs no device-to-host sync).
    """

    def __init__(self, prefix_width: int | None = None) -> None:
        self.prefix_width = prefix_width
        self._greedy_ws: GreedyWorkspace | None = None  # greedy_argmax's scratch (CUDA), grown on demand

    def __call__(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        token_sink: TokenSink | None = None,
        token_mask: TokenMask | None = None,
        inplace: bool = False,
    ) -> SamplerOutput:
        """logits [B, V] of any float dtype -> SamplerOutput.

        inplace: the caller reads the logits no more, so bias, penalties and a token mask may be applied
        to them in place (not when logprobs are wanted: those are the raw logits').

        token_sink (buffer, rows): also write row i's token to buffer[rows[i]] (the engine's
        device-side token buffer); an all-greedy batch on CUDA does it in its argmax launch.
        token_mask: the grammar-constrained rows' allowed tokens; the logprobs stay those of the raw
        logits (as without a grammar)."""
        if logits.dim() != 2 or tuple(logits.shape) != (info.batch_size, info.vocab_size):
            raise ValueError(
                f"logits must be [{info.batch_size}, {info.vocab_size}], got {tuple(logits.shape)}"
            )
        raw = logits
        inplace = inplace and not info.want_logprobs
        if token_mask is not None:
            logits = logits.float()
            if logits is raw and not inplace:
                logits = logits.clone()
            apply_token_bitmask(logits, *token_mask)
            inplace = True  # a copy of our own, or the caller's to modify
        if info.num_sampled == 0 and not info.needs_processing:
            if use_triton(logits) and logits.stride(1) == 1:  # one launch, the sink included
                tokens = greedy_argmax(logits, self._greedy_workspace(logits), sink=token_sink)
                token_sink = None
            else:
                tokens = logits.max(dim=-1).indices  # [B] max() is faster than argmax on CPU, same first-index ties
        else:
            x = process_logits(logits, info, inplace)  # [B, V] float32
            tokens = torch.empty(info.batch_size, dtype=torch.int64, device=logits.device)
            if info.num_greedy:
                tokens = _put(tokens, info.greedy_idx, _take(x, info.greedy_idx).argmax(dim=-1))
            if info.num_sampled:
                tokens = _put(tokens, info.sample_idx, self._sample(x, info))
        fill_token_sink(token_sink, tokens)
        if not info.want_logprobs:
            return SamplerOutput(tokens, None, None, None)
        lp, top_ids, top_lp = compute_logprobs(raw, tokens, info.num_top_logprobs)
        return SamplerOutput(tokens, lp, top_ids, top_lp)

    def _greedy_workspace(self, logits: torch.Tensor) -> GreedyWorkspace:
        rows, vocab = logits.shape
        ws = self._greedy_ws
        if ws is None or not ws.fits(rows, vocab, logits.device):
            grow = max(rows, 2 * ws.rows if ws is not None and ws.vocab_size == vocab else 0)
            ws = self._greedy_ws = GreedyWorkspace(grow, vocab, logits.device)
        return ws

    def _sample(self, x: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Gumbel-max over the sampled rows of x [B, V] float32 -> token ids [S] (in sample_idx order).

        Each group (unfiltered, filtered) is gathered from x once; on CUDA both run in gumbel_argmax."""
        assert info.temperatures is not None and info.keys is not None
        b, v = x.shape
        fused = use_triton(x) and x.stride(1) == 1  # CUDA: one kernel a row, the same tokens
        out = torch.empty(info.num_sampled, dtype=torch.int64, device=x.device)
        if info.num_filtered < info.num_sampled:  # unfiltered rows: argmax(z + g) over every column
            rows = _compose(info.sample_idx, info.plain_idx)
            keys, temps = _take(info.keys, info.plain_idx), _take(info.temperatures, info.plain_idx)
            if fused:
                tok = gumbel_argmax(x, torch.arange(b, device=x.device) if rows is None else rows, keys, temps)
            else:
                tok = add_gumbel_noise_(_scaled(x, rows, temps), keys).argmax(dim=-1)
            out = _put(out, info.plain_idx, tok)
        if info.num_filtered:
            rows = _compose(info.sample_idx, info.filter_idx)
            keys, temps = _take(info.keys, info.filter_idx), _take(info.temperatures, info.filter_idx)
            zf = _scaled(x, rows, temps)  # [F, V]
            width = self.prefix_width
            if width is None:
                width = CPU_PREFIX_WIDTH if x.device.type == "cpu" else v  # elsewhere a full sort: no sync
            picked = torch.empty(zf.shape[0], dtype=torch.int64, device=x.device)
            floors = torch.empty(zf.shape[0], dtype=torch.float32, device=x.device) if fused else None
            for c in select_candidates(zf, info.top_k, info.top_p, info.min_p, width):
                if floors is not None:  # the kept set is every token at or above its last one
                    floors = _put(floors, c.rows, c.vals.gather(1, (c.keep.sum(dim=-1) - 1)[:, None]).squeeze(1))
                else:
                    picked = _put(picked, c.rows, gumbel_max_candidates(c.vals, c.ids, c.keep, _take(keys, c.rows)))
            if floors is not None:
                picked = gumbel_argmax(x, torch.arange(b, device=x.device) if rows is None else rows, keys, temps,
                                       floors=floors)  # fmt: skip
            out = _put(out, info.filter_idx, picked)
        return out
