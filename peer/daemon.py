"""The daemon's lifecycle: load the identity, start the subsystems, serve until told to stop.

In order: the transport host, NAT traversal, the DHT (joined through
`--bootstrap` or the --network's list, else peers heard over mDNS, else
starting a new network), the HTTP status endpoint, then the
experiment (hosted or joined, `session.py`) and its training loop. Each is
pushed on one exit stack, so shutdown closes them in reverse order, and a
start that fails half-way closes what had started.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import gc
import importlib
import json
import logging
import os
import shlex
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from shoal.dht.node import BootstrapError, DHTNode
from shoal.dht.records import RecordValidator
from shoal.dht.relay_directory import DHTRelayDirectory
from shoal.transport.access import AccessControl
from shoal.transport.host import Host
from shoal.transport.identity import Identity, IdentityFileError
from shoal.transport.multiaddr import Multiaddr, MultiaddrError
from shoal.transport.nat import NatConfig, NatManager

from . import __version__
from .config import Config, ConfigError
from .experiment import register_manifest_validator
from .finding import MDNS_FIRST_WAIT, find_bootstrap, mdns_interfaces
from .finding.lan import LanFinder
from .status.progress import Progress
from .training.heap import return_large_blocks_at_once
from .training.priority import helper_executor

if TYPE_CHECKING:
    from .node import PeerNode

__all__ = [
    "StartedNode",
    "StartupError",
    "choose_device_of",
    "load_identity",
    "print_addresses",
    "print_join_command",
    "run_daemon",
    "start_node",
]

log = logging.getLogger("shoal.peer")

# On top of the host's own close_grace: how long shutdown may take before we give up on it.
SHUTDOWN_SLACK = 5.0
SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Joining: each bootstrap peer is tried this many times, waiting 1, 2, 4, 8 s between
# (15 s in all: enough for a host started at the same moment; each try is logged).
BOOTSTRAP_ATTEMPTS = 5
BOOTSTRAP_BACKOFF = 1.0


class StartupError(Exception):
    """The daemon cannot run as configured (key file, data dir, port); the message is one line."""


LOCK_FILE = ".lock"


def lock_data_dir(data_dir: Path) -> TextIO:
    """Hold an exclusive lock on `data_dir` for this process' lifetime (the open file
    is the lock; closing it, or the process ending, releases it). StartupError naming
    the holder's pid when another shoal uses the directory: two processes would
    share one identity and write over each other's checkpoints."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        handle = open(data_dir / LOCK_FILE, "a+")  # noqa: SIM115 (held open on purpose)
    except OSError as e:
        raise StartupError(
            f"cannot use data directory {data_dir}: {e.strerror or e}; choose another "
            "with --data-dir or SHOAL_DATA_DIR"
        ) from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise StartupError(
            f"data directory {data_dir} is in use by another shoal (pid {holder}); stop "
            "it, or give this peer its own --data-dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def load_identity(config: Config) -> Identity:
    """The peer's identity from the data dir, created (mode 0600) on first use."""
    data_dir, path = config.data_dir, config.identity_path
    hint = "choose another with --data-dir or SHOAL_DATA_DIR"
    try:
        # 0700: the directory will also hold checkpoints; nobody else needs to list it.
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise StartupError(
            f"cannot use data directory {data_dir}: {e.strerror or e}; {hint}"
        ) from None
    existed = path.exists()
    try:
        identity = Identity.load_or_create(path)
    except IdentityFileError as e:
        raise StartupError(str(e)) from None
    except OSError as e:
        verb = "read" if existed else "create"
        raise StartupError(
            f"cannot {verb} identity key {path}: {e.strerror or e}; {hint}"
        ) from None
    if existed:
        log.debug("loaded identity %s from %s", identity.peer_id, path)
    else:
        log.info("created a new identity %s in %s", identity.peer_id, path)
    return identity


def print_addresses(host: Host, out: TextIO | None = None) -> None:
    """The dialable addresses on stdout, one per line, so scripts and people can copy them."""
    out = out if out is not None else sys.stdout
    print(f"shoal peer {host.peer_id} is reachable at:", file=out)
    # What we listen on, not only what NAT traversal has confirmed so far: until
    # another peer dialed us back, that list is empty, yet these work locally.
    addrs = host.addresses() if host.config.announce else host.interface_addresses()
    for addr in addrs:
        print(addr, file=out)
    print(
        "To connect, another peer dials one of the addresses above "
        "(the handshake checks the /p2p/ peer ID).",
        file=out,
        flush=True,  # stdout is block-buffered when piped; whoever waits for it must see it now
    )


def _log_access(access: AccessControl, config: Config) -> None:
    """Say who may connect, and warn of bootstrap peers the allow list would refuse."""
    status = access.status()
    if access.mode == "open":
        log.info("access: open swarm (any peer may connect)")
        return
    parts = []
    if status["swarm_key_fingerprint"] is not None:
        parts.append(f"swarm key {status['swarm_key_fingerprint']} (fingerprint)")
    if access.allowed is not None:
        parts.append(f"allow list of {len(access.allowed)} peer IDs")
        for addr in config.bootstrap:
            peer = addr.peer_id
            if peer is not None and peer not in access.allowed:
                log.warning(
                    "bootstrap peer %s is not in the allow list (%s): it will be refused; list it",
                    peer,
                    config.allow_peers,
                )
    log.info("access: private swarm: %s", "; ".join(parts))


async def run_daemon(
    config: Config,
    stop: asyncio.Event | None = None,
    out: TextIO | None = None,
    *,
    freeze_heap: bool = False,
) -> None:
    """Run the peer until `stop` is set, or, without one, until SIGINT or SIGTERM.

    `freeze_heap` (for a process that is only this peer, as `shoal run`) moves
    everything allocated during start-up out of the garbage collector's passes, has
    every large block the C heap gives out mapped on its own, so that freeing it
    gives it back at once (`heap.return_large_blocks_at_once`: a verifying 50M peer
    otherwise grew by about a model state per round, freed but kept by malloc), and
    runs the loop's default executor below the loop's priority
    (`priority.helper_executor`).

    Raises StartupError (or ConfigError) when it cannot start; returns after a
    graceful shutdown: the round in flight ends, a checkpoint is written, the
    status endpoint, the DHT, NAT traversal and the transport close in turn.
    """
    log.info("shoal %s starting", __version__)
    for line in config.describe():
        log.info("config: %s", line)
    role = config.experiment_role()  # a ConfigError here, before anything starts
    if freeze_heap:
        return_large_blocks_at_once()
        # (run_until_complete shuts the default executor down at the end)
        asyncio.get_running_loop().set_default_executor(helper_executor())
    async with contextlib.AsyncExitStack() as stack:
        if stop is None:
            # Installed first: Ctrl+C during start-up already means a clean shutdown.
            stop = asyncio.Event()
            stack.enter_context(_shutdown_on_signals(stop))

        if config.threads is not None and role is not None:
            import torch

            torch.set_num_threads(config.threads)
        device, inventory = choose_device_of(config) if role is not None else (None, None)

        started = await start_node(config, stack, load_training=role is not None)
        config, role, node, lan = started.config, started.role, started.node, started.lan
        host = node.host

        if role is not None:
            from .session import SessionError, open_session

            try:
                session = await open_session(
                    config, node.identity, node.dht, device=device, inventory=inventory
                )
            except SessionError as e:
                raise StartupError(str(e)) from None
            node.attach(session)
        print_addresses(host, out)
        if lan is not None:
            await lan.settled()  # a newcomer on the LAN now joins us rather than hosting
        if node.session is not None:
            print_join_command(node, config, out)
        if config.status_addr is not None and node.status_url:
            print(f"Status: {node.status_url}", file=out or sys.stdout, flush=True)

        if freeze_heap:
            # What start-up allocated (torch's modules, the model, the corpus index)
            # lives as long as the process: take it out of the collector's reach. A
            # full collection over it stalled the event loop ~80 ms each time, and
            # every deadline and heartbeat in flight with it.
            gc.freeze()

        await _run_until_stopped(node, stop, stack)
        log.info("shutting down")
    log.info("stopped")


@dataclasses.dataclass
class StartedNode:
    """A peer's running network part (`start_node`): what the daemon and the library share."""

    config: Config  # with --join filled in when the peer found its experiment's swarm now
    role: tuple[str, str] | None  # ("host" | "join", NAME) or None (no experiment)
    node: PeerNode
    lan: LanFinder | None


async def start_node(
    config: Config, stack: contextlib.AsyncExitStack, *, load_training: bool = True
) -> StartedNode:
    """Lock the data directory, load the identity, start the transport, NAT traversal,
    mDNS and the DHT, then the `PeerNode` and (unless `config.status_addr` is None) its
    status endpoint; each is closed by `stack`. The one start-up of `shoal run` and of
    the library (`shoal.peer.library`). StartupError or ConfigError when it cannot."""
    stack.enter_context(lock_data_dir(config.data_dir))
    identity = load_identity(config)
    config.check_peer_id(identity.peer_id)
    log.info("peer ID %s", identity.peer_id)

    host, nat, dht, lan, way_in = await _start_network(config, identity, stack)
    # A peer that found its way in only now (a network list, mDNS) joins its experiment.
    role = config.experiment_role(has_way_in=way_in)
    if role is not None and role[0] == "join" and config.join is None:
        config = dataclasses.replace(config, join=role[1])  # what open_session reads

    # Imported here: session loads torch, which `shoal id`, `shoal status` and a
    # --no-train peer (a bootstrap or relay on a small machine) never need. In a
    # thread: importing the training stack (averaging, numba's compiled loops)
    # takes seconds on a loaded machine, and the event loop must keep answering
    # handshakes meanwhile (a missed dial-back once made a public host conclude
    # it was private).
    if role is not None and load_training:
        await asyncio.to_thread(importlib.import_module, "shoal.peer.session")
    from .node import PeerNode

    node = PeerNode(config, identity, host, nat, dht)
    stack.push_async_callback(node.aclose)
    if config.status_addr is not None:
        await _start_status(node, config.status_addr, stack)
    return StartedNode(config, role, node, lan)


async def _start_network(
    config: Config, identity: Identity, stack: contextlib.AsyncExitStack
) -> tuple[Host, NatManager, DHTNode, LanFinder | None, bool]:
    """The transport, NAT traversal, mDNS and the DHT, started, each closed by `stack`;
    and whether the DHT joined an existing network."""
    access = config.access_control()
    _log_access(access, config)
    host = Host(identity, config.host_config(), access=access)
    stack.push_async_callback(_close_host, host)  # before start: closes a partial start too
    try:
        await host.start()
    except OSError as e:
        raise StartupError(
            f"{e}; is another shoal running? choose a free address with --listen "
            "(or SHOAL_LISTEN), e.g. --listen /ip4/0.0.0.0/tcp/0 (any free port)"
        ) from None
    for addr in host.listen_addrs:
        log.info("listening on %s", addr)
    nat = NatManager(host, config=NatConfig(reachability=config.reachability))
    await nat.start()
    stack.push_async_callback(nat.aclose)
    lan = None
    interfaces = mdns_interfaces(config.mdns, list(host.listen_addrs))
    if interfaces is not False:
        lan = LanFinder(host, config.network, interfaces or None, nat.heard_on_lan)
        stack.push_async_callback(lan.aclose)
        try:
            await lan.start()
        except Exception as e:  # no multicast here, no such interface: other ways in remain
            log.warning("mDNS is off: %r", e)
            lan = None
    dht, way_in = await _start_dht(host, config, nat, lan)
    stack.push_async_callback(dht.aclose)
    if lan is not None:
        lan.attach(dht)
    stack.callback(save_known_peers, dht, config.data_dir)  # runs before dht.aclose
    nat.directory = DHTRelayDirectory(dht)
    nat.address_listeners.append(dht.addresses_changed)
    # Reachability can turn public while the DHT is bootstrapping (its first
    # connection brings the dial-back): that change told no listener yet, and the
    # bootstrap requests carried no address, so tell our neighbours now, or they
    # list us only after a refresh (a lab test waited 30 s for it in vain).
    dht.addresses_changed()
    return host, nat, dht, lan, way_in


async def _run_until_stopped(
    node: PeerNode, stop: asyncio.Event, stack: contextlib.AsyncExitStack
) -> None:
    """Train (or, without an experiment, serve) until `stop` is set."""
    progress = Progress()
    if progress.live:
        from tqdm.contrib.logging import logging_redirect_tqdm

        stack.enter_context(logging_redirect_tqdm())
    stack.callback(progress.close)
    node.start_background(progress)
    if node.session is not None:
        from .training.checkpoint import CheckpointError

        try:
            await node.train(stop)
        except CheckpointError as e:  # the disk filled up, or the directory went away
            raise StartupError(str(e)) from None
    else:
        await stop.wait()


def choose_device_of(config: Config) -> tuple[Any, Any]:
    """The training device and what torch sees; ConfigError (one line) when it is absent."""
    from .training.device import DeviceError, choose_device, describe, probe_inventory

    inventory = probe_inventory()
    try:
        device = choose_device(config.device, inventory)
    except DeviceError as e:
        raise ConfigError(str(e)) from None
    log.info("training on %s", describe(device, inventory).summary())
    return device, inventory


async def _start_status(
    node: PeerNode, addr: tuple[str, int], stack: contextlib.AsyncExitStack
) -> None:
    from .status.metrics import Metrics
    from .status.server import StatusServer

    metrics = Metrics(node)
    server = StatusServer(node, metrics, addr[0], addr[1])
    try:
        await server.start()
    except OSError as e:
        raise StartupError(
            f"cannot serve the status endpoint on {addr[0]}:{addr[1]}: {e.strerror or e}; "
            "is another shoal running? choose another with --status-addr HOST:PORT "
            "(or SHOAL_STATUS_ADDR; 'off' disables it)"
        ) from None
    stack.push_async_callback(server.aclose)
    node.metrics = metrics
    node.status_url = server.url


def print_join_command(node: PeerNode, config: Config, out: TextIO | None = None) -> None:
    """How another machine, or another terminal here, joins this experiment."""
    out = out if out is not None else sys.stdout
    session = node.session
    assert session is not None
    ref = str(session.manifest.ref)
    if ":" in session.manifest.task:  # a custom task runs only on joiners that name it
        ref += f" --task {shlex.quote(session.manifest.task)}"
    print(f"Experiment {session.manifest.name!r} (id {session.manifest.experiment_id}).", file=out)
    remote = (
        node.host.addresses()
        if config.announce
        else node.host.interface_addresses(include_loopback=False)
    )
    if remote:
        node.join_command = f"shoal run --join {ref} --bootstrap {remote[0]}"
        print("To join it from another machine:", file=out)
        print(f"  {node.join_command}", file=out)
    else:
        print(
            "Other machines cannot reach this peer: it listens on loopback only "
            "(--listen /ip4/0.0.0.0/tcp/PORT lets them).",
            file=out,
        )
    local = [a for a in node.host.interface_addresses() if a.is_loopback] or remote
    if local:
        # A fresh data directory and free ports per run: the same command works in as
        # many terminals as you open (each peer with its own identity).
        terminal = (
            f'shoal run --join {ref} --bootstrap {local[0]} --data-dir "$(mktemp -d)" '
            "--listen /ip4/0.0.0.0/tcp/0 --status-addr 127.0.0.1:0"
        )
        node.join_command = node.join_command or terminal
        print("To join it from another terminal on this machine (run it in several):", file=out)
        print(f"  {terminal}", file=out)
    out.flush()


async def _start_dht(
    host: Host, config: Config, nat: NatManager, lan: LanFinder | None
) -> tuple[DHTNode, bool]:
    found = await find_bootstrap(
        config.bootstrap, config.network, config.networks, config.dns_server
    )
    if found.error is not None:
        raise StartupError(found.error)
    for result in found.dnsaddr:
        log.info("%s resolves to %d addresses", result.name, len(result.addrs))
    bootstrap = found.addrs
    if config.bootstrap and not bootstrap:
        raise StartupError(
            "no address to join through: the --bootstrap /dnsaddr/ names resolved to none "
            f"({'; '.join(p for r in found.dnsaddr for p in r.problems[:2])})"
        )
    if found.entries and not bootstrap:
        log.warning("the %s list resolved to no address", found.source)
    for addr in bootstrap:
        if addr.peer_id is None:
            log.warning(
                "bootstrap address %s names no peer ID: whoever answers there is trusted "
                "as the way in; add /p2p/<ID> to be sure",
                addr,
            )
    validator = RecordValidator()
    register_manifest_validator(validator)  # before any record can arrive
    options: dict[str, Any] = {"serves": lambda: nat.serves_dht, "validator": validator}
    if not bootstrap:
        # Peers this one knew when it last ran: a restarted peer (a host that left
        # its swarm for a moment) finds its swarm again instead of starting alone.
        known = load_known_peers(config.data_dir)
        if known:
            try:
                dht = await DHTNode.create(host, bootstrap=known, bootstrap_attempts=1, **options)
                log.info(
                    "rejoined the network through peers known from the last run: %d peers",
                    len(dht.routing_table),
                )
                return dht, False
            except BootstrapError:
                log.info("none of the %d peers known from the last run answers", len(known))
        if lan is not None:
            heard, joins = await lan.first_peers(MDNS_FIRST_WAIT)
            if heard:
                with contextlib.suppress(BootstrapError):
                    dht = await DHTNode.create(
                        host, bootstrap=heard, bootstrap_attempts=1, **options
                    )
                    log.info("joined the peers found over mDNS: %d known", len(dht.routing_table))
                    return dht, joins
        log.info("no bootstrap peers: starting a new network")
        return await DHTNode.create(host, **options), False
    # A peer that was in this network before (it saved the peers it knew) and finds
    # none of its bootstrap peers now is cut off (a partition, an outage), not
    # misconfigured: it starts anyway and the DHT joins again through them every
    # `rejoin_check` seconds. A first start fails fast (most likely a wrong address),
    # unless peers of the network on our LAN answer (`_join_the_lan_instead`).
    was_in_network = bool(load_known_peers(config.data_dir))
    try:
        dht = await DHTNode.create(
            host,
            bootstrap=bootstrap,
            bootstrap_attempts=BOOTSTRAP_ATTEMPTS,
            bootstrap_backoff=BOOTSTRAP_BACKOFF,
            start_alone_on_failure=was_in_network,
            **options,
        )
    except BootstrapError as e:
        lan_dht = await _join_the_lan_instead(host, lan, bootstrap, options)
        if lan_dht is None:
            raise StartupError(f"{e}; check the --bootstrap (SHOAL_BOOTSTRAP) addresses") from None
        dht = lan_dht
    known = len(dht.routing_table)
    if known:
        log.info("joined the network: %d %s known", known, "peer" if known == 1 else "peers")
        save_known_peers(dht, config.data_dir)  # also for a next start after a kill -9
    return dht, True


async def _join_the_lan_instead(
    host: Host, lan: LanFinder | None, bootstrap: list[Multiaddr], options: dict[str, Any]
) -> DHTNode | None:
    """None of the bootstrap peers answered a first start, but peers of our network on
    the LAN did finish starting (heard over mDNS): our uplink or theirs is cut (a CI
    soak's peer, started in a partition, exited while two such neighbours were
    heard). Join through them; the DHT joins through the bootstrap peers again once
    cut off (`rejoin_check`). None: no such neighbour answers either."""
    neighbours = lan.settled_addrs() if lan is not None else []
    if not neighbours:
        return None
    try:
        dht = await DHTNode.create(
            host, bootstrap=[*neighbours, *bootstrap], bootstrap_attempts=1, **options
        )
    except BootstrapError:
        return None
    log.warning(
        "none of the %d bootstrap peers answers: joined through the peers found on "
        "this LAN over mDNS; joining through the bootstrap peers again when cut off",
        len(bootstrap),
    )
    return dht


KNOWN_PEERS_FILE = "known-peers.json"
KNOWN_PEERS_MAX = 16


def load_known_peers(data_dir: Path) -> list[Multiaddr]:
    """Addresses saved by `save_known_peers` (nothing when missing or unreadable)."""
    try:
        raw = json.loads((data_dir / KNOWN_PEERS_FILE).read_text())
        return [Multiaddr(a) for a in raw[:KNOWN_PEERS_MAX] if isinstance(a, str)]
    except (OSError, ValueError, TypeError, MultiaddrError):
        return []


def save_known_peers(dht: DHTNode, data_dir: Path) -> None:
    """A few contacts of the routing table, one address each, for the next start."""
    addrs = []
    for contact in dht.routing_table:
        direct = [a for a in contact.addrs if a.is_direct_tcp]
        if direct:
            addrs.append(str(direct[0].with_peer_id(contact.peer_id)))
        if len(addrs) >= KNOWN_PEERS_MAX:
            break
    if not addrs:
        return
    path = data_dir / KNOWN_PEERS_FILE
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(addrs, indent=1))
        tmp.replace(path)
    except OSError as e:
        log.debug("could not save known peers: %r", e)


async def _close_host(host: Host) -> None:
    deadline = host.config.close_grace + SHUTDOWN_SLACK
    try:
        async with asyncio.timeout(deadline):
            await host.aclose()
    except TimeoutError:
        log.warning("transport did not close within %.0fs; exiting anyway", deadline)


@contextlib.contextmanager
def _shutdown_on_signals(stop: asyncio.Event) -> Iterator[None]:
    """SIGINT/SIGTERM set `stop`; a second one kills the process at once."""
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        log.info(
            "%s received: shutting down after a last checkpoint (press Ctrl+C again to exit "
            "at once, without it)",
            sig.name,
        )
        # The default disposition, not another loop callback: the second signal must
        # work even when shutdown has the event loop stuck.
        for s in SHUTDOWN_SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        stop.set()

    for sig in SHUTDOWN_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        yield
    finally:
        for sig in SHUTDOWN_SIGNALS:
            loop.remove_signal_handler(sig)
