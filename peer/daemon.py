"""The daemon's lifecycle: load the identity, start the subsystems, serve until told to stop.

Subsystems so far: the transport host and the DHT node (joined through
`--bootstrap`, or starting a new network). The trainer and the HTTP status
endpoint will be started in `run_daemon` the same way, each pushed on the exit
stack so that shutdown closes them in reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Iterator
from typing import TextIO

from shoal.dht.node import BootstrapError, DHTNode
from shoal.transport.host import Host
from shoal.transport.identity import Identity, IdentityFileError

from . import __version__
from .config import Config

__all__ = ["StartupError", "load_identity", "print_addresses", "run_daemon"]

log = logging.getLogger("shoal.peer")

# On top of the host's own close_grace: how long shutdown may take before we give up on it.
SHUTDOWN_SLACK = 5.0
SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Joining: each bootstrap peer is tried this many times, waiting 1, 2, 4, ... s between.
BOOTSTRAP_ATTEMPTS = 6
BOOTSTRAP_BACKOFF = 1.0


class StartupError(Exception):
    """The daemon cannot run as configured (key file, data dir, port); the message is one line."""


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
    for addr in host.addresses():
        print(addr, file=out)
    print(
        "To connect, another peer dials one of the addresses above "
        "(the handshake checks the /p2p/ peer ID).",
        file=out,
        flush=True,  # stdout is block-buffered when piped; whoever waits for it must see it now
    )


async def run_daemon(
    config: Config, stop: asyncio.Event | None = None, out: TextIO | None = None
) -> None:
    """Run the peer until `stop` is set, or, without one, until SIGINT or SIGTERM.

    Raises StartupError (or ConfigError) when it cannot start; returns after a
    graceful shutdown.
    """
    log.info("shoal %s starting", __version__)
    for line in config.describe():
        log.info("config: %s", line)
    async with contextlib.AsyncExitStack() as stack:
        if stop is None:
            # Installed first: Ctrl+C during start-up already means a clean shutdown.
            stop = asyncio.Event()
            stack.enter_context(_shutdown_on_signals(stop))

        identity = load_identity(config)
        config.check_peer_id(identity.peer_id)
        log.info("peer ID %s", identity.peer_id)

        host = Host(identity, config.host_config())
        stack.push_async_callback(_close_host, host)  # before start: closes a partial start too
        try:
            await host.start()
        except OSError as e:
            raise StartupError(
                f"{e}; is another shoal running? choose a free address with --listen "
                "(or SHOAL_LISTEN), e.g. --listen /ip4/0.0.0.0/tcp/31338"
            ) from None
        for addr in host.listen_addrs:
            log.info("listening on %s", addr)
        dht = await _start_dht(host, config)
        stack.push_async_callback(dht.aclose)
        print_addresses(host, out)

        await stop.wait()
        log.info("shutting down")
    log.info("stopped")


async def _start_dht(host: Host, config: Config) -> DHTNode:
    for addr in config.bootstrap:
        if addr.peer_id is None:
            log.warning(
                "bootstrap address %s names no peer ID: whoever answers there is trusted "
                "as the way in; add /p2p/<ID> to be sure",
                addr,
            )
    if not config.bootstrap:
        log.info("no bootstrap peers: starting a new network")
        return await DHTNode.create(host)
    try:
        dht = await DHTNode.create(
            host,
            bootstrap=config.bootstrap,
            bootstrap_attempts=BOOTSTRAP_ATTEMPTS,
            bootstrap_backoff=BOOTSTRAP_BACKOFF,
        )
    except BootstrapError as e:
        raise StartupError(f"{e}; check the --bootstrap (SHOAL_BOOTSTRAP) addresses") from None
    log.info("joined the network: %d peers known", len(dht.routing_table))
    return dht


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
        log.warning("%s received: shutting down (press Ctrl+C again to exit at once)", sig.name)
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
