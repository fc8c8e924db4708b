"""Scheduler worker: owns the device and the Engine; admits, steps, and streams outputs onward.

A vision-language request's images arrive as tensor-transport handles (mllmd.multimodal.transport):
received onto the engine's device before the request is admitted, and acknowledged to the tokenizer
worker once each copy has completed (checked after every step)."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import msgspec
import zmq

from mllmd import knobs
from mllmd.messages import (
    AbortRequest,
    ControlResult,
    EngineStats,
    FirstTokenTimes,
    FlushCache,
    GenerateRequest,
    KVUsage,
    RegisterRequest,
    RequestFailed,
    RequestTiming,
    ResetRequests,
    SchedulerInbox,
    StateUsage,
    TokenOutputs,
    decoder,
    encode,
    request_id_of,
)
from mllmd.workers import ipc
from mllmd.workers.base import WorkerContext, worker_main

logger = logging.getLogger("scheduler")
STATS_INTERVAL = 0.5
IDLE_TRIM_AFTER = 2.0  # seconds without work before freed heap memory is handed back to the system


def _malloc_trim() -> Any:
    """glibc's malloc_trim(0), or None elsewhere. After a burst of requests the heap keeps what the
    step's tensors and lists freed (in several arenas: torch's threads); without a trim the worker's
    RSS at rest depends on the shape of the last burst (measured: 527 to 636 MiB between rounds of the
    same 1,000 requests on the tiny model)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


MAX_TIMINGS = 4096  # per stats message; beyond it the oldest are dropped (never unbounded)


class RequestClock:
    """When each request arrived in this worker, was first scheduled and gave its first token, so
    that main can observe queue, prefill and decode time (EngineStats.timings) and each hop of the way
    to the first token (FirstTokenTimes on the first output). Seen from outside the engine, between
    steps: a request found admitted after a step was scheduled at that step's start. Times are
    time.perf_counter() readings (the clock main and the tokenizer stamp their hops with)."""

    def __init__(self) -> None:
        from mllmd.engine.request import ReqStatus  # the engine is imported by run(), not at module import

        self.WAITING = ReqStatus.WAITING
        self.waiting: dict[str, float] = {}  # rid -> arrival
        self.admitted: dict[str, tuple[float, float]] = {}  # rid -> (arrival, admission)
        self.first: dict[str, tuple[float, float, float]] = {}  # rid -> (arrival, admission, first token)
        self.origin: dict[str, tuple[float, float | None]] = {}  # rid -> (main's submit, tokenizer's send)
        self.done: list[RequestTiming] = []

    def received(self, rid: str, now: float, submitted: float | None = None, tokenized: float | None = None) -> None:
        self.waiting[rid] = now
        if submitted is not None:
            self.origin[rid] = (submitted, tokenized)

    def after_step(self, engine: Any, outputs: list[Any], step_start: float, now: float) -> list[Any]:
        """Note the step's admissions, first tokens and finishes; returns `outputs` with FirstTokenTimes
        on each request's first output (where main stamped its submission)."""
        if self.waiting:
            for rid in [r for r in self.waiting if (q := engine.reqs.get(r)) is None or q.status is not self.WAITING]:
                self.admitted[rid] = (self.waiting.pop(rid), step_start)
        for i, o in enumerate(outputs):
            if o.new_token_ids and o.rid in self.admitted:
                arrived, admitted = self.admitted.pop(o.rid)
                self.first[o.rid] = (arrived, admitted, now)
                origin = self.origin.pop(o.rid, None)
                if origin is not None:
                    outputs[i] = msgspec.structs.replace(o, first_times=FirstTokenTimes(*origin, arrived, admitted, now))
            if o.finished:
                t = self.first.pop(o.rid, None)
                self.admitted.pop(o.rid, None)
                self.origin.pop(o.rid, None)
                if t is not None:
                    self.done.append(RequestTiming(t[1] - t[0], t[2] - t[1], now - t[2]))
        if len(self.done) > MAX_TIMINGS:
            del self.done[: len(self.done) - MAX_TIMINGS]
        return outputs

    def take(self, engine: Any) -> list[RequestTiming]:
        """The finished requests' timings since the last call; aborted requests are forgotten."""
        for table in (self.admitted, self.first, self.origin):
            for rid in [r for r in table if r not in engine.reqs]:
                del table[rid]
        out, self.done = self.done, []
        return out


def _engine_stats(engine: Any, timings: list[RequestTiming] | None = None) -> EngineStats:
    s = engine.scheduler.stats
    return EngineStats(
        running=len(engine.scheduler.running),
        waiting=len(engine.scheduler.waiting),
        kv=KVUsage(**engine.kv_usage()),
        prefill_tokens_computed=s.prefill_tokens_computed,
        decode_tokens_computed=s.decode_tokens_computed,
        cached_prompt_tokens=s.cached_prompt_tokens,
        preemptions=s.preemptions,
        states=StateUsage(**states) if (states := engine.state_usage()) is not None else None,
        timings=timings or [],
    )


