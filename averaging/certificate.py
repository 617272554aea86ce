"""Commit certificates: the members of a round sign what their commit made, so that
anyone can check which peers vouch for a version of a shared state.

A version of a shared state is a commit count and a hash chain of round IDs
(`averager._chained_version`). After a commit, each member signs a `Statement`:
the averaged key, the version it left (`previous`), the round's ID, the version
it holds now and that state's fingerprint, and the round's members. The
signatures of one statement make its `Certificate`. The statement is
self-checking: the version must be the chain link of `previous` and the round ID,
so a certificate cannot be moved to another version, and a state is accepted
only when its bytes hash to the certified fingerprint, so it cannot be moved to
other bytes either.

What a certificate is worth (`Certificate.signers`) is the number of distinct
members whose signature checks: nobody can raise it but the members themselves.
A peer that commits alone signs alone, and its certificate is worth one
member's work (see `provenance` for how chains of them rank).

Everything here is a pure function of bytes: decoding bounds every field before
anything is allocated or verified.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from shoal.transport.identity import PeerID

__all__ = [
    "CERT_FORMAT",
    "MAX_MEMBERS",
    "Certificate",
    "CertificateError",
    "Statement",
    "chained_version",
    "commits_of",
]

CERT_FORMAT = 1
# Groups are at most a few dozen peers (target_group_size 64 at most).
MAX_MEMBERS = 256
MAX_KEY_BYTES = 512
MAX_ROUND_ID_BYTES = 64
MAX_FINGERPRINT_CHARS = 128
MAX_PEER_ID_BYTES = 64
SIGNATURE_BYTES = 64
VERSION_BYTES = 16  # a chained version: commit count (8) and a link hash (8)
_DOMAIN = b"shoal/commit-certificate/1\0"


class CertificateError(ValueError):
    """A certificate or statement that is malformed, or does not hold together."""


def commits_of(version: bytes) -> int:
    """The commit count a version starts with (0 for the empty version)."""
    return int.from_bytes(version[:8], "big") if len(version) >= 8 else 0


def chained_version(commits: int, previous: bytes, round_id: bytes) -> bytes:
    """The version after a commit of a shared state: the commit count (so versions
    order by progress) and a hash of the previous version and the round's ID."""
    link = hashlib.sha256(b"shoal/state-version\0" + previous + b"\0" + round_id).digest()
    return commits.to_bytes(8, "big") + link[:8]


@dataclass(frozen=True, slots=True)
class Statement:
    """What every member of a committed round signs."""

    key: str
    previous: bytes  # the version the round started from (b"" before the first commit)
    round_id: bytes
    version: bytes  # chained_version(commits_of(previous) + 1, previous, round_id)
    fingerprint: str  # of the state the commit made (`fingerprint.state_fingerprint`)
    members: tuple[PeerID, ...]  # sorted, distinct

    def __post_init__(self) -> None:
        if len(self.key.encode()) > MAX_KEY_BYTES:
            raise CertificateError("key too long")
        if not 0 < len(self.round_id) <= MAX_ROUND_ID_BYTES:
            raise CertificateError("bad round ID")
        if not 0 < len(self.fingerprint) <= MAX_FINGERPRINT_CHARS:
            raise CertificateError("bad fingerprint")
        if not 0 < len(self.members) <= MAX_MEMBERS:
            raise CertificateError("a round has 1 to 256 members")
        if list(self.members) != sorted(set(self.members)):
            raise CertificateError("members must be sorted and distinct")
        if self.previous and len(self.previous) != VERSION_BYTES:
            raise CertificateError("previous is not a chained version")
        expected = chained_version(commits_of(self.previous) + 1, self.previous, self.round_id)
        if self.version != expected:
            raise CertificateError("version is not the link of previous and the round")

    @classmethod
    def of_round(
        cls,
        key: str,
        previous: bytes,
        round_id: bytes,
        fingerprint: str,
        members: Iterable[PeerID],
    ) -> Statement:
        version = chained_version(commits_of(previous) + 1, previous, round_id)
        return cls(key, previous, round_id, version, fingerprint, tuple(sorted(set(members))))

    def signed_bytes(self) -> bytes:
        """The canonical bytes every member signs (domain-separated)."""
        body: bytes = msgpack.packb(self._fields(), use_bin_type=True)
        return _DOMAIN + body

    def _fields(self) -> list[Any]:
        return [
            CERT_FORMAT,
            self.key,
            self.previous,
            self.round_id,
            self.version,
            self.fingerprint,
            [m.to_bytes() for m in self.members],
        ]

    @property
    def commits(self) -> int:
        return commits_of(self.version)


