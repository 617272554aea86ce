"""The daemon's configuration: one table of options, read from flags and SHOAL_* variables.

Each option is declared once in `OPTIONS` (flag, environment variable, help);
the argparse options, the environment lookup, the validation and the
"effective configuration" log lines are all derived from that table, so a new
option (DHT bootstrap peers, HTTP status port, ...) is one entry plus one
`Config` field.

Precedence, by the common convention: a command-line flag, else its SHOAL_*
environment variable, else the TOML file of --config, else the default (a
leftover `export SHOAL_...` must not silently override what a user types; the
docker image sets nothing on its command line, so its users lose nothing).
"""

from __future__ import annotations

import argparse
import logging
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.averaging.registry import outer_strategy_names
from shoal.pipeline.options import ROLES  # (torch-free; registers the pipeline strategy)
from shoal.pipeline.sizes import parse_size  # (torch-free)
from shoal.transport.access import AccessControl, AccessFileError, read_allow_list, read_swarm_key
from shoal.transport.connection import ConnectionConfig
from shoal.transport.dnsaddr import DnsaddrName, parse_nameserver
from shoal.transport.host import DEFAULT_LISTEN, HostConfig
from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr, MultiaddrError
from shoal.transport.mux import LEAN_MAX_WINDOW, MuxLimits

from .finding.networks import DEFAULT_NETWORK, NetworkError, check_network_name, parse_entry
from .training.optimizers import INNER_OPTIMIZERS, parse_inner_optimizer  # (torch-free)

__all__ = [
    "DEFAULT_DATA_DIR",
    "IDENTITY_FILE",
    "LOG_LEVELS",
    "OPTIONS",
    "Config",
    "ConfigError",
    "Option",
    "add_options",
    "build_config",
]

DEFAULT_DATA_DIR = "~/.shoal"
DEFAULT_EXPERIMENT = "default"
DEFAULT_TASK = "bytegpt"
DEFAULT_STRATEGY = "diloco"
DEFAULT_INNER_STEPS = 50
DEFAULT_STATUS_ADDR = "127.0.0.1:8080"
DEFAULT_CHECKPOINT_INTERVAL = 300.0
REACHABILITY_MODES = ("auto", "public", "private")
# The arithmetic of an experiment's inner steps (autocast dtype; parameters stay fp32).
PRECISIONS = ("fp32", "bf16", "fp16")
_DEVICE_FORM = re.compile(r"auto|cpu|mps|cuda(:\d+)?")
IDENTITY_FILE = "identity.key"
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    """A configuration mistake by the user; the message is one line naming the flag or variable."""


@dataclass(frozen=True, slots=True)
class Option:
    name: str  # Config field; the flag is --name with dashes
    env: str
    help: str
    metavar: str
    default_text: str  # how the default reads in --help
    repeatable: bool = False  # a list: repeat the flag, or comma-separate (the env var)
    many: bool = False  # the flag also takes several values at once: --flag A B
    boolean: bool = False  # a switch: --flag alone sets it; the variable takes 1/0, true/false

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


