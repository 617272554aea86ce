"""Our receipts of recent verified sparse rounds, and the members' signatures of them
(`verification.receipts`: why a chain needs them).

After a commit the verifier signs its receipt of the round and hands the signature to
the round's other members (`hand_out`, over the connections the round used); each
keeps the signatures that verify over its own receipt of that round, which are the
ones a member with the same view of the round's commitments made. A signature that
arrives before our own commit is done is held a while (`PENDING_S`). What a prover
reveals of its previous round's receipt is the `ChainProof` kept here.

Since protocol 2.11 the signature rides on the push of our round's secret to a member
whose hello says 2.11 (`withholding.DirectRecords.push`, its `"receipt"`: `wire`;
taken here by `take`), one call where there were two; `hand_out` is left for the
members that push did not carry it to.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from shoal.transport import rpc
from shoal.transport.errors import TransportError
from shoal.transport.identity import Identity, PeerID
from shoal.verification.receipts import SIGNATURE_BYTES, ChainProof, Receipt

from .recent import RecentRounds

__all__ = ["ReceiptBook"]

log = logging.getLogger("shoal.verifier")

PUSH_TIMEOUT = 5.0
PENDING_S = 30.0  # a signature that came before our receipt was made waits this long
MAX_PENDING = 1024


class ReceiptBook:
    """Our receipts of recent rounds (as `RecentRounds` keeps them) and their signatures."""

    def __init__(
        self, service: rpc.RpcService, identity: Identity, keep: int, retain_s: float
    ) -> None:
        self.identity = identity
        self.protocol = service.protocol
        self._proofs: RecentRounds[ChainProof] = RecentRounds(keep, retain_s)
        self._pending: dict[tuple[int, bytes, PeerID], tuple[bytes, float]] = {}
        self.received = 0  # valid signatures of our receipts, from other members
        service.unary("receipt")(self._on_receipt)

    def sign(self, receipt: Receipt) -> ChainProof:
        """Our receipt of a round we committed, signed (blocking: signs, verifies held
        signatures); kept until it is too old for any audit of the next round."""
        proof = ChainProof(receipt, {self.identity.peer_id: receipt.sign(self.identity)})
        now = time.monotonic()
        for key, (sig, until) in list(self._pending.items()):
            if key[:2] == (receipt.round, receipt.round_id):
                del self._pending[key]
                if until > now:
                    self.received += proof.add(key[2], sig)
        self._proofs.add(receipt.round, proof)
        return proof

    def proof(self, round_index: int) -> ChainProof | None:
        return self._proofs.get(round_index)

    def wire(self, proof: ChainProof) -> list[bytes]:
        """Our signature of `proof`'s receipt as a push carries it: [round ID, signature]
        (the push names the round)."""
        return [proof.receipt.round_id, proof.signatures[self.identity.peer_id]]

    async def hand_out(
        self, host: Any, proof: ChainProof, peers: Sequence[PeerID] | None = None
    ) -> int:
        """Give our signature of `proof`'s receipt to the round's other members (or to
        `peers` of them); how many took it."""
        r = proof.receipt
        payload = {"round": r.round, "round_id": r.round_id,
                   "sig": proof.signatures[self.identity.peer_id]}  # fmt: skip

        async def one(peer: PeerID) -> bool:
            try:
                await rpc.call(host, peer, self.protocol, "receipt", payload, timeout=PUSH_TIMEOUT)
                return True
            except (TransportError, TimeoutError, OSError, ValueError, LookupError) as e:
                log.debug("receipt of round %d not taken by %s: %r", r.round, peer.short(), e)
                return False

        if peers is None:
            peers = [p for p in r.members if p != self.identity.peer_id]
        return sum(await asyncio.gather(*(one(p) for p in peers)))

    async def _on_receipt(self, ctx: rpc.CallContext, payload: Any) -> Any:
        if not isinstance(payload, dict):
            raise ValueError("receipt wants a map")
        round_index = payload.get("round")
        if not isinstance(round_index, int) or isinstance(round_index, bool) or round_index < 0:
            raise ValueError("bad round")
        return self.take(ctx.peer, round_index, [payload.get("round_id"), payload.get("sig")])

    def take(self, peer: PeerID, round_index: int, wire: object) -> dict[str, Any]:
        """`peer`'s signature of its receipt of round `round_index` (`wire`'s form),
        kept if it verifies over ours (or held until ours is made); ValueError when
        it is malformed."""
        if not isinstance(wire, list | tuple) or len(wire) != 2:
            raise ValueError("a receipt is [round ID, signature]")
        round_id, sig = wire
        if not isinstance(round_id, bytes) or not 0 < len(round_id) <= 64:
            raise ValueError("bad round ID")
        if not isinstance(sig, bytes) or len(sig) != SIGNATURE_BYTES:
            raise ValueError("bad signature")
        proof = self._proofs.get(round_index)
        if proof is None or proof.receipt.round_id != round_id:
            self._hold(round_index, round_id, peer, sig)
            return {"held": True}
        added = proof.add(peer, sig)
        self.received += added
        return {"added": added}

    def _hold(self, round_index: int, round_id: bytes, peer: PeerID, sig: bytes) -> None:
        now = time.monotonic()
        self._pending = {k: v for k, v in self._pending.items() if v[1] > now}
        if len(self._pending) < MAX_PENDING:
            self._pending[(round_index, round_id, peer)] = (sig, now + PENDING_S)
