"""Daemon configuration: precedence, parsing, errors that name key and source, redaction, CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from mllmd import cli
from mllmd.config import ConfigError, EngineConfig
from mllmd.daemon import config as dc
from mllmd.daemon.config import SCHEMA, DaemonConfig, DaemonConfigError, load_config

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_FILE = REPO_ROOT / "etc" / "mllmd" / "mllmd.yaml"


@pytest.fixture(autouse=True)
def _no_system_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Never read the host's /etc/mllmd/mllmd.yaml."""
    monkeypatch.setattr(dc, "DEFAULT_CONFIG_PATH", str(tmp_path / "absent.yaml"))


def write(tmp_path: Path, text: str, name: str = "mllmd.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load(path: Path | None = None, args: list[str] | None = None, env: dict[str, str] | None = None) -> DaemonConfig:
    return load_config(path, args or [], environ=env or {})


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MLLMD_")}
    return subprocess.run(
        [sys.executable, "-m", "mllmd.cli", *args],
        capture_output=True, text=True, cwd=REPO_ROOT, env={**clean, **(env or {})}, timeout=60,
    )


# ------------------------------------------------------------------------------------ precedence


def test_defaults_without_a_file() -> None:
    cfg = load()
    assert cfg == DaemonConfig() and cfg.config_file is None
    assert cfg.server.host == "127.0.0.1" and cfg.server.port == 30000
    assert cfg.server.unix_socket == "/run/mllmd/mllmd.sock" and cfg.model.path is None
    assert cfg.model.models_dir == ("/var/lib/mllmd/models",)
    assert cfg.workers.max_restarts == 5 and cfg.workers.restart_window == 300.0


def test_precedence_defaults_file_env_cli(tmp_path: Path) -> None:
    path = write(tmp_path, "server:\n  port: 1001\n")
    env = {"MLLMD_SERVER__PORT": "1002"}
    assert load().server.port == 30000
    assert load(path).server.port == 1001
    assert load(path, env=env).server.port == 1002
    cfg = load(path, ["--server.port", "1003"], env)
    assert cfg.server.port == 1003
    assert cfg.sources["server.port"] == "command line option --server.port"
    assert load(path, env=env).sources["server.port"] == "environment variable MLLMD_SERVER__PORT"
    assert load(path).sources["server.port"] == str(path)


def test_layers_merge_key_by_key(tmp_path: Path) -> None:
    path = write(tmp_path, "server:\n  port: 1001\n  max_queued_requests: 7\nscheduler:\n  max_running_requests: 3\n")
    cfg = load(path, ["--scheduler.max_running_requests", "5"], {"MLLMD_SERVER__PORT": "1002"})
    assert (cfg.server.port, cfg.server.max_queued_requests, cfg.engine.max_running_requests) == (1002, 7, 5)


def test_missing_default_file_is_fine_but_explicit_is_an_error(tmp_path: Path) -> None:
    assert load() == DaemonConfig()
    with pytest.raises(DaemonConfigError, match="not found") as err:
        load(tmp_path / "nope.yaml")
    assert str(tmp_path / "nope.yaml") in str(err.value)


def test_default_path_is_read_when_present(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "logging:\n  level: debug\n")
    monkeypatch.setattr(dc, "DEFAULT_CONFIG_PATH", str(path))
    cfg = load_config(environ={})
    assert cfg.logging.level == "DEBUG" and cfg.config_file == str(path)


def test_empty_file_and_empty_section(tmp_path: Path) -> None:
    assert load(write(tmp_path, "")) == DaemonConfig()
    assert load(write(tmp_path, "server:\n# nothing\n")) == DaemonConfig()


# ---------------------------------------------------------------------------------- environment


def test_env_parsing() -> None:
    cfg = load(env={
        "MLLMD_SERVER__PORT": "8080",
        "MLLMD_SERVER__API_KEY": "12345",
        "MLLMD_SERVER__UNIX_SOCKET": "",
        "MLLMD_SERVER__MEDIA_DIRS": "[/srv/a, /srv/b]",
        "MLLMD_MODEL__MODELS_DIR": "/data/models",
        "MLLMD_MODEL__PATH": "",
        "MLLMD_CACHE__DISABLE_RADIX_CACHE": "true",
        "MLLMD_RUNTIME__MEM_FRACTION_STATIC": "0.5",
        "MLLMD_WORKERS__HEARTBEAT_TIMEOUT": "20",
        "MLLMD_LOGGING__LEVEL": "debug",
        "MLLMD_SCHEDULER__MAX_TOTAL_TOKENS": "null",
        "MLLMD_SERVER__ADMIN_API_KEY": "#not-a-comment",
        "MLLMD_RUNTIME__DISABLE_CUDA_GRAPH": "1",
        "MLLMD_UNRELATED": "ignored",
        "OTHER__VAR": "ignored",
    })
    assert cfg.server.port == 8080
    assert cfg.api_key == "12345"  # a number-looking key stays a string
    assert cfg.server.unix_socket == ""
    assert cfg.server.media_dirs == ("/srv/a", "/srv/b")
    assert cfg.model.models_dir == ("/data/models",)
    assert cfg.model.path is None
    assert cfg.engine.disable_radix_cache is True and cfg.engine.mem_fraction_static == 0.5
    assert cfg.workers.heartbeat_timeout == 20.0 and isinstance(cfg.workers.heartbeat_timeout, float)
    assert cfg.logging.level == "DEBUG" and cfg.engine.max_total_tokens is None
    assert cfg.admin_api_key == "#not-a-comment" and cfg.engine.disable_cuda_graph is True


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"MLLMD_SERVER__PORT": "abc"}, "server.port"),
        ({"MLLMD_SERVER__PROT": "1"}, "server.prot"),
        ({"MLLMD_SERVERS__PORT": "1"}, "servers"),
        ({"MLLMD_SCHEDULER__MAX_RUNNING_REQUESTS": "0"}, "scheduler.max_running_requests"),
    ],
)
def test_env_errors_name_variable_and_key(env: dict[str, str], key: str) -> None:
    with pytest.raises(DaemonConfigError) as err:
        load(env=env)
    assert err.value.key == key and key in str(err.value)
    assert f"environment variable {next(iter(env))}" in str(err.value)