class StepTrace:
    """Debug aid: one JSON line per loop iteration (MLLMD_STEP_TRACE=path): time spent on messages,
    in engine.step and sending outputs, and the tokens the step computed. Off unless the variable is set."""

    def __init__(self, engine: Any, path: str) -> None:
        self.engine = engine
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 (line-buffered; lives as long as the worker)
        s = engine.scheduler.stats
        self.last = (s.prefill_tokens_computed, s.decode_tokens_computed)
        self.submitted: list[float] = []  # main's submit time of each request received this iteration

    @classmethod
    def from_env(cls, engine: Any) -> StepTrace | None:
        path = knobs.step_trace_path()
        return cls(engine, path) if path else None

    def received(self, msg: GenerateRequest) -> None:
        """A generate message arrived: note when main submitted it (time.perf_counter, same clock)."""
        if msg.t_submit is not None:
            self.submitted.append(round(msg.t_submit, 6))

    def record(self, t0: float, t1: float, t2: float, t3: float, n_outputs: int) -> None:
        s = self.engine.scheduler.stats
        now = (s.prefill_tokens_computed, s.decode_tokens_computed)
        prefill, decode = now[0] - self.last[0], now[1] - self.last[1]
        self.last = now
        submitted, self.submitted = self.submitted, []
        if prefill or decode or n_outputs or submitted:
            self.file.write(json.dumps({
                "t": round(t0, 6), "msgs_ms": round((t1 - t0) * 1e3, 3), "step_ms": round((t2 - t1) * 1e3, 3),
                "send_ms": round((t3 - t2) * 1e3, 3), "prefill": prefill, "decode": decode, "outputs": n_outputs,
                "running": len(self.engine.scheduler.running), "waiting": len(self.engine.scheduler.waiting),
                "submitted": submitted,
            }) + "\n")


def _images(msg: GenerateRequest, receiver: Any, device: Any) -> list[Any]:
    """The request's images as EngineImages, their pixels copied out of the transport onto the engine's
    device (every handle is received, even after one failed, so that no segment is left behind)."""
    from mllmd.engine.request import EngineImage

    out, error = [], None
    for im in msg.images:
        try:
            pixels = receiver.receive(im.pixels, device)
        except Exception as e:
            error = error or e
            continue
        t, h, w = im.grid_thw
        out.append(EngineImage(im.start, im.num_tokens, (t, h, w), im.content_hash, pixels))
    if error is not None:
        raise error
    return out


def handle(msg: GenerateRequest | AbortRequest | FlushCache, engine: Any, wctx: WorkerContext,
           to_detok: zmq.Socket[Any], receiver: Any = None, clock: RequestClock | None = None,
           deferred: dict[str, tuple[GenerateRequest, float]] | None = None) -> None:
    """One message from main or the tokenizer. A request whose grammar is still compiling waits in
    `deferred` (with its arrival time) until `admit_deferred` registers it."""
    from mllmd.engine.request import AdmissionError

    logger.debug("%s", type(msg).__name__)
    if isinstance(msg, GenerateRequest):
        try:
            images = _images(msg, receiver, engine.info.device) if msg.images else None
        except Exception as e:  # the tokenizer's copy is gone (a restarted tokenizer), or a bad handle
            wctx.send_main(RequestFailed(msg.rid, "unavailable", f"the request's images could not be received: {e}"))
            return
        arrived = time.perf_counter()
        try:
            queued = engine.add_request(msg.rid, msg.input_ids, msg.params, images)
        except AdmissionError as e:
            wctx.send_main(RequestFailed(msg.rid, "invalid_request", str(e), e.param))
            return
        if queued is False and deferred is not None:  # its grammar compiles off the step loop
            deferred[msg.rid] = (msg, arrived)
            return
        _register(msg, arrived, to_detok, clock)
    elif isinstance(msg, AbortRequest):
        if deferred is not None:
            deferred.pop(msg.rid, None)
        engine.abort(msg.rid)
    else:
        freed = engine.flush_cache()
        wctx.send_main(ControlResult("flush_cache", msg.id, freed))


def _register(msg: GenerateRequest, arrived: float, to_detok: zmq.Socket[Any], clock: RequestClock | None) -> None:
    """A queued request: its clock starts, the detokenizer learns its prompt and stop strings."""
    if clock is not None:
        clock.received(msg.rid, arrived, msg.t_submit, msg.t_tokenized)
    p = msg.params
    to_detok.send(encode(RegisterRequest(msg.rid, msg.input_ids, p.stop, p.skip_special_tokens, msg.meta)))