OPTIONS: dict[str, Option] = {
    o.name: o
    for o in (
        Option(
            "data_dir",
            "SHOAL_DATA_DIR",
            "directory for the identity key, hosted experiments and checkpoints",
            "DIR",
            DEFAULT_DATA_DIR,
        ),
        Option(
            "listen",
            "SHOAL_LISTEN",
            "multiaddr to listen on; repeat the flag for several",
            "MULTIADDR",
            " and ".join(DEFAULT_LISTEN),
            repeatable=True,
        ),
        Option(
            "announce",
            "SHOAL_ANNOUNCE",
            "multiaddr to advertise instead of the detected ones (e.g. a public IP or "
            "DNS name behind port forwarding); repeat the flag for several",
            "MULTIADDR",
            "the detected addresses",
            repeatable=True,
        ),
        Option(
            "bootstrap",
            "SHOAL_BOOTSTRAP",
            "multiaddr of a peer to join the network through (/ip4/.../tcp/N/p2p/ID), or "
            "/dnsaddr/DOMAIN (the addresses in the TXT records of _dnsaddr.DOMAIN); several "
            "may follow the flag; they replace the --network's list",
            "MULTIADDR",
            "the --network's list; none there: peers found over mDNS, else a new network",
            repeatable=True,
            many=True,
        ),
        Option(
            "network",
            "SHOAL_NETWORK",
            "the named network to join: its bootstrap list ships with shoal (or comes from "
            "--networks)",
            "NAME",
            DEFAULT_NETWORK,
        ),
        Option(
            "networks",
            "SHOAL_NETWORKS",
            'TOML file of named networks ([NAME] bootstrap = ["/dnsaddr/...", ...]) that '
            "adds to the shipped ones and replaces them by name",
            "FILE",
            "none: the shipped list",
        ),
        Option(
            "mdns",
            "SHOAL_MDNS",
            "find and be found by peers of the same network on the local link (mDNS): auto "
            "(on the interfaces listened on, off for a loopback-only peer), on (loopback "
            "too), off, or the IP of the one interface to use",
            "MODE",
            "auto",
        ),
        Option(
            "dns_server",
            "SHOAL_DNS_SERVER",
            "DNS server (IP or IP:PORT) that resolves /dnsaddr/ names",
            "ADDR",
            "the system's resolver",
            repeatable=True,
        ),
        Option(
            "log_level",
            "SHOAL_LOG_LEVEL",
            "log verbosity (" + ", ".join(LOG_LEVELS) + ")",
            "LEVEL",
            "info",
        ),
        Option(
            "config",
            "SHOAL_CONFIG",
            "TOML file of options (keys are the option names, e.g. inner_steps = 20); "
            "flags and SHOAL_* variables take precedence over it",
            "FILE",
            "none",
        ),
        Option(
            "host_experiment",
            "SHOAL_HOST_EXPERIMENT",
            "create the experiment NAME (a signed manifest in the DHT) and train on it; "
            "other peers join it with --join",
            "NAME",
            f"{DEFAULT_EXPERIMENT!r} when neither --join nor --bootstrap is given",
        ),
        Option(
            "join",
            "SHOAL_JOIN",
            "join the experiment NAME (or NAME@PEERID, naming its host, as the host prints it) "
            "found through the --bootstrap peers",
            "NAME[@PEERID]",
            f"{DEFAULT_EXPERIMENT!r} when --bootstrap is given",
        ),
        Option(
            "no_train",
            "SHOAL_NO_TRAIN",
            "take part in the network (DHT, relay, hole punching) without training: "
            "a bootstrap or relay peer",
            "",
            "off",
            boolean=True,
        ),
        Option(
            "task",
            "SHOAL_TASK",
            "what a hosted experiment trains: a built-in task (bytegpt; hf, a Hugging Face "
            "causal LM with pip install 'shoal[hf]'), or your own as "
            "package.module:factory or path/to/file.py:factory (see the README, Tasks)",
            "TASK",
            DEFAULT_TASK,
        ),
        Option(
            "allow_task",
            "SHOAL_ALLOW_TASK",
            "run the custom task MODULE:FACTORY when an experiment joined names it (a "
            "joiner runs only task code it names, here or with --task, and only when its "
            "copy has the digest the manifest pins); repeat the flag for several",
            "MODULE:FACTORY",
            "none: built-in tasks only",
            repeatable=True,
        ),
        Option(
            "task_option",
            "SHOAL_TASK_OPTIONS",
            "a task setting of a hosted experiment, e.g. d_model=64 (bytegpt: preset=base, "
            "a 38 M model; hf: family=llama,hidden_size=256 or config={JSON}); repeat the "
            "flag for several",
            "KEY=VALUE",
            "the task's defaults",
            repeatable=True,
        ),
        Option(
            "data",
            "SHOAL_DATA",
            "train on this text file or folder instead of the built-in corpus (the Python "
            "standard library's sources)",
            "PATH",
            "the built-in corpus",
        ),
        Option(
            "init_from",
            "SHOAL_INIT_FROM",
            "start a new hosted experiment from these weights instead of a random init "
            "(fine-tuning): a folder of `shoal export` (model.safetensors), names, shapes "
            "and dtypes as the task's model (task hf: its config.json and tokenizer.json "
            "unless --task-option names others); a joiner given it starts from them too",
            "DIR",
            "the task's random init",
        ),
        Option(
            "strategy",
            "SHOAL_STRATEGY",
            "how a hosted experiment averages: " + ", ".join(outer_strategy_names()),
            "NAME",
            DEFAULT_STRATEGY,
        ),
        Option(
            "inner_steps",
            "SHOAL_INNER_STEPS",
            "local steps between two averaging rounds of a hosted experiment (DiLoCo's H; "
            "a new experiment with a sparse codec defaults to 10)",
            "H",
            str(DEFAULT_INNER_STEPS),
        ),
        Option(
            "strategy_option",
            "SHOAL_STRATEGY_OPTIONS",
            "a strategy setting of a hosted experiment, e.g. outer_lr=0.5 or codec=int8 "
            "(each strategy's settings are listed below); repeat the flag for several",
            "KEY=VALUE",
            "the strategy's defaults",
            repeatable=True,
        ),
        Option(
            "inner_optimizer",
            "SHOAL_INNER_OPTIMIZER",
            "the inner optimizer of a hosted experiment, pinned in its manifest: "
            + ", ".join(INNER_OPTIMIZERS)
            + " with arguments, e.g. SGD:momentum=0.9,nesterov=true or JSON "
            '\'{"name": "AdamW", "betas": [0.9, 0.99]}\' (the lr and weight decay stay the '
            "experiment's inner_lr and weight_decay)",
            "NAME[:KEY=VALUE,...]",
            "AdamW",
        ),
        Option(
            "pipeline_stages",
            "SHOAL_PIPELINE_STAGES",
            "split a hosted experiment's model into N stages served by different peers "
            "(a SWARM pipeline: for models too large for one peer); pipeline settings "
            "such as global_batch=256 or codec=none go in --strategy-option",
            "N",
            "off: every peer holds the whole model",
        ),
        Option(
            "role",
            "SHOAL_ROLE",
            "in a pipelined experiment: stage (serve a stage), trainer (drive microbatches of "
            "this peer's data through the stages), auto (both) or monitor (neither: keep the "
            "experiment and show its pipeline, e.g. a bootstrap peer hosting it)",
            "ROLE",
            "auto",
        ),
        Option(
            "stage",
            "SHOAL_STAGE",
            "in a pipelined experiment: serve stage K (0 is the first)",
            "K",
            "the stage with the least capacity",
        ),
        Option(
            "max_memory",
            "SHOAL_MAX_MEMORY",
            "in a pipelined experiment: the memory this peer may use for its stage "
            "(parameters, gradients, AdamW moments, averaging buffers, activations), e.g. "
            "2G or 512M; it serves, and moves to, only stages that fit, and refuses to "
            "start when none does",
            "SIZE",
            "what the machine (and the GPU) has free at start",
        ),
        Option(
            "status_addr",
            "SHOAL_STATUS_ADDR",
            "HOST:PORT of the HTTP status endpoint (/status, /peers, /metrics, /healthz, "
            "and a page at /); 'off' disables it",
            "HOST:PORT",
            DEFAULT_STATUS_ADDR,
        ),
        Option(
            "checkpoint_interval",
            "SHOAL_CHECKPOINT_INTERVAL",
            "seconds between checkpoints (one is also written at shutdown)",
            "SECONDS",
            str(int(DEFAULT_CHECKPOINT_INTERVAL)),
        ),
        Option(
            "threads",
            "SHOAL_THREADS",
            "CPU threads for training",
            "N",
            "torch's default (the cores)",
        ),
        Option(
            "device",
            "SHOAL_DEVICE",
            "where to train: auto (the first CUDA GPU, else an Apple GPU, else the CPU), "
            "cpu, cuda, cuda:N or mps",
            "DEVICE",
            "auto",
        ),
        Option(
            "precision",
            "SHOAL_PRECISION",
            "arithmetic of a hosted experiment's training, one of "
            + ", ".join(PRECISIONS)
            + " (every peer uses the experiment's; bf16 suits Ampere and newer GPUs)",
            "P",
            "fp32",
        ),
        Option(
            "verify",
            "SHOAL_VERIFY",
            "on: a hosted experiment audits its contributors' work (commitments, "
            "re-executed segments, bans; CenteredClip averaging); off: peers trust each other "
            "(auto: on for diloco, unless each peer trains on its own --data, which no "
            "referee can re-execute: then off, and on is refused)",
            "auto|on|off",
            "auto",
        ),
        Option(
            "work_log_max",
            "SHOAL_WORK_LOG_MAX",
            "in a verified experiment: the most training states this peer keeps for its "
            "auditors, in RAM and in the data dir's work-log folder together, e.g. 2G; past it, "
            "intermediate states go first (an audit re-runs them), then rounds older than "
            "the last 2 even inside the 5-minute audit window (their audits fail as work "
            "withheld); sparse codecs keep their error feedback's residuals besides, in a "
            "quarter of it",
            "SIZE",
            "8G",
        ),
        Option(
            "reachability",
            "SHOAL_REACHABILITY",
            "auto: find out with the help of other peers; public: this address is "
            "reachable (a forwarded port); private: always use relays",
            "MODE",
            "auto",
        ),
        Option(
            "swarm_key",
            "SHOAL_SWARM_KEY",
            "private swarm: a pre-shared key file (libp2p's swarm.key format; make one with "
            "`shoal swarm-key new FILE` and give every peer a copy); peers without the same "
            "key cannot connect to this peer, nor it to them",
            "FILE",
            "none: an open swarm",
        ),
        Option(
            "allow_peers",
            "SHOAL_ALLOW_PEERS",
            "private swarm: a file of the peer IDs allowed to connect, one per line (# starts "
            "a comment); every other peer, bootstrap peers and relays included, is refused "
            "at the handshake",
            "FILE",
            "none: any peer",
        ),
    )
}