# --------------------------------------------------------------------------------- command line


def test_bare_boolean_flags() -> None:
    assert load(args=["--cache.disable_radix_cache"]).engine.disable_radix_cache is True
    cfg = load(args=["--cache.disable_radix_cache", "--server.port", "9"])
    assert cfg.engine.disable_radix_cache is True and cfg.server.port == 9
    assert load(args=["--cache.disable_radix_cache", "false"]).engine.disable_radix_cache is False
    assert load(args=["--runtime.disable_cuda_graph=no"]).engine.disable_cuda_graph is False
    assert load(args=["--cache.disable-radix-cache"]).engine.disable_radix_cache is True


def test_equals_form_and_lists() -> None:
    cfg = load(args=[
        "--server.port=8081", "--server.host=localhost", "--server.media_dirs=[/m1, /m2]",
        "--model.models_dir", "/one", "--runtime.random_seed", "-3", "--server.api_key=a=b",
    ])
    assert cfg.server.port == 8081 and cfg.server.host == "localhost"
    assert cfg.server.media_dirs == ("/m1", "/m2") and cfg.model.models_dir == ("/one",)
    assert cfg.engine.random_seed == -3 and cfg.api_key == "a=b"


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--server.port"], "server.port: needs a value"),
        (["--server.port", "--cache.disable_radix_cache"], "server.port: needs a value"),
        (["stray"], "unexpected argument 'stray'"),
        (["--port", "1"], "unknown option --port"),
        (["--server.prot", "1"], "server.prot: unknown key \\(did you mean server.port\\?\\)"),
        (["--nosuch.key", "1"], "nosuch: unknown section"),
        (["--server.port", "1.5"], "command line option --server.port: server.port: must be an integer"),
    ],
)
def test_cli_errors(args: list[str], match: str) -> None:
    with pytest.raises(DaemonConfigError, match=match):
        load(args=args)


def test_mapping_overrides() -> None:
    cfg = load_config(None, {"server.port": 5, "cache.disable_radix_cache": True}, environ={})
    assert cfg.server.port == 5 and cfg.engine.disable_radix_cache is True
    with pytest.raises(DaemonConfigError, match="overrides: server.port"):
        load_config(None, {"server.port": "5"}, environ={})


# ------------------------------------------------------------------------------------ YAML errors


def yaml_error(tmp_path: Path, text: str) -> DaemonConfigError:
    path = write(tmp_path, text)
    with pytest.raises(DaemonConfigError) as err:
        load(path)
    assert str(path) in str(err.value), "the message names the file"
    return err.value


