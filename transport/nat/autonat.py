"""AutoNAT: are we reachable from the internet? Ask peers to dial us back.

Protocol ``/shoal/autonat/1.0.0`` (client -> server, on a direct connection)::

    -> {"nonce": 16 bytes, "addrs": [addr]}
    <- {"status": "ok", "addr": addr}
       | {"status": "failed", "error": str, "reason": "refused" | "timeout" | "error"}
       | {"status": "refused", "error": str}

(`reason` says how the dial-backs failed: a reset is strong evidence that
nobody listens there, a timeout is weak: a NAT drops the SYN, or the client
was too busy to finish the handshake in time. Servers before it sent none.)

The server dials back only addresses whose IP is the one it sees the client's
connection coming from, so nobody can aim its dials at a third party. It dials
from an ephemeral port (a dial from its listen port would ride the client's
existing NAT mapping and prove nothing) with a throwaway identity (so the
dial-back is not mistaken for a second connection between the two peers),
opens ``/shoal/autonat/dialback/1.0.0`` and sends the nonce::

    -> {"nonce": 16 bytes, "addr": addr}    <- {"ok": bool}

The throwaway identity is derived from the nonce (`probe_identity`): only the
client and the server know the nonce, so a client with an allow list
(transport/access.py) admits that one peer ID for the length of its request,
and nobody else can use it. The dial-back carries the swarm key like any
connection of the host.

The client counts a success only when the nonce came back through its own
listener: a server's word alone proves nothing. `reachability.ReachabilityTracker`
turns results into PUBLIC / PRIVATE / UNKNOWN without any I/O.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import os

from ..connection import Connection, ConnectionConfig, Stream
from ..errors import ProtocolViolation, TransportError
from ..host import Host
from ..identity import Identity, PeerID
from ..multiaddr import Multiaddr
from . import wire
from .config import NatConfig
from .reachability import ProbeResult, Reachability, ReachabilityTracker

__all__ = [
    "AutoNAT",
    "ProbeResult",
    "Reachability",
    "ReachabilityTracker",
    "dial_failure_kind",
    "parse_dialback",
    "parse_probe_reply",
    "parse_request",
    "probe_identity",
]

log = logging.getLogger("shoal.transport.nat")

PROTOCOL = "/shoal/autonat/1.0.0"
DIALBACK_PROTOCOL = "/shoal/autonat/dialback/1.0.0"
NONCE_LEN = 16
MAX_DIALBACKS_PER_REQUEST = 4


def dial_failure_kind(e: BaseException) -> str:
    """How a dial-back failed: "refused" (reset: nobody listens), "timeout", or "error"."""
    if isinstance(e, ConnectionRefusedError):
        return "refused"
    if isinstance(e, TimeoutError):
        return "timeout"
    return "error"


def parse_request(req: dict[str, object]) -> tuple[bytes, list[Multiaddr]]:
    """An AutoNAT request (the server side): its nonce and the addresses to dial back."""
    nonce = wire.get_bytes(req, "nonce", 64)
    if len(nonce) < NONCE_LEN:
        raise ProtocolViolation("autonat: nonce too short")
    return nonce, wire.get_addrs(req, "addrs")


def probe_identity(nonce: bytes) -> Identity:
    """The identity a server dials back with for the request carrying `nonce`."""
    return Identity.from_seed(hashlib.sha256(b"shoal-autonat-probe:" + nonce).digest())


def parse_dialback(msg: dict[str, object]) -> tuple[bytes, Multiaddr | None]:
    """A dial-back (the client side): its nonce, and the address it reached if well formed."""
    nonce = wire.get_bytes(msg, "nonce", 64)
    addr = wire.get_addrs({"a": [msg.get("addr")]}, "a")
    return nonce, addr[0] if addr else None


def parse_probe_reply(reply: dict[str, object]) -> tuple[str, str]:
    """The server's answer to a probe: its status, and for "failed" how the dial failed
    (a server that does not say: counted as the weak kind, "timeout")."""
    status = wire.get_str(reply, "status", 16)
    reason = reply.get("reason")
    outcome = reason if reason in ("refused", "timeout", "error") else "timeout"
    return status, str(outcome)


def _same_ip(addr: Multiaddr, ip: str) -> bool:
    endpoint = addr.tcp_endpoint()
    if endpoint is None:
        return False
    try:
        return ipaddress.ip_address(endpoint[0]) == ipaddress.ip_address(ip)
    except ValueError:
        return False  # a DNS name: never dialed back (it could point anywhere)


class AutoNAT:
    """Both sides of AutoNAT for one host: serves dial-backs, and probes servers."""

    def __init__(self, host: Host, config: NatConfig) -> None:
        self.host = host
        self.config = config
        self._nonces: dict[bytes, asyncio.Future[Multiaddr | None]] = {}
        self._slots = asyncio.Semaphore(config.autonat_max_concurrent)
        self._last_request: dict[PeerID, float] = {}
        self._dialback_conns: set[Connection] = set()
        self._serving: set[asyncio.Task[object]] = set()  # our handlers, cancelled on close
        self.served = {"ok": 0, "failed": 0, "refused": 0, "timeout": 0}

    def start(self) -> None:
        self.host.set_handler(PROTOCOL, self._serve)
        self.host.set_handler(DIALBACK_PROTOCOL, self._serve_dialback)
        self.host.versions.without_hello.add(DIALBACK_PROTOCOL)  # (a throwaway identity's)

    def close(self) -> None:
        self.host.remove_handler(PROTOCOL)
        self.host.remove_handler(DIALBACK_PROTOCOL)
        for task in list(self._serving):
            task.cancel()  # a dial-back may be waiting for a SYN that never gets answered
        for conn in list(self._dialback_conns):
            conn.abort("shutting down")
        for fut in self._nonces.values():
            if not fut.done():
                fut.set_result(None)

    # --- client --------------------------------------------------------------------------------

    async def probe(self, conn: Connection, addrs: list[Multiaddr]) -> ProbeResult | None:
        """Ask the peer of `conn` to dial us back at `addrs`; None when it would not try."""
        loop = asyncio.get_running_loop()
        nonce = os.urandom(NONCE_LEN)
        reached: asyncio.Future[Multiaddr | None] = loop.create_future()
        self._nonces[nonce] = reached
        server = conn.remote_peer
        addrs = list(dict.fromkeys(a.without_peer_id() for a in addrs))[: wire.MAX_ADDRS]
        stream: Stream | None = None
        release_probe = None
        if self.host.access.restricts_peers:
            release_probe = self.host.access.admit_for_now(probe_identity(nonce).peer_id)
        try:
            async with asyncio.timeout(self.config.probe_timeout):
                stream = await conn.open_stream(PROTOCOL)
                ms = wire.messages(stream)
                await ms.send({"nonce": nonce, "addrs": [str(a) for a in addrs]})
                await stream.close()
                reply = await wire.recv_map(ms, "autonat reply")
                stream = None
            status, outcome = parse_probe_reply(reply)
            now = loop.time()
            if status == "ok":
                if not reached.done() or reached.result() is None:
                    log.info("autonat: %s claims a dial-back that never arrived", server.short())
                    return None
                return ProbeResult(server, reached.result(), True, now, tuple(addrs), "ok")
            if status == "failed":
                if reached.done() and reached.result() is not None:
                    # The nonce did arrive (the server gave up waiting for our ack): it worked.
                    return ProbeResult(server, reached.result(), True, now, tuple(addrs), "ok")
                log.debug("autonat: %s could not dial us back: %s", server.short(), reply)
                return ProbeResult(server, None, False, now, tuple(addrs), outcome)
            log.debug("autonat: %s refused: %s", server.short(), reply.get("error"))
            return None
        except (TransportError, TimeoutError, EOFError) as e:
            log.debug("autonat probe via %s failed: %s", server.short(), e)
            return None
        finally:
            del self._nonces[nonce]
            if release_probe is not None:
                release_probe()
            if stream is not None:  # cancelled or failed before the reply: release it
                stream.reset("autonat probe abandoned")

    async def _serve_dialback(self, stream: Stream) -> None:
        ms = wire.messages(stream)
        async with asyncio.timeout(self.config.dialback_timeout * 2):
            msg = await wire.recv_map(ms, "dial-back")
            nonce, addr = parse_dialback(msg)
            fut = self._nonces.get(nonce)
            ok = fut is not None
            if fut is not None and not fut.done():
                fut.set_result(addr)
            await ms.send({"ok": ok})

    # --- server --------------------------------------------------------------------------------

    async def _serve(self, stream: Stream) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._serving.add(task)
        try:
            await self._serve_request(stream)
        except TimeoutError:
            # The request outlived `probe_timeout` (a client slow to ask, dial-backs
            # that hang, this process paused): the client times out too and tries
            # elsewhere. Normal on the internet, not a handler failure.
            self.served["timeout"] += 1
            log.debug("autonat request from %s ran out of time", stream.remote_peer.short())
            stream.reset("timeout")
        finally:
            self._serving.discard(task)

    async def _serve_request(self, stream: Stream) -> None:
        conn = stream.connection
        peer = conn.remote_peer
        ms = wire.messages(stream)
        async with asyncio.timeout(self.config.probe_timeout):
            req = await wire.recv_map(ms, "autonat request")
            nonce, addrs = parse_request(req)
            refusal = self._refusal(conn)
            if refusal is not None:
                self.served["refused"] += 1
                await ms.send({"status": "refused", "error": refusal})
                return
            assert conn.remote_address is not None
            ip = conn.remote_address[0]
            # Only the IP we see the request come from: no dialing third parties.
            targets = [a for a in addrs if _same_ip(a, ip)][:MAX_DIALBACKS_PER_REQUEST]
            if not targets:
                self.served["refused"] += 1
                await ms.send(
                    {"status": "refused", "error": f"no address at your observed IP {ip}"}
                )
                return
            async with self._slots:
                reached, errors, kinds = await self._dial_all(targets, peer, nonce)
            if reached is not None:
                self.served["ok"] += 1
                await ms.send({"status": "ok", "addr": str(reached)})
                return
            self.served["failed"] += 1
            # The strongest evidence among the targets: refused > error > timeout.
            reason = next((k for k in ("refused", "error") if k in kinds), "timeout")
            await ms.send({"status": "failed", "error": "; ".join(errors)[:1000], "reason": reason})

    async def _dial_all(
        self, targets: list[Multiaddr], peer: PeerID, nonce: bytes
    ) -> tuple[Multiaddr | None, list[str], list[str]]:
        """Dial every target at once (the answer comes within one dial-back timeout, not
        one per address); the first that reaches the peer, or why none did."""
        tasks = {asyncio.ensure_future(self._dial_back(t, peer, nonce)): t for t in targets}
        errors: list[str] = []
        kinds: list[str] = []
        try:
            for done in asyncio.as_completed(list(tasks)):
                try:
                    target = await done
                except (OSError, TransportError, TimeoutError, EOFError) as e:
                    errors.append(f"{type(e).__name__}: {e}")
                    kinds.append(dial_failure_kind(e))
                    continue
                return target, errors, kinds
            return None, errors, kinds
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _refusal(self, conn: Connection) -> str | None:
        if conn.kind == "relayed" or conn.remote_address is None:
            return "dial-back needs a direct connection (your IP is unknown through a relay)"
        now = asyncio.get_running_loop().time()
        last = self._last_request.get(conn.remote_peer)
        if last is not None and now - last < self.config.autonat_server_min_interval:
            return "too many requests"
        if len(self._last_request) > 4096:  # bounded: forget old entries
            cutoff = now - self.config.autonat_server_min_interval
            self._last_request = {p: t for p, t in self._last_request.items() if t > cutoff}
        self._last_request[conn.remote_peer] = now
        if self._slots.locked():
            return "busy"
        return None

    async def _dial_back(self, addr: Multiaddr, peer: PeerID, nonce: bytes) -> Multiaddr:
        endpoint = addr.tcp_endpoint()
        assert endpoint is not None
        loop = asyncio.get_running_loop()
        timeout = self.config.dialback_timeout
        conn = Connection(
            probe_identity(nonce),
            initiator=True,
            expected_peer=peer,
            config=ConnectionConfig(handshake_timeout=timeout, idle_timeout=0),
            access=self.host.access,
        )
        self._dialback_conns.add(conn)
        try:
            async with asyncio.timeout(timeout):
                # Two deadlines: the connect's (the kernel's part, short) and the whole
                # dial-back's (the handshake waits on the peer's process, generous).
                async with asyncio.timeout(min(timeout, self.config.dialback_connect_timeout)):
                    await loop.create_connection(lambda: conn, *endpoint)
                await asyncio.shield(conn.handshake_done)
                stream = await conn.open_stream(DIALBACK_PROTOCOL)
                ms = wire.messages(stream)
                await ms.send({"nonce": nonce, "addr": str(addr)})
                await stream.close()
                reply = await wire.recv_map(ms, "dial-back ack")
                if reply.get("ok") is not True:
                    raise ProtocolViolation("the peer at that address did not know our nonce")
            return addr
        finally:
            self._dialback_conns.discard(conn)
            conn.abort("dial-back done")