@dataclass(frozen=True, slots=True)
class Config:
    """The effective configuration of one `shoal` invocation."""

    data_dir: Path = field(default_factory=lambda: Path(DEFAULT_DATA_DIR).expanduser())
    listen: tuple[Multiaddr, ...] = tuple(Multiaddr(a) for a in DEFAULT_LISTEN)
    announce: tuple[Multiaddr, ...] = ()
    bootstrap: tuple[Multiaddr | DnsaddrName, ...] = ()
    network: str = DEFAULT_NETWORK
    networks: Path | None = None
    mdns: str = "auto"
    dns_server: tuple[tuple[str, int], ...] = ()
    log_level: str = "info"
    config: Path | None = None
    host_experiment: str | None = None
    join: str | None = None
    no_train: bool = False
    task: str = DEFAULT_TASK
    allow_task: tuple[str, ...] = ()
    task_option: tuple[tuple[str, Any], ...] = ()
    data: Path | None = None
    init_from: Path | None = None  # a folder with model.safetensors (peer/training/export.py)
    strategy: str = DEFAULT_STRATEGY
    inner_steps: int = DEFAULT_INNER_STEPS
    strategy_option: tuple[tuple[str, Any], ...] = ()
    inner_optimizer: dict[str, Any] | None = None  # None: AdamW
    pipeline_stages: int | None = None
    role: str = "auto"
    stage: int | None = None
    max_memory: int | None = None  # bytes
    status_addr: tuple[str, int] | None = ("127.0.0.1", 8080)
    checkpoint_interval: float = DEFAULT_CHECKPOINT_INTERVAL
    threads: int | None = None
    device: str = "auto"
    precision: str = "fp32"
    verify: str = "auto"  # auto: on for strategies that support it
    work_log_max: int | None = None  # bytes; None: the work log's default (8 GiB)
    reachability: str = "auto"
    swarm_key: Path | None = None
    allow_peers: Path | None = None
    # Where each value came from ("default", "--listen", "SHOAL_LISTEN", ...), for the
    # start-up log: env-over-flag precedence surprises people, so show it.
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    @property
    def identity_path(self) -> Path:
        return self.data_dir / IDENTITY_FILE

    @property
    def logging_level(self) -> int:
        return getattr(logging, self.log_level.upper())  # type: ignore[no-any-return]

    def host_config(self) -> HostConfig:
        connection = ConnectionConfig()
        if self.max_memory is not None:
            # Held to a budget: less may wait in a stream for a slow reader (what the
            # stage's memory estimate counts, `memory.stage_memory`).
            connection = ConnectionConfig(mux=MuxLimits(max_window=LEAN_MAX_WINDOW))
        return HostConfig(
            listen=tuple(str(a) for a in self.listen),
            announce=tuple(str(a) for a in self.announce),
            # Hole punching dials out from the listening port (NAT traversal).
            reuse_port=True,
            connection=connection,
        )

    def access_control(self) -> AccessControl:
        """The access rules of --swarm-key and --allow-peers (read from their files now)."""
        try:
            key = None if self.swarm_key is None else read_swarm_key(self.swarm_key)
            allowed = None if self.allow_peers is None else read_allow_list(self.allow_peers)
        except AccessFileError as e:
            raise ConfigError(str(e)) from None
        return AccessControl(key, allowed)

    @property
    def checkpoints_dir(self) -> Path:
        return self.data_dir / "checkpoints"

    def experiment_role(self, has_way_in: bool | None = None) -> tuple[str, str] | None:
        """("host", NAME) or ("join", NAME[@PEERID]); None for a peer that does not train.

        Without --host-experiment or --join: a first peer (no --bootstrap) hosts
        the default experiment, a peer given --bootstrap joins it. `has_way_in`:
        whether the peer joined a network (through --bootstrap, the --network's
        list or mDNS); None: whether --bootstrap is given.
        """
        if self.no_train:
            return None
        if self.host_experiment and self.join:
            raise ConfigError(
                f"{self._origin('host_experiment')} and {self._origin('join')} exclude each "
                "other: host a new experiment or join one"
            )
        if self.host_experiment:
            return ("host", self.host_experiment)
        if self.join:
            return ("join", self.join)
        joins = bool(self.bootstrap) if has_way_in is None else has_way_in
        return ("join", DEFAULT_EXPERIMENT) if joins else ("host", DEFAULT_EXPERIMENT)

    def check_peer_id(self, peer_id: PeerID) -> None:
        """Refuse announce addresses that name another peer (the host would silently replace it)."""
        for addr in self.announce:
            named = addr.peer_id
            if named is not None and named != peer_id and not _ends_in_circuit(addr):
                raise ConfigError(
                    f"{self._origin('announce')}: {addr} names peer {named}, "
                    f"but this peer is {peer_id}; drop the /p2p/ part"
                )

    @property
    def named_tasks(self) -> tuple[str, ...]:
        """The task specs this peer consents to run when joining: --task, when given
        (not its default), and every --allow-task."""
        given = (self.task,) if "task" in self.sources else ()
        return tuple(dict.fromkeys(given + self.allow_task))

    def _origin(self, name: str) -> str:
        """The flag or variable a value came from, for error messages."""
        return self.sources.get(name, OPTIONS[name].flag).split(",")[0]

    def to_json(self) -> dict[str, object]:
        """The effective configuration in JSON types, keyed by flag name (for /status):
        numbers as numbers, lists as lists, KEY=VALUE options as maps, unset as null.
        `host-experiment` and `join` say what the peer does, defaults included."""
        out: dict[str, object] = {}
        for name in OPTIONS:
            value = getattr(self, name)
            if name == "status_addr":
                value = None if value is None else f"{value[0]}:{value[1]}"
            elif name in ("task_option", "strategy_option"):
                value = {k: v for k, v in value}
            elif isinstance(value, tuple):
                value = [str(v) for v in value]
            elif isinstance(value, Path):
                value = str(value)
            out[OPTIONS[name].flag[2:]] = value
        try:
            role = self.experiment_role()
        except ConfigError:
            role = None
        if role is not None:
            out["host-experiment" if role[0] == "host" else "join"] = role[1]
        return out

    def describe(self, names: Iterable[str] = OPTIONS) -> list[str]:
        """One `name = value  [source]` line per option, for the start-up log."""
        lines = []
        for name in names:
            value = getattr(self, name)
            if name == "status_addr":
                text = "off" if value is None else f"{value[0]}:{value[1]}"
            elif name == "dns_server":
                text = ", ".join(f"{ip}:{port}" for ip, port in value) or "(the system's)"
            elif isinstance(value, tuple):
                text = (
                    ", ".join(f"{v[0]}={v[1]}" if isinstance(v, tuple) else str(v) for v in value)
                    or "(none)"
                )
            elif value is None:
                text = "(none)"
            else:
                text = str(value)
            lines.append(
                f"{OPTIONS[name].flag[2:]} = {text}  [{self.sources.get(name, 'default')}]"
            )
        return lines


