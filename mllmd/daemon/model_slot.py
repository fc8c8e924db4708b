"""ModelSlot: one loaded (or loading) model — its workers, their ZMQ sockets and its requests in flight.

A hot swap runs two slots side by side: the new one loads while the old one serves; requests stay
on the slot they were submitted to, so each request's output comes wholly from one model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq.asyncio

from mllmd import knobs
from mllmd.config import EngineConfig
from mllmd.daemon.models import ModelFacts
from mllmd.daemon.ratelimit import RateLimitedLog
from mllmd.daemon.request_manager import RequestManager
from mllmd.daemon.supervisor import Supervisor, WorkerPolicy
from mllmd.messages import (
    EngineStats,
    Heartbeat,
    MainInbox,
    RequestFailed,
    TextOutputs,
    TokenizeOnly,
    TokenizeResult,
    WorkerFatal,
    WorkerReady,
    decoder,
    encode,
)
from mllmd.openai.parser_choice import choose_parsers
from mllmd.workers import ipc

logger = logging.getLogger("mllmd.slot")
_errors = RateLimitedLog(logger)

# Share of a load that each worker's readiness stands for (the scheduler loads the weights).
_LOAD_WEIGHT = {ipc.TOKENIZER: 0.1, ipc.DETOKENIZER: 0.1, ipc.SCHEDULER: 0.8}


def make_ipc_dir() -> Path:
    """A private folder for the slot's ipc:// sockets: under $RUNTIME_DIRECTORY, else in /tmp."""
    root = knobs.runtime_dir()
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="ipc-", dir=root))
    return Path(tempfile.mkdtemp(prefix="mllmd-"))


