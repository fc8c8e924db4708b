"""RequestManager (main process): rid -> request state, asyncio queues for results, abort on disconnect.

Results come back from the detokenizer; errors from any worker. When a worker is lost, every request
in flight fails at once with a 503 (nothing hangs).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from mllmd.workers import ipc
from mllmd.workers.tokenizer_worker import sampling_params_for

logger = logging.getLogger("mllmd.requests")


@dataclass
class RequestState:
    rid: str
    group: str
    queue: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.monotonic)
    finished: bool = False
    owner: Any = None  # the RequestManager (of one model slot) that holds this request


class RequestManager:
    def __init__(self, ctx: zmq.asyncio.Context, ipc_dir: str) -> None:
        self.to_tokenizer = ipc.push(ctx, ipc_dir, ipc.TOKENIZER)  # type: ignore[arg-type]
        self.to_scheduler = ipc.push(ctx, ipc_dir, ipc.SCHEDULER)  # type: ignore[arg-type]
        self.reqs: dict[str, RequestState] = {}
        self.groups: dict[str, list[str]] = {}
        self._ids = itertools.count()
        self._prefix = os.urandom(4).hex()

    def new_rid(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    async def submit(self, msg: dict[str, Any], n: int, context_length: int | None = None) -> list[RequestState]:
        """Send one prompt with n sampling runs to the tokenizer; one state per run.

        A prompt of token ids needs no tokenizer: with the model's `context_length` known, it is checked
        here (APIError, before anything is registered) and goes straight to the scheduler, one hop less.
        """
        group = self.new_rid()
        rids = [f"{group}.{i}" for i in range(n)]
        direct = None
        if msg.get("mode") == "ids" and context_length:
            ids = list(msg["input_ids"])
            direct = (ids, sampling_params_for({**msg, "rids": rids}, len(ids), context_length))
        states = [RequestState(rid, group, owner=self) for rid in rids]
        for s in states:
            self.reqs[s.rid] = s
        self.groups[group] = rids
        logger.debug("submit %s", group)
        if direct is None:
            await self.to_tokenizer.send_pyobj({**msg, "rid": group, "rids": rids, "t_submit": time.perf_counter()})
            return states
        ids, params_list = direct
        for rid, params in zip(rids, params_list):
            gen = {"type": "generate", "rid": rid, "input_ids": ids, "params": params, "meta": {},
                   "t_submit": time.perf_counter()}  # for the scheduler's MLLMD_STEP_TRACE
            await self.to_scheduler.send_pyobj(gen)
        return states

    async def abort(self, rid: str) -> None:
        state = self.reqs.pop(rid, None)
        if state is not None and not state.finished:
            state.finished = True
            await self.to_scheduler.send_pyobj({"type": "abort", "rid": rid})

    async def send_control(self, msg: dict[str, Any]) -> None:
        await self.to_scheduler.send_pyobj(msg)

    # ---- results -----------------------------------------------------------------------------
    def deliver(self, msg: dict[str, Any]) -> list[str]:
        """Route a worker message to its requests; returns rids that need an abort sent."""
        kind = msg["type"]
        stale: list[str] = []
        if kind == "outputs":
            for item in msg["items"]:
                state = self.reqs.get(item["rid"])
                if state is None:
                    if not item.get("finished"):
                        stale.append(item["rid"])
                    continue
                state.queue.put_nowait(item)
                if item.get("finished"):
                    state.finished = True
                    self.reqs.pop(item["rid"], None)
                    if item.get("finish_reason") == "stop" and item.get("matched_stop_str"):
                        stale.append(item["rid"])  # ended by a stop string: the engine must stop too
        elif kind == "error":
            rid = msg["rid"]
            for r in self.groups.get(rid, [rid]):
                state = self.reqs.pop(r, None)
                if state is not None:
                    state.finished = True
                    state.queue.put_nowait({"error": msg["message"], "status": msg.get("status", 500), **msg})
        return stale

    def fail_all(self, message: str, status: int = 503) -> None:
        """A worker was lost: every request in flight ends now with an error."""
        for state in list(self.reqs.values()):
            state.finished = True
            state.queue.put_nowait({"error": message, "status": status})
        self.reqs.clear()
        self.groups.clear()

    def close(self) -> None:
        self.to_tokenizer.close(linger=0)
        self.to_scheduler.close(linger=0)

    def forget_group(self, group: str) -> None:
        self.groups.pop(group, None)

    @property
    def num_in_flight(self) -> int:
        return len(self.reqs)