@dataclass(slots=True)
class Certificate:
    """A statement and the members' signatures of it found so far (only valid
    signatures of members are ever kept)."""

    statement: Statement
    signatures: dict[PeerID, bytes] = field(default_factory=dict)

    @property
    def version(self) -> bytes:
        return self.statement.version

    @property
    def previous(self) -> bytes:
        return self.statement.previous

    @property
    def signers(self) -> int:
        """How many members vouch for the commit: its work."""
        return len(self.signatures)

    def add_signature(self, peer: PeerID, signature: bytes) -> bool:
        """Keep `signature` if it is `peer`'s valid signature and `peer` is a member;
        True when it added one."""
        if peer in self.signatures or peer not in self.statement.members:
            return False
        if len(signature) != SIGNATURE_BYTES:
            return False
        if not peer.verify(signature, self.statement.signed_bytes()):
            return False
        self.signatures[peer] = bytes(signature)
        return True

    def merge(self, other: Certificate) -> int:
        """Take `other`'s signatures of the same statement; how many were new."""
        if other.statement != self.statement:
            return 0
        return sum(self.add_signature(p, s) for p, s in other.signatures.items())

    def to_wire(self) -> list[Any]:
        return [
            *self.statement._fields(),
            [[p.to_bytes(), s] for p, s in sorted(self.signatures.items())],
        ]

    @classmethod
    def from_wire(cls, obj: object) -> Certificate:
        """Decode and check a certificate from untrusted input: the statement must
        hold together, and only valid member signatures are kept (a certificate
        with none is refused)."""
        if not isinstance(obj, list | tuple) or len(obj) != 8:
            raise CertificateError("a certificate is a list of 8")
        fmt, key, previous, round_id, version, fingerprint, members, sigs = obj
        if fmt != CERT_FORMAT:
            raise CertificateError(f"unknown certificate format {fmt!r}")
        if not (isinstance(key, str) and isinstance(fingerprint, str)):
            raise CertificateError("key and fingerprint must be strings")
        for name, b in (("previous", previous), ("round_id", round_id), ("version", version)):
            if not isinstance(b, bytes) or len(b) > MAX_ROUND_ID_BYTES:
                raise CertificateError(f"bad {name}")
        if not isinstance(members, list | tuple) or not 0 < len(members) <= MAX_MEMBERS:
            raise CertificateError("bad members")
        if not isinstance(sigs, list | tuple) or not 0 < len(sigs) <= len(members):
            raise CertificateError("bad signatures")
        statement = Statement(
            key, previous, round_id, version, fingerprint, tuple(_peer(m) for m in members)
        )
        cert = cls(statement)
        for item in sigs:
            if not (isinstance(item, list | tuple) and len(item) == 2):
                raise CertificateError("bad signature entry")
            if isinstance(item[1], bytes):
                cert.add_signature(_peer(item[0]), item[1])
        if not cert.signatures:
            raise CertificateError("no valid signature of a member")
        return cert


def _peer(obj: object) -> PeerID:
    if not isinstance(obj, bytes) or not 0 < len(obj) <= MAX_PEER_ID_BYTES:
        raise CertificateError("bad peer ID")
    try:
        return PeerID(obj)
    except ValueError as e:
        raise CertificateError(f"bad peer ID: {e}") from None