class ModelSlot:
    def __init__(
        self,
        engine: EngineConfig,
        facts: ModelFacts,
        served_name: str,
        policy: WorkerPolicy,
        log_level: str,
        zctx: zmq.asyncio.Context,
        on_message: Callable[[ModelSlot, Any], None],
        on_lost: Callable[[ModelSlot, str, str], None],
        chat_template: str | None = None,
        media: dict[str, Any] | None = None,
        log_format: str = "text",
    ) -> None:
        """`media`: what the tokenizer worker needs for images ({"server": the image limits, "ipc": the
        transport section}); never the API keys."""
        self.engine = engine
        self.facts = facts
        self.served_name = served_name
        self.aliases: tuple[str, ...] = (served_name,)  # every name it answers to, served_name first
        self.ipc_dir = make_ipc_dir()
        self.inbox = ipc.pull(zctx, self.ipc_dir, ipc.MAIN)
        self.rm = RequestManager(zctx, str(self.ipc_dir))
        # the image limits this model loaded with (its tokenizer worker's; a reload changes the next load's)
        self.max_images_per_request = int(((media or {}).get("server") or {}).get("max_images_per_request") or 0)
        settings = {
            "engine": dataclasses.asdict(engine),
            "tokenizer_path": engine.tokenizer_path or engine.model_path,
            "heartbeat_interval": policy.heartbeat_interval,
            "log_level": log_level,
            "log_format": log_format,
            "chat_template": chat_template,
            **(media or {}),
        }
        self.supervisor = Supervisor(self.ipc_dir, settings, policy, lambda w, r: on_lost(self, w, r))
        self._on_message = on_message
        self.engine_stats: EngineStats | None = None
        self.load_started = time.monotonic()
        self.load_seconds: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._tokenize_waiters: dict[str, asyncio.Future[TokenizeResult]] = {}
        self.chat_template = chat_template
        self._parsers: dict[tuple[str | None, str | None], tuple[str | None, str | None]] = {}

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.supervisor.start_all()
        self._task = asyncio.create_task(self._recv_loop())

    async def stop(self) -> None:
        """Stop the workers and free the sockets (requests still in flight fail)."""
        self.rm.fail_all("the model was unloaded")
        await asyncio.get_running_loop().run_in_executor(None, self.supervisor.stop_all)
        if self._task is not None:
            self._task.cancel()
        self.inbox.close(linger=0)
        self.rm.close()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    async def drain_and_stop(self, timeout: float) -> None:
        """Let in-flight requests finish (up to `timeout` s), then stop."""
        deadline = time.monotonic() + timeout
        while self.rm.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.stop()

    # ---- state -------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.supervisor.all_ready and self.supervisor.degraded_reason is None

    @property
    def progress(self) -> float:
        return sum(_LOAD_WEIGHT[h.name] for h in self.supervisor.workers.values() if h.ready)

    @property
    def info(self) -> WorkerReady | None:
        """What the scheduler worker reported when it became ready (dtype, device, ...)."""
        return self.supervisor.workers[ipc.SCHEDULER].ready_info

    @property
    def context_length(self) -> int | None:
        """The context length the tokenizer worker checks prompts against (from its ready notice)."""
        h = self.supervisor.workers.get(ipc.TOKENIZER)
        return h.ready_info.context_length if h is not None and h.ready_info is not None else None

    def chat_parsers(self, reasoning: str | None, tools: str | None) -> tuple[str | None, str | None]:
        """(reasoning parser, tool-call parser) for `server.reasoning_parser` / `tool_call_parser`; `auto`
        reads them off this model's architecture and chat template, once (the files do not change under it)."""
        key = (reasoning, tools)
        if key not in self._parsers:
            self._parsers[key] = choose_parsers(reasoning, tools, self.facts.architecture,
                                                self.engine.tokenizer_path or self.engine.model_path, self.chat_template)
        return self._parsers[key]

    def describe(self) -> dict[str, Any]:
        info = self.info or WorkerReady(ipc.SCHEDULER, 0)
        return {
            "path": self.engine.model_path,
            "served_name": self.served_name,
            "architecture": info.architecture or self.facts.architecture,
            "dtype": info.dtype or self.facts.dtype,
            "quantization": self.facts.quantization,
            "device": info.device,
            "context_length": info.context_length,
            "kv_cache_tokens": info.max_total_tokens,
            "max_running_requests": info.max_running_requests or self.engine.max_running_requests,
            "load_seconds": self.load_seconds,
            "takes_images": self.facts.takes_images,
            "tensor_transport": self._transport(),
        }

    def _transport(self) -> dict[str, Any] | None:
        """The tokenizer's tensor transport (vision-language models): the mode in use and, when it is not
        the configured one, why."""
        h = self.supervisor.workers.get(ipc.TOKENIZER)
        info = h.ready_info if h is not None else None
        if info is None or info.transport is None:
            return None
        return {"mode": info.transport, "fallback_reason": info.transport_fallback}

    # ---- messages ----------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        """Every message from the workers; one that cannot be read or handled is logged (rate-limited)
        and skipped: the loop never ends while the slot lives (requests would wait forever)."""
        decode = decoder(MainInbox).decode
        while True:
            data = await self.inbox.recv()
            try:
                await self._handle(decode(data))
            except Exception:
                _errors.exception("recv", "a message from the workers could not be handled")

    async def tokenize_only(self, msg: TokenizeOnly, timeout: float = 30.0) -> TokenizeResult | None:
        """Ask the tokenizer worker (/tokenize, /detokenize); None if it did not answer in `timeout` s."""
        fut: asyncio.Future[TokenizeResult] = asyncio.get_running_loop().create_future()
        self._tokenize_waiters[msg.id] = fut
        try:
            await self.rm.to_tokenizer.send(encode(msg))
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            self._tokenize_waiters.pop(msg.id, None)

    async def _handle(self, msg: Any) -> None:
        self._on_message(self, msg)  # first: metrics read the request state before delivery drops it
        if isinstance(msg, (Heartbeat, WorkerReady, WorkerFatal)):
            self.supervisor.on_message(msg)
            if isinstance(msg, WorkerReady) and self.ready and self.load_seconds is None:
                self.load_seconds = time.monotonic() - self.load_started
        elif isinstance(msg, EngineStats):
            self.engine_stats = msg
        elif isinstance(msg, TokenizeResult):
            fut = self._tokenize_waiters.get(msg.id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, (TextOutputs, RequestFailed)):
            for rid in self.rm.deliver(msg):
                await self.rm.send_abort(rid)
