"""The `shoal` command line: `shoal id`, `run`, `status`, `experiments`, `doctor` and
`swarm-key new`.

User mistakes end as one line on stderr, ``shoal: error: ...``, with exit
status 2 for a bad command line or setting and 1 for a runtime problem (key
file, data directory, port); never a traceback. A traceback means a bug.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import logging
import os
import sys
from collections.abc import Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, NoReturn, TypeAlias, TypeVar

from shoal.averaging.registry import describe_strategies

from . import __version__
from .config import DEFAULT_DATA_DIR, OPTIONS, Config, ConfigError, add_options, build_config
from .daemon import StartupError, load_identity, load_known_peers, run_daemon

if TYPE_CHECKING:
    from shoal.transport.access import AccessControl
    from shoal.transport.identity import Identity

    from .finding import Found

__all__ = ["build_parser", "main", "parse_command_line"]

T = TypeVar("T")

EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # the shell convention for "killed by SIGINT"

# How `experiments` and `doctor` find a first peer, as `run` does.
FINDING = ("bootstrap", "network", "networks", "mdns", "dns_server")
# The options each command reads (flags and SHOAL_* variables); a variable for an
# option the command does not use is ignored rather than validated.
COMMAND_OPTIONS: dict[str, tuple[str, ...]] = {
    "id": ("data_dir", "log_level"),
    "run": tuple(OPTIONS),
    "status": (),  # its URL and --json are plain arguments (status/cli.py)
    "experiments": (*FINDING, "data_dir", "log_level", "swarm_key", "allow_peers"),
    "doctor": (*FINDING, "data_dir", "log_level", "swarm_key", "allow_peers"),
    "export": ("data_dir", "log_level", "data"),  # OUT, --format, --experiment: plain
    "swarm-key": (),  # its FILE is a plain argument
}

ENV_HELP = """\
Every option can also be set with its SHOAL_* environment variable (lists are
comma-separated, e.g. SHOAL_LISTEN=/ip4/0.0.0.0/tcp/31337,/ip6/::/tcp/31337).
Precedence: command-line flags, then SHOAL_* environment variables, then a
--config TOML file, then the default. An empty variable counts as unset.
"""
MAIN_HELP = ENV_HELP + "\nOptions of a command: shoal COMMAND --help.\n"
STRATEGIES_HELP = """
The strategies a hosted experiment can use, and their settings (--strategy-option
KEY=VALUE; --inner-steps sets inner_steps) with their defaults:
"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one `shoal: error:` line rather than the usage text."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see `{self.prog} --help`)")


# What `add_subparsers` returns (argparse names its class privately).
_Commands: TypeAlias = "argparse._SubParsersAction[_Parser]"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="shoal",
        description=(
            "shoal: a peer-to-peer training daemon. Peers find each other through a DHT, "
            "connect through NATs and train one model together (DiLoCo-style averaging), "
            "with no central server."
        ),
        epilog=MAIN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"shoal {__version__}")
    commands = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    _add_id_command(commands)
    _add_run_command(commands)
    _add_status_command(commands)
    _add_experiments_command(commands)
    _add_doctor_command(commands)
    _add_export_command(commands)
    _add_swarm_key_command(commands)
    return parser


