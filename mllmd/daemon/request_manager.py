"""RequestManager (main process): rid -> request state, asyncio queues for results, abort on disconnect.

Results come back from the detokenizer; errors from any worker. When a worker is lost, every request
in flight fails at once with a 503 (nothing hangs). Request ids carry 128 random bits: they cannot be
guessed from one's own. A request registered here is always released: by its last result, by an
error, by its handler (client gone, any exception), or by an admin abort, which also wakes the
handler with a final "abort" item.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from mllmd.messages import (
    AbortRequest,
    GenerateRequest,
    OutputBudget,
    Prompt,
    PromptMeta,
    RequestFailed,
    TextOutput,
    TextOutputs,
    TokenizeRequest,
    TokenPrompt,
    encode,
)
from mllmd.openai.errors import bad_request
from mllmd.sampling_params import InvalidSamplingParam, SamplingParams, choice_params, fit_max_tokens
from mllmd.workers import ipc

logger = logging.getLogger("mllmd.requests")

# What a request's queue receives: its outputs, or the error that ended it.
Result = TextOutput | RequestFailed


@dataclass
class RequestState:
    rid: str
    group: str
    queue: asyncio.Queue[Result] = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.monotonic)
    finished: bool = False
    owner: Any = None  # the RequestManager (of one model slot) that holds this request
    alias: str | None = None  # the client's own id for it (native /generate's `rid`), unique while in flight
    last: TextOutput | None = None  # the latest output delivered (its token counts end an admin abort)
    prompt_param: str = "prompt"  # the request field that holds its prompt (messages, prompt, text, input_ids)
    first_at: float | None = None  # time.perf_counter() when main got its first output (the to_client hop)


class RequestManager:
    def __init__(self, ctx: zmq.asyncio.Context, ipc_dir: str) -> None:
        self.to_tokenizer = ipc.push(ctx, ipc_dir, ipc.TOKENIZER)
        self.to_scheduler = ipc.push(ctx, ipc_dir, ipc.SCHEDULER)
        self.reqs: dict[str, RequestState] = {}
        self.groups: dict[str, list[str]] = {}
        # a client's own request id -> its group. The engine only ever sees the random ids: a client id
        # reused at once cannot meet the outputs of the request it named before
        self.aliases: dict[str, str] = {}
        # told of each choice given up before it finished (client gone, admin abort): the metrics
        self.on_abort: Callable[[], None] | None = None

    @staticmethod
    def new_rid() -> str:
        """A group id with 128 random bits (a 32-bit hex tag, then 96 bits in decimal); its choices are
        `<group>.<i>`. Nothing about one id tells another."""
        return f"{secrets.token_hex(4)}-{secrets.randbits(96)}"

    async def submit(
        self,
        prompt: Prompt,
        params: SamplingParams,
        budget: OutputBudget,
        n: int,
        prompt_param: str,
        context_length: int | None = None,
        alias: str | None = None,
    ) -> list[RequestState]:
        """Send one prompt with n sampling runs to the tokenizer; one state per run (`alias`: the
        client's own id for the request, refused while another request holds it).

        A prompt of token ids needs no tokenizer: with the model's `context_length` known, it is checked
        here (APIError, before anything is registered) and goes straight to the scheduler, one hop less.
        """
        if alias is not None and alias in self.aliases:
            raise bad_request(f"'rid' {alias!r} is already in flight", "rid")
        group = self.new_rid()
        rids = [f"{group}.{i}" for i in range(n)]
        direct = None
        if isinstance(prompt, TokenPrompt) and context_length:
            try:
                max_tokens = fit_max_tokens(budget.requested, budget.default, len(prompt.ids), context_length,
                                            prompt_param, budget.param, budget.kv_tokens)
            except InvalidSamplingParam as e:
                raise bad_request(str(e), e.param) from None
            direct = choice_params(dataclasses.replace(params, max_tokens=max_tokens), n)
        states = [RequestState(rid, group, owner=self, alias=alias, prompt_param=prompt_param) for rid in rids]
        for s in states:
            self.reqs[s.rid] = s
        self.groups[group] = rids
        if alias is not None:
            self.aliases[alias] = group
        logger.debug("submit %s", group)
        t_submit = time.perf_counter()  # FirstTokenTimes.submitted; the scheduler's MLLMD_STEP_TRACE
        sent: list[str] = []
        try:
            if direct is None:
                await self.to_tokenizer.send(encode(TokenizeRequest(group, rids, prompt, params, budget,
                                                                    prompt_param, t_submit)))
                return states
            assert isinstance(prompt, TokenPrompt)
            for rid, p in zip(rids, direct):
                await self.to_scheduler.send(encode(GenerateRequest(rid, prompt.ids, p, t_submit=t_submit)))
                sent.append(rid)
            return states
        except BaseException:  # nothing may stay registered (an encode error, a cancelled handler)
            for s in states:
                self._drop(s.rid)
            for rid in sent:
                self._abort_nowait(rid)
            raise

    def _drop(self, rid: str) -> RequestState | None:
        """Stop tracking `rid`; its group goes with its last choice."""
        state = self.reqs.pop(rid, None)
        if state is not None:
            state.finished = True
            rids = self.groups.get(state.group, ())
            if not any(r in self.reqs for r in rids):
                self.groups.pop(state.group, None)
                if state.alias is not None:
                    self.aliases.pop(state.alias, None)
        return state

    async def abort(self, rid: str) -> None:
        """The handler of `rid` gives it up (client gone, error): forget it, stop it in the engine, and
        once its whole group is gone, in the tokenizer worker (images still loading, a long prompt
        still encoding: work nobody waits for)."""
        state = self._drop(rid)
        if state is not None:
            if self.on_abort is not None:
                self.on_abort()
            await self.send_abort(rid)
            if state.group not in self.groups:
                try:
                    await self.to_tokenizer.send(encode(AbortRequest(state.group)), flags=zmq.NOBLOCK)
                except zmq.ZMQError:  # a full queue: the worker does that work in vain, nothing worse
                    pass

    async def abort_by_admin(self, rid: str) -> list[str]:
        """Abort a request (a choice id, a group id for all its choices, or the client's own /generate
        `rid`) and wake its handler with a
        final "abort" item; returns the choice ids aborted (none: no such request here)."""
        rid = self.aliases.get(rid, rid)
        rids = [r for r in self.groups.get(rid, [rid]) if r in self.reqs]
        for r in rids:
            state = self._drop(r)
            assert state is not None
            if self.on_abort is not None:
                self.on_abort()
            last = state.last
            state.queue.put_nowait(TextOutput(
                rid=r, text="", token_ids=[], finished=True, finish_reason="abort", matched_stop=None,
                matched_stop_str=None, prompt_tokens=last.prompt_tokens if last else 0,
                completion_tokens=last.completion_tokens if last else 0,
                cached_tokens=last.cached_tokens if last else 0, meta=last.meta if last else PromptMeta(),
            ))
            await self.send_abort(r)
        return rids

    def _abort_nowait(self, rid: str) -> None:
        """send_abort without awaiting (from a cancelled task); a full queue drops it (the engine's
        output for an unknown request is answered with an abort anyway: see deliver)."""
        try:
            self.to_scheduler.send(encode(AbortRequest(rid)), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    async def send_abort(self, rid: str) -> None:
        """Tell the scheduler to stop `rid` (which main no longer tracks)."""
        await self.to_scheduler.send(encode(AbortRequest(rid)))

    async def send_control(self, msg: Any) -> None:
        await self.to_scheduler.send(encode(msg))

    # ---- results -----------------------------------------------------------------------------
    def deliver(self, msg: TextOutputs | RequestFailed) -> list[str]:
        """Route a worker message to its requests; returns rids that need an abort sent."""
        stale: list[str] = []
        if isinstance(msg, TextOutputs):
            for item in msg.items:
                state = self.reqs.get(item.rid)
                if state is None:
                    if not item.finished:
                        stale.append(item.rid)
                    continue
                state.queue.put_nowait(item)
                state.last = item
                if item.first_times is not None:
                    state.first_at = time.perf_counter()
                if item.finished:
                    self._drop(item.rid)
                    if item.finish_reason == "stop" and item.matched_stop_str:
                        stale.append(item.rid)  # ended by a stop string: the engine must stop too
        else:
            for r in list(self.groups.get(msg.rid, [msg.rid])):
                state = self._drop(r)
                if state is not None:
                    # the engine blames "prompt" for whatever field held the request's prompt
                    fixed = msg if msg.param != "prompt" else msgspec.structs.replace(msg, param=state.prompt_param)
                    state.queue.put_nowait(fixed)
        return stale

    def fail_all(self, message: str) -> None:
        """A worker was lost (or the model is going away): every request in flight ends now with a 503."""
        for state in list(self.reqs.values()):
            state.finished = True
            state.queue.put_nowait(RequestFailed(state.rid, "unavailable", message))
        self.reqs.clear()
        self.groups.clear()
        self.aliases.clear()

    def fail_unstarted(self, message: str) -> list[str]:
        """The tokenizer worker was lost: the requests with no output yet (it may have held them) end now
        with a 503; those already generating never need it again and go on. Returns the ids failed."""
        failed = [rid for rid, state in self.reqs.items() if state.last is None]
        for rid in failed:
            state = self._drop(rid)
            assert state is not None
            state.queue.put_nowait(RequestFailed(rid, "unavailable", message))
        return failed

    def close(self) -> None:
        self.to_tokenizer.close(linger=0)
        self.to_scheduler.close(linger=0)

    @property
    def num_in_flight(self) -> int:
        return len(self.reqs)

    @property
    def num_groups(self) -> int:
        return len(self.groups)
