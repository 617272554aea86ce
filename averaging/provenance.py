"""The provenance of a shared state: chains of commit certificates, and the work of a
lineage computed from them, never declared (sans-I/O).

Two versions of one shared state that went their own ways (a partition, a peer cut
off that stepped alone, a peer that lies) must order the same way on every peer,
and no single peer may decide the order by what it says. So the order comes from
certificates (`certificate`): a version's lineage is the chain of certificates
from the first commit to it, each linked to the one before by `previous`, and
its `Rank` is computed by whoever checks the chain:

- `coop`: the signers summed over the certificates signed by two members or
  more: work that peers other than one vouch for;
- `solo`: the number of certificates only one member signed (a peer that
  committed alone, or a round whose other signatures we have not seen).

A lineage of more `coop` work ranks higher, whatever its `solo` count: a solo
commit adds one member's work, which outranks no round of several, and however
many a peer makes alone (at whatever pace it likes), they never lift its state
above one that a round of other peers committed since. Among lineages of equal
`coop` work, the one with *fewer* solo commits ranks higher: the state closest to
what a round certified. (The reverse rule let one peer that stepped alone just
after a round outrank the round's members until their next round: exactly the
attack this closes.) Lineages that no round of two ever certified (a swarm of
one, or peers that never met) have nothing to check anyone's word against: among
them the one of more commits alone ranks higher, so a peer that trained alone for
hours keeps its work when a peer that trained alone for a minute meets it. What
remains forgeable is said in docs/security.md ("State a stranger serves"): keys are
free, so a peer that runs several identities can sign "rounds" among them, and
before the first round of two, a lone peer's word is all there is.

A `Provenance` keeps the certificates of the chains a peer holds or has checked;
it verifies nothing over the network: drivers (`provenance_sync`) fetch chains
and hand them in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from .certificate import Certificate, CertificateError, commits_of

__all__ = ["GENESIS_RANK", "UNVERIFIED", "ChainError", "Provenance", "Rank"]

# Foreign lineages whose rank we computed (versions other peers declared).
MAX_FOREIGN_RANKS = 512


class ChainError(ValueError):
    """A chain of certificates that does not link, or is not of our key."""


@dataclass(frozen=True, slots=True, order=False)
class Rank:
    """The certified work of a lineage (see the module docstring)."""

    coop: int
    solo: int

    @property
    def order(self) -> tuple[int, int]:
        """Larger ranks higher: more coop work, then fewer solo commits; among
        lineages no round of two ever certified (nothing to check anyone's word
        against yet), more solo commits."""
        return (self.coop, -self.solo) if self.coop > 0 else (0, self.solo)

    def after(self, cert: Certificate) -> Rank:
        """The rank of a lineage extended by `cert`."""
        if cert.signers >= 2:
            return Rank(self.coop + cert.signers, self.solo)
        return Rank(self.coop, self.solo + 1)


GENESIS_RANK = Rank(0, 0)
# The order of a version nobody showed us a valid chain for: below every verified one.
UNVERIFIED: tuple[int, int] = (-1, 0)


class Provenance:
    """Certificates of one key's shared state: our own chain and the chains we
    checked, with the rank of every version they reach."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._certs: dict[bytes, Certificate] = {}
        self._ranks: dict[bytes, Rank] = {}  # memo, cleared when a signature arrives
        self._foreign: OrderedDict[bytes, Rank] = OrderedDict()

    def __len__(self) -> int:
        return len(self._certs)

    def get(self, version: bytes) -> Certificate | None:
        return self._certs.get(version)

    def add(self, cert: Certificate) -> bool:
        """Keep `cert` (or the signatures it adds to the one we have); True when
        anything was new."""
        if cert.statement.key != self.key:
            raise ChainError("a certificate of another key")
        held = self._certs.get(cert.version)
        if held is None:
            self._certs[cert.version] = cert
            self._ranks.clear()
            return True
        if held.merge(cert):
            self._ranks.clear()
            return True
        return False

    def add_signature(self, version: bytes, peer: Any, signature: bytes) -> bool:
        """A member's signature of the certificate of `version`, if we hold that
        certificate and the signature checks."""
        cert = self._certs.get(version)
        if cert is None or not cert.add_signature(peer, signature):
            return False
        self._ranks.clear()
        return True

    def rank(self, version: bytes) -> Rank | None:
        """The certified rank of `version`'s lineage: of the certificates of its chain
        we hold, back to the first commit or to the first version we hold none for
        (history from before certificates, or that nobody showed us: leaving
        certificates out can only lower a lineage's rank). None when we hold no
        certificate of `version` itself."""
        held = self.held_rank(version)
        return held if held is not None else self._foreign.get(version)

    def held_rank(self, version: bytes) -> Rank | None:
        """`rank`, from the certificates we hold alone (not what we remember of
        chains we checked and dropped)."""
        if not version:
            return GENESIS_RANK
        known = self._ranks.get(version)
        if known is not None:
            return known
        path: list[Certificate] = []
        at = version
        base = GENESIS_RANK
        while at:
            if at in self._ranks:
                base = self._ranks[at]
                break
            cert = self._certs.get(at)
            if cert is None:
                if not path:
                    return None
                break  # rooted here: what came before counts for nothing
            path.append(cert)
            at = cert.previous
        for cert in reversed(path):
            base = base.after(cert)
            self._ranks[cert.version] = base
        return base

    def order(self, version: bytes) -> tuple[int, int]:
        """`rank(version).order`, or UNVERIFIED."""
        rank = self.rank(version)
        return UNVERIFIED if rank is None else rank.order

    def chain(
        self, version: bytes, known: Iterable[bytes] = (), limit: int = 256
    ) -> list[Certificate]:
        """The certificates from `version` back (newest first), stopping before a
        version in `known`, at the first commit, or after `limit`."""
        stop = set(known)
        out: list[Certificate] = []
        at = version
        while at and at not in stop and len(out) < limit:
            cert = self._certs.get(at)
            if cert is None:
                break
            out.append(cert)
            at = cert.previous
        return out

    def locator(self, version: bytes, most: int = 16) -> list[bytes]:
        """Versions of `version`'s chain at depths 0, 1, 2, 4, 8, ... (as Bitcoin's
        block locators): what a fetch names as known, so that a holder stops at
        the fork whether it is one commit deep or a thousand."""
        out: list[bytes] = []
        at, depth, next_depth = version, 0, 0
        while at and len(out) < most:
            cert = self._certs.get(at)
            if cert is None:
                break
            if depth == next_depth:
                out.append(at)
                next_depth = max(1, 2 * depth)
            at, depth = cert.previous, depth + 1
        return out

    def check_chain(self, tip: bytes, certs: Sequence[Certificate]) -> Rank:
        """The rank of `tip` given `certs`, its chain newest first down to the first
        commit, to a version whose rank we know, or to where the holder's
        certificates stop (it can only lower its own rank so); ChainError when they
        do not link. Nothing is kept (see `adopt` and `remember`)."""
        return self._walk(tip, certs)[0]

    def _walk(self, tip: bytes, certs: Sequence[Certificate]) -> tuple[Rank, int]:
        at, used = tip, 0
        for cert in certs:
            if self.held_rank(at) is not None:
                break
            if cert.statement.key != self.key:
                raise ChainError("a certificate of another key")
            if cert.version != at:
                raise ChainError(f"the chain breaks at version {at.hex()[-12:]}")
            at, used = cert.previous, used + 1
        base = self.held_rank(at)
        if base is None:
            if not used:
                raise ChainError(f"no certificate of version {tip.hex()[-12:]}")
            base = GENESIS_RANK  # rooted where the certificates shown stop (see `rank`)
        for cert in reversed(certs[:used]):
            base = base.after(cert)
        return base, used

    def adopt(self, tip: bytes, certs: Sequence[Certificate]) -> Rank:
        """Check `certs` as `check_chain` does, then keep them (we now hold `tip`)."""
        rank, used = self._walk(tip, certs)
        for cert in certs[:used]:
            self.add(cert)
        for cert in certs[used:]:  # more signatures of certificates we hold
            if cert.version in self._certs and cert.statement.key == self.key:
                self.add(cert)
        return self.rank(tip) or rank

    def remember(self, version: bytes, rank: Rank) -> None:
        """The rank of a foreign lineage we checked (kept for the most recent few)."""
        self._foreign[version] = rank
        self._foreign.move_to_end(version)
        while len(self._foreign) > MAX_FOREIGN_RANKS:
            self._foreign.popitem(last=False)

    def prune(self, keep: bytes) -> None:
        """Drop every certificate that is not of `keep`'s chain."""
        ours = {c.version: c for c in self.chain(keep, limit=commits_of(keep) + 1)}
        if len(ours) != len(self._certs):
            self._certs = ours
            self._ranks.clear()

    def saved(self, version: bytes) -> str:
        """`version`'s chain, newest first, as a checkpoint keeps it (the hex of its
        msgpack: a checkpoint holds plain data only)."""
        wires = [c.to_wire() for c in self.chain(version, limit=commits_of(version) + 1)]
        packed: bytes = msgpack.packb(wires, use_bin_type=True)
        return packed.hex()

    def load_saved(self, version: bytes, saved: object) -> Rank | None:
        """Take a checkpoint's chain of `version`; its rank, or None when the
        checkpoint holds none (an older release) or a chain that does not check."""
        if not isinstance(saved, str) or not saved:
            return None
        try:
            wires = msgpack.unpackb(bytes.fromhex(saved), raw=False)
            if not isinstance(wires, list):
                return None
            certs = [Certificate.from_wire(w) for w in wires]
            return self.adopt(version, certs)
        except (CertificateError, ChainError, ValueError, msgpack.UnpackException):
            return None
