"""`mllmd`: run the daemon, or check its configuration.

    mllmd [run] [--config PATH] [--section.key VALUE ...]
    mllmd demo [--section.key VALUE ...]     (the built-in demo model: RANDOM weights)
    mllmd check-config [--config PATH] [--section.key VALUE ...]
    mllmd --version

The daemon itself (`mllmd.daemon.main`) is imported only when it runs. No torch here.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from mllmd import __version__
from mllmd.daemon.config import (
    DEFAULT_CONFIG_PATH,
    DaemonConfig,
    DaemonConfigError,
    describe_keys,
    load_config,
    render_effective_yaml,
)

COMMANDS = ("run", "demo", "check-config")
USAGE = """\
usage: mllmd [run] [--config PATH] [--section.key VALUE ...]
       mllmd demo [--config PATH] [--section.key VALUE ...]
       mllmd check-config [--config PATH] [--section.key VALUE ...]
       mllmd --version"""


class UsageError(Exception):
    """A malformed command line (exit status 2)."""


def _help() -> str:
    return f"""{USAGE}

commands:
  run            run the daemon (the default)
  demo           run the daemon on the built-in demo model (tiny, RANDOM weights: meaningless output;
                 for trying the API); its Unix socket and its state folder ($STATE_DIRECTORY) go to
                 the mllmd cache folder unless set
  check-config   print the effective configuration (secrets hidden) and exit; 2 if it is invalid

options:
  --config PATH  YAML configuration file (default {DEFAULT_CONFIG_PATH}; a missing default file is fine)
  --version      print the version and exit

Every configuration key can be set with --section.key VALUE (or --section.key=VALUE; a boolean alone
means true) and with the environment variable MLLMD_SECTION__KEY=VALUE. Precedence: defaults <
file < environment < command line. Keys:
{describe_keys()}
"""


def parse_args(argv: Sequence[str]) -> tuple[str, str | None, list[str]]:
    """Split argv into (command, config path or None, override tokens); --help/--version as commands."""
    args = list(argv)
    command = "run"
    if args and not args[0].startswith("-"):
        if args[0] not in COMMANDS:
            raise UsageError(f"unknown command {args[0]!r} (commands: {', '.join(COMMANDS)})")
        command = args.pop(0)
    config: str | None = None
    rest: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg in ("-h", "--help"):
            return "help", None, []
        if arg == "--version":
            return "version", None, []
        if arg == "--config":
            if i >= len(args):
                raise UsageError("--config needs a PATH")
            config, i = args[i], i + 1
        elif arg.startswith("--config="):
            config = arg.partition("=")[2]
        else:
            rest.append(arg)
    if config == "":
        raise UsageError("--config needs a PATH")
    return command, config, rest


def _run(config: DaemonConfig) -> int:
    try:
        from mllmd.daemon.main import run
    except ModuleNotFoundError as e:
        if e.name == "mllmd.daemon.main":
            print("mllmd: the daemon (mllmd.daemon.main) is not part of this installation", file=sys.stderr)
        else:
            print(f"mllmd: cannot start the daemon: {e}", file=sys.stderr)
        return 1
    return int(run(config) or 0)


def demo_overrides(overrides: list[str]) -> list[str]:
    """Build the demo model (in a subprocess: this process never imports torch); point the config at it.
    Its socket and its state folder (the record of the loaded model) go to the mllmd cache folder unless
    set, never to the service's: a demo run as root would otherwise replace the service's record."""
    import os
    import subprocess

    from mllmd.knobs import cache_dir

    print("mllmd: preparing the built-in demo model (RANDOM weights, meaningless output) ...", file=sys.stderr)
    done = subprocess.run([sys.executable, "-m", "mllmd.demo"], capture_output=True, text=True)
    if done.returncode != 0:
        raise UsageError(f"could not build the demo model: {done.stderr.strip().splitlines()[-1:]}")
    path = done.stdout.strip().splitlines()[-1]
    given = {o.partition("=")[0] for o in overrides if o.startswith("--")}
    extra = ["--model.path", path]
    if "--server.unix_socket" not in given:
        extra += ["--server.unix_socket", str(cache_dir() / "mllmd-demo.sock")]
    if not os.environ.get("STATE_DIRECTORY"):
        os.environ["STATE_DIRECTORY"] = str(cache_dir() / "state")  # inherited by the workers
    return extra + overrides


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `mllmd` console script; returns the exit status."""
    try:
        command, path, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        if command == "help":
            print(_help(), end="")
            return 0
        if command == "version":
            print(f"mllmd {__version__}")
            return 0
        if command == "demo":
            overrides = demo_overrides(overrides)
        config = load_config(path, overrides)
    except (UsageError, DaemonConfigError) as e:
        print(f"mllmd: error: {e}", file=sys.stderr)
        if isinstance(e, UsageError):
            print(USAGE, file=sys.stderr)
        return 2
    if command == "check-config":
        print(render_effective_yaml(config), end="")
        return 0
    return _run(config)


if __name__ == "__main__":
    sys.exit(main())
