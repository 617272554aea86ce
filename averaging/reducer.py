"""The owner's side of one lane of its part: which chunk can be reduced now, and how.

`LaneReducer` is a sans-I/O state machine. Senders attach with a weight,
contribution chunks arrive (in order per sender, into a ring of `window`
slots), and it says which chunk is next to reduce and with which members and
weights, in member order, so the result never depends on arrival order. The
driver (`lanes.DataPlane`) moves the bytes, runs the reduction and tells it
when a chunk is done; a result chunk may go out once reduced, and a slot may
take a sender's next chunk once the chunk it held is reduced.

The reduction itself is pluggable (`Reduction`): a weighted mean today,
CenteredClip (`verification.robust`) for Byzantine-robust averaging. Only the
owner of a part computes it and everyone receives the owner's bytes, so any
deterministic reduction keeps the members' results bit-identical.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shoal.verification.robust import capped_weights, centered_clip

from .compression import Codec, CodecError
from .partition import Span
from .round_errors import Veto

__all__ = [
    "ALL_REDUCTIONS",
    "NOTHING_TO_AVERAGE",
    "REDUCTIONS",
    "BitwiseUnion",
    "CenteredClip",
    "ChunkJob",
    "Input",
    "LaneReducer",
    "Reduction",
    "WeightedMean",
    "make_reduction",
    "reduce_chunk",
]

# The veto of a group whose members all contribute weight 0 (peers that just loaded the
# state, catching up): the same group would only veto again.
NOTHING_TO_AVERAGE = "the total weight of the group is zero"

# One member's contribution to a chunk: our own float32 input, another member's
# float32 slot (uncompressed), or its checked encoded bytes (with a codec).
Input = torch.Tensor | memoryview
_REDUCE_PIECE = 1 << 18  # elements summed at a time in float64 (2 MiB: stays in cache)


@dataclass(frozen=True, slots=True)
class ChunkJob:
    """Reduce chunk `index` (elements `span`) from these members, in this order."""

    index: int
    span: Span
    order: tuple[tuple[int, float], ...]  # (member, weight / total weight)


class LaneReducer:
    """Bookkeeping of one lane of our part: attachments, arrivals, reductions."""

    def __init__(
        self,
        me: int,
        chunks: list[Span],
        senders: list[int],
        window: int,
        weight: float,
        owner_written: bool = False,
        caps_weights: bool = False,
    ) -> None:
        self.me = me
        # The reduction's `owner_written`: the others attach (with their weights) but
        # send nothing, and our part is our own input alone.
        self.owner_written = owner_written
        self.caps_weights = caps_weights  # (the reduction's `caps_weights`)
        self.chunks = chunks
        self.senders = senders
        self.window = window
        self.weights: dict[int, float] = {me: float(weight)}
        self._arrived = dict.fromkeys(senders, 0)  # per sender: chunks received
        self.reduced = 0  # chunks whose result is final (they are reduced in order)
        self._order: tuple[tuple[int, float], ...] | None = None

    def attach(self, sender: int, weight: float) -> str | None:
        """A sender's stream arrived with its weight; returns a problem, or None."""
        known = self.weights.setdefault(sender, float(weight))
        if known != float(weight):
            return "inconsistent weight"
        return None

    @property
    def attached_all(self) -> bool:
        return all(i in self.weights for i in self.senders)

    def contributes(self, sender: int) -> bool:
        """Does `sender` stream data into this lane (not just its weight)?"""
        return not self.owner_written and self.weights.get(sender, 0.0) > 0

    def slot(self, chunk: int) -> int:
        return chunk % self.window

    def slot_free_after(self, chunk: int) -> int:
        """Chunk `chunk` may be received once this many chunks are reduced."""
        return chunk - self.window + 1

    def arrived(self, sender: int, chunk: int) -> None:
        if chunk != self._arrived[sender] or chunk >= self.reduced + self.window:
            raise AssertionError(f"chunk {chunk} of member {sender} out of turn")
        self._arrived[sender] = chunk + 1

    def next_job(self) -> ChunkJob | None:
        """The next chunk to reduce, once every contribution to it is here; else None.
        Raises Veto when the group's weights cannot be averaged."""
        if self.reduced >= len(self.chunks) or not self.attached_all:
            return None
        order = self._member_order()
        c = self.reduced
        if any(i != self.me and self._arrived[i] <= c for i, _ in order):
            return None
        return ChunkJob(c, self.chunks[c], order)

    def finished(self, chunk: int) -> None:
        assert chunk == self.reduced
        self.reduced += 1

    @property
    def complete(self) -> bool:
        return self.reduced >= len(self.chunks)

    def _member_order(self) -> tuple[tuple[int, float], ...]:
        if self._order is None:
            members = sorted(self.weights)
            weights = [self.weights[i] for i in members]
            if self.caps_weights:
                weights = capped_weights(weights)
            total = math.fsum(weights)
            if total <= 0:
                raise Veto(NOTHING_TO_AVERAGE)
            if self.owner_written:
                self._order = ((self.me, 1.0),)
                return self._order
            self._order = tuple(
                (i, w / total) for i, w in zip(members, weights, strict=True) if w > 0
            )
        return self._order


