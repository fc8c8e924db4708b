"""Engine: admission, the step loop (schedule -> forward -> sample -> finish) and per-step outputs.

This is what the scheduler worker and the offline `LLM` drive: `add_request`, `abort`, `step`.
"""

from __future__ import annotations

import random
import time

import torch

from mllmd.config import EngineConfig
from mllmd.engine.device_io import fetch
from mllmd.engine.model_runner import ModelRunner
from mllmd.engine.prefix_cache import ChunkCache, PrefixCache, RadixCache
from mllmd.engine.request import AdmissionError, Req, ReqStatus, RequestOutput
from mllmd.engine.sampling import Sampler, SamplingBatchInfo
from mllmd.engine.scheduler import Scheduler
from mllmd.sampling_params import SamplingParams

SEED_MASK = (1 << 63) - 1


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.info = self.runner.info
        alloc = self.runner.allocator
        cache: PrefixCache
        if config.disable_radix_cache:
            cache = ChunkCache(alloc.free, device=self.runner.device)
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
        )
        self.sampler = Sampler()
        self._rng = random.Random(config.random_seed)
        self.reqs: dict[str, Req] = {}
        self._pending_outputs: list[RequestOutput] = []

    # ---- admission ---------------------------------------------------------------------------
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; AdmissionError (naming the numbers) if it can never be served."""
        if rid in self.reqs:
            raise AdmissionError(f"request id {rid!r} is already in use")
        info = self.info
        try:
            params.validate(info.vocab_size)
        except ValueError as e:
            raise AdmissionError(str(e)) from None
        if not prompt_ids:
            raise AdmissionError("the prompt is empty")
        if any((not isinstance(t, int)) or t < 0 or t >= info.vocab_size for t in prompt_ids):
            raise AdmissionError(f"prompt token ids must be integers in [0, {info.vocab_size})")
        total = len(prompt_ids) + params.max_tokens
        if total > info.context_length:
            raise AdmissionError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} tokens "
                f"exceeds the context length of {info.context_length}"
            )
        if total > self.runner.max_total_tokens:
            raise AdmissionError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} tokens "
                f"exceeds the KV cache of {self.runner.max_total_tokens} tokens"
            )
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Req(rid=rid, prompt_ids=list(prompt_ids), params=params, seed=seed & SEED_MASK)
        self.reqs[rid] = req
        self.scheduler.add(req)

    def abort(self, rid: str) -> bool:
        """Stop a request now and free its memory; its final output says finish_reason "abort"."""
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return False
        self.scheduler.abort(req)
        req.finish_reason = "abort"
        self._pending_outputs.append(self._output(req, [], None, None))
        del self.reqs[rid]
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; return what changed for each request touched (plus aborts since last step)."""
        outputs, self._pending_outputs = self._pending_outputs, []
        sched = self.scheduler.schedule()
        if sched is None:
            return outputs
        batch = self.runner.prepare(sched)
        logits = self.runner.forward(batch)
        self.scheduler.commit(sched)
        sampling_reqs = [r for r, need in zip(sched.reqs, sched.needs_logits) if need]
        if sampling_reqs:
            outputs += self._sample_and_finish(sampling_reqs, logits)
        return outputs

    def _sample_and_finish(self, reqs: list[Req], logits: torch.Tensor) -> list[RequestOutput]:
        info = SamplingBatchInfo.build(
            [r.params for r in reqs],
            [r.seed for r in reqs],
            [r.prompt_ids for r in reqs],
            [r.output_ids for r in reqs],
            self.info.vocab_size,
            self.runner.device,
        )
        out = self.sampler(logits, info)
        # the step's one wait for the device: sampled ids (and logprobs) through pinned memory
        next_ids, chosen_lp, top_ids, top_lps = fetch(
            [out.next_token_ids, out.logprobs, out.top_logprob_ids, out.top_logprobs]
        )
        assert next_ids is not None
        now = time.monotonic()
        results = []
        for i, req in enumerate(reqs):
            tok = next_ids[i]
            req.token_ids.append(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            lp = top = None
            if req.params.logprobs and chosen_lp is not None:
                lp = [chosen_lp[i]]
                k = req.params.top_logprobs
                top = [list(zip(top_ids[i][:k], top_lps[i][:k]))] if k and top_ids is not None else [[]]
                req.logprobs += lp
                req.top_logprobs += top
            reason = self._check_finish(req, tok)
            if reason is not None:
                self.scheduler.finish(req, reason)
                self.reqs.pop(req.rid, None)
            results.append(self._output(req, [tok], lp, top))
        return results

    def _check_finish(self, req: Req, tok: int) -> str | None:
        p = req.params
        if tok in p.stop_token_ids:
            req.matched_stop = tok
            return "stop"
        if not p.ignore_eos and tok in self.info.eos_token_ids:
            req.matched_stop = tok
            return "stop"
        if req.num_output >= p.max_tokens or len(req.token_ids) >= self.info.context_length:
            return "length"
        return None

    def _output(
        self, req: Req, new: list[int], lp: list[float] | None, top: list[list[tuple[int, float]]] | None
    ) -> RequestOutput:
        return RequestOutput(
            rid=req.rid,
            new_token_ids=new,
            finished=req.status is ReqStatus.FINISHED,
            finish_reason=req.finish_reason,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=req.num_output,
            cached_tokens=max(req.cached_tokens, 0),
            new_logprobs=lp,
            new_top_logprobs=top,
            matched_stop=req.matched_stop,
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

    def is_idle_and_clean(self) -> bool:
        """No request holds KV: every slot is free or owned by the prefix cache, all request slots free."""
        alloc = self.runner.allocator
        pool = self.runner.req_to_token_pool
        return (
            not self.scheduler.has_work()
            and alloc.available_size() + self.cache.total_size() == self.runner.max_total_tokens
            and pool.available_size() == pool.size
            and self.cache.protected_size() == 0
        )
