"""Who owns which elements in a butterfly all-reduce, and how they travel (pure functions).

Every member computes the same `Plan` from the same `Group` and tensor size,
with no communication: part boundaries come from exact rational arithmetic
(`fractions.Fraction`), so no platform or float-rounding difference can make
two members disagree about a boundary. A digest of the plan travels with the
data, so members that disagree anyway (different tensor sizes, codecs or
chunking) find out at once instead of averaging misaligned bytes.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

__all__ = ["MAX_BANDWIDTH_RATIO", "Plan", "partition", "split_even"]

Span = tuple[int, int]  # [start, end) in elements of the flattened vector


# A member's bandwidth counts at most this many times the median member's.
MAX_BANDWIDTH_RATIO = 4


def partition(n_elements: int, bandwidths: Sequence[float]) -> list[Span]:
    """Split [0, n_elements) into one contiguous part per member, sized by bandwidth.

    Part k is ``[floor(N * B_k / B), floor(N * B_{k+1} / B))`` where ``B_k`` is the
    sum of the first k bandwidths and ``B`` their total: parts are proportional,
    adjacent, cover everything, and a member with bandwidth 0 gets an empty part.
    When every bandwidth is 0 the parts are equal (someone has to own the data).

    A bandwidth is its member's claim, and a part's owner alone reduces it and
    writes the result everyone applies: a member that claimed 1e9 owned all of
    every vector. So each counts at most `MAX_BANDWIDTH_RATIO` times the median
    of the non-zero ones (the lower middle one of an even count).
    """
    if not isinstance(n_elements, int) or n_elements < 0:
        raise ValueError(f"element count must be a non-negative int, got {n_elements!r}")
    if not bandwidths:
        raise ValueError("at least one member is needed")
    for b in bandwidths:
        if isinstance(b, bool) or not isinstance(b, int | float) or not math.isfinite(b) or b < 0:
            raise ValueError(f"bandwidths must be finite numbers >= 0, got {b!r}")
    weights = [Fraction(b) for b in bandwidths]
    if not any(weights):
        weights = [Fraction(1)] * len(weights)
    given = sorted(w for w in weights if w)
    cap = MAX_BANDWIDTH_RATIO * given[(len(given) - 1) // 2]
    weights = [min(w, cap) for w in weights]
    total = sum(weights)
    bounds = [0]
    acc = Fraction(0)
    for w in weights[:-1]:
        acc += w
        bounds.append(math.floor(n_elements * acc / total))
    bounds.append(n_elements)
    return [(bounds[k], bounds[k + 1]) for k in range(len(weights))]


def split_even(span: Span, pieces: int) -> list[Span]:
    """Split a span into `pieces` contiguous sub-spans whose sizes differ by at most one."""
    start, end = span
    n = end - start
    return [(start + n * i // pieces, start + n * (i + 1) // pieces) for i in range(pieces)]


@dataclass(frozen=True, slots=True)
class Plan:
    """The transfer schedule of one round, identical on every member.

    Member j owns ``parts[j]``. Between every ordered pair (i, j) there are
    ``streams`` streams; stream s carries sub-span ``lanes(j)[s]`` of part j in
    chunks of at most ``chunk_elements``: i's contribution one way, and the
    averaged result the other way.
    """

    n_elements: int
    parts: tuple[Span, ...]
    streams: int
    chunk_elements: int

    @classmethod
    def build(
        cls, n_elements: int, bandwidths: Sequence[float], *, streams: int, chunk_elements: int
    ) -> Plan:
        if streams < 1 or chunk_elements < 1:
            raise ValueError("streams and chunk_elements must be >= 1")
        return cls(n_elements, tuple(partition(n_elements, bandwidths)), streams, chunk_elements)

    def lanes(self, owner: int) -> list[Span]:
        """The sub-spans of `owner`'s part, one per stream (some may be empty)."""
        return split_even(self.parts[owner], self.streams)

    def chunks(self, lane: Span) -> list[Span]:
        start, end = lane
        step = self.chunk_elements
        return [(a, min(a + step, end)) for a in range(start, end, step)]

    def digest(
        self, round_id: bytes, peers: Sequence[bytes], codec_code: int, extra: bytes = b""
    ) -> bytes:
        """16 bytes that differ whenever two members would not exchange compatible data
        (`extra`: more that must agree, e.g. a reduction other than the mean)."""
        h = hashlib.sha256(b"shoal/allreduce-plan/v1\x00")
        h.update(
            struct.pack(
                ">QIIIi",
                self.n_elements,
                len(self.parts),
                self.streams,
                self.chunk_elements,
                codec_code,
            )
        )
        h.update(round_id)
        for peer, (start, end) in zip(peers, self.parts, strict=True):
            h.update(struct.pack(">HQQ", len(peer), start, end))
            h.update(peer)
        if extra:
            h.update(b"\x00extra" + extra)
        return h.digest()[:16]
