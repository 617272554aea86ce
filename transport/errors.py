"""Typed transport errors.

Everything that comes off the network is untrusted; when it is wrong it becomes
one of these, naming the peer and the problem, and costs only its own stream or
connection.
"""

from __future__ import annotations


class TransportError(Exception):
    """Base class of every error raised by shoal.transport."""


class ProtocolViolation(TransportError):
    """The remote side broke the wire protocol (bad frame, oversized message, ...)."""


class PayloadTooLarge(ProtocolViolation):
    """The remote side announced more than the receiver expects here (a tensor larger
    than the call's bound): refused before anything was allocated for it or read."""


class StreamTruncated(ProtocolViolation):
    """The stream ended (EOF) in the middle of a read that needed more bytes."""


class HandshakeError(TransportError):
    """The secure handshake failed: bad message, bad signature, wrong peer, timeout."""


class AccessRefused(HandshakeError):
    """The handshake met a peer this host's access rules refuse (transport/access.py);
    `reason` ("swarm_key" or "not_allowed") is what /status counts it under."""

    reason = "access"


class SwarmKeyMismatch(AccessRefused):
    """The remote does not hold our swarm key (it has none, or another)."""

    reason = "swarm_key"


class PeerNotAllowed(AccessRefused):
    """The remote authenticated as a peer ID that is not in our allow list."""

    reason = "not_allowed"


class ConnectionLost(TransportError):
    """The connection closed (or was found dead) before the operation finished."""


class DialError(TransportError):
    """No connection could be made to the peer at any of the given addresses."""


class ClosedAtOnce(DialError):
    """The connection closed before the remote's first stream (its hello): a peer
    alive but closing it (its handshake slots full, its connection limit), since a
    gone one refuses the dial or leaves it unanswered. Worth a second dial."""


class PeerBlocked(DialError):
    """The peer is blocked on this host (`Host.block`): no connection with it either way."""


class PeerIDMismatch(HandshakeError, DialError):
    """The address named one peer ID and the handshake met another."""


class LimitExceeded(TransportError):
    """A configured resource limit refused the operation (connections, streams, sizes)."""


class StreamReset(TransportError):
    """The stream was reset by either side; `reason` says why when known."""

    def __init__(self, reason: str = "stream reset") -> None:
        super().__init__(reason)
        self.reason = reason


class StreamClosed(TransportError):
    """Write after the local side half-closed the stream."""


class ProtocolNotSupported(StreamReset):
    """The remote peer has no handler for the protocol named at stream open."""


class RpcError(TransportError):
    """Base class of errors surfaced by RPC calls."""


class RemoteError(RpcError):
    """The remote handler raised; `kind` is the remote exception's class name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}" if message else kind)
        self.kind = kind
        self.message = message


class RpcTimeout(RpcError, TimeoutError):
    """The call's deadline passed before the response arrived."""


class UnknownMethod(RemoteError):
    """The remote protocol handler does not know the method."""


class RelayError(TransportError):
    """Base class of circuit relay errors (reservations, relayed connections)."""


class ReservationRefused(RelayError):
    """The relay refused (or dropped) a reservation: limit reached, not public, expired."""


class RelayConnectRefused(RelayError, DialError):
    """The relay would not open a relayed connection to the target (no reservation, limits)."""


class RelayLimitExceeded(RelayError, ConnectionLost):
    """The relay cut a relayed connection that exceeded its byte or duration limit."""
