"""The host's listeners: one server per listen address, on its port shared with
outgoing dials when reuse_port is on."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable, Sequence

from .connection import Connection
from .identity import PeerID
from .interfaces import local_addresses
from .multiaddr import Multiaddr, MultiaddrError, from_socket_address

log = logging.getLogger("shoal.transport")

# Listen failures that mean "this address family is not available here", as
# opposed to a real problem such as a port in use, which is always fatal.
_FAMILY_UNAVAILABLE = {errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT}


class ListenFailed(OSError):
    """A listen address could not be served (other than for a missing family)."""


async def listen(
    addresses: Sequence[str],
    reuse_port: bool,
    accept: Callable[[], Connection],
    servers: list[asyncio.Server],
    bound: list[Multiaddr],
) -> None:
    """A server for each of `addresses`, each connection from `accept()`; appended to
    `servers`, with their bound addresses (ports resolved) to `bound` as they start.
    Raises on the first fatal failure (the servers started so far stay in `servers`)."""
    loop = asyncio.get_running_loop()
    errors = []
    for text in addresses:
        addr = Multiaddr(text)
        endpoint = addr.tcp_endpoint()
        if endpoint is None or addr.is_relayed:
            raise MultiaddrError(f"cannot listen on {text!r}: not a direct TCP address")
        host, port = endpoint
        family = socket.AF_INET6 if addr.family == "ip6" else socket.AF_INET
        try:
            if reuse_port:
                server = await loop.create_server(
                    accept, sock=_reuse_port_listener(family, host, port), backlog=1024
                )
            else:
                server = await loop.create_server(
                    accept, host, port, family=family, reuse_address=True, backlog=1024
                )
        except OSError as e:
            if e.errno in _FAMILY_UNAVAILABLE:
                # e.g. no IPv6 inside a container: serve on the other family.
                errors.append(f"{text}: {e.strerror or e}")
                continue
            raise ListenFailed(e.errno, f"cannot listen on {text}: {e.strerror or e}") from None
        servers.append(server)
        for sock in server.sockets:
            bound_host, bound_port = sock.getsockname()[:2]
            bound.append(from_socket_address(bound_host, bound_port))
    if not servers and addresses:
        raise OSError(f"could not listen on any address: {'; '.join(errors)}")
    for err in errors:
        log.warning("not listening on %s", err)


def interface_addresses(
    listen_addrs: Sequence[Multiaddr], peer_id: PeerID, include_loopback: bool = True
) -> list[Multiaddr]:
    """`listen_addrs` with 0.0.0.0/:: expanded to this machine's interface IPs."""
    out: list[Multiaddr] = []
    for addr in listen_addrs:
        if addr.is_unspecified:
            _, port = addr.tcp_endpoint()  # type: ignore[misc]
            family = "ip6" if addr.family == "ip6" else "ip4"
            for ip in local_addresses(family):
                out.append(from_socket_address(ip, port))
        else:
            out.append(addr)
    if not include_loopback:
        out = [a for a in out if not a.is_loopback]
    unique = list(dict.fromkeys(out))
    return [a.with_peer_id(peer_id) for a in unique]


def _reuse_port_listener(family: int, host: str, port: int) -> socket.socket:
    """A bound listening socket that dialing sockets may share its port with.

    Bound *before* SO_REUSEPORT is set, so that a port already in use (by anyone,
    another shoal included) still fails the bind, as without reuse_port.
    """
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