def test_unknown_key_in_yaml_names_key_and_file(tmp_path: Path) -> None:
    err = yaml_error(tmp_path, "server:\n  prot: 8080\n")
    assert err.key == "server.prot" and "server.prot" in str(err) and "server.port" in str(err)


def test_unknown_section(tmp_path: Path) -> None:
    err = yaml_error(tmp_path, "serve:\n  port: 8080\n")
    assert err.key == "serve" and "unknown section" in str(err)


@pytest.mark.parametrize(
    ("text", "key", "match"),
    [
        ("server:\n  port: '8080'\n", "server.port", "must be an integer"),
        ("server:\n  port: true\n", "server.port", "must be an integer"),
        ("server:\n  allow_unauthenticated_lan: 1\n", "server.allow_unauthenticated_lan", "must be a boolean"),
        ("server:\n  media_dirs: [1]\n", "server.media_dirs", "list of non-empty strings"),
        ("server:\n  host: null\n", "server.host", "must not be null"),
        ("model:\n  served_model_name: ''\n", "model.served_model_name", "must not be empty"),
        ("scheduler:\n  max_running_requests: many\n", "scheduler.max_running_requests", "must be an integer"),
        ("cache:\n  disable_radix_cache: maybe\n", "cache.disable_radix_cache", "must be a boolean"),
    ],
)
def test_wrong_type(tmp_path: Path, text: str, key: str, match: str) -> None:
    err = yaml_error(tmp_path, text)
    assert err.key == key and match in str(err)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("logging:\n  format: xml\n", "logging.format"),
        ("logging:\n  level: verbose\n", "logging.level"),
        ("server:\n  reasoning_parser: deepseek\n", "server.reasoning_parser"),
        ("model:\n  quantization: fp8\n", "model.quantization"),
        ("ipc:\n  tensor_transport_mode: nccl\n", "ipc.tensor_transport_mode"),
        ("runtime:\n  attention_backend: cudnn\n", "runtime.attention_backend"),
        ("model:\n  dtype: float64\n", "model.dtype"),
    ],
)
def test_bad_choice(tmp_path: Path, text: str, key: str) -> None:
    err = yaml_error(tmp_path, text)
    assert err.key == key and "must be one of" in str(err)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("server:\n  port: 70000\n", "server.port"),
        ("server:\n  port: 0\n", "server.port"),
        ("server:\n  max_request_bytes: 0\n", "server.max_request_bytes"),
        ("server:\n  shutdown_timeout: -1\n", "server.shutdown_timeout"),
        ("workers:\n  heartbeat_interval: 0\n", "workers.heartbeat_interval"),
        ("workers:\n  heartbeat_timeout: 0.5\n", "workers.heartbeat_timeout"),
        ("workers:\n  restart_backoff_max: 0.1\n", "workers.restart_backoff_max"),
        ("workers:\n  max_restarts: -1\n", "workers.max_restarts"),
        ("runtime:\n  mem_fraction_static: 1.5\n", "runtime.mem_fraction_static"),
        ("scheduler:\n  max_running_requests: 0\n", "scheduler.max_running_requests"),
    ],
)
def test_out_of_range(tmp_path: Path, text: str, key: str) -> None:
    assert yaml_error(tmp_path, text).key == key


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("server: [1, 2]\n", "must be a mapping"),
        ("- server\n", "top level must be a mapping"),
        ("server:\n  port: 1\n  port: 2\n", "line 3, column 3: duplicate key 'port'"),
        ("server:\n  port: [\n", "invalid YAML"),
    ],
)
def test_malformed_yaml(tmp_path: Path, text: str, match: str) -> None:
    assert match in str(yaml_error(tmp_path, text))


def test_bad_file_value_is_an_error_even_if_overridden(tmp_path: Path) -> None:
    path = write(tmp_path, "server:\n  port: nope\n")
    with pytest.raises(DaemonConfigError, match=str(path)):
        load(path, ["--server.port", "1"])


# ---------------------------------------------------------------------------- security + secrets


def test_lan_bind_needs_a_key_or_explicit_opt_in(tmp_path: Path) -> None:
    with pytest.raises(DaemonConfigError, match="server.host") as err:
        load(args=["--server.host", "0.0.0.0"])
    assert err.value.source == "command line option --server.host"
    assert load(args=["--server.host", "0.0.0.0", "--server.api_key", "k"]).server.host == "0.0.0.0"
    assert load(args=["--server.host", "::", "--server.allow_unauthenticated_lan"]).server.host == "::"
    for host in ("127.0.0.1", "127.0.1.1", "::1", "localhost"):
        assert load(args=["--server.host", host]).api_key is None


