"""ZMQ wiring between the main process and the workers (ipc:// sockets in the runtime directory).

Every message is one of mllmd.messages' structs, msgpack-encoded (`messages.encode`); each socket
decodes the union of the messages it receives (`messages.MainInbox`, ...).
    main        PULL  main.sock        <- heartbeats, ready/fatal notices, results, errors
    tokenizer   PULL  tokenizer.sock   <- generate requests from main
    scheduler   PULL  scheduler.sock   <- tokenized requests (token-id prompts straight from main), aborts, control
    detokenizer PULL  detokenizer.sock <- engine outputs from the scheduler
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar

import zmq

# The context's socket class: an asyncio context's sockets have awaitable send/recv.
_Socket = TypeVar("_Socket", bound="zmq.Socket[Any]")

MAIN = "main"
TOKENIZER = "tokenizer"
SCHEDULER = "scheduler"
DETOKENIZER = "detokenizer"
WORKERS = (TOKENIZER, SCHEDULER, DETOKENIZER)


def address(ipc_dir: str | os.PathLike[str], name: str) -> str:
    return f"ipc://{Path(ipc_dir) / (name + '.sock')}"


def pull(ctx: zmq.Context[_Socket], ipc_dir: str | os.PathLike[str], name: str) -> _Socket:
    sock = ctx.socket(zmq.PULL)
    sock.bind(address(ipc_dir, name))
    return sock


def push(ctx: zmq.Context[_Socket], ipc_dir: str | os.PathLike[str], name: str) -> _Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address(ipc_dir, name))
    return sock
