"""Hole punching (DCUtR-like) over a relayed connection, by TCP simultaneous open.

Protocol ``/shoal/dcutr/1.0.0``, opened over the relayed connection by the peer
that *accepted* it (the initiator, I; the other is the responder, R)::

    I -> R  {"type": "connect", "addrs": [I's public addresses],
             "lan": [I's private addresses]}                          (I starts a clock)
    R -> I  {"type": "connect", "addrs": [...], "lan": [...]}         (I: rtt = clock)
    I -> R  {"type": "sync"}
    R dials I at once; I dials R rtt/2 later, so both SYNs leave together.

Both dial from their listen ports, which the NATs map to the addresses just
exchanged: each SYN opens its own NAT's mapping for the other's, and the
kernel turns the crossing SYNs into one connection. Since neither side "dialed",
the handshake roles were fixed above: I is the Noise initiator whether its
socket came from connect() or from its listener (`Host.expect_inbound`). Up
to `punch_attempts` rounds on the same stream; then I closes it. On success
the host prefers the new direct connection and gracefully closes the relayed one.

Two peers behind the same NAT (the same public IP on both sides) also dial each
other's private addresses (``lan``, optional): a router that does not hairpin
drops a SYN sent from inside to its own public address, and even one that does
would carry the pair's traffic through itself. Over the LAN the dial reaches the
other's listener directly, and the connection lives on when the NAT's uplink is
cut (a partition from the relays and the DHT: the two can still average). The
private addresses of a peer behind another public IP are never dialed: they name
hosts on someone else's network.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..connection import Connection, Stream
from ..errors import ProtocolViolation, TransportError
from ..host import Host
from ..identity import PeerID
from ..multiaddr import Multiaddr
from . import wire
from .config import NatConfig

log = logging.getLogger("shoal.transport.nat")

PROTOCOL = "/shoal/dcutr/1.0.0"
MAX_TARGETS = 4
MAX_LAN_TARGETS = 2  # private addresses dialed besides the public ones (same NAT only)


def dial_targets(addrs: list[Multiaddr]) -> list[tuple[str, int]]:
    """The (ip, port) endpoints worth punching to: direct IP addresses, deduplicated."""
    out: list[tuple[str, int]] = []
    for a in addrs:
        endpoint = a.tcp_endpoint()
        if endpoint is None or a.is_unspecified or a.family not in ("ip4", "ip6"):
            continue
        if endpoint not in out:
            out.append(endpoint)
    return out[:MAX_TARGETS]


def _is_private(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip.split("%", 1)[0]).is_private
    except ValueError:
        return False


def lan_addresses(host: Host) -> list[Multiaddr]:
    """Our private (LAN) listen addresses: what a peer behind our NAT can dial."""
    out = [a for a in host.interface_addresses(include_loopback=False) if a.is_private]
    return out[:MAX_LAN_TARGETS]


def same_nat(theirs: list[tuple[str, int]], ours: list[Multiaddr]) -> bool:
    """Whether a public IP the peer offered is one of ours (we are behind one NAT)."""
    our_ips = {ip for ip, _ in dial_targets(ours)}
    return any(ip in our_ips for ip, _ in theirs)


def parse_connect(
    msg: dict[str, object], ours: list[Multiaddr] | None = None
) -> list[tuple[str, int]]:
    """A DCUtR "connect" (either side): the (host, port) targets to dial: its public
    ones, and first its private ones when it shares a public IP with `ours`."""
    if msg.get("type") != "connect":
        raise ProtocolViolation("dcutr: expected connect")
    public = dial_targets(wire.get_addrs(msg, "addrs"))
    if not ours or "lan" not in msg or not same_nat(public, ours):
        return public
    lan = dial_targets(wire.get_addrs(msg, "lan"))[:MAX_LAN_TARGETS]
    return [*lan, *(t for t in public if t not in lan)]


def parse_sync(msg: dict[str, object]) -> None:
    """The initiator's DCUtR "sync" (the responder dials now)."""
    if msg.get("type") != "sync":
        raise ProtocolViolation("dcutr: expected sync")


def initiator_delay(rtt: float) -> float:
    """How long I waits after sending SYNC: half the round trip, the time SYNC takes to
    reach R, so that both SYNs leave at the same moment."""
    return max(0.0, rtt / 2)