def test_key_conflicts(tmp_path: Path) -> None:
    key_file = write(tmp_path, "k1\n", "key")
    with pytest.raises(DaemonConfigError, match="server.api_key_file: set either"):
        load(args=["--server.api_key", "k1", "--server.api_key_file", str(key_file)])
    with pytest.raises(DaemonConfigError, match="server.admin_api_key: must differ"):
        load(args=["--server.api_key_file", str(key_file), "--server.admin_api_key", "k1"])


def test_api_key_file(tmp_path: Path) -> None:
    key_file = write(tmp_path, "# keys of the LAN clients\n  s3cr3t-from-file  \n\n  # old one below\nsecond-key\n", "key")
    cfg = load(args=["--server.api_key_file", str(key_file)])
    assert cfg.api_key == "s3cr3t-from-file" and cfg.server.api_key is None
    assert cfg.api_keys == ("s3cr3t-from-file", "second-key")  # one per line, comments and blanks skipped
    with pytest.raises(DaemonConfigError, match="server.api_key_file: cannot read"):
        load(args=["--server.api_key_file", str(tmp_path / "missing")])
    with pytest.raises(DaemonConfigError, match="server.api_key_file: .* holds no key") as err:
        load(args=["--server.api_key_file", str(write(tmp_path, "\n# only a comment\n", "empty"))])
    assert "comment\n" not in str(err.value)


def test_served_model_name_aliases() -> None:
    cfg = load(args=["--model.path", "/m/Qwen3-8B", "--model.served_model_name", "[qwen3, gpt-4o-mini]"])
    assert cfg.served_model_names() == ("qwen3", "gpt-4o-mini") and cfg.served_model_name() == "qwen3"
    assert load(args=["--model.path", "/m/Qwen3-8B", "--model.served_model_name", "one"]).served_model_names() == ("one",)
    assert load(args=["--model.path", "/m/Qwen3-8B"]).served_model_names() == ("Qwen3-8B",)


def test_served_model_name_follows_the_boot_model_by_folder(tmp_path: Path) -> None:
    """model.path given as a bare name (found in model.models_dir), with a trailing slash or through a
    symlink still gets its served names when the load names the resolved folder."""
    (tmp_path / "models" / "qwen").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "models" / "qwen")
    for path in ("qwen", f"{tmp_path}/models/qwen/", f"{tmp_path}/link"):
        cfg = load(args=["--model.path", path, "--model.models_dir", f"[{tmp_path / 'models'}]",
                         "--model.served_model_name", "my-model"])
        assert cfg.served_model_names(str(tmp_path / "models" / "qwen")) == ("my-model",), path
        assert cfg.served_model_names(cfg.engine_config().model_path) == ("my-model",), path
        (tmp_path / "models" / "other").mkdir(exist_ok=True)
        assert cfg.served_model_names(str(tmp_path / "models" / "other")) == ("other",)


def test_redacted(tmp_path: Path) -> None:
    cfg = load(args=["--server.api_key", "sk-live-1", "--server.admin_api_key", "adm-2"])
    red = cfg.redacted()
    assert red["server"]["api_key"] == "***" and red["server"]["admin_api_key"] == "***"
    assert load().redacted()["server"]["api_key"] is None
    for text in (repr(cfg), str(cfg), str(red), dc.render_effective_yaml(cfg)):
        assert "sk-live-1" not in text and "adm-2" not in text
    assert cfg.to_dict()["server"]["api_key"] == "sk-live-1"


def test_secret_never_in_error_messages(tmp_path: Path) -> None:
    err = yaml_error(tmp_path, "server:\n  api_key: 998877665544\n")
    assert "998877665544" not in str(err) and "must be a string" in str(err)


