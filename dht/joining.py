"""Joining a DHT through bootstrap peers, and joining again when cut off."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from shoal.transport import rpc
from shoal.transport.errors import PeerIDMismatch, TransportError
from shoal.transport.host import Host
from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr
from shoal.transport.version import IncompatibleProtocol

from .errors import BootstrapError, PeerBusy
from .protocol import DHTProtocolError
from .routing import RoutingTable

log = logging.getLogger("shoal.dht")

# A node with fewer live contacts than this (contacts whose last RPC did not fail)
# joins again through its bootstrap peers, checked every REJOIN_CHECK_S (`rejoin_check`).
REJOIN_BELOW = 2
REJOIN_CHECK_S = 30.0


def _reason(e: BaseException) -> str:
    chain: BaseException | None = e
    while chain is not None:
        if isinstance(chain, ConnectionRefusedError):
            return "connection refused (nothing listens there yet?)"
        chain = chain.__cause__ or chain.__context__
    if "[Errno 111]" in str(e):  # a DialError that kept only the message of the refusal
        return "connection refused (nothing listens there yet?)"
    if isinstance(e, TimeoutError):
        return "no answer"
    return f"{type(e).__name__}: {e}"[:200]


class Joiner:
    """Pings bootstrap peers (with retries), hands each that answers to `reached`,
    then fills the table with `fill` (a lookup of our own ID, then of every bucket)."""

    def __init__(
        self,
        host: Host,
        protocol: str,
        hop_timeout: float,
        hello: Callable[[], dict[str, Any]],
        reached: Callable[[PeerID, object, Multiaddr], None],
        fill: Callable[[], Awaitable[object]],
    ) -> None:
        self.host = host
        self.protocol = protocol
        self.hop_timeout = hop_timeout
        self._hello = hello
        self._reached = reached
        self._fill = fill

    async def bootstrap(
        self,
        addrs: Sequence[str | Multiaddr],
        *,
        attempts: int = 3,
        backoff: float = 0.2,
        quiet: bool = False,
    ) -> None:
        # Not ourselves: a bootstrap peer started with its network's whole list dialed
        # itself, failed `attempts` times and held the join that long (15 s with the
        # daemon's backoff); alone on the list, it refused to start. A list of only
        # ourselves is a new network's first peer.
        parsed = [Multiaddr(str(a)) for a in addrs]
        others = [a for a in parsed if a.peer_id != self.host.peer_id]
        if len(others) < len(parsed):
            log.log(logging.DEBUG if quiet else logging.INFO,
                    "the bootstrap list names this peer: not dialed")  # fmt: skip
        if not others and parsed:
            return
        addrs = others
        results = await asyncio.gather(
            *(self._bootstrap_one(a, attempts, backoff, quiet) for a in others)
        )
        errors = [r for r in results if r is not None]
        if len(errors) == len(results):
            raise BootstrapError(
                f"could not reach any of {len(addrs)} bootstrap peers after "
                f"{attempts} attempts each: " + "; ".join(errors)
            )
        # Our own ID fills the deep buckets, a lookup in every bucket the far ones.
        await self._fill()

    async def rejoin_when_cut_off(
        self, addrs: list[str], every: float, table: RoutingTable
    ) -> None:
        """Join again through the bootstrap peers while fewer than REJOIN_BELOW contacts
        are `live`. The table keeps contacts that fail (stale) when nothing replaces
        them, and most come back by themselves after an outage; this is for those
        that do not (a NATed contact whose relay address changed meanwhile)."""
        while True:
            await asyncio.sleep(every)
            live = sum(1 for c in table if c.failures == 0)
            if live >= REJOIN_BELOW:
                continue
            try:
                await self.bootstrap(addrs, attempts=1, quiet=True)
            except BootstrapError as e:
                log.debug("rejoining through the bootstrap peers: %s", e)
                continue
            log.info("%d live DHT contacts: joined again through the bootstrap peers "
                     "(%d contacts now)", live, len(table))  # fmt: skip

    async def _bootstrap_one(
        self, addr: Multiaddr, attempts: int, backoff: float, quiet: bool = False
    ) -> str | None:
        error = ""
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(backoff * 2 ** (attempt - 1))
            try:
                async with asyncio.timeout(self.hop_timeout * 2):
                    conn = await self.host.connect(addr, timeout=self.hop_timeout)
                    peer = conn.remote_peer
                    reply = await rpc.call(
                        self.host,
                        peer,
                        self.protocol,
                        "ping",
                        self._hello(),
                        timeout=self.hop_timeout,
                    )
                self._reached(peer, reply, addr)
                return None
            except (TransportError, TimeoutError, OSError, DHTProtocolError, PeerBusy) as e:
                error = f"{addr}: {type(e).__name__}: {e}"
                # Another peer answers there, or one whose protocol we cannot speak:
                # retrying cannot help.
                hopeless = isinstance(e, PeerIDMismatch | IncompatibleProtocol)
                final = attempt + 1 == attempts or hopeless
                # Said while it happens: a joiner must not sit silent for half a minute.
                log.log(
                    logging.DEBUG if quiet else logging.INFO,
                    "bootstrap peer %s: %s (attempt %d of %d%s)",
                    addr,
                    _reason(e),
                    attempt + 1,
                    attempts,
                    "" if final else f", next in {backoff * 2**attempt:.0f}s",
                )
                if hopeless:
                    break
        return error
