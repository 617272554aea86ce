"""Moving commit certificates between peers: members hand each other their signatures
after a commit, and a peer fetches the chain of a version from a peer that holds it.

Served on the state-sync protocol, beside the state itself (`state_sync`):

- ``signature`` (unary): ``{"version": bytes, "sig": bytes}``, a member's
  signature of the certificate of a round it committed with us. Taken only as
  the caller's own signature, and only for a statement we signed too (one that
  arrives before we have frozen our own commit waits a little, bounded);
- ``chain`` (unary): ``{"version": bytes, "known": [bytes, ...], "limit": int}``
  answers ``{"certs": [...], "more": bool}``: the certificates of `version`'s
  chain, newest first, back to the first commit or to a version the caller says
  it knows, at most `limit` (bounded) per call; a caller pages further back by
  asking for the oldest one's previous version.

A fetched chain is only ever a claim: `Provenance.check_chain` links it, and
every certificate keeps only signatures that check.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from shoal.transport import rpc
from shoal.transport.errors import TransportError
from shoal.transport.identity import PeerID

from .certificate import MAX_ROUND_ID_BYTES, SIGNATURE_BYTES, Certificate, CertificateError
from .provenance import ChainError, Provenance, Rank

log = logging.getLogger("shoal.averaging.provenance")

CHAIN_PAGE = 256  # certificates per `chain` answer (a few hundred KB at most)
MAX_KNOWN = 16  # versions a caller may name as known
# A chain longer than this is not fetched (a week of one commit every 10 s).
MAX_CHAIN = 65536
PENDING_S = 30.0  # how long a signature that came before our own commit waits
MAX_PENDING = 256
PUSH_TIMEOUT = 5.0


class ProvenanceService:
    """Serves our certificates and takes the signatures round members push to us."""

    def __init__(self, service: rpc.RpcService, book: Provenance) -> None:
        self.book = book
        self._pending: dict[tuple[bytes, PeerID], tuple[bytes, float]] = {}
        self.signatures_received = 0
        self.chains_served = 0
        service.unary("signature")(self._on_signature)
        service.unary("chain")(self._on_chain)

    async def _on_signature(self, ctx: rpc.CallContext, payload: Any) -> Any:
        if not isinstance(payload, dict):
            raise ValueError("signature wants a map")
        version, sig = payload.get("version"), payload.get("sig")
        if not isinstance(version, bytes) or len(version) > MAX_ROUND_ID_BYTES:
            raise ValueError("bad version")
        if not isinstance(sig, bytes) or len(sig) != SIGNATURE_BYTES:
            raise ValueError("bad signature")
        if self.book.get(version) is None:
            self._hold(version, ctx.peer, sig)
            return {"held": True}
        added = self.book.add_signature(version, ctx.peer, sig)
        self.signatures_received += added
        return {"added": added}

    def _hold(self, version: bytes, peer: PeerID, sig: bytes) -> None:
        now = time.monotonic()
        self._pending = {k: v for k, v in self._pending.items() if v[1] > now}
        if len(self._pending) < MAX_PENDING:
            self._pending[(version, peer)] = (sig, now + PENDING_S)

    def take_pending(self, version: bytes) -> int:
        """Signatures of `version` that came before we certified it ourselves."""
        added = 0
        for (v, peer), (sig, _) in list(self._pending.items()):
            if v == version:
                del self._pending[(v, peer)]
                added += self.book.add_signature(version, peer, sig)
        self.signatures_received += added
        return added

    async def _on_chain(self, ctx: rpc.CallContext, payload: Any) -> Any:
        if not isinstance(payload, dict):
            raise ValueError("chain wants a map")
        version, known = payload.get("version"), payload.get("known", [])
        limit = payload.get("limit")
        if not isinstance(version, bytes) or len(version) > MAX_ROUND_ID_BYTES:
            raise ValueError("bad version")
        if not isinstance(known, list) or len(known) > MAX_KNOWN:
            raise ValueError("bad known versions")
        limit = limit if isinstance(limit, int) and 0 < limit <= CHAIN_PAGE else CHAIN_PAGE
        certs = self.book.chain(version, [k for k in known if isinstance(k, bytes)], limit + 1)
        if not certs:
            raise LookupError(f"no certificate of version {version.hex()[-12:]}")
        self.chains_served += 1
        return {"certs": [c.to_wire() for c in certs[:limit]], "more": len(certs) > limit}


async def push_signature(
    host: Any, protocol: str, members: Sequence[PeerID], version: bytes, sig: bytes
) -> int:
    """Hand our signature of `version`'s certificate to the round's other members
    (over the connections the round used); how many took it."""

    async def one(peer: PeerID) -> bool:
        try:
            await rpc.call(
                host, peer, protocol, "signature", {"version": version, "sig": sig},
                timeout=PUSH_TIMEOUT,
            )  # fmt: skip
            return True
        except (TransportError, TimeoutError, OSError, ValueError, LookupError) as e:
            log.debug("signature for %s not taken by %s: %r", version.hex()[-12:], peer.short(), e)
            return False

    others = [p for p in members if p != host.peer_id]
    return sum(await asyncio.gather(*(one(p) for p in others)))


async def fetch_chain(
    host: Any,
    peer: PeerID,
    protocol: str,
    book: Provenance,
    version: bytes,
    *,
    known: Sequence[bytes] = (),
    timeout: float = 30.0,
) -> tuple[Rank, list[Certificate]]:
    """`version`'s chain from `peer`, checked against `book` (which keeps nothing):
    its rank and certificates. Raises ChainError (or a transport error) when
    `peer` does not give a chain that links to what we know."""
    certs: list[Certificate] = []
    at = version
    async with asyncio.timeout(timeout):
        while True:
            answer = await rpc.call(
                host, peer, protocol, "chain",
                {"version": at, "known": list(known)[:MAX_KNOWN], "limit": CHAIN_PAGE},
                timeout=timeout,
            )  # fmt: skip
            page = _page(answer)
            certs.extend(page)
            at = page[-1].previous
            if not at or book.held_rank(at) is not None or at in known:
                break
            if not answer.get("more") or len(certs) >= MAX_CHAIN:
                break
    return book.check_chain(version, certs), certs


def _page(answer: object) -> list[Certificate]:
    if not isinstance(answer, dict) or not isinstance(answer.get("certs"), list):
        raise ChainError("a chain answer is a map with certs")
    wires = answer["certs"]
    if not 0 < len(wires) <= CHAIN_PAGE:
        raise ChainError("a chain page holds 1 to 256 certificates")
    try:
        return [Certificate.from_wire(w) for w in wires]
    except CertificateError as e:
        raise ChainError(f"a bad certificate: {e}") from None