def test_check_config_never_prints_secrets(tmp_path: Path) -> None:
    key_file = write(tmp_path, "file-secret-42\n", "key")
    path = write(tmp_path, f"server:\n  api_key_file: {key_file}\n  admin_api_key: admin-secret-7\n")
    proc = run_cli("check-config", "--config", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "file-secret-42" not in proc.stdout + proc.stderr
    assert "admin-secret-7" not in proc.stdout + proc.stderr
    assert str(key_file) in proc.stdout
    proc = run_cli("check-config", "--config", str(path), env={"MLLMD_SERVER__ADMIN_API_KEY": "env-secret-9"})
    assert proc.returncode == 0 and "env-secret-9" not in proc.stdout
    proc = run_cli("check-config", "--config", str(DEFAULT_FILE), "--server.api_key", "cli-secret-3")
    assert proc.returncode == 0 and "cli-secret-3" not in proc.stdout


# ------------------------------------------------------------------------------------ engine


def test_engine_keys_come_from_engine_config() -> None:
    engine_keys = {f"{f.metadata['section']}.{f.name}" for f in fields(EngineConfig) if f.name != "model_path"}
    assert engine_keys == {d for d, k in SCHEMA.items() if k.engine}
    assert set(dc.SECTIONS) >= {"server", "model", "scheduler", "cache", "runtime", "ipc", "workers", "telemetry", "logging"}


def test_engine_config_mapping(tmp_path: Path) -> None:
    cfg = load(args=[
        "--model.path", "/models/Qwen3-0.6B", "--model.dtype", "bfloat16", "--model.context_length", "4096",
        "--model.tokenizer_path", "/tok", "--scheduler.max_running_requests", "8",
        "--scheduler.max_total_tokens", "10000", "--scheduler.max_prefill_tokens", "1024",
        "--scheduler.chunked_prefill_size", "512", "--cache.disable_radix_cache", "--runtime.device", "cpu",
        "--runtime.attention_backend", "torch", "--runtime.mem_fraction_static", "0.5",
        "--runtime.disable_cuda_graph", "--runtime.random_seed", "7", "--runtime.cpu_kv_cache_max_tokens", "4096",
    ])
    eng = cfg.engine_config()
    assert eng == EngineConfig(
        model_path="/models/Qwen3-0.6B", tokenizer_path="/tok", dtype="bfloat16", context_length=4096,
        device="cpu", max_running_requests=8, max_total_tokens=10000, max_prefill_tokens=1024,
        chunked_prefill_size=512, disable_radix_cache=True, attention_backend="torch",
        mem_fraction_static=0.5, disable_cuda_graph=True, random_seed=7, cpu_kv_cache_max_tokens=4096,
    )
    assert cfg.engine_config("/other").model_path == "/other"
    assert cfg.engine_config("/other").max_running_requests == 8
    for f in fields(EngineConfig):
        if f.name != "model_path":
            assert cfg.get(f"{f.metadata['section']}.{f.name}") == getattr(eng, f.name)


def test_engine_config_without_model_and_name_resolution(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load().engine_config()
    assert err.value.key == "model.path"
    (tmp_path / "models" / "Qwen3-8B").mkdir(parents=True)
    cfg = load(args=["--model.models_dir", str(tmp_path / "models"), "--model.path", "Qwen3-8B"])
    assert cfg.engine_config().model_path == str(tmp_path / "models" / "Qwen3-8B")
    assert cfg.served_model_name() == "Qwen3-8B"
    assert cfg.with_values({"model.served_model_name": "qwen"}).served_model_name() == "qwen"
    assert cfg.served_model_name("/x/Other/") == "Other"


def test_quantization_only_confirms_the_checkpoint() -> None:
    load().check_quantization("w8a8")
    cfg = load(args=["--model.quantization", "w4a16"])
    cfg.check_quantization("w4a16")
    with pytest.raises(ConfigError, match="model.quantization"):
        cfg.check_quantization(None)


def test_with_values_keeps_earlier_values() -> None:
    cfg = load(args=["--server.port", "1234"])
    new = cfg.with_values({"logging.level": "warning"})
    assert new.server.port == 1234 and new.logging.level == "WARNING"
    assert new.sources["server.port"] == "command line option --server.port"
    assert DaemonConfig(server=dc.ServerSection(port=9)).with_values({}).server.port == 9
    with pytest.raises(DaemonConfigError, match="overrides: logging.level"):
        cfg.with_values({"logging.level": "loud"})


def test_sections_validate_when_built_directly() -> None:
    with pytest.raises(ConfigError, match="server.port"):
        dc.ServerSection(port=0)
    assert dc.ServerSection(media_dirs=["/a"]).media_dirs == ("/a",)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- default file


def test_default_file_is_in_sync_with_the_schema() -> None:
    assert DEFAULT_FILE.read_text() == dc.render_default_yaml(), (
        "etc/mllmd/mllmd.yaml is stale: regenerate it with "
        "python -c 'from mllmd.daemon.config import render_default_yaml as r; print(r(), end=\"\")' > etc/mllmd/mllmd.yaml"
    )


def test_default_file_documents_every_key_with_its_default() -> None:
    text = DEFAULT_FILE.read_text()
    data = yaml.safe_load(text)
    assert data == DaemonConfig().to_dict()
    assert {f"{s}.{k}" for s, keys in data.items() for k in keys} == set(SCHEMA)
    lines = text.splitlines()
    section, documented = "", set()
    for prev, line in zip(lines, lines[1:]):
        if line and not line.startswith((" ", "#")):
            section = line.rstrip(":")
        elif line.startswith("  ") and not line.startswith("  #"):
            assert prev.startswith("  # ") and len(prev) > 6, f"{line!r} has no comment"
            documented.add(f"{section}.{line.split(':')[0].strip()}")
    assert documented == set(SCHEMA)
    assert load(DEFAULT_FILE) == DaemonConfig()


def test_effective_yaml_round_trips(tmp_path: Path) -> None:
    cfg = load(args=["--server.port", "4321", "--model.models_dir", "[/a, /b]"])
    assert yaml.safe_load(dc.render_effective_yaml(cfg)) == cfg.redacted()


# ------------------------------------------------------------------------------------------- CLI


def test_check_config_passes_on_the_default_file() -> None:
    proc = run_cli("check-config", "--config", str(DEFAULT_FILE))
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout) == DaemonConfig().redacted()


@pytest.mark.parametrize(
    ("text", "args", "key"),
    [
        ("server:\n  prot: 1\n", [], "server.prot"),
        ("server:\n  port: 99999\n", [], "server.port"),
        ("", ["--logging.format", "xml"], "logging.format"),
    ],
)
def test_check_config_exits_2_naming_the_key(tmp_path: Path, text: str, args: list[str], key: str) -> None:
    path = write(tmp_path, text)
    proc = run_cli("check-config", "--config", str(path), *args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert key in proc.stderr and proc.stderr.startswith("mllmd: error:")
    if not args:
        assert str(path) in proc.stderr


def test_cli_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check-config", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "not found" in capsys.readouterr().err
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err
    assert cli.main(["check-config", "--config"]) == 2
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("mllmd 0.")
    assert cli.main(["--help"]) == 0
    assert "--server.port" in capsys.readouterr().out


def test_run_hands_the_config_to_the_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[DaemonConfig] = []
    fake = types.ModuleType("mllmd.daemon.main")
    fake.run = lambda config: seen.append(config) or 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mllmd.daemon.main", fake)
    monkeypatch.delenv("MLLMD_SERVER__PORT", raising=False)
    assert cli.main(["--server.port", "8123"]) == 3
    assert cli.main(["run", "--server.port", "8124"]) == 3
    assert [c.server.port for c in seen] == [8123, 8124]


def test_run_without_the_daemon_module(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "mllmd.daemon.main", None)  # import raises ModuleNotFoundError
    assert cli.main([]) == 1
    assert "mllmd.daemon.main" in capsys.readouterr().err


def test_no_torch_in_the_main_process() -> None:
    code = (
        "import sys, mllmd.daemon.config, mllmd.cli; "
        "mllmd.cli.main(['check-config', '--config', 'etc/mllmd/mllmd.yaml']); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("key,value", [
    ("server.max_json_depth", 1), ("server.max_json_depth", 1000), ("server.max_stop_length", 0),
    ("server.header_timeout", 0), ("server.body_timeout", -1), ("server.max_header_bytes", 100),
    ("server.keepalive_timeout", 0), ("server.max_connections", 0), ("server.max_unix_connections", 0),
])
def test_hardening_keys_are_checked(key: str, value: object) -> None:
    """Issue 35's keys: each bad value is an error that names the key."""
    with pytest.raises(ConfigError) as info:
        dc.load_config("/dev/null", {key: value}, environ={})
    assert info.value.key == key


def test_default_body_limit_holds_an_image_at_the_image_limit() -> None:
    """An image over server.max_image_bytes sent as a data URL must be the 400 that names that rule,
    not a 413 for the body: by default the body limit holds one image of max_image_bytes in base64
    (4/3 of its bytes) with room for the rest of the request."""
    srv = dc.ServerSection()
    as_data_url = -(-srv.max_image_bytes // 3) * 4 + len("data:image/jpeg;base64,")
    assert srv.max_request_bytes >= as_data_url + 1024 * 1024
