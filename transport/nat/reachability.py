"""Are we reachable? The decision from dial-back results, and when to ask again (sans-I/O).

A dial-back that arrives is proof: the nonce came back through our listener,
so one success makes PUBLIC at once, whatever came before. A failure is only
a hint: a server that could not reach us may have been slow, or we were (a
peer importing torch at start-up misses handshakes for seconds), or its own
network blocks outbound connections. So failures must pile up before we call
ourselves PRIVATE, and they count by kind:

- ``refused`` (the SYN was answered with a reset: nobody listens there) and
  ``error`` (a connection that failed in some other definite way) weigh 1;
- ``timeout`` (no answer: a NAT dropping the SYN, or a loaded peer) weighs 1/2.

PRIVATE needs a failure weight of `private_score` since the last success,
from at least two distinct servers, so one slow moment or one odd server
cannot flip it (behind a NAT, one server suffices when it is the only one).
The bar depends on what we know locally: with an address on a public
interface (no NAT between us and the internet, as on a bootstrap or relay
machine) it is 3; with only private
interface addresses (we are behind a NAT unless a port is forwarded) it is
1/2, a single failed dial-back, so NATed peers look for relays at once.

Until the evidence decides, the state stays UNKNOWN, and a peer with a public
interface keeps serving as a relay meanwhile (`may_serve_relay`).

After a change of state, or an answer that contradicts the current state, the
next probes come soon (2, 4, 8, 16 s), so a wrong conclusion is corrected
within 30 s; once things are stable, every `recheck_interval`.
"""

from __future__ import annotations

import enum
import ipaddress
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from ..connection import Connection
from ..identity import PeerID
from ..multiaddr import Multiaddr

__all__ = [
    "OUTCOME_WEIGHTS",
    "ProbeResult",
    "Reachability",
    "ReachabilityTracker",
    "has_public_interface",
]


class Reachability(enum.StrEnum):
    UNKNOWN = "unknown"
    PUBLIC = "public"
    PRIVATE = "private"


OUTCOME_WEIGHTS = {"ok": 0.0, "refused": 1.0, "error": 1.0, "timeout": 0.5}
PUBLIC_INTERFACE_SCORE = 3.0  # failure weight that makes PRIVATE with a public interface
NAT_INTERFACE_SCORE = 0.5  # ... with private interface addresses only: one timeout
SETTLE_DELAYS = (2.0, 4.0, 8.0, 16.0)  # re-probes after a change (2 + 4 + 8 + 16 = 30 s)

_NON_PUBLIC = tuple(
    ipaddress.ip_network(n)
    for n in (
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",  # carrier-grade NAT
        "127.0.0.0/8",
        "169.254.0.0/16",
        "0.0.0.0/8",
        "::1/128",
        "fc00::/7",
        "fe80::/10",
        "::/128",
    )
)


def has_public_interface(addrs: Iterable[Multiaddr]) -> bool:
    """True when one of our interface addresses is outside the private, shared (CGNAT),
    loopback and link-local ranges: nothing translates between it and the internet."""
    for addr in addrs:
        endpoint = addr.tcp_endpoint()
        if endpoint is None:
            continue
        try:
            ip = ipaddress.ip_address(endpoint[0])
        except ValueError:
            continue
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if not any(ip in net for net in _NON_PUBLIC if net.version == ip.version):
            return True
    return False


@dataclass(frozen=True, slots=True)
class ProbeResult:
    server: PeerID
    addr: Multiaddr | None  # the address that was reached (None for a failure)
    ok: bool
    at: float
    tried: tuple[Multiaddr, ...] = ()
    outcome: str = ""  # "ok", "refused", "timeout" or "error" ("" : derived from ok)

    @property
    def kind(self) -> str:
        if self.outcome in OUTCOME_WEIGHTS:
            return self.outcome
        return "ok" if self.ok else "error"

    def describe(self) -> str:
        return f"{self.server.short()} {self.kind}"