def _ends_in_circuit(addr: Multiaddr) -> bool:
    # /.../p2p/RELAY/p2p-circuit: the last /p2p/ is the relay, which is not us; the
    # host appends our ID after /p2p-circuit.
    return addr.protocols()[-1] == "p2p-circuit"


def add_options(parser: argparse.ArgumentParser, names: Iterable[str]) -> None:
    """Add the flags of `names` to `parser`; unset flags stay None so precedence can be applied."""
    for name in names:
        opt = OPTIONS[name]
        if opt.boolean:
            parser.add_argument(
                opt.flag,
                dest=name,
                action="store_const",
                const="1",
                default=None,
                help=f"{opt.help} [env {opt.env}=1]",
            )
            continue
        parser.add_argument(
            opt.flag,
            dest=name,
            metavar=opt.metavar,
            action=("extend" if opt.many else "append") if opt.repeatable else "store",
            nargs="+" if opt.many else None,
            default=None,
            help=f"{opt.help} [env {opt.env}; default: {opt.default_text}]",
        )


def build_config(
    names: Iterable[str], flags: Mapping[str, object], environ: Mapping[str, str]
) -> Config:
    """The Config for options `names`: each from its flag, else its env var, else the
    TOML file named by --config (SHOAL_CONFIG), else the default.

    An empty or blank environment variable counts as unset (compose files often
    declare `SHOAL_ANNOUNCE=` with nothing after it). Raises ConfigError.
    """
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    names = list(names)
    file_values: dict[str, object] = {}
    file_origin = ""
    if "config" in names:
        path_text = flags.get("config") or environ.get(OPTIONS["config"].env, "").strip()
        if path_text:
            file_origin = str(path_text)
            file_values = _read_toml(Path(str(path_text)).expanduser(), names)
    for name in names:
        opt = OPTIONS[name]
        env_value = environ.get(opt.env, "").strip()
        flag_value = flags.get(name)
        if not env_value and flag_value is None and name in file_values:
            origin = sources[name] = f"{file_origin} ({name})"
            values[name] = _from_toml(name, file_values[name], origin)
            continue
        if flag_value is not None:
            raw: str | Sequence[str] = flag_value  # type: ignore[assignment]
            origin = opt.flag
            sources[name] = origin if not env_value else f"{origin}, overriding {opt.env}"
        elif env_value:
            raw = env_value
            origin = sources[name] = opt.env
        else:
            continue
        values[name] = _PARSERS[name](raw, origin)
    return Config(**values, sources=sources)  # type: ignore[arg-type]