def admit_deferred(engine: Any, wctx: WorkerContext, to_detok: zmq.Socket[Any], clock: RequestClock | None,
                   deferred: dict[str, tuple[GenerateRequest, float]]) -> None:
    """After a step: register the requests it queued once their grammar compiled (before the step's
    outputs go out), and fail those whose grammar could not be compiled."""
    for rid in engine.take_admitted():
        entry = deferred.pop(rid, None)
        if entry is not None:
            _register(entry[0], entry[1], to_detok, clock)
    for rid, e in engine.take_refused():
        deferred.pop(rid, None)
        wctx.send_main(RequestFailed(rid, "invalid_request", str(e), e.param))


def run(wctx: WorkerContext) -> None:
    from mllmd.config import EngineConfig
    from mllmd.engine.engine import Engine

    config = EngineConfig(**wctx.settings["engine"])
    if config.cpu_threads is None:  # leave a core to main, tokenizer and detokenizer
        config = config.replace(cpu_threads=max(1, (os.cpu_count() or 1) - 1))
    engine = Engine(config)
    engine.prepare_grammars()  # structured outputs' compiler, built while the first requests arrive
    engine.defer_grammars = True  # a grammar compiles while the running requests keep decoding
    deferred: dict[str, tuple[GenerateRequest, float]] = {}
    inbox = ipc.pull(wctx.ctx, wctx.ipc_dir, ipc.SCHEDULER)
    to_detok = ipc.push(wctx.ctx, wctx.ipc_dir, ipc.DETOKENIZER)
    receiver = to_tokenizer = None
    if engine.runner.vision is not None:  # images arrive through the tensor transport; acks go back
        from mllmd.multimodal.transport import TensorReceiver

        receiver = TensorReceiver()
        to_tokenizer = ipc.push(wctx.ctx, wctx.ipc_dir, ipc.TOKENIZER)
    # A restarted scheduler starts with no requests: the detokenizer's state for the ones the previous
    # process ran (main failed them) would otherwise stay forever. Sent before any register.
    to_detok.send(encode(ResetRequests()))
    info = engine.info
    wctx.ready(
        context_length=info.context_length,
        vocab_size=info.vocab_size,
        max_total_tokens=engine.runner.max_total_tokens,
        max_running_requests=engine.config.max_running_requests,
        dtype=str(info.dtype).replace("torch.", ""),
        device=str(info.device),
        architecture=(getattr(info.hf_config, "architectures", None) or ["?"])[0],
    )
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    trace = StepTrace.from_env(engine)
    decode = decoder(SchedulerInbox).decode
    wctx.count_requests = lambda: len(engine.reqs) + engine.compiling_grammars
    last_stats = 0.0
    clock = RequestClock()
    trim = _malloc_trim()
    last_work, trimmed = time.monotonic(), True
    while not wctx.stopping:
        timeout = 0 if engine.has_unfinished() else 5 if engine.compiling_grammars else 50
        t0 = time.perf_counter()
        while dict(poller.poll(timeout)).get(inbox):
            data = inbox.recv()
            try:
                msg = decode(data)
            except Exception as e:  # a sender's bug: fail that request, keep serving the others
                logger.error("cannot decode a message: %s", e)
                rid = request_id_of(data)
                if rid is not None:
                    wctx.send_main(RequestFailed(rid, "internal", "the request could not be read by the scheduler"))
                continue
            if trace is not None and isinstance(msg, GenerateRequest):
                trace.received(msg)
            handle(msg, engine, wctx, to_detok, receiver, clock, deferred)
            timeout = 0
        t1 = time.perf_counter()
        outputs = engine.step()
        t2 = time.perf_counter()
        if deferred:
            admit_deferred(engine, wctx, to_detok, clock, deferred)
        outputs = clock.after_step(engine, outputs, t1, t2)
        if outputs:
            to_detok.send(encode(TokenOutputs(outputs)))
        if receiver is not None:
            acks = receiver.pending_acks()
            if acks is not None:
                try:  # never block the engine on a tokenizer that is gone (its copies went with it)
                    to_tokenizer.send(encode(acks), zmq.NOBLOCK)  # type: ignore[union-attr]
                except zmq.Again:
                    logger.warning("the tokenizer worker is not taking transport acks; %d dropped", len(acks.ids))
        if trace is not None:
            trace.record(t0, t1, t2, time.perf_counter(), len(outputs))
        now = time.monotonic()
        if outputs or engine.has_unfinished():
            last_work, trimmed = now, False
        elif not trimmed and trim is not None and now - last_work > IDLE_TRIM_AFTER:
            trim()  # once per idle period
            trimmed = True
        if now - last_stats > STATS_INTERVAL:
            wctx.send_main(_engine_stats(engine, clock.take(engine)))
            last_stats = now


if __name__ == "__main__":
    worker_main(ipc.SCHEDULER, run)
