"""Daemon configuration: YAML file < environment < command line, on top of `EngineConfig`.

Keys are `section.key`. The engine's keys come from `EngineConfig`'s fields (their `section`
metadata), so they cannot drift; daemon-only keys live in the section dataclasses below. Every bad
value raises `DaemonConfigError`, whose message names the key and where the value came from.
This module must not import torch.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml

from mllmd.config import ConfigError, EngineConfig

DEFAULT_CONFIG_PATH = "/etc/mllmd/mllmd.yaml"
ENV_PREFIX = "MLLMD_"
REDACTED = "***"
MIB = 1024 * 1024

Layer = list[tuple[str, Any, str]]  # (dotted key, value, source)


class DaemonConfigError(ConfigError):
    """A bad configuration value; `source` says where it came from (file, variable, option)."""

    def __init__(self, key: str, message: str, source: str | None = None) -> None:
        super().__init__(key, message)
        self.source = source

    def __str__(self) -> str:
        return ": ".join(p for p in (self.source, self.key, self.message) if p)


def _opt(default: Any, doc: str, **checks: Any) -> Any:
    """A daemon key: default, one-line doc, and checks (choices, low, high, positive, secret, upper)."""
    meta = {"doc": doc, **checks}
    default = tuple(default) if isinstance(default, list) else default
    return field(default=default, repr=not checks.get("secret"), metadata=meta)


def _check_fields(obj: Any) -> None:
    for key in _KEYS_BY_CLASS[type(obj)]:
        object.__setattr__(obj, key.name, check_value(key, getattr(obj, key.name)))


@dataclass(frozen=True)
class ServerSection:
    """HTTP server, authentication and API behaviour."""

    host: str = _opt("127.0.0.1", "TCP address to listen on; a non-loopback address needs an API key or allow_unauthenticated_lan")
    port: int = _opt(30000, "TCP port", low=1, high=65535)
    unix_socket: str = _opt("/run/mllmd/mllmd.sock", "Unix socket for local clients and the admin API (mode 0660, group mllmd); empty string disables")
    api_key: str | None = _opt(None, "API key (Bearer) required on the OpenAI and native routes; null: no key", secret=True)
    api_key_file: str | None = _opt(None, "file of API keys, one per line (blank lines and lines starting with # ignored); instead of api_key; every key is accepted")
    admin_api_key: str | None = _opt(None, "key for /admin/* over TCP; null: admin API only on the Unix socket", secret=True)
    allow_unauthenticated_lan: bool = _opt(False, "allow a non-loopback host without an API key")
    metrics_require_key: bool = _opt(False, "require the API key on /metrics too; false (the default): Prometheus scrapes without one (/metrics holds counters, the served model's name and device telemetry, never paths, prompts or keys); set true when untrusted clients reach the TCP port")
    max_request_bytes: int = _opt(20 * MIB, "largest request body accepted, in bytes (20 MiB: a max_image_bytes image fits as a data URL, base64 being 4/3 of its bytes, so an image over that limit is a 400 naming it rather than a 413); larger: 413", low=1)
    max_json_depth: int = _opt(64, "deepest nesting of objects and arrays in a request body; deeper: 400", low=2, high=256)
    max_stop_length: int = _opt(1024, "longest stop string, in characters; longer: 400", low=1, high=65536)
    body_timeout: float = _opt(60.0, "seconds a client may take to send a request body once its headers are in; slower: 408", positive=True)
    send_timeout: float = _opt(60.0, "seconds a response may wait on a client that reads none of it (its socket's buffers full); longer: the connection is cut and the request stops generating", positive=True)
    header_timeout: float = _opt(10.0, "seconds a connection may take to send a request's headers (from its first byte, or from the connection's start); slower: a 408 if some arrived, then closed", positive=True)
    max_header_bytes: int = _opt(65536, "largest request line + headers, in bytes (64 KiB); larger: 431 and the connection closed (checked before authentication)", low=1024)
    keepalive_timeout: float = _opt(5.0, "seconds an idle keep-alive connection stays open between requests", positive=True)
    max_connections: int = _opt(1000, "most open TCP connections; more are answered 503 and closed at once; never more than the open-file limit allows (RLIMIT_NOFILE minus a reserve for the workers and the Unix socket)", low=1)
    max_unix_connections: int = _opt(64, "most open connections on the Unix socket (local clients, mllmctl), counted apart from TCP so that no TCP flood locks the admin out", low=1)
    max_queued_requests: int = _opt(256, "most requests waiting for the scheduler; more: 503", low=1)
    shutdown_timeout: float = _opt(30.0, "seconds to let running requests finish on stop before aborting them", low=0)
    cors_allow_origins: tuple[str, ...] = _opt([], "origins (scheme://host[:port]) whose browser pages may call the API (CORS); [\"*\"]: any; []: CORS off (no CORS headers); a POST from any other origin is a 403 (CSRF)")
    allowed_hosts: tuple[str, ...] = _opt([], "host names the Host header of a TCP request may give (a reverse proxy's public name, say); [\"*\"]: any; []: loopback names (localhost and *.localhost, 127.0.0.0/8, ::1) while host is a loopback address, else any. Others are a 403, which stops a web page re-pointing its own name at 127.0.0.1 (DNS rebinding)")
    sse_keepalive_interval: float = _opt(15.0, "seconds between SSE comment lines (': keep-alive') while a stream waits for its first token (queue, prefill), so that proxies with idle timeouts keep the connection; 0 disables", low=0)
    default_max_tokens: int | None = _opt(4096, "output-token limit of a chat or /generate request that gives no max_tokens (capped by what the context and the KV cache leave; /v1/completions keeps OpenAI's 16); null: the rest of the context. 4096 leaves room for a thinking model's reasoning while a forgotten max_tokens cannot run for many minutes", low=1)
    max_tokens_cap: int | None = _opt(None, "largest max_tokens any request gets (a larger one is lowered to it); null: only the context bounds it", low=1)
    reasoning_parser: str | None = _opt("auto", "split thinking into reasoning_content and reasoning: auto (from the model's architecture and chat template; none when the template has no <think>) | none | qwen3 | qwen3_5 (null: none)", choices=("auto", "none", None, "qwen3", "qwen3_5"))
    tool_call_parser: str | None = _opt("auto", "parse tool calls into tool_calls: auto (from the model's architecture and chat template; none when the template has no <tool_call>) | none | qwen3 (alias hermes) | qwen3_5 (alias qwen3_coder) (null: none)", choices=("auto", "none", None, "qwen3", "hermes", "qwen3_5", "qwen3_coder"))
    media_dirs: tuple[str, ...] = _opt([], "folders that local image paths (absolute paths, file:// URLs) may be read from; []: none (applies at the next model load)")
    allow_remote_images: bool = _opt(False, "fetch http(s) image URLs (never loopback, link-local or multicast addresses); false: refused (applies at the next model load)")
    remote_image_timeout: float = _opt(10.0, "seconds to connect to and download one remote image (applies at the next model load)", positive=True)
    max_image_bytes: int = _opt(12 * MIB, "largest encoded image (data URL, file or download), in bytes (12 MiB; a data URL is also bounded by max_request_bytes, whose default holds one such image); larger: 400 (applies at the next model load)", low=1)
    max_image_pixels: int = _opt(1024 * 32 * 32, "most pixels an image is resized to for the vision tower (smart_resize's max_pixels, never above the model's own preprocessor_config.json value, 16,777,216 = 16,384 tokens for Qwen3-VL); a larger image is scaled down, keeping its aspect ratio. 1,048,576 (1,024 tokens): a 4000x3000 photo becomes 1152x864, 972 tokens (applies at the next model load)", low=1024)
    max_image_decode_pixels: int = _opt(50_000_000, "most pixels (width x height) of a stored image, read from its header before decoding (the decompression-bomb guard; decoding takes up to about 28 bytes a pixel, 1.4 GB at the default); more: 400 (applies at the next model load)", low=1)
    max_images_per_request: int = _opt(8, "most images in one request; more: 400 (applies at the next model load)", low=1)

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class ModelSection:
    """The daemon-only model keys (the engine's model keys live in `EngineConfig`)."""

    path: str | None = _opt(None, "model folder (or a folder name under models_dir) loaded at boot, unless `mllmctl load-model` chose another since (the daemon's state folder records it; a changed model.path wins again); null: start with no model")
    chat_template: str | None = _opt(None, "Jinja chat template file used instead of the model's own; null: the model's (requests can never supply a template)")
    served_model_name: tuple[str, ...] | None = _opt(None, "model id in the API, or a list of aliases (the first is the primary id; requests may name any); null: the model folder's name")
    models_dir: tuple[str, ...] = _opt(["/var/lib/mllmd/models"], "folders that hold models (listed by mllmctl models; bare names resolve here)")
    quantization: str | None = _opt(None, "expected quantization: null (the checkpoint's) | w8a8 | w4a16; must match the checkpoint", choices=(None, "w8a8", "w4a16"))

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class IpcSection:
    """How large tensors (images, vision features) travel between processes."""

    tensor_transport_mode: str = _opt("default", "default (CPU shared memory) | cuda_ipc | cuda_ipc_pool", choices=("default", "cuda_ipc", "cuda_ipc_pool"))
    cuda_ipc_pool_size_mb: int = _opt(256, "GPU workspace for cuda_ipc_pool, in MiB", low=1)

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class WorkersSection:
    """Worker health checks and restarts."""

    heartbeat_interval: float = _opt(1.0, "seconds between worker heartbeats", positive=True)
    heartbeat_timeout: float = _opt(10.0, "seconds without a heartbeat before a worker is restarted", positive=True)
    ready_timeout: float = _opt(600.0, "seconds a starting worker may take to become ready (model load)", positive=True)
    restart_backoff_initial: float = _opt(0.5, "seconds before the first restart; doubles each time", positive=True)
    restart_backoff_max: float = _opt(30.0, "longest wait between restarts, in seconds", positive=True)
    max_restarts: int = _opt(5, "restarts allowed within restart_window; more leave the daemon degraded", low=0)
    restart_window: float = _opt(300.0, "window for counting restarts, in seconds", positive=True)

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ConfigError("workers.heartbeat_timeout", f"must be greater than workers.heartbeat_interval ({self.heartbeat_interval})")
        if self.restart_backoff_max < self.restart_backoff_initial:
            raise ConfigError("workers.restart_backoff_max", f"must be >= workers.restart_backoff_initial ({self.restart_backoff_initial})")


@dataclass(frozen=True)
class TelemetrySection:
    """Device telemetry (power, temperature, utilisation) exported on /metrics."""

    enabled: bool = _opt(True, "collect device telemetry")
    interval: float = _opt(1.0, "seconds between samples", positive=True)
    tegrastats_path: str = _opt("/usr/bin/tegrastats", "tegrastats binary (Jetson; a bare name is looked up on PATH); missing: NVML or procfs")
    nvml: bool = _opt(True, "use NVML when it is available")

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class LoggingSection:
    """Logging to the journal (stderr)."""

    level: str = _opt("INFO", "DEBUG | INFO | WARNING | ERROR | CRITICAL (a reload sets the main process's at once, the workers' at the next model load)", choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), upper=True)
    format: str = _opt("text", "text | json (one JSON object per line)", choices=("text", "json"))

    def __post_init__(self) -> None:
        _check_fields(self)


