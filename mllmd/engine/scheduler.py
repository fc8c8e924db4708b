"""Continuous-batching scheduler: FCFS admission, token budget per step, chunked prefill, preemption.

Each step every running request gets work: a decode (one token) or the next chunk of its prefill;
waiting requests are admitted in arrival order while the step's token budget, the request limit and
the KV pool allow. While requests decode, a new prompt may be held for up to `prefill_wait_s` so that
prompts arriving close together share one prefill step (see _hold_prefill). When KV runs out, the
newest running request is preempted: its computed KV goes to the prefix cache (or is freed), it
returns to the head of the queue, and is recomputed later.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mllmd.engine.memory import ReqToTokenPool, TokenToKVPoolAllocator
from mllmd.engine.prefix_cache import HybridRadixCache, MatchResult, PrefixCache, RadixCache
from mllmd.engine.request import PLACEHOLDER, EngineImage, Req, ReqStatus
from mllmd.engine.state_pool import SNAPSHOT_CHUNK, StatePool, taken_in_forward
from mllmd.engine.step_cost import MIN_CAPPED_TOKENS

# prompt tokens a step computes for the requests that want their logprobs, all of them together: 512
# rows of a 151,936-token vocabulary are 311 MB of float32 logits (per request, 16 requests of a batch
# made one step of 8,192 rows: 5 GB, twice that with the log-softmax)
PROMPT_LOGPROB_CHUNK = 512


@dataclass
class ScheduledBatch:
    """The work of one step: row i computes reqs[i].token_ids[prefix_lens[i] : prefix_lens[i] + extend_lens[i]]."""

    reqs: list[Req]
    extend_lens: list[int]
    prefix_lens: list[int]
    out_cache_loc: torch.Tensor  # [T] KV slots of the new tokens, rows concatenated (not yet in the request table)
    # hybrid models: per row, (position, state slot) of each prefix-cache snapshot the chunk takes as it
    # computes (the state after the row's first `position` tokens; Scheduler.snapshot_positions)
    snapshots: list[list[tuple[int, int]]] = field(default_factory=list)

    @property
    def needs_logits(self) -> list[bool]:
        return [p + n == len(r.token_ids) for r, p, n in zip(self.reqs, self.prefix_lens, self.extend_lens)]


@dataclass
class SchedulerStats:
    prefill_tokens_computed: int = 0
    decode_tokens_computed: int = 0
    cached_prompt_tokens: int = 0
    preemptions: int = 0


class Scheduler:
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        cache: PrefixCache,
        max_running_requests: int,
        max_prefill_tokens: int,
        chunked_prefill_size: int,
        prefill_wait_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        encoder_tokens_per_step: int = 0,
        encoder_cost: Callable[[EngineImage], int] | None = None,
        state_pool: StatePool | None = None,
        snapshot_interval: int = 0,
        decode_stall_tokens: Callable[[], int | None] | None = None,
    ) -> None:
        """`encoder_cost(image)`: the vision-encoder tokens computing any of the image's rows costs now (0
        once its output is cached); a step's prefill chunks may need at most `encoder_tokens_per_step`
        of them (an image larger than that is encoded alone in its step).

        Hybrid models: every admitted request takes a slot of `state_pool` for its recurrent state
        (none free: it waits), zeroed or copied from the prefix match's snapshot; a prefill chunk
        snapshots the state for the prefix cache as it computes, near each multiple of
        `snapshot_interval` and before the prompt's end (`snapshot_positions`).

        `decode_stall_tokens()`: while requests decode, the most tokens a step may compute to stay within
        the decode stall budget (None: no cap yet); prefill work always gets at least MIN_CAPPED_TOKENS."""
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.cache = cache
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.chunk_size = chunked_prefill_size if chunked_prefill_size > 0 else None
        self._prompt_rows_left = PROMPT_LOGPROB_CHUNK
        self.prefill_wait_s = prefill_wait_s
        self.clock = clock
        self.encoder_tokens_per_step = encoder_tokens_per_step
        self.encoder_cost = encoder_cost
        self.state_pool = state_pool
        self.snapshot_interval = snapshot_interval if state_pool is not None else 0
        self.decode_stall_tokens = decode_stall_tokens
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.stats = SchedulerStats()

    # ---- queue -------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        req.arrival_time = self.clock()
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, req: Req) -> None:
        """Drop a waiting or running request and free everything it holds."""
        if req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is ReqStatus.RUNNING:
            self.running.remove(req)
            self.release(req)
        req.status = ReqStatus.FINISHED

    # ---- KV bookkeeping ----------------------------------------------------------------------
    def _alloc(self, n: int) -> torch.Tensor | None:
        slots = self.allocator.alloc(n)
        if slots is None:
            self.cache.evict(n - self.allocator.available_size())
            slots = self.allocator.alloc(n)
        return slots

    def _kv_slots(self, req: Req) -> torch.Tensor:
        assert req.req_pool_idx is not None
        return self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len].clone()

    def release(self, req: Req) -> None:
        """Hand the request's computed KV to the prefix cache (which frees what it does not keep)."""
        if req.req_pool_idx is None:
            return
        value = self._kv_slots(req)
        key = req.cache_key(req.kv_len)
        if isinstance(self.cache, HybridRadixCache):
            states = []
            if req.state_slot is not None and req.kv_len > 0:
                states.append((req.kv_len, req.state_slot))
            elif req.state_slot is not None:
                self._free_states([req.state_slot])
            n, surplus = self.cache.insert_with_states(key, value, states)
            self._free_states(surplus)
        else:
            n = self.cache.insert(key, value)
            self._free_states([req.state_slot] if req.state_slot is not None else [])
        req.state_slot = None
        self.allocator.free(value[req.prefix_len : n])
        if req.last_node is not None:
            self.cache.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node, req.kv_len, req.prefix_len = None, None, 0, 0

    def _preempt(self, req: Req) -> None:
        self.running.remove(req)
        self.release(req)
        req.status = ReqStatus.WAITING
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    def _free_states(self, slots: list[int]) -> None:
        if self.state_pool is not None:
            for slot in slots:
                self.state_pool.free(slot)

    def _alloc_state(self) -> int | None:
        """A free state slot, giving up the prefix cache's least recently used unlocked snapshot if need
        be (the snapshots a running prefill takes are in the cache too: one long prompt's, 64 for a 32K
        prompt at the default interval, never keep the next request waiting until it finishes)."""
        assert self.state_pool is not None
        slot = self.state_pool.alloc()
        if slot is None and isinstance(self.cache, HybridRadixCache) and self.cache.evict_states(1):
            slot = self.state_pool.alloc()
        return slot

    def _admit_state(self, match: MatchResult) -> int | None:
        """The admitted request's own state slot, holding the state after its cached prefix (the matched
        snapshot's copy; zeros without one). The match comes first and its snapshot is locked while a
        slot is found, so that making room never evicts the very snapshot the request is about to start
        from; with no other slot to free, the request takes the snapshot's slot itself (no copy)."""
        assert self.state_pool is not None
        if match.state is None or not isinstance(self.cache, HybridRadixCache):
            slot = self._alloc_state()
            if slot is not None:
                self.state_pool.zero(slot)
            return slot
        self.cache.lock_state(match.last_node)
        try:
            slot = self._alloc_state()
        finally:
            self.cache.unlock_state(match.last_node)
        if slot is not None:
            self.state_pool.copy(match.state, slot)  # enqueued before anything can reuse the snapshot's slot
            return slot
        return self.cache.take_state(match.last_node)

    def _admit(self, req: Req) -> bool:
        """Give a waiting request a request slot (and a state slot), and its cached prefix; False if no
        slot is free."""
        idx = self.req_to_token_pool.alloc()
        if idx is None:
            return False
        # prompt logprobs need every prompt position computed: no cached prefix until they are
        want_all = req.params.prompt_logprobs and len(req.prompt_logprobs) < len(req.prompt_ids) - 1
        match = self.cache.match_prefix(req.cache_key(0 if want_all else len(req.token_ids) - 1))
        if self.state_pool is not None:
            state = self._admit_state(match)
            if state is None:
                self.req_to_token_pool.free(idx)
                return False
            req.state_slot = state
        n = int(match.indices.numel())
        self.cache.inc_lock_ref(match.last_node)
        self.req_to_token_pool.req_to_token[idx, :n] = match.indices
        req.req_pool_idx, req.last_node, req.kv_len, req.prefix_len = idx, match.last_node, n, n
        if req.cached_tokens < 0:
            req.cached_tokens = min(n, len(req.prompt_ids))
            self.stats.cached_prompt_tokens += req.cached_tokens
        return True

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        reqs: list[Req] = []
        lens: list[int] = []
        slots: list[torch.Tensor] = []
        budget = self._stall_capped(self.max_prefill_tokens)
        self._prompt_rows_left = PROMPT_LOGPROB_CHUNK  # prompt-logprob rows this step may still compute
        self._encoding: set[bytes] = set()  # images this step encodes
        self._encoder_left = self.encoder_tokens_per_step

        # Steady state: every running request decodes one token; one allocation for all of them.
        i = 0
        decodes = self._all_decodes()
        if decodes:
            got = self._alloc(len(decodes))
            if got is not None:
                reqs, lens, slots = decodes, [1] * len(decodes), [got]
                budget -= len(decodes)
                i = len(self.running)  # nothing left for the general loop below

        # Running requests, oldest first: decodes always; prefill chunks within the budget.
        while i < len(self.running):
            req = self.running[i]
            remaining = len(req.token_ids) - req.kv_len
            n = 1 if remaining == 1 else min(remaining, self._chunk_cap(budget))
            if req.num_output >= req.params.max_tokens:
                n = 0  # its last token is still on its way (overlap): it finishes by length then
            elif n > 1:
                n = self._fit_encoder(req, self._align(req, n))
            if n <= 0:
                i += 1
                continue
            got = self._alloc(n)
            while got is None and self.running[-1] is not req:
                self._preempt(self.running[-1])
                got = self._alloc(n)
            if got is None:
                if len(self.running) > 1:
                    self._preempt(req)
                    break
                raise RuntimeError("KV cache too small for a single request; admission should have refused it")
            reqs.append(req)
            lens.append(n)
            slots.append(got)
            budget -= n
            self._take_prompt_rows(req, n)
            i += 1

        # Waiting requests, strictly in order, while budget, request slots and KV allow.
        hold = decodes is not None and reqs is decodes and self._hold_prefill()
        while not hold and self.waiting and budget > 0 and len(self.running) < self.max_running_requests:
            req = self.waiting[0]
            if req.token_ids[-1] == PLACEHOLDER:
                break  # preempted while its last token is on its way: admit it once that arrives
            if not self._admit(req):
                break
            remaining = len(req.token_ids) - req.kv_len
            n = min(remaining, self._chunk_cap(budget))
            if self.chunk_size is None and n < remaining and reqs:
                self.release(req)  # unchunked prompt does not fit this step's budget: next step
                break
            if self.chunk_size is None:
                n = remaining  # a lone unchunked prompt may exceed the budget
            n = self._fit_encoder(req, self._align(req, n))
            if n <= 0:
                self.release(req)  # its images wait for the next step's encoder budget
                break
            headroom = len(self.running)  # keep room for the next step's decodes
            if self.allocator.available_size() + self.cache.evictable_size() < n + headroom:
                self.release(req)
                break
            got = self._alloc(n)
            if got is None:
                self.release(req)
                break
            self.waiting.popleft()
            req.status = ReqStatus.RUNNING
            self.running.append(req)
            reqs.append(req)
            lens.append(n)
            slots.append(got)
            budget -= n
            self._take_prompt_rows(req, n)

        if not reqs:
            return None
        prefix_lens = [r.kv_len for r in reqs]
        for req, p, n in zip(reqs, prefix_lens, lens):
            if n > 1 or len(req.token_ids) - p > 1:
                self.stats.prefill_tokens_computed += n
            else:
                self.stats.decode_tokens_computed += n
        out_cache_loc = slots[0] if len(slots) == 1 else torch.cat(slots)  # one piece: no copy launch
        # The model runner writes the slots into the request table (ModelRunner.prepare).
        batch = ScheduledBatch(reqs, lens, prefix_lens, out_cache_loc)
        if self.snapshot_interval and isinstance(self.cache, HybridRadixCache):
            batch.snapshots = [self._snapshot_slots(r, p, n) for r, p, n in zip(reqs, prefix_lens, lens)]
        return batch

    def _stall_capped(self, budget: int) -> int:
        """The step's token budget under the decode stall cap: while requests decode, their tokens plus
        the prefill work may not exceed what the cap allows, and prefill work keeps MIN_CAPPED_TOKENS."""
        if self.decode_stall_tokens is None or self.chunk_size is None:  # unchunked prompts cannot be capped
            return budget
        decoding = sum(1 for r in self.running if len(r.token_ids) - r.kv_len == 1)
        if not decoding:
            return budget
        cap = self.decode_stall_tokens()
        if cap is None:
            return budget
        return min(budget, decoding + max(MIN_CAPPED_TOKENS, cap - decoding))

    def _hold_prefill(self) -> bool:
        """Whether this decode-only step should leave the waiting prompts for a later step.

        A step that carries a prefill runs eagerly (no CUDA graph) and costs every running request a
        slower step: on an H200 an eager Qwen3-8B step takes about 20 ms of host time however few its
        tokens, against 6 ms for a 64-request decode graph. Prompts arriving a few ms apart are cheaper
        in one prefill step than each in its own. So the head of the queue waits while: it arrived less
        than `prefill_wait_s` ago, was never preempted (a preempted request has waited already), the
        waiting prompts are shorter than one prefill chunk in total, and there are free request slots
        for more of them to join.
        """
        if self.prefill_wait_s <= 0 or not self.waiting:
            return False
        head = self.waiting[0]
        if head.num_preemptions or self.clock() - head.arrival_time >= self.prefill_wait_s:
            return False
        if len(self.waiting) >= self.max_running_requests - len(self.running):
            return False
        enough = self.chunk_size or self.max_prefill_tokens
        return sum(len(r.token_ids) for r in self.waiting) < enough

    def _all_decodes(self) -> list[Req] | None:
        """The running requests that decode this step, if all of them either decode or wait for their
        last in-flight token (overlap); None when some request still has prefill work."""
        out = []
        for req in self.running:
            if req.num_output >= req.params.max_tokens:
                continue
            if len(req.token_ids) - req.kv_len != 1:
                return None
            out.append(req)
        return out or None

    def _fit_encoder(self, req: Req, n: int) -> int:
        """How much of the next n tokens of `req` this step can compute within the encoder budget: the
        chunk ends before the first image whose (uncached) encoding would overrun it, unless nothing
        is encoded yet this step (a large image is then encoded alone)."""
        if not req.images or self.encoder_cost is None:
            return n
        p = req.kv_len
        for image in req.images:
            if image.end <= p or image.start >= p + n or image.content_hash in self._encoding:
                continue
            cost = self.encoder_cost(image)
            if cost == 0:
                continue
            if cost > self._encoder_left and self._encoding:
                return max(0, image.start - p)
            self._encoding.add(image.content_hash)
            self._encoder_left -= cost
        return n

    def _align(self, req: Req, n: int) -> int:
        """Prompts whose logprobs are wanted share PROMPT_LOGPROB_CHUNK tokens a step (each of their
        tokens takes a row of float32 logits, vocabulary-wide): 0 when the step has none left."""
        if self._wants_prompt_rows(req):
            n = min(n, self._prompt_rows_left)
        return n

    def snapshot_positions(self, req: Req, p: int, n: int) -> list[int]:
        """Where a hybrid model's prefill chunk of tokens [p, p + n) snapshots its state for the prefix
        cache: at each multiple of the snapshot interval it crosses (a prefix shared by requests that
        diverge after it), and before the prompt's final token (the next turn of a conversation repeats
        the prompt up to the assistant's header, which the chat template renders differently once the
        reply is in the history). The chunk kernel copies the state out after any whole 64-token chunk
        it computes (counted from p), so a position inside the chunk moves back to such a boundary, or
        to p itself (the request's state before the step, copied then); the chunk's own end is exact
        (the request's state, copied once the step is launched). Never the last token (a hit must
        leave one to compute), nor the empty prefix."""
        if not self.snapshot_interval or n <= 1:  # decodes: the final state is kept when the request ends
            return []
        last = len(req.token_ids) - 1
        end = min(p + n, last)

        def place(t: int) -> int:
            return t if t == p + n else p + (t - p) // SNAPSHOT_CHUNK * SNAPSHOT_CHUNK

        interval = self.snapshot_interval
        out = {place(t) for t in range((p // interval + 1) * interval, end + 1, interval)}
        if p + n >= last:
            out.add(place(last))
        return sorted(x for x in out if x > 0)

    def _snapshot_slots(self, req: Req, p: int, n: int) -> list[tuple[int, int]]:
        """A state slot for each of the chunk's snapshot positions, while slots can be had (evicting
        the least recently used unlocked snapshots: the newest are worth more)."""
        out: list[tuple[int, int]] = []
        for pos in self.snapshot_positions(req, p, n):
            if pos == p and (req.last_node is None or not isinstance(self.cache, HybridRadixCache)
                             or self.cache.has_state(req.last_node)):  # fmt: skip
                continue  # p has its snapshot already (the last step's end, or the prefix hit's)
            slot = self._alloc_state()
            if slot is None:
                break
            if pos == p:  # the state before the step: copied now, ahead of the step's forward
                assert self.state_pool is not None and req.state_slot is not None
                self.state_pool.copy(req.state_slot, slot)
            out.append((pos, slot))
        return out

    @staticmethod
    def _wants_prompt_rows(req: Req) -> bool:
        return req.params.prompt_logprobs and req.kv_len < len(req.prompt_ids) - 1

    def _take_prompt_rows(self, req: Req, n: int) -> None:
        if self._wants_prompt_rows(req):
            self._prompt_rows_left -= n

    def _chunk_cap(self, budget: int) -> int:
        return budget if self.chunk_size is None else min(budget, self.chunk_size)

    def commit(self, batch: ScheduledBatch) -> None:
        """Record that the batch's KV has been written; a prefill chunk's KV enters the prefix cache
        (hybrid models: with the snapshots the step's forward takes, at their positions)."""
        snapshots = batch.snapshots or [[] for _ in batch.reqs]
        for req, p, n, snaps in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, snapshots):
            req.kv_len = p + n
            if n <= 1 or not isinstance(self.cache, RadixCache):
                self._free_states([slot for _, slot in snaps])
                continue
            for pos, slot in snaps:
                if pos == p:  # copied before the step, at the node the request's path ends at
                    assert req.last_node is not None and req.prefix_len == p and isinstance(self.cache, HybridRadixCache)
                    if not self.cache.attach_state(req.last_node, slot):
                        self._free_states([slot])
                    continue
                if not taken_in_forward(p, pos):  # the chunk's end
                    assert self.state_pool is not None and req.state_slot is not None and pos == req.kv_len
                    self.state_pool.copy(req.state_slot, slot)
                self._cache_unfinished(req, pos, slot)
            if req.prefix_len < req.kv_len:
                self._cache_unfinished(req, req.kv_len, None)

    def _cache_unfinished(self, req: Req, end: int, snapshot: int | None) -> None:
        """Put the first `end` tokens a running request has computed into the prefix cache (SGLang's
        cache_unfinished_req): a request that arrives meanwhile with the same prefix hits it from the
        next step on, and where another request cached these tokens first, its slots replace this
        one's (freed). The request locks the new end of its path; `snapshot` (hybrid models: the state
        after these tokens) becomes that node's, or is freed if the node has one."""
        assert req.req_pool_idx is not None and req.last_node is not None and isinstance(self.cache, RadixCache)
        start, row = req.prefix_len, self.req_to_token_pool.req_to_token[req.req_pool_idx]
        own = row[start:end].clone()
        had, node, cached = self.cache.extend(req.last_node, req.cache_key(end)[start:], own)
        if had:
            self.allocator.free(own[:had])
            row[start : start + had] = cached
        self.cache.inc_lock_ref(node)
        self.cache.dec_lock_ref(req.last_node)
        req.last_node, req.prefix_len = node, end
        if snapshot is not None:
            assert isinstance(self.cache, HybridRadixCache)
            if not self.cache.attach_state(node, snapshot):
                self._free_states([snapshot])

    def finish(self, req: Req, reason: str) -> None:
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req.status is ReqStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)  # preempted, then its in-flight token ended it (overlap)
        self.release(req)
        req.status = ReqStatus.FINISHED
