"""What `shoal doctor` concludes from what it measured (sans-I/O: facts in, verdicts out).

Each check gives a verdict ("ok", "warn", "fail"), a line of detail and, when
something is wrong, what to do. The peer can take part when at least one
bootstrap peer answered; everything else only makes it better or worse at it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Check", "Facts", "diagnose", "nat_mapping"]

CLOCK_SKEW_LIMIT_S = 30.0
LOW_DISK_BYTES = 1 << 30


@dataclass(frozen=True)
class Check:
    name: str
    verdict: str  # "ok", "warn", "fail" or "skip" (could not be checked)
    detail: str
    advice: str = ""

    def as_json(self) -> dict[str, str]:
        return {
            "check": self.name,
            "verdict": self.verdict,
            "detail": self.detail,
            "advice": self.advice,
        }


@dataclass
class Facts:
    bootstrap: list[tuple[str, str | None]] = field(default_factory=list)  # (addr, error)
    observed: list[tuple[str, str]] = field(default_factory=list)  # (observer IP, our addr)
    reachability: str = "unknown"
    reachability_reason: str = ""
    relays: list[str] = field(default_factory=list)
    clock_skews_s: list[float] = field(default_factory=list)
    free_disk_bytes: int | None = None
    data_dir: str = ""
    # Why a file could not be written, fsynced and removed in the data directory (None: it
    # could): a read-only or full file system stops checkpoints.
    unwritable: str | None = None
    torch: str | None = None
    threads: int | None = None
    device: str | None = None
    # Hole punches tried to NATed peers: (peer, None when it punched, else why not).
    punches: list[tuple[str, str | None]] = field(default_factory=list)
    # Private swarms: AccessControl.status() (mode, fingerprint, ...), and the bootstrap
    # peers our allow list does not name (we would refuse them).
    access: dict[str, Any] = field(default_factory=dict)
    unlisted_bootstrap: list[str] = field(default_factory=list)


def nat_mapping(observed: list[tuple[str, str]]) -> str:
    """ "consistent" when observers at different IPs see us at the same address (a cone
    NAT, or none: hole punching can work), "per-destination" when they see different
    ports (a symmetric NAT: only a relay gets through), "unknown" with fewer than two."""
    by_ip: dict[str, str] = {}
    for observer_ip, addr in observed:
        by_ip.setdefault(observer_ip, addr)
    if len(by_ip) < 2:
        return "unknown"
    return "consistent" if len(set(by_ip.values())) == 1 else "per-destination"


def diagnose(f: Facts) -> list[Check]:
    bootstrap = _bootstrap(f)
    if bootstrap.verdict == "fail":
        # Nobody to ask: say so once, not as three more warnings.
        network = [
            Check(name, "skip", "not checked: no peer answered")
            for name in ("reachability", "hole punch", "relays", "clock")
        ]
    else:
        network = [_reachability(f), _hole_punch(f), _relays(f), _clock(f)]
    return [bootstrap, _access(f), *network, _disk(f), _torch(f)]


def can_take_part(checks: list[Check]) -> bool:
    return all(c.verdict != "fail" for c in checks)


def _bootstrap(f: Facts) -> Check:
    reached = [a for a, e in f.bootstrap if e is None]
    if not f.bootstrap:
        return Check(
            "bootstrap", "fail", "no bootstrap peer given",
            "give --bootstrap ADDR: any peer of the network (its `shoal run` prints it)",
        )  # fmt: skip
    if not reached:
        why = "; ".join(f"{a}: {e}" for a, e in f.bootstrap)
        access = _access_refusal(f, [e or "" for _, e in f.bootstrap], why)
        if access is not None:
            return access
        if all(e is not None and "IncompatibleProtocol" in e for _, e in f.bootstrap):
            # (the error itself names both versions and which side must upgrade)
            return Check(
                "bootstrap", "fail", f"the bootstrap peers speak another protocol ({why})",
                "upgrade whichever side the error names (pip install -U shoal)",
            )  # fmt: skip
        return Check(
            "bootstrap", "fail", f"no bootstrap peer answered ({why})",
            "check the address (a typo, an old port?), that the peer runs, and that no "
            "firewall blocks the way out",
        )  # fmt: skip
    failed = len(f.bootstrap) - len(reached)
    extra = f"; {failed} did not answer" if failed else ""
    return Check("bootstrap", "ok", f"reached {len(reached)} of {len(f.bootstrap)}{extra}")


def _access_refusal(f: Facts, errors: list[str], why: str) -> Check | None:
    """The bootstrap check when access rules explain why no bootstrap peer answered."""
    keyed = f.access.get("swarm_key_fingerprint") is not None
    if all("swarm key" in e for e in errors):
        return Check(
            "bootstrap", "fail",
            "the bootstrap peers refused our handshake: the swarm key probably differs "
            f"({why})" if keyed else f"the bootstrap peers use a swarm key, we have none ({why})",
            "give every peer the same key file with --swarm-key FILE (compare /status "
            "access.swarm_key_fingerprint on both sides)",
        )  # fmt: skip
    if all("not in the allow list" in e for e in errors):
        return Check(
            "bootstrap", "fail", f"our --allow-peers list does not name them ({why})",
            "add the bootstrap peers' IDs to the --allow-peers file",
        )  # fmt: skip
    if not keyed and all("closed by peer" in e and "handshake" in e for e in errors):
        return Check(
            "bootstrap", "fail",
            f"the bootstrap peers closed the handshake at once ({why})",
            "a private swarm? run with its --swarm-key FILE",
        )  # fmt: skip
    if all("closed at once" in e for e in errors):
        return Check(
            "bootstrap", "fail",
            f"the bootstrap peers closed the connection right after the handshake ({why})",
            "a private swarm with an allow list? ask its members to add this peer's ID "
            "(`shoal id`) to their --allow-peers file",
        )  # fmt: skip
    return None


def _access(f: Facts) -> Check:
    mode = f.access.get("mode", "open")
    if mode == "open":
        return Check("access", "ok", "open swarm: no --swarm-key, no --allow-peers")
    parts = []
    if f.access.get("swarm_key_fingerprint"):
        parts.append(f"swarm key {f.access['swarm_key_fingerprint']} (fingerprint)")
    if f.access.get("allowed_peers") is not None:
        parts.append(f"allow list of {f.access['allowed_peers']} peer IDs")
    detail = "private swarm: " + "; ".join(parts)
    if f.unlisted_bootstrap:
        return Check(
            "access", "warn",
            f"{detail}; bootstrap peers not in it: {', '.join(f.unlisted_bootstrap)}",
            "the allow list is strict: list bootstrap peers and relays too, or they are refused",
        )  # fmt: skip
    return Check("access", "ok", detail)


def _reachability(f: Facts) -> Check:
    mapping = nat_mapping(f.observed)
    seen = ", ".join(sorted({a for _, a in f.observed})) or "nobody reported it yet"
    if f.reachability == "public":
        return Check("reachability", "ok", f"public: other peers can dial you ({seen})")
    if f.reachability == "private":
        if mapping == "per-destination":
            return Check(
                "reachability", "warn",
                f"private, relay needed: your NAT gives each destination its own port ({seen})",
                "training works through relays, slower; forward a port to this machine and "
                "run with --announce /ip4/PUBLIC_IP/tcp/PORT to be dialable",
            )  # fmt: skip
        possible = "possible" if mapping == "consistent" else "likely possible"
        return Check(
            "reachability", "ok",
            f"private, hole punching {possible}: your NAT keeps one port for all "
            f"destinations ({seen})" if mapping == "consistent" else
            f"private, hole punching {possible} ({seen})",
        )  # fmt: skip
    return Check(
        "reachability", "warn", f"not known yet: {f.reachability_reason or 'no answer'}",
        "run it again in a minute: it takes a dial-back by another peer",
    )  # fmt: skip


def _hole_punch(f: Facts) -> Check:
    if f.reachability != "private":
        return Check("hole punch", "ok", "not needed: others dial you directly")
    if not f.punches:
        return Check(
            "hole punch", "skip",
            "not tried: no NATed peer found in the network's experiments to punch to",
        )  # fmt: skip
    worked = [peer for peer, why in f.punches if why is None]
    if worked:
        return Check("hole punch", "ok", f"a direct connection to {worked[0]} (a NATed peer)")
    why = "; ".join(f"{peer}: {reason}" for peer, reason in f.punches)
    return Check(
        "hole punch", "warn", f"failed ({why})",
        "peers behind NAT reach you through relays only (slower); a port forward to "
        "this machine with --announce /ip4/PUBLIC_IP/tcp/PORT makes you directly dialable",
    )  # fmt: skip


def _relays(f: Facts) -> Check:
    if f.relays:
        return Check("relays", "ok", "reserved: " + ", ".join(f.relays))
    if f.reachability == "private":
        return Check(
            "relays", "warn", "none reserved yet",
            "peers behind NAT need a public peer that relays: is one in the network?",
        )  # fmt: skip
    return Check("relays", "ok", "none needed")


def _clock(f: Facts) -> Check:
    if not f.clock_skews_s:
        return Check("clock", "warn", "no peer told its time", "")
    skew = sorted(f.clock_skews_s)[len(f.clock_skews_s) // 2]
    if abs(skew) > CLOCK_SKEW_LIMIT_S:
        return Check(
            "clock", "warn", f"this clock is {skew:+.0f}s off the peers'",
            "enable time synchronization (NTP, e.g. systemd-timesyncd): DHT records "
            "expire by the clock",
        )  # fmt: skip
    return Check("clock", "ok", f"within {abs(skew):.1f}s of the peers'")


def _disk(f: Facts) -> Check:
    if f.unwritable is not None:
        return Check(
            "disk", "fail", f"cannot write in {f.data_dir}: {f.unwritable}",
            "checkpoints are written there: make it writable (a read-only mount, "
            "permissions, a full disk), or choose another --data-dir",
        )  # fmt: skip
    if f.free_disk_bytes is None:
        return Check("disk", "warn", f"cannot tell the free space in {f.data_dir}")
    gib = f.free_disk_bytes / 2**30
    if f.free_disk_bytes < LOW_DISK_BYTES:
        return Check(
            "disk", "warn", f"{gib:.2f} GiB free in {f.data_dir}",
            "checkpoints need room: free some, or choose another --data-dir",
        )  # fmt: skip
    return Check("disk", "ok", f"{gib:.1f} GiB free in {f.data_dir}")


def _torch(f: Facts) -> Check:
    if f.torch is None:
        return Check("torch", "fail", "torch is not installed", "pip install torch (README)")
    return Check("torch", "ok", f"torch {f.torch}, {f.threads} CPU threads, device {f.device}")


def as_text(checks: list[Check]) -> str:
    marks = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "skip": "--  "}
    lines = []
    for c in checks:
        lines.append(f"{marks[c.verdict]}  {c.name:<12} {c.detail}")
        if c.advice:
            lines.append(f"      {'':<12} -> {c.advice}")
    return "\n".join(lines) + "\n"


def as_json(checks: list[Check]) -> list[dict[str, Any]]:
    return [c.as_json() for c in checks]
