"""Per-request sampling state, kept in rows indexed by the request's slot (vLLM Model Runner V2's
persistent request state).

A request's parameters are written into its slot's row once, when it is first sampled in that slot
(admission or re-admission after preemption); each step then reads the rows of its batch:

* host mirrors (numpy, `*_np`) tell which rows are greedy, filtered, biased or penalised, and give
  the per-row values, with array operations instead of a loop over Python objects; what the device
  needs of them goes up in one staged copy per dtype;
* penalty state lives on the device for every slot: each slot's output-token counts and the set of
  its prompt tokens, updated as tokens are sampled (`record`), so a step never rebuilds them from
  token lists. It is allocated when the first request with penalties arrives.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from mllmd_kernels.gumbel import row_keys_np, split_seed

from mllmd.engine.device_io import to_device_parts
from mllmd.sampling_params import SamplingParams

# float columns of a slot's row
TEMPERATURE, TOP_P, MIN_P, REPETITION, FREQUENCY, PRESENCE = range(6)


def uses_output_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


@dataclass
class SamplingBatchInfo:
    """Tensors for one sampler step of B rows over a vocabulary of V.

    Index tensors select a subset of rows; None means "all rows, in order" (no gather needed). The
    sampled-row parameters are aligned with `sample_idx`, the filter parameters with `filter_idx`
    (positions among the sampled rows); penalised rows with `penalty_idx`.
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
    # penalised rows and their state: rows penalty_slots of SamplingStates' [R, V] tensors
    penalty_idx: torch.Tensor | None  # [P] rows of the batch
    penalty_slots: torch.Tensor | None  # [P] their request slots
    penalty_rows_cpu: list[tuple[int, int]]  # (row, slot) of each penalised row
    output_counts: torch.Tensor | None  # [R, V] int32: each slot's output-token counts
    prompt_mask: torch.Tensor | None  # [R, V] bool: each slot's prompt tokens (None if no row has a repetition penalty)
    repetition: torch.Tensor | None  # [P, 1] float32 (1 = off); None if no row uses it
    frequency: torch.Tensor | None  # [P, 1] float32; None (with presence) if no row uses either
    presence: torch.Tensor | None  # [P, 1] float32
    # logprobs (of the raw logits)
    want_logprobs: bool
    num_top_logprobs: int  # K = max top_logprobs in the batch

    @property
    def has_bias(self) -> bool:
        return self.bias_rows is not None

    @property
    def has_penalties(self) -> bool:
        return self.penalty_idx is not None

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
        """The batch of requests given as lists (tests, one-off callers): row i samples the token at
        output index len(output_ids[i]) (or positions[i]) of request i with seed seeds[i]."""
        b = len(params)
        if not (len(seeds) == len(prompt_ids) == len(output_ids) == b):
            raise ValueError(
                f"params, seeds, prompt_ids and output_ids must have one entry per row "
                f"(got {b}, {len(seeds)}, {len(prompt_ids)}, {len(output_ids)})"
            )
        states = SamplingStates(b, vocab_size, torch.device(device))
        for slot in range(b):
            states.write(slot, params[slot], seeds[slot], prompt_ids[slot], output_ids[slot])
        pos = positions if positions is not None else [len(o) for o in output_ids]
        return states.batch(list(range(b)), pos)