# Section order of the file; None: the section holds engine keys only.
SECTIONS: dict[str, tuple[type | None, str]] = {
    "server": (ServerSection, ServerSection.__doc__ or ""),
    "model": (ModelSection, "The model: where it is, its name in the API, how it is loaded."),
    "scheduler": (None, "Continuous batching limits."),
    "cache": (None, "KV cache and prefix cache."),
    "runtime": (None, "Device, attention kernels, memory, CUDA graphs."),
    "ipc": (IpcSection, IpcSection.__doc__ or ""),
    "workers": (WorkersSection, WorkersSection.__doc__ or ""),
    "telemetry": (TelemetrySection, TelemetrySection.__doc__ or ""),
    "logging": (LoggingSection, LoggingSection.__doc__ or ""),
}
# EngineConfig fields that are not config keys: the model path is `model.path` (null allowed).
_ENGINE_NOT_KEYS = {"model_path"}


@dataclass(frozen=True)
class Key:
    """One configuration key of the schema."""

    section: str
    name: str
    hint: Any
    default: Any
    doc: str
    engine: bool
    meta: Mapping[str, Any]

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def secret(self) -> bool:
        return bool(self.meta.get("secret"))

    def kind(self) -> tuple[type, bool, bool]:
        """(base type, nullable, is a list)."""
        if get_origin(self.hint) in (tuple, list):
            return str, False, True
        args = get_args(self.hint) or (self.hint,)
        if any(get_origin(a) in (tuple, list) for a in args):  # a list or null
            return str, type(None) in args, True
        base = next(a for a in args if a is not type(None))
        return base, type(None) in args, False


