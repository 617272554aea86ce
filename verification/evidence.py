"""Verdicts and convictions that anyone checks offline, from signatures alone.

A referee's `Verdict` is signed: which commitment, which segment, the hash of
what the prover revealed, the result and the measurements behind it. An
`Evidence` bundle convicts a prover. It holds the prover's signed commitment,
every commitment and every revealed secret of the round (so that anyone
recomputes who the referees were, `referees.RoundDraw`; a bundle missing a
secret proves nothing, or its assembler could pick the seed by leaving
secrets out), and the referees' verdicts, at least two of which accuse the
prover and more than half of the referees. `Evidence.check()` returns the
convicted peer or raises `EvidenceError`; nothing in a bundle is trusted
until then.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import msgpack

from shoal.transport.identity import Identity, PeerID

from .commitment import HASH_BYTES, Commitment, CommitmentError
from .referees import SECRET_BYTES, RoundDraw

__all__ = ["REFEREES", "Evidence", "EvidenceError", "Result", "Verdict", "convicting"]

REFEREES = 3  # the auditor and two more for a dispute
MIN_ACCUSERS = 2  # never convicted on the word of one peer
MAX_ROUND_MEMBERS = 256
MAX_EVIDENCE_BYTES = 1 << 20
_VERDICT_TAG = b"shoal/verdict/1\0"


class EvidenceError(ValueError):
    """A verdict or evidence bundle that does not decode or does not prove what it says."""


class Result(enum.StrEnum):
    PASS = "pass"
    FAIL = "fail"  # the recomputation disagrees (angle or norm test)
    BAD_REVEAL = "bad_reveal"  # no reveal in time, or one that does not match the commitment


@dataclass(frozen=True)
class Verdict:
    """One referee's signed finding on one commitment."""

    verifier: PeerID
    commitment: bytes  # Commitment.digest()
    segment: int
    revealed: bytes  # hash of the revealed end state; b"" when nothing valid was revealed
    result: Result
    flips: int = 0
    bits: int = 0
    norm_gap: float = 0.0
    signature: bytes = field(default=b"", compare=False)

    @property
    def accuses(self) -> bool:
        return self.result is not Result.PASS

    def body(self) -> bytes:
        return msgpack.packb(
            [
                self.verifier.to_bytes(),
                self.commitment,
                self.segment,
                self.revealed,
                str(self.result),
                self.flips,
                self.bits,
                float(self.norm_gap),
            ],
            use_bin_type=True,
        )

    def signed(self, identity: Identity) -> Verdict:
        if identity.peer_id != self.verifier:
            raise EvidenceError("only the verifier signs its verdict")
        return replace(self, signature=identity.sign(_VERDICT_TAG + self.body()))

    def verifies(self) -> bool:
        return self.verifier.verify(self.signature, _VERDICT_TAG + self.body())

    def to_wire(self) -> list[bytes]:
        return [self.body(), self.signature]

    @classmethod
    def from_wire(cls, obj: object) -> Verdict:
        """A verdict from `to_wire`; EvidenceError unless well formed and signed."""
        try:
            body, signature = obj  # type: ignore[misc]
            (verifier, commitment, segment, revealed, result, flips, bits, gap) = msgpack.unpackb(
                body, raw=False
            )
            verdict = cls(
                PeerID(verifier), commitment, segment, revealed, Result(result),
                flips, bits, gap, signature,
            )  # fmt: skip
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as e:
            raise EvidenceError(f"malformed verdict: {e}") from None
        ok = (
            isinstance(commitment, bytes)
            and len(commitment) == HASH_BYTES
            and isinstance(revealed, bytes)
            and len(revealed) in (0, HASH_BYTES)
            and all(isinstance(x, int) and x >= 0 for x in (segment, flips, bits))
            and isinstance(gap, float)
            and isinstance(signature, bytes)
        )
        if not ok or verdict.body() != body:
            raise EvidenceError("malformed verdict")
        if not verdict.verifies():
            raise EvidenceError("the verdict's signature does not verify")
        return verdict


def convicting(verdicts: Sequence[Verdict], referees: int) -> bool:
    """Whether these verdicts (one per referee) convict: at least `MIN_ACCUSERS`
    accusations, and more than half of the `referees`."""
    accusers = sum(1 for v in verdicts if v.accuses)
    return accusers >= MIN_ACCUSERS and 2 * accusers > referees


@dataclass(frozen=True)
class Evidence:
    """A conviction of `commitment.prover` (module docstring)."""

    commitment: Commitment
    round_commitments: tuple[Commitment, ...]  # every member's, the prover's included
    secrets: tuple[tuple[PeerID, bytes], ...]  # the secrets revealed in the round
    verdicts: tuple[Verdict, ...]

    @property
    def prover(self) -> PeerID:
        return self.commitment.prover

    def check(self) -> PeerID:
        """The convicted peer, once everything checks; EvidenceError otherwise."""
        digest = self.commitment.digest()
        if digest not in {c.digest() for c in self.round_commitments}:
            raise EvidenceError("the commitment is not one of the round's")
        if not all(c.verifies() for c in self.round_commitments):
            raise EvidenceError("a commitment's signature does not verify")
        try:
            draw = RoundDraw.from_reveals(self.round_commitments, dict(self.secrets))
        except ValueError as e:
            raise EvidenceError(str(e)) from None
        if draw.withheld:
            # Otherwise whoever assembles a bundle could choose which secrets to
            # leave out, and so choose among 2^n seeds the one that makes its
            # friends the referees.
            raise EvidenceError("a member's secret is missing or wrong: the draw is not provable")
        referees = draw.referees(self.prover, REFEREES)
        segment = draw.segment(self.prover, self.commitment.segments)
        seen: set[PeerID] = set()
        for v in self.verdicts:
            if v.verifier not in referees or v.verifier in seen:
                raise EvidenceError(f"{v.verifier.short()} is not a referee of this commitment")
            seen.add(v.verifier)
            if v.commitment != digest or v.segment != segment:
                raise EvidenceError("a verdict is about another commitment or segment")
            if not v.verifies():
                raise EvidenceError("a verdict's signature does not verify")
        if not convicting(self.verdicts, len(referees)):
            raise EvidenceError(
                f"{sum(v.accuses for v in self.verdicts)} of {len(referees)} referees "
                "accuse: not a conviction"
            )
        return self.prover

    def encode(self) -> bytes:
        return msgpack.packb(
            [
                self.commitment.encode(),
                [c.encode() for c in self.round_commitments],
                [[p.to_bytes(), s] for p, s in self.secrets],
                [v.to_wire() for v in self.verdicts],
            ],
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, data: bytes) -> Evidence:
        """A bundle from `encode`'s bytes (signatures checked; call `check` for the rest)."""
        if len(data) > MAX_EVIDENCE_BYTES:
            raise EvidenceError("evidence too large")
        try:
            raw, commitments, secrets, verdicts = msgpack.unpackb(
                data, raw=False, max_array_len=MAX_ROUND_MEMBERS
            )
            pairs = tuple((PeerID(p), s) for p, s in secrets)
            if not all(isinstance(s, bytes) and len(s) == SECRET_BYTES for _, s in pairs):
                raise EvidenceError("malformed secret")
            return cls(
                Commitment.decode(raw),
                tuple(Commitment.decode(c) for c in commitments),
                pairs,
                tuple(Verdict.from_wire(v) for v in verdicts),
            )
        except EvidenceError:
            raise
        except CommitmentError as e:
            raise EvidenceError(str(e)) from None
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as e:
            raise EvidenceError(f"malformed evidence: {e}") from None
