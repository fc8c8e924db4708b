"""Log line formats (`logging.format`: text | json) and the request id carried by log records.

A torch-free leaf: the main process and the workers both configure their logging from here, so that
`logging.format: json` gives one JSON object per line on the whole journal stream. In the main
process every record made while an HTTP request is handled carries that request's id (a contextvar
set by the HTTP layer, copied onto the record by `RequestIdFilter`).
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
from typing import Any

# The id of the HTTP request being handled in this context ("-" outside any request).
request_id: contextvars.ContextVar[str] = contextvars.ContextVar("mllmd_request_id", default="-")

TEXT_FORMAT = "%(asctime)s {proc}[%(process)d] %(levelname)s %(name)s [%(request_id)s]: %(message)s"
# LogRecord attributes that are not "extra" fields given by the caller.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "request_id",
                                                                       "color_message"}  # uvicorn's ANSI copy


class RequestIdFilter(logging.Filter):
    """Put the current request id on every record (a handler filter: it sees records of every logger)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (RFC 3339, UTC), level, logger, process, message, request_id,
    the exception text if any, and any `extra` fields the caller gave."""

    def __init__(self, process_name: str) -> None:
        super().__init__()
        self.process_name = process_name

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "process": self.process_name,
            "pid": record.process,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", request_id.get()),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure(level: str, fmt: str, process_name: str) -> None:
    """Replace the root logger's handlers with one stderr handler in the chosen format."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter(process_name))
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT.format(proc=process_name)))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
