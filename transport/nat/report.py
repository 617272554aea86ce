"""What `NatManager.status` shows of connections and of the reachability verdict."""

from __future__ import annotations

from ..host import Host
from ..identity import PeerID
from .autonat import ReachabilityTracker
from .identify import IdentifyInfo


def connection_kinds(host: Host, peers: dict[PeerID, IdentifyInfo]) -> list[dict[str, object]]:
    """Every open connection: its kind ("direct" | "relayed" | "hole-punched"), the
    relay it goes through, and its byte counters."""
    out = []
    for conn in host.open_connections():
        peer = conn.remote_peer
        out.append(
            {
                "peer": str(peer),
                "kind": conn.kind,
                "primary": host.connection(peer) is conn,
                "relay": str(conn.relay) if conn.relay else None,
                "remote_address": _fmt_addr(conn.remote_address),
                "bytes_sent": conn.bytes_sent,
                "bytes_received": conn.bytes_received,
                "rtt_ms": None if conn.rtt is None else round(conn.rtt * 1000, 3),
                "agent": peers[peer].agent if peer in peers else None,
                # "1.0", "unknown" (software from before versions), None: not yet
                "protocol": host.versions.describe(conn),
            }
        )
    return out


def reachability_detail(tracker: ReachabilityTracker, now: float) -> dict[str, object]:
    """Why we believe what we believe: the dial-back evidence and the last change."""
    return {
        "state": tracker.reachability.value,
        "forced": tracker.forced is not None,
        "reason": tracker.reason,
        "changed_s_ago": None if tracker.changed_at is None else round(now - tracker.changed_at, 1),
        "public_interface": tracker.public_interface,
        "results": [
            {
                "server": str(r.server),
                "outcome": r.kind,
                "addr": str(r.addr) if r.addr else None,
                "age_s": round(now - r.at, 1),
            }
            for r in tracker.results
        ],
    }


def _fmt_addr(addr: tuple[str, int] | None) -> str | None:
    return None if addr is None else f"{addr[0]}:{addr[1]}"