# --- per-option parsing and validation --------------------------------------------------------


def _read_toml(path: Path, names: Sequence[str]) -> dict[str, object]:
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    known = {n: n for n in names} | {n.replace("_", "-"): n for n in names}
    out: dict[str, object] = {}
    for key, value in data.items():
        if key not in known or key == "config":
            raise ConfigError(
                f"config file {path}: unknown option {key!r} (options are the flag names, "
                "e.g. inner_steps or inner-steps)"
            )
        out[known[key]] = value
    return out


def _from_toml(name: str, value: object, origin: str) -> object:
    """An option's value from the TOML file: typed TOML values stay typed where they can."""
    if _PARSERS[name] is _parse_key_values and isinstance(value, dict):
        # A table (task_option = {d_model = 64, tie = true}): already typed, and its
        # strings may hold commas, so it does not go through the KEY=VALUE text.
        if not all(isinstance(k, str) and k.strip() for k in value):
            raise ConfigError(f"{origin}: empty key")
        return tuple(value.items())
    if isinstance(value, list | dict) and not OPTIONS[name].repeatable:
        kind = "list" if isinstance(value, list) else "table"
        raise ConfigError(f"{origin}: expected a single value, got a {kind}")
    return _PARSERS[name](_toml_text(value), origin)


def _toml_text(value: object) -> str | list[str]:
    """A TOML value as the text a flag would carry (the option parsers take text)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, list):
        return [str(v) for v in value]
    if isinstance(value, dict):
        return [f"{k}={v}" for k, v in value.items()]
    return str(value)


def _items(raw: str | Sequence[str]) -> list[str]:
    # A flag may be repeated and each value may itself be comma-separated, like the env var.
    parts = [raw] if isinstance(raw, str) else list(raw)
    return [item.strip() for part in parts for item in part.split(",") if item.strip()]


def _multiaddrs(raw: str | Sequence[str], source: str) -> list[Multiaddr]:
    out = []
    for text in _items(raw):
        try:
            out.append(Multiaddr(text))
        except MultiaddrError as e:
            raise ConfigError(f"{source}: {e}") from None
    if not out:
        raise ConfigError(f"{source}: no address given")
    return list(dict.fromkeys(out))


def _parse_listen(raw: str | Sequence[str], source: str) -> tuple[Multiaddr, ...]:
    addrs = _multiaddrs(raw, source)
    for addr in addrs:
        if addr.tcp_endpoint() is None or addr.peer_id is not None:
            raise ConfigError(
                f"{source}: cannot listen on {addr}: give a local IP and TCP port, "
                "such as /ip4/0.0.0.0/tcp/31337 (no /p2p/ part)"
            )
    return tuple(addrs)


def _parse_announce(raw: str | Sequence[str], source: str) -> tuple[Multiaddr, ...]:
    addrs = _multiaddrs(raw, source)
    for addr in addrs:
        if not (addr.is_direct_tcp or addr.is_relayed):
            raise ConfigError(
                f"{source}: cannot announce {addr}: give an address to dial, "
                "such as /ip4/203.0.113.5/tcp/31337 or /dns/example.org/tcp/31337"
            )
    return tuple(addrs)


def _parse_bootstrap(raw: str | Sequence[str], source: str) -> tuple[Multiaddr | DnsaddrName, ...]:
    # Without /p2p/ID the peer is whoever answers at that address: allowed
    # (a DNS name for a public swarm), but the daemon warns.
    try:
        entries = [parse_entry(text) for text in _items(raw)]
    except NetworkError as e:
        raise ConfigError(f"{source}: {e} (a running peer prints its address at start)") from None
    if not entries:
        raise ConfigError(f"{source}: no address given")
    return tuple(dict.fromkeys(entries))


def _parse_network(raw: str | Sequence[str], source: str) -> str:
    assert isinstance(raw, str)
    try:
        return check_network_name(raw)
    except NetworkError as e:
        raise ConfigError(f"{source}: {e}") from None


def _parse_networks(raw: str | Sequence[str], source: str) -> Path:
    from .finding.networks import load_networks

    assert isinstance(raw, str)
    path = Path(raw.strip()).expanduser().absolute()
    try:
        load_networks(path)  # a bad file stops the start here, in one line
    except NetworkError as e:
        raise ConfigError(f"{source}: {e}") from None
    return path


def _parse_mdns(raw: str | Sequence[str], source: str) -> str:
    import ipaddress

    assert isinstance(raw, str)
    text = raw.strip().lower()
    if text in ("auto", "on", "off"):
        return text
    try:
        return str(ipaddress.IPv4Address(text))
    except ValueError:
        raise ConfigError(
            f"{source}: expected auto, on, off or an interface's IPv4 address, got {raw!r}"
        ) from None


def _parse_dns_server(raw: str | Sequence[str], source: str) -> tuple[tuple[str, int], ...]:
    try:
        servers = [parse_nameserver(text) for text in _items(raw)]
    except ValueError:
        raise ConfigError(f"{source}: expected IP or IP:PORT, got {raw!r}") from None
    if not servers:
        raise ConfigError(f"{source}: no DNS server given")
    return tuple(dict.fromkeys(servers))


def _parse_data_dir(raw: str | Sequence[str], source: str) -> Path:
    assert isinstance(raw, str)
    text = raw.strip()
    if not text:
        raise ConfigError(f"{source}: empty directory name")
    # absolute(): the log and error messages then say exactly which directory is used.
    return Path(text).expanduser().absolute()


def _parse_log_level(raw: str | Sequence[str], source: str) -> str:
    assert isinstance(raw, str)
    level = raw.strip().lower()
    if level not in LOG_LEVELS:
        raise ConfigError(
            f"{source}: unknown log level {raw!r}; choose one of {', '.join(LOG_LEVELS)}"
        )
    return level


def _parse_config(raw: str | Sequence[str], source: str) -> Path:
    assert isinstance(raw, str)
    return Path(raw.strip()).expanduser().absolute()


def _parse_name(raw: str | Sequence[str], source: str) -> str:
    """An experiment name to host (NAME: the peer ID is always ours)."""
    assert isinstance(raw, str)
    name = raw.strip()
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name):
        raise ConfigError(
            f"{source}: invalid experiment name {name!r}: 1-64 characters: letters, digits, "
            "'.', '_' or '-', starting with a letter or digit"
        )
    return name


def _parse_ref(raw: str | Sequence[str], source: str) -> str:
    """An experiment to join, NAME or NAME@PEERID; checked here so a typo fails at once."""
    assert isinstance(raw, str)
    text = raw.strip()
    name, sep, host = text.partition("@")
    _parse_name(name, source)
    if sep:
        try:
            PeerID.from_base58(host)
        except ValueError:
            raise ConfigError(
                f"{source}: invalid host peer ID {host!r} in {text!r}: expected "
                "NAME@12D3KooW..., as the host prints it"
            ) from None
    return text


def _parse_bool(raw: str | Sequence[str], source: str) -> bool:
    assert isinstance(raw, str)
    text = raw.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{source}: expected 1/0, true/false, yes/no; got {raw!r}")


def _parse_task(raw: str | Sequence[str], source: str) -> str:
    assert isinstance(raw, str)
    text = raw.strip()
    if not text:
        raise ConfigError(f"{source}: empty task")
    return text


def _parse_allow_task(raw: str | Sequence[str], source: str) -> tuple[str, ...]:
    specs = _items(raw)
    for spec in specs:
        target, colon, factory = spec.rpartition(":")
        if not colon or not target or not factory:
            raise ConfigError(
                f"{source}: expected MODULE:FACTORY or path/to/file.py:FACTORY, got {spec!r}"
            )
    if not specs:
        raise ConfigError(f"{source}: no task given")
    return tuple(dict.fromkeys(specs))


def _parse_key_values(raw: str | Sequence[str], source: str) -> tuple[tuple[str, Any], ...]:
    """KEY=VALUE items; values are read as TOML scalars (numbers, booleans), else text."""
    out: dict[str, Any] = {}
    for item in _top_level_items(raw):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"{source}: expected KEY=VALUE, got {item!r}")
        out[key] = _scalar(value.strip())
    return tuple(out.items())


def _top_level_items(raw: str | Sequence[str]) -> list[str]:
    """As `_items`, but a comma inside brackets or braces (and the quotes within them)
    stays in its item: a value may be JSON (``config={"model_type": "llama", ...}``)."""
    items: list[str] = []
    for part in [raw] if isinstance(raw, str) else list(raw):
        depth, quote, start = 0, "", 0
        for i, char in enumerate(part):
            if quote:
                quote = "" if char == quote and part[i - 1] != "\\" else quote
            elif char in "\"'" and depth:  # (an apostrophe outside JSON is just text)
                quote = char
            elif char in "[{":
                depth += 1
            elif char in "]}":
                depth = max(depth - 1, 0)
            elif char == "," and depth == 0:
                items.append(part[start:i])
                start = i + 1
        items.append(part[start:])
    return [item.strip() for item in items if item.strip()]


def _scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _parse_data(raw: str | Sequence[str], source: str) -> Path:
    assert isinstance(raw, str)
    path = Path(raw.strip()).expanduser().absolute()
    if not path.exists():
        raise ConfigError(f"{source}: {path} does not exist; give a text file or a folder")
    return path


def _parse_init_from(raw: str | Sequence[str], source: str) -> Path:
    assert isinstance(raw, str)
    path = Path(raw.strip()).expanduser().absolute()
    if not (path / "model.safetensors").is_file():
        raise ConfigError(
            f"{source}: {path} holds no model.safetensors; give a folder `shoal export` wrote"
        )
    return path


def _parse_strategy(raw: str | Sequence[str], source: str) -> str:
    assert isinstance(raw, str)
    name = raw.strip().lower()
    known = outer_strategy_names()
    if name not in known:
        raise ConfigError(f"{source}: unknown strategy {raw!r}; choose one of {', '.join(known)}")
    return name


def _positive_int(raw: str | Sequence[str], source: str) -> int:
    assert isinstance(raw, str)
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(f"{source}: expected a positive whole number, got {raw!r}")
    return value


def _parse_stages(raw: str | Sequence[str], source: str) -> int:
    value = _positive_int(raw, source)
    if value < 2:
        raise ConfigError(f"{source}: a pipeline has at least 2 stages, got {value}")
    return value


def _parse_stage(raw: str | Sequence[str], source: str) -> int:
    assert isinstance(raw, str)
    try:
        value = int(raw.strip())
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"{source}: expected a stage number (0, 1, ...), got {raw!r}")
    return value


def _parse_memory(raw: str | Sequence[str], source: str) -> int:
    assert isinstance(raw, str)
    try:
        return parse_size(raw)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def _parse_role(raw: str | Sequence[str], source: str) -> str:
    assert isinstance(raw, str)
    text = raw.strip().lower()
    if text not in ROLES:
        raise ConfigError(f"{source}: unknown role {raw!r}; choose one of {', '.join(ROLES)}")
    return text


def _parse_interval(raw: str | Sequence[str], source: str) -> float:
    assert isinstance(raw, str)
    try:
        value = float(raw.strip())
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ConfigError(f"{source}: expected a positive number of seconds, got {raw!r}")
    return value


def _parse_status_addr(raw: str | Sequence[str], source: str) -> tuple[str, int] | None:
    assert isinstance(raw, str)
    text = raw.strip()
    if text.lower() in ("off", "none", "no"):
        return None
    from .status.server import parse_status_addr

    try:
        return parse_status_addr(text)
    except ValueError as e:
        raise ConfigError(f"{source}: {e} (or 'off' to disable the endpoint)") from None


def _parse_device(raw: str | Sequence[str], source: str) -> str:
    # Only the form is checked here (torch-free); whether the machine has the
    # device is the daemon's question (peer/training/device.py).
    assert isinstance(raw, str)
    text = raw.strip().lower()
    if not _DEVICE_FORM.fullmatch(text):
        raise ConfigError(
            f"{source}: unknown device {raw!r}; choose auto, cpu, cuda, cuda:N or mps"
        )
    return text


def _parse_precision(raw: str | Sequence[str], source: str) -> str:
    assert isinstance(raw, str)
    text = raw.strip().lower()
    if text not in PRECISIONS:
        raise ConfigError(
            f"{source}: unknown precision {raw!r}; choose one of {', '.join(PRECISIONS)}"
        )
    return text


def _parse_inner_optimizer(raw: str | Sequence[str], source: str) -> dict[str, Any]:
    assert isinstance(raw, str)
    try:
        return parse_inner_optimizer(raw)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def _parse_verify(raw: str | Sequence[str], source: str) -> str:
    assert isinstance(raw, str)
    text = raw.strip().lower()
    if text not in ("on", "off", "auto"):
        raise ConfigError(f"{source}: --verify takes on or off, got {raw!r}")
    return text


def _parse_reachability(raw: str | Sequence[str], source: str) -> str:
    assert isinstance(raw, str)
    mode = raw.strip().lower()
    if mode not in REACHABILITY_MODES:
        raise ConfigError(
            f"{source}: unknown reachability {raw!r}; choose one of {', '.join(REACHABILITY_MODES)}"
        )
    return mode


def _parse_swarm_key(raw: str | Sequence[str], source: str) -> Path:
    assert isinstance(raw, str)
    path = Path(raw.strip()).expanduser().absolute()
    try:
        read_swarm_key(path)  # a bad file stops the start here, in one line
    except AccessFileError as e:
        raise ConfigError(f"{source}: {e}") from None
    return path


def _parse_allow_peers(raw: str | Sequence[str], source: str) -> Path:
    assert isinstance(raw, str)
    path = Path(raw.strip()).expanduser().absolute()
    try:
        read_allow_list(path)
    except AccessFileError as e:
        raise ConfigError(f"{source}: {e}") from None
    return path


_PARSERS = {
    "data_dir": _parse_data_dir,
    "listen": _parse_listen,
    "announce": _parse_announce,
    "bootstrap": _parse_bootstrap,
    "network": _parse_network,
    "networks": _parse_networks,
    "mdns": _parse_mdns,
    "dns_server": _parse_dns_server,
    "log_level": _parse_log_level,
    "config": _parse_config,
    "host_experiment": _parse_name,
    "join": _parse_ref,
    "no_train": _parse_bool,
    "task": _parse_task,
    "allow_task": _parse_allow_task,
    "task_option": _parse_key_values,
    "data": _parse_data,
    "init_from": _parse_init_from,
    "strategy": _parse_strategy,
    "inner_steps": _positive_int,
    "strategy_option": _parse_key_values,
    "inner_optimizer": _parse_inner_optimizer,
    "pipeline_stages": _parse_stages,
    "role": _parse_role,
    "stage": _parse_stage,
    "max_memory": _parse_memory,
    "status_addr": _parse_status_addr,
    "checkpoint_interval": _parse_interval,
    "threads": _positive_int,
    "device": _parse_device,
    "precision": _parse_precision,
    "verify": _parse_verify,
    "work_log_max": _parse_memory,
    "reachability": _parse_reachability,
    "swarm_key": _parse_swarm_key,
    "allow_peers": _parse_allow_peers,
}
