"""The all-gather of sparse contributions, over the butterfly's exact commits.

Sparse messages with different indices cannot be summed part by part the way a
butterfly sums dense ones (a partial sum is neither sparse nor low-bit). So a
round moves the messages themselves: the vector averaged is one slot per group
member (in the group's order), each member writes its weight and its message in
its own slot and zeros elsewhere, and the owners reduce with the bitwise union
(`reducer.BitwiseUnion`). The union is owner-written: the round's parts are the
slots, so slot j is member j's part and only its owner ever sends it (the zeros
the others hold there never travel, and what a member writes outside its own
slot never leaves it). On commit every member holds the same slots, bit for
bit, and `mean_into` turns them into the weighted mean with one pure function:
slot by slot in group order, each message checked (`SparseCodec.check`) and
added with its share of the total weight. Each slot is signed by its author
(over the round, the slot, the weight and the message), which binds a message
to the member and round it was sent in: a slot that is empty, malformed, signed
for another round or slot, or claims an impossible weight is skipped, by every
member alike. With the robust reduction (`centered_clip` in the
options) each message is clipped to the median message norm before it is added
(`verification.robust.norm_clip_scales`: why norms, not CenteredClip's centre)
and each weight capped at twice the median weight (`capped_weights`), and the
round's plan is named `union_clip_capped`, so that members that clip never average
with members that do not (nor with stop-57 peers, which clipped norms alone).
With the senders' mean (`codec_mean = "senders"`) each coordinate is divided by the
weight of the members whose message sent it, not by all of theirs, and the plan's
name ends in `_senders`, for the same reason. A
member that leaves mid-round aborts the round as in any butterfly (every member
still opens its stream to every owner, with no data).

Slot layout: weight (float64, little-endian), the author's Ed25519 signature
(64 bytes), the message; zero-padded to whole float32 words.

On the wire a member sends its slot to each of the G - 1 others (an all-gather),
plus the round's stream headers and control messages.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence

import torch

from shoal.transport.identity import PeerID
from shoal.verification.robust import capped_weights, norm_clip_scales

from .compression import CodecError
from .sparse_codec import SparseCodec

__all__ = ["MAX_WEIGHT", "SparseGather", "dense_bytes_per_peer", "gather_bytes_per_peer"]

# A member's claimed weight (samples) above this is refused (a float64 counts exactly up
# to 2**53).
MAX_WEIGHT = float(2**53)
_HEADER = struct.Struct("<d")  # the slot's weight
_SIGNATURE = 64
_CONTEXT = b"shoal/sparse-slot\x00"


def _signed(round_id: bytes, slot: int, weight_bytes: bytes, message: bytes) -> bytes:
    return b"".join((_CONTEXT, round_id, slot.to_bytes(4, "little"), weight_bytes, message))


class SparseGather:
    """Slots of messages of `codec` for vectors of `n` elements."""

    def __init__(self, codec: SparseCodec, n: int) -> None:
        self.codec = codec
        self.n = n
        self.message_bytes = codec.encoded_size(n)
        # A whole number of float32 words, so that slots never share a word.
        self._body = _HEADER.size + _SIGNATURE
        self.slot_words = -(-(self._body + self.message_bytes) // 4)

    def words(self, members: int) -> int:
        return members * self.slot_words

    def fill(
        self,
        buffer: torch.Tensor,
        round_id: bytes,
        slot: int,
        weight: float,
        message: bytes | None,
        sign: Callable[[bytes], bytes],
    ) -> None:
        """Zero `buffer` (float32, `words(G)` elements) and write our slot of round
        `round_id`: weight, signature and message. Weight 0 or no message: the slot
        stays empty."""
        if buffer.dtype != torch.float32 or buffer.dim() != 1 or buffer.numel() % self.slot_words:
            raise ValueError(f"buffer must be float32 slots of {self.slot_words} words")
        buffer.zero_()
        if message is None or not weight > 0:
            return
        if len(message) != self.message_bytes or not weight <= MAX_WEIGHT:
            raise ValueError("message of the wrong size, or weight out of range")
        weight_bytes = _HEADER.pack(float(weight))
        signature = sign(_signed(round_id, slot, weight_bytes, message))
        payload = weight_bytes + signature + message
        start = slot * self.slot_words * 4
        raw = buffer.view(torch.uint8)
        raw[start : start + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    def message_of(self, slot: bytes) -> bytes:
        """The message bytes of one slot's bytes (`slot_words` words)."""
        return slot[self._body : self._body + self.message_bytes]

    def buffer_with(self, members: int, index: int, slot: bytes) -> torch.Tensor:
        """The round vector its author sent: `slot` at `index`, zeros elsewhere."""
        if len(slot) != self.slot_words * 4 or not 0 <= index < members:
            raise ValueError("a slot of another size, or past the round's members")
        buffer = torch.zeros(self.words(members))
        start = index * self.slot_words * 4
        raw = buffer.view(torch.uint8)
        raw[start : start + len(slot)] = torch.frombuffer(bytearray(slot), dtype=torch.uint8)
        return buffer

    def mean_into(
        self,
        buffer: torch.Tensor,
        out: torch.Tensor,
        round_id: bytes,
        members: Sequence[PeerID],
        *,
        clip: bool = False,
        senders: bool = False,
    ) -> list[int]:
        """`out` = the weighted mean of the valid slots' messages (zero if none is);
        with `senders`, per coordinate, over the messages that sent it (SparseLoCo's
        mean: a coordinate one member sent is not divided by the others' weight);
        `members` are the round's, in group order (slot i is members[i]'s). With `clip`,
        each message is first scaled down to at most the lower median of the valid
        messages' norms (`norm_clip_scales`) and each weight capped at twice their
        median (`capped_weights`), so that no member moves the mean further than an
        honest one could, nor counts for more than two. Returns the slots skipped
        (forged, malformed; empty ones are not). The same bits on every member holding
        the same buffer."""
        raw = buffer.view(torch.uint8).numpy().tobytes()
        size = self.slot_words * 4
        if len(raw) != size * len(members):
            raise ValueError(f"{len(members)} members need {len(members)} slots")
        checked: list[tuple[float, object]] = []
        skipped: list[int] = []
        for i, member in enumerate(members):
            slot = raw[i * size : (i + 1) * size]
            if not any(slot):
                continue  # weight 0, or a member that had nothing to send
            weight_bytes, signature = slot[: _HEADER.size], slot[_HEADER.size : self._body]
            message = slot[self._body : self._body + self.message_bytes]
            (weight,) = _HEADER.unpack(weight_bytes)
            try:
                if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
                    raise CodecError(f"weight {weight!r}")
                if not member.verify(signature, _signed(round_id, i, weight_bytes, message)):
                    raise CodecError("not its author's signature")
                checked.append((weight, self.codec.check(message, self.n)))
            except CodecError:
                skipped.append(i)
        out.zero_()
        weights = [w for w, _ in checked]
        scales = [1.0] * len(checked)
        if clip:
            weights = capped_weights(weights)
            scales = norm_clip_scales([m.norm for _, m in checked])  # type: ignore[attr-defined]
        total = math.fsum(weights)
        shares = [weight / total for weight in weights]
        messages = [message for _, message in checked]
        if senders and checked:
            sums, sent = torch.zeros(self.n), torch.zeros(self.n)
            for share, message, scale in zip(shares, messages, scales, strict=True):
                self.codec.add_sent(message, sums, sent, share * scale, share)  # type: ignore[arg-type]
            self.codec.senders_mean_into(sums, sent, out)
            return skipped
        for share, message, scale in zip(shares, messages, scales, strict=True):
            self.codec.add_decoded(message, out, share * scale)  # type: ignore[arg-type]
        return skipped


def gather_bytes_per_peer(slot_bytes: int, members: int) -> int:
    """Bytes of data one member sends in a round of `members`: its slot to every
    other member (the reduce-scatter half moves nothing)."""
    return (members - 1) * slot_bytes


def dense_bytes_per_peer(encoded_bytes: int, members: int) -> int:
    """The same for a dense butterfly of `encoded_bytes` per member."""
    return 2 * (members - 1) * encoded_bytes // members