def _build_schema() -> dict[str, Key]:
    schema: dict[str, Key] = {}
    engine_hints = get_type_hints(EngineConfig)
    engine_sections = {f.metadata["section"] for f in fields(EngineConfig)}
    for sec in engine_sections - SECTIONS.keys():  # a new engine section: keep it, at the end
        SECTIONS[sec] = (None, f"{sec} options.")
    for sec, (cls, _) in SECTIONS.items():
        if cls is not None:
            hints = get_type_hints(cls)
            for f in fields(cls):
                schema[f"{sec}.{f.name}"] = Key(sec, f.name, hints[f.name], f.default, f.metadata["doc"], False, f.metadata)
        for f in fields(EngineConfig):
            if f.metadata["section"] != sec or f.name in _ENGINE_NOT_KEYS:
                continue
            if f"{sec}.{f.name}" in schema:
                raise RuntimeError(f"{sec}.{f.name} is both an engine and a daemon key")
            schema[f"{sec}.{f.name}"] = Key(sec, f.name, engine_hints[f.name], f.default, f.metadata["doc"], True, f.metadata)
    return schema


SCHEMA: dict[str, Key] = _build_schema()
_KEYS_BY_CLASS: dict[type, list[Key]] = {
    cls: [k for k in SCHEMA.values() if k.section == sec and not k.engine] for sec, (cls, _) in SECTIONS.items() if cls
}


