"""Engine: admission, the step loop (schedule -> forward -> sample -> finish) and per-step outputs.

This is what the scheduler worker and the offline `LLM` drive: `add_request`, `abort`, `step`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mllmd.config import EngineConfig
from mllmd.engine.device_io import PendingFetch
from mllmd.engine.model_runner import ModelRunner
from mllmd.engine.prefix_cache import ChunkCache, HybridRadixCache, PrefixCache, RadixCache
from mllmd.engine.request import PLACEHOLDER, AdmissionError, EngineImage, Req, ReqStatus
from mllmd.engine.sampling import uses_output_penalties
from mllmd.engine.sampling.logprobs import compute_logprobs
from mllmd.engine.sampling.sampler import TokenMask
from mllmd.engine.scheduler import Scheduler
from mllmd.engine.step_cost import DECODE_TIMING_EVERY, StepCostModel, StepTimer, stall_budget_s
from mllmd.messages import TokenOutput
from mllmd.sampling_params import OutputConstraint, SamplingParams
from mllmd.structured.grammar import GrammarCompiler, GrammarError
from mllmd.structured.mask import bitmask_words
from mllmd.structured.matcher import RequestGrammar

logger = logging.getLogger(__name__)

SEED_MASK = (1 << 63) - 1


@dataclass
class _Launched:
    """A sampled batch whose tokens are still on the device: row i is reqs[i]'s token at positions[i]."""

    reqs: list[Req]
    positions: list[int]
    pending: PendingFetch
    timers: list[StepTimer] = field(default_factory=list)  # scheduler.max_decode_stall_ms: steps to learn from