class Reduction:
    """How the owner turns a chunk's contributions into its result.

    `reduce` writes the float32 result into `out`; inputs come in member order
    with normalized weights. `acc` is a float64 scratch buffer (uncompressed
    rounds only). The result must be a deterministic function of the inputs.
    """

    name = "?"
    # True: every member's input is zero outside its own part of an equal split (member j
    # writes part j alone), so no contribution travels to another owner and an owner's
    # result is its own input reduced alone: a round sends G - 1 parts per member, the
    # all-gather half of a butterfly.
    owner_written = False
    # True: each member's weight counts at most `WEIGHT_OVER_MEDIAN` times the median
    # member's (`verification.robust.capped_weights`): a robust reduction's bound on a
    # contribution's pull means little if its claimed weight drowns the others.
    caps_weights = False

    def reduce(
        self,
        inputs: Sequence[tuple[Input, float]],
        out: torch.Tensor,
        codec: Codec,
        acc: torch.Tensor | None,
    ) -> None:
        raise NotImplementedError


class WeightedMean(Reduction):
    """sum_i w_i x_i. Uncompressed: float64 accumulation in pieces that stay in cache,
    rounded once to float32 (the error stays near half an ulp of the mean). With a
    lossy codec, whose error dwarfs float32 rounding, the sum is built in `out` directly
    (cheaper), decoding each member's bytes straight into it."""

    name = "mean"

    def reduce(
        self,
        inputs: Sequence[tuple[Input, float]],
        out: torch.Tensor,
        codec: Codec,
        acc: torch.Tensor | None,
    ) -> None:
        if acc is None:
            for k, (x, wx) in enumerate(inputs):
                if isinstance(x, torch.Tensor):
                    codec.add_plain(x, out, wx, overwrite=k == 0)
                else:
                    codec.add_decoded(x, out, wx, overwrite=k == 0)
            return
        first, w = inputs[0]
        assert isinstance(first, torch.Tensor)
        step = len(acc)
        for start in range(0, len(out), step):
            stop = min(start + step, len(out))
            part = acc[: stop - start]
            part.copy_(first[start:stop])
            if w != 1.0:
                part.mul_(w)
            for x, wx in inputs[1:]:
                assert isinstance(x, torch.Tensor)
                part.add_(x[start:stop], alpha=wx)
            out[start:stop].copy_(part)


class CenteredClip(Reduction):
    """Byzantine-robust: each contribution's pull on the result is bounded (the
    CenteredClip iteration of `verification.robust`, per chunk)."""

    name = "centered_clip"
    caps_weights = True

    def __init__(self, iterations: int = 20) -> None:
        self.iterations = iterations

    def reduce(
        self,
        inputs: Sequence[tuple[Input, float]],
        out: torch.Tensor,
        codec: Codec,
        acc: torch.Tensor | None,
    ) -> None:
        values = []
        for x, _ in inputs:
            if isinstance(x, torch.Tensor):
                values.append(x)
            else:
                plain = torch.empty(len(out), dtype=torch.float32)
                codec.decode_checked(x, plain)
                values.append(plain)
        weights = [w for _, w in inputs]
        out.copy_(centered_clip(values, weights, iterations=self.iterations))


class BitwiseUnion(Reduction):
    """Not an average: the bitwise OR of the contributions' 32-bit words. For rounds
    that move opaque bytes (`sparse_gather`): every member writes only its own slot
    of the vector, which is its own part of the round (`owner_written`: the parts are
    equal, one slot each), and leaves the rest zero. So nothing but an owner's own
    words travels, and the result is every member's slot exactly as its author wrote
    it: what a member writes outside its slot never leaves it. Weights do not enter it."""

    name = "union"
    owner_written = True

    def reduce(
        self,
        inputs: Sequence[tuple[Input, float]],
        out: torch.Tensor,
        codec: Codec,
        acc: torch.Tensor | None,
    ) -> None:
        words = out.view(torch.int32)
        words.zero_()
        for x, _ in inputs:
            if not isinstance(x, torch.Tensor):
                raise Veto("a union round moves raw words (codec none)")
            words.bitwise_or_(x.view(torch.int32))


def reduce_chunk(
    reduction: Reduction,
    codec: Codec,
    inputs: Sequence[tuple[Input, float]],
    out: torch.Tensor,
    acc: torch.Tensor | None,
    encoded: memoryview | None,
) -> None:
    """Reduce one chunk into `out`; with a codec, encode it into `encoded` (only the
    owner computes a part, so how it rounds needs only to be deterministic; like
    everyone else, the owner decodes those bytes on commit)."""
    reduction.reduce(inputs, out, codec, acc)
    if encoded is not None:
        try:
            codec.encode(out, encoded)
        except CodecError as e:
            raise Veto(f"codec error: {e}") from None


# What a manifest may choose (`options.REDUCTION_NAMES`) ...
REDUCTIONS: dict[str, type[Reduction]] = {"mean": WeightedMean, "centered_clip": CenteredClip}
# ... and what strategies also use internally.
# `union_clip_capped` moves the same bytes as `union`; its own name in the plan keeps
# members that clip the messages' norms and cap their weights when they decode them
# (`sparse_gather`) apart from members that do not, which would commit other bits from
# the same slots. (`union_clip`, which clipped norms alone, is retired: its members
# would commit other bits than these from a slot that claims a large weight.)
ALL_REDUCTIONS: dict[str, type[Reduction]] = {
    **REDUCTIONS,
    "union": BitwiseUnion,
    "union_clip_capped": BitwiseUnion,
    # (the same, for members that take the senders' mean: `sparse_gather`)
    "union_senders": BitwiseUnion,
    "union_clip_capped_senders": BitwiseUnion,
}


def make_reduction(name: str) -> Reduction:
    try:
        return ALL_REDUCTIONS[name]()
    except KeyError:
        raise ValueError(f"unknown reduction {name!r} (one of {sorted(ALL_REDUCTIONS)})") from None


def float64_scratch(chunk_elements: int) -> int:
    """Elements of the float64 accumulator an uncompressed reduction needs."""
    return min(chunk_elements, _REDUCE_PIECE)