class SamplingStates:
    """The sampling rows of `num_slots` request slots over a vocabulary of `vocab_size`."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.num_slots, self.vocab_size, self.device = num_slots, vocab_size, device
        r = num_slots
        self.floats_np = np.zeros((r, 6), dtype=np.float32)  # the float columns above
        self.top_k_np = np.zeros(r, dtype=np.int64)  # V where off
        self.seed_words_np = np.zeros((r, 2), dtype=np.int64)  # the seed's 32-bit words (lo, hi)
        self.seeds: list[int] = [0] * r
        self.filtered_np = np.zeros(r, dtype=bool)  # top-k, top-p or min-p in use
        self.penalised_np = np.zeros(r, dtype=bool)
        self.top_logprobs_np = np.zeros(r, dtype=np.int64)
        self.logprobs_np = np.zeros(r, dtype=bool)
        self.bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # slot -> (token ids, biases)
        self.owner: list[object] = [None] * r  # what each row was last written for
        # penalty state, for every slot once the first penalised request arrives
        self.output_counts: torch.Tensor | None = None  # [R, V] int32
        self.prompt_mask: torch.Tensor | None = None  # [R, V] bool

    @staticmethod
    def state_bytes(num_slots: int, vocab_size: int) -> int:
        """Device bytes of the penalty state (counts and prompt mask of every slot)."""
        return num_slots * vocab_size * 5

    # ---- writes ------------------------------------------------------------------------------
    def write(
        self, slot: int, params: SamplingParams, seed: int, prompt_ids: list[int], output_ids: list[int],
        owner: object = None,
    ) -> None:  # fmt: skip
        """Set slot's row for a request (its output so far counts towards its penalties)."""
        v = self.vocab_size
        p = params
        self.floats_np[slot] = (p.temperature, min(p.top_p, 1.0), max(p.min_p, 0.0), p.repetition_penalty,
                                p.frequency_penalty, p.presence_penalty)
        top_k = p.top_k if 0 < p.top_k < v else v
        self.top_k_np[slot] = top_k
        self.seed_words_np[slot] = split_seed(seed)
        self.seeds[slot] = int(seed)
        self.filtered_np[slot] = p.temperature != 0.0 and (top_k < v or p.top_p < 1.0 or p.min_p > 0.0)
        self.top_logprobs_np[slot] = p.top_logprobs
        self.logprobs_np[slot] = p.logprobs or p.top_logprobs > 0
        self.owner[slot] = owner
        if p.logit_bias:
            for t in p.logit_bias:
                if not 0 <= t < v:
                    raise ValueError(f"logit_bias: token id {t} is outside the vocabulary of {v}")
            self.bias[slot] = (np.fromiter(p.logit_bias.keys(), np.int64), np.fromiter(p.logit_bias.values(), np.float32))
        else:
            self.bias.pop(slot, None)
        self.penalised_np[slot] = uses_output_penalties(p)
        if self.penalised_np[slot]:
            self._write_penalty_state(slot, prompt_ids, output_ids)

    def _write_penalty_state(self, slot: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        if self.output_counts is None:
            shape = (self.num_slots, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        assert self.prompt_mask is not None
        v = self.vocab_size
        prompt = [t for t in prompt_ids if 0 <= t < v]
        output = [t for t in output_ids if 0 <= t < v]  # ids outside the vocabulary (-1: in flight) do not count
        prompt_t, output_t = to_device_parts([prompt, output], torch.int64, self.device)
        self.output_counts[slot].zero_()
        self.output_counts[slot].index_add_(0, output_t, torch.ones_like(output_t, dtype=torch.int32))
        self.prompt_mask[slot].zero_()
        self.prompt_mask[slot, prompt_t] = True

    def record(self, slots: torch.Tensor, tokens: torch.Tensor, penalised: np.ndarray) -> None:
        """The batch's sampled tokens [B] at its `slots` [B] (device): count them for the rows with
        penalties (`penalised`, host bools per row)."""
        if self.output_counts is None or not penalised.any():
            return
        if not penalised.all():
            rows = to_device_parts([np.flatnonzero(penalised).tolist()], torch.int64, self.device)[0]
            slots, tokens = slots[rows], tokens[rows]
        self.output_counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)

    # ---- a step's batch ----------------------------------------------------------------------
    def batch(self, slots: list[int], positions: list[int], slots_dev: torch.Tensor | None = None) -> SamplingBatchInfo:
        """The SamplingBatchInfo of rows reading `slots` (row i samples output index positions[i]);
        `slots_dev`: the same slots already on the device, if they are."""
        dev, v = self.device, self.vocab_size
        rows = np.asarray(slots, dtype=np.int64)
        b = len(slots)
        floats = self.floats_np[rows]  # [B, 6]
        temps = floats[:, TEMPERATURE]
        sampled = np.flatnonzero(temps != 0.0)
        greedy = np.flatnonzero(temps == 0.0)
        filt_rows = rows[sampled]
        filtered = self.filtered_np[filt_rows]
        filt = np.flatnonzero(filtered)  # positions among the sampled rows
        plain = np.flatnonzero(~filtered)
        penal = np.flatnonzero(self.penalised_np[rows])
        bias_parts = [(i, self.bias[int(s)]) for i, s in enumerate(slots) if int(s) in self.bias]

        # what goes up: index lists and int64 values in one copy, float32 values in another
        ints: list[list[int]] = []
        flts: list[list[float]] = []

        def up_int(xs: np.ndarray, cond: bool = True) -> int | None:
            if not cond:
                return None
            ints.append(xs.tolist())
            return len(ints) - 1

        def up_float(xs: np.ndarray, cond: bool = True) -> int | None:
            if not cond:
                return None
            flts.append(xs.tolist())
            return len(flts) - 1

        def index(xs: np.ndarray, total: int) -> int | None:  # None when xs is all rows in order
            return up_int(xs, len(xs) > 0 and not (len(xs) == total and bool((xs == np.arange(total)).all())))

        i_greedy = index(greedy, b)
        i_sample = index(sampled, b)
        i_temps = up_float(temps[sampled], len(sampled) > 0)
        i_keys = None
        if len(sampled):
            keys = row_keys_np(self.seed_words_np[filt_rows], np.asarray(positions, dtype=np.int64)[sampled])
            i_keys = up_int(keys.reshape(-1))
        i_filter = index(filt, len(sampled))
        i_plain = index(plain, len(sampled))
        f_rows = filt_rows[filt]
        top_k_vals = self.top_k_np[f_rows]
        i_top_k = up_int(top_k_vals, bool((top_k_vals < v).any()))
        i_top_p = up_float(floats[sampled][filt, TOP_P], bool((floats[sampled][filt, TOP_P] < 1.0).any()))
        i_min_p = up_float(floats[sampled][filt, MIN_P], bool((floats[sampled][filt, MIN_P] > 0.0).any()))
        i_bias = None
        if bias_parts:
            i_bias = (
                up_int(np.concatenate([np.full(len(c), i, dtype=np.int64) for i, (c, _) in bias_parts])),
                up_int(np.concatenate([c for _, (c, _) in bias_parts])),
                up_float(np.concatenate([x for _, (_, x) in bias_parts])),
            )
        pf = floats[penal]
        i_pen = i_rep = i_freq = i_pres = None
        uses_rep = bool((pf[:, REPETITION] != 1.0).any())
        uses_fp = bool(((pf[:, FREQUENCY] != 0.0) | (pf[:, PRESENCE] != 0.0)).any())
        if len(penal):
            i_pen = up_int(penal)
            i_rep = up_float(pf[:, REPETITION], uses_rep)
            i_freq = up_float(pf[:, FREQUENCY], uses_fp)
            i_pres = up_float(pf[:, PRESENCE], uses_fp)
        i_pen_slots = up_int(rows[penal], len(penal) > 0 and slots_dev is None)
        pen_rows_cpu = [(int(i), int(rows[i])) for i in penal]

        int_t = to_device_parts(ints, torch.int64, dev) if ints else []
        flt_t = to_device_parts(flts, torch.float32, dev) if flts else []
        it = lambda i: int_t[i] if i is not None else None  # noqa: E731
        ft = lambda i: flt_t[i] if i is not None else None  # noqa: E731

        pen_idx = pen_slots = None
        if i_pen is not None:
            assert self.output_counts is not None and self.prompt_mask is not None
            pen_idx = int_t[i_pen]
            pen_slots = slots_dev[pen_idx] if slots_dev is not None else int_t[i_pen_slots]  # type: ignore[index]
        col = lambda t: t[:, None] if t is not None else None  # noqa: E731
        keys_t = it(i_keys)
        top_logprobs = self.top_logprobs_np[rows]
        return SamplingBatchInfo(
            batch_size=b,
            vocab_size=v,
            device=dev,
            seeds=[self.seeds[int(s)] for s in slots],
            positions=list(positions),
            num_greedy=len(greedy),
            greedy_idx=it(i_greedy),
            num_sampled=len(sampled),
            sample_idx=it(i_sample),
            temperatures=ft(i_temps),
            keys=keys_t.view(-1, 2) if keys_t is not None else None,
            num_filtered=len(filt),
            filter_idx=it(i_filter),
            plain_idx=it(i_plain),
            top_k=it(i_top_k),
            top_p=ft(i_top_p),
            min_p=ft(i_min_p),
            bias_rows=it(i_bias[0]) if i_bias else None,
            bias_cols=it(i_bias[1]) if i_bias else None,
            bias_vals=ft(i_bias[2]) if i_bias else None,
            penalty_idx=pen_idx,
            penalty_slots=pen_slots,
            penalty_rows_cpu=pen_rows_cpu,
            output_counts=self.output_counts if pen_idx is not None else None,
            prompt_mask=self.prompt_mask if pen_idx is not None and uses_rep else None,
            repetition=col(ft(i_rep)),
            frequency=col(ft(i_freq)),
            presence=col(ft(i_pres)),
            want_logprobs=bool(self.logprobs_np[rows].any()),
            num_top_logprobs=int(top_logprobs.max()) if b else 0,
        )