@dataclass(slots=True)
class PunchStats:
    attempts: int = 0
    successes: int = 0
    failures: int = 0
    last_rtt_s: float | None = None
    results: list[dict[str, object]] = field(default_factory=list)  # the last few


class HolePuncher:
    def __init__(
        self,
        host: Host,
        config: NatConfig,
        our_addrs: Callable[[], list[Multiaddr]],
        lan_addrs: Callable[[], list[Multiaddr]] | None = None,
    ) -> None:
        """`our_addrs`: our public addresses (observed, confirmed); `lan_addrs`: our
        private ones (default: the host's private interface addresses)."""
        self.host = host
        self.config = config
        self._our_addrs = our_addrs
        self._lan_addrs = lan_addrs or (lambda: lan_addresses(host))
        self._direct: dict[PeerID, list[asyncio.Future[Connection]]] = {}
        self._remove_listener: Callable[[], None] | None = None
        self._punching: set[PeerID] = set()
        self.stats = PunchStats()

    def start(self) -> None:
        self.host.set_handler(PROTOCOL, self._serve)
        self._remove_listener = self.host.add_connection_listener(self._opened)

    def close(self) -> None:
        self.host.remove_handler(PROTOCOL)
        if self._remove_listener is not None:
            self._remove_listener()

    def _opened(self, conn: Connection) -> None:
        if conn.kind == "relayed":
            return
        for fut in self._direct.pop(conn.remote_peer, []):
            if not fut.done():
                fut.set_result(conn)

    def _direct_connection(self, peer: PeerID) -> Connection | None:
        conn = self.host.connection(peer)
        return conn if conn is not None and conn.kind != "relayed" else None

    # --- initiator -------------------------------------------------------------------------------

    async def punch(self, relayed: Connection) -> bool:
        """Run the exchange as I over `relayed`; True once a direct connection exists."""
        peer = relayed.remote_peer
        if self._direct_connection(peer) is not None:
            return True
        if peer in self._punching:  # one punch per peer at a time: they share our port
            return False
        self._punching.add(peer)
        try:
            return await self._punch(relayed, peer)
        finally:
            self._punching.discard(peer)

    async def _punch(self, relayed: Connection, peer: PeerID) -> bool:
        t_start = time.monotonic()
        try:
            stream = await relayed.open_stream(PROTOCOL)
        except TransportError as e:
            log.debug("hole punch to %s: %s", peer.short(), e)
            return False
        ms = wire.messages(stream)
        success = False
        attempts = 0
        try:
            for attempt in range(1, self.config.punch_attempts + 1):
                ours = self._our_addrs()
                if not dial_targets(ours):
                    log.debug("hole punch to %s: we know no public address", peer.short())
                    break
                async with asyncio.timeout(self.config.punch_stream_timeout):
                    t0 = time.monotonic()
                    await ms.send(self._connect_message(ours))
                    reply = await wire.recv_map(ms, "dcutr connect")
                    rtt = time.monotonic() - t0
                targets = parse_connect(reply, ours)
                if not targets:
                    log.debug("hole punch to %s: it knows no public address", peer.short())
                    break
                await ms.send({"type": "sync"})
                attempts = attempt
                self.stats.attempts += 1
                self.stats.last_rtt_s = rtt
                success = await self._attempt(peer, targets, True, initiator_delay(rtt), rtt)
                if success:
                    break
        except (TransportError, TimeoutError, EOFError) as e:
            log.debug("hole punch to %s aborted: %s", peer.short(), e)
        except BaseException:
            stream.reset("hole punch cancelled")
            raise
        with contextlib.suppress(TransportError):
            await stream.close(discard_input=True)
        self._record(peer, success, attempts, time.monotonic() - t_start)
        return success

    # --- responder -------------------------------------------------------------------------------

    async def _serve(self, stream: Stream) -> None:
        conn = stream.connection
        peer = conn.remote_peer
        if conn.kind != "relayed":
            return  # already direct: nothing to punch
        ms = wire.messages(stream)
        pending: asyncio.Task[bool] | None = None
        try:
            while True:
                try:
                    async with asyncio.timeout(self.config.punch_stream_timeout):
                        msg = await wire.recv_map(ms, "dcutr connect")
                except (EOFError, TimeoutError):  # done, or the initiator went silent
                    break
                ours = self._our_addrs()
                theirs = parse_connect(msg, ours)
                if pending is not None:  # I saw the previous attempt fail
                    pending.cancel()
                    pending = None
                # I's SYN may beat our own: from now on our listener takes it as the punch.
                removers = self._expect(peer, theirs, initiator=False)
                try:
                    await ms.send(self._connect_message(ours))
                    async with asyncio.timeout(self.config.punch_stream_timeout):
                        sync = await wire.recv_map(ms, "dcutr sync")
                    parse_sync(sync)
                except (EOFError, TimeoutError):  # the initiator went silent or away: done
                    for remove in removers:
                        remove()
                    break
                except BaseException:
                    for remove in removers:
                        remove()
                    raise
                pending = asyncio.get_running_loop().create_task(
                    self._attempt(peer, theirs, False, 0.0, 0.0, removers)
                )
            if pending is not None:
                # I closed the stream (done, or gave up): let our last dial finish its
                # handshake rather than abort a connection I may already be using.
                await pending
        finally:
            if pending is not None and not pending.done():
                pending.cancel()

    def _connect_message(self, ours: list[Multiaddr]) -> dict[str, object]:
        msg: dict[str, object] = {"type": "connect", "addrs": [str(a) for a in ours]}
        if lan := self._lan_addrs():
            msg["lan"] = [str(a) for a in lan[:MAX_LAN_TARGETS]]
        return msg

    # --- one attempt -------------------------------------------------------------------------

    async def _attempt(
        self,
        peer: PeerID,
        targets: list[tuple[str, int]],
        initiator: bool,
        delay: float,
        rtt: float,
        removers: list[Callable[[], None]] | None = None,
    ) -> bool:
        loop = asyncio.get_running_loop()
        found: asyncio.Future[Connection] = loop.create_future()
        self._direct.setdefault(peer, []).append(found)
        if removers is None:
            removers = self._expect(peer, targets, initiator)
        dials: list[asyncio.Task[Connection]] = []
        timeout = self.config.punch_timeout
        try:
            if delay:
                await asyncio.sleep(delay)
            if self._direct_connection(peer) is not None:
                return True
            dials = [
                loop.create_task(
                    self.host.dial_from_listen_port(t, peer, initiator=initiator, timeout=timeout)
                )
                for t in targets
            ]
            deadline = loop.time() + timeout
            pending: set[asyncio.Future[object]] = {found, *dials}  # type: ignore[arg-type]
            while not found.done() and loop.time() < deadline:
                _, pending = await asyncio.wait(
                    pending, timeout=deadline - loop.time(), return_when=asyncio.FIRST_COMPLETED
                )
                if pending == {found}:
                    # Our dials failed (a NAT answered with RST, say); the other side's SYN
                    # may still reach our listener: give it a little longer.
                    deadline = min(deadline, loop.time() + max(0.2, 2 * rtt))
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(max(0.0, deadline - loop.time())):
                            await asyncio.shield(found)
                    break
            for d in dials:
                if d.done() and not d.cancelled() and d.exception() is not None:
                    log.debug("punch dial to %s: %s", peer.short(), d.exception())
            return found.done() or self._direct_connection(peer) is not None
        finally:
            for d in dials:
                d.cancel()
            await asyncio.gather(*dials, return_exceptions=True)
            for remove in removers:
                remove()
            waiters = self._direct.get(peer)
            if waiters is not None and found in waiters:
                waiters.remove(found)
                if not waiters:
                    del self._direct[peer]

    def _expect(
        self, peer: PeerID, targets: list[tuple[str, int]], initiator: bool
    ) -> list[Callable[[], None]]:
        """Take inbound connections from the peer's addresses as the punch, in our role:
        from a private address only from its port (the peer dials from its listen port,
        and other peers may share that address: one host, one LAN), from a public one
        from any port (a NAT may map the port)."""
        removers = []
        for ip, port in targets:
            exact = _is_private(ip)
            removers.append(
                self.host.expect_inbound(
                    ip, peer, initiator=initiator, port=port if exact else None
                )
            )
        return removers

    def _record(self, peer: PeerID, success: bool, attempts: int, elapsed: float) -> None:
        if success:
            self.stats.successes += 1
        else:
            self.stats.failures += 1
        self.stats.results.append(
            {
                "peer": str(peer),
                "success": success,
                "attempts": attempts,
                "elapsed_s": round(elapsed, 3),
            }
        )
        del self.stats.results[:-32]
        log.info(
            "hole punch to %s %s after %d attempt(s), %.2fs",
            peer.short(),
            "succeeded" if success else "failed",
            attempts,
            elapsed,
        )