class ReachabilityTracker:
    """Dial-back results in, reachability and the time of the next probe out."""

    def __init__(
        self,
        window: int = 8,
        private_score: float | None = None,
        forced: Reachability | None = None,
        *,
        recheck_interval: float = 300.0,
    ) -> None:
        self._results: deque[ProbeResult] = deque(maxlen=window)
        self.private_score = private_score  # None: from the interfaces, as described above
        self.public_interface = False
        self.forced = forced
        self.recheck_interval = recheck_interval
        self._confirmed: dict[Multiaddr, float] = {}
        self._state = Reachability.UNKNOWN
        self._settle = 0  # index into SETTLE_DELAYS; len() once settled
        self.changed_at: float | None = None
        self.reason = "no dial-back result yet"

    # -- the decision

    @property
    def reachability(self) -> Reachability:
        return self.forced if self.forced is not None else self._state

    @property
    def may_serve_relay(self) -> bool:
        """PUBLIC, or UNKNOWN with a public interface (not refused for being unconfirmed)."""
        state = self.reachability
        return state is Reachability.PUBLIC or (
            state is Reachability.UNKNOWN and self.public_interface
        )

    def _needed(self) -> float:
        if self.private_score is not None:
            return self.private_score
        return PUBLIC_INTERFACE_SCORE if self.public_interface else NAT_INTERFACE_SCORE

    def _failures_since_success(self) -> list[ProbeResult]:
        out: list[ProbeResult] = []
        for r in reversed(self._results):
            if r.ok:
                break
            out.append(r)
        return out

    def _decide(self) -> Reachability:
        failures = self._failures_since_success()
        score = sum(OUTCOME_WEIGHTS[r.kind] for r in failures)
        servers = {r.server for r in failures}
        answered = {r.server for r in self._results}
        # Two servers must agree; behind a NAT, one is enough when it is all there is.
        distinct = 2 if self.public_interface else min(2, len(answered))
        enough = score >= self._needed() and len(servers) >= distinct
        if enough:
            return Reachability.PRIVATE
        return Reachability.PUBLIC if self._confirmed else Reachability.UNKNOWN

    def record(self, result: ProbeResult) -> bool:
        """Add a result; True when the reachability or the confirmed addresses changed."""
        before = (self.reachability, tuple(self.confirmed()))
        previous = self._state
        self._results.append(result)
        if result.ok and result.addr is not None:
            self._confirmed[result.addr] = result.at
        self._state = self._decide()
        if self._state is Reachability.PRIVATE:
            self._confirmed.clear()  # the evidence against them outweighs the old proof
        contradicts = (result.ok and previous is not Reachability.PUBLIC) or (
            not result.ok and previous is Reachability.PUBLIC
        )
        if self._state is not previous:
            self.changed_at = result.at
            self.reason = self._explain()
        if self._state is not previous or contradicts:
            self._settle = 0  # look again soon
        return (self.reachability, tuple(self.confirmed())) != before

    def _explain(self) -> str:
        if self._state is Reachability.PUBLIC:
            last = next(r for r in reversed(self._results) if r.ok)
            return f"{last.server.short()} dialed us back at {last.addr}"
        failures = self._failures_since_success()
        if self._state is Reachability.PRIVATE:
            listed = ", ".join(r.describe() for r in reversed(failures))
            return f"{len(failures)} dial-backs failed since the last success: {listed}"
        return "evidence too thin to decide"

    def evidence(self) -> list[ProbeResult]:
        return list(self._results)

    # -- when to probe again

    def next_delay(self) -> float:
        """Seconds until the next probe, after one just ended."""
        if self.reachability is Reachability.UNKNOWN:
            return SETTLE_DELAYS[0]
        if self._settle < len(SETTLE_DELAYS):
            delay = SETTLE_DELAYS[self._settle]
            self._settle += 1
            return delay
        return self.recheck_interval

    # -- addresses

    def confirmed(self) -> list[Multiaddr]:
        """Addresses a dial-back reached, most recently confirmed first."""
        return sorted(self._confirmed, key=lambda a: -self._confirmed[a])

    def forget(self, keep: Callable[[Multiaddr], bool]) -> bool:
        """Our addresses changed: drop confirmations of addresses no longer ours (the
        caller then probes again). True when that changed anything."""
        before = (self.reachability, tuple(self.confirmed()))
        self._confirmed = {a: t for a, t in self._confirmed.items() if keep(a)}
        self._state = self._decide()
        return (self.reachability, tuple(self.confirmed())) != before

    @property
    def results(self) -> list[ProbeResult]:
        return list(self._results)


def over_lan(conn: Connection, neighbours: Collection[str] = ()) -> bool:
    """A direct connection over our LAN: hole-punched to a peer behind our NAT (at its
    private address), or to a peer we heard on our link (`neighbours`: the IPs mDNS
    announced, `NatManager.heard_on_lan`). What it sees of us, and a dial back over
    it, say nothing of how the internet reaches us (they made peers behind a NAT
    "public" at 10.0.1.2, advertised to everyone), and a relay reached over it is no
    relay for the others. (Not any private address: a Docker network or a private
    cluster stands for the internet of the peers in it.)"""
    if conn.kind == "relayed" or conn.remote_address is None:
        return False
    try:
        ip = ipaddress.ip_address(conn.remote_address[0].split("%", 1)[0])
    except ValueError:
        return False
    if conn.kind == "hole-punched":
        return ip.is_private and not ip.is_loopback
    return not ip.is_loopback and str(ip) in neighbours