def _add_id_command(commands: _Commands) -> None:
    """`shoal id` and its arguments."""
    id_parser = commands.add_parser(
        "id",
        help="create this peer's identity key, or show it; prints the peer ID",
        description=(
            "Print this peer's ID (just the ID, for scripts), creating the identity key\n"
            f"(DIR/identity.key, DIR defaulting to {DEFAULT_DATA_DIR}; mode 0600) on first use."
        ),
        epilog=ENV_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(id_parser, COMMAND_OPTIONS["id"])


def _add_run_command(commands: _Commands) -> None:
    """`shoal run` and its arguments."""
    run_parser = commands.add_parser(
        "run",
        help="run the peer until Ctrl+C or SIGTERM",
        description=(
            "Start the peer and print the addresses other peers can dial, one per line.\n"
            "Ctrl+C or SIGTERM shuts it down gracefully; a second Ctrl+C exits at once."
        ),
        epilog=ENV_HELP + STRATEGIES_HELP + describe_strategies(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(run_parser, COMMAND_OPTIONS["run"])


def _add_status_command(commands: _Commands) -> None:
    """`shoal status` and its arguments."""
    status_parser = commands.add_parser(
        "status",
        help="show a running peer's status (from its HTTP status endpoint)",
        description=(
            "Print the status of a running peer: step, loss, connections, the swarm's peers.\n"
            "URL defaults to SHOAL_STATUS_ADDR (HOST:PORT, as `shoal run --status-addr` takes\n"
            "it) when set, else http://127.0.0.1:8080."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    status_parser.add_argument(
        "url", nargs="?", metavar="URL", help="the peer's status endpoint: http://HOST:PORT"
    )
    status_parser.add_argument(
        "--json", action="store_true", help="print the raw /status JSON instead"
    )


def _add_experiments_command(commands: _Commands) -> None:
    """`shoal experiments` and its arguments."""
    experiments_parser = commands.add_parser(
        "experiments",
        help="list the experiments training in the network, to join one",
        description=(
            "List the experiments with live peers in the network: NAME@HOST (what\n"
            "`shoal run --join` takes; NAME alone when it is unique), task and size,\n"
            "strategy, peers, the swarm's round, step and loss, age. The network is\n"
            "reached through --bootstrap, else the --network's list (/dnsaddr/ names\n"
            "resolved), else the peers the last `shoal run` with this data directory\n"
            "knew, else peers of the network found over mDNS on the local link."
        ),
        epilog=ENV_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(experiments_parser, COMMAND_OPTIONS["experiments"])
    experiments_parser.add_argument(
        "--json", action="store_true", help="print one JSON list, for scripts"
    )


def _add_doctor_command(commands: _Commands) -> None:
    """`shoal doctor` and its arguments."""
    doctor_parser = commands.add_parser(
        "doctor",
        help="check whether this machine can take part, and say what to fix",
        description=(
            "Diagnose this machine as a peer: the network and how its peers were found\n"
            "(--bootstrap or the --network's list, /dnsaddr/ names resolved, peers heard\n"
            "over mDNS), bootstrap peers reached (or why not), how\n"
            "others see it (observed addresses, reachability, whether its NAT allows hole\n"
            "punching or needs a relay), relays, clock skew against the peers, free disk\n"
            "in the data directory, torch. Paste the output into a bug report. Exit\n"
            "status 0 when the peer can take part, 1 when it cannot reach any bootstrap peer."
        ),
        epilog=ENV_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(doctor_parser, COMMAND_OPTIONS["doctor"])
    doctor_parser.add_argument("--json", action="store_true", help="print one JSON object")


def _add_export_command(commands: _Commands) -> None:
    """`shoal export` and its arguments."""
    export_parser = commands.add_parser(
        "export",
        help="write the swarm's current model from a checkpoint, for others to load",
        description=(
            "Write the global parameters (the swarm's last committed average) of the latest\n"
            "checkpoint in the data directory to the folder OUT: --format safetensors (any\n"
            "task) writes model.safetensors and shoal_experiment.json; --format hf (task hf)\n"
            "writes save_pretrained output (config.json, model.safetensors) and tokenizer.json,\n"
            "which AutoModelForCausalLM.from_pretrained(OUT) loads. `shoal run --init-from OUT`\n"
            "hosts a new experiment starting from these weights."
        ),
        epilog=ENV_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(export_parser, COMMAND_OPTIONS["export"])
    export_parser.add_argument("out", metavar="OUT", help="the folder to write (created)")
    export_parser.add_argument(
        "--format", choices=("safetensors", "hf"), default="safetensors",
        help="safetensors (any task; the default) or hf (save_pretrained, task hf)",
    )  # fmt: skip
    export_parser.add_argument(
        "--experiment", metavar="NAME",
        help="the experiment to export, when the data directory holds several",
    )  # fmt: skip


def _add_swarm_key_command(commands: _Commands) -> None:
    """`shoal swarm-key new` and its arguments."""
    swarm_parser = commands.add_parser(
        "swarm-key",
        help="make a swarm key file for a private swarm (--swarm-key)",
        description=(
            "`shoal swarm-key new FILE` writes a fresh random 256-bit key to FILE (mode 0600,\n"
            "libp2p's swarm.key format) and prints its fingerprint. Give every peer of the\n"
            "private swarm a copy and run them with --swarm-key FILE; peers without it\n"
            "cannot connect. It never overwrites an existing file."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    swarm_commands = swarm_parser.add_subparsers(dest="swarm_command", metavar="ACTION")
    swarm_commands.required = True
    new_parser = swarm_commands.add_parser("new", help="write a new swarm key to FILE")
    new_parser.add_argument("file", metavar="FILE", help="where to write the key")


def parse_command_line(
    argv: Sequence[str] | None, environ: Mapping[str, str]
) -> tuple[str | None, Config]:
    """The command (None when not given) and its effective Config. Raises ConfigError."""
    args = build_parser().parse_args(argv)
    if args.command is None:
        return None, Config()
    return args.command, build_config(COMMAND_OPTIONS[args.command], vars(args), environ)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        command, config = parse_command_line(argv, os.environ)
    except ConfigError as e:
        return _fail(e, EXIT_USAGE)
    if command is None:
        build_parser().print_help(sys.stderr)
        return EXIT_USAGE
    if command == "status":
        from .status.cli import status_command  # not at the top: aiohttp is slow to import

        args = build_parser().parse_args(argv)  # parsed fine above; its arguments are not config
        return status_command(args.url, sys.stdout, json_output=args.json)
    if command == "experiments":
        return _experiments(argv, config)
    if command == "doctor":
        return _doctor(argv, config)
    if command == "swarm-key":
        return _swarm_key(build_parser().parse_args(argv).file)
    if command == "export":
        return _export(argv, config)
    logging.basicConfig(
        level=config.logging_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    try:
        if command == "id":
            print(load_identity(config).peer_id, flush=True)
            return 0
        # A crash in native code (torch, a wheel's extension) then leaves every
        # thread's traceback in the log instead of a daemon that vanished silently.
        faulthandler.enable(file=sys.stderr, all_threads=True)
        _run(run_daemon(config, freeze_heap=True))
        _exit_now(0)
    except ConfigError as e:
        return _fail(e, EXIT_USAGE)
    except StartupError as e:
        return _fail(e, EXIT_RUNTIME)
    except KeyboardInterrupt:  # Ctrl+C before the daemon's own handler was installed
        return EXIT_INTERRUPTED


def _experiments(argv: Sequence[str] | None, config: Config) -> int:
    from .discovery import experiments_command

    logging.basicConfig(level=max(config.logging_level, logging.WARNING), stream=sys.stderr)
    args = build_parser().parse_args(argv)
    try:
        access, identity = _access_and_identity(config)
    except (ConfigError, StartupError) as e:
        return _fail(e, EXIT_USAGE if isinstance(e, ConfigError) else EXIT_RUNTIME)

    async def find_and_list() -> tuple[int, str]:
        found = await _first_peers(config, mdns_until_first=True)
        if found.error is not None:
            return EXIT_USAGE, f"shoal: error: {found.error}\n"
        return await experiments_command(
            found.addrs, json_output=args.json, access=access, identity=identity
        )

    status, text = _run(find_and_list())
    (sys.stdout if status == 0 else sys.stderr).write(text)
    return status


def _doctor(argv: Sequence[str] | None, config: Config) -> int:
    from .doctor import doctor_command

    logging.basicConfig(level=max(config.logging_level, logging.ERROR), stream=sys.stderr)
    args = build_parser().parse_args(argv)
    try:
        access, identity = _access_and_identity(config)
    except (ConfigError, StartupError) as e:
        return _fail(e, EXIT_USAGE if isinstance(e, ConfigError) else EXIT_RUNTIME)

    async def find_and_diagnose() -> tuple[int, str]:
        found = await _first_peers(config, mdns_until_first=False)
        return await doctor_command(
            found, config.data_dir, json_output=args.json, access=access, identity=identity
        )

    status, text = _run(find_and_diagnose())
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `shoal doctor | head`: the reader has what it wanted
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return status


async def _first_peers(config: Config, *, mdns_until_first: bool) -> Found:
    """Addresses to reach the network through, as `shoal run` finds them: --bootstrap or
    the network's list, else the peers remembered, else (or, for the doctor's report,
    also) the peers heard over mDNS."""
    from shoal.transport.identity import Identity

    from .finding import MDNS_FIRST_WAIT, browse_mdns, find_bootstrap

    found = await find_bootstrap(
        config.bootstrap, config.network, config.networks, config.dns_server
    )
    if found.error is not None:
        return found
    if not found.addrs:
        found.addrs = load_known_peers(config.data_dir)
        if found.addrs:
            found.source = f"peers remembered in {config.data_dir}"
    if not found.addrs or not mdns_until_first:
        me = Identity.generate().peer_id  # heard peers are never "us"
        await browse_mdns(found, me, config.mdns, MDNS_FIRST_WAIT, until_first=mdns_until_first)
    return found


def _access_and_identity(config: Config) -> tuple[AccessControl, Identity | None]:
    """A private swarm's rules, and who a short-lived client must be in it: this peer
    (its identity key) when the swarm has an allow list, which admits listed IDs only;
    else None, a throwaway identity."""
    access = config.access_control()
    return access, load_identity(config) if access.restricts_peers else None


def _export(argv: Sequence[str] | None, config: Config) -> int:
    from pathlib import Path

    from .export import ExportError, export_checkpoint

    logging.basicConfig(level=max(config.logging_level, logging.WARNING), stream=sys.stderr)
    args = build_parser().parse_args(argv)
    out = Path(args.out).expanduser().absolute()
    try:
        saved = export_checkpoint(
            config.data_dir, out, format=args.format, experiment=args.experiment,
            data=config.data,
        )  # fmt: skip
    except ExportError as e:
        return _fail(e, EXIT_RUNTIME)
    print(
        f"exported {saved.manifest.describe()} at step {saved.checkpoint.get('step')} "
        f"({args.format}) to {out}",
        flush=True,
    )
    return 0


def _swarm_key(path: str) -> int:
    from shoal.transport.access import AccessFileError, swarm_key_fingerprint, write_new_swarm_key

    try:
        key = write_new_swarm_key(os.path.expanduser(path))
    except AccessFileError as e:
        return _fail(e, EXIT_RUNTIME)
    print(
        f"wrote a new swarm key to {path} (fingerprint {swarm_key_fingerprint(key)}); "
        f"copy it to every peer of the swarm and run them with --swarm-key {path}",
        flush=True,
    )
    return 0


def _exit_now(status: int) -> NoReturn:
    """End the process once the daemon has shut down (checkpoint written, peers told).

    Tearing down the interpreter (freeing torch's tensors and modules one object
    at a time) takes seconds on a slow machine, counted against `docker stop`'s
    10 s grace period, and has nothing left to save.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _fail(error: Exception, status: int) -> int:
    print(f"shoal: error: {error}", file=sys.stderr, flush=True)
    return status


def _run(coro: Coroutine[object, object, T]) -> T:
    """One event loop for the process (docs/architecture/index.md): uvloop when installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
