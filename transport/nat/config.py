"""NAT traversal knobs, with defaults meant for the real internet."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..version import agent as version_agent


@dataclass(frozen=True, slots=True)
class RelayLimits:
    """What a relay grants (circuit relay v2-like); every limit is enforced by the relay."""

    max_reservations: int = 128  # peers that may hold a reservation at once
    max_reservations_per_ip: int = 8
    reservation_ttl: float = 3600.0  # a reservation expires unless refreshed
    max_circuits: int = 256  # relayed connections through this relay at once
    max_circuits_per_peer: int = 8  # ... per peer, as either end
    # Relayed connections carry training traffic between peers that cannot punch
    # (symmetric NATs), so the per-connection limits are generous; a cut connection
    # is simply redialed through the relay.
    circuit_duration: float = 3600.0
    circuit_bytes: int = 4 << 30  # both directions together
    connect_timeout: float = 5.0  # the target must answer the relay within this


@dataclass(frozen=True, slots=True)
class NatConfig:
    # What identify tells peers, e.g. "shoal/0.1.0 protocol/1.0" (transport/version.py).
    agent: str = field(default_factory=version_agent)
    # identify: an observed address is trusted once this many distinct peers report it
    observed_threshold: int = 2
    observed_ttl: float = 1800.0
    identify_timeout: float = 5.0

    # AutoNAT. "public"/"private" skip detection (e.g. a known port forward, or tests).
    reachability: Literal["auto", "public", "private"] = "auto"
    # One dial-back (TCP connect + handshake). Generous: the peer being dialed may be
    # busy (importing torch, building its model) and answer its handshake late; a
    # timeout is weak evidence anyway (see reachability.py).
    dialback_timeout: float = 4.0
    # Of which the TCP connect may take this long. The kernel answers a SYN however busy
    # the process behind it is, so the connect needs only the round trip (and one lost
    # SYN's retransmission after Linux's initial 1 s RTO, on links up to 250 ms RTT);
    # a NAT dropping the SYN, the usual case, is told within it rather than within the
    # 4 s a busy peer's handshake gets.
    dialback_connect_timeout: float = 1.25
    probe_timeout: float = 20.0  # one whole request, dial-backs included
    # The failure weight (refused 1, timeout 1/2) since the last success that makes
    # PRIVATE; None: 3 with a public interface address, 1/2 behind a NAT. A success is
    # proof (the nonce came back through our listener), so one makes PUBLIC.
    private_score: float | None = None
    probe_window: int = 8  # recent results the decision looks at
    recheck_unknown: float = 2.0  # probe again this soon while the answer is unknown
    recheck_interval: float = 300.0  # and this often once it is known and settled
    autonat_max_concurrent: int = 8  # dial-backs this peer runs for others at once
    autonat_server_min_interval: float = 1.0  # per requesting peer

    # relays
    relay_service: bool = True  # serve as a relay while publicly reachable
    relay_limits: RelayLimits = field(default_factory=RelayLimits)
    max_relays: int = 2  # reservations a private peer keeps
    relay_retry: float = 1.0  # first backoff after a failed reservation (doubles, capped)
    relay_dht_ttl: float = 600.0

    # hole punching (DCUtR-like, TCP simultaneous open)
    hole_punching: bool = True
    punch_attempts: int = 3
    punch_timeout: float = 2.5  # one attempt: long enough for one SYN retransmission
    punch_stream_timeout: float = 10.0  # each message of the exchange over the relay
