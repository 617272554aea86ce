"""What each member says it received of a round's results, so that none commits bits
the others do not hold (sans-IO, blocking: hashes the whole average).

A part's owner reduces it alone and sends its result to every member. An honest
owner encodes it once and sends everyone the same bytes; a Byzantine one could
send each member other values, and every member would commit, each with other
bits. So in rounds that defend against Byzantine members, a READY vote carries,
per part, a digest of its result as it came to the voter (our own part as we send
it), and member 0 commits only if every READY member's digests agree
(`Votes.split_parts`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from .buffers import bytes_of
from .commit import RESULT_DIGEST
from .partition import Plan

__all__ = ["result_digests"]


def result_digests(
    plan: Plan, result: torch.Tensor, encoded: Sequence[tuple[int, int, memoryview]] | None
) -> bytes:
    """`RESULT_DIGEST` bytes per part, in member order: of the part's result chunks in
    order, as received (`encoded`: the coded chunks, (start, end, bytes), with a codec;
    None: the raw float32 `result`)."""
    chunks = sorted(encoded or (), key=lambda c: c[0])
    out = bytearray()
    i = 0
    for start, end in plan.parts:
        h = hashlib.sha256()  # (SHA extensions: 2.6x blake2b's rate here)
        if encoded is None:
            h.update(bytes_of(result[start:end]))  # (its chunks' bytes, in order)
        while i < len(chunks) and chunks[i][0] < end:
            if chunks[i][0] >= start:
                h.update(chunks[i][2])
            i += 1
        out += h.digest()[:RESULT_DIGEST]
    return bytes(out)
