"""Scheduler worker: owns the device and the Engine; admits, steps, and streams outputs onward."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import zmq

from mllmd.workers import ipc
from mllmd.workers.base import WorkerContext, worker_main

logger = logging.getLogger("scheduler")
STATS_INTERVAL = 0.5


def _engine_stats(engine: Any) -> dict[str, Any]:
    s = engine.scheduler.stats
    return {
        "type": "stats",
        "running": len(engine.scheduler.running),
        "waiting": len(engine.scheduler.waiting),
        "kv": engine.kv_usage(),
        "prefill_tokens_computed": s.prefill_tokens_computed,
        "decode_tokens_computed": s.decode_tokens_computed,
        "cached_prompt_tokens": s.cached_prompt_tokens,
        "preemptions": s.preemptions,
    }


def handle(msg: dict[str, Any], engine: Any, wctx: WorkerContext, to_detok: zmq.Socket[Any]) -> None:
    from mllmd.engine.request import AdmissionError

    kind = msg["type"]
    logger.debug("%s %s", kind, msg.get("rid"))
    if kind == "generate":
        try:
            engine.add_request(msg["rid"], msg["input_ids"], msg["params"])
        except AdmissionError as e:
            wctx.send_main({"type": "error", "rid": msg["rid"], "status": 400, "message": str(e)})
            return
        to_detok.send_pyobj({**msg, "type": "register"})
    elif kind == "abort":
        engine.abort(msg["rid"])
    elif kind == "flush_cache":
        freed = engine.flush_cache()
        wctx.send_main({"type": "control_result", "op": "flush_cache", "id": msg.get("id"), "freed_tokens": freed})
    else:
        logger.warning("unknown message type %r", kind)


def run(wctx: WorkerContext) -> None:
    from mllmd.config import EngineConfig
    from mllmd.engine.engine import Engine

    config = EngineConfig(**wctx.settings["engine"])
    if config.cpu_threads is None:  # leave a core to main, tokenizer and detokenizer
        config = config.replace(cpu_threads=max(1, (os.cpu_count() or 1) - 1))
    engine = Engine(config)
    if os.environ.get("MLLMD_TESTING_SCRIPT"):  # test-only: scripted model output
        from mllmd.testing.scripted import install_from_env

        install_from_env(engine, wctx.settings["tokenizer_path"])
    inbox = ipc.pull(wctx.ctx, wctx.ipc_dir, ipc.SCHEDULER)
    to_detok = ipc.push(wctx.ctx, wctx.ipc_dir, ipc.DETOKENIZER)
    # A restarted scheduler starts with no requests: the detokenizer's state for the ones the previous
    # process ran (main failed them) would otherwise stay forever. Sent before any register.
    to_detok.send_pyobj({"type": "reset"})
    info = engine.info
    wctx.ready(
        context_length=info.context_length,
        vocab_size=info.vocab_size,
        max_total_tokens=engine.runner.max_total_tokens,
        dtype=str(info.dtype).replace("torch.", ""),
        device=str(info.device),
        architecture=(getattr(info.hf_config, "architectures", None) or ["?"])[0],
    )
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    last_stats = 0.0
    while not wctx.stopping:
        timeout = 0 if engine.has_unfinished() else 50
        while dict(poller.poll(timeout)).get(inbox):
            handle(inbox.recv_pyobj(), engine, wctx, to_detok)
            timeout = 0
        outputs = engine.step()
        if outputs:
            to_detok.send_pyobj({"type": "outputs", "outputs": outputs})
        now = time.monotonic()
        if now - last_stats > STATS_INTERVAL:
            wctx.send_main(_engine_stats(engine))
            last_stats = now


if __name__ == "__main__":
    worker_main(ipc.SCHEDULER, run)
