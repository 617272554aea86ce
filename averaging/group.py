"""What matchmaking agrees on and the all-reduce consumes: one averaging group.

A `Group` is identical on every member before any tensor moves: the same
`round_id`, the same members in the same order. The order fixes who owns
which part of the flattened tensors and the order of every reduction, so
that all members end with the same bits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack

from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr

ROUND_ID_BYTES = 32


@dataclass(frozen=True, slots=True)
class Member:
    peer_id: PeerID
    addrs: tuple[Multiaddr, ...] = ()
    # Measured (or declared) upload bandwidth in bytes/s; parts are sized by it.
    # 0 means "do not give me a part" (e.g. reachable only through a relay).
    bandwidth: float = 1.0


@dataclass(frozen=True, slots=True)
class Group:
    key: str  # what is averaged, e.g. "<experiment>/params"
    round_id: bytes  # ROUND_ID_BYTES, unique per group formation
    members: tuple[Member, ...]
    # The state version every member declared (see `Averager`): only peers that
    # hold the same committed state average together.
    state_version: bytes = b""
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if len(self.round_id) != ROUND_ID_BYTES:
            raise ValueError(f"round_id must be {ROUND_ID_BYTES} bytes")
        ids = [m.peer_id for m in self.members]
        if len(set(ids)) != len(ids):
            raise ValueError("a peer is listed twice in the group")

    @property
    def peer_ids(self) -> tuple[PeerID, ...]:
        return tuple(m.peer_id for m in self.members)

    @property
    def size(self) -> int:
        return len(self.members)

    def index(self, peer: PeerID) -> int:
        for i, m in enumerate(self.members):
            if m.peer_id == peer:
                return i
        raise KeyError(f"{peer.short()} is not in group {self.round_id.hex()[:12]}")

    def to_wire(self) -> dict[str, object]:
        return {
            "key": self.key,
            "round": self.round_id,
            "version": self.state_version,
            "members": [
                [m.peer_id.to_bytes(), [str(a) for a in m.addrs], float(m.bandwidth)]
                for m in self.members
            ],
        }

    @classmethod
    def from_wire(cls, obj: object, *, max_members: int = 1024) -> Group:
        """Parse an untrusted group description; raises ValueError."""
        if not isinstance(obj, dict):
            raise ValueError("group must be a map")
        key, round_id, version, raw = (
            obj.get("key"),
            obj.get("round"),
            obj.get("version", b""),
            obj.get("members"),
        )
        if not isinstance(key, str) or not isinstance(round_id, bytes):
            raise ValueError("group key must be str and round bytes")
        if not isinstance(version, bytes) or len(version) > 64:
            raise ValueError("group version must be at most 64 bytes")
        if not isinstance(raw, list) or not 0 < len(raw) <= max_members:
            raise ValueError(f"group must list 1..{max_members} members")
        members = []
        for item in raw:
            if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], bytes)):
                raise ValueError("a member must be [peer_id, [addrs], bandwidth]")
            addrs_raw, bw = item[1], item[2]
            if not isinstance(addrs_raw, list) or len(addrs_raw) > 16:
                raise ValueError("member addresses must be a list of at most 16")
            if isinstance(bw, bool) or not isinstance(bw, int | float) or not 0 <= bw < 1e15:
                raise ValueError("member bandwidth must be a finite number >= 0")
            addrs = tuple(Multiaddr(a) for a in addrs_raw if isinstance(a, str))
            members.append(Member(PeerID(item[0]), addrs, float(bw)))
        return cls(key, round_id, tuple(members), version)


def make_round_id(key: str, members: Sequence[PeerID], nonce: bytes) -> bytes:
    """A round ID bound to the key, the ordered members and a fresh nonce."""
    body = msgpack.packb([key, [p.to_bytes() for p in members], nonce], use_bin_type=True)
    return hashlib.sha256(b"shoal-averaging-round:" + body).digest()
