"""Tampered code for the end-to-end verification test (on the PYTHONPATH of one
daemon only): a referee that fails every prover it audits, honest or not, without
looking at its work. It trains honestly."""

from shoal.peer.verify import referee
from shoal.verification.evidence import Result, Verdict


async def _always_fail(self, rnd, prover):  # type: ignore[no-untyped-def]
    c = rnd.commitments[prover]
    segment = rnd.draw.segment(prover, c.segments)
    self.counts["audits_done"] += 1
    self.counts["audits_failed"] += 1
    return Verdict(self.me, c.digest(), segment, b"", Result.FAIL).signed(self.identity)


referee.Referee.audit = _always_fail  # type: ignore[method-assign]
