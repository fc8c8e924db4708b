"""SamplingBatchInfo: the per-step sampling tensors of a batch, built once on the target device."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from mllmd_kernels.gumbel import row_keys

from mllmd.engine.device_io import to_device
from mllmd.engine.sampling.penalties import unique_tokens
from mllmd.sampling_params import SamplingParams


def _index(rows: list[int], total: int, device: torch.device) -> torch.Tensor | None:
    """int64 [len(rows)] index tensor, or None when rows is exactly range(total)."""
    if rows == list(range(total)):
        return None
    return to_device(rows, torch.int64, device)


@dataclass
class SamplingBatchInfo:
    """Tensors for one sampler step of B rows over a vocabulary of V.

    Index tensors select a subset of rows; None means "all rows, in order" (no gather needed). The
    sampled-row parameters are aligned with `sample_idx`, the filter parameters with `filter_idx`
    (positions among the sampled rows); penalties are sparse (row, token) entries.
    """

    batch_size: int
    vocab_size: int
    device: torch.device
    seeds: list[int]
    positions: list[int]  # output index of the token each row samples
    # greedy rows (temperature 0): argmax of the biased, penalised logits
    num_greedy: int
    greedy_idx: torch.Tensor | None  # [G]
    # sampled rows: Gumbel-max on temperature-scaled, filtered logits
    num_sampled: int
    sample_idx: torch.Tensor | None  # [S]
    temperatures: torch.Tensor | None  # [S] float32, > 0
    keys: torch.Tensor | None  # [S, 2] int64 row keys of (seed, position)
    num_filtered: int  # sampled rows using top-k, top-p or min-p
    filter_idx: torch.Tensor | None  # [F] positions in the sampled rows
    plain_idx: torch.Tensor | None  # [S - F] positions in the sampled rows
    top_k: torch.Tensor | None  # [F] int64 (V = off); None if no row uses top-k
    top_p: torch.Tensor | None  # [F] float32 (1 = off); None if no row uses top-p
    min_p: torch.Tensor | None  # [F] float32 (0 = off); None if no row uses min-p
    # logit bias as sparse triples
    bias_rows: torch.Tensor | None  # [N] int64
    bias_cols: torch.Tensor | None  # [N] int64
    bias_vals: torch.Tensor | None  # [N] float32
    # repetition penalty over prompt + output tokens: distinct (row, token) pairs
    rep_rows: torch.Tensor | None  # [N] int64
    rep_cols: torch.Tensor | None  # [N] int64
    rep_penalty: torch.Tensor | None  # [N] float32, the row's penalty
    # frequency / presence penalties over output tokens: distinct (row, token) pairs
    fp_rows: torch.Tensor | None  # [M] int64
    fp_cols: torch.Tensor | None  # [M] int64
    fp_counts: torch.Tensor | None  # [M] float32, > 0
    frequency: torch.Tensor | None  # [M] float32, the row's frequency penalty
    presence: torch.Tensor | None  # [M] float32, the row's presence penalty
    # logprobs (of the raw logits)
    want_logprobs: bool
    num_top_logprobs: int  # K = max top_logprobs in the batch

    @property
    def has_bias(self) -> bool:
        return self.bias_rows is not None

    @property
    def has_penalties(self) -> bool:
        return self.rep_rows is not None or self.fp_rows is not None

    @property
    def needs_processing(self) -> bool:
        """Whether logits change before selection (bias or penalties)."""
        return self.has_bias or self.has_penalties

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        vocab_size: int,
        device: torch.device | str = "cpu",
        positions: list[int] | None = None,
    ) -> SamplingBatchInfo:
        """Row i samples the token at output index len(output_ids[i]) of request i with seed seeds[i].

        Penalty tensors are built only when some row uses them, noise keys only for sampled rows.
        `positions` (output indices) may be given instead: then output_ids[i] is only read for rows
        with penalties, and may be empty for the others.
        """
        b = len(params)
        if not (len(seeds) == len(prompt_ids) == len(output_ids) == b):
            raise ValueError(
                f"params, seeds, prompt_ids and output_ids must have one entry per row "
                f"(got {b}, {len(seeds)}, {len(prompt_ids)}, {len(output_ids)})"
            )
        dev = torch.device(device)
        v = vocab_size
        if positions is None:
            positions = [len(o) for o in output_ids]

        def f32(xs: list[float]) -> torch.Tensor:
            return to_device(xs, torch.float32, dev)

        greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
        sampled = [i for i, p in enumerate(params) if p.temperature != 0.0]
        sp = [params[i] for i in sampled]
        temperatures = keys = None
        top_k = top_p = min_p = None
        filt: list[int] = []
        plain: list[int] = []
        if sp:
            temperatures = f32([p.temperature for p in sp])
            keys = to_device(row_keys([seeds[i] for i in sampled], [positions[i] for i in sampled]), torch.int64, dev)
            ks = [p.top_k if 0 < p.top_k < v else v for p in sp]
            ps = [p.top_p if p.top_p < 1.0 else 1.0 for p in sp]
            ms = [p.min_p if p.min_p > 0.0 else 0.0 for p in sp]
            filt = [j for j in range(len(sp)) if ks[j] < v or ps[j] < 1.0 or ms[j] > 0.0]
            plain = sorted(set(range(len(sp))) - set(filt))
            if any(ks[j] < v for j in filt):
                top_k = to_device([ks[j] for j in filt], torch.int64, dev)
            if any(ps[j] < 1.0 for j in filt):
                top_p = f32([ps[j] for j in filt])
            if any(ms[j] > 0.0 for j in filt):
                min_p = f32([ms[j] for j in filt])

        bias_rows = bias_cols = bias_vals = None
        triples = [(i, t, b_) for i, p in enumerate(params) for t, b_ in (p.logit_bias or {}).items()]
        if triples:
            for _, t, _ in triples:
                if not 0 <= t < v:
                    raise ValueError(f"logit_bias: token id {t} is outside the vocabulary of {v}")
            bias_rows = to_device([r for r, _, _ in triples], torch.int64, dev)
            bias_cols = to_device([t for _, t, _ in triples], torch.int64, dev)
            bias_vals = f32([x for _, _, x in triples])

        rep_rows = rep_cols = rep_penalty = None
        rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if rep:
            lists = [list(prompt_ids[i]) + list(output_ids[i]) for i in rep]
            sub, rep_cols, _ = unique_tokens(lists, v, dev)
            row_of = to_device(rep, torch.int64, dev)
            rep_rows = row_of[sub]
            rep_penalty = f32([params[i].repetition_penalty for i in rep])[sub]

        fp_rows = fp_cols = fp_counts = frequency = presence = None
        fp = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
        if fp:
            sub, fp_cols, fp_counts = unique_tokens([list(output_ids[i]) for i in fp], v, dev)
            fp_rows = to_device(fp, torch.int64, dev)[sub]
            frequency = f32([params[i].frequency_penalty for i in fp])[sub]
            presence = f32([params[i].presence_penalty for i in fp])[sub]

        return cls(
            batch_size=b,
            vocab_size=v,
            device=dev,
            seeds=[int(s) for s in seeds],
            positions=positions,
            num_greedy=len(greedy),
            greedy_idx=_index(greedy, b, dev) if greedy else None,
            num_sampled=len(sampled),
            sample_idx=_index(sampled, b, dev) if sampled else None,
            temperatures=temperatures,
            keys=keys,
            num_filtered=len(filt),
            filter_idx=_index(filt, len(sp), dev) if filt else None,
            plain_idx=_index(plain, len(sp), dev) if plain else None,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            bias_rows=bias_rows,
            bias_cols=bias_cols,
            bias_vals=bias_vals,
            rep_rows=rep_rows,
            rep_cols=rep_cols,
            rep_penalty=rep_penalty,
            fp_rows=fp_rows,
            fp_cols=fp_cols,
            fp_counts=fp_counts,
            frequency=frequency,
            presence=presence,
            want_logprobs=any(p.logprobs or p.top_logprobs > 0 for p in params),
            num_top_logprobs=max((p.top_logprobs for p in params), default=0),
        )