def _shown(key: Key, value: Any) -> str:
    return f"a {type(value).__name__}" if key.secret else repr(value)


def check_value(key: Key, value: Any) -> Any:
    """Normalise (list -> tuple, int -> float, upper-case) and validate one value; ConfigError if bad."""
    if key.engine:
        try:
            EngineConfig(**{key.name: value})
        except ConfigError as e:
            if e.key == key.dotted:  # a check across keys is left to the whole config
                raise
        except TypeError as e:  # e.g. an unhashable value
            raise ConfigError(key.dotted, str(e)) from None
        base, _, _ = key.kind()
        return float(value) if base is float and isinstance(value, int) and not isinstance(value, bool) else value
    base, nullable, is_list = key.kind()
    meta = key.meta
    if value is None:
        if not nullable:
            raise ConfigError(key.dotted, "must not be null")
        return None
    if is_list:
        if isinstance(value, str):
            if not value and nullable:
                raise ConfigError(key.dotted, "must not be empty (use null)")
            value = (value,)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(key.dotted, f"must be a list of non-empty strings, got {value!r}")
        return tuple(value) if value or not nullable else None
    if base is bool:
        ok, want = isinstance(value, bool), "a boolean"
    elif base is int:
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif base is float:
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
        value = float(value) if ok else value
    else:
        ok, want = isinstance(value, str), "a string"
    if not ok:
        raise ConfigError(key.dotted, f"must be {want}, got {_shown(key, value)}")
    if base is str and nullable and not value:
        raise ConfigError(key.dotted, "must not be empty (use null)")
    if meta.get("upper"):
        value = value.upper()
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        allowed = " | ".join("null" if c is None else c for c in choices)
        raise ConfigError(key.dotted, f"must be one of {allowed}; got {value!r}")
    if meta.get("low") is not None and value < meta["low"]:
        raise ConfigError(key.dotted, f"must be >= {meta['low']}; got {value}")
    if meta.get("high") is not None and value > meta["high"]:
        raise ConfigError(key.dotted, f"must be <= {meta['high']}; got {value}")
    if meta.get("positive") and value <= 0:
        raise ConfigError(key.dotted, f"must be > 0; got {value}")
    return value