def _drop_placeholders(req: Req) -> None:
    while req.token_ids and req.token_ids[-1] == PLACEHOLDER:
        req.token_ids.pop()


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        config = self.config = self.runner.config  # max_running_requests lowered to the state slots (hybrids)
        self.info = self.runner.info
        alloc = self.runner.allocator
        states = self.runner.state_pool
        cache: PrefixCache
        if config.disable_radix_cache:
            cache = ChunkCache(alloc.free, device=self.runner.device)
        elif states is not None:  # hybrid: KV and recurrent-state snapshots
            def free_states(slots: list[int]) -> None:
                for s in slots:
                    states.free(s)

            cache = HybridRadixCache(alloc.free, free_states, device=self.runner.device)
        else:
            cache = RadixCache(alloc.free, device=self.runner.device)
        self.cache = cache
        self.scheduler = Scheduler(
            self.runner.req_to_token_pool,
            alloc,
            cache,
            max_running_requests=config.max_running_requests,
            max_prefill_tokens=config.max_prefill_tokens,
            chunked_prefill_size=config.chunked_prefill_size,
            prefill_wait_s=config.prefill_wait_ms / 1e3,
            encoder_tokens_per_step=config.max_encoder_tokens_per_step,
            encoder_cost=self.runner.vision.uncached_tokens if self.runner.vision is not None else None,
            state_pool=states,
            snapshot_interval=config.state_snapshot_interval,
            decode_stall_tokens=self._decode_stall_tokens if self._stall_cap_on() else None,
        )
        # scheduler.max_decode_stall_ms: what steps cost per token, from the steps' own times
        graphs = self.runner.prefill_graphs
        self.step_cost = (
            StepCostModel(buckets=graphs.token_sizes if graphs is not None else ()) if self._stall_cap_on() else None
        )
        self._decode_steps = 0  # decode-only steps launched (auto stall budget: one in DECODE_TIMING_EVERY timed)
        self._step_timers: list[StepTimer] = []  # steps timed since the last launched sampling
        # Overlap scheduling (see step): by default only where the device runs asynchronously.
        ov = config.overlap_schedule
        self.overlap: bool = self.runner.device.type == "cuda" if ov is None else ov
        self._rng = random.Random(config.random_seed)
        self.reqs: dict[str, Req] = {}
        self._pending_outputs: list[TokenOutput] = []
        self._inflight: _Launched | None = None  # overlap: the batch whose tokens are on their way
        self._grammars: GrammarCompiler | None = None  # built at the first constrained request
        self._grammars_ready: concurrent.futures.Future[GrammarCompiler] | None = None  # prepare_grammars
        # With defer_grammars (the scheduler worker sets it), a request whose grammar is not compiled yet
        # waits here, off the step loop, instead of stalling every running request while it compiles.
        self.defer_grammars = False
        self._compiling: dict[str, tuple[concurrent.futures.Future, Req, float]] = {}  # rid -> (compile, req, deadline)
        self._admitted_late: list[str] = []  # rids whose grammar compiled since take_admitted
        self._refused_late: list[tuple[str, AdmissionError]] = []  # rids whose grammar could not (take_refused)

    # ---- admission ---------------------------------------------------------------------------
    def add_request(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, images: list[EngineImage] | None = None
    ) -> bool:
        """Queue a request; AdmissionError (naming the numbers) if it can never be served. `images`: the
        prompt's images in order, each over its run of image tokens (vision-language models). Returns
        False when, with `defer_grammars`, the request waits for its grammar: a later step admits it
        (`take_admitted`) or refuses it (`take_refused`)."""
        if rid in self.reqs or rid in self._compiling:
            raise AdmissionError(f"request id {rid!r} is already in use")
        info = self.info
        try:
            params.validate(info.vocab_size)
        except ValueError as e:
            raise AdmissionError(str(e), getattr(e, "param", None)) from None
        if not prompt_ids:
            raise AdmissionError("the prompt is empty", "prompt")
        bad = [t for t in prompt_ids if (not isinstance(t, int)) or t < 0 or t >= info.vocab_size][:1]
        if bad:
            raise AdmissionError(f"prompt token ids must be integers in [0, {info.vocab_size}) (got {bad[0]!r})", "prompt")
        total = len(prompt_ids) + params.max_tokens
        if total > info.context_length:
            raise AdmissionError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} tokens "
                f"exceeds the context length of {info.context_length}",
                "max_tokens",
            )
        if total > self.runner.max_total_tokens:
            raise AdmissionError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} tokens "
                f"exceeds the KV cache of {self.runner.max_total_tokens} tokens",
                "max_tokens",
            )
        if info.video_token_id is not None and info.video_token_id in prompt_ids:
            raise AdmissionError(f"the prompt holds video placeholder tokens ({info.video_token_id}): videos are "
                                 "not supported", "prompt")
        mrope = check_images(prompt_ids, images or [], info.image_token_id, info.spatial_merge_size)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Req(rid=rid, prompt_ids=list(prompt_ids), params=params, seed=seed & SEED_MASK, images=list(images or []))
        if mrope is not None:
            req.mrope_positions, req.mrope_delta = mrope
        if params.constraint is not None:
            if self.defer_grammars:
                compiler = self._compiler()
                compiled = compiler.lookup(params.constraint)
                if compiled is None:
                    deadline = time.monotonic() + compiler.timeout_s
                    self._compiling[rid] = (compiler.submit(params.constraint), req, deadline)
                    return False
                req.grammar = self._request_grammar(compiled, params.constraint)
            else:
                req.grammar = self._grammar_for(params.constraint)
        self.reqs[rid] = req
        self.scheduler.add(req)
        return True

    def _admit_compiled(self) -> None:
        """Queue the deferred requests whose grammar has compiled; refuse those whose grammar failed or
        outlived the compile timeout (its thread runs on: later compilations queue behind it)."""
        now = time.monotonic()
        for rid, (future, req, deadline) in list(self._compiling.items()):
            if not future.done() and now < deadline:
                continue
            del self._compiling[rid]
            assert req.params.constraint is not None and self._grammars is not None
            try:
                req.grammar = self._request_grammar(self._grammars.finish(future, req.params.constraint),
                                                    req.params.constraint)  # fmt: skip
            except GrammarError as e:
                self._refused_late.append((rid, AdmissionError(str(e), e.param)))
                continue
            self.reqs[rid] = req
            self.scheduler.add(req)
            self._admitted_late.append(rid)

    @property
    def compiling_grammars(self) -> int:
        """Requests waiting for their grammar (defer_grammars)."""
        return len(self._compiling)

    def take_admitted(self) -> list[str]:
        """Deferred requests queued by the steps since the last call (before their first output)."""
        out, self._admitted_late = self._admitted_late, []
        return out

    def take_refused(self) -> list[tuple[str, AdmissionError]]:
        """Deferred requests whose grammar could not be compiled since the last call (no output follows)."""
        out, self._refused_late = self._refused_late, []
        return out

    def prepare_grammars(self) -> None:
        """Build the structured-output compiler on a background thread now (about a second for a 151k
        vocabulary), so that the first constrained request does not stall the step loop for it."""
        if self._grammars_ready is None:
            self._grammars_ready = concurrent.futures.ThreadPoolExecutor(1).submit(self._build_grammars)

    def _build_grammars(self) -> GrammarCompiler:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer_path or self.config.model_path)
        return GrammarCompiler(tokenizer, self.info.vocab_size)

    def _compiler(self) -> GrammarCompiler:
        """The structured-output compiler, with the model's tokenizer, built once."""
        if self._grammars is None:
            self.prepare_grammars()
            assert self._grammars_ready is not None
            try:
                self._grammars = self._grammars_ready.result()
            except Exception as e:  # xgrammar missing, or a tokenizer it cannot read
                raise AdmissionError(f"structured outputs are unavailable here: {e}", "response_format") from None
        return self._grammars

    def _grammar_for(self, c: OutputConstraint) -> RequestGrammar:
        """A matcher for a constrained request, compiled now (the offline path)."""
        try:
            compiled = self._compiler().compile(c)
        except GrammarError as e:
            raise AdmissionError(str(e), e.param) from None
        return self._request_grammar(compiled, c)

    def _request_grammar(self, compiled: Any, c: OutputConstraint) -> RequestGrammar:
        return RequestGrammar(compiled, self.info.eos_token_ids, c.starts_after_token)

    def abort(self, rid: str) -> bool:
        """Stop a request now and free its memory; its final output says finish_reason "abort"."""
        if self._compiling.pop(rid, None) is not None:  # never queued, never reported: nothing to end
            return True
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return False
        self.scheduler.abort(req)
        _drop_placeholders(req)
        req.finish_reason = "abort"
        self._pending_outputs.append(self._output(req, [], None, None))
        del self.reqs[rid]
        return True

    def _stall_cap_on(self) -> bool:
        """scheduler.max_decode_stall_ms: a fixed budget, or null on a GPU (learned from the decode steps)."""
        ms = self.config.max_decode_stall_ms
        return ms is None and self.runner.device.type == "cuda" or bool(ms and ms > 0)

    def _decode_stall_tokens(self) -> int | None:
        """The scheduler's cap while requests decode (scheduler.max_decode_stall_ms; None: no cap yet)."""
        assert self.step_cost is not None
        budget = stall_budget_s(self.config.max_decode_stall_ms, self.step_cost.decode_step_s)
        return None if budget is None else self.step_cost.tokens_within(budget)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        """Run one batch; return what changed for each request touched (plus aborts since last step).

        With `overlap_schedule`, the tokens of this step's batch are reported by the next call: the
        host schedules and launches batch N+1 while the device still runs batch N (see _Launched).
        """
        if self._compiling:
            self._admit_compiled()
        outputs, self._pending_outputs = self._pending_outputs, []
        if self._inflight is not None and not self._can_overlap():
            outputs += self._complete(self._inflight)
            self._inflight = None
        launched = None
        sched = self.scheduler.schedule()
        if sched is not None:
            timer = None
            if self.step_cost is not None:
                if any(n > 1 for n in sched.extend_lens):  # steps with prefill work
                    timer = StepTimer.begin(sum(sched.extend_lens), self.runner.device)
                elif not self.config.max_decode_stall_ms:  # auto: now and then a decode-only step, the budget's unit
                    self._decode_steps += 1
                    if self._decode_steps % DECODE_TIMING_EVERY == 1:
                        timer = StepTimer.begin(len(sched.extend_lens), self.runner.device, decode_only=True)
            batch = self.runner.prepare(sched)
            logits = self.runner.forward(batch)
            if timer is not None:
                if batch.prefill_graph is not None and not timer.decode_only:  # its bucket, padding included
                    timer.tokens = batch.prefill_graph[0]
                timer.stop()
                self._step_timers = [*self._step_timers[-63:], timer]
            self.scheduler.commit(sched)
            sampling_reqs = [r for r, need in zip(sched.reqs, sched.needs_logits) if need]
            if batch.prompt_spans:  # their rows follow the sampling rows
                self._record_prompt_logprobs(batch.prompt_spans, logits[len(sampling_reqs):])
                logits = logits[: len(sampling_reqs)]
            if sampling_reqs:
                # every row samples (decodes): the batch's device-side request rows are the token slots
                rows = batch.req_pool_indices if len(sampling_reqs) == len(sched.reqs) else None
                if self._inflight is not None and any(r.grammar is not None for r in sampling_reqs):
                    # a grammar's mask needs the previous token: take batch N's tokens now, while the
                    # device runs this batch's forward, then sample with the masks
                    outputs += self._complete(self._inflight)
                    self._inflight = None
                    keep = [i for i, r in enumerate(sampling_reqs) if not r.finished]
                    if len(keep) < len(sampling_reqs):  # ended at step N: nothing to sample for them
                        logits = logits[torch.tensor(keep, dtype=torch.int64, device=logits.device)]
                        sampling_reqs = [sampling_reqs[i] for i in keep]
                        rows = None
                if sampling_reqs:
                    launched = self._launch_sampling(sampling_reqs, logits, rows)
        if self._inflight is not None:
            outputs += self._complete(self._inflight)  # the device runs `launched` meanwhile
            self._inflight = None
        if launched is not None:
            if self.overlap:
                self._inflight = launched
            else:
                outputs += self._complete(launched)
        return outputs

    def _can_overlap(self) -> bool:
        """Overlap needs no output token on the host before sampling: not with penalties."""
        if not self.overlap:
            return False
        return not any(uses_output_penalties(r.params) for r in self.scheduler.running)

    def _launch_sampling(self, reqs: list[Req], logits: torch.Tensor, rows: torch.Tensor | None = None) -> _Launched:
        """Sample on the device and start copying the tokens back; with overlap, each request gets a
        placeholder token that the runner's device-side token stands in for until _complete fills it.
        `rows`: the requests' slots on the device already (else they are copied up)."""
        out = self.runner.sample(reqs, logits, rows, keep_on_device=self.overlap,
                                 token_mask=self._token_mask(reqs, logits.device))
        positions = [len(r.token_ids) for r in reqs]
        if self.overlap:
            for r in reqs:
                r.token_ids.append(PLACEHOLDER)
        pending = PendingFetch([out.next_token_ids, out.logprobs, out.top_logprob_ids, out.top_logprobs])
        timers, self._step_timers = self._step_timers, []  # their ends come before this fetch's event
        return _Launched(reqs, positions, pending, timers)

    def _record_prompt_logprobs(self, spans: list[tuple[Req, int, int]], logits: torch.Tensor) -> None:
        """Prompt tokens' logprobs from this step's prompt rows (a host sync: only for requests that
        asked, in their prefill)."""
        start = 0
        for req, first, count in spans:
            rows = logits[start : start + count]
            start += count
            skip = max(0, len(req.prompt_logprobs) - first)  # recomputed after a preemption: kept already
            if skip >= count:
                continue
            rows, first, count = rows[skip:], first + skip, count - skip
            targets = torch.tensor(req.prompt_ids[first + 1 : first + 1 + count], dtype=torch.int64, device=rows.device)
            k = req.params.top_logprobs
            lp, top_ids, top_lp = compute_logprobs(rows, targets, k)
            req.prompt_logprobs += lp.tolist()
            if top_ids is not None and top_lp is not None:
                req.prompt_top_logprobs += [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_lp.tolist())]
            else:
                req.prompt_top_logprobs += [[] for _ in range(count)]

    def _token_mask(self, reqs: list[Req], device: torch.device) -> TokenMask | None:
        """The grammar rows' allowed tokens, filled on the host and copied up without a sync."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.finished and r.grammar.constrains]
        if not rows:
            return None
        pin = device.type == "cuda"
        bitmask = torch.empty(len(rows), bitmask_words(self.info.vocab_size), dtype=torch.int32, pin_memory=pin)
        for j, i in enumerate(rows):
            reqs[i].grammar.fill(bitmask, j)
        idx = torch.tensor(rows, dtype=torch.int64, pin_memory=pin)
        return bitmask.to(device, non_blocking=True), idx.to(device, non_blocking=True)

    def _complete(self, launched: _Launched) -> list[TokenOutput]:
        """Wait for a launched batch's tokens; record them, check stops, report."""
        next_ids, chosen_lp, top_ids, top_lps = launched.pending.wait()
        assert next_ids is not None
        if self.step_cost is not None:
            for timer in launched.timers:
                seconds = timer.seconds()
                if seconds is None:
                    continue
                if timer.decode_only:
                    self.step_cost.observe_decode(seconds)
                else:
                    self.step_cost.observe(timer.tokens, seconds)
        now = time.monotonic()
        results = []
        for i, (req, pos) in enumerate(zip(launched.reqs, launched.positions)):
            if req.finished:  # finished or aborted while this batch was in flight
                continue
            tok = next_ids[i]
            if pos < len(req.token_ids):
                req.token_ids[pos] = tok  # the placeholder
            else:
                req.token_ids.append(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            lp = top = None
            if req.params.logprobs and chosen_lp is not None:
                lp = [chosen_lp[i]]
                k = req.params.top_logprobs
                top = [list(zip(top_ids[i][:k], top_lps[i][:k]))] if k and top_ids is not None and top_lps is not None else [[]]
                req.logprobs += lp
                req.top_logprobs += top
            num_output = pos + 1 - len(req.prompt_ids)
            reason = self._check_finish(req, tok, num_output, pos + 1)
            if req.grammar is not None and not req.grammar.accept(tok) and reason is None:
                logger.error("request %s: the grammar refused token %d; the request ends", req.rid, tok)
                reason = "stop"
            if reason is not None:
                del req.token_ids[pos + 1 :]  # the in-flight batch's placeholder, if any
                self.scheduler.finish(req, reason)
                self.reqs.pop(req.rid, None)
            results.append(self._output(req, [tok], lp, top, num_output))
        return results

    def _check_finish(self, req: Req, tok: int, num_output: int, length: int) -> str | None:
        p = req.params
        if tok in p.stop_token_ids:
            req.matched_stop = tok
            return "stop"
        if not p.ignore_eos and tok in self.info.eos_token_ids:
            req.matched_stop = tok
            return "stop"
        if num_output >= p.max_tokens or length >= self.info.context_length:
            return "length"
        return None

    def _output(
        self,
        req: Req,
        new: list[int],
        lp: list[float] | None,
        top: list[list[tuple[int, float]]] | None,
        num_output: int | None = None,
    ) -> TokenOutput:
        prompt_lp = prompt_top = None
        if req.params.prompt_logprobs and not req.prompt_logprobs_sent and new:
            prompt_lp, prompt_top = req.prompt_logprobs, req.prompt_top_logprobs
            req.prompt_logprobs_sent = True
        return TokenOutput(
            rid=req.rid,
            new_token_ids=new,
            finished=req.status is ReqStatus.FINISHED,
            finish_reason=req.finish_reason,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=req.num_output if num_output is None else num_output,
            cached_tokens=max(req.cached_tokens, 0),
            new_logprobs=lp,
            new_top_logprobs=top,
            matched_stop=req.matched_stop,
            prompt_logprobs=prompt_lp,
            prompt_top_logprobs=prompt_top,
        )

    # ---- introspection (tests, metrics, admin) -----------------------------------------------
    def flush_cache(self) -> int:
        return self.cache.flush()

    def kv_usage(self) -> dict[str, int]:
        alloc = self.runner.allocator
        return {
            "total": self.runner.max_total_tokens,
            "free": alloc.available_size(),
            "cached": self.cache.total_size(),
            "evictable": self.cache.evictable_size(),
        }

    def state_usage(self) -> dict[str, int] | None:
        """The recurrent-state pool's slots (hybrid models), or None."""
        states = self.runner.state_pool
        if states is None:
            return None
        snapshots = self.cache.num_states if isinstance(self.cache, HybridRadixCache) else 0
        return {"total": states.size, "free": states.available(), "snapshots": snapshots,
                "bytes_per_slot": states.slot_bytes}

    def is_idle_and_clean(self) -> bool:
        """No request holds KV: every slot is free or owned by the prefix cache, all request slots free."""
        alloc = self.runner.allocator
        pool = self.runner.req_to_token_pool
        states = self.runner.state_pool
        cached_states = self.cache.num_states if isinstance(self.cache, HybridRadixCache) else 0
        return (
            not self.scheduler.has_work()
            and alloc.available_size() + self.cache.total_size() == self.runner.max_total_tokens
            and pool.available_size() == pool.size
            and self.cache.protected_size() == 0
            and (states is None or states.available() + cached_states == states.size)
        )


def check_images(
    prompt_ids: list[int], images: list[EngineImage], image_token_id: int | None, merge: int
) -> tuple[torch.Tensor, int] | None:
    """Check that the images cover exactly the prompt's runs of image tokens; their M-RoPE positions
    ([3, P], delta) when there are any. AdmissionError says what disagrees."""
    runs: list[tuple[int, int]] = []
    if image_token_id is not None:
        i = 0
        while i < len(prompt_ids):
            if prompt_ids[i] == image_token_id:
                j = i
                while j < len(prompt_ids) and prompt_ids[j] == image_token_id:
                    j += 1
                runs.append((i, j))
                i = j
            else:
                i += 1
    if not images:
        if runs:
            raise AdmissionError(f"the prompt holds {len(runs)} image placeholder runs but no image", "prompt")
        return None
    if image_token_id is None:
        raise AdmissionError("the loaded model does not take images", "prompt")
    got = [(im.start, im.end) for im in images]
    if got != runs:
        raise AdmissionError(f"the images cover prompt tokens {got} but the image tokens are at {runs}", "prompt")
    for k, im in enumerate(images):
        t, h, w = im.grid_thw
        if t * h * w != im.num_tokens * merge * merge:
            raise AdmissionError(f"image {k + 1}: a {t}x{h}x{w} grid is not {im.num_tokens} image tokens", "prompt")
    from mllmd.models.mrope import mrope_positions

    types = [0] * len(prompt_ids)
    for s, e in runs:
        types[s:e] = [1] * (e - s)
    return mrope_positions(types, [im.grid_thw for im in images], merge)

