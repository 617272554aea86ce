"""Tampered code for the end-to-end test of verified sparse rounds (on the PYTHONPATH
of one daemon only): it trains honestly, then sends its pseudo-gradient sign-flipped
(coded with error feedback as an honest peer codes its own). Everything else
(commitments, reveals) is the honest code: the peer commits to the message it sent,
and the audit of its last segment finds that its run gives another one."""

from shoal.averaging import sparse_round

_honest_compress = sparse_round.SparseContribution.compress


def _flipped(self: sparse_round.SparseContribution) -> None:
    self.delta.neg_()
    _honest_compress(self)


sparse_round.SparseContribution.compress = _flipped  # type: ignore[method-assign]