def is_loopback_host(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class DaemonConfig:
    """The whole daemon configuration. `engine` holds the engine keys (its model_path is unset)."""

    server: ServerSection = field(default_factory=ServerSection)
    model: ModelSection = field(default_factory=ModelSection)
    ipc: IpcSection = field(default_factory=IpcSection)
    workers: WorkersSection = field(default_factory=WorkersSection)
    telemetry: TelemetrySection = field(default_factory=TelemetrySection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    engine: EngineConfig = field(default_factory=EngineConfig)
    config_file: str | None = field(default=None, compare=False)  # the YAML file read, if any
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)  # key -> origin
    _file_api_keys: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        s = self.server
        if s.api_key is not None and s.api_key_file is not None:
            raise ConfigError("server.api_key_file", "set either server.api_key or server.api_key_file, not both")
        if s.api_key_file is not None:
            object.__setattr__(self, "_file_api_keys", _read_key_file(s.api_key_file))
        if self.model.chat_template is not None:
            _check_template_file(self.model.chat_template)
        if not s.host:
            raise ConfigError("server.host", "must not be empty")
        if s.admin_api_key is not None and s.admin_api_key in self.api_keys:
            raise ConfigError("server.admin_api_key", "must differ from the API key")
        if not is_loopback_host(s.host) and self.api_key is None and not s.allow_unauthenticated_lan:
            raise ConfigError(
                "server.host",
                f"{s.host!r} is reachable from the network but no API key is set; set server.api_key "
                "(or server.api_key_file), or server.allow_unauthenticated_lan: true",
            )

    @property
    def api_key(self) -> str | None:
        """The (first) API key: `server.api_key` or the first key of `server.api_key_file`."""
        keys = self.api_keys
        return keys[0] if keys else None

    @property
    def api_keys(self) -> tuple[str, ...]:
        """Every accepted API key: `server.api_key`, or the keys of `server.api_key_file`."""
        return (self.server.api_key,) if self.server.api_key is not None else self._file_api_keys

    @property
    def admin_api_key(self) -> str | None:
        return self.server.admin_api_key

    def get(self, dotted: str) -> Any:
        """The value of `section.key`."""
        key = SCHEMA.get(dotted)
        if key is None:
            raise KeyError(dotted)
        return getattr(self.engine if key.engine else getattr(self, key.section), key.name)

    def to_dict(self, redact: bool = False) -> dict[str, dict[str, Any]]:
        """{section: {key: value}} in schema order (tuples as lists); secrets as "***" if `redact`."""
        out: dict[str, dict[str, Any]] = {sec: {} for sec in SECTIONS}
        for dotted, key in SCHEMA.items():
            value = self.get(dotted)
            if isinstance(value, tuple):
                value = list(value)
            if redact and key.secret and value is not None:
                value = REDACTED
            out[key.section][key.name] = value
        return out

    def redacted(self) -> dict[str, dict[str, Any]]:
        """`to_dict()` with the secrets replaced by "***" (null stays null): safe to print or log."""
        return self.to_dict(redact=True)

    def with_values(self, values: Mapping[str, Any], source: str = "overrides") -> DaemonConfig:
        """A copy with `{"section.key": value}` changes applied and validated."""
        changed = [(k, self.get(k), self.sources.get(k, "")) for k, key in SCHEMA.items() if k in self.sources or self.get(k) != key.default]
        layer = [(k, v, source) for k, v in values.items()]
        return build_config([_checked(changed), _checked(layer)], config_file=self.config_file)

    def resolve_model_path(self, path: str) -> str:
        """A bare folder name that is not a folder here is looked up in `model.models_dir`."""
        if os.sep in path or os.path.exists(path):
            return path
        for folder in self.model.models_dir:
            candidate = os.path.join(folder, path)
            if os.path.isdir(candidate):
                return candidate
        return path

    def engine_config(self, model_path: str | None = None) -> EngineConfig:
        """The engine's configuration for `model_path` (default: `model.path`)."""
        path = model_path if model_path is not None else self.model.path
        if path is None:
            raise ConfigError("model.path", "no model configured; set model.path or load one with `mllmctl load-model PATH`")
        return self.engine.replace(model_path=self.resolve_model_path(os.fspath(path)))

    def served_model_name(self, model_path: str | None = None) -> str | None:
        """The API model id: the first of `model.served_model_name` for the boot model, else the folder's name."""
        names = self.served_model_names(model_path)
        return names[0] if names else None

    def served_model_names(self, model_path: str | None = None) -> tuple[str, ...]:
        """Every id the model answers to: `model.served_model_name` (a list of aliases) for the boot
        model, else the folder's name; () without a model."""
        path = model_path if model_path is not None else self.model.path
        if path is None:
            return ()
        if self.model.served_model_name is not None and (model_path is None or self._is_boot_model(model_path)):
            return self.model.served_model_name
        return (os.path.basename(os.path.normpath(os.fspath(path))),)

    def _is_boot_model(self, model_path: str) -> bool:
        """`model_path` names the folder of `model.path` (a bare name, a symlink or a trailing slash
        in either still matches)."""
        if self.model.path is None:
            return False

        def real(p: str) -> str:
            return os.path.realpath(self.resolve_model_path(os.fspath(p)))

        return model_path == self.model.path or real(model_path) == real(self.model.path)

    def check_quantization(self, detected: str | None) -> None:
        """Raise unless `model.quantization` is null or equals the checkpoint's scheme (`detected`)."""
        want = self.model.quantization
        if want is not None and want != detected:
            raise ConfigError("model.quantization", f"is {want!r} but the checkpoint is {detected or 'not quantized'}")


def _read_key_file(path: str) -> tuple[str, ...]:
    """The keys of an API key file: one per line; blank lines and `#` comments skipped. The keys are
    never part of an error message."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read(1 << 20).splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("server.api_key_file", f"cannot read {path}: {getattr(e, 'strerror', None) or 'not UTF-8'}") from None
    keys = tuple(k for line in lines if (k := line.strip()) and not k.startswith("#"))
    if not keys:
        raise ConfigError("server.api_key_file", f"{path} holds no key (one per line; # starts a comment)")
    return keys


def _check_template_file(path: str) -> None:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(1 << 20 | 1)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("model.chat_template", f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    if not text.strip():
        raise ConfigError("model.chat_template", f"{path} is empty")
    if len(text) > 1 << 20:
        raise ConfigError("model.chat_template", f"{path} is larger than 1 MiB")


# ----------------------------------------------------------------------------------------- sources


def _unknown(dotted: str) -> str:
    close = difflib.get_close_matches(dotted, SCHEMA, n=1)
    return "unknown key" + (f" (did you mean {close[0]}?)" if close else "")


def _lookup(dotted: str, source: str) -> Key:
    key = SCHEMA.get(dotted)
    if key is None:
        section = dotted.partition(".")[0]
        if section not in SECTIONS:
            raise DaemonConfigError(section, f"unknown section (known: {', '.join(SECTIONS)})", source)
        raise DaemonConfigError(dotted, _unknown(dotted), source)
    return key


def _checked(layer: Layer) -> Layer:
    """Check each value's key and value where it was given, so an error names its source."""
    out: Layer = []
    for dotted, value, source in layer:
        key = _lookup(dotted, source)
        try:
            out.append((dotted, check_value(key, value), source))
        except ConfigError as e:
            raise DaemonConfigError(e.key, e.message, source) from None
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def mapping_layer(data: Any, source: str) -> Layer:
    """Flatten `{section: {key: value}}` (a parsed YAML document) into a layer."""
    if data is None:
        return []
    if not isinstance(data, Mapping):
        raise DaemonConfigError("", "the top level must be a mapping of sections (server:, model:, ...)", source)
    layer: Layer = []
    for section, keys in data.items():
        if str(section) not in SECTIONS:
            raise DaemonConfigError(str(section), f"unknown section (known: {', '.join(SECTIONS)})", source)
        if keys is None:
            continue
        if not isinstance(keys, Mapping):
            raise DaemonConfigError(str(section), "must be a mapping of keys", source)
        layer += [(f"{section}.{name}", value, source) for name, value in keys.items()]
    return _checked(layer)


def yaml_layer(path: str | os.PathLike[str], required: bool = True) -> Layer:
    """The keys set in a YAML file; a missing file is an error only if `required`."""
    source = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        if required:
            raise DaemonConfigError("", "configuration file not found", source) from None
        return []
    except OSError as e:
        raise DaemonConfigError("", f"cannot read the configuration file: {e.strerror}", source) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise DaemonConfigError("", f"invalid YAML: {where}{e.problem or e.context}", source) from None
    except yaml.YAMLError as e:
        raise DaemonConfigError("", f"invalid YAML: {e}".replace("\n", " "), source) from None
    return mapping_layer(data, source)


_NULL_WORDS = {"null", "Null", "NULL", "~"}


def parse_text(key: Key, raw: str) -> Any:
    """A value given as text (environment, command line), parsed as a YAML scalar or list.

    Strings are taken verbatim ("12345", "#key" stay strings); only "", null and ~ mean null.
    A single string for a list key is a one-item list; booleans also accept 1 and 0.
    """
    base, nullable, is_list = key.kind()
    if not raw.strip():
        return () if is_list else ("" if base is str and not nullable else None)
    if raw.strip() in _NULL_WORDS:
        return None
    if base is str and not is_list:
        return raw
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    if is_list and not isinstance(value, list):
        return (raw,)
    if base is bool and raw.strip() in ("1", "0"):
        return raw.strip() == "1"
    return value


def env_layer(environ: Mapping[str, str] | None = None) -> Layer:
    """`MLLMD_SECTION__KEY=value` variables (other MLLMD_* names without `__` are ignored)."""
    environ = os.environ if environ is None else environ
    layer: Layer = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        section, _, key_name = name[len(ENV_PREFIX):].partition("__")
        dotted = f"{section.lower()}.{key_name.lower()}"
        source = f"environment variable {name}"
        key = _lookup(dotted, source)
        layer.append((dotted, parse_text(key, environ[name]), source))
    return _checked(layer)


_BOOL_WORDS = {"true", "false", "yes", "no", "on", "off", "1", "0"}


def cli_layer(args: Sequence[str]) -> Layer:
    """`--section.key value`, `--section.key=value`; a boolean may be a bare flag (= true)."""
    layer: Layer = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--") or len(arg) == 2:
            raise DaemonConfigError("", f"unexpected argument {arg!r} (options are --section.key VALUE)", "command line")
        name, eq, raw = arg[2:].partition("=")
        section, dot, key_name = name.partition(".")
        if not dot:
            raise DaemonConfigError("", f"unknown option --{name} (options are --section.key VALUE)", "command line")
        dotted = f"{section}.{key_name.replace('-', '_')}"
        source = f"command line option --{dotted}"
        key = _lookup(dotted, source)
        if not eq:
            nxt = args[i] if i < len(args) else None
            if key.kind()[0] is bool:
                if nxt is not None and nxt.lower() in _BOOL_WORDS:
                    raw, i = nxt, i + 1
                else:
                    raw = "true"
            elif nxt is None or nxt.startswith("--"):
                raise DaemonConfigError(dotted, "needs a value", source)
            else:
                raw, i = nxt, i + 1
        layer.append((dotted, parse_text(key, raw), source))
    return _checked(layer)


def build_config(layers: Iterable[Layer], config_file: str | None = None) -> DaemonConfig:
    """Apply checked layers in order (later wins) and build the validated `DaemonConfig`."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for layer in layers:
        for dotted, value, source in layer:
            values[dotted] = value
            if source:
                sources[dotted] = source
            else:
                sources.pop(dotted, None)
    try:
        sections: dict[str, Any] = {}
        for sec, (cls, _) in SECTIONS.items():
            if cls is not None:
                sections[sec] = cls(**{k.name: values[k.dotted] for k in _KEYS_BY_CLASS[cls] if k.dotted in values})
        engine = EngineConfig(**{k.name: v for d, v in values.items() if (k := SCHEMA[d]).engine})
        return DaemonConfig(**sections, engine=engine, config_file=config_file, sources=sources)
    except ConfigError as e:
        raise DaemonConfigError(e.key, e.message, sources.get(e.key)) from None


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Sequence[str] | Mapping[str, Any] = (),
    environ: Mapping[str, str] | None = None,
) -> DaemonConfig:
    """Defaults < YAML (`path`, else DEFAULT_CONFIG_PATH if present) < environment < overrides.

    `overrides` is command-line tokens (`["--server.port", "8080"]`) or `{"server.port": 8080}`.
    `environ` defaults to `os.environ`. Raises `DaemonConfigError`.
    """
    file = os.fspath(path) if path is not None else DEFAULT_CONFIG_PATH
    file_layer = yaml_layer(file, required=path is not None)
    if isinstance(overrides, Mapping):
        last = _checked([(k, v, "overrides") for k, v in overrides.items()])
    else:
        last = cli_layer(list(overrides))
    read = file if (path is not None or os.path.exists(file)) else None
    return build_config([file_layer, env_layer(environ), last], config_file=read)


# --------------------------------------------------------------------------------------- rendering


def _yaml_value(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, allow_unicode=True).strip()
    return text[: -len("\n...")] if text.endswith("\n...") else text


_HEADER = """\
# /etc/mllmd/mllmd.yaml: configuration of the mllmd daemon.
#
# Every key is listed with its default value. Precedence: defaults < this file < environment
# (MLLMD_SECTION__KEY=value) < command line (mllmd --section.key value). Unknown keys and bad
# values are errors. Show the effective configuration (secrets hidden) with: mllmd check-config
#
# This file is generated from the schema (mllmd.daemon.config.render_default_yaml).
"""


def render_default_yaml() -> str:
    """The documented default configuration file (etc/mllmd/mllmd.yaml)."""
    lines = [_HEADER]
    for sec, (_, doc) in SECTIONS.items():
        lines.append(f"# {doc.strip()}")
        lines.append(f"{sec}:")
        for key in SCHEMA.values():
            if key.section == sec:
                lines.append(f"  # {key.doc}")
                lines.append(f"  {key.name}: {_yaml_value(key.default)}")
        lines.append("")
    return "\n".join(lines)


def render_effective_yaml(cfg: DaemonConfig) -> str:
    """The effective configuration as YAML, secrets redacted; values not defaulted say where from."""
    where = cfg.config_file or f"none ({DEFAULT_CONFIG_PATH} not found; defaults)"
    lines = ["# mllmd effective configuration", f"# file: {where}"]
    for sec, keys in cfg.redacted().items():
        lines.append(f"{sec}:")
        for name, value in keys.items():
            dotted = f"{sec}.{name}"
            origin = cfg.sources.get(dotted)
            changed = origin != cfg.config_file or cfg.get(dotted) != SCHEMA[dotted].default
            note = f"  # from {origin}" if origin and changed else ""
            lines.append(f"  {name}: {_yaml_value(value)}{note}")
    return "\n".join(lines) + "\n"


def describe_keys() -> str:
    """One line per key (for --help): `section.key (default): doc`."""
    return "\n".join(f"  --{k.dotted} (default {_yaml_value(k.default)}): {k.doc}" for k in SCHEMA.values())


__all__ = [
    "DEFAULT_CONFIG_PATH",
    "SCHEMA",
    "SECTIONS",
    "DaemonConfig",
    "DaemonConfigError",
    "Key",
    "load_config",
    "render_default_yaml",
    "render_effective_yaml",
]
